"""Request body size limit, enforced on the bytes received (chunked bodies included)."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from oss_api.errors import MalformedBody, RequestTooLarge


class BodyTooLarge(Exception):
    pass


def check_parameters_size(parameters: dict[str, Any], max_bytes: int) -> None:
    """Refuse parameters over ``max_bytes`` serialized (413), or holding NaN or Infinity (400)."""
    try:
        size = len(json.dumps(parameters, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode())
    except ValueError:
        # Python's parser accepts NaN/Infinity (and reads 1e400 as Infinity); JSON
        # (and PostgreSQL's jsonb) does not.
        raise MalformedBody(
            "malformed JSON body: NaN and Infinity are not JSON numbers (1e400 and beyond overflow to Infinity)"
        ) from None
    if size > max_bytes:
        raise RequestTooLarge(f"parameters are {size} bytes; the limit is {max_bytes}")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        received = 0
        too_large = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            # The framework turns the aborted read into its own error response;
            # send the 413 in its place.
            if not too_large:
                await send(message)
            elif message["type"] == "http.response.start":
                await self._reject(send)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body: dict[str, Any] = {"error": f"request body over {self.max_bytes} bytes"}
        payload = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})
