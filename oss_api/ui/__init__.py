"""The dashboard at /ui: server-rendered pages over the same services and keys as /api.

No build step and nothing from another origin: Jinja2 templates, one stylesheet
and one small script (live refresh, select-all) under /ui/static. Routes are
left out of the OpenAPI schema.
"""

from __future__ import annotations

from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from oss_api.ui.pages import other_routes
from oss_api.ui.render import STATIC, page
from oss_api.ui.session import LoginNeeded, Refused
from oss_api.ui.tasks import task_routes
from oss_api.ui.workers import worker_routes
from shared.runtime import Runtime


def install(app: FastAPI, runtime: Runtime) -> None:
    """Serve the dashboard from ``app``."""
    app.include_router(task_routes(runtime))
    app.include_router(other_routes(runtime))
    app.include_router(worker_routes(runtime))
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")

    @app.exception_handler(LoginNeeded)
    async def login_needed(request: Request, exc: LoginNeeded) -> Response:
        target = request.url.path + ("?" + request.url.query if request.url.query else "")
        if request.method != "GET":
            target = "/ui"
        return RedirectResponse("/ui/login?next=" + quote(target, safe=""), status_code=303)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> Response:
        return page(request, None, "missing.html", status=exc.status_code, title="Refused", problem=str(exc))
