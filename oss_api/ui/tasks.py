"""The task list (/ui), the task page (/ui/tasks/{id}) and their actions."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import Response

from oss_api.auth import ANY_TASK_ID, visible_task
from oss_api.limits import check_parameters_size
from oss_api.ui import timeline
from oss_api.ui.render import back, page
from oss_api.ui.session import FormDep, ViewerDep, field, local_path
from shared.names import NAME
from shared.runtime import Runtime
from shared.saga import Cancel, InvalidAction, Operation, Resume, Retry
from shared.service import ServiceError, TaskNotFound
from shared.states import TaskStatus
from shared.storage.base import Cursor, StatusCounts, TaskQuery

PAGE_SIZES = (50, 200, 1000)
# Tasks one bulk action may name: a page of the list at its default size, and then some.
BULK_MAX = 200
# Each action from its parameter corrections (none for a cancel), and what it did.
ACTIONS: dict[str, tuple[Callable[[dict[str, Any]], Operation], str]] = {
    "cancel": (lambda _: Cancel(), "cancelled"),
    "retry": (Retry, "retried"),
    "resume": (Resume, "resumed"),
}


class BadFilter(ValueError):
    pass


@dataclass(frozen=True)
class Filters:
    """The list's query string, as typed, and the store query it means."""

    values: Mapping[str, str]
    query: TaskQuery

    def link(self, **changes: str | None) -> str:
        merged = {k: v for k, v in {**self.values, **changes}.items() if v}
        return "/ui" + ("?" + urlencode(merged) if merged else "")


def _time(text: str, name: str) -> float | None:
    if not text:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d"):
        try:
            return datetime.strptime(text.strip(), fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    raise BadFilter(f"{name}: expected a UTC time like 2026-01-31 or 2026-01-31 14:05")


def _cursor(text: str) -> Cursor | None:
    if not text:
        return None
    at, sep, task_id = text.partition("~")
    try:
        value = float(at)
    except ValueError:
        value = None
    if not sep or value is None or ANY_TASK_ID.fullmatch(task_id) is None:
        raise BadFilter("after: not a position in the list (follow the 'Older' link)")
    return value, task_id


def _corrections(text: str) -> dict[str, Any]:
    """The parameter corrections typed on the task page: a JSON object, or nothing."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise BadFilter(f"the parameters are not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise BadFilter("the parameters must be a JSON object, like {\"amount\": 10}")
    return value


def encode_cursor(cursor: Cursor) -> str:
    return f"{cursor[0]!r}~{cursor[1]}"


def parse_filters(params: Mapping[str, str], user: str | None, admin: bool) -> Filters:
    """The list's filters from the query string; a caller who is not admin sees only its own tasks."""
    keys = ("flow", "status", "user", "from", "until", "param", "after", "limit")
    values = {k: params.get(k, "").strip() for k in keys}
    flow = values["flow"] or None
    if flow is not None and re.fullmatch(NAME, flow) is None:
        raise BadFilter("flow: not a flow name")
    status = None
    if values["status"]:
        label = values["status"].lower()
        found = [s for s in TaskStatus if s.label == label or str(int(s)) == label]
        if not found:
            raise BadFilter(f"status: one of {', '.join(s.label for s in TaskStatus)}")
        status = found[0]
    user_id = values["user"] or None
    if not admin:
        user_id = user
        values["user"] = ""
    parameter = None
    if values["param"]:
        key, sep, text = values["param"].partition("=")
        path = tuple(p for p in key.strip().split(".") if p)
        if not sep or not path:
            raise BadFilter("parameter: write name=value (a nested one as order.id=7)")
        parameter = (path, text.strip())
    limit = int(values["limit"]) if values["limit"].isdigit() else PAGE_SIZES[0]
    if limit not in PAGE_SIZES:
        limit = PAGE_SIZES[0]
    values["limit"] = "" if limit == PAGE_SIZES[0] else str(limit)
    query = TaskQuery(
        flow=flow,
        status=status,
        user_id=user_id,
        created_from=_time(values["from"], "from"),
        created_until=_time(values["until"], "until"),
        parameter=parameter,
        after=_cursor(values["after"]),
        limit=limit,
    )
    return Filters(values, query)


class CountCache:
    """Counts by status, kept a few seconds: every open list polls them."""

    def __init__(self, ttl: float = 5.0, size: int = 256) -> None:
        self.ttl = ttl
        self.size = size
        self._kept: dict[tuple[str | None, str | None], tuple[float, StatusCounts]] = {}
        self._lock = threading.Lock()

    def get(self, runtime: Runtime, user_id: str | None, flow: str | None) -> StatusCounts:
        key = (user_id, flow)
        now = time.monotonic()
        with self._lock:
            kept = self._kept.get(key)
        if kept is not None and kept[0] > now:
            return kept[1]
        counts = runtime.store.count_by_status(user_id=user_id, flow=flow)
        with self._lock:
            if len(self._kept) >= self.size:
                self._kept.clear()
            self._kept[key] = (now + self.ttl, counts)
        return counts


def task_routes(runtime: Runtime) -> APIRouter:
    router = APIRouter(prefix="/ui", include_in_schema=False)
    counts = CountCache()

    @router.get("")
    def task_list(request: Request, who: ViewerDep) -> Response:
        problem = None
        try:
            filters = parse_filters(request.query_params, who.user, who.admin)
        except BadFilter as exc:
            problem = str(exc)
            filters = parse_filters({}, who.user, who.admin)
        found = runtime.store.page(filters.query)
        q = filters.query
        tally = counts.get(runtime, q.user_id, q.flow)
        origins = runtime.schedules.origins(t.task_id for t in found.tasks)
        return page(
            request,
            who,
            "tasks.html",
            title="Tasks",
            filters=filters,
            problem=problem,
            found=found,
            older=filters.link(after=encode_cursor(found.next)) if found.next else None,
            newest=filters.link(after=None) if q.after else None,
            counts=tally,
            statuses=list(TaskStatus),
            flows=sorted(runtime.flows.flows),
            origins=origins,
            page_sizes=PAGE_SIZES,
            here=str(request.url.path) + ("?" + request.url.query if request.url.query else ""),
        )

    @router.get("/tasks/{task_id}")
    def task_page(task_id: str, request: Request, who: ViewerDep) -> Response:
        svc = runtime.service
        try:
            task = visible_task(svc, who.caller, task_id)
        except TaskNotFound as exc:
            return page(request, who, "missing.html", status=404, title="No such task", problem=str(exc))
        now = time.time()
        attempts = svc.attempts(task_id)
        rows = timeline.rows(task, attempts, now)
        changes = timeline.changes(task, attempts)
        origin = runtime.schedules.origins([task_id]).get(task_id)
        events = runtime.store.events(task_id)
        return page(
            request,
            who,
            "task.html",
            title=f"Task {task_id}",
            task=task,
            rows=rows,
            bars=timeline.bars(rows, task.created_at, now),
            boxes=timeline.boxes(task),
            rolled_back=timeline.rolled_back(task),
            rollback_path=timeline.rollback_path(task),
            changes=changes,
            submitted=timeline.submitted(task, changes),
            origin=origin,
            events=events,
            live=not task.status.is_terminal and task.status is not TaskStatus.ROLLBACK_FAILED,
        )

    @router.post("/tasks/bulk")
    def bulk(request: Request, who: ViewerDep, form: FormDep) -> Response:
        to = local_path(field(form, "back"))
        who.may_act()
        action = field(form, "action")
        ids = list(dict.fromkeys(form.get("task_id", [])))
        if action not in ACTIONS:
            return back(request, to, "Choose cancel or retry.")
        if not ids:
            return back(request, to, "Select tasks first (the boxes on the left).")
        if len(ids) > BULK_MAX:
            return back(request, to, f"At most {BULK_MAX} tasks at a time.")
        event, done = ACTIONS[action]
        refused: list[str] = []
        for task_id in ids:
            try:
                visible_task(runtime.service, who.caller, task_id)
                runtime.service.operate(task_id, event({}), actor=who.user)
            except (InvalidAction, ServiceError) as exc:
                refused.append(f"{task_id}: {exc}")
        message = f"{len(ids) - len(refused)} of {len(ids)} task(s) {done}."
        if refused:
            message += " Refused: " + "; ".join(refused[:5]) + (" …" if len(refused) > 5 else "")
        return back(request, to, message)

    @router.post("/tasks/{task_id}/{action}")
    def act(task_id: str, action: str, request: Request, who: ViewerDep, form: FormDep) -> Response:
        to = f"/ui/tasks/{task_id}" if ANY_TASK_ID.fullmatch(task_id) else "/ui"
        who.may_act()
        if action not in ACTIONS:
            return back(request, to, f"Unknown action {action[:40]!r}.")
        make, done = ACTIONS[action]
        try:
            task = visible_task(runtime.service, who.caller, task_id)
            corrections = _corrections(field(form, "parameters"))
            if corrections:
                if action == "cancel":
                    return back(request, to, "A cancel takes no parameters.")
                check_parameters_size({**task.parameters, **corrections}, runtime.settings.max_parameters_bytes)
            task = runtime.service.operate(task_id, make(corrections), actor=who.user)
        except (InvalidAction, ServiceError, BadFilter) as exc:
            return back(request, to, f"Not {done}: {exc}")
        return back(request, to, f"Task {done}: now {task.status.label.replace('_', ' ')}.")

    return router
