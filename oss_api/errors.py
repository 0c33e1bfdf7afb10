"""All HTTP error mapping in one place: exceptions carry or imply a status code."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from shared.saga import InvalidAction
from shared.service import ServiceError
from shared.storage import StorageUnavailable, TaskConflict

log = logging.getLogger(__name__)


class RequestTooLarge(ServiceError):
    status_code = 413


class MalformedBody(ServiceError):
    status_code = 400


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


def install(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(_: Request, exc: ServiceError) -> JSONResponse:
        detail = getattr(exc, "detail", None)
        return _body(exc.status_code, str(exc), detail, headers=getattr(exc, "headers", None))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """The framework's own errors (unknown route, wrong method, unparsable body), in our format."""
        if exc.status_code == 400 and exc.detail == _UNPARSABLE:
            message = "malformed JSON body: cannot parse it (not UTF-8, nested too deeply, or a number too long)"
        elif exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path[:200]}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path[:200]}"
        else:
            message = str(exc.detail)
        return _body(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(InvalidAction)
    async def invalid_action(_: Request, exc: InvalidAction) -> JSONResponse:
        return _body(409, str(exc))

    @app.exception_handler(TaskConflict)
    async def conflict(_: Request, exc: TaskConflict) -> JSONResponse:
        return _body(409, str(exc))

    @app.exception_handler(StorageUnavailable)
    async def unavailable(_: Request, exc: StorageUnavailable) -> JSONResponse:
        log.error("storage unavailable: %s", exc)
        return _body(503, "the task database is unavailable; try again shortly")

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
