"""Request and response models of the native API (the task document of SPEC §2)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Path
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

from shared.schedules.model import Run
from shared.states import Phase, StepState, StepType, TaskStatus
from shared.storable import json_problem
from shared.storage import AttemptRecord, TaskEvent
from shared.task import Step, Task

TASK_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _printable(value: str | None) -> str | None:
    if value is not None and _CONTROL.search(value):
        raise PydanticCustomError("control_character", "must not contain control characters")
    return value


# A user id: free text up to 128 characters, without control characters (NUL above all,
# which PostgreSQL cannot store). The pattern is for the document: the validator says
# what is wrong in words.
UserId = Annotated[
    str | None,
    Field(max_length=128, json_schema_extra={"pattern": r"^[^\x00-\x1F\x7F]*$"}),
    AfterValidator(_printable),
]

# Keys and strings anywhere in parameters: no NUL (PostgreSQL cannot store it); the
# document says so at every level (oss_api.docs), json_problem checks it.
_PARAMETERS_SCHEMA: JsonDict = {
    "propertyNames": {"pattern": r"^[^\x00]*$"},
    "additionalProperties": {"$ref": "#/components/schemas/ParameterValue"},
}


def path_id(pattern: str, what: str) -> Any:
    """A path parameter documented as matching ``pattern`` whole, which the handler checks itself.

    An id that no stored item can have answers 404 like a missing one, not FastAPI's 422.
    """
    anchored = f"^{pattern.removeprefix('^').removesuffix('$')}$"
    return Path(description=f"The {what}'s id", json_schema_extra={"pattern": anchored})


def storable_parameters(value: dict[str, Any]) -> dict[str, Any]:
    """``value``, if the stores can hold it (:func:`shared.storable.json_problem`)."""
    problem = json_problem(value, "parameters")
    if problem:
        raise PydanticCustomError("unstorable_json", "{problem}", {"problem": problem})
    return value


class SubmitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    flow: str = Field(max_length=64, description="Name of a flow in flows.yaml")
    parameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Shared Parameters (a JSON object, at most 64 KiB serialized, nested at most 32 deep; "
        "no NUL character in any key or string)",
        json_schema_extra=_PARAMETERS_SCHEMA,
    )
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    user_id: UserId = Field(
        default=None, description="Owner of the task; with API keys, defaults to the caller's user"
    )
    task_id: str | None = Field(
        default=None,
        pattern=TASK_ID,
        description="Client-chosen id; submitting it again returns the stored task (idempotent)",
    )

    @field_validator("parameters")
    @classmethod
    def _storable(cls, value: dict[str, Any]) -> dict[str, Any]:
        return storable_parameters(value)


# Submissions in one batch: its body stays under the request size limit for
# small parameters, and the insert under a second.
MAX_BATCH = 1000


class SubmitBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: list[SubmitRequest] = Field(
        min_length=1,
        max_length=MAX_BATCH,
        description=f"1 to {MAX_BATCH} submissions, each as POST /api/tasks takes it; all are stored or none",
    )


class BatchItem(BaseModel):
    task_id: str
    created: bool = Field(description="False: the task_id was already stored, by the same flow and user (a replay)")


class BatchAnswer(BaseModel):
    tasks: list[BatchItem] = Field(description="One per submission, in the order given")


class OperationRequest(BaseModel):
    """The optional body of retry and resume."""

    model_config = ConfigDict(extra="forbid")

    parameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Corrections merged over the task's parameters before it runs again (a JSON object, "
        "at most 64 KiB); checked against the flow's declared parameters, and recorded in its history",
        json_schema_extra=_PARAMETERS_SCHEMA,
    )

    @field_validator("parameters")
    @classmethod
    def _storable(cls, value: dict[str, Any]) -> dict[str, Any]:
        return storable_parameters(value)


class TaskEventDocument(BaseModel):
    """One entry of a task's history: an operator's cancel, retry or resume."""

    at: float
    kind: str = Field(description="cancel, retry or resume")
    actor: str | None = Field(description="The API caller's user; null with authentication off")
    detail: dict[str, Any] = Field(
        description='What it changed: "step" where the run restarts; "parameters": {key: {"old", "new"}} '
        "for each corrected parameter (no old for a new key)"
    )

    @classmethod
    def of(cls, event: TaskEvent) -> TaskEventDocument:
        return cls(at=event.at, kind=event.kind, actor=event.actor, detail=dict(event.detail))


class StepDocument(BaseModel):
    code: int
    message: str | None
    time_start: float | None
    time_end: float | None
    normal_module: str
    normal_command: str
    normal_timeout: float
    normal_retry: int
    rollback_module: str | None
    rollback_command: str | None
    rollback_timeout: float | None
    rollback_retry: int | None
    state: str
    rollback_state: str
    attempts: int
    rollback_attempts: int
    rollback_time_start: float | None
    rollback_time_end: float | None

    @classmethod
    def of(cls, step: Step) -> StepDocument:
        rb = step.rollback
        return cls(
            code=step.code,
            message=step.message,
            time_start=step.time_start,
            time_end=step.time_end,
            normal_module=step.normal.module,
            normal_command=step.normal.command,
            normal_timeout=step.normal.timeout,
            normal_retry=step.normal.retry,
            rollback_module=rb.module if rb else None,
            rollback_command=rb.command if rb else None,
            rollback_timeout=rb.timeout if rb else None,
            rollback_retry=rb.retry if rb else None,
            state=StepState(step.state).label,
            rollback_state="none" if rb is None and step.rollback_state is StepState.PENDING
            else StepState(step.rollback_state).label,
            attempts=step.attempts,
            rollback_attempts=step.rollback_attempts,
            rollback_time_start=step.rollback_time_start,
            rollback_time_end=step.rollback_time_end,
        )


class CurrentMessage(BaseModel):
    """The task's outstanding step message (the message cursor of seed 004 §三)."""

    seq: int
    cursor: int
    type: int
    attempt: int
    phase: str
    due_at: float | None


class AttemptDocument(BaseModel):
    seq: int
    cursor: int
    type: int
    attempt: int
    module: str
    command: str
    started_at: float | None
    ended_at: float | None
    outcome: str | None
    error: str | None
    worker: str | None = None
    heartbeat_at: float | None = None
    progress: dict[str, Any] | None = None
    result: dict[str, Any] | None = None

    @classmethod
    def of(cls, a: AttemptRecord) -> AttemptDocument:
        return cls(
            seq=a.seq,
            cursor=a.cursor,
            type=int(a.type),
            attempt=a.attempt,
            module=a.module,
            command=a.command,
            started_at=a.started_at,
            ended_at=a.ended_at,
            outcome=a.outcome,
            error=a.error,
            worker=a.worker,
            heartbeat_at=a.heartbeat_at,
            progress=dict(a.progress) if a.progress is not None else None,
            result=dict(a.result) if a.result is not None else None,
        )


class TaskDocument(BaseModel):
    task_id: str
    flow: str
    task_status: int = Field(
        description="0 success, 1 not started, 2 running, 3 rolling back, 4 failed (compensated), "
        "5 rollback failed (needs an operator), 6 cancelled (compensated)"
    )
    status_name: str
    task_message: str | None
    task_cursor: int = Field(description="Farthest step reached")
    time_create: float
    time_start: float | None
    time_end: float | None
    priority: int
    user_id: str | None
    cancel_requested: bool
    parameters: dict[str, Any]
    steps: list[StepDocument]
    current: CurrentMessage | None
    attempts: list[AttemptDocument] | None = None
    events: list[TaskEventDocument] | None = Field(
        default=None, description="The task's history, oldest first (in GET /api/tasks/{task_id} only)"
    )
    schedule_id: str | None = Field(default=None, description="The schedule whose firing created the task")
    scheduled_at: float | None = Field(default=None, description="The scheduled time of that firing")

    @classmethod
    def of(
        cls,
        task: Task,
        attempts: list[AttemptRecord] | None = None,
        origin: Run | None = None,
        events: list[TaskEvent] | None = None,
    ) -> TaskDocument:
        a = task.active
        return cls(
            events=[TaskEventDocument.of(e) for e in events] if events is not None else None,
            schedule_id=origin.schedule_id if origin else None,
            scheduled_at=origin.scheduled_at if origin else None,
            task_id=task.task_id,
            flow=task.flow,
            task_status=int(task.status),
            status_name=TaskStatus(task.status).label,
            task_message=task.message,
            task_cursor=task.cursor,
            time_create=task.created_at,
            time_start=task.started_at,
            time_end=task.ended_at,
            priority=task.priority,
            user_id=task.user_id,
            cancel_requested=task.cancel_requested,
            parameters=dict(task.parameters),
            steps=[StepDocument.of(s) for s in task.steps],
            current=CurrentMessage(
                seq=a.seq,
                cursor=a.cursor,
                type=int(StepType(a.type)),
                attempt=a.attempt,
                phase=Phase(a.phase).name.lower(),
                due_at=a.due_at,
            )
            if a
            else None,
            attempts=[AttemptDocument.of(x) for x in attempts] if attempts is not None else None,
        )


class TaskList(BaseModel):
    tasks: list[TaskDocument]
