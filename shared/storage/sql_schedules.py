"""Storage of schedules, their runs and the leader lease; shares the SQL store's engine.

A firing is one transaction: the schedule's compare-and-set, its run records and
the tasks they create. The key of af_schedule_runs, (schedule, scheduled time),
makes the database refuse a second record of the same firing whoever attempts it.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

from sqlalchemy import Connection, and_, bindparam, delete, insert, select, tuple_, update
from sqlalchemy.exc import IntegrityError

from shared.pull.rules import PullStatus
from shared.records import evolve
from shared.schedules.model import Overlap, Policy, Run, RunState, Schedule, Target, When
from shared.schedules.timetable import wake_at
from shared.states import TERMINAL, TaskStatus
from shared.storage.base import CREATED_VERSION, Firing, Lease, NotLeader, ScheduleStore
from shared.storage.codec import task_to_row
from shared.storage.schema import (
    attempts,
    leases,
    pull_tasks,
    schedule_runs,
    schedules,
    task_events,
    task_types,
    tasks,
)
from shared.storage.sql import SqlStore
from shared.storage.sql_pull import CREATE_PULL_TASKS, create_row
from shared.storage.statements import CREATE_TASK

# The leader's state, written by every firing; the definition only by users.
_STATE = ("cursor", "next_at", "running", "buffered", "fire_at", "paused", "note")

_SAVE_STATE = (
    update(schedules)
    .where(schedules.c.schedule_id == bindparam("b_id"), schedules.c.version == bindparam("b_version"))
    .values({name: bindparam(name, type_=schedules.c[name].type) for name in (*_STATE, "version")})
)
_PROMOTE = (
    update(schedule_runs)
    .where(
        schedule_runs.c.schedule_id == bindparam("b_id"),
        schedule_runs.c.scheduled_at == bindparam("b_at"),
    )
    .values(state=bindparam("state"), fired_at=bindparam("fired_at"), task_id=bindparam("task_id"))
)
_ENDED_PULL = (int(PullStatus.SUCCESS), int(PullStatus.FAILED))


def _definition(s: Schedule) -> dict[str, Any]:
    return {"target": asdict(s.target), "when": asdict(s.when), "policy": asdict(s.policy)}


def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """Fields ``cls`` has; keys written by another release are ignored."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def _row(s: Schedule) -> dict[str, Any]:
    return {
        "schedule_id": s.schedule_id,
        "definition": _definition(s),
        "user_id": s.target.user_id,
        "created_at": s.created_at,
        "changed_at": s.updated_at,
        "version": s.version,
        **_state(s),
    }


def _state(s: Schedule) -> dict[str, Any]:
    return {
        "cursor": s.cursor,
        "next_at": s.next_at,
        "running": s.running,
        "buffered": list(s.buffered),
        "fire_at": wake_at(s),
        "paused": s.paused,
        "note": s.note,
    }


def _schedule(row: Any) -> Schedule:
    d = row.definition
    policy = _known(Policy, d.get("policy", {}))
    if "overlap" in policy:
        policy["overlap"] = Overlap(policy["overlap"])
    return Schedule(
        schedule_id=row.schedule_id,
        target=Target(**_known(Target, d.get("target", {}))),
        when=When(**_known(When, d.get("when", {}))),
        policy=Policy(**policy),
        paused=row.paused,
        note=row.note,
        created_at=row.created_at,
        updated_at=row.changed_at,
        cursor=row.cursor,
        next_at=row.next_at,
        running=row.running,
        buffered=tuple(row.buffered),
        version=row.version,
    )


def _run(row: Any) -> Run:
    return Run(
        schedule_id=row.schedule_id,
        scheduled_at=row.scheduled_at,
        state=RunState(row.state),
        fired_at=row.fired_at,
        task_id=row.task_id,
        reason=row.reason,
    )


def _run_row(run: Run) -> dict[str, Any]:
    return {
        "schedule_id": run.schedule_id,
        "scheduled_at": run.scheduled_at,
        "state": run.state.value,
        "fired_at": run.fired_at,
        "task_id": run.task_id,
        "reason": run.reason,
    }


class SqlScheduleStore(ScheduleStore):
    def __init__(self, sql: SqlStore) -> None:
        self.sql = sql

    def add(self, schedule: Schedule) -> tuple[Schedule, bool]:
        stored = evolve(schedule, version=1)
        try:
            with self.sql.transaction() as conn:
                conn.execute(insert(schedules).values(**_row(stored)))
            return stored, True
        except IntegrityError:
            found = self.get(schedule.schedule_id)
            if found is None:  # deleted in between: try once more
                return self.add(schedule)
            return found, False

    def add_many(self, new: Iterable[Schedule], batch: int = 5000) -> int:
        """Insert many new schedules (a bulk import); an existing id fails the whole call."""
        rows = [_row(evolve(s, version=1)) for s in new]
        with self.sql.transaction() as conn:
            for start in range(0, len(rows), batch):
                conn.execute(insert(schedules), rows[start : start + batch])
        return len(rows)

    def get(self, schedule_id: str) -> Schedule | None:
        with self.sql.transaction(read_only=True) as conn:
            row = conn.execute(select(schedules).where(schedules.c.schedule_id == schedule_id)).first()
        return _schedule(row) if row is not None else None

    def list(self, limit: int, after: str | None = None, user_id: str | None = None) -> builtins.list[Schedule]:
        query = select(schedules).order_by(schedules.c.schedule_id).limit(limit)
        if after is not None:
            query = query.where(schedules.c.schedule_id > after)
        if user_id is not None:
            query = query.where(schedules.c.user_id == user_id)
        with self.sql.transaction(read_only=True) as conn:
            return [_schedule(r) for r in conn.execute(query)]

    def save(self, schedule: Schedule, changed: bool = True) -> bool:
        values = _row(evolve(schedule, version=schedule.version + 1))
        del values["schedule_id"], values["created_at"]
        if not changed:
            del values["changed_at"], values["definition"]
        query = (
            update(schedules)
            .where(schedules.c.schedule_id == schedule.schedule_id, schedules.c.version == schedule.version)
            .values(**values)
        )
        with self.sql.transaction() as conn:
            return bool(conn.execute(query).rowcount == 1)

    def delete(self, schedule_id: str) -> bool:
        with self.sql.transaction() as conn:
            conn.execute(delete(schedule_runs).where(schedule_runs.c.schedule_id == schedule_id))
            return bool(conn.execute(delete(schedules).where(schedules.c.schedule_id == schedule_id)).rowcount)

    def due(self, until: float, limit: int, after: tuple[float, str] | None = None) -> builtins.list[Schedule]:
        # fire_at is NULL while paused or finished: the range scan touches only what is due.
        key = (schedules.c.fire_at, schedules.c.schedule_id)
        query = select(schedules).where(schedules.c.fire_at <= until).order_by(*key).limit(limit)
        if after is not None:
            query = query.where(schedules.c.fire_at >= after[0], tuple_(*key) > tuple_(*after))
        with self.sql.transaction(read_only=True) as conn:
            return [_schedule(r) for r in conn.execute(query)]

    def changed_since(self, since: float, limit: int) -> builtins.list[Schedule]:
        query = (
            select(schedules).where(schedules.c.changed_at >= since).order_by(schedules.c.changed_at).limit(limit)
        )
        with self.sql.transaction(read_only=True) as conn:
            return [_schedule(r) for r in conn.execute(query)]

    # --- firing ---------------------------------------------------------------------------

    def fire(self, firings: Iterable[Firing], lease: Lease | None, now: float) -> builtins.list[bool]:
        batch = list(firings)
        if not batch:
            return []
        with self.sql.transaction() as conn:
            self._fence(conn, lease, now)
            # The common case, one leader: every compare-and-set holds, and the batch is
            # written with one statement per table.
            if conn.execute(_SAVE_STATE, [_cas(f.schedule) for f in batch]).rowcount == len(batch):
                self._write(conn, batch, now)
                return [True] * len(batch)
            conn.rollback()
        # Someone else changed one of them (a user, a deposed leader): one by one.
        done = []
        for firing in batch:
            with self.sql.transaction() as conn:
                self._fence(conn, lease, now)
                applied = conn.execute(_SAVE_STATE, _cas(firing.schedule)).rowcount == 1
                if applied:
                    self._write(conn, [firing], now)
            done.append(applied)
        return done

    def _fence(self, conn: Connection, lease: Lease | None, now: float) -> None:
        if lease is None:
            return
        held = conn.execute(
            select(leases.c.epoch).where(
                leases.c.name == lease.name,
                leases.c.owner == lease.owner,
                leases.c.epoch == lease.epoch,
                leases.c.expires_at > now,
            )
        ).first()
        if held is None:
            raise NotLeader(f"lease {lease.name!r} epoch {lease.epoch} is no longer held by {lease.owner}")

    def _write(self, conn: Connection, batch: Sequence[Firing], now: float) -> None:
        new_runs, promoted = [], []
        for firing in batch:
            for run in firing.runs:
                if run.scheduled_at in firing.promoted:
                    promoted.append(_run_row(run) | {"b_id": run.schedule_id, "b_at": run.scheduled_at})
                else:
                    new_runs.append(_run_row(run))
        if new_runs:
            conn.execute(insert(schedule_runs), new_runs)
        if promoted:
            conn.execute(_PROMOTE, promoted)
        flow_tasks = [task_to_row(t, now) | {"version": CREATED_VERSION} for f in batch for t in f.tasks]
        if flow_tasks:
            conn.execute(CREATE_TASK, flow_tasks)
        pulled = [create_row(t) for f in batch for t in f.pull_tasks]
        if pulled:
            wanted = {row["task_type"] for row in pulled}
            known = set(conn.execute(select(task_types.c.task_type).where(task_types.c.task_type.in_(wanted))).scalars())
            if wanted - known:
                raise ValueError(f"task type(s) {sorted(wanted - known)} are not registered")
            conn.execute(CREATE_PULL_TASKS, pulled)

    # --- reads ----------------------------------------------------------------------------

    def runs(self, schedule_id: str, limit: int, before: float | None = None) -> builtins.list[Run]:
        query = (
            select(schedule_runs)
            .where(schedule_runs.c.schedule_id == schedule_id)
            .order_by(schedule_runs.c.scheduled_at.desc())
            .limit(limit)
        )
        if before is not None:
            query = query.where(schedule_runs.c.scheduled_at < before)
        with self.sql.transaction(read_only=True) as conn:
            return [_run(r) for r in conn.execute(query)]

    def origins(self, task_ids: Iterable[str]) -> dict[str, Run]:
        ids = list(set(task_ids))
        if not ids:
            return {}
        query = select(schedule_runs).where(schedule_runs.c.task_id.in_(ids))
        with self.sql.transaction(read_only=True) as conn:
            return {r.task_id: _run(r) for r in conn.execute(query)}

    def run_times(self, schedule_id: str, start: float, end: float) -> set[float]:
        query = select(schedule_runs.c.scheduled_at).where(
            schedule_runs.c.schedule_id == schedule_id,
            schedule_runs.c.scheduled_at >= start,
            schedule_runs.c.scheduled_at <= end,
        )
        with self.sql.transaction(read_only=True) as conn:
            return set(conn.execute(query).scalars())

    def task_status(self, task_ids: Iterable[str]) -> dict[str, str]:
        ids = list(set(task_ids))
        if not ids:
            return {}
        with self.sql.transaction(read_only=True) as conn:
            flows = conn.execute(select(tasks.c.task_id, tasks.c.status).where(tasks.c.task_id.in_(ids)))
            found = {r.task_id: TaskStatus(r.status).label for r in flows}
            rest = [i for i in ids if i not in found]
            if rest:
                pulled = conn.execute(
                    select(pull_tasks.c.task_id, pull_tasks.c.status).where(pull_tasks.c.task_id.in_(rest))
                )
                found.update({r.task_id: PullStatus(r.status).name.lower() for r in pulled})
        return found

    # --- leadership -----------------------------------------------------------------------

    def acquire(self, name: str, owner: str, ttl: float, now: float) -> Lease | None:
        expires = now + ttl
        mine = and_(leases.c.name == name, leases.c.owner == owner, leases.c.expires_at > now)
        renew = update(leases).where(mine).values(expires_at=expires).returning(leases.c.epoch)
        take = (
            update(leases)
            .where(leases.c.name == name, leases.c.expires_at <= now)
            .values(owner=owner, epoch=leases.c.epoch + 1, expires_at=expires)
            .returning(leases.c.epoch)
        )
        try:
            with self.sql.transaction() as conn:
                epoch = conn.execute(renew).scalar() or conn.execute(take).scalar()
                if epoch is None:
                    if conn.execute(select(leases.c.name).where(leases.c.name == name)).first() is not None:
                        return None  # another scheduler holds it
                    conn.execute(insert(leases).values(name=name, owner=owner, epoch=1, expires_at=expires))
                    epoch = 1
        except IntegrityError:
            return None  # another scheduler inserted it first
        return Lease(name, owner, int(epoch), expires)

    def release(self, lease: Lease) -> None:
        with self.sql.transaction() as conn:
            conn.execute(
                update(leases)
                .where(leases.c.name == lease.name, leases.c.owner == lease.owner, leases.c.epoch == lease.epoch)
                .values(expires_at=0.0)
            )

    # --- retention ------------------------------------------------------------------------

    def purge(self, before: float, limit: int, tasks: bool) -> int:
        with self.sql.transaction() as conn:
            old = conn.execute(
                select(schedule_runs.c.schedule_id, schedule_runs.c.scheduled_at, schedule_runs.c.task_id)
                .where(schedule_runs.c.scheduled_at < before)
                .order_by(schedule_runs.c.scheduled_at)
                .limit(limit)
            ).all()
            if not old:
                return 0
            keys = [(r.schedule_id, r.scheduled_at) for r in old]
            conn.execute(
                delete(schedule_runs).where(tuple_(schedule_runs.c.schedule_id, schedule_runs.c.scheduled_at).in_(keys))
            )
            task_ids = [r.task_id for r in old if r.task_id is not None]
            if tasks and task_ids:
                _delete_ended_tasks(conn, task_ids)
        return len(old)


def _delete_ended_tasks(conn: Connection, task_ids: builtins.list[str]) -> None:
    ended = [int(s) for s in TERMINAL]
    ended_flows = select(tasks.c.task_id).where(tasks.c.task_id.in_(task_ids), tasks.c.status.in_(ended))
    conn.execute(delete(attempts).where(attempts.c.task_id.in_(ended_flows)))
    conn.execute(delete(task_events).where(task_events.c.task_id.in_(ended_flows)))
    conn.execute(delete(tasks).where(tasks.c.task_id.in_(task_ids), tasks.c.status.in_(ended)))
    conn.execute(
        delete(pull_tasks).where(pull_tasks.c.task_id.in_(task_ids), pull_tasks.c.status.in_(_ENDED_PULL))
    )


def _cas(s: Schedule) -> dict[str, Any]:
    return _state(s) | {"b_id": s.schedule_id, "b_version": s.version, "version": s.version + 1}
