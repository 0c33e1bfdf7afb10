"""The load generators' HTTP client: keep-alive connections on the stdlib, JSON by orjson.

The benchmarks' clients run on the two cores they measure, so what a client
spends on a request counts against the stack under test. httpx spends about
three times the CPU of ``http.client`` with orjson on a submit (benchmarks/README.md,
"The load generator's own cost"); neither is part of Asyncflow.
"""

from __future__ import annotations

import http.client
import threading
from typing import Any
from urllib.parse import urlsplit

import orjson


class KeepAlive:
    """HTTP/1.1 requests to one server, one kept connection per thread.

    A kept connection the server closed while it was idle (uvicorn closes them
    after 5 s) is opened again and the request sent once more: the server never
    read it. A failure on a new connection is raised.
    """

    def __init__(self, url: str, timeout: float = 60) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout = timeout
        self._local = threading.local()

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, the JSON answer, None if empty)."""
        payload = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
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
                if kept and isinstance(exc, ConnectionError):  # RemoteDisconnected is one
                    continue
                raise
            return response.status, orjson.loads(data) if data else None

    def close(self) -> None:
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
