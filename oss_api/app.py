"""FastAPI application factory: ``create_app(runtime)``. Routes are thin adapters."""

# No `from __future__ import annotations`: FastAPI reads the route annotations,
# some of which are built inside the factory from the settings.

import asyncio
import logging
import os
import re
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response
from fastapi.telemetry import TelemetryConfig
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from oss_api import docs, errors
from oss_api.auth import (
    ANY_TASK_ID,
    KEY_SECURITY,
    Caller,
    CallerDep,
    RequestCallerDep,
    caller,
    list_user,
    load_keys,
    log_mode,
    request_caller,
    submit_user,
    visible_task,
)
from oss_api.coalesce import Coalescer
from oss_api.direct import DirectPosts, Endpoint, post_endpoints
from oss_api.limits import BodyLimit, check_parameters_size
from oss_api.metrics import StackMetrics
from oss_api.schedules import schedule_routes
from oss_api.schemas import (
    MAX_BATCH,
    BatchAnswer,
    BatchItem,
    OperationRequest,
    SubmitBatch,
    SubmitRequest,
    TaskDocument,
    TaskList,
    UserId,
    path_id,
)
from oss_api.ui import install as install_ui
from oss_api.v1 import v1_routes
from shared import heap
from shared.config import load_settings
from shared.logs import setup_logging
from shared.names import NAME
from shared.presence import Presence, version
from shared.reload import reload_on_hangup
from shared.runtime import Runtime
from shared.saga import Cancel, Resume, Retry
from shared.service import ServiceError, Submission, TaskService, at_index
from shared.states import TaskStatus
from shared.storage import TaskFilter
from shared.storage.codec import orjson_reads_as_json_does
from shared.task import Task

log = logging.getLogger(__name__)

_NO_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}


def _opentelemetry_configured(environ: Mapping[str, str]) -> bool:
    """Whether FastAPI's own OpenTelemetry spans and metrics are wanted, by the environment.

    No code of the API's process sets an OpenTelemetry provider, so only its
    environment can; where it does not, asking on each request whether a provider
    is set took 6 % of a v1 call's CPU. Asyncflow's own metrics are /metrics'.
    """
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return environ.get("FASTAPI_OTEL_AUTO_CONFIGURE", "").lower() == "true" or any(
        name.startswith("OTEL_") for name in environ
    )


def create_app(runtime: Runtime) -> FastAPI:
    """Raises :class:`oss_api.auth.AuthConfigError` when the configured API keys are unusable."""
    settings = runtime.settings
    keys = load_keys(settings)
    # This API process in the registry, renewed while the app runs (each of several uvicorn workers its own).
    presence = Presence(
        runtime.process_store,
        "api",
        settings.heartbeat_interval,
        detail=lambda: {"url": settings.resolved_api_url(), "version": version()},
    )
    stack_metrics = StackMetrics(runtime, presence)
    app = FastAPI(
        lifespan=_registered(presence, stack_metrics),
        title="Asyncflow",
        version="0.1.0",
        description="Submit multi-step tasks by flow name, watch them, cancel, retry, resume. "
        "With API keys configured, /api needs `Authorization: Bearer <key>` (or `X-API-Key`); "
        "/healthz, /metrics, /docs, /redoc and /openapi.json stay open.",
        # Served from the package by oss_api.docs (no CDN).
        docs_url=None,
        redoc_url=None,
        telemetry=None if _opentelemetry_configured(os.environ) else _NO_TELEMETRY,
    )
    app.state.runtime = runtime
    app.state.api_keys = keys
    app.state.stack_metrics = stack_metrics  # the dashboard's workers page asks it too
    log_mode(keys)
    errors.install(app)
    docs.install(app)

    tasks, direct = _task_routes(runtime)
    v1 = v1_routes(runtime)
    direct |= post_endpoints(v1, "create_task", "hold_tasks", "set_task")
    # Added last, BodyLimit wraps DirectPosts: it counts what the direct routes read too.
    app.add_middleware(DirectPosts, endpoints=direct)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.include_router(tasks)
    app.include_router(v1)
    app.include_router(schedule_routes(runtime))
    install_ui(app, runtime)  # the dashboard at /ui (oss_api/ui), left out of the OpenAPI schema

    @app.get("/healthz", tags=["operations"], responses=errors.answers(503))
    def healthz() -> dict[str, str]:
        runtime.store.ping()
        return {"status": "ok"}

    @app.get(
        "/metrics",
        tags=["operations"],
        response_class=Response,
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    def metrics() -> Response:
        """The whole stack's metrics: every API process, worker and scheduler (README "Metrics")."""
        return Response(stack_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


def app_from_environment() -> FastAPI:
    """The app of one of several API processes (``asyncflow api --workers N``)."""
    settings = load_settings()
    setup_logging(settings, "api")
    runtime = Runtime(settings)
    reload_on_hangup(runtime)  # the supervisor passes SIGHUP on: shared.reload.serve_api_workers
    app = create_app(runtime)
    heap.settle()
    return app


def _registered(presence: Presence, stack_metrics: StackMetrics) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: its process is in the registry while it serves."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        presence.start()
        try:
            yield
        finally:
            await asyncio.to_thread(presence.stop)
            await asyncio.to_thread(stack_metrics.close)  # it may wait for a question to the broker

    return lifespan


# The answers of the /api/tasks routes besides their success (oss_api.errors.answers).
_NO_TASK = "No such task (or another user's)"
_TASK_ERRORS = errors.answers(401, 404, 503, e404=_NO_TASK)
_OPERATION_ERRORS = errors.answers(401, 404, 409, 503, e404=_NO_TASK, e409="The task's state does not allow the action")
_CORRECTION_ERRORS = errors.answers(
    400,
    413,
    422,
    e400="Malformed JSON body, or NaN or Infinity in parameters",
    e413="The body, or the task's parameters once corrected, are over the size limit",
    e422="Invalid body, or corrected parameters the flow's declaration refuses (detail names each)",
)


TaskId = Annotated[str, path_id(ANY_TASK_ID.pattern, "task")]
# The Idempotency-Key header's form: the route's check, and what lets the direct submit take one.
IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_MAX = re.compile(r"^[A-Za-z0-9._:-]+$"), 64


def _task_routes(runtime: Runtime) -> tuple[APIRouter, dict[str, Endpoint]]:
    """The /api routes, and those of them served in front of the router (oss_api.direct)."""
    settings = runtime.settings
    router = APIRouter(prefix="/api", tags=["tasks"])

    async def service() -> TaskService:  # async: called on the event loop, not through a worker thread
        return runtime.service

    Service = Annotated[TaskService, Depends(service)]
    # Submits that arrive together are stored in one commit (oss_api.coalesce).
    submits: Coalescer[Submission, tuple[Task, bool]] = Coalescer(
        "submit", lambda batch: runtime.service.submit_each(batch), MAX_BATCH
    )

    @router.post(
        "/tasks",
        status_code=201,
        response_model=TaskDocument,
        responses={
            200: {"model": TaskDocument, "description": "The task already stored under this task_id (a replay)"},
            **errors.answers(
                400,
                401,
                403,
                404,
                409,
                413,
                422,
                503,
                e403="The key's user may not submit for another user_id",
                e404="Unknown flow",
                e409="The task_id is taken by a task of another flow or user",
                e422="Invalid body, or parameters the flow's declaration refuses (detail names each)",
            ),
        },
        openapi_extra=KEY_SECURITY,
    )
    async def submit(
        body: SubmitRequest,
        who: RequestCallerDep,
        idempotency_key: Annotated[
            str | None, Header(max_length=IDEMPOTENCY_KEY_MAX, pattern=IDEMPOTENCY_KEY.pattern)
        ] = None,
    ) -> Response:
        user_id = submit_user(who, body.user_id)
        check_parameters_size(body.parameters, settings.max_parameters_bytes)
        task_id = body.task_id or idempotency_key
        task, created = await submits(Submission(body.flow, body.parameters, body.priority, user_id, task_id))
        # Encoded here, once: returned as a model, the document would be validated
        # against TaskDocument again and then encoded (9 % of the API's CPU in a burst).
        return Response(TaskDocument.of(task).model_dump_json(), 201 if created else 200, media_type="application/json")

    async def submit_direct(request: Request) -> Response | None:
        """``submit`` in front of the router (oss_api.direct), for a submit FastAPI would take as it is:
        a JSON body the model accepts, an idempotency key of the header's form. Anything else is
        the router's, for FastAPI's own answer (None)."""
        headers = request.headers
        key = headers.get("idempotency-key")
        if headers.get("content-type", "").partition(";")[0].strip().lower() != "application/json" or (
            key is not None and (len(key) > IDEMPOTENCY_KEY_MAX or not IDEMPOTENCY_KEY.fullmatch(key))
        ):
            return None
        try:
            text = await request.body()
        except ClientDisconnect:  # replayed, the router answers it as it would have
            return None
        if not orjson_reads_as_json_does(text):
            return None
        try:
            body = SubmitRequest.model_validate(orjson.loads(text))
        except (orjson.JSONDecodeError, ValidationError):
            return None
        return await submit(body, request_caller(request), key)

    @router.post(
        "/batches",
        response_model=BatchAnswer,
        responses=errors.answers(
            400,
            401,
            403,
            404,
            409,
            413,
            422,
            503,
            e403="The key's user may not submit for another user_id",
            e404="Unknown flow (the error names the submission, tasks[i])",
            e409="A task_id is taken by a task of another flow or user; nothing was stored",
            e422="Invalid body, parameters a flow refuses, or a task_id given twice (detail names each)",
        ),
    )
    def submit_batch(body: SubmitBatch, who: CallerDep, svc: Service) -> BatchAnswer:
        """Submit up to 1,000 tasks in one request: one transaction stores them all, or none."""
        batch = []
        for i, sub in enumerate(body.tasks):
            try:
                user_id = submit_user(who, sub.user_id)
                check_parameters_size(sub.parameters, settings.max_parameters_bytes)
            except ServiceError as exc:
                raise at_index(exc, i) from None
            batch.append(Submission(sub.flow, sub.parameters, sub.priority, user_id, sub.task_id))
        stored = svc.submit_many(batch)
        return BatchAnswer(tasks=[BatchItem(task_id=task.task_id, created=created) for task, created in stored])

    @router.get("/tasks/{task_id}", response_model=TaskDocument, responses=_TASK_ERRORS)
    def get_task(task_id: TaskId, who: CallerDep, svc: Service) -> TaskDocument:
        origin = runtime.schedules.origins([task_id]).get(task_id)
        task = visible_task(svc, who, task_id)
        return TaskDocument.of(task, svc.attempts(task_id), origin, svc.events(task_id))

    @router.get(
        "/tasks",
        response_model=TaskList,
        responses=errors.answers(401, 403, 422, 503, e403="The key's user may not list another user's tasks"),
    )
    def list_tasks(
        who: CallerDep,
        svc: Service,
        flow: Annotated[str | None, Query(pattern=NAME)] = None,
        status: Annotated[int | None, Query(ge=0, le=6)] = None,
        user_id: Annotated[UserId, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=settings.list_limit_max)] = 50,
    ) -> TaskList:
        where = TaskFilter(
            flow=flow,
            status=TaskStatus(status) if status is not None else None,
            user_id=list_user(who, user_id),
            limit=limit,
        )
        found = svc.list(where)
        origins = runtime.schedules.origins(t.task_id for t in found)
        return TaskList(tasks=[TaskDocument.of(t, origin=origins.get(t.task_id)) for t in found])

    @router.post("/tasks/{task_id}/cancel", response_model=TaskDocument, responses=_OPERATION_ERRORS)
    def cancel(task_id: TaskId, who: CallerDep, svc: Service) -> TaskDocument:
        visible_task(svc, who, task_id)
        return TaskDocument.of(svc.operate(task_id, Cancel(), actor=who.user))

    def corrections(task_id: str, who: Caller, svc: TaskService, body: OperationRequest | None) -> dict[str, Any]:
        task = visible_task(svc, who, task_id)
        if body is None or not body.parameters:
            return {}
        # The task's parameters once corrected must fit as a submit's would.
        check_parameters_size({**task.parameters, **body.parameters}, settings.max_parameters_bytes)
        return body.parameters

    @router.post(
        "/tasks/{task_id}/retry", response_model=TaskDocument, responses=_OPERATION_ERRORS | _CORRECTION_ERRORS
    )
    def retry(task_id: TaskId, who: CallerDep, svc: Service, body: OperationRequest | None = None) -> TaskDocument:
        """Run a failed or cancelled task again from its failed step; ``parameters`` correct its own first."""
        parameters = corrections(task_id, who, svc, body)
        return TaskDocument.of(svc.operate(task_id, Retry(parameters), actor=who.user))

    @router.post(
        "/tasks/{task_id}/resume", response_model=TaskDocument, responses=_OPERATION_ERRORS | _CORRECTION_ERRORS
    )
    def resume(task_id: TaskId, who: CallerDep, svc: Service, body: OperationRequest | None = None) -> TaskDocument:
        """Compensate again from the rollback that failed; ``parameters`` correct the task's first."""
        parameters = corrections(task_id, who, svc, body)
        return TaskDocument.of(svc.operate(task_id, Resume(parameters), actor=who.user))

    @router.get("/flows", tags=["flows"], dependencies=[Depends(caller)], responses=errors.answers(401))
    def list_flows() -> dict[str, Any]:
        return {
            "flows": [
                flow.model_dump(mode="json") for flow in runtime.flows.flows.values()
            ]
        }

    return router, {router.prefix + "/tasks": submit_direct}
