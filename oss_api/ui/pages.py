"""The dashboard's other pages: sign-in, alarms, flows, schedules, v1 task types."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from oss_api.auth import KeyTable, visible_task
from oss_api.ui import stats
from oss_api.ui.render import back, page
from oss_api.ui.session import (
    KEY_COOKIE,
    FormDep,
    Viewer,
    ViewerDep,
    field,
    local_path,
    set_cookie,
)
from shared.runtime import Runtime
from shared.schedules.model import Schedule
from shared.schedules.service import ScheduleNotFound
from shared.service import ServiceError
from shared.states import StepType, TaskStatus
from shared.storage.base import TaskQuery

# The flows page samples the newest tasks of each flow in the window, at most this many.
FLOW_SAMPLE = 2000
WINDOWS = {"1h": 3600.0, "24h": 86400.0, "7d": 7 * 86400.0, "30d": 30 * 86400.0}
ALARMS_SHOWN = 100
SESSION_DAYS = 7
# The v1 page counts each task type's newest tasks, at most this many.
V1_WINDOW = 50_000


def other_routes(runtime: Runtime) -> APIRouter:
    router = APIRouter(prefix="/ui", include_in_schema=False)

    # --- sign-in -----------------------------------------------------------------

    @router.get("/login")
    def login_form(request: Request) -> Response:
        return login_page(request, None)

    def login_page(request: Request, problem: str | None) -> Response:
        keys: KeyTable = request.app.state.api_keys
        return page(
            request,
            None,
            "login.html",
            title="Sign in",
            problem=problem,
            auth=keys.enabled,
            next=local_path(request.query_params.get("next", "/ui")),
            status=401 if keys.enabled else 200,
        )

    @router.post("/login")
    def login(request: Request, form: FormDep) -> Response:
        keys: KeyTable = request.app.state.api_keys
        key = field(form, "key").strip()
        target = local_path(field(form, "next", "/ui"))
        if not keys.enabled:
            return RedirectResponse(target, status_code=303)
        if keys.lookup(key) is None:
            return login_page(request, "That key is not valid.")
        response = RedirectResponse(target, status_code=303)
        set_cookie(response, request, KEY_COOKIE, key, max_age=SESSION_DAYS * 86400)
        return response

    @router.post("/logout")
    def logout(request: Request, form: FormDep) -> Response:
        response = RedirectResponse("/ui/login", status_code=303)
        response.delete_cookie(KEY_COOKIE, path="/ui")
        return response

    # --- alarms ------------------------------------------------------------------------

    @router.get("/alarms")
    def alarms(request: Request, who: ViewerDep) -> Response:
        found = runtime.store.page(
            TaskQuery(status=TaskStatus.ROLLBACK_FAILED, user_id=None if who.admin else who.user, limit=ALARMS_SHOWN)
        )
        attempts = runtime.store.attempts_of(t.task_id for t in found.tasks)
        failures = {}
        for task_id, records in attempts.items():
            failed = [a for a in records if a.type is StepType.ROLLBACK and a.outcome not in (None, "succeeded")]
            if failed:
                failures[task_id] = failed[-1]
        return page(
            request, who, "alarms.html", title="Alarms", found=found, failures=failures, shown=ALARMS_SHOWN
        )

    # --- flows -------------------------------------------------------------------------

    @router.get("/flows")
    def flows(request: Request, who: ViewerDep) -> Response:
        window = request.query_params.get("window", "24h")
        if window not in WINDOWS:
            window = "24h"
        since = time.time() - WINDOWS[window]
        shown = []
        for name, flow in sorted(runtime.flows.flows.items()):
            sample = runtime.store.flow_attempts(name, since, FLOW_SAMPLE)
            shown.append((flow, stats.step_stats(sample), len({a.task_id for a in sample})))
        return page(
            request, who, "flows.html", title="Flows", shown=shown, window=window, windows=WINDOWS, sample=FLOW_SAMPLE
        )

    # --- schedules ----------------------------------------------------------------------

    def visible_schedule(who: Viewer, schedule_id: str) -> Schedule:
        schedule = runtime.schedules.get(schedule_id)
        if not who.admin and schedule.target.user_id != who.user:
            raise ScheduleNotFound(f"no schedule {schedule_id!r}")
        return schedule

    @router.get("/schedules")
    def schedules(request: Request, who: ViewerDep) -> Response:
        svc = runtime.schedules
        after = request.query_params.get("after") or None
        found = svc.list(101, after, user_id=None if who.admin else who.user)
        more = len(found) > 100
        found = found[:100]
        return page(
            request,
            who,
            "schedules.html",
            title="Schedules",
            found=[(s, svc.next_fire_times(s, 3)) for s in found],
            older=found[-1].schedule_id if more else None,
        )

    @router.get("/schedules/{schedule_id}")
    def schedule_page(schedule_id: str, request: Request, who: ViewerDep) -> Response:
        svc = runtime.schedules
        try:
            schedule = visible_schedule(who, schedule_id)
        except ScheduleNotFound as exc:
            return page(request, who, "missing.html", status=404, title="No such schedule", problem=str(exc))
        return page(
            request,
            who,
            "schedule.html",
            title=f"Schedule {schedule_id}",
            schedule=schedule,
            upcoming=svc.next_fire_times(schedule, 10),
            runs=svc.runs(schedule_id, 50),
        )

    @router.post("/schedules/{schedule_id}/{action}")
    def schedule_action(schedule_id: str, action: str, request: Request, who: ViewerDep, form: FormDep) -> Response:
        to = local_path(f"/ui/schedules/{schedule_id}", "/ui/schedules")
        who.may_act()
        svc = runtime.schedules
        try:
            visible_schedule(who, schedule_id)
            if action == "pause":
                svc.pause(schedule_id, field(form, "note") or None)
            elif action == "resume":
                svc.resume(schedule_id)
            elif action == "trigger":
                views = svc.trigger(schedule_id)
                made = ", ".join(v.run.task_id or v.run.state.value for v in views) or "nothing"
                return back(request, to, f"Triggered: {made}.")
            else:
                return back(request, to, f"Unknown action {action[:40]!r}.")
        except ServiceError as exc:
            return back(request, to, f"Not done: {exc}")
        return back(request, to, f"Schedule {action}d." if action != "pause" else "Schedule paused.")

    # --- v1 task types ----------------------------------------------------------------

    @router.get("/v1")
    def task_types(request: Request, who: ViewerDep) -> Response:
        rows = []
        for t in runtime.pull_service.types():
            summary = runtime.pull_store.summary(t.task_type, V1_WINDOW)
            by_status: dict[int, int] = {}
            for (_, status), n in summary.by_stage.items():
                by_status[status] = by_status.get(status, 0) + n
            stages = sorted({stage for stage, _ in summary.by_stage})
            rows.append((t, summary, by_status, stages))
        return page(request, who, "v1.html", title="v1 task types", rows=rows, window=V1_WINDOW)

    # --- lookup by id (the search box in the header) --------------------------------

    @router.get("/find")
    def find(request: Request, who: ViewerDep) -> Response:
        task_id = request.query_params.get("task_id", "").strip()
        try:
            visible_task(runtime.service, who.caller, task_id)
        except ServiceError:
            return back(request, "/ui", f"No task {task_id[:64]!r}.")
        return RedirectResponse(f"/ui/tasks/{task_id}", status_code=303)

    return router
