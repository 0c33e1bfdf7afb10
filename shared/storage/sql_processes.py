"""The process registry in SQL (af_processes); shares the SQL store's engine.

Rows are few (one per process, kept a day after it goes) and each is written by
its own process only, so a register is an upsert and a renewal a plain update.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.sql.dml import Insert

from shared.storage.base import ProcessRecord, ProcessStore
from shared.storage.schema import processes
from shared.storage.sql import SqlStore

_REPLACED = ("role", "host", "pid", "detail", "metrics", "started_at", "seen_at", "stopped_at")


def _row(record: ProcessRecord) -> dict[str, Any]:
    return {
        "process_id": record.process_id,
        "role": record.role,
        "host": record.host,
        "pid": record.pid,
        "detail": dict(record.detail),
        "metrics": [dict(m) for m in record.metrics],
        "started_at": record.started_at,
        "seen_at": record.seen_at,
        "stopped_at": record.stopped_at,
    }


def _record(row: Any) -> ProcessRecord:
    return ProcessRecord(
        process_id=row.process_id,
        role=row.role,
        host=row.host,
        pid=int(row.pid),
        started_at=float(row.started_at),
        seen_at=float(row.seen_at),
        detail=row.detail or {},
        metrics=list(row.metrics or []),
        stopped_at=float(row.stopped_at) if row.stopped_at is not None else None,
    )


class SqlProcessStore(ProcessStore):
    def __init__(self, sql: SqlStore) -> None:
        self.sql = sql

    def register(self, record: ProcessRecord) -> None:
        with self.sql.transaction() as conn:
            conn.execute(self._upsert(_row(record)))

    def _upsert(self, row: dict[str, Any]) -> Insert:
        dialect = self.sql.engine.dialect.name
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as postgres_insert

            pg = postgres_insert(processes).values(**row)
            return pg.on_conflict_do_update(
                index_elements=[processes.c.process_id], set_={k: pg.excluded[k] for k in _REPLACED}
            )
        if dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            lite = sqlite_insert(processes).values(**row)
            return lite.on_conflict_do_update(
                index_elements=[processes.c.process_id], set_={k: lite.excluded[k] for k in _REPLACED}
            )
        if dialect in ("mysql", "mariadb"):
            from sqlalchemy.dialects.mysql import insert as mysql_insert

            my = mysql_insert(processes).values(**row)
            return my.on_duplicate_key_update({k: my.inserted[k] for k in _REPLACED})
        return insert(processes).values(**row)  # elsewhere a reused process id is refused

    def renew(
        self, process_id: str, seen_at: float, detail: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]]
    ) -> bool:
        statement = (
            update(processes)
            .where(processes.c.process_id == process_id)
            .values(seen_at=seen_at, detail=dict(detail), metrics=[dict(m) for m in metrics])
        )
        with self.sql.transaction() as conn:
            return bool(conn.execute(statement).rowcount == 1)

    def stop(self, process_id: str, at: float) -> None:
        statement = update(processes).where(processes.c.process_id == process_id).values(seen_at=at, stopped_at=at)
        with self.sql.transaction() as conn:
            conn.execute(statement)

    def list(self, seen_since: float | None = None) -> builtins.list[ProcessRecord]:
        query = select(processes).order_by(processes.c.process_id)
        if seen_since is not None:
            query = query.where(processes.c.seen_at >= seen_since)
        with self.sql.transaction(read_only=True) as conn:
            return [_record(r) for r in conn.execute(query)]

    def purge(self, before: float) -> int:
        with self.sql.transaction() as conn:
            return int(conn.execute(delete(processes).where(processes.c.seen_at < before)).rowcount)
