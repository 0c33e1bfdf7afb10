"""Routes of /api/schedules (SPEC §9): thin adapters over :class:`ScheduleService`.

With API keys, a schedule belongs to the user its tasks are created for: others
see it as missing, admins see all.
"""

# No `from __future__ import annotations`: FastAPI reads the route annotations.

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from oss_api.auth import Caller, CallerDep, submit_user
from oss_api.errors import answers
from oss_api.limits import check_parameters_size
from oss_api.schemas import path_id
from shared.runtime import Runtime
from shared.schedules.definition import SCHEDULE_ID, Definition, definition_of
from shared.schedules.model import Overlap, Schedule
from shared.schedules.service import RunView, ScheduleNotFound, ScheduleService


class ScheduleDocument(Definition):
    """The definition as stored, with where the schedule stands."""

    model_config = ConfigDict(extra="forbid")

    schedule_id: str  # always set once stored
    created_at: float
    updated_at: float
    state: str = Field(description="active, paused, or done (it will not fire again)")
    next_fire_times: list[float] = Field(description="The next 5 scheduled times (epoch seconds), paused or not")
    last_scheduled_at: float | None = Field(description="Every scheduled time up to this one is handled")
    running_task_id: str | None = Field(description="Task of the latest firing while it may still run")
    buffered: list[float] = Field(description="Scheduled times waiting for the running task to end")

    @classmethod
    def of(cls, s: Schedule, next_fire_times: list[float]) -> "ScheduleDocument":
        return cls(
            **definition_of(s).model_dump(exclude={"schedule_id"}),
            schedule_id=s.schedule_id,
            created_at=s.created_at,
            updated_at=s.updated_at,
            state="paused" if s.paused else "active" if next_fire_times or s.buffered else "done",
            next_fire_times=next_fire_times,
            last_scheduled_at=s.cursor,
            running_task_id=s.running,
            buffered=list(s.buffered),
        )


class ScheduleList(BaseModel):
    schedules: list[ScheduleDocument]


class Changes(BaseModel):
    """Fields to change; those not sent keep their value."""

    model_config = ConfigDict(extra="forbid")

    flow: str | None = None
    parameters: dict[str, Any] | None = None
    task_type: str | None = None
    task_stage: str | None = None
    task_content: str | None = None
    run_at: float | None = None
    cron: str | None = None
    every: float | None = None
    timezone: str | None = None
    start_at: float | None = None
    end_at: float | None = None
    jitter: float | None = None
    overlap: Overlap | None = None
    catchup_window: float | None = None
    pause_on_failure: bool | None = None
    paused: bool | None = None
    note: str | None = None


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    note: str | None = Field(default=None, max_length=1000)


class BackfillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start: float = Field(description="From this scheduled time (epoch seconds), inclusive")
    end: float = Field(description="To this scheduled time (epoch seconds), inclusive")


class RunDocument(BaseModel):
    scheduled_at: float
    fired_at: float | None
    task_id: str | None
    status: str = Field(description="The created task's status, else the run's state (skipped, buffered)")
    state: str = Field(description="fired, buffered or skipped")
    reason: str | None = Field(description="Why it was skipped")

    @classmethod
    def view(cls, view: RunView) -> "RunDocument":
        run = view.run
        return cls(
            scheduled_at=run.scheduled_at,
            fired_at=run.fired_at,
            task_id=run.task_id,
            status=view.status,
            state=run.state.value,
            reason=run.reason,
        )


class RunList(BaseModel):
    runs: list[RunDocument]


ScheduleId = Annotated[str, path_id(SCHEDULE_ID, "schedule")]
_NO_SCHEDULE = "No such schedule (or another user's)"
_BODY_ERRORS = (400, 413, 422)  # malformed JSON, too large, invalid fields


def schedule_routes(runtime: Runtime) -> APIRouter:
    router = APIRouter(prefix="/api/schedules", tags=["schedules"])

    async def service() -> ScheduleService:  # async: called on the event loop, not through a worker thread
        return runtime.schedules

    Service = Annotated[ScheduleService, Depends(service)]

    def visible(svc: ScheduleService, who: Caller, schedule_id: str) -> Schedule:
        if re.fullmatch(SCHEDULE_ID, schedule_id) is None:
            # No schedule can have this id (NUL, which PostgreSQL cannot even compare, included).
            raise ScheduleNotFound(f"no schedule {schedule_id[:80]!r}")
        schedule = svc.get(schedule_id)
        if not who.admin and schedule.target.user_id != who.user:
            raise ScheduleNotFound(f"no schedule {schedule_id!r}")
        return schedule

    def document(svc: ScheduleService, s: Schedule) -> ScheduleDocument:
        return ScheduleDocument.of(s, svc.next_fire_times(s))

    @router.post(
        "",
        status_code=201,
        response_model=ScheduleDocument,
        responses={
            200: {"model": ScheduleDocument, "description": "The schedule already stored under this schedule_id"},
            **answers(
                *_BODY_ERRORS,
                401,
                403,
                409,
                503,
                e403="The key's user may not schedule tasks for another user_id",
                e409="The schedule_id is taken by another definition",
            ),
        },
    )
    def add(body: Definition, who: CallerDep, svc: Service, response: Response) -> ScheduleDocument:
        body = body.model_copy(update={"user_id": submit_user(who, body.user_id)})
        check_parameters_size(body.parameters or {}, runtime.settings.max_parameters_bytes)
        schedule, created = svc.add(body)
        if not created:
            response.status_code = 200
        return document(svc, schedule)

    @router.get("", response_model=ScheduleList, responses=answers(401, 422, 503))
    def list_schedules(
        who: CallerDep,
        svc: Service,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        after: Annotated[str | None, Query(pattern=SCHEDULE_ID, description="Those with a greater id")] = None,
    ) -> ScheduleList:
        found = svc.list(limit, after, user_id=None if who.admin else who.user)
        return ScheduleList(schedules=[document(svc, s) for s in found])

    @router.get("/{schedule_id}", response_model=ScheduleDocument, responses=answers(401, 404, 503, e404=_NO_SCHEDULE))
    def get(schedule_id: ScheduleId, who: CallerDep, svc: Service) -> ScheduleDocument:
        return document(svc, visible(svc, who, schedule_id))

    @router.patch(
        "/{schedule_id}",
        response_model=ScheduleDocument,
        responses=answers(*_BODY_ERRORS, 401, 404, 503, e404=_NO_SCHEDULE),
    )
    def modify(schedule_id: ScheduleId, body: Changes, who: CallerDep, svc: Service) -> ScheduleDocument:
        visible(svc, who, schedule_id)
        check_parameters_size(body.parameters or {}, runtime.settings.max_parameters_bytes)
        return document(svc, svc.modify(schedule_id, body.model_dump(exclude_unset=True)))

    @router.delete(
        "/{schedule_id}", status_code=204, response_class=Response, responses=answers(401, 404, 503, e404=_NO_SCHEDULE)
    )
    def remove(schedule_id: ScheduleId, who: CallerDep, svc: Service) -> Response:
        visible(svc, who, schedule_id)
        svc.delete(schedule_id)
        return Response(status_code=204)

    @router.post(
        "/{schedule_id}/pause",
        response_model=ScheduleDocument,
        responses=answers(*_BODY_ERRORS, 401, 404, 503, e404=_NO_SCHEDULE),
    )
    def pause(
        schedule_id: ScheduleId, who: CallerDep, svc: Service, body: PauseRequest | None = None
    ) -> ScheduleDocument:
        visible(svc, who, schedule_id)
        return document(svc, svc.pause(schedule_id, body.note if body else None))

    @router.post(
        "/{schedule_id}/resume", response_model=ScheduleDocument, responses=answers(401, 404, 503, e404=_NO_SCHEDULE)
    )
    def resume(schedule_id: ScheduleId, who: CallerDep, svc: Service) -> ScheduleDocument:
        visible(svc, who, schedule_id)
        return document(svc, svc.resume(schedule_id))

    @router.post("/{schedule_id}/trigger", response_model=RunList, responses=answers(401, 404, 503, e404=_NO_SCHEDULE))
    def trigger(schedule_id: ScheduleId, who: CallerDep, svc: Service) -> RunList:
        visible(svc, who, schedule_id)
        return RunList(runs=[RunDocument.view(v) for v in svc.trigger(schedule_id)])

    @router.post(
        "/{schedule_id}/backfill",
        response_model=RunList,
        responses=answers(*_BODY_ERRORS, 401, 404, 503, e404=_NO_SCHEDULE),
    )
    def backfill(schedule_id: ScheduleId, body: BackfillRequest, who: CallerDep, svc: Service) -> RunList:
        visible(svc, who, schedule_id)
        return RunList(runs=[RunDocument.view(v) for v in svc.backfill(schedule_id, body.start, body.end)])

    @router.get(
        "/{schedule_id}/runs", response_model=RunList, responses=answers(401, 404, 422, 503, e404=_NO_SCHEDULE)
    )
    def runs(
        schedule_id: ScheduleId,
        who: CallerDep,
        svc: Service,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        before: Annotated[float | None, Query(description="Runs scheduled before this time")] = None,
    ) -> RunList:
        visible(svc, who, schedule_id)
        return RunList(runs=[RunDocument.view(v) for v in svc.runs(schedule_id, limit, before)])

    return router
