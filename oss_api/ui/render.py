"""Pages from the Jinja2 templates, with the headers every dashboard page carries."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape

from oss_api.ui.session import CSRF_COOKIE, NOTICE_COOKIE, Viewer, csrf_of, set_cookie

HERE = Path(__file__).parent
STATIC = HERE / "static"

# Scripts and styles come from /ui/static only: no inline script, no other origin.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def when(at: float | None) -> str:
    """An epoch time as UTC, to the second."""
    if at is None:
        return "–"
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def ago(at: float | None, now: float | None = None) -> str:
    if at is None:
        return "–"
    return duration(max(0.0, (now or time.time()) - at)) + " ago"


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=when, duration=duration, ago=ago, pretty=pretty, short=short, q=quote)
    return env


ENV = _environment()


def page(request: Request, viewer: Viewer | None, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    notice = request.cookies.get(NOTICE_COOKIE)
    csrf, fresh = (viewer.csrf, viewer.fresh_csrf) if viewer is not None else csrf_of(request)
    html = ENV.get_template(template).render(
        request=request,
        viewer=viewer,
        csrf=csrf,
        notice=unquote(notice) if notice is not None else None,
        path=request.url.path,
        now=time.time(),
        **context,
    )
    response = HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)
    if notice is not None:
        response.delete_cookie(NOTICE_COOKIE, path="/ui")
    if fresh:
        set_cookie(response, request, CSRF_COOKIE, csrf)
    return response


def back(request: Request, to: str, notice: str) -> Response:
    """After an action: to the page ``to`` (Post/Redirect/Get), with ``notice`` shown once there."""
    response = RedirectResponse(to, status_code=303)
    # A cookie, not the URL: a crafted link cannot make the dashboard say something.
    set_cookie(response, request, NOTICE_COOKIE, quote(notice[:600]), max_age=60)
    return response
