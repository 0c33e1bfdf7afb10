"""PostgreSQL's hot statements run on psycopg's cursor, past SQLAlchemy's execution layer.

A step costs one read and one write, each a single statement. Per call,
SQLAlchemy's Connection, its transaction block, execution context and result
wrapping cost more CPU than psycopg's own execute (profile in benchmarks/README.md).
The statements are still built with SQLAlchemy Core and compiled once by the
engine's dialect, bind processors included: the SQL and the values sent are the
ones SQLAlchemy would send. Connections come from the engine's pool, so its
checkout checks (the idle ping) and fork handling apply as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, cast
from weakref import WeakKeyDictionary

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Engine, event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

from shared.storage.base import StorageUnavailable

# A connection drops its prepared statements after this many executions of them,
# so that a plan made while a table was tiny is made again once it has grown.
PREPARED_RUNS = 200


class DriverStatement:
    """One statement compiled for the engine's dialect, and its parameters' conversions.

    ``prepared``: a statement whose plan does not depend on the tables' sizes (by
    primary key), prepared on each connection so that PostgreSQL may plan it once
    there instead of on every execution. No other statement is prepared
    (:func:`prepare_on_request`).
    """

    def __init__(self, statement: ClauseElement, engine: Engine, prepared: bool = False) -> None:
        self.prepared = prepared
        dialect = engine.dialect
        compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
        # Bytes, and only the parameters the statement names: psycopg then reuses
        # its parse of the query (it caches none of a str, nor past 50 parameters).
        self.sql = compiled.string.encode()
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
            cursor.execute(b"DEALLOCATE ALL")  # psycopg forgets its own record of them on seeing it
            runs = 1
        _prepared_runs[conn] = runs
        return cursor.execute(self.sql, self.params(values), prepare=True)


# Executions of prepared statements on each connection since they were last dropped.
_prepared_runs: WeakKeyDictionary[psycopg.Connection[Any], int] = WeakKeyDictionary()


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


@contextmanager
def autocommit_cursor(engine: Engine) -> Iterator[psycopg.Cursor[dict[str, Any]]]:
    """A cursor on a pooled connection in autocommit: each statement commits on its own.

    The connection goes back to the pool out of autocommit, as SQLAlchemy expects
    it; one that broke is discarded instead.
    """
    try:
        pooled = engine.raw_connection()
    except DBAPIError as exc:
        raise StorageUnavailable(f"database unavailable: {exc.orig or exc}") from exc
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:  # a new connection refused: unwrapped here
        raise StorageUnavailable(f"database unavailable: {exc}") from exc
    conn: psycopg.Connection[Any] = pooled.driver_connection  # type: ignore[assignment]
    try:
        conn.autocommit = True
        with conn.cursor(row_factory=dict_row) as cursor:
            yield cursor
        conn.autocommit = False
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        pooled.invalidate(exc)
        raise StorageUnavailable(f"database unavailable: {exc}") from exc
    except BaseException as exc:
        # A statement error leaves no transaction open in autocommit; a broken
        # connection (or an interrupted call) is not given to the next caller.
        lost = conn.broken or conn.closed
        if lost or conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            pooled.invalidate()
        else:
            conn.autocommit = False
        if lost and isinstance(exc, psycopg.Error):  # e.g. refusing autocommit on a closed connection
            raise StorageUnavailable(f"database connection lost: {exc}") from exc
        raise
    finally:
        pooled.close()


def by_id(row: Mapping[str, Any]) -> str:
    """The order a batch's rows are inserted in: two batches that share ids then wait
    for each other's commit instead of deadlocking (concurrent replays of one request)."""
    return str(row["task_id"])


def batch_transaction(cursor: psycopg.Cursor[dict[str, Any]], rows: Sequence[object]) -> AbstractContextManager[Any]:
    """One transaction around the statements of a batch of ``rows``.

    A batch of one is a lone statement, atomic on its own: BEGIN and COMMIT would
    triple its round trips, and concurrent single creates come here one at a time
    whenever the API is not busy (oss_api.coalesce).
    """
    return cursor.connection.transaction() if len(rows) > 1 else nullcontext()


def insert_new(
    cursor: psycopg.Cursor[dict[str, Any]],
    insert: DriverStatement,
    read: DriverStatement,
    rows: Sequence[Mapping[str, Any]],
) -> tuple[set[str], list[dict[str, Any]]]:
    """Run ``insert``, one row's INSERT … ON CONFLICT DO NOTHING RETURNING task_id, for each of ``rows``.

    In a pipeline: the statement is parsed once and the rows go in one round trip.
    Returns the ids inserted, and the stored rows of the others, ``read`` by
    ``b_task_id`` one by one (replays: rare).
    """
    cursor.executemany(insert.sql, [insert.params(row) for row in rows], returning=True)
    inserted: set[str] = set()
    while True:
        inserted.update(row["task_id"] for row in cursor.fetchall())
        if not cursor.nextset():
            break
    found = []
    for row in rows:
        if row["task_id"] not in inserted:
            stored = cursor.execute(read.sql, read.params({"b_task_id": row["task_id"]})).fetchone()
            found.extend([stored] if stored is not None else [])
    return inserted, found
