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

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

from shared.storage.base import StorageUnavailable


class DriverStatement:
    """One statement compiled for the engine's dialect, and its parameters' conversions."""

    def __init__(self, statement: ClauseElement, engine: Engine) -> None:
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
