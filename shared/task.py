"""The task as plain immutable data: what the saga reads and returns.

No I/O here. Storage maps these to rows; the API maps them to the task document.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.flows import Action, Flow
from shared.records import evolve
from shared.retry import retry_delay
from shared.states import Phase, StepState, StepType, TaskStatus


@dataclass(frozen=True)
class Command:
    """A step command's settings as the task took them from flows.yaml at submit.

    A plain snapshot, not the config model: a task keeps running with the settings
    it started with, and rows stored by earlier releases load whatever the config
    model has become since (see :mod:`shared.storage.codec`).
    """

    module: str
    command: str
    timeout: float
    retry: int  # extra attempts after the first
    max_retry_interval: float  # the retry rule of shared.retry

    @classmethod
    def of(cls, action: Action) -> Command:
        return cls(action.module, action.command, action.timeout, action.retry, action.max_retry_interval)

    def backoff(self, failed_attempts: int) -> float:
        """Seconds to wait before the next attempt after ``failed_attempts`` failures."""
        return retry_delay(failed_attempts - 1, self.max_retry_interval)


@dataclass(frozen=True)
class Step:
    normal: Command
    rollback: Command | None
    state: StepState = StepState.PENDING
    rollback_state: StepState = StepState.PENDING
    code: int = 0
    message: str | None = None
    time_start: float | None = None
    time_end: float | None = None
    rollback_time_start: float | None = None
    rollback_time_end: float | None = None
    attempts: int = 0
    rollback_attempts: int = 0

    def action(self, step_type: StepType) -> Command:
        if step_type is StepType.NORMAL:
            return self.normal
        assert self.rollback is not None, "rollback dispatched for a step without one"
        return self.rollback


@dataclass(frozen=True)
class Active:
    """The one outstanding step message of a task; messages that don't match are stale."""

    seq: int
    cursor: int
    type: StepType
    attempt: int
    phase: Phase
    due_at: float | None = None
    started_at: float | None = None
    # Requeue passes that left it in its queue's backlog (saga.Requeue); bounded by Timing.requeue_holds.
    held: int = 0


@dataclass(frozen=True)
class Task:
    task_id: str
    flow: str
    status: TaskStatus
    cursor: int
    parameters: Mapping[str, Any]
    steps: tuple[Step, ...]
    created_at: float
    priority: int = 0
    user_id: str | None = None
    message: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    cancel_requested: bool = False
    seq: int = 0  # last message sequence number issued
    active: Active | None = None
    version: int = 0

    def with_step(self, index: int, **changes: Any) -> Task:
        steps = list(self.steps)
        steps[index] = evolve(steps[index], **changes)
        return evolve(self, steps=tuple(steps))


@dataclass(frozen=True)
class StepMessage:
    """What goes on a module queue (seed 004 §三, plus seq and attempt for fencing)."""

    task_id: str
    flow: str
    seq: int
    cursor: int
    type: StepType
    attempt: int
    module: str
    command: str
    timeout: float
    retry: int
    parameters: Mapping[str, Any] = field(default_factory=dict)
    priority: int = 0  # the task's
    # Wall-clock time of its publish (set by the publisher, not by the saga): the
    # queue wait metric. Not part of what the message is, so not compared.
    sent_at: float | None = field(default=None, compare=False)
    # The task as its publisher stored it (shared.storage.codec.task_fields), on the
    # first step of a task just submitted: the consumer decides the step's start on
    # it instead of reading the task, and the start's compare-and-set proves it
    # current. Not part of what the message is either.
    known: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def continues(self) -> bool:
        """Part of a flow under way (a later step, a retry, a rollback), not its first attempt."""
        return self.cursor > 0 or self.attempt > 1 or self.type is StepType.ROLLBACK

    def to_payload(self) -> dict[str, Any]:
        payload = {
            "task_id": self.task_id,
            "flow": self.flow,
            "seq": self.seq,
            "cursor": self.cursor,
            "type": int(self.type),
            "attempt": self.attempt,
            "module": self.module,
            "command": self.command,
            "timeout": self.timeout,
            "retry": self.retry,
            "parameters": dict(self.parameters),
            "priority": self.priority,
        }
        if self.sent_at is not None:
            payload["sent_at"] = self.sent_at
        if self.known is not None:
            payload["known"] = self.known
        return payload

    @classmethod
    def from_payload(cls, data: Mapping[str, Any]) -> StepMessage:
        return cls(
            task_id=str(data["task_id"]),
            flow=str(data["flow"]),
            seq=int(data["seq"]),
            cursor=int(data["cursor"]),
            type=StepType(int(data["type"])),
            attempt=int(data["attempt"]),
            module=str(data["module"]),
            command=str(data["command"]),
            timeout=float(data["timeout"]),
            retry=int(data["retry"]),
            parameters=dict(data.get("parameters") or {}),
            priority=int(data.get("priority") or 0),
            sent_at=float(data["sent_at"]) if data.get("sent_at") is not None else None,
            known=data.get("known"),
        )


@dataclass(frozen=True)
class Alarm:
    """A compensation failed: somebody has to look."""

    task_id: str
    flow: str
    seq: int  # of the rollback message that failed: one alarm per failure
    cursor: int
    module: str
    command: str
    error: str

    def to_parameters(self) -> dict[str, Any]:
        return {
            "Alarm": "rollback_failed",
            "TaskId": self.task_id,
            "Flow": self.flow,
            "Cursor": self.cursor,
            "Module": self.module,
            "Command": self.command,
            "Error": self.error,
        }


def new_task(
    task_id: str,
    flow: Flow,
    parameters: Mapping[str, Any],
    now: float,
    priority: int = 0,
    user_id: str | None = None,
) -> Task:
    """A task as stored at submit: cursor 0, status 1, no message yet."""
    return Task(
        task_id=task_id,
        flow=flow.name,
        status=TaskStatus.PENDING,
        cursor=0,
        parameters=dict(parameters),
        steps=first_steps(flow),
        created_at=now,
        priority=priority,
        user_id=user_id,
    )


# Every new task of a flow starts from the same steps, and steps are immutable: they
# are made once per Flow object and shared (a step that changes is a new Step). By
# the object's id, as a Flow declaring parameters is not hashable; the flow is kept
# beside its steps, so an id is not reused while cached. A reload of flows.yaml makes
# new Flow objects: the bound keeps the old ones from piling up.
FIRST_STEPS_KEPT = 256
_first_steps: dict[int, tuple[Flow, tuple[Step, ...]]] = {}
_shared: dict[int, tuple[Step, ...]] = {}  # the same steps, by their own id


def first_steps(flow: Flow) -> tuple[Step, ...]:
    """The steps of a new task of ``flow``, shared by all of them."""
    cached = _first_steps.get(id(flow))
    if cached is not None and cached[0] is flow:
        return cached[1]
    steps = tuple(
        Step(normal=Command.of(s.normal), rollback=Command.of(s.rollback) if s.rollback else None)
        for s in flow.steps
    )
    if len(_first_steps) >= FIRST_STEPS_KEPT:
        _first_steps.clear()
        _shared.clear()
    _first_steps[id(flow)] = (flow, steps)
    _shared[id(steps)] = steps
    return steps


def is_first_steps(steps: tuple[Step, ...]) -> bool:
    """Whether ``steps`` are a flow's :func:`first_steps`, as a new task holds them."""
    return _shared.get(id(steps)) is steps
