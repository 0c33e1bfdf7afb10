"""SQLite engines for files that several processes write at once.

WAL lets readers run beside a writer, and a busy timeout makes writers queue
instead of failing. With ``immediate_writes`` (the default) SQLAlchemy's begin
issues ``BEGIN IMMEDIATE``: a deferred transaction that later writes fails at
once with "database is locked" instead of waiting. Connections marked with
``read_only_options()`` begin deferred and take no write lock.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event

READ_ONLY = "asyncflow_read_only"


def read_only_options() -> dict[str, bool]:
    return {READ_ONLY: True}


def sqlite_engine(url: str, immediate_writes: bool = True) -> Engine:
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        if immediate_writes:
            # Let the begin event below issue BEGIN; pysqlite would defer it.
            dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    if immediate_writes:

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            read_only = conn.get_execution_options().get(READ_ONLY, False)
            conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine
