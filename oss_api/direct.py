"""The hottest POST routes, served in front of the router.

The router tries each route's pattern in turn, through every included router, and
FastAPI's route wrapper then solves the endpoint's dependencies inside two exit
stacks: served past them, create_task and hold_tasks take a third to two fifths
less of the API's CPU a call (benchmarks/README.md, "The v1 calls in front of the router").

An endpoint served here takes the request alone. It answers every outcome itself
but the exceptions the app answers alike wherever they are raised (a missing or
unknown key's 401, a conflict's 409, say: ``errors.answer_for``); or it
answers None, and the request, its body as read, goes on to the router, whose
answer it is: so a submit whose body or headers FastAPI would refuse gets
FastAPI's own refusal, and only a well-formed one is served here.
Its route stays registered: the OpenAPI document describes it, and any other
method on its path is the router's to answer. So is every request while FastAPI's
OpenTelemetry instrumentation is on, which learns the route's name from the router.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from oss_api import errors

# None: the router's to answer (see above).
Endpoint = Callable[[Request], Awaitable[Response | None]]


class DirectPosts:
    def __init__(self, app: ASGIApp, endpoints: Mapping[str, Endpoint]) -> None:
        self.app = app
        self.endpoints = dict(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # By the whole path as the server gives it: a path the table does not name,
        # a root_path's prefix included, is the router's.
        endpoint = None
        if scope["type"] == "http" and scope["method"] == "POST" and scope.get("fastapi.telemetry") is None:
            endpoint = self.endpoints.get(scope["path"])
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        read: list[Message] = []

        async def reading() -> Message:
            message = await receive()
            read.append(message)
            return message

        request = Request(scope, reading, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            response = errors.answer_for(exc)
            if response is None:
                raise
        if response is None:
            await self.app(scope, _replay(read, receive), send)
            return
        await response(scope, receive, send)


def _replay(read: list[Message], receive: Receive) -> Receive:
    """``receive`` with the messages already ``read`` given again first, in order."""
    pending = read[::-1]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def post_endpoints(router: APIRouter, *names: str) -> dict[str, Endpoint]:
    """The endpoints of ``router``'s POST routes named ``names``, by path.

    The paths are the router's own: it must be included in the app without a prefix.
    """
    routes = {r.name: r for r in router.routes if isinstance(r, APIRoute) and r.methods == {"POST"}}
    return {routes[name].path: routes[name].endpoint for name in names}
