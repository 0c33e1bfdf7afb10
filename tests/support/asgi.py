"""A request sent straight to an ASGI app, for what an HTTP client cannot send: a body cut short."""

from __future__ import annotations

from typing import Any

from starlette.types import Message


async def post_cut_short(app: Any, path: str, headers: list[tuple[bytes, bytes]], part: bytes) -> tuple[int, bytes]:
    """POST ``part`` of a body to ``path``, then the client is gone: the answer's status and body.

    The app must answer, not raise: what it raises, the server logs as an error with a traceback.
    """
    came: list[Message] = [{"type": "http.request", "body": part, "more_body": True}, {"type": "http.disconnect"}]
    sent: list[Message] = []

    async def receive() -> Message:
        return came.pop(0) if came else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
    }
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])
