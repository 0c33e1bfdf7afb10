"""Request body size limit, enforced on the bytes received (chunked bodies included)."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    pass


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


# Containers nested in ``parameters``, the object itself included. Deeper
# documents cannot be rendered back (the serializer stops near 255 levels).
MAX_PARAMETERS_DEPTH = 32


def json_problem(value: Any, root: str, max_depth: int = MAX_PARAMETERS_DEPTH) -> str | None:
    """What makes a parsed JSON value unstorable, or None; ``root`` names it in the message.

    Rejected: nesting deeper than ``max_depth``, the NUL character in a string
    or key (PostgreSQL text and jsonb cannot hold it) and lone UTF-16 surrogates
    such as ``"\\ud800"`` (not Unicode). Walks iteratively: no recursion limit.
    """
    stack: list[tuple[Any, str, int]] = [(value, root, 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            problem = _string_problem(item)
            if problem:
                return f"{problem} (at {path})"
            continue
        if isinstance(item, dict):
            children = [(v, f"{path}.{_clip(k) if isinstance(k, str) else k}", k) for k, v in item.items()]
        elif isinstance(item, list):
            children = [(v, f"{path}[{i}]", None) for i, v in enumerate(item)]
        else:
            continue
        if depth > max_depth:
            return f"nested deeper than {max_depth} levels (at {path})"
        for child, child_path, key in children:
            if isinstance(key, str):
                problem = _string_problem(key)
                if problem:
                    return f"{problem} (in a key at {child_path})"
            stack.append((child, child_path, depth + 1))
    return None


def _string_problem(text: str) -> str | None:
    if "\x00" in text:
        return "strings cannot contain the NUL character \\u0000"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "strings cannot contain lone UTF-16 surrogates such as \\ud800"
    return None


def _clip(text: str, width: int = 40) -> str:
    # The key goes into the error message: a lone surrogate in it would make the answer unencodable.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= width else text[:width] + "…"
