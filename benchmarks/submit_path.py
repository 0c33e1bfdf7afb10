#!/usr/bin/env python
"""POST /api/tasks through the ASGI app, in one process, without a server or a socket.

Each request goes through FastAPI as uvicorn hands it over: the middleware, the
routing, the caller (API keys off, as in the other benchmarks), the body's
checks, the service's decision (through the coalescing of submits and its
worker thread) and the task document answered. The task store is in memory and
the broker a queue, and the log lines are switched off, so what it counts is the
API process's own Python but for its log line, not PostgreSQL's, RabbitMQ's or
HTTP parsing (``intake.py`` and ``e2e_flows.py`` measure those too).

It prints the process CPU per request. For a figure the machine's noise does not
move, count instructions under callgrind at two sizes and take the difference,
which cancels start-up and warm-up:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/submit_path.py --requests 200
    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/submit_path.py --requests 1200
    # (Collected of the second - Collected of the first) / 1000 = instructions per submit

    .venv/bin/python benchmarks/submit_path.py --requests 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from stack import REPO, machine_info  # noqa: E402

sys.path.insert(0, str(REPO))

from oss_api.app import create_app  # noqa: E402
from shared.flows import load_flows  # noqa: E402
from shared.testing import InProcess  # noqa: E402

WARM_UP = 200
BODY = json.dumps({"flow": "noop", "parameters": {"n": 1}}).encode()


def request(app: Any, body: bytes) -> Any:
    """One POST /api/tasks, as an ASGI server hands it to the app; its status code."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/api/tasks", "raw_path": b"/api/tasks", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
    }
    events = [{"type": "http.request", "body": body, "more_body": False}]
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        if events:
            return events.pop()
        await asyncio.Event().wait()  # the client never disconnects
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    async def call() -> int:
        await app(scope, receive, send)
        return status[0]

    return call()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=5000, help="submits measured (default 5000)")
    args = p.parse_args(argv)
    logging.disable(logging.WARNING)  # silences the warning that keys are off, and each submit's INFO line
    with tempfile.TemporaryDirectory(prefix="af-submit-path-") as home:
        per_request = measure(Path(home), args.requests)
    result = {"requests": args.requests, "cpu_ms_per_request": round(per_request, 4), "machine": machine_info()}
    print(f"{args.requests} submits through the ASGI app: {per_request:.4f} ms CPU each")
    print("RESULT " + json.dumps(result))
    return 0


def measure(home: Path, requests: int) -> float:
    """CPU ms per submit over ``requests`` of them, after a warm-up."""
    runtime = InProcess(load_flows(REPO / "tests" / "support" / "flows.yaml"), home)
    app = create_app(runtime.runtime)

    async def run() -> float:
        async with app.router.lifespan_context(app):
            for _ in range(WARM_UP):
                if await request(app, BODY) != 201:
                    raise SystemExit("a warm-up submit was refused")
            cpu = time.process_time()
            for i in range(requests):
                if await request(app, BODY) != 201:
                    raise SystemExit("a submit was refused")
                if i % 1000 == 0:
                    runtime.publisher.messages.clear()  # no consumer here: the queue would only grow
            return (time.process_time() - cpu) / requests * 1000

    return uvloop.run(run())


if __name__ == "__main__":
    sys.exit(main())
