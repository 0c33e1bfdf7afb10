"""A task's history as the task page draws it: pure functions of the task and its attempts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared.states import Phase, StepState, StepType, TaskStatus
from shared.storage import AttemptRecord
from shared.task import Step, Task


@dataclass(frozen=True)
class Row:
    """One line of the timeline: an attempt, or the message still waiting for one."""

    cursor: int
    rollback: bool
    attempt: int
    label: str  # "2 beta.step"
    outcome: str  # succeeded, failed, timed_out, poll_later, expired, released, running, queued, waiting
    ready_at: float  # when it could have started (after the previous attempt, or the submit)
    started_at: float | None
    ended_at: float | None
    backoff: float | None  # the retry delay before this attempt, if it is a retry
    worker: str | None = None
    error: str | None = None
    progress: Mapping[str, Any] | None = None
    heartbeat_at: float | None = None
    due_at: float | None = None

    @property
    def queued(self) -> float | None:
        """From ready to started, the backoff included."""
        return None if self.started_at is None else max(0.0, self.started_at - self.ready_at)

    @property
    def run_time(self) -> float | None:
        if self.started_at is None or self.ended_at is None:
            return None
        return max(0.0, self.ended_at - self.started_at)


@dataclass(frozen=True)
class Bar:
    """A row drawn on the time axis, in percent of the span: the wait, then the run."""

    row: Row
    wait_x: float
    wait_w: float
    run_x: float
    run_w: float


def rows(task: Task, attempts: Sequence[AttemptRecord], now: float) -> list[Row]:
    """Every attempt in order, then the outstanding message if it has not started."""
    found: list[Row] = []
    ready = task.created_at
    for a in attempts:
        step = task.steps[a.cursor] if a.cursor < len(task.steps) else None
        rollback = a.type is StepType.ROLLBACK
        backoff = None
        if step is not None and a.attempt > 1:
            backoff = step.action(a.type).backoff(a.attempt - 1)
        outcome = a.outcome or ("running" if a.started_at is not None else "queued")
        start = a.started_at
        found.append(
            Row(
                cursor=a.cursor,
                rollback=rollback,
                attempt=a.attempt,
                label=f"{a.cursor + 1} {a.module}.{a.command}",
                outcome=outcome,
                ready_at=min(ready, start) if start is not None else ready,
                started_at=start,
                ended_at=a.ended_at,
                backoff=backoff,
                worker=a.worker,
                error=a.error,
                progress=a.progress,
                heartbeat_at=a.heartbeat_at,
            )
        )
        if a.ended_at is not None:
            ready = a.ended_at
    active = task.active
    if active is not None and active.phase is not Phase.RUNNING and not _recorded(active.seq, attempts):
        step = task.steps[active.cursor]
        command = step.action(active.type)
        found.append(
            Row(
                cursor=active.cursor,
                rollback=active.type is StepType.ROLLBACK,
                attempt=active.attempt,
                label=f"{active.cursor + 1} {command.module}.{command.command}",
                outcome="waiting" if active.phase is Phase.WAITING else "queued",
                ready_at=min(ready, now),
                started_at=None,
                ended_at=None,
                backoff=command.backoff(active.attempt - 1) if active.attempt > 1 else None,
                due_at=active.due_at,
            )
        )
    return found


def _recorded(seq: int, attempts: Sequence[AttemptRecord]) -> bool:
    return any(a.seq == seq for a in attempts)


def bars(found: Sequence[Row], start: float, now: float) -> list[Bar]:
    """Rows placed on one axis from ``start`` to the last thing that happened (or now)."""
    end = start
    for r in found:
        end = max(end, r.ended_at or r.started_at or r.ready_at)
        if r.ended_at is None:
            end = max(end, now)
    span = max(end - start, 1e-6)

    def x(at: float) -> float:
        return round(100.0 * (at - start) / span, 3)

    placed = []
    for r in found:
        run_start = r.started_at if r.started_at is not None else now
        run_end = r.ended_at if r.ended_at is not None else (now if r.started_at is not None else run_start)
        placed.append(
            Bar(
                row=r,
                wait_x=x(r.ready_at),
                wait_w=max(0.0, x(run_start) - x(r.ready_at)),
                run_x=x(run_start),
                # A run too short to see still gets a sliver.
                run_w=max(0.4, x(run_end) - x(run_start)) if r.started_at is not None else 0.0,
            )
        )
    return placed


@dataclass(frozen=True)
class Change:
    """What one attempt merged into the parameters."""

    label: str
    rollback: bool
    at: float | None
    values: Mapping[str, Any]
    overwrote: frozenset[str]  # keys that already had another value


def changes(task: Task, attempts: Sequence[AttemptRecord]) -> list[Change]:
    """The parameters' evolution, step by step: each attempt's result, in order.

    The submitted values are what the task holds now minus what the steps set;
    a key a step overwrote shows its earlier value only where a step set it.
    """
    found = []
    seen: dict[str, Any] = {}
    for a in attempts:
        if not a.result:
            continue
        overwrote = frozenset(k for k, v in a.result.items() if k in seen and seen[k] != v)
        seen.update(a.result)
        found.append(
            Change(
                label=f"{a.cursor + 1} {a.module}.{a.command} (attempt {a.attempt})",
                rollback=a.type is StepType.ROLLBACK,
                at=a.ended_at,
                values=dict(a.result),
                overwrote=overwrote,
            )
        )
    return found


def submitted(task: Task, found: Sequence[Change]) -> dict[str, Any]:
    """The parameters as submitted, as far as the attempt log tells: keys no step set."""
    set_by_steps = {k for c in found for k in c.values}
    return {k: v for k, v in task.parameters.items() if k not in set_by_steps}


@dataclass(frozen=True)
class Box:
    """One step on the saga diagram."""

    index: int
    normal: str  # module.command
    rollback: str | None
    state: str  # the StepState label of the normal direction
    rollback_state: str  # of the compensation; "skipped" for a step without one
    current: bool


def boxes(task: Task) -> list[Box]:
    return [
        Box(
            index=i,
            normal=f"{s.normal.module}.{s.normal.command}",
            rollback=f"{s.rollback.module}.{s.rollback.command}" if s.rollback else None,
            state=s.state.label,
            rollback_state=s.rollback_state.label if s.rollback else "skipped",
            current=i == task.cursor and not task.status.is_terminal,
        )
        for i, s in enumerate(task.steps)
    ]


def rolled_back(task: Task) -> bool:
    """Whether any compensation has started: then the rollback path is drawn."""
    return any(s.rollback_state is not StepState.PENDING for s in task.steps if s.rollback) or task.status in (
        TaskStatus.ROLLING_BACK,
        TaskStatus.ROLLBACK_FAILED,
    )


def rollback_path(task: Task) -> list[tuple[int, Step]]:
    """The steps compensations run for, in the order they run (last completed first)."""
    return [
        (i, s)
        for i, s in reversed(list(enumerate(task.steps)))
        if s.rollback is not None and s.rollback_state is not StepState.PENDING
    ]
