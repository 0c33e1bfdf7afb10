"""FastAPI application factory: ``create_app(runtime)``. Routes are thin adapters."""

# No `from __future__ import annotations`: FastAPI reads the route annotations,
# some of which are built inside the factory from the settings.

import logging
import os
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from oss_api import errors
from oss_api.auth import CallerDep, caller, list_user, load_keys, log_mode, submit_user, visible_task
from oss_api.limits import BodyLimit, check_parameters_size
from oss_api.schedules import schedule_routes
from oss_api.schemas import SubmitRequest, TaskDocument, TaskList, UserId
from oss_api.v1 import v1_routes
from shared.config import load_settings
from shared.logs import setup_logging
from shared.names import NAME
from shared.runtime import Runtime
from shared.saga import Cancel, Resume, Retry
from shared.service import TaskService
from shared.states import TaskStatus
from shared.storage import TaskFilter

log = logging.getLogger(__name__)


def create_app(runtime: Runtime) -> FastAPI:
    """Raises :class:`oss_api.auth.AuthConfigError` when the configured API keys are unusable."""
    settings = runtime.settings
    keys = load_keys(settings)
    app = FastAPI(
        title="Asyncflow",
        version="0.1.0",
        description="Submit multi-step tasks by flow name, watch them, cancel, retry, resume. "
        "With API keys configured, /api needs `Authorization: Bearer <key>` (or `X-API-Key`); "
        "/healthz, /metrics, /docs and /openapi.json stay open.",
    )
    app.state.runtime = runtime
    app.state.api_keys = keys
    log_mode(keys)
    errors.install(app)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.include_router(_task_routes(runtime))
    app.include_router(v1_routes(runtime))
    app.include_router(schedule_routes(runtime))

    @app.get("/healthz", tags=["operations"])
    def healthz() -> dict[str, str]:
        runtime.store.ping()
        return {"status": "ok"}

    @app.get("/metrics", tags=["operations"], response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(_registry()), media_type=CONTENT_TYPE_LATEST)

    return app


def app_from_environment() -> FastAPI:
    """The app of one of several API processes (``asyncflow api --workers N``)."""
    settings = load_settings()
    setup_logging(settings.log_level, "api")
    return create_app(Runtime(settings))


def _registry() -> CollectorRegistry:
    """The metrics of every API process when there are several, else of this one."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # untyped in prometheus_client
    return registry


def _task_routes(runtime: Runtime) -> APIRouter:
    settings = runtime.settings
    router = APIRouter(prefix="/api", tags=["tasks"])

    def service() -> TaskService:
        return runtime.service

    Service = Annotated[TaskService, Depends(service)]

    @router.post("/tasks", status_code=201, response_model=TaskDocument)
    def submit(
        body: SubmitRequest,
        who: CallerDep,
        svc: Service,
        response: Response,
        idempotency_key: Annotated[str | None, Header(max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")] = None,
    ) -> TaskDocument:
        user_id = submit_user(who, body.user_id)
        check_parameters_size(body.parameters, settings.max_parameters_bytes)
        task, created = svc.submit(
            body.flow,
            body.parameters,
            priority=body.priority,
            user_id=user_id,
            task_id=body.task_id or idempotency_key,
        )
        if not created:
            response.status_code = 200
        return TaskDocument.of(task)

    @router.get("/tasks/{task_id}", response_model=TaskDocument)
    def get_task(task_id: str, who: CallerDep, svc: Service) -> TaskDocument:
        origin = runtime.schedules.origins([task_id]).get(task_id)
        return TaskDocument.of(visible_task(svc, who, task_id), svc.attempts(task_id), origin)

    @router.get("/tasks", response_model=TaskList)
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

    @router.post("/tasks/{task_id}/cancel", response_model=TaskDocument)
    def cancel(task_id: str, who: CallerDep, svc: Service) -> TaskDocument:
        visible_task(svc, who, task_id)
        return TaskDocument.of(svc.operate(task_id, Cancel()))

    @router.post("/tasks/{task_id}/retry", response_model=TaskDocument)
    def retry(task_id: str, who: CallerDep, svc: Service) -> TaskDocument:
        visible_task(svc, who, task_id)
        return TaskDocument.of(svc.operate(task_id, Retry()))

    @router.post("/tasks/{task_id}/resume", response_model=TaskDocument)
    def resume(task_id: str, who: CallerDep, svc: Service) -> TaskDocument:
        visible_task(svc, who, task_id)
        return TaskDocument.of(svc.operate(task_id, Resume()))

    @router.get("/flows", tags=["flows"], dependencies=[Depends(caller)])
    def list_flows() -> dict[str, Any]:
        return {
            "flows": [
                flow.model_dump(mode="json") for flow in runtime.flows.flows.values()
            ]
        }

    return router
