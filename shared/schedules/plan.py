"""Which firings are due, given a schedule, its policies, the state of its last task and now.

Pure: no I/O, no clock, no globals. The leader loads a schedule, looks up the
status of ``schedule.running``'s task, calls :func:`plan_due` and writes the plan
(the new schedule with a compare-and-set on its version, the run records, the
tasks of the FIRED records, the cancellations) in one go.

Choices the rules leave open:

- Lateness is measured from a firing's jittered moment (``t + jitter_of(t)``),
  not from ``t``: a firing that is on time is never MISSED because of its jitter.
- CANCEL_OTHER fires only the newest in-window firing of a plan: the earlier
  in-window ones of the same plan are SKIPPED(OVERLAP) (superseded), rather than
  created and cancelled at once. The task that ran before is cancelled.
- A paused schedule starts no buffered firing either: they stay buffered until
  it is resumed.
- ``pause_on_failure`` looks at ``schedule.running`` only: with ALLOW_ALL that
  is the newest of the tasks that may run.
- A schedule whose ``cursor`` is None counts from ``initial_cursor(when, created_at)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from shared.records import evolve
from shared.schedules.model import Overlap, Run, RunState, Schedule, SkipReason, task_id_of
from shared.schedules.timing import initial_cursor, jitter_of, times_after, times_between


class Running(Enum):
    """The state of ``schedule.running``'s task, as the caller found it."""

    NONE = "none"  # schedule.running is None, or its task is gone
    ALIVE = "alive"  # not ended yet
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class Plan:
    schedule: Schedule  # the new state
    runs: tuple[Run, ...] = ()  # run records to write, in scheduled order
    cancel: tuple[str, ...] = ()  # tasks to cancel (CANCEL_OTHER)
    # The schedule the plan was made from: ``changed`` compares with it (None: always changed).
    before: Schedule | None = None

    @property
    def fired(self) -> tuple[Run, ...]:
        return tuple(r for r in self.runs if r.state is RunState.FIRED)

    @property
    def changed(self) -> bool:
        return bool(self.runs or self.cancel) or self.before is None or self.schedule != self.before


def plan_due(schedule: Schedule, now: float, running: Running, limit: int = 1000) -> Plan:
    """The firings due at ``now``: at most ``limit`` scheduled times are handled per call."""
    work = _Work(schedule, now)
    if work.settle(running):
        return work.plan()
    if schedule.paused:
        return work.plan()
    when, policy = schedule.when, schedule.policy
    start = _cursor(schedule)
    due: list[tuple[float, float]] = []  # (scheduled time, its jittered moment)
    for t in times_between(when, start, now, limit):
        moment = t + jitter_of(schedule.schedule_id, t, when.jitter)
        if moment > now:  # still pending: the cursor must not pass it
            break
        due.append((t, moment))
    in_window = [now - moment <= policy.catchup_window for _, moment in due]
    newest = max((i for i, ok in enumerate(in_window) if ok), default=-1)
    for i, (t, _) in enumerate(due):
        if not in_window[i]:
            work.skip(t, SkipReason.MISSED)
        elif policy.overlap is Overlap.CANCEL_OTHER:
            if i < newest:
                work.skip(t, SkipReason.OVERLAP)  # superseded by a newer firing of this plan
            else:
                work.cancel_running()
                work.fire(t)
        else:
            work.offer(t, policy.overlap)
    cursor = due[-1][0] if due else start
    return work.plan(cursor=cursor, next_at=_first(times_after(when, cursor, 1)))


def plan_trigger(schedule: Schedule, now: float, running: Running) -> Plan:
    """A manual "run now": one firing scheduled at ``now``, under the overlap policy.

    It fires even when the schedule is paused, and whatever the catch-up window;
    the cursor does not move. The state of the running task is settled first, as in
    :func:`plan_due` (so a failure may pause the schedule, and the trigger still fires).
    """
    work = _Work(schedule, now)
    work.settle(running)
    if schedule.policy.overlap is Overlap.CANCEL_OTHER:
        work.cancel_running()
        work.fire(now)
    else:
        work.offer(now, schedule.policy.overlap)
    return work.plan()


def plan_backfill(schedule: Schedule, start: float, end: float, now: float, limit: int) -> Plan:
    """Fire every scheduled time in ``[start, end]`` now, whatever the overlap policy and window.

    Only times up to the cursor are backfilled (later ones are the scheduler's to
    fire), and not those waiting in ``buffered``. Times that already have a run
    record are the caller's to leave out (their task ids are the same). The cursor
    does not move; ``running`` becomes the newest fired task if nothing runs.
    Raises ValueError when more than ``limit`` times fall in the range.
    """
    if not (math.isfinite(start) and math.isfinite(end)):
        raise ValueError("backfill: start and end must be finite")
    end = min(end, _cursor(schedule))
    times = times_between(schedule.when, math.nextafter(start, -math.inf), end, limit + 1)
    if len(times) > limit:
        raise ValueError(f"backfill: more than {limit} scheduled times between {start} and {end}")
    runs = tuple(_fired(schedule.schedule_id, t, now) for t in times if t not in schedule.buffered)
    new = schedule
    if runs and schedule.running is None:
        new = evolve(schedule, running=runs[-1].task_id)
    return Plan(new, runs, before=schedule)


def next_fire_at(schedule: Schedule) -> float | None:
    """When the leader should look at this schedule again (None: nothing scheduled, or paused)."""
    if schedule.paused or schedule.next_at is None:
        return None
    return schedule.next_at + jitter_of(schedule.schedule_id, schedule.next_at, schedule.when.jitter)


# --- internals ---------------------------------------------------------------------


def _cursor(schedule: Schedule) -> float:
    if schedule.cursor is not None:
        return schedule.cursor
    return initial_cursor(schedule.when, schedule.created_at)


def _first(times: list[float]) -> float | None:
    return times[0] if times else None


def _fired(schedule_id: str, t: float, now: float) -> Run:
    return Run(schedule_id, t, RunState.FIRED, fired_at=now, task_id=task_id_of(schedule_id, t))


class _Work:
    """The plan under way: the state it changes and the records it writes."""

    def __init__(self, schedule: Schedule, now: float) -> None:
        self.before = schedule
        self.now = now
        self.running = schedule.running
        self.busy = False  # a task runs: the one found ALIVE, or one fired by this plan
        self.buffered = list(schedule.buffered)
        self.paused = schedule.paused
        self.note = schedule.note
        self.runs: list[Run] = []
        self.cancel: list[str] = []

    def settle(self, running: Running) -> bool:
        """Take in the state of the running task; True if that paused the schedule."""
        if self.running is not None and running is Running.ALIVE:
            self.busy = True
            return False
        ended = self.running
        self.running = None
        failed = ended is not None and running is Running.FAILED
        if failed and self.before.policy.pause_on_failure and not self.paused:
            self.paused = True
            self.note = f"paused on failure: task {ended} failed"
            return True
        if self.buffered and not self.paused:
            self.fire(self.buffered.pop(0))
        return False

    def fire(self, t: float) -> None:
        run = _fired(self.before.schedule_id, t, self.now)
        self.runs.append(run)
        self.running = run.task_id
        self.busy = True

    def skip(self, t: float, reason: SkipReason) -> None:
        self.runs.append(Run(self.before.schedule_id, t, RunState.SKIPPED, reason=reason.value))

    def offer(self, t: float, overlap: Overlap) -> None:
        """A firing in the window, under any policy but CANCEL_OTHER."""
        if not self.busy or overlap is Overlap.ALLOW_ALL:
            self.fire(t)
        elif overlap is Overlap.BUFFER_ALL or (overlap is Overlap.BUFFER_ONE and not self.buffered):
            self.runs.append(Run(self.before.schedule_id, t, RunState.BUFFERED))
            self.buffered.append(t)
            self.buffered.sort()
        else:
            self.skip(t, SkipReason.OVERLAP)

    def cancel_running(self) -> None:
        if self.busy and self.running is not None:
            self.cancel.append(self.running)
        self.busy = False

    def plan(self, cursor: float | None = None, next_at: float | None = None) -> Plan:
        b = self.before
        new = evolve(
            b,
            running=self.running,
            buffered=tuple(self.buffered),
            paused=self.paused,
            note=self.note,
            cursor=b.cursor if cursor is None else cursor,
            next_at=b.next_at if cursor is None else next_at,
        )
        return Plan(new, tuple(self.runs), tuple(self.cancel), before=b)
