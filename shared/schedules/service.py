"""The schedule service: definitions in, firings out, every change a compare-and-set.

Users' changes (add, modify, pause, resume, delete, trigger, backfill) and the
leader's firings go through here; which firings are due is decided by
:mod:`shared.schedules.plan`, and a firing's run records and tasks are written in
one transaction by the store before the first step of a flow task is published.
"""

from __future__ import annotations

import builtins
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from shared import metrics
from shared.parameters import InvalidParameters
from shared.pull.rules import PullTask, TaskType, new_pull_task
from shared.pull.service import PullService
from shared.records import evolve
from shared.saga import Cancel, Decision, InvalidAction
from shared.schedules.definition import Definition, Problem, definition_of
from shared.schedules.model import TASK_ID_PREFIX, Overlap, Run, RunState, Schedule
from shared.schedules.plan import Plan, Running, plan_backfill, plan_due, plan_trigger
from shared.schedules.timing import initial_cursor, times_after, times_between
from shared.service import ServiceError, TaskService
from shared.storage.base import Firing, Lease, ScheduleStore
from shared.transition import compare_and_set

log = logging.getLogger(__name__)

MAX_BACKFILL = 10_000
_FAILED = frozenset({"failed", "cancelled", "rollback_failed"})


class ScheduleNotFound(ServiceError):
    status_code = 404


class ScheduleConflict(ServiceError):
    status_code = 409


class InvalidSchedule(ServiceError):
    """A definition that cannot be stored; ``detail`` names each wrong field."""

    status_code = 422
    detail: list[dict[str, str]]

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("invalid schedule: " + "; ".join(f"{f}: {p}" for f, p in problems))
        self.detail = [{"field": f, "problem": p} for f, p in problems]


@dataclass(frozen=True)
class RunView:
    run: Run
    status: str  # the created task's status, or the run's state when it created none


def _what(s: Schedule) -> tuple[object, ...]:
    """What a definition says, apart from the state users change later (pause, note)."""
    return (s.target, s.when, s.policy)


def _resumed(s: Schedule, now: float) -> Schedule:
    """``s``, just unpaused, going on from ``now``: no making up for the firings of the pause."""
    cursor = max(s.cursor if s.cursor is not None else now, now)
    if s.when.run_at is not None:
        cursor = min(cursor, initial_cursor(s.when, now))
    following = times_after(s.when, cursor, 1)
    return evolve(s, cursor=cursor, next_at=following[0] if following else None, updated_at=now)


def _watches_its_task(s: Schedule) -> bool:
    """Whether what became of its latest task changes anything (it does unless all may run at once)."""
    policy = s.policy
    return s.running is not None and (policy.overlap is not Overlap.ALLOW_ALL or policy.pause_on_failure or bool(s.buffered))


def running_of(schedule: Schedule, statuses: Mapping[str, str]) -> Running:
    """What became of the task of the schedule's latest firing, from its status label."""
    if schedule.running is None or schedule.running not in statuses:
        return Running.NONE
    label = statuses[schedule.running]
    if label == "success":
        return Running.SUCCEEDED
    return Running.FAILED if label in _FAILED else Running.ALIVE


class ScheduleService:
    def __init__(
        self,
        store: ScheduleStore,
        tasks: TaskService,
        pull: PullService,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.tasks = tasks
        self.pull = pull
        self.clock = clock

    # --- definitions -----------------------------------------------------------------

    def add(self, definition: Definition) -> tuple[Schedule, bool]:
        """Store a new schedule; a replayed id with the same definition returns the stored one."""
        schedule_id = definition.schedule_id or uuid.uuid4().hex[:20]
        definition = definition.model_copy(update={"schedule_id": schedule_id})
        now = self.clock()
        stored = self.store.get(schedule_id) if definition.schedule_id else None
        if stored is None:
            stored, created = self.store.add(self._checked(definition, schedule_id, now))
            if created:
                log.info("schedule added", extra={"schedule_id": schedule_id})
                return stored, True
        # A replay: the same definition, though its run_at may be long past by now.
        if _what(self._checked(definition, schedule_id, now, new_run_at=False)) != _what(stored):
            raise ScheduleConflict(f"schedule {schedule_id!r} exists with another definition")
        return stored, False

    def declare(self, declared: Mapping[str, Definition]) -> None:
        """Apply flows.yaml's schedules: add the new ones, update those whose definition changed.

        Schedules not declared (added through the API or the CLI, or removed from the
        file) are left alone. Raises :class:`InvalidSchedule` naming the schedule.
        """
        for schedule_id, definition in declared.items():
            stored = self.store.get(schedule_id)
            try:
                if stored is None:
                    self.add(definition)
                elif _what(self._checked(definition, schedule_id, self.clock(), new_run_at=False)) != _what(stored):
                    self.modify(schedule_id, definition.model_dump(exclude={"schedule_id", "paused", "note"}))
                    log.info("schedule updated from flows.yaml", extra={"schedule_id": schedule_id})
            except InvalidSchedule as exc:
                raise InvalidSchedule([(f"schedules.{schedule_id}.{d['field']}", d["problem"]) for d in exc.detail]) from None

    def get(self, schedule_id: str) -> Schedule:
        schedule = self.store.get(schedule_id)
        if schedule is None:
            raise ScheduleNotFound(f"no schedule {schedule_id!r}")
        return schedule

    def list(self, limit: int, after: str | None = None, user_id: str | None = None) -> builtins.list[Schedule]:
        return self.store.list(limit, after, user_id)

    def modify(self, schedule_id: str, changes: Mapping[str, Any]) -> Schedule:
        """Change fields of the definition; firing times restart from now if the timing changed.

        ``paused: false`` resumes, as :meth:`resume` does.
        """
        if "schedule_id" in changes and changes["schedule_id"] != schedule_id:
            raise InvalidSchedule([("schedule_id", "cannot be changed")])

        def decide(stored: Schedule) -> Schedule:
            fields = definition_of(stored).model_dump() | dict(changes)
            try:
                definition = Definition.model_validate(fields)
            except ValidationError as exc:
                raise InvalidSchedule(
                    [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors()]
                ) from None
            now = self.clock()
            fresh = self._checked(definition, schedule_id, now, new_run_at=definition.run_at != stored.when.run_at)
            if fresh.when == stored.when:
                fresh = evolve(fresh, cursor=stored.cursor, next_at=stored.next_at)
            changed = evolve(
                fresh,
                created_at=stored.created_at,
                running=stored.running,
                buffered=stored.buffered,
                version=stored.version,
            )
            return _resumed(changed, now) if stored.paused and not changed.paused else changed

        return self._change(schedule_id, decide)

    def pause(self, schedule_id: str, note: str | None = None) -> Schedule:
        now = self.clock()
        return self._change(
            schedule_id,
            lambda s: evolve(s, paused=True, note=s.note if note is None else note, updated_at=now),
        )

    def resume(self, schedule_id: str) -> Schedule:
        """Firings that fell in the pause are not made up for: the schedule goes on from now."""
        now = self.clock()
        return self._change(schedule_id, lambda s: _resumed(evolve(s, paused=False), now) if s.paused else s)

    def delete(self, schedule_id: str) -> None:
        if not self.store.delete(schedule_id):
            raise ScheduleNotFound(f"no schedule {schedule_id!r}")
        log.info("schedule deleted", extra={"schedule_id": schedule_id})

    def next_fire_times(self, schedule: Schedule, count: int = 5) -> builtins.list[float]:
        if schedule.cursor is None:
            return []
        return times_after(schedule.when, schedule.cursor, count)

    def runs(self, schedule_id: str, limit: int, before: float | None = None) -> builtins.list[RunView]:
        self.get(schedule_id)
        return self._views(self.store.runs(schedule_id, limit, before))

    def _views(self, runs: builtins.list[Run]) -> builtins.list[RunView]:
        statuses = self.store.task_status(r.task_id for r in runs if r.task_id is not None)
        return [RunView(r, statuses.get(r.task_id or "", r.state.value)) for r in runs]

    def origins(self, task_ids: Iterable[str]) -> dict[str, Run]:
        """The run that created each task a schedule created (their ids start with ``sch.``)."""
        return self.store.origins(t for t in task_ids if t.startswith(TASK_ID_PREFIX))

    # --- firings users ask for ---------------------------------------------------------

    def trigger(self, schedule_id: str) -> builtins.list[RunView]:
        """Fire now, under the schedule's overlap policy; returns the run records written."""

        def decide(s: Schedule, running: Running, now: float) -> Plan:
            # Two triggers in one millisecond, or one on a scheduled time: a firing of its own.
            while self.store.run_times(schedule_id, now - 0.0005, now + 0.0005):
                now += 0.001
            return plan_trigger(s, now, running)

        return self._fire_one(schedule_id, decide)

    def backfill(self, schedule_id: str, start: float, end: float) -> builtins.list[RunView]:
        """Fire every scheduled time in [start, end] that has no run yet."""
        if end < start:
            raise InvalidSchedule([("end", "must not be before start")])
        schedule = self.get(schedule_id)
        if len(times_between(schedule.when, start - 1e-6, end, MAX_BACKFILL + 1)) > MAX_BACKFILL:
            raise InvalidSchedule([("end", f"the range holds more than {MAX_BACKFILL} firings")])

        def decide(s: Schedule, running: Running, now: float) -> Plan:
            plan = plan_backfill(s, start, end, now, MAX_BACKFILL)
            known = self.store.run_times(schedule_id, start, end)
            runs = tuple(r for r in plan.runs if r.scheduled_at not in known)
            # The newest task it starts may be one that ran already: then nothing new runs.
            newest = max((r for r in runs if r.task_id), key=lambda r: r.scheduled_at, default=None)
            after = evolve(plan.schedule, running=newest.task_id if newest and s.running is None else s.running)
            return evolve(plan, schedule=after, runs=runs)

        return self._fire_one(schedule_id, decide)

    # --- the leader's firings ----------------------------------------------------------

    def fire_due(self, schedules: Iterable[Schedule], lease: Lease | None) -> builtins.list[Schedule]:
        """Fire what is due of ``schedules`` (the leader's copies); returns each as it now stands.

        A copy that turns out stale (a user changed the schedule) is read again,
        so the leader's timetable follows; a deleted one is left out.
        """
        now = self.clock()
        batch = builtins.list(schedules)
        statuses = self.store.task_status(s.running for s in batch if s.running is not None and _watches_its_task(s))
        planned = [(s, plan_due(s, now, running_of(s, statuses))) for s in batch]
        after = [s for s, p in planned if not p.changed]
        planned = [(s, p) for s, p in planned if p.changed]
        written = self._write(planned, lease, now)
        for (before, plan), ok in zip(planned, written, strict=True):
            if ok:
                after.append(evolve(plan.schedule, version=before.version + 1))
            elif (fresh := self.store.get(before.schedule_id)) is not None:
                after.append(fresh)
        return after

    # --- internals -----------------------------------------------------------------------

    def _checked(self, definition: Definition, schedule_id: str, now: float, new_run_at: bool = True) -> Schedule:
        problems: list[tuple[str, str]] = []
        try:
            schedule = definition.schedule(schedule_id, now, new_run_at)
        except Problem as exc:
            problems = exc.problems
        flow = self.tasks.flows.get(definition.flow) if definition.flow is not None else None
        if definition.flow is not None and flow is None:
            known = ", ".join(sorted(self.tasks.flows.flows)) or "none"
            problems.append(("flow", f"unknown flow {definition.flow!r} (known flows: {known})"))
        if flow is not None:
            try:
                flow.check_parameters(definition.parameters or {})  # as each firing will
            except InvalidParameters as exc:
                problems += exc.problems
        if definition.task_type is not None:
            try:
                self.pull.task_type(definition.task_type)
            except ServiceError as exc:
                problems.append(("task_type", str(exc)))
        if problems:
            raise InvalidSchedule(problems)
        return schedule

    def _change(self, schedule_id: str, decide: Callable[[Schedule], Schedule]) -> Schedule:
        def write(stored: Schedule, changed: Schedule) -> bool | None:
            return None if changed == stored else self.store.save(changed)

        stored, changed = compare_and_set(f"schedule {schedule_id}", lambda: self.get(schedule_id), decide, write)
        return stored if changed == stored else evolve(changed, version=stored.version + 1)

    def _fire_one(
        self, schedule_id: str, decide: Callable[[Schedule, Running, float], Plan]
    ) -> builtins.list[RunView]:
        def plan(s: Schedule) -> Plan:
            statuses = self.store.task_status([s.running] if s.running else [])
            return decide(s, running_of(s, statuses), self.clock())

        def write(s: Schedule, p: Plan) -> bool | None:
            return self._write([(s, p)], None, self.clock())[0] if p.changed else None

        _, done = compare_and_set(f"schedule {schedule_id}", lambda: self.get(schedule_id), plan, write)
        return self._views(sorted(done.runs, key=lambda r: r.scheduled_at, reverse=True))

    def _write(self, planned: builtins.list[tuple[Schedule, Plan]], lease: Lease | None, now: float) -> builtins.list[bool]:
        """Store the plans with the tasks they create, then publish and cancel what they say."""
        firings, decisions = [], []
        for before, plan in planned:
            firing, made = self._firing(before, plan, now)
            firings.append(firing)
            decisions.append(made)
        written = self.store.fire(firings, lease, now)
        for (before, plan), made, ok in zip(planned, decisions, written, strict=True):
            if ok:
                self._after(before, plan, made, now)
        return written

    def _firing(self, before: Schedule, plan: Plan, now: float) -> tuple[Firing, builtins.list[Decision]]:
        target = before.target
        made: builtins.list[Decision] = []
        pull_tasks: builtins.list[PullTask] = []
        for run in plan.fired:
            assert run.task_id is not None
            if target.flow is not None:
                made.append(self.tasks.prepare(target.flow, target.parameters, 0, target.user_id, run.task_id))
            else:
                assert target.task_type is not None
                config = TaskType(task_type=target.task_type)  # the store fills in the type's settings
                pull_tasks.append(
                    new_pull_task(
                        run.task_id, config, target.user_id or "", target.task_stage, target.task_content, 0, now
                    )
                )
        promoted = frozenset(before.buffered) & frozenset(r.scheduled_at for r in plan.fired)
        firing = Firing(plan.schedule, plan.runs, promoted, tuple(d.task for d in made), tuple(pull_tasks))
        return firing, made

    def _after(self, before: Schedule, plan: Plan, made: builtins.list[Decision], now: float) -> None:
        self.tasks.dispatch(made)
        for run in plan.runs:
            metrics.SCHEDULE_RUNS.labels(run.state.value).inc()
            extra = {"schedule_id": run.schedule_id, "task_id": run.task_id, "scheduled_at": run.scheduled_at}
            if run.state is RunState.FIRED:
                metrics.SCHEDULE_LATENESS.observe(max(0.0, now - run.scheduled_at))
                log.info("schedule fired", extra=extra)
            else:
                log.info("schedule %s: %s", run.state.value, run.reason or "", extra=extra)
        for task_id in plan.cancel:
            self._cancel(task_id)
        if plan.schedule.paused and not before.paused:
            log.warning("schedule paused: %s", plan.schedule.note, extra={"schedule_id": before.schedule_id})

    def _cancel(self, task_id: str) -> None:
        """cancel_other: the running flow task compensates; a v1 task cannot be cancelled."""
        try:
            self.tasks.operate(task_id, Cancel())
        except (ServiceError, InvalidAction) as exc:
            log.warning("cancel_other: could not cancel %s: %s", task_id, exc)
