"""Who is browsing the dashboard, and the guard on its actions against cross-site requests.

API keys are bearer tokens; a browser cannot add a header to a link it follows.
So the login form takes the key once and keeps it in a cookie the page's scripts
cannot read (HttpOnly), that is sent to /ui only (Path) and never with a request
another site starts (SameSite=Strict). A request with ``Authorization`` or
``X-API-Key`` is served as on /api, without the cookie. With authentication off
(no keys configured) everyone is the anonymous admin and there is no login.

Every action (a POST under /ui) must come from a page of this dashboard: the
browser's ``Sec-Fetch-Site`` (else ``Origin``) must name this site, and the form
must carry the token of the ``asyncflow_csrf`` cookie (double submit), which
another site can neither read nor set.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import parse_qs, urlsplit

from fastapi import Depends, Request, Response
from starlette.requests import ClientDisconnect

from oss_api.auth import Caller, KeyTable, identify, request_caller

KEY_COOKIE = "asyncflow_key"
CSRF_COOKIE = "asyncflow_csrf"
NOTICE_COOKIE = "asyncflow_notice"
# Forms are small (a key, a few ids); a bigger body is not one of ours.
MAX_FORM_BYTES = 64 * 1024


class LoginNeeded(Exception):
    """No usable key: the page answers with the login form (see oss_api.ui.install)."""

    def __init__(self, problem: str | None = None) -> None:
        super().__init__(problem or "")
        self.problem = problem


class Refused(Exception):
    """An action the dashboard will not do; answered with an HTML page (oss_api.ui.install)."""

    status_code = 403


class CrossSite(Refused):
    pass


class ReadOnly(Refused):
    pass


class CutShort(Refused):
    """The browser hung up before the form's body ended: answered, though nobody reads it,
    rather than raised to the server's error log."""

    status_code = 400


@dataclass(frozen=True)
class Viewer:
    caller: Caller
    auth: bool  # whether keys are configured (then there is a logout)
    csrf: str  # the token this browser's forms carry
    fresh_csrf: bool = False  # new to this browser: the page sets its cookie

    @property
    def admin(self) -> bool:
        return self.caller.admin

    @property
    def user(self) -> str | None:
        return self.caller.user

    def may_act(self) -> None:
        if not self.caller.admin:
            raise ReadOnly(f"this key (user {self.caller.user!r}) is read-only: actions need an admin key")


def csrf_of(request: Request) -> tuple[str, bool]:
    """This browser's form token, and whether it is new (then the page sets its cookie)."""
    csrf = request.cookies.get(CSRF_COOKIE) or ""
    if len(csrf) == 32:
        return csrf, False
    return secrets.token_hex(16), True


def viewer(request: Request) -> Viewer:
    """The FastAPI dependency of every /ui page: raises LoginNeeded instead of 401."""
    keys: KeyTable = request.app.state.api_keys
    csrf, fresh = csrf_of(request)
    if not keys.enabled:
        return Viewer(identify(request, None), auth=False, csrf=csrf, fresh_csrf=fresh)
    headers = request.headers
    if headers.get("authorization") or headers.get("x-api-key"):
        return Viewer(request_caller(request), auth=True, csrf=csrf, fresh_csrf=fresh)
    key = request.cookies.get(KEY_COOKIE)
    if not key:
        raise LoginNeeded()
    found = keys.lookup(key)
    if found is None:
        raise LoginNeeded("that key is no longer valid: sign in again")
    return Viewer(found, auth=True, csrf=csrf, fresh_csrf=fresh)


ViewerDep = Annotated[Viewer, Depends(viewer)]


async def form(request: Request) -> dict[str, list[str]]:
    """The posted form (application/x-www-form-urlencoded), after the cross-site checks."""
    same_site(request)
    try:
        body = await request.body()
    except ClientDisconnect:
        raise CutShort("the form ended early: the browser disconnected") from None
    if len(body) > MAX_FORM_BYTES:
        raise CrossSite("form too large")
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=1000)
    token = (fields.get("csrf") or [""])[0]
    cookie = request.cookies.get(CSRF_COOKIE) or ""
    if len(cookie) != 32 or not hmac.compare_digest(token.encode(), cookie.encode()):
        raise CrossSite("the form is stale or came from another site: reload the page and try again")
    return fields


FormDep = Annotated[dict[str, list[str]], Depends(form)]


def same_site(request: Request) -> None:
    """Refuse a request another site started (browsers send these headers on every POST)."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None:
        if fetch_site not in ("same-origin", "none"):
            raise CrossSite(f"refused a {fetch_site} request: actions must come from this dashboard")
        return
    origin = request.headers.get("origin")
    if origin is not None and origin != "null":
        if urlsplit(origin).netloc != request.headers.get("host", ""):
            raise CrossSite("refused a request from another origin: actions must come from this dashboard")
    elif origin == "null":
        raise CrossSite("refused a request from an opaque origin")


def field(fields: Mapping[str, list[str]], name: str, default: str = "") -> str:
    values = fields.get(name)
    return values[0] if values else default


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int | None = None) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def local_path(target: str, default: str = "/ui") -> str:
    """``target`` if it is a path of this dashboard, else ``default``: no open redirect."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not parts.path.startswith("/ui") or "\\" in target:
        return default
    return target
