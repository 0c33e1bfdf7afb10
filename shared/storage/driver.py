"""PostgreSQL's hot statements run on psycopg's cursor, past SQLAlchemy's execution layer;
a transition on libpq's own call, past psycopg's cursor too (:meth:`DriverStatement.count`).

A step costs one read and one write, each a single statement. Per call,
SQLAlchemy's Connection, its transaction block, execution context and result
wrapping cost more CPU than psycopg's own execute (profile in benchmarks/README.md).
The statements are still built with SQLAlchemy Core and compiled once by the
engine's dialect, bind processors included: the SQL and the values sent are the
ones SQLAlchemy would send. Connections come from the engine's pool, so its
checkout checks (the idle ping) and fork handling apply as before.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
import select
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple, TypeVar, cast
from weakref import WeakKeyDictionary

import psycopg
from psycopg.abc import Transformer as AdaptTransformer
from psycopg.adapt import PyFormat, Transformer
from psycopg.pq import ConnStatus, ExecStatus, PipelineStatus
from psycopg.pq.abc import PGconn, PGresult
from psycopg.rows import dict_row
from sqlalchemy import Engine, event
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

from shared.storage.base import StorageUnavailable

Answered = TypeVar("Answered")

# A connection drops its prepared statements after this many executions of them,
# so that a plan made while a table was tiny is made again once it has grown.
PREPARED_RUNS = 200


class DriverStatement:
    """One statement compiled for the engine's dialect, and its parameters' conversions.

    ``prepared``: a statement whose plan does not depend on the tables' sizes (by
    primary key, a v1 claim in its index's order, or a batch's insert, which joins
    at most the small table of task types), prepared on each connection
    so that PostgreSQL may plan it once there instead of on every execution. No
    other statement is prepared (:func:`prepare_on_request`).

    ``binary``: its parameters sent in PostgreSQL's binary format, for arrays
    (:func:`shared.storage.statements.batch_rows`): as text, psycopg quotes and
    escapes each element of an array, a JSON document's every quote by a regular
    expression, which cost more than the insert.
    """

    def __init__(self, statement: ClauseElement, engine: Engine, prepared: bool = False, binary: bool = False) -> None:
        self.prepared = prepared
        dialect = engine.dialect
        compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
        # Bytes, and only the parameters the statement names: psycopg then reuses
        # its parse of the query (it caches none of a str, nor past 50 parameters).
        self.sql = compiled.string.encode()
        # For count(): the SQL with libpq's $1..., and the parameter names in that order.
        self._numbered_sql, self._order = _numbered(self.sql)
        if binary:
            self.sql = re.sub(rb"%\((\w+)\)s", rb"%(\1)b", self.sql)
        self._names: list[tuple[str, Callable[[Any], Any] | None]] = []
        # The statement's own literals (``status == 1``) became parameters with their value.
        self._fixed: dict[str, Any] = {}
        for bind, name in compiled.bind_names.items():  # each parameter under the name the SQL gives it
            convert = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if bind.required:
                self._names.append((name, convert))
            else:
                self._fixed[name] = bind.effective_value if convert is None else convert(bind.effective_value)

    def params(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The statement's parameters out of ``values``, converted as SQLAlchemy would."""
        named = {name: (values[name] if convert is None else convert(values[name])) for name, convert in self._names}
        return self._fixed | named if self._fixed else named

    def run(self, cursor: psycopg.Cursor[dict[str, Any]], values: Mapping[str, Any]) -> psycopg.Cursor[dict[str, Any]]:
        """Execute it on ``cursor``, with its parameters out of ``values``."""
        if not self.prepared:
            return cursor.execute(self.sql, self.params(values))
        conn = cursor.connection
        runs = _prepared_runs.get(conn, 0) + 1
        if runs > PREPARED_RUNS:
            _drop_prepared(cursor)
        else:
            _prepared_runs[conn] = runs
        try:
            return cursor.execute(self.sql, self.params(values), prepare=True)
        except psycopg.errors.FeatureNotSupported:
            # "cached plan must not change result type": a migration changed a column
            # the statement returns while this connection kept it prepared. Outside a
            # transaction nothing was written: drop them all and run it once more.
            if conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                raise
            _drop_prepared(cursor)
            return cursor.execute(self.sql, self.params(values), prepare=True)

    def count(self, cursor: psycopg.Cursor[dict[str, Any]], values: Mapping[str, Any]) -> int:
        """Run it, prepared, on libpq itself: the integer in its one row, 0 without a row.

        For a transition, whose answer is one number: psycopg's cursor costs about
        50 µs more CPU per execution than libpq's own call with the same parameters,
        dumped by psycopg's Transformer as the cursor dumps them (benchmarks/README.md,
        "A transition on libpq"). Errors are psycopg's, as the cursor raises them. In
        autocommit only: a refused statement then leaves no transaction behind.
        """
        conn = cursor.connection
        assert conn.autocommit, "count() runs in autocommit"
        own = _own_prepared_on(conn)
        pgconn = conn.pgconn
        with conn.lock:
            bound = self._bind(_dumper_of(cursor), values)
            own.counted(conn, 1)
            for last_try in (False, True):
                name = own.prepared(conn, bound)
                try:
                    executed = pgconn.exec_prepared(name, bound.dumped, bound.formats)
                    result = _answer(conn, executed, ExecStatus.TUPLES_OK)
                    break
                except psycopg.errors.InvalidSqlStatementName:
                    # Dropped behind our back: psycopg sends DEALLOCATE ALL of its own after it rolls
                    # back a transaction on a connection where it prepared statements (a batch
                    # insert that failed). Made again, at the cost of one refused execution.
                    if last_try:
                        raise
                    own.names.clear()
        return _number(result)

    def _bind(self, dump: AdaptTransformer, values: Mapping[str, Any]) -> _Bound:
        """Under the connection's lock: ``dump`` is its cursor's (:func:`_dumper_of`)."""
        params = self.params(values)
        dumped = dump.dump_sequence([params[name] for name in self._order], [PyFormat.AUTO] * len(self._order))
        # The types are part of the prepared statement: an integer may be dumped as int2 or int8.
        types = tuple(dump.types or ())
        return _Bound(self, types, cast(Sequence[bytes], dumped), dump.formats)


class _Bound(NamedTuple):
    """A statement's parameters, dumped for libpq, and what it is prepared under."""

    statement: DriverStatement
    types: tuple[int, ...]
    dumped: Sequence[bytes]
    formats: Any


def count_together(
    cursor: psycopg.Cursor[dict[str, Any]], runs: Sequence[tuple[DriverStatement, Mapping[str, Any]]]
) -> list[int]:
    """Run statements as :meth:`DriverStatement.count` does, all in one round trip and one transaction.

    libpq's pipeline mode: the statements are sent back to back, then a sync, and
    PostgreSQL runs what lies between two syncs as one implicit transaction, made
    durable by one WAL flush. A statement refused rolls them all back: its error
    is raised, as count() raises it, and nothing is written. In autocommit only,
    as count().
    """
    if len(runs) == 1:
        statement, values = runs[0]
        return [statement.count(cursor, values)]
    conn = cursor.connection
    assert conn.autocommit, "count_together() runs in autocommit"
    own = _own_prepared_on(conn)
    with conn.lock:
        dump = _dumper_of(cursor)
        bound = [statement._bind(dump, values) for statement, values in runs]
        own.counted(conn, len(bound))
        for last_try in (False, True):
            try:
                return [_number(result) for result in _pipelined(conn, own, bound)]
            except psycopg.errors.InvalidSqlStatementName:
                # Dropped behind our back, as count() finds: nothing was written; prepared again, once.
                if last_try:
                    raise
                own.names.clear()
    raise AssertionError("unreachable: the last try returns or raises")


def _pipelined(conn: psycopg.Connection[Any], own: _OwnPrepared, bound: list[_Bound]) -> list[PGresult]:
    """One pipeline of ``bound``'s executions and its sync: their results, or the first refusal raised."""
    pgconn = conn.pgconn
    names = [own.prepared(conn, b) for b in bound]  # prepared before: the pipeline holds executions only
    pgconn.enter_pipeline_mode()
    answered = False
    try:
        for name, b in zip(names, bound, strict=True):
            pgconn.send_query_prepared(name, b.dumped, b.formats)
        pgconn.pipeline_sync()
        results = []
        for _ in bound:
            results.append(_next_result(pgconn))
            while _next_result(pgconn) is not None:  # each statement's results end with a null
                pass
        synced = _next_result(pgconn)
        answered = True
    finally:
        if pgconn.status == ConnStatus.OK and pgconn.pipeline_status != PipelineStatus.OFF:
            try:
                pgconn.exit_pipeline_mode()
            except psycopg.OperationalError:
                if answered:  # otherwise it would hide what is being raised already
                    raise
    if synced is None or synced.status != ExecStatus.PIPELINE_SYNC or None in results:
        raise psycopg.OperationalError(pgconn.get_error_message() or "connection lost in a pipeline")
    for result in results:
        if result is not None and result.status != ExecStatus.PIPELINE_ABORTED:  # aborted: by the refusal before it
            _answer(conn, result, ExecStatus.TUPLES_OK)
    return cast(list[PGresult], results)


def _next_result(pgconn: PGconn) -> PGresult | None:
    """libpq's next result, waited for in select(), which lets the process's other threads run.

    psycopg's get_result() holds the interpreter's lock while it blocks: the whole
    process would stop for each commit (the pulse thread included).
    """
    while pgconn.is_busy():
        select.select([pgconn.socket], [], [])
        pgconn.consume_input()
    return pgconn.get_result()


def _number(result: PGresult) -> int:
    """The integer in a statement's one row, 0 without a row."""
    return int(result.get_value(0, 0) or 0) if result.ntuples else 0


def _dumper_of(cursor: psycopg.Cursor[Any]) -> AdaptTransformer:
    """psycopg's dumpers of ``cursor``'s connection, made once for the cursor (a kept one lives as long as its connection is kept).

    A Transformer made for each statement made each dumper again (a JSON one
    included), which cost twice the dumping itself; psycopg's own executemany keeps
    one for all its rows.
    """
    dump = _dumpers.get(cursor)
    if dump is None:
        dump = _dumpers[cursor] = Transformer(cursor.connection)
    return dump


def _own_prepared_on(conn: psycopg.Connection[Any]) -> _OwnPrepared:
    own = _own_prepared.get(conn)
    if own is None:
        own = _own_prepared[conn] = _OwnPrepared()
    return own


class _OwnPrepared:
    """The statements :meth:`DriverStatement.count` prepared on one connection, out of psycopg's sight.

    psycopg's record of the statements it prepared is not told of these: they are
    dropped here, by name, every PREPARED_RUNS of their executions and when the
    connection goes back to the pool, and forgotten when :func:`_drop_prepared`
    drops every statement of the connection.
    """

    def __init__(self) -> None:
        self.names: dict[tuple[DriverStatement, tuple[int, ...]], bytes] = {}
        self.made = itertools.count()
        self.runs = 0

    def counted(self, conn: psycopg.Connection[Any], executions: int) -> None:
        """``executions`` more are about to run: past PREPARED_RUNS, every statement is prepared afresh."""
        self.runs += executions
        if self.runs > PREPARED_RUNS:
            self.drop(conn)

    def prepared(self, conn: psycopg.Connection[Any], bound: _Bound) -> bytes:
        """The name ``bound``'s statement is prepared under on ``conn``, prepared now if need be."""
        key = (bound.statement, bound.types)
        name = self.names.get(key)
        if name is None:
            name = b"af_%d" % next(self.made)
            _answer(conn, conn.pgconn.prepare(name, bound.statement._numbered_sql, bound.types), ExecStatus.COMMAND_OK)
            self.names[key] = name  # only once it exists: a refused prepare leaves no name behind
        return name

    def drop(self, conn: psycopg.Connection[Any]) -> None:
        for name in self.names.values():
            try:
                _answer(conn, conn.pgconn.exec_(b"DEALLOCATE " + name), ExecStatus.COMMAND_OK)
            except psycopg.errors.InvalidSqlStatementName:
                pass  # gone already
        self.names.clear()
        self.runs = 1


def _numbered(sql: bytes) -> tuple[bytes, list[str]]:
    """``sql`` with ``%(name)s`` placeholders as libpq's ``$1``..., and the names in that order."""
    order: list[str] = []

    def number(match: re.Match[bytes]) -> bytes:
        name = match.group(1).decode()
        if name not in order:
            order.append(name)
        return b"$%d" % (order.index(name) + 1)

    return _PLACEHOLDER.sub(lambda m: b"%" if m.group(0) == b"%%" else number(m), sql), order


_PLACEHOLDER = re.compile(rb"%%|%\((\w+)\)s")


def _answer(conn: psycopg.Connection[Any], result: PGresult, expected: ExecStatus) -> PGresult:
    """``result`` if it has the status expected; otherwise the error psycopg's cursor would raise."""
    if result.status == expected:
        return result
    if conn.pgconn.status == ConnStatus.BAD:  # the connection is gone, not the statement refused
        raise psycopg.OperationalError(conn.pgconn.get_error_message() or "connection lost")
    raise psycopg.errors.error_from_result(result, conn.info.encoding)


def _drop_prepared(cursor: psycopg.Cursor[dict[str, Any]]) -> None:
    """Drop the connection's prepared statements; the statement run next is its first since."""
    cursor.execute(b"DEALLOCATE ALL")  # psycopg forgets its own record of them on seeing it
    _prepared_runs[cursor.connection] = 1
    own = _own_prepared.get(cursor.connection)
    if own is not None:
        own.names.clear()  # those of DriverStatement.count, of which psycopg knows nothing


# Executions of prepared statements on each connection since they were last dropped.
_prepared_runs: WeakKeyDictionary[psycopg.Connection[Any], int] = WeakKeyDictionary()
# The statements DriverStatement.count prepared on each connection.
_own_prepared: WeakKeyDictionary[psycopg.Connection[Any], _OwnPrepared] = WeakKeyDictionary()
# Each cursor's dumpers (_dumper_of). A Transformer refers to its connection: keyed by the
# cursor, which the connection does not refer to, it keeps no connection alive past it.
_dumpers: WeakKeyDictionary[psycopg.Cursor[Any], AdaptTransformer] = WeakKeyDictionary()


def prepare_on_request(engine: Engine) -> None:
    """Statements are prepared only where asked (:class:`DriverStatement`), and planned by PostgreSQL's rule.

    psycopg would prepare any statement run five times on a connection, and
    PostgreSQL may then keep one generic plan for it while the connection lives.
    Made while a table was tiny (a new deployment, a quiet night), that plan reads
    every row once the table has grown: after ANALYZE has seen af_tasks at one
    page, even a primary-key UPDATE's generic plan is a sequential scan
    (benchmarks/README.md). An unprepared statement is planned on each execution,
    with the tables' sizes of the moment. The hot statements by key are prepared
    and made again every ``PREPARED_RUNS``: planning was 30 % of PostgreSQL's CPU
    per flow, and preparing them cut that CPU by a quarter.
    """

    def on_request_only(dbapi_conn: Any, _record: Any) -> None:
        # Out of reach rather than None: None would refuse prepare=True as well.
        dbapi_conn.prepare_threshold = 1 << 30

    event.listen(engine, "connect", on_request_only)


def answers(dbapi_conn: Any) -> None:
    """Raise DisconnectionError unless the connection answers a round trip (a database
    restart closes connections that sat idle, and only the next use would find out)."""
    try:
        with dbapi_conn.cursor() as cursor:
            cursor.execute("SELECT 1")
        dbapi_conn.rollback()
    except Exception as exc:
        raise DisconnectionError(f"pooled connection is dead: {exc}") from exc


# How many connections an engine keeps checked out in autocommit between statements.
KEPT = 4


class Kept:
    """A connection kept out of the pool in autocommit, with its cursor and when it was last used."""

    __slots__ = ("pooled", "cursor", "used_at")

    def __init__(self, pooled: PoolProxiedConnection, cursor: psycopg.Cursor[dict[str, Any]]) -> None:
        self.pooled = pooled
        self.cursor = cursor
        self.used_at = time.monotonic()


class KeptConnections:
    """The few connections an engine keeps in autocommit between statements.

    Giving a connection back to SQLAlchemy's pool after each statement and taking
    it again (the checkout, the reset on return, autocommit set and unset, a new
    cursor) cost a worker more CPU per step than the statements' own execute
    (benchmarks/README.md). The last used comes first, so under a light load one
    connection serves. At most ``keep`` stay out; the others go back to the pool,
    which keeps the rest for SQLAlchemy's own transactions. One unused for ``idle``
    seconds is checked with a round trip before use, as the pool checks its own.
    """

    def __init__(self, engine: Engine, idle: float, keep: int = KEPT) -> None:
        self.engine = engine
        self.idle = idle
        self.keep = keep
        self._free: list[Kept] = []
        self._lock = threading.Lock()
        # A forked child must neither use nor give back its parent's connections:
        # their sockets are the parent's. They are held here, untouched, for good.
        self._inherited: list[Kept] = []
        os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))

    def take(self) -> Kept:
        with self._lock:
            kept = self._free.pop() if self._free else None
        if kept is not None and time.monotonic() - kept.used_at >= self.idle:
            try:
                answers(kept.pooled.driver_connection)
            except DisconnectionError as exc:
                self.discard(kept, exc)
                kept = None
        if kept is None:
            kept = self._checkout()
        return kept

    def _checkout(self) -> Kept:
        try:
            pooled = self.engine.raw_connection()
        except DBAPIError as exc:
            raise StorageUnavailable(f"database unavailable: {exc.orig or exc}") from exc
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:  # a new connection refused: unwrapped here
            raise StorageUnavailable(f"database unavailable: {exc}") from exc
        conn: psycopg.Connection[Any] = pooled.driver_connection  # type: ignore[assignment]
        try:
            conn.autocommit = True
            return Kept(pooled, conn.cursor(row_factory=dict_row))
        except psycopg.Error as exc:  # e.g. refusing autocommit on a closed connection
            pooled.invalidate(exc)
            pooled.close()
            raise StorageUnavailable(f"database connection lost: {exc}") from exc

    def give_back(self, kept: Kept) -> None:
        """Keep it for the next statement, or return it to the pool out of autocommit, as SQLAlchemy expects it."""
        kept.used_at = time.monotonic()
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(kept)
                return
        self._return(kept)

    def discard(self, kept: Kept, exc: BaseException | None = None) -> None:
        """Drop a broken connection. The others are pinged before their next use: what
        broke one (a database restart) has likely broken them too."""
        kept.pooled.invalidate(exc)
        kept.pooled.close()
        with self._lock:
            for other in self._free:
                other.used_at = -math.inf

    def release(self) -> None:
        """Return every kept connection to the pool, and keep none from now on (the store is closing)."""
        with self._lock:
            free, self._free, self.keep = self._free, [], 0
        for kept in free:
            self._return(kept)

    @staticmethod
    def _return(kept: Kept) -> None:
        conn: psycopg.Connection[Any] = kept.pooled.driver_connection  # type: ignore[assignment]
        try:
            kept.cursor.close()
            own = _own_prepared.pop(conn, None)
            if own is not None:
                # Dropped, not left to a rollback in the pool: psycopg's DEALLOCATE ALL there
                # would drop them unseen, and their next execution would be refused once.
                own.drop(conn)
            conn.autocommit = False
        except psycopg.Error as exc:
            kept.pooled.invalidate(exc)
        kept.pooled.close()


def _forked(ref: weakref.ReferenceType[KeptConnections]) -> None:
    kept = ref()
    if kept is not None:
        # Its lock may have been held by a thread of the parent, which the child does not have.
        kept._lock = threading.Lock()
        kept._inherited += kept._free
        kept._free = []


@contextmanager
def autocommit_cursor(kept_connections: KeptConnections) -> Iterator[psycopg.Cursor[dict[str, Any]]]:
    """A cursor on one of ``kept_connections``, in autocommit: each statement commits on its own.

    One that broke is discarded.
    """
    kept = kept_connections.take()
    conn = kept.cursor.connection
    try:
        yield kept.cursor
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        kept_connections.discard(kept, exc)
        raise StorageUnavailable(f"database unavailable: {exc}") from exc
    except BaseException as exc:
        # A statement error leaves no transaction open in autocommit; a broken
        # connection (or an interrupted call) is not given to the next caller.
        lost = conn.broken or conn.closed
        if lost or conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            kept_connections.discard(kept)
        else:
            kept_connections.give_back(kept)
        if lost and isinstance(exc, psycopg.Error):  # e.g. a statement sent on a closed connection
            raise StorageUnavailable(f"database connection lost: {exc}") from exc
        raise
    else:
        kept_connections.give_back(kept)


class Inserted(NamedTuple):
    """What a batch's insert did: the ids inserted, each with the columns the insert returned
    (a pull task's settings); the stored rows of the ids it skipped; and, where those could
    not be read, why."""

    new: dict[str, dict[str, Any]]
    found: list[dict[str, Any]]
    unread: StorageUnavailable | None = None


def insert_new(
    kept_connections: KeptConnections,
    insert: DriverStatement,
    read: DriverStatement,
    rows: Sequence[Mapping[str, Any]],
    each: bool,
    answer: Callable[[Inserted], Answered],
) -> Answered:
    """Run ``insert``, an INSERT … ON CONFLICT DO NOTHING RETURNING task_id of the batch's rows
    as arrays (:func:`shared.storage.statements.batch_rows`), on ``rows``; then ``read``, by
    ``b_task_id``, the rows of the ids it skipped (replays; or pull tasks of an unregistered
    type, which a batch of any size may hold), in one more round trip. Returns what
    ``answer`` makes of it.

    A batch answered all or none is one transaction, which ``answer`` rolls back by
    raising. One whose tasks are answered ``each`` for itself (concurrent single
    creates, coalesced by the API), or a batch of one, is one statement that commits
    on its own: no BEGIN and COMMIT, which would triple its round trips. Its read
    comes after that commit, so if it finds the database unavailable, that is the
    answer of the skipped rows alone: the inserted ones are stored.
    """
    if not rows:
        return answer(Inserted({}, []))
    arrays = {name: [row[name] for row in rows] for name in rows[0]}
    alone = each or len(rows) == 1
    with autocommit_cursor(kept_connections) as cursor, (nullcontext() if alone else cursor.connection.transaction()):
        new = {returned.pop("task_id"): returned for returned in insert.run(cursor, arrays).fetchall()}
        skipped = [{"b_task_id": row["task_id"]} for row in rows if row["task_id"] not in new]
        if not skipped or not alone:
            return answer(Inserted(new, _each_row(cursor, read, skipped) if skipped else []))
    try:
        with autocommit_cursor(kept_connections) as cursor:
            found = _each_row(cursor, read, skipped)
    except StorageUnavailable as exc:
        return answer(Inserted(new, [], exc))
    return answer(Inserted(new, found))


def _each_row(
    cursor: psycopg.Cursor[dict[str, Any]], statement: DriverStatement, values: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The rows ``statement`` returns for each of ``values``, run in a pipeline."""
    cursor.executemany(statement.sql, [statement.params(v) for v in values], returning=True)
    rows = []
    while True:
        rows.extend(cursor.fetchall())
        if not cursor.nextset():
            return rows
