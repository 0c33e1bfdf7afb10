"""Database plumbing shared by the example modules: one engine per URL and process.

On SQLite several worker processes write the same file: engines come from
:func:`shared.sqlite.sqlite_engine`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Generic, TypeVar

from sqlalchemy import Connection, Engine, MetaData, create_engine, make_url, text

from shared.config import Settings
from shared.sqlite import read_only_options, sqlite_engine

# Any constant works; it only has to be the same in every process that creates tables.
_DDL_LOCK_KEY = 0x41_46_4D_4F_44  # "AFMOD"

_engines: dict[str, Engine] = {}
_owner_pid: int | None = None

T = TypeVar("T")


def engine(url: str) -> Engine:
    """The engine for ``url`` in this process (a forked child gets fresh ones)."""
    _forget_inherited_engines()
    found = _engines.get(url)
    if found is None:
        # Two threads racing here build two engines; the loser never connected.
        found = _engines.setdefault(url, _create(url))
    return found


def dispose_engines() -> None:
    """Close every cached connection (tests, and processes about to exit)."""
    for eng in _engines.values():
        eng.dispose()
    _engines.clear()


@contextmanager
def writing(url: str) -> Iterator[Connection]:
    """One write transaction: commits on success, rolls back on any exception."""
    with engine(url).begin() as conn:
        yield conn


@contextmanager
def reading(url: str) -> Iterator[Connection]:
    """A read transaction; on SQLite it does not take the write lock."""
    with engine(url).connect() as conn:
        conn.execution_options(**read_only_options())
        with conn.begin():
            yield conn


@contextmanager
def admin_connection(url: str) -> Iterator[Connection]:
    """An autocommit connection, for DDL that cannot run in a transaction (CREATE DATABASE)."""
    with engine(url).connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        yield conn


def create_tables(url: str, metadata: MetaData, then: Callable[[Connection], None] | None = None) -> None:
    """Create missing tables, then run ``then`` in the same transaction.

    Workers of one module start together on a fresh database; on PostgreSQL two
    concurrent CREATE TABLEs of the same name fail, so they queue on a lock.
    """
    _ensure_sqlite_directory(url)
    with writing(url) as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _DDL_LOCK_KEY})
        metadata.create_all(conn)
        if then is not None:
            then(conn)


class PerSettings(Generic[T]):
    """What a module's start-up built, remembered for the Settings it was built from.

    Handlers receive the settings in their context; the worker passes the same
    object it started the module with, so this is a lookup. A different object
    (a test, another app in the process) runs the set-up again, which is idempotent.
    """

    def __init__(self, build: Callable[[Settings], T]) -> None:
        self._build = build
        self._last: tuple[Settings, T] | None = None

    def __call__(self, settings: Settings) -> T:
        last = self._last
        if last is not None and last[0] is settings:
            return last[1]
        value = self._build(settings)
        self._last = (settings, value)
        return value


def _forget_inherited_engines() -> None:
    global _owner_pid
    pid = os.getpid()
    if _owner_pid == pid:
        return
    for eng in _engines.values():
        # close=False: the sockets belong to the parent, which keeps using them.
        eng.dispose(close=False)
    _engines.clear()
    _owner_pid = pid


def _create(url: str) -> Engine:
    if make_url(url).get_backend_name() == "sqlite":
        return sqlite_engine(url)
    return create_engine(url, pool_pre_ping=True)


def _ensure_sqlite_directory(url: str) -> None:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
