"""The saga state machine: ``decide(task, event, now) -> Decision``.

Pure: no I/O, no clock, no randomness. The engine loads a task, calls
:func:`decide`, stores the new task with a compare-and-set on its version, and
only then publishes the returned messages and raises the returned alarms.

Step events carry the ``seq`` of the message they answer; an event whose seq or
phase does not match the task's one outstanding message is stale (a duplicate
delivery, a late worker) and is ignored, so redelivery never advances a task twice.

A consumer records ``Started`` only for an attempt that outlives a short
threshold; a quick attempt reports its outcome straight from the queued phase,
with ``started_at``, so the start and the outcome are one transition, one commit.

The outstanding message's ``due_at`` is when the scheduler must look at the task
next, whatever the phase: a waiting message is published (``Due``); a queued
one that nobody started is published again (``Requeue``: lost in a crash
between commit and publish, or by the broker); a running attempt with no outcome
by its deadline counts as failed (``Expire``: its worker died or hangs).

While an attempt runs, its worker renews it with ``Heartbeat`` every few
seconds; for an attempt started with heartbeats, the sweep's deadline is its
last heartbeat plus ``Timing.heartbeat_timeout`` (never past its own timeout
plus grace), so a worker killed during a 30-minute step is noticed in seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.records import evolve
from shared.states import Phase, StepCode, StepState, StepType, TaskStatus
from shared.task import Active, Alarm, StepMessage, Task


class InvalidAction(Exception):
    """An operator action that the task's current state does not allow."""


@dataclass(frozen=True)
class Timing:
    """Bounds of the governance sweeps, in seconds (settings pass them in)."""

    requeue_after: float = 30.0  # queued, not started: publish again
    # Requeue passes that may leave a queued message in its queue's backlog before it
    # is published again anyway (a message lost in a crash is then late, not lost).
    requeue_holds: int = 10
    expire_grace: float = 15.0  # running past timeout + this: a lost attempt
    publish_retry: float = 2.0  # a publish failed: try again this soon
    # Above 0: a running attempt whose worker sends no Heartbeat for this long is
    # lost (0: only its timeout + expire_grace bounds it).
    heartbeat_timeout: float = 0.0
    # 0: a consumer records an attempt's start before it runs the handler. Else a
    # consumer running a queued message records its start (or its outcome) within
    # this many seconds, so a cancelled message still queued after it never ran.
    start_recorded_within: float = 0.0


DEFAULT_TIMING = Timing()


# --- events -----------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    """The task was stored; dispatch its first step.

    ``deferred``: the first step waits in the store, due at once, for the
    scheduler's sweep to publish it (:class:`Due`). A batch's caller then waits
    for its tasks to be stored, not for a message each: storing a task costs a
    fraction of what publishing its message costs the broker and the API.
    """

    deferred: bool = False


@dataclass(frozen=True)
class Due:
    """A waiting message (backoff, poll later) has reached its due time."""

    seq: int


@dataclass(frozen=True)
class Requeue:
    """A queued message was not started in time: publish it again (same seq).

    ``backlogged``: modules whose queues still hold messages waiting their turn. A
    message of one of them is most likely among those (the scheduler names none for
    a while once the broker has lost what it held), so it is looked at again after
    ``requeue_after`` instead, up to ``Timing.requeue_holds`` times: a copy
    published into a backlog is one more message to deliver, read and drop as
    stale, and a queue ``requeue_after`` behind would get a copy of every message
    at every pass, so it would fall further behind. The bound is for the message
    that is not there after all (lost between the commit and the publish, or by
    the broker). One the broker refused
    (:class:`PublishFailed`) is never held.
    """

    seq: int
    backlogged: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PublishFailed:
    """The broker refused the message: look again soon rather than after requeue_after."""

    seq: int


@dataclass(frozen=True)
class Expire:
    """A running attempt passed its deadline without an outcome."""

    seq: int


@dataclass(frozen=True)
class Started:
    seq: int
    # The attempt's worker sends Heartbeats: it is lost once they stop. Else only
    # its timeout bounds it (a v1 worker that did not opt in).
    heartbeats: bool = False


@dataclass(frozen=True)
class Heartbeat:
    """The worker running the attempt is alive; ``progress`` is what its handler last reported."""

    seq: int
    progress: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Released:
    """An attempt a worker holds, its handler not run, goes to another worker.

    A consumer process holding several deliveries stores their starts together,
    then runs their handlers one at a time: behind one that runs long, it gives
    the others back, started (``running``) or not yet. The same attempt goes out
    as a new message (a new seq, so the copy it held is stale, and so is a report
    of its loss should the process die); it is not one of the step's tries.
    """

    seq: int
    running: bool = True  # its start was stored; else it is still queued


# Outcomes carry ``started_at`` when the attempt's start was not recorded with
# ``Started``: the outcome then records both, from the queued phase.


@dataclass(frozen=True)
class Succeeded:
    seq: int
    result: Mapping[str, Any] = field(default_factory=dict)
    started_at: float | None = None


@dataclass(frozen=True)
class Failed:
    seq: int
    error: str
    timed_out: bool = False
    permanent: bool = False  # retrying cannot help: skip the remaining retries
    started_at: float | None = None


@dataclass(frozen=True)
class PollLater:
    seq: int
    after: float
    parameters: Mapping[str, Any] = field(default_factory=dict)
    started_at: float | None = None


@dataclass(frozen=True)
class Cancel:
    pass


@dataclass(frozen=True)
class Retry:
    """Run a failed or cancelled task again; ``parameters`` are merged over its own first
    (an operator correcting the value it failed on)."""

    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Resume:
    """Compensate again from the rollback that failed; ``parameters`` as for :class:`Retry`."""

    parameters: Mapping[str, Any] = field(default_factory=dict)


StepEvent = Due | Requeue | PublishFailed | Expire | Started | Heartbeat | Released | Succeeded | Failed | PollLater
Operation = Cancel | Retry | Resume  # an operator's action (TaskService.operate)
Event = Submit | StepEvent | Operation

# The phase the outstanding message must be in for each step event to apply.
_EXPECTED_PHASE: dict[type, Phase] = {
    Due: Phase.WAITING,
    Requeue: Phase.QUEUED,
    PublishFailed: Phase.QUEUED,
    Expire: Phase.RUNNING,
    Started: Phase.QUEUED,
    Heartbeat: Phase.RUNNING,
    Released: Phase.RUNNING,
    Succeeded: Phase.RUNNING,
    Failed: Phase.RUNNING,
    PollLater: Phase.RUNNING,
}
# Sweep events act only once the outstanding message is due.
_SWEEPS = (Due, Requeue, Expire)


def unrecorded_start(event: Event) -> float | None:
    """When an outcome's attempt began, if its start was not recorded with ``Started``."""
    return event.started_at if isinstance(event, Succeeded | Failed | PollLater) else None


@dataclass(frozen=True)
class Decision:
    task: Task
    messages: tuple[StepMessage, ...] = ()
    alarms: tuple[Alarm, ...] = ()
    ignored: str | None = None  # set when a step event was stale and changed nothing
    # The one of ``messages`` its caller runs itself, not published (shared.service.TaskService.apply's ``keep``).
    kept: StepMessage | None = None


def decide(task: Task, event: Event, now: float, timing: Timing = DEFAULT_TIMING) -> Decision:
    if isinstance(event, Submit):
        return _submit(task, event, now, timing)
    if isinstance(event, Cancel):
        return _cancel(task, now, timing)
    if isinstance(event, Retry):
        return _retry(task, event, now, timing)
    if isinstance(event, Resume):
        return _resume(task, event, now, timing)

    reason = stale(task, event, now)
    if reason:
        return Decision(task, ignored=reason)
    active = task.active
    assert active is not None
    if isinstance(event, Requeue) and task.cancel_requested and task.status is not TaskStatus.ROLLING_BACK:
        return _cancelled_before_running(task, now, timing)
    if isinstance(event, Requeue) and _held(task, event.backlogged, timing):
        return Decision(evolve(task, active=evolve(active, due_at=now + timing.requeue_after, held=active.held + 1)))
    if isinstance(event, Due | Requeue):
        return _publish_again(task, now, timing)
    if isinstance(event, PublishFailed):
        # Not in any queue: published again at its next look, whatever the backlog.
        failed = evolve(active, due_at=now + timing.publish_retry, held=timing.requeue_holds)
        return Decision(evolve(task, active=failed))
    if isinstance(event, Started):
        return _started(task, now, timing, event.heartbeats)
    if isinstance(event, Heartbeat):
        return _heartbeat(task, now, timing)
    if isinstance(event, Released):
        return _released(task, now, timing)
    start = unrecorded_start(event)
    if start is not None and active.phase is Phase.QUEUED:
        task = _started(task, start, timing).task
    if isinstance(event, Succeeded):
        return _succeeded(task, event, now, timing)
    if isinstance(event, Expire):
        return _failed(task, expiry(task, now, timing), now, timing)
    if isinstance(event, Failed):
        return _failed(task, event, now, timing)
    return _poll_later(task, event, now, timing)


def _held(task: Task, backlogged: frozenset[str], timing: Timing) -> bool:
    """Whether a due queued message stays in its module's backlog for another ``requeue_after``."""
    active = task.active
    assert active is not None
    return active.held < timing.requeue_holds and task.steps[active.cursor].action(active.type).module in backlogged


def stale(task: Task, event: StepEvent, now: float) -> str | None:
    """Why ``event`` does not apply to the task's outstanding message, or None if it does."""
    active = task.active
    if active is None:
        return f"task {task.task_id} has no outstanding step (status {task.status.label})"
    if active.seq != event.seq:
        return f"message seq {event.seq} is not the outstanding seq {active.seq}"
    expected = _EXPECTED_PHASE[type(event)]
    if unrecorded_start(event) is not None and active.phase is Phase.QUEUED:
        expected = Phase.QUEUED
    if isinstance(event, Released) and not event.running:
        expected = Phase.QUEUED
    if active.phase is not expected:
        return f"{type(event).__name__} for seq {event.seq} while it is {active.phase.name.lower()}"
    if isinstance(event, _SWEEPS) and (active.due_at is None or active.due_at > now):
        return f"{type(event).__name__} for seq {event.seq} before it is due"
    return None


# --- dispatch helpers ---------------------------------------------------------


def _dispatch(
    task: Task,
    cursor: int,
    step_type: StepType,
    attempt: int,
    now: float,
    timing: Timing,
    delay: float = 0.0,
    waiting: bool = False,
) -> Decision:
    """The task with its next message outstanding: queued, or waiting ``delay`` (or for the sweep)."""
    seq = task.seq + 1
    if delay > 0 or waiting:
        active = Active(seq, cursor, step_type, attempt, Phase.WAITING, due_at=now + delay)
        return Decision(evolve(task, seq=seq, active=active))
    active = Active(seq, cursor, step_type, attempt, Phase.QUEUED, due_at=now + timing.requeue_after)
    task = evolve(task, seq=seq, active=active)
    return Decision(task, messages=(message_for(task),))


def message_for(task: Task) -> StepMessage:
    """The step message for the task's outstanding (queued) step."""
    active = task.active
    assert active is not None
    action = task.steps[active.cursor].action(active.type)
    return StepMessage(
        task_id=task.task_id,
        flow=task.flow,
        seq=active.seq,
        cursor=active.cursor,
        type=active.type,
        attempt=active.attempt,
        module=action.module,
        command=action.command,
        timeout=action.timeout,
        retry=action.retry,
        parameters=dict(task.parameters),
        priority=task.priority,
    )


def _rollback_from(task: Task, start: int, now: float, timing: Timing) -> Decision:
    """Compensate steps ``start``, ``start-1`` … 0, skipping steps without a rollback."""
    task = evolve(task, status=TaskStatus.ROLLING_BACK, active=None)
    for index in range(start, -1, -1):
        if task.steps[index].rollback is None:
            task = task.with_step(index, rollback_state=StepState.SKIPPED)
            continue
        return _dispatch(task, index, StepType.ROLLBACK, 1, now, timing)
    final = TaskStatus.CANCELLED if task.cancel_requested else TaskStatus.FAILED
    return Decision(evolve(task, status=final, ended_at=now))


def _merge(task: Task, values: Mapping[str, Any]) -> Task:
    if not values:
        return task
    return evolve(task, parameters={**task.parameters, **values})


# --- step events ---------------------------------------------------------------


def _submit(task: Task, event: Submit, now: float, timing: Timing) -> Decision:
    if task.status is not TaskStatus.PENDING or task.seq != 0:
        raise InvalidAction(f"task {task.task_id} was already dispatched")
    return _dispatch(task, 0, StepType.NORMAL, 1, now, timing, waiting=event.deferred)


def _publish_again(task: Task, now: float, timing: Timing) -> Decision:
    """Publish the outstanding message (same seq: a copy still in flight stays harmless)."""
    assert task.active is not None
    active = evolve(task.active, phase=Phase.QUEUED, due_at=now + timing.requeue_after, held=0)
    task = evolve(task, active=active)
    return Decision(task, messages=(message_for(task),))


def _started(task: Task, now: float, timing: Timing, heartbeats: bool = False) -> Decision:
    active = task.active
    assert active is not None
    step = task.steps[active.cursor]
    if active.type is StepType.NORMAL:
        task = task.with_step(
            active.cursor,
            state=StepState.RUNNING,
            attempts=active.attempt,
            time_start=step.time_start or now,
        )
    else:
        task = task.with_step(
            active.cursor,
            rollback_state=StepState.RUNNING,
            rollback_attempts=active.attempt,
            rollback_time_start=step.rollback_time_start or now,
        )
    if task.status is TaskStatus.PENDING:
        task = evolve(task, status=TaskStatus.RUNNING, started_at=now)
    active = evolve(active, phase=Phase.RUNNING, started_at=now)
    due_at = _running_deadline(task, active, now, timing) if heartbeats else _deadline(task, active, timing)
    return Decision(evolve(task, active=evolve(active, due_at=due_at)))


def _deadline(task: Task, active: Active, timing: Timing) -> float:
    """When a running attempt counts as failed however alive its worker is."""
    assert active.started_at is not None
    return active.started_at + task.steps[active.cursor].action(active.type).timeout + timing.expire_grace


def _running_deadline(task: Task, active: Active, now: float, timing: Timing) -> float:
    """When the sweep must look at a running attempt heard from at ``now``."""
    deadline = _deadline(task, active, timing)
    if timing.heartbeat_timeout > 0:
        return min(deadline, now + timing.heartbeat_timeout)
    return deadline


def _heartbeat(task: Task, now: float, timing: Timing) -> Decision:
    active = task.active
    assert active is not None
    # Stored even when the deadline stays (capped, or a coarse clock): the heartbeat's
    # time and progress go to the attempt log with it.
    due_at = _running_deadline(task, active, now, timing)
    return Decision(evolve(task, active=evolve(active, due_at=due_at)))


def _released(task: Task, now: float, timing: Timing) -> Decision:
    active = task.active
    assert active is not None
    if active.phase is Phase.RUNNING:
        task = _unstarted(task, active)
    if task.cancel_requested and active.type is StepType.NORMAL:
        return _cancelled_before_running(task, now, timing)
    return _dispatch(task, active.cursor, active.type, active.attempt, now, timing)


def _unstarted(task: Task, active: Active) -> Task:
    """``task`` with its step as it was before ``active`` first started it, if it did.

    A step whose first start is given back never ran: it is not compensated, and
    its start time is that of the start that runs it. A later one (a retry, a
    poll again) follows a handler that did run, so the step stays as it is.
    """
    step = task.steps[active.cursor]
    if active.type is StepType.NORMAL:
        if step.time_start != active.started_at:
            return task
        return task.with_step(active.cursor, state=StepState.PENDING, attempts=0, time_start=None)
    if step.rollback_time_start != active.started_at:
        return task
    return task.with_step(
        active.cursor, rollback_state=StepState.PENDING, rollback_attempts=0, rollback_time_start=None
    )


def expiry(task: Task, now: float, timing: Timing) -> Failed:
    """The failure a running attempt with no outcome by its due time counts as."""
    active = task.active
    assert active is not None
    action = task.steps[active.cursor].action(active.type)
    if timing.heartbeat_timeout > 0 and now < _deadline(task, active, timing):
        # Still within its time: its worker went silent (killed, host lost).
        error = f"worker lost: no heartbeat for {timing.heartbeat_timeout:g}s"
        return Failed(active.seq, error)
    error = f"no outcome within {action.timeout:g}s + {timing.expire_grace:g}s grace (its worker was lost or stalled)"
    return Failed(active.seq, error, timed_out=True)


def _succeeded(task: Task, event: Succeeded, now: float, timing: Timing) -> Decision:
    active = task.active
    assert active is not None
    n = active.cursor
    if active.type is StepType.ROLLBACK:
        task = task.with_step(n, rollback_state=StepState.SUCCEEDED, rollback_time_end=now)
        return _rollback_from(task, n - 1, now, timing)

    task = _merge(task, event.result).with_step(
        n, state=StepState.SUCCEEDED, code=StepCode.OK, message=None, time_end=now
    )
    if task.cancel_requested:
        return _rollback_from(evolve(task, message="cancelled by operator"), n, now, timing)
    if n == len(task.steps) - 1:
        return Decision(evolve(task, status=TaskStatus.SUCCESS, ended_at=now, active=None))
    return _dispatch(evolve(task, cursor=n + 1), n + 1, StepType.NORMAL, 1, now, timing)


def _failed(task: Task, event: Failed, now: float, timing: Timing) -> Decision:
    active = task.active
    assert active is not None
    n = active.cursor
    step = task.steps[n]
    action = step.action(active.type)
    code = StepCode.TIMED_OUT if event.timed_out else StepCode.FAILED
    cancelling = task.cancel_requested and active.type is StepType.NORMAL
    if active.attempt <= action.retry and not event.permanent and not cancelling:
        task = task.with_step(n, code=code, message=event.error)
        delay = action.backoff(active.attempt)
        return _dispatch(task, n, active.type, active.attempt + 1, now, timing, delay)

    where = f"step {n} ({action.module}.{action.command})"
    if active.type is StepType.NORMAL:
        task = task.with_step(n, state=StepState.FAILED, code=code, message=event.error, time_end=now)
        return _rollback_from(evolve(task, message=f"{where} failed: {event.error}"), n, now, timing)

    task = task.with_step(
        n, rollback_state=StepState.FAILED, code=code, message=event.error, rollback_time_end=now
    )
    task = evolve(
        task,
        status=TaskStatus.ROLLBACK_FAILED,
        message=f"rollback of {where} failed: {event.error}",
        active=None,
        ended_at=now,
    )
    alarm = Alarm(task.task_id, task.flow, active.seq, n, action.module, action.command, event.error)
    return Decision(task, alarms=(alarm,))


def _poll_later(task: Task, event: PollLater, now: float, timing: Timing) -> Decision:
    active = task.active
    assert active is not None
    task = _merge(task, event.parameters)
    if task.cancel_requested and active.type is StepType.NORMAL:
        task = task.with_step(
            active.cursor, state=StepState.CANCELLED, code=StepCode.CANCELLED, time_end=now
        )
        return _rollback_from(evolve(task, message="cancelled by operator"), active.cursor, now, timing)
    delay = max(event.after, 0.0)
    return _dispatch(task, active.cursor, active.type, active.attempt, now, timing, delay)


# --- operator actions ----------------------------------------------------------


def _cancel(task: Task, now: float, timing: Timing) -> Decision:
    if task.status not in (TaskStatus.PENDING, TaskStatus.RUNNING):
        raise InvalidAction(
            f"task {task.task_id} is {task.status.label}; only pending or running tasks can be cancelled"
        )
    if task.cancel_requested:
        return Decision(task)
    active = task.active
    assert active is not None, "a pending or running task always has an outstanding step"
    task = evolve(task, cancel_requested=True, message="cancel requested")
    if active.phase is Phase.RUNNING:
        # The attempt in flight finishes (or times out); its outcome starts the rollback.
        return Decision(task)
    if active.phase is Phase.QUEUED and timing.start_recorded_within > 0:
        # A consumer may be running it and not have recorded the start yet: its outcome
        # then starts the rollback. If nothing is heard by the time a start would have
        # been recorded, the attempt never ran (the requeue sweep says so).
        return Decision(evolve(task, active=evolve(active, due_at=now + timing.start_recorded_within)))
    return _cancelled_before_running(task, now, timing)


def _cancelled_before_running(task: Task, now: float, timing: Timing) -> Decision:
    """The outstanding normal attempt of a cancelled task is not running: compensate now."""
    assert task.active is not None
    n = task.active.cursor
    task = evolve(task, message="cancelled by operator", active=None)
    if task.steps[n].attempts == 0:
        # Step n never ran: nothing of it to undo.
        return _rollback_from(task, n - 1, now, timing)
    task = task.with_step(n, state=StepState.CANCELLED, code=StepCode.CANCELLED, time_end=now)
    return _rollback_from(task, n, now, timing)


def _retry(task: Task, event: Retry, now: float, timing: Timing) -> Decision:
    if task.status not in (TaskStatus.FAILED, TaskStatus.CANCELLED):
        raise InvalidAction(
            f"task {task.task_id} is {task.status.label}; only failed or cancelled tasks can be retried"
        )
    task = _merge(task, event.parameters)
    # Run again from the failed step, but first redo any earlier step whose work
    # the compensation undid: resuming past it would build on work that is gone.
    n = task.cursor
    undone = [k for k in range(n) if task.steps[k].rollback_state is StepState.SUCCEEDED]
    start = min(undone + [n])
    steps = task.steps[:start] + tuple(
        type(s)(normal=s.normal, rollback=s.rollback) for s in task.steps[start:]
    )
    task = evolve(
        task,
        steps=steps,
        status=TaskStatus.RUNNING,
        cursor=start,
        message=None,
        ended_at=None,
        cancel_requested=False,
    )
    return _dispatch(task, start, StepType.NORMAL, 1, now, timing)


def _resume(task: Task, event: Resume, now: float, timing: Timing) -> Decision:
    if task.status is not TaskStatus.ROLLBACK_FAILED:
        raise InvalidAction(
            f"task {task.task_id} is {task.status.label}; only a failed rollback can be resumed"
        )
    task = _merge(task, event.parameters)
    k = max(i for i, s in enumerate(task.steps) if s.rollback_state is StepState.FAILED)
    task = task.with_step(k, rollback_state=StepState.PENDING)
    task = evolve(task, status=TaskStatus.ROLLING_BACK, ended_at=None, message=None)
    return _dispatch(task, k, StepType.ROLLBACK, 1, now, timing)
