"""The ``resource`` module: a quota ledger for Cpu, Memory and Storage.

``resource_quota`` holds each resource's total and how much is in use;
``resource_ledger`` records every reservation (the id of the task that made
it) once as 'deduct' and at most once as 'restore', so a duplicate delivery
never moves the balance twice. The commands read the Parameters Cpu, Memory and
Storage (positive integers).

Settings (environment): ``ASYNCFLOW_RESOURCE_QUOTA`` ("Cpu=64,Memory=256,Storage=10000";
only rows not yet in the table are seeded) and ``ASYNCFLOW_RESOURCE_DATABASE_URL``
(default: the framework's database).

``python -m modules.resource`` prints the quota and the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import (
    CheckConstraint,
    Column,
    Connection,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    delete,
    insert,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from modules import _db, _drill
from shared.config import Settings, load_settings
from shared.module import Module, PermanentError, StepContext

module = Module("resource")

RESOURCES = ("Cpu", "Memory", "Storage")
_LEDGER_COLUMN = {"Cpu": "cpu", "Memory": "memory", "Storage": "storage"}

metadata = MetaData()

quota_table = Table(
    "resource_quota",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("total", Integer, nullable=False),
    Column("used", Integer, nullable=False, default=0),
    # The last line of defence against an overdraw, whatever the code above does.
    CheckConstraint("used >= 0 AND used <= total", name="resource_quota_used_in_range"),
)

ledger_table = Table(
    "resource_ledger",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("reservation", String(255), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("cpu", Integer, nullable=False),
    Column("memory", Integer, nullable=False),
    Column("storage", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    UniqueConstraint("reservation", "kind", name="resource_ledger_once_per_kind"),
)


def parse_quota(text: str) -> dict[str, int]:
    """``"Cpu=64,Memory=256"`` → ``{"Cpu": 64, "Memory": 256}``; raises ValueError."""
    limits: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in RESOURCES:
            names = ", ".join(RESOURCES)
            raise ValueError(f"quota entry {item!r}: expected NAME=INTEGER with NAME one of {names}")
        try:
            limits[name] = int(value)
        except ValueError:
            raise ValueError(f"quota entry {item!r}: {value.strip()!r} is not an integer") from None
        if limits[name] < 0:
            raise ValueError(f"quota entry {item!r}: a total cannot be negative")
    return limits


class ResourceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ASYNCFLOW_RESOURCE_", extra="ignore")

    database_url: str | None = None
    quota: str = "Cpu=64,Memory=256,Storage=10000"

    @field_validator("quota")
    @classmethod
    def _quota_parses(cls, value: str) -> str:
        parse_quota(value)
        return value


@dataclass(frozen=True)
class _Config:
    url: str


def _setup(settings: Settings) -> _Config:
    own = ResourceSettings()
    url = own.database_url or settings.resolved_database_url()
    limits = parse_quota(own.quota)
    _db.create_tables(url, metadata, then=lambda conn: _seed(conn, limits))
    return _Config(url)


_config = _db.PerSettings(_setup)


@module.on_startup
def start(settings: Settings) -> None:
    """Create the tables and seed missing quota rows."""
    _config(settings)


def _seed(conn: Connection, limits: Mapping[str, int]) -> None:
    present = set(conn.scalars(select(quota_table.c.name)))
    for name, total in limits.items():
        if name not in present:
            conn.execute(insert(quota_table).values(name=name, total=total, used=0))


def _requested(parameters: Mapping[str, Any]) -> dict[str, int]:
    amounts: dict[str, int] = {}
    for name in RESOURCES:
        if name not in parameters:
            raise PermanentError(f"parameter {name} is missing (a positive integer is required)")
        value = parameters[name]
        # bool is an int subclass; True is not a quantity.
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise PermanentError(f"parameter {name} must be a positive integer, got {value!r}")
        amounts[name] = value
    return amounts


def _shortages(conn: Connection, amounts: Mapping[str, int]) -> list[str]:
    rows = {r.name: r for r in conn.execute(select(quota_table).where(quota_table.c.name.in_(list(amounts))))}
    problems = []
    for name, wanted in amounts.items():
        row = rows.get(name)
        if row is None:
            problems.append(f"no quota configured for {name}")
        elif row.total - row.used < wanted:
            problems.append(f"insufficient {name}: requested {wanted}, free {row.total - row.used}")
    return problems


@_drill.command(module, "check_resource")
def check_resource(ctx: StepContext) -> dict[str, Any]:
    amounts = _requested(ctx.parameters)
    with _db.reading(_config(ctx.settings).url) as conn:
        problems = _shortages(conn, amounts)
    if problems:
        raise PermanentError("; ".join(problems))
    return {"ResourceChecked": True}


@_drill.command(module, "deduct_resource")
def deduct_resource(ctx: StepContext) -> dict[str, Any]:
    amounts = _requested(ctx.parameters)
    url = _config(ctx.settings).url
    try:
        with _db.writing(url) as conn:
            _deduct(conn, ctx.task_id, amounts)
    except IntegrityError:
        # Another delivery of this attempt recorded the deduction first; anything
        # else (a broken CHECK) must not pass for success.
        if not _is_open(url, ctx.task_id):
            raise
    return {"ReservationId": ctx.task_id}


def _deduct(conn: Connection, reservation: str, amounts: Mapping[str, int]) -> None:
    kinds = _kinds(conn, reservation)
    if "deduct" in kinds and "restore" not in kinds:
        return
    if "restore" in kinds:
        # An operator retried a compensated task: the old cycle is closed, take the quota again.
        conn.execute(delete(ledger_table).where(ledger_table.c.reservation == reservation))
    conn.execute(insert(ledger_table).values(_ledger_row(reservation, "deduct", amounts)))
    for name, wanted in amounts.items():
        taken = conn.execute(
            update(quota_table)
            .where(quota_table.c.name == name, quota_table.c.total - quota_table.c.used >= wanted)
            .values(used=quota_table.c.used + wanted)
        ).rowcount
        if taken != 1:
            # Raising inside the transaction undoes the ledger row and earlier updates.
            raise PermanentError("; ".join(_shortages(conn, {name: wanted})) or f"cannot deduct {name}")


@_drill.command(module, "restore_resource")
def restore_resource(ctx: StepContext) -> dict[str, Any]:
    """Rollback of deduct_resource: gives back what the ledger says this task took."""
    _restore(_config(ctx.settings).url, ctx.task_id)
    return {}


@_drill.command(module, "release_reservation")
def release_reservation(ctx: StepContext) -> dict[str, Any]:
    """Gives back the reservation named by Parameters["ReservationId"] (deprovisioning)."""
    reservation = ctx.parameters.get("ReservationId")
    if not isinstance(reservation, str) or not reservation:
        raise PermanentError(f"parameter ReservationId must be a non-empty string, got {reservation!r}")
    _restore(_config(ctx.settings).url, reservation)
    return {"ReleasedReservation": reservation}


def _restore(url: str, reservation: str) -> None:
    try:
        with _db.writing(url) as conn:
            _give_back(conn, reservation)
    except IntegrityError:
        if not _is_restored(url, reservation):
            raise


def _give_back(conn: Connection, reservation: str) -> None:
    kinds = _kinds(conn, reservation)
    deducted = kinds.get("deduct")
    if deducted is None or "restore" in kinds:
        return
    # Insert first: a concurrent restore of the same reservation then fails on
    # the unique key instead of subtracting a second time.
    conn.execute(insert(ledger_table).values(_ledger_row(reservation, "restore", deducted)))
    for name, amount in deducted.items():
        conn.execute(
            update(quota_table).where(quota_table.c.name == name).values(used=quota_table.c.used - amount)
        )


def _kinds(conn: Connection, reservation: str) -> dict[str, dict[str, int]]:
    rows = conn.execute(select(ledger_table).where(ledger_table.c.reservation == reservation))
    return {r.kind: {name: getattr(r, col) for name, col in _LEDGER_COLUMN.items()} for r in rows}


def _is_open(url: str, reservation: str) -> bool:
    with _db.reading(url) as conn:
        kinds = _kinds(conn, reservation)
    return "deduct" in kinds and "restore" not in kinds


def _is_restored(url: str, reservation: str) -> bool:
    with _db.reading(url) as conn:
        return "restore" in _kinds(conn, reservation)


def _ledger_row(reservation: str, kind: str, amounts: Mapping[str, int]) -> dict[str, Any]:
    row: dict[str, Any] = {"reservation": reservation, "kind": kind, "created_at": time.time()}
    for name, col in _LEDGER_COLUMN.items():
        row[col] = amounts.get(name, 0)
    return row


def quota(settings: Settings) -> dict[str, dict[str, int]]:
    """Each resource's total, used and free amounts."""
    with _db.reading(_config(settings).url) as conn:
        rows = conn.execute(select(quota_table).order_by(quota_table.c.name)).all()
    return {r.name: {"total": r.total, "used": r.used, "free": r.total - r.used} for r in rows}


def ledger(settings: Settings, limit: int = 50) -> list[dict[str, Any]]:
    """The newest ledger entries first."""
    query = select(ledger_table).order_by(ledger_table.c.id.desc()).limit(limit)
    with _db.reading(_config(settings).url) as conn:
        return [dict(r._mapping) for r in conn.execute(query)]


def main() -> None:
    settings = load_settings()
    print(f"{'resource':<10}{'total':>10}{'used':>10}{'free':>10}")
    for name, row in quota(settings).items():
        print(f"{name:<10}{row['total']:>10}{row['used']:>10}{row['free']:>10}")
    entries = ledger(settings)
    if entries:
        print(f"\n{'when':<20}{'kind':<9}{'cpu':>6}{'memory':>8}{'storage':>9}  reservation")
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["created_at"]))
        print(f"{when:<20}{e['kind']:<9}{e['cpu']:>6}{e['memory']:>8}{e['storage']:>9}  {e['reservation']}")


if __name__ == "__main__":
    main()
