"""The hottest POST routes, served in front of the router.

The router tries each route's pattern in turn, through every included router, and
FastAPI's route wrapper then solves the endpoint's dependencies inside two exit
stacks: served past them, create_task and hold_tasks take two fifths less of the
API's CPU a call (benchmarks/README.md, "The v1 calls in front of the router").

An endpoint served here takes the request alone and answers every outcome itself,
but for a key the caller may not use, which is answered as the router's handler
answers it. Its route stays registered: the OpenAPI document describes it, and any
other method on its path is the router's to answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from oss_api import errors
from shared.errors import ServiceError

Endpoint = Callable[[Request], Awaitable[Response]]


class DirectPosts:
    def __init__(self, app: ASGIApp, endpoints: Mapping[str, Endpoint]) -> None:
        self.app = app
        self.endpoints = dict(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # By the whole path: behind a root_path a request goes to the router, as before.
        endpoint = self.endpoints.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except ServiceError as exc:
            response = errors.service_error(exc)
        await response(scope, receive, send)


def post_endpoints(router: APIRouter, *names: str) -> dict[str, Endpoint]:
    """The endpoints of ``router``'s POST routes named ``names``, by path."""
    routes = {r.name: r for r in router.routes if isinstance(r, APIRoute) and r.methods == {"POST"}}
    return {routes[name].path: routes[name].endpoint for name in names}
