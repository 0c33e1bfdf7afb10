"""In-memory stores for unit tests of the engine and of user modules.

They keep the contract of the SQL stores (tests/integration/test_store_contract.py
and test_pull_store_contract.py run on both), so tests written against them hold
on a real database.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from shared.pull.rules import PullStatus, PullTask, TaskType, leased, type_settings
from shared.records import evolve
from shared.schedules.model import Run, Schedule
from shared.schedules.timetable import wake_at
from shared.states import Phase, TaskStatus
from shared.storage.base import (
    CREATED_VERSION,
    AttemptRecord,
    Created,
    Firing,
    Lease,
    NotLeader,
    Outstanding,
    ProcessRecord,
    ProcessStore,
    PullStore,
    ScheduleStore,
    StatusCounts,
    Stored,
    TaskConflict,
    TaskEvent,
    TaskFilter,
    TaskPage,
    TaskQuery,
    TaskStore,
    TypeSummary,
    batch_created,
    matches_parameter,
    same_pull_request,
    same_request,
)
from shared.task import Task


def _insert_new(
    table: dict[str, Created],
    batch: Sequence[Created],
    same: Callable[[Created, Created], bool],
    each: bool,
    filled: Callable[[Created], Mapping[str, Any] | None] = lambda task: {},
) -> builtins.list[Stored[Created]]:
    """create_many of the fakes: all of ``batch`` or, if one is refused, none (or, with ``each``, the others).

    ``filled``: the columns the store fills in for a new task, None when it cannot be created.
    """
    found = [table[task.task_id] for task in batch if task.task_id in table]
    inserted = {}
    for task in batch:
        if task.task_id not in table and (columns := filled(task)) is not None:
            inserted[task.task_id] = columns
    answer = batch_created(batch, inserted, found, same, each)
    for one in answer:
        if isinstance(one, tuple) and one[1]:
            table[one[0].task_id] = one[0]
    return answer


class InMemoryStore(TaskStore):
    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}
        self._attempts: dict[tuple[str, int], AttemptRecord] = {}
        self._events: dict[str, builtins.list[TaskEvent]] = {}
        self._lock = threading.Lock()

    def create(self, task: Task, now: float) -> tuple[Task, bool]:
        with self._lock:
            stored = self._tasks.get(task.task_id)
            if stored is not None:
                if not same_request(stored, task):
                    raise TaskConflict(f"task id {task.task_id!r} is already used")
                return stored, False
            self._tasks[task.task_id] = evolve(task, version=CREATED_VERSION)
            return self._tasks[task.task_id], True

    def create_many(self, batch: Sequence[Task], now: float, each: bool = False) -> builtins.list[Stored[Task]]:
        with self._lock:
            return _insert_new(self._tasks, batch, same_request, each)

    def get(self, task_id: str) -> Task | None:
        return self._tasks.get(task_id)

    def save(
        self,
        task: Task,
        now: float,
        attempt: AttemptRecord | None = None,
        event: TaskEvent | None = None,
        next_attempt: AttemptRecord | None = None,
    ) -> bool:
        with self._lock:
            stored = self._tasks.get(task.task_id)
            if stored is None or (stored.version, stored.created_at) != (task.version, task.created_at):
                return False
            self._tasks[task.task_id] = evolve(task, version=task.version + 1)
            if event is not None:
                self._events.setdefault(event.task_id, []).append(event)
            for record in (attempt, next_attempt):
                if record is not None:
                    self._write_attempt(record)
            return True

    def _write_attempt(self, attempt: AttemptRecord) -> None:
        key = (attempt.task_id, attempt.seq)
        previous = self._attempts.get(key)
        if previous is not None and attempt.write == "outcome":
            attempt = evolve(
                previous, ended_at=attempt.ended_at, outcome=attempt.outcome,
                error=attempt.error, result=attempt.result,
            )
        elif previous is not None and attempt.write == "heartbeat":
            attempt = evolve(previous, heartbeat_at=attempt.heartbeat_at, progress=attempt.progress)
        if previous is not None or attempt.write == "insert":
            self._attempts[key] = attempt

    def list(self, where: TaskFilter) -> list[Task]:
        found = [
            t
            for t in self._tasks.values()
            if (where.flow is None or t.flow == where.flow)
            and (where.status is None or t.status == where.status)
            and (where.user_id is None or t.user_id == where.user_id)
        ]
        found.sort(key=lambda t: t.created_at, reverse=True)
        return found[: where.limit]

    def attempts(self, task_id: str) -> builtins.list[AttemptRecord]:
        return sorted(
            (a for (tid, _), a in self._attempts.items() if tid == task_id), key=lambda a: a.seq
        )

    def events(self, task_id: str) -> builtins.list[TaskEvent]:
        return list(self._events.get(task_id, ()))

    def due(
        self, now: float, limit: int, kind: Outstanding, flow: str | None = None
    ) -> builtins.list[tuple[str, int, Phase]]:
        ready = sorted(
            (t.active.due_at, t.task_id, t.active.seq, t.active.phase)
            for t in list(self._tasks.values())
            if t.active is not None and t.active.due_at is not None and t.active.due_at <= now
            and kind.holds(t.active.phase, t.active.seq) and (flow is None or t.flow == flow)
        )
        return [(task_id, seq, phase) for _, task_id, seq, phase in ready[:limit]]

    def waiting_flows(self) -> builtins.list[str]:
        oldest: dict[str, float] = {}
        for t in list(self._tasks.values()):
            if t.active is not None and t.active.due_at is not None and Outstanding.FIRST.holds(t.active.phase, t.active.seq):
                oldest[t.flow] = min(oldest.get(t.flow, t.active.due_at), t.active.due_at)
        return sorted(oldest, key=lambda flow: (oldest[flow], flow))

    def ping(self) -> None:
        return None

    def forget(self, task_id: str) -> None:
        """Drop an ended task, its attempts and its history (retention)."""
        with self._lock:
            task = self._tasks.get(task_id)
            if task is not None and task.status.is_terminal:
                del self._tasks[task_id]
                self._events.pop(task_id, None)
                for key in [k for k in self._attempts if k[0] == task_id]:
                    del self._attempts[key]

    # --- reads for browsing (the dashboard): the SQL stores' results, without their bounds' cost

    def page(self, query: TaskQuery) -> TaskPage:
        q = query
        newest = sorted(self._tasks.values(), key=lambda t: (t.created_at, t.task_id), reverse=True)
        reach = [
            t
            for t in newest
            if (q.indexed != "user_id" or t.user_id == q.user_id)
            and (q.indexed != "flow" or t.flow == q.flow)
            and (q.indexed != "status" or t.status == q.status)
            and (q.created_from is None or t.created_at >= q.created_from)
            and (q.created_until is None or t.created_at < q.created_until)
            and (q.after is None or (t.created_at, t.task_id) < q.after)
        ]
        window = reach[: q.scan] if q.residual else reach
        found = [
            t
            for t in window
            if (q.flow is None or t.flow == q.flow)
            and (q.status is None or t.status == q.status)
            and (q.parameter is None or matches_parameter(t.parameters, q.parameter))
        ][: q.limit]
        if len(found) == q.limit:
            return TaskPage(found, (found[-1].created_at, found[-1].task_id))
        if q.residual and len(reach) >= q.scan:
            last = reach[q.scan - 1]
            return TaskPage(found, (last.created_at, last.task_id), partial=True)
        return TaskPage(found, None)

    def count_by_status(
        self, user_id: str | None = None, flow: str | None = None, cap: int = 10_000, window: int = 50_000
    ) -> StatusCounts:
        counts: dict[TaskStatus, int] = {}
        if user_id is None and flow is None:
            for t in list(self._tasks.values()):
                counts[t.status] = min(counts.get(t.status, 0) + 1, cap + 1)
            return StatusCounts(counts, cap, None)
        newest = sorted(
            (
                t
                for t in list(self._tasks.values())
                if (user_id is None or t.user_id == user_id) and (flow is None or t.flow == flow)
            ),
            key=lambda t: t.created_at,
            reverse=True,
        )[:window]
        for t in newest:
            counts[t.status] = counts.get(t.status, 0) + 1
        return StatusCounts(counts, None, window)

    def attempts_of(self, task_ids: Iterable[str]) -> dict[str, builtins.list[AttemptRecord]]:
        found: dict[str, builtins.list[AttemptRecord]] = {}
        for task_id in sorted(set(task_ids)):
            if records := self.attempts(task_id):
                found[task_id] = records
        return found

    def flow_attempts(self, flow: str, since: float, newest: int) -> builtins.list[AttemptRecord]:
        chosen = sorted(
            (t for t in list(self._tasks.values()) if t.flow == flow and t.created_at >= since),
            key=lambda t: t.created_at,
            reverse=True,
        )[:newest]
        return [a for t in chosen for a in self.attempts(t.task_id)]


class InMemoryPullStore(PullStore):
    def __init__(self) -> None:
        self._types: dict[str, TaskType] = {}
        self._tasks: dict[str, PullTask] = {}
        self._lock = threading.Lock()

    def save_type(self, config: TaskType, now: float) -> TaskType:
        with self._lock:
            self._types[config.task_type] = config
        return config

    def get_type(self, task_type: str) -> TaskType | None:
        return self._types.get(task_type)

    def types(self) -> list[TaskType]:
        return [self._types[name] for name in sorted(self._types)]

    def create_many(self, batch: Sequence[PullTask], each: bool = False) -> builtins.list[Stored[PullTask]]:
        with self._lock:
            return _insert_new(self._tasks, batch, same_pull_request, each, self._settings_of)

    def _settings_of(self, task: PullTask) -> dict[str, int] | None:
        config = self._types.get(task.task_type)
        return type_settings(config) if config is not None else None

    def create(self, task: PullTask) -> tuple[PullTask, bool] | None:
        with self._lock:
            config = self._types.get(task.task_type)
            if config is None:
                return None
            stored = self._tasks.get(task.task_id)
            if stored is not None:
                if (stored.task_type, stored.user_id) != (task.task_type, task.user_id):
                    raise TaskConflict(f"task id {task.task_id!r} is already used")
                return stored, False
            task = evolve(task, version=1, **type_settings(config))
            self._tasks[task.task_id] = task
            return task, True

    def forget(self, task_id: str) -> None:
        """Drop an ended task (retention)."""
        with self._lock:
            task = self._tasks.get(task_id)
            if task is not None and task.status in (PullStatus.SUCCESS, PullStatus.FAILED):
                del self._tasks[task_id]

    def enqueue(self, task: PullTask) -> None:
        with self._lock:
            stored = self._tasks.get(task.task_id)
            if stored is None:
                self._tasks[task.task_id] = evolve(task, version=1)
            elif stored.status is not PullStatus.PENDING:
                self._tasks[task.task_id] = evolve(
                    task, create_time=stored.create_time, version=stored.version + 1
                )

    def get(self, task_id: str) -> PullTask | None:
        return self._tasks.get(task_id)

    def list(
        self,
        task_type: str | None,
        status: int | None,
        stage: str | None,
        limit: int,
        user_id: str | None = None,
    ) -> list[PullTask]:
        found = [
            t
            for t in list(self._tasks.values())
            if (task_type is None or t.task_type == task_type)
            and (status is None or t.status == status)
            and (stage is None or t.task_stage == stage)
            and (user_id is None or t.user_id == user_id)
        ]
        found.sort(key=lambda t: t.create_time, reverse=True)
        return found[:limit]

    def count(self, task_type: str) -> dict[int, int]:
        counts: dict[int, int] = {}
        for t in list(self._tasks.values()):
            if t.task_type == task_type:
                counts[int(t.status)] = counts.get(int(t.status), 0) + 1
        return counts

    def hold(
        self, task_type: str, limit: int | None, now: float, heartbeat_timeout: float | None = None
    ) -> builtins.list[PullTask]:
        with self._lock:
            if limit is None:
                config = self._types.get(task_type)
                limit = config.schedule_limit if config is not None else 0
            ready = sorted(
                (
                    t
                    for t in self._tasks.values()
                    if t.task_type == task_type and t.status is PullStatus.PENDING and t.order_time <= now
                ),
                key=lambda t: t.order_time,
            )[:limit]
            held = [evolve(leased(t, now, heartbeat_timeout), version=t.version + 1) for t in ready]
            self._tasks.update((t.task_id, t) for t in held)
            return held

    def save(self, task: PullTask) -> bool:
        with self._lock:
            stored = self._tasks.get(task.task_id)
            if stored is None or stored.version != task.version:
                return False
            self._tasks[task.task_id] = evolve(task, version=task.version + 1)
            return True

    def due(self, now: float, limit: int) -> builtins.list[PullTask]:
        ends = sorted(
            (end, t.task_id, t) for t in list(self._tasks.values()) if (end := t.lease_until) is not None
        )
        return [t for end, _, t in ends if end <= now][:limit]

    def summary(self, task_type: str, window: int = 50_000) -> TypeSummary:
        of_type = [t for t in list(self._tasks.values()) if t.task_type == task_type]
        by_stage: dict[tuple[str, int], int] = {}
        for t in sorted(of_type, key=lambda t: t.create_time, reverse=True)[:window]:
            key = (t.task_stage, int(t.status))
            by_stage[key] = by_stage.get(key, 0) + 1
        running = [t.modify_time for t in of_type if t.status is PullStatus.RUNNING]
        return TypeSummary(by_stage, window, len(running), min(running) if running else None)


class InMemoryScheduleStore(ScheduleStore):
    """Schedules beside in-memory task stores; one lock stands in for the transaction."""

    def __init__(self, tasks: InMemoryStore, pull: InMemoryPullStore) -> None:
        self._tasks = tasks
        self._pull = pull
        self._schedules: dict[str, Schedule] = {}
        self._changed_at: dict[str, float] = {}
        self._runs: dict[tuple[str, float], Run] = {}
        self._leases: dict[str, Lease] = {}
        self._lock = threading.RLock()

    def add(self, schedule: Schedule) -> tuple[Schedule, bool]:
        with self._lock:
            stored = self._schedules.get(schedule.schedule_id)
            if stored is not None:
                return stored, False
            stored = evolve(schedule, version=1)
            self._schedules[schedule.schedule_id] = stored
            self._changed_at[schedule.schedule_id] = schedule.updated_at
            return stored, True

    def get(self, schedule_id: str) -> Schedule | None:
        return self._schedules.get(schedule_id)

    def list(self, limit: int, after: str | None = None, user_id: str | None = None) -> builtins.list[Schedule]:
        ids = sorted(
            i
            for i, s in self._schedules.items()
            if (after is None or i > after) and (user_id is None or s.target.user_id == user_id)
        )
        return [self._schedules[i] for i in ids[:limit]]

    def save(self, schedule: Schedule, changed: bool = True) -> bool:
        with self._lock:
            stored = self._schedules.get(schedule.schedule_id)
            if stored is None or stored.version != schedule.version:
                return False
            self._schedules[schedule.schedule_id] = evolve(schedule, version=schedule.version + 1)
            if changed:
                self._changed_at[schedule.schedule_id] = schedule.updated_at
            return True

    def delete(self, schedule_id: str) -> bool:
        with self._lock:
            if self._schedules.pop(schedule_id, None) is None:
                return False
            for key in [k for k in self._runs if k[0] == schedule_id]:
                del self._runs[key]
            return True

    def due(self, until: float, limit: int, after: tuple[float, str] | None = None) -> builtins.list[Schedule]:
        ready = sorted(
            (at, s.schedule_id)
            for s in self._schedules.values()
            if (at := wake_at(s)) is not None and at <= until and (after is None or (at, s.schedule_id) > after)
        )
        return [self._schedules[i] for _, i in ready[:limit]]

    def changed_since(self, since: float, limit: int) -> builtins.list[Schedule]:
        ids = sorted(i for i, at in self._changed_at.items() if at >= since and i in self._schedules)
        return [self._schedules[i] for i in ids[:limit]]

    def fire(self, firings: Iterable[Firing], lease: Lease | None, now: float) -> builtins.list[bool]:
        with self._lock:
            held = self._leases.get(lease.name) if lease is not None else None
            if lease is not None and (held != lease or lease.expires_at <= now):
                raise NotLeader(f"lease {lease.name!r} epoch {lease.epoch} is no longer held")
            return [self._fire(f, now) for f in firings]

    def _fire(self, firing: Firing, now: float) -> bool:
        if not self.save(firing.schedule, changed=False):
            return False
        for run in firing.runs:
            self._runs[(run.schedule_id, run.scheduled_at)] = run
        for task in firing.tasks:
            self._tasks.create(task, now)
        for pull_task in firing.pull_tasks:
            self._pull.create(pull_task)
        return True

    def runs(self, schedule_id: str, limit: int, before: float | None = None) -> builtins.list[Run]:
        found = sorted(
            (r for (sid, at), r in self._runs.items() if sid == schedule_id and (before is None or at < before)),
            key=lambda r: r.scheduled_at,
            reverse=True,
        )
        return found[:limit]

    def origins(self, task_ids: Iterable[str]) -> dict[str, Run]:
        wanted = set(task_ids)
        return {r.task_id: r for r in self._runs.values() if r.task_id is not None and r.task_id in wanted}

    def run_times(self, schedule_id: str, start: float, end: float) -> set[float]:
        return {at for sid, at in self._runs if sid == schedule_id and start <= at <= end}

    def task_status(self, task_ids: Iterable[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for task_id in task_ids:
            if (task := self._tasks.get(task_id)) is not None:
                found[task_id] = task.status.label
            elif (pull_task := self._pull.get(task_id)) is not None:
                found[task_id] = pull_task.status.name.lower()
        return found

    def acquire(self, name: str, owner: str, ttl: float, now: float) -> Lease | None:
        with self._lock:
            held = self._leases.get(name)
            if held is not None and held.expires_at > now and held.owner != owner:
                return None
            if held is not None and held.owner == owner and held.expires_at > now:
                lease = evolve(held, expires_at=now + ttl)
            else:
                lease = Lease(name, owner, (held.epoch if held else 0) + 1, now + ttl)
            self._leases[name] = lease
            return lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            if self._leases.get(lease.name) == lease:
                self._leases[lease.name] = evolve(lease, expires_at=0.0)

    def purge(self, before: float, limit: int, tasks: bool) -> int:
        with self._lock:
            old = sorted((at, sid) for sid, at in self._runs if at < before)[:limit]
            for at, sid in old:
                run = self._runs.pop((sid, at))
                if tasks and run.task_id is not None:
                    self._tasks.forget(run.task_id)
                    self._pull.forget(run.task_id)
            return len(old)


class InMemoryProcessStore(ProcessStore):
    def __init__(self) -> None:
        self._rows: dict[str, ProcessRecord] = {}
        self._lock = threading.Lock()

    def register(self, record: ProcessRecord) -> None:
        with self._lock:
            self._rows[record.process_id] = record

    def renew(
        self, process_id: str, seen_at: float, detail: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]]
    ) -> bool:
        with self._lock:
            row = self._rows.get(process_id)
            if row is None:
                return False
            self._rows[process_id] = evolve(row, seen_at=seen_at, detail=dict(detail), metrics=list(metrics))
            return True

    def stop(self, process_id: str, at: float) -> None:
        with self._lock:
            row = self._rows.get(process_id)
            if row is not None:
                self._rows[process_id] = evolve(row, seen_at=at, stopped_at=at)

    def list(self, seen_since: float | None = None) -> builtins.list[ProcessRecord]:
        with self._lock:
            rows = sorted(self._rows.values(), key=lambda r: r.process_id)
        return [r for r in rows if seen_since is None or r.seen_at >= seen_since]

    def purge(self, before: float) -> int:
        with self._lock:
            old = [pid for pid, r in self._rows.items() if r.seen_at < before]
            for pid in old:
                del self._rows[pid]
            return len(old)
