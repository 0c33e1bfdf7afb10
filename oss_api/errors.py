"""All HTTP error mapping in one place: exceptions carry or imply a status code."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.routing import Match, Mount

from shared.saga import InvalidAction
from shared.service import ServiceError
from shared.storage import StorageUnavailable, TaskConflict

log = logging.getLogger(__name__)


class RequestTooLarge(ServiceError):
    status_code = 413


class MalformedBody(ServiceError):
    status_code = 400


class FieldProblem(BaseModel):
    field: str = Field(description='Dotted path of the field, e.g. "parameters.cpu" ("" for the body itself)')
    problem: str


class Problem(BaseModel):
    """Every error answer of /api (and /healthz): what went wrong, in one sentence."""

    error: str
    detail: list[FieldProblem] | None = Field(default=None, description="The fields at fault, when there are some")


class Invalid(Problem):
    """A 422: the request is well-formed JSON, but some fields are wrong; ``detail`` names each."""

    detail: list[FieldProblem]


# What each error status means, the same wherever it is answered.
_MEANINGS: dict[int, tuple[type[Problem], str]] = {
    400: (Problem, "Malformed JSON body (not JSON, not UTF-8, nested too deeply), or NaN/Infinity in parameters"),
    401: (Problem, "Missing or unknown API key (only when API keys are configured)"),
    403: (Problem, "The key's user may not act for the user_id asked for"),
    404: (Problem, "Not found (another user's resource is not found either)"),
    409: (Problem, "Conflicts with the stored state"),
    413: (Problem, "The request body, or its parameters, are over the size limit"),
    422: (Invalid, "Invalid fields; detail names each"),
    503: (Problem, "The task database is unavailable; try again shortly"),
}


def answers(*codes: int, **meanings: str) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that answers ``codes``; ``meanings`` ("e404"=...) say more than the default."""
    documented: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        model, description = _MEANINGS[code]
        documented[code] = {"model": model, "description": meanings.get(f"e{code}", description)}
    if 401 in codes:
        documented[401]["headers"] = {
            "WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}},
        }
    return documented


_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")
_STATIC = ("GET", "HEAD")  # the app's mounts are static files


def _allowed(request: Request) -> str:
    """Every method some route serves at the request's path (the router names only its first route's)."""
    routes = request.app.router.routes
    # Matched from the top: inside a mount, the scope's root_path is the mount's.
    scope = {**request.scope, "root_path": request.scope.get("app_root_path", request.scope.get("root_path", ""))}
    mounted = any(isinstance(r, Mount) and r.matches(scope)[0] is Match.FULL for r in routes)
    return ", ".join(
        method
        for method in _METHODS
        if (mounted and method in _STATIC)
        or any(not isinstance(r, Mount) and r.matches({**scope, "method": method})[0] is Match.FULL for r in routes)
    )


# FastAPI's answer to a body it cannot parse at all (json.loads raised something
# other than a syntax error): invalid UTF-8, nesting past the recursion limit, an
# integer with more than 4300 digits.
_UNPARSABLE = "There was an error parsing the body"


def _body(
    status: int,
    error: str,
    detail: list[dict[str, str]] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    content: dict[str, object] = {"error": error}
    if detail is not None:
        content["detail"] = detail
    return JSONResponse(status_code=status, content=content, headers=headers)


def answer_for(exc: Exception) -> JSONResponse | None:
    """The answer to ``exc`` wherever it is raised, the router's handlers' and the direct routes' alike:
    a service's refusal (its status), a conflict with the stored state, the store unavailable;
    None for an exception of another kind."""
    if isinstance(exc, ServiceError):  # its status, its message, its fields and headers
        return _body(exc.status_code, str(exc), getattr(exc, "detail", None), headers=getattr(exc, "headers", None))
    if isinstance(exc, InvalidAction | TaskConflict):
        return _body(409, str(exc))
    if isinstance(exc, StorageUnavailable):
        log.error("storage unavailable: %s", exc)
        return _body(503, "the task database is unavailable; try again shortly")
    return None


def install(app: FastAPI) -> None:
    async def answered(_: Request, exc: Exception) -> JSONResponse:
        answer = answer_for(exc)
        assert answer is not None  # installed for those kinds alone
        return answer

    for kind in (ServiceError, InvalidAction, TaskConflict, StorageUnavailable):
        app.add_exception_handler(kind, answered)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """The framework's own errors (unknown route, wrong method, unparsable body), in our format."""
        if exc.status_code == 400 and exc.detail == _UNPARSABLE:
            message = "malformed JSON body: cannot parse it (not UTF-8, nested too deeply, or a number too long)"
        elif exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path[:200]}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path[:200]}"
            return _body(405, message, headers={**(exc.headers or {}), "Allow": _allowed(request)})
        else:
            message = str(exc.detail)
        return _body(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            ctx = errors[0].get("ctx", {})
            return _body(400, f"malformed JSON body: {ctx.get('error', 'cannot parse')}")
        detail = [
            {"field": ".".join(str(p) for p in e["loc"] if p != "body"), "problem": e["msg"]}
            for e in errors
        ]
        summary = "; ".join(f"{d['field'] or 'body'}: {d['problem']}" for d in detail)
        return _body(422, f"invalid request: {summary}", json.loads(json.dumps(detail, default=str)))
