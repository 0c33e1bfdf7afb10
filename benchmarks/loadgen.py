"""The load generators' HTTP client: keep-alive connections on the stdlib, JSON by orjson.

The benchmarks' clients run on the two cores they measure, so what a client
spends on a request counts against the stack under test. With ``e2e_flows.py``'s
clients on ``http.client`` instead of httpx, the machine's CPU per flow outside
the stack and its servers fell to about a third (benchmarks/README.md, "The load
generator's own cost"); neither client is part of Asyncflow.
"""

from __future__ import annotations

import http.client
import threading
from typing import Any
from urllib.parse import urlsplit

import orjson


class KeepAlive:
    """HTTP/1.1 requests to one server, one kept connection per thread.

    A request that may be sent twice (a GET, or a POST the caller marks
    ``repeatable``, such as a submit naming its task) is sent once more on a new
    connection when its kept one fails: uvicorn closes a connection idle for 5 s.
    Any other failure is raised: the server may have acted on the request.
    """

    def __init__(self, url: str, timeout: float = 60) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout = timeout
        self._local = threading.local()

    def call(self, method: str, path: str, body: Any = None, repeatable: bool = False) -> tuple[int, Any]:
        """(status, the answer: parsed if it is JSON, else its text; None if empty)."""
        payload = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        may_resend = repeatable or method == "GET"
        while True:
            conn = getattr(self._local, "conn", None)
            kept = conn is not None
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                conn.request(method, path, body=payload, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except BaseException as exc:
                conn.close()
                self._local.conn = None
                if kept and may_resend and isinstance(exc, ConnectionError):  # RemoteDisconnected is one
                    may_resend = False
                    continue
                raise
            return response.status, _answer(data)

    def close(self) -> None:
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def __enter__(self) -> KeepAlive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _answer(data: bytes) -> Any:
    if not data:
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:  # a plain-text error page, say
        return data.decode("utf-8", "replace")
