"""The ``monitor`` module: records events, and POSTs each one to a webhook if configured.

``report_event`` stores a row in ``monitor_events`` (the task's Parameters as
payload). It is also the framework's default alarm hook: an alarm arrives with
Parameters such as ``{"Alarm": "rollback_failed", "Flow": ..., "Cursor": ...,
"Module": ..., "Command": ..., "Error": ...}`` and is recorded with kind "alarm"
(any other delivery is kind "event").

Each delivery is recorded once per idempotency key. The webhook is marked
delivered only after it answered 2xx, so a redelivery after a failed POST
posts again, while one after a successful POST does not.

Settings (environment): ``ASYNCFLOW_MONITOR_WEBHOOK_URL`` (unset: record only),
``ASYNCFLOW_MONITOR_DATABASE_URL`` (default: the framework's database).
``python -m modules.monitor [TASK_ID]`` prints the recorded events.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import JSON, Column, Float, Integer, MetaData, Row, String, Table, insert, select, update
from sqlalchemy.exc import IntegrityError

from modules import _db, _drill
from shared.config import Settings, load_settings
from shared.module import Module, StepContext

module = Module("monitor")

metadata = MetaData()

events_table = Table(
    "monitor_events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("idempotency_key", String(255), nullable=False, unique=True),
    Column("task_id", String(255), nullable=False, index=True),
    Column("flow", String(255), nullable=False),
    Column("kind", String(64), nullable=False),
    Column("cursor", Integer, nullable=False),
    Column("step_type", Integer, nullable=False),
    Column("payload", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    # NULL until the webhook accepted the event (or there is no webhook).
    Column("delivered_at", Float, nullable=True),
)


class MonitorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASYNCFLOW_MONITOR_", extra="ignore")

    database_url: str | None = None
    webhook_url: str | None = None
    webhook_timeout: float = 5.0


@dataclass(frozen=True)
class _Config:
    url: str
    webhook_url: str | None
    webhook_timeout: float


def _setup(settings: Settings) -> _Config:
    own = MonitorSettings()
    url = own.database_url or settings.resolved_database_url()
    _db.create_tables(url, metadata)
    return _Config(url, own.webhook_url or None, own.webhook_timeout)


_config = _db.PerSettings(_setup)


@module.on_startup
def start(settings: Settings) -> None:
    """Create the events table."""
    _config(settings)


@_drill.command(module, "report_event")
def report_event(ctx: StepContext) -> dict[str, Any]:
    cfg = _config(ctx.settings)
    event = _record(cfg.url, _event_row(ctx))
    if cfg.webhook_url and event.delivered_at is None:
        _post(cfg.webhook_url, cfg.webhook_timeout, _as_dict(event))
        with _db.writing(cfg.url) as conn:
            delivered = update(events_table).where(events_table.c.id == event.id).values(delivered_at=time.time())
            conn.execute(delivered)
    return {}


def _event_key(ctx: StepContext) -> str:
    """One event per step execution, whatever the attempt.

    A retry after a lost attempt (its worker died after recording the event)
    must not report the same event twice. Alarms carry their own key.
    """
    if ctx.key is not None:
        return ctx.key
    return f"{ctx.task_id}:{ctx.cursor}:{ctx.step_type}"


def _event_row(ctx: StepContext) -> dict[str, Any]:
    alarm = ctx.parameters.get("Alarm")
    return {
        "idempotency_key": _event_key(ctx),
        "task_id": ctx.task_id,
        "flow": ctx.flow,
        "kind": "alarm" if alarm else "event",
        "cursor": ctx.cursor,
        "step_type": ctx.step_type,
        "payload": dict(ctx.parameters),
        "created_at": time.time(),
    }


def _record(url: str, row: dict[str, Any]) -> Row[Any]:
    """The stored event for this key: inserted now, or by an earlier delivery."""
    try:
        with _db.writing(url) as conn:
            conn.execute(insert(events_table).values(row))
    except IntegrityError:
        pass  # an earlier delivery of the same attempt recorded it
    with _db.reading(url) as conn:
        stored = conn.execute(
            select(events_table).where(events_table.c.idempotency_key == row["idempotency_key"])
        ).first()
    if stored is None:
        raise RuntimeError(f"event {row['idempotency_key']!r} could not be recorded")
    return stored


def _post(url: str, timeout: float, event: dict[str, Any]) -> None:
    # The transport retries failed connections; an error answer raises, so the
    # step's own retry policy takes over.
    transport = httpx.HTTPTransport(retries=3)
    with httpx.Client(transport=transport, timeout=timeout) as client:
        client.post(url, json=event).raise_for_status()


def _as_dict(row: Row[Any]) -> dict[str, Any]:
    event = dict(row._mapping)
    event.pop("delivered_at", None)
    return event


def events(settings: Settings, task_id: str | None = None) -> list[dict[str, Any]]:
    """Recorded events, oldest first; only ``task_id``'s when given."""
    query = select(events_table).order_by(events_table.c.id)
    if task_id is not None:
        query = query.where(events_table.c.task_id == task_id)
    with _db.reading(_config(settings).url) as conn:
        return [dict(r._mapping) for r in conn.execute(query)]


def main() -> None:
    task_id = sys.argv[1] if len(sys.argv) > 1 else None
    for event in events(load_settings(), task_id):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event["created_at"]))
        where = f"{event['task_id']} step {event['cursor']}"
        print(f"{when}  {event['kind']:<6} {where}  {json.dumps(event['payload'])}")


if __name__ == "__main__":
    main()
