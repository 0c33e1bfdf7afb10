"""The Asyncflow v1 API (seed 000 §一): pull-mode tasks for workers in any language.

Every answer is HTTP 200 with ``code`` (0 success) and ``msg`` (``SUCCESS`` or
``FAIL_REASON::ERROR_MSG``), as existing clients expect; the codes are listed in
:data:`CODES`. Routes only parse, call :class:`PullService`, and shape answers.
"""

import json
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from oss_api.auth import KEY_SECURITY, Caller, Forbidden, request_caller
from oss_api.coalesce import Coalescer
from oss_api.errors import answers
from oss_api.schemas import MAX_BATCH
from shared.names import NAME
from shared.pull.rules import (
    MAX_CONTENT_BYTES,
    MAX_LOG_BYTES,
    MAX_TASK_ID,
    InvalidReport,
    PullStatus,
    PullTask,
    Report,
    TaskType,
)
from shared.pull.service import NewPullTask, PullService, ReservedTaskType, UnknownTaskType
from shared.pull.steps import InvalidStepReport
from shared.runtime import Runtime
from shared.service import DuplicateTaskId, TaskNotFound, at_index
from shared.storable import json_problem
from shared.storage import StorageUnavailable, TaskConflict
from shared.storage.codec import json_text

log = logging.getLogger(__name__)

CODES = {
    "INPUT_INVALID": 1,
    "NOT_FOUND": 2,
    "CONFLICT": 3,
    "FORBIDDEN": 4,
    "DB_UNAVAILABLE": 5,
    "INTERNAL": 6,
}
TASK_ID = rf"^[A-Za-z0-9][A-Za-z0-9._:-]{{0,{MAX_TASK_ID - 1}}}$"


class _Body(BaseModel):
    # Clients written for other servers may send more fields: ignore, don't refuse.
    # Strict: a JSON string or boolean where a number belongs is a wrong type, not a number.
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def null_is_absent(cls, data: Any) -> Any:
        # Clients that serialize every field of a struct send null for the ones they leave out.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class CreateTaskData(_Body):
    task_id: str | None = Field(default=None, pattern=TASK_ID)
    task_type: str = Field(pattern=NAME)
    task_content: str = Field(default="", max_length=MAX_CONTENT_BYTES)
    task_priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    user_id: str = Field(default="", max_length=128)
    task_stage: str = Field(default="", max_length=64)

    # Seed 000: task_id is "not filled" at creation; clients built on structs send "" for that.
    @field_validator("task_id", mode="before")
    @classmethod
    def empty_id_is_absent(cls, value: Any) -> Any:
        return None if value == "" else value


class CreateTask(_Body):
    task_data: CreateTaskData


class CreateTasks(_Body):
    task_list: list[CreateTaskData] = Field(
        min_length=1, max_length=MAX_BATCH, description=f"1 to {MAX_BATCH} tasks, each as create_task's task_data"
    )


class TaskTypeData(_Body):
    task_type: str = Field(pattern=NAME)
    schedule_limit: int | None = None
    schedule_interval: int | None = None
    max_processing_time: int | None = None
    max_retry_num: int | None = None
    max_retry_interval: int | None = None


class RegisterTaskType(_Body):
    task_type_data: TaskTypeData


class RegisterTask(_Body):
    task_config_data: TaskTypeData


class HoldTasks(_Body):
    task_type: str = Field(pattern=NAME)
    # Opt-in liveness: the worker reports status 2 while it works, and a lease whose
    # reports stop ends after the answer's heartbeat_timeout.
    heartbeat: bool = False


class SetTaskData(_Body):
    task_id: str = Field(pattern=TASK_ID)
    task_type: str | None = None
    status: int = Field(ge=1, le=4)
    schedule_log: str | None = Field(default=None, max_length=MAX_LOG_BYTES)
    crt_retry_num: int | None = Field(default=None, ge=0)
    task_stage: str | None = Field(default=None, max_length=64)
    task_content: str | None = Field(default=None, max_length=MAX_CONTENT_BYTES)

    # An empty string keeps the stored value, as a zero value did in the original server:
    # clients that send every field of their struct must not wipe the stage or the context.
    @field_validator("task_stage", "task_content", "schedule_log", mode="before")
    @classmethod
    def empty_is_unchanged(cls, value: Any) -> Any:
        return None if value == "" else value


class SetTask(_Body):
    task_data: SetTaskData


# --- answers, as the OpenAPI document shows them (handlers build plain dicts) ----------------


class Answer(BaseModel):
    """Every v1 answer is HTTP 200 with these two fields; the others only when ``code`` is 0."""

    code: int = Field(
        ge=0,
        le=max(CODES.values()),
        description="0 success; " + ", ".join(f"{n} {reason}" for reason, n in CODES.items()),
    )
    msg: str = Field(description='"SUCCESS", or "REASON::message"')


class TaskData(BaseModel):
    user_id: str
    task_id: str
    task_type: str
    task_stage: str
    stage: str = Field(description="The same as task_stage (get_task's name for it)")
    status: int = Field(description=", ".join(f"{int(s)} {s.name.lower()}" for s in PullStatus))
    priority: int
    crt_retry_num: int
    max_retry_num: int
    max_retry_interval: int
    max_processing_time: int
    schedule_log: str
    task_content: str
    order_time: int
    create_time: int
    modify_time: int


class CreatedAnswer(Answer):
    task_id: str | None = Field(default=None, description="The new (or replayed) task's id")


class CreatedListAnswer(Answer):
    task_id_list: list[str] | None = Field(
        default=None, description="The tasks' ids in the order given (a replayed id is the stored task's)"
    )


class TaskAnswer(Answer):
    task_data: TaskData | None = None


class TaskListAnswer(Answer):
    task_list: list[TaskData] | None = None


class HeldAnswer(TaskListAnswer):
    heartbeat_timeout: float | None = Field(
        default=None, description="With heartbeat: a lease ends this many seconds after the worker's last report"
    )


class TypesAnswer(Answer):
    task_schedule_cfg_list: list[TaskType] | None = None


class CountsAnswer(Answer):
    task_count: int | None = None
    task_count_by_status: dict[str, int] | None = Field(default=None, description="Tasks by status (as a string)")


def _documented(answer: type[Answer], body: type[BaseModel] | None = None, open_: bool = False) -> dict[str, Any]:
    """Route arguments that document a v1 route: its answers, its body, its keys.

    Handlers parse the body themselves (:func:`_parse`, so that a bad one is a v1
    answer, not FastAPI's 422), hence the body schema given here by hand.
    """
    extra: dict[str, Any] = {}
    if body is not None:
        schema = _inlined(body.model_json_schema())
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    if not open_:
        extra |= KEY_SECURITY
    responses: dict[int | str, dict[str, Any]] = {200: {"model": answer, "description": "The v1 answer"}}
    if not open_:
        responses |= answers(401, e401="Missing or unknown API key (only when API keys are configured)")
    if body is not None:
        responses |= answers(413, e413="The request body is over the size limit")
    return {"response_model": None, "responses": responses, "openapi_extra": extra}


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its local ``$defs`` references replaced by the definitions (none is recursive)."""
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(definitions[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    inlined: dict[str, Any] = inline(schema)
    return inlined


class V1Error(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def ok(**fields: Any) -> dict[str, Any]:
    return {"code": 0, "msg": "SUCCESS", **fields}


def fail(reason: str, message: str) -> dict[str, Any]:
    return {"code": CODES[reason], "msg": f"{reason}::{message}"}


def task_json(task: PullTask) -> dict[str, Any]:
    return {
        "user_id": task.user_id,
        "task_id": task.task_id,
        "task_type": task.task_type,
        "task_stage": task.task_stage,
        "stage": task.task_stage,  # get_task's name for it (seed 000 §一.2.2)
        "status": int(task.status),
        "priority": task.priority,
        "crt_retry_num": task.crt_retry_num,
        "max_retry_num": task.max_retry_num,
        "max_retry_interval": task.max_retry_interval,
        "max_processing_time": task.max_processing_time,
        "schedule_log": task.schedule_log,
        "task_content": task.task_content,
        "order_time": int(task.order_time),
        "create_time": int(task.create_time),
        "modify_time": int(task.modify_time),
    }


async def _parse(request: Request, model: type[_Body]) -> Any:
    try:
        data = json.loads(await request.body())
    except ClientDisconnect:
        # The caller hung up before its body ended: nothing is done, and the answer goes
        # nowhere. Left to propagate, each such hang-up put a traceback in the server's error log.
        raise V1Error("INPUT_INVALID", "the body ended early: the client disconnected") from None
    except ValueError as exc:
        raise V1Error("INPUT_INVALID", f"body is not JSON: {exc}") from None
    except RecursionError:
        raise V1Error("INPUT_INVALID", "body is not JSON this server can read: nested too deeply") from None
    # NUL and lone surrogates pass JSON parsing but no database stores them.
    problem = json_problem(data, "body")
    if problem:
        raise V1Error("INPUT_INVALID", problem)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise V1Error("INPUT_INVALID", _problems(exc)) from None


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())


def _answer(call: Callable[[], dict[str, Any]]) -> Response:
    """The v1 answer of ``call``, encoded once: a route that returned the dict would have
    FastAPI walk it whole (jsonable_encoder) before encoding it, 7 % of hold_tasks' CPU."""
    return _json(_answered(call))


def _json(answer: dict[str, Any]) -> Response:
    return Response(json_text(answer), media_type="application/json")


def _answered(call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return call()
    except Exception as exc:
        return _failed(exc)


def _failed(exc: Exception) -> dict[str, Any]:
    """The v1 answer of a call that raised ``exc``."""
    if isinstance(exc, V1Error):
        return fail(exc.reason, str(exc))
    if isinstance(exc, UnknownTaskType | TaskNotFound):
        return fail("NOT_FOUND", str(exc))
    if isinstance(exc, TaskConflict | InvalidReport | ReservedTaskType):
        return fail("CONFLICT", str(exc))
    if isinstance(exc, InvalidStepReport | DuplicateTaskId):
        return fail("INPUT_INVALID", str(exc))
    if isinstance(exc, Forbidden):
        return fail("FORBIDDEN", str(exc))
    if isinstance(exc, ValidationError):
        return fail("INPUT_INVALID", _problems(exc))
    if isinstance(exc, StorageUnavailable):
        return fail("DB_UNAVAILABLE", "the task database is unavailable; try again shortly")
    log.error("v1 request failed", exc_info=exc)
    return fail("INTERNAL", "internal error; see the server log")


def v1_routes(runtime: Runtime) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["v1 (pull-mode workers)"])

    def service() -> PullService:
        return runtime.pull_service

    def admin(who: Caller) -> None:
        # Task types and leases are infrastructure: workers and operators hold admin keys.
        if not who.admin:
            raise Forbidden("this call needs an admin key")

    def owner(who: Caller, task: PullTask) -> PullTask:
        if not who.admin and task.user_id != who.user:
            raise TaskNotFound(f"no task {task.task_id!r}")
        return task

    @router.get("/ping", **_documented(Answer, open_=True))
    def ping() -> Response:
        return _answer(ok)

    def owned(who: Caller, data: CreateTaskData) -> str:
        """The user_id a new task gets: the one asked for by an admin, else the caller's own."""
        if who.admin:
            return data.user_id
        if data.user_id and data.user_id != who.user:
            raise Forbidden("cannot create tasks for another user")
        return who.user or ""

    # create_task calls that arrive together are stored in one commit (oss_api.coalesce).
    creates: Coalescer[NewPullTask, tuple[PullTask, bool]] = Coalescer(
        "create_task", lambda batch: service().create_each(batch), MAX_BATCH
    )
    # Concurrent holds of a type share one claim (PullService.hold_each).
    holds: Coalescer[tuple[str, bool], list[PullTask]] = Coalescer(
        "hold_tasks", lambda batch: service().hold_each(batch), MAX_BATCH
    )

    @router.post("/create_task", **_documented(CreatedAnswer, CreateTask))
    async def create_task(request: Request) -> Response:
        who = request_caller(request)
        try:
            data = (await _parse(request, CreateTask)).task_data
        except V1Error as exc:
            return _json(fail(exc.reason, str(exc)))
        try:
            new = NewPullTask(
                data.task_type, data.task_content, owned(who, data), data.task_priority, data.task_stage, data.task_id
            )
            task, _ = await creates(new)
        except Exception as exc:
            return _json(_failed(exc))
        return _json(ok(task_id=task.task_id))

    @router.post("/create_tasks", **_documented(CreatedListAnswer, CreateTasks))
    async def create_tasks(request: Request) -> Response:
        """Up to 1,000 tasks in one call, stored in one transaction: all of them or, on any error, none."""
        who = request_caller(request)
        def call(body: CreateTasks) -> dict[str, Any]:
            batch = []
            for i, data in enumerate(body.task_list):
                try:
                    user = owned(who, data)
                except Forbidden as exc:
                    raise at_index(exc, i) from None
                batch.append(
                    NewPullTask(data.task_type, data.task_content, user, data.task_priority, data.task_stage, data.task_id)
                )
            stored = service().create_many(batch)
            return ok(task_id_list=[task.task_id for task, _ in stored])

        return await _post(request, CreateTasks, call)

    @router.post("/register_task_type", **_documented(Answer, RegisterTaskType))
    async def register_task_type(request: Request) -> Response:
        who = request_caller(request)
        def call(body: RegisterTaskType) -> dict[str, Any]:
            admin(who)
            service().register_type(body.task_type_data.model_dump(), partial=False)
            return ok()

        return await _post(request, RegisterTaskType, call)

    @router.post("/register_task", **_documented(Answer, RegisterTask))
    async def register_task(request: Request) -> Response:
        who = request_caller(request)
        def call(body: RegisterTask) -> dict[str, Any]:
            admin(who)
            service().register_type(body.task_config_data.model_dump(), partial=True)
            return ok()

        return await _post(request, RegisterTask, call)

    @router.post("/hold_tasks", **_documented(HeldAnswer, HoldTasks))
    async def hold_tasks(request: Request) -> Response:
        who = request_caller(request)
        try:
            body = await _parse(request, HoldTasks)
        except V1Error as exc:  # and nothing else: a body over the limit is BodyLimit's to answer
            return _json(fail(exc.reason, str(exc)))
        try:
            admin(who)
            held = [task_json(t) for t in await holds((body.task_type, body.heartbeat))]
        except Exception as exc:
            return _json(_failed(exc))
        if body.heartbeat:
            return _json(ok(task_list=held, heartbeat_timeout=service().heartbeat_timeout))
        return _json(ok(task_list=held))

    @router.post("/set_task", **_documented(Answer, SetTask))
    async def set_task(request: Request) -> Response:
        who = request_caller(request)
        def call(body: SetTask) -> dict[str, Any]:
            admin(who)
            data = body.task_data
            report = Report(
                status=PullStatus(data.status),
                task_stage=data.task_stage,
                task_content=data.task_content,
                schedule_log=data.schedule_log,
                crt_retry_num=data.crt_retry_num,
            )
            service().set(data.task_id, report)
            return ok()

        return await _post(request, SetTask, call)

    @router.get("/get_task", **_documented(TaskAnswer))
    def get_task(request: Request, task_id: str = "") -> Response:
        who = request_caller(request)
        return _answer(lambda: ok(task_data=task_json(owner(who, service().get(_id(task_id))))))

    @router.get("/get_task_schedule_cfg_list", **_documented(TypesAnswer))
    def get_task_schedule_cfg_list(request: Request) -> Response:
        request_caller(request)
        return _answer(
            lambda: ok(task_schedule_cfg_list=[t.model_dump() for t in service().types()])
        )

    @router.get("/get_task_list", **_documented(TaskListAnswer))
    def get_task_list(
        request: Request,
        task_type: str | None = None,
        status: str | None = None,
        limit: str = "100",
        stage: str | None = None,
    ) -> Response:
        # Query values are parsed here, not by FastAPI, so that a bad one is a
        # v1 answer (code 1) rather than FastAPI's HTTP 422.
        who = request_caller(request)
        def call() -> dict[str, Any]:
            max_limit = runtime.settings.list_limit_max
            count = _integer("limit", limit, 1, max_limit)
            wanted = None if status is None else _integer("status", status, min(PullStatus), max(PullStatus))
            if task_type is not None:
                _type_name(task_type)
            problem = json_problem(stage, "stage")
            if problem:
                raise V1Error("INPUT_INVALID", problem)
            user = None if who.admin else who.user
            tasks = service().list(task_type, wanted, stage, count, user_id=user)
            return ok(task_list=[task_json(t) for t in tasks])

        return _answer(call)

    @router.get("/get_task_counts_by_type", **_documented(CountsAnswer))
    def get_task_counts_by_type(request: Request, task_type: str = "") -> Response:
        who = request_caller(request)
        def call() -> dict[str, Any]:
            admin(who)
            counts = service().count(_type_name(task_type))
            by_status = {str(status): n for status, n in counts.items()}
            return ok(task_count=sum(counts.values()), task_count_by_status=by_status)

        return _answer(call)

    return router


def _id(task_id: str) -> str:
    if not re.fullmatch(TASK_ID, task_id):
        raise V1Error("INPUT_INVALID", "task_id is missing or not a task id")
    return task_id


def _type_name(task_type: str) -> str:
    if not re.fullmatch(NAME, task_type):
        raise V1Error("INPUT_INVALID", f"task_type must match {NAME}")
    return task_type


def _integer(name: str, text: str, low: int, high: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise V1Error("INPUT_INVALID", f"{name} must be an integer, not {text[:40]!r}") from None
    if not low <= value <= high:
        raise V1Error("INPUT_INVALID", f"{name} must be {low}..{high}")
    return value


async def _post(request: Request, model: type[Any], act: Callable[[Any], dict[str, Any]]) -> Response:
    """Parse the body into ``model``, then run ``act`` on it, answering in the v1 form."""
    try:
        body = await _parse(request, model)
    except V1Error as exc:
        return _json(fail(exc.reason, str(exc)))
    # The store is synchronous: run it in the thread pool like the sync routes.
    return await run_in_threadpool(_answer, lambda: act(body))
