"""A stand-in for an external moderation/transcoding API whose jobs take time.

    POST /jobs      {"kind": "moderate" | "transcode", "source": URL} -> {"job_id": ID}
    GET  /jobs/ID   -> {"state": "running"} or {"state": "done", "result": {...}}

A job is done ``duration`` seconds after it was submitted (time.monotonic), so
callers must come back later, as with a real video service (seed 003 §三).
Results: moderation ``{"approved": bool}`` (rejected when the source URL
contains "reject"); transcoding ``{"url": ...}``. Request handlers never sleep.

    with FakeMediaService(duration=2) as media:
        print(media.url)
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KINDS = ("moderate", "transcode")


class FakeMediaService:
    def __init__(self, duration: float = 2.0, host: str = "127.0.0.1", port: int = 0) -> None:
        self.duration = duration
        self._jobs: dict[str, tuple[str, str, float]] = {}  # id -> kind, source, submitted
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeMediaService:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-media", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> FakeMediaService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, kind: str, source: str) -> str:
        job_id = uuid.uuid4().hex[:12]
        with self._lock:
            self._jobs[job_id] = (kind, source, time.monotonic())
        return job_id

    def status(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            return None
        kind, source, submitted = job
        if time.monotonic() - submitted < self.duration:
            return {"state": "running"}
        if kind == "moderate":
            return {"state": "done", "result": {"approved": "reject" not in source}}
        name = source.rstrip("/").rsplit("/", 1)[-1] or "video"
        return {"state": "done", "result": {"url": f"{self.url}/media/{job_id}/{name}.m3u8"}}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path != "/jobs":
                    return self._send(404, {"error": "not found"})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                    kind, source = body["kind"], body["source"]
                except (ValueError, KeyError, TypeError):
                    return self._send(400, {"error": 'expected {"kind": ..., "source": ...}'})
                if kind not in KINDS or not isinstance(source, str):
                    return self._send(400, {"error": f"kind is one of {KINDS}, source a URL"})
                self._send(200, {"job_id": service.submit(kind, source)})

            def do_GET(self) -> None:
                prefix = "/jobs/"
                status = service.status(self.path[len(prefix):]) if self.path.startswith(prefix) else None
                if status is None:
                    return self._send(404, {"error": "no such job"})
                self._send(200, status)

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
                pass  # quiet: the worker logs what matters

        return Handler


if __name__ == "__main__":
    with FakeMediaService() as media:
        print(f"fake media service on {media.url} (Ctrl-C to stop)")
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
