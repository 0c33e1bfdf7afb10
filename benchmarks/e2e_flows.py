#!/usr/bin/env python
"""End-to-end benchmark: N three-step no-op flows through Asyncflow's real processes.

Starts ``asyncflow api``, ``asyncflow scheduler`` and ``asyncflow worker alpha beta``
as subprocesses on a fresh backend (embedded SQLite, PostgreSQL + RabbitMQ or
PostgreSQL + Redis), submits the ``noop`` flow of tests/support/flows.yaml over
HTTP and reads the figures back from the task documents (server timestamps).

Throughput mode (default): submit N flows as fast as a few HTTP clients can,
wait for all of them; flows/s = N / (last time_end - first time_create).
Latency mode (--rate R): submit N flows at R flows/s (open loop); submit->done
latency = time_end - time_create of each task.
Both modes: per-step dispatch latency from the attempt log (previous attempt's
ended_at -> next attempt's started_at; first step: time_create -> started_at).

Each run is isolated: a fresh ASYNCFLOW_HOME, a fresh PostgreSQL database, a
RabbitMQ vhost of its own (or an empty Redis db from 9 up), all removed at the end.

It reports, it does not judge: the exit status is non-zero only when a flow did
not succeed (1), the run timed out (2), the stack could not be set up or one of
its processes died (3), or the run was interrupted (130).

    .venv/bin/python benchmarks/e2e_flows.py --backend embedded --flows 200
    .venv/bin/python benchmarks/e2e_flows.py --backend postgres-rabbitmq --flows 500
    .venv/bin/python benchmarks/e2e_flows.py --backend postgres-rabbitmq --rate 50 --flows 200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import (  # noqa: E402
    SPEC_REFERENCE,
    STOPPED,
    SUCCESS,
    analyse,
    conclude,
    cpu_figures,
    print_report,
    summary_head,
)
from loadgen import KeepAlive  # noqa: E402
from runner import Run, add_keep_options, check_positive, guarded, measure, run_parser  # noqa: E402
from stack import Backend, SetupError, Stack, log, machine_info, make_backend  # noqa: E402

FLOW = "noop"


# --- HTTP side --------------------------------------------------------------------------


class Api:
    """The load generator's side of the API (:mod:`loadgen`: its clients share the measured cores).

    Each submit names its task: sent again on a new connection, it would be a
    replay (answered 200), never a second flow.
    """

    def __init__(self, url: str) -> None:
        self.http = KeepAlive(url, timeout=30)

    def submit(self, user_id: str) -> tuple[str, float]:
        """POST one noop flow; returns (task_id, seconds the request took)."""
        task_id = uuid.uuid4().hex
        body = {"flow": FLOW, "parameters": {}, "user_id": user_id, "task_id": task_id}
        t0 = time.perf_counter()
        status, answer = self.http.call("POST", "/api/tasks", body, repeatable=True)
        elapsed = time.perf_counter() - t0
        if status not in (200, 201):
            raise RuntimeError(f"submit answered {status}: {str(answer)[:300]}")
        return task_id, elapsed

    def get(self, task_id: str) -> dict[str, Any]:
        return self._read(f"/api/tasks/{task_id}")

    def any_with_status(self, user_id: str, status: int) -> bool:
        return bool(self._read(f"/api/tasks?{urlencode({'user_id': user_id, 'status': status, 'limit': 1})}")["tasks"])

    def all_stopped(self, user_id: str) -> bool:
        return not any(self.any_with_status(user_id, s) for s in (1, 2, 3))

    def _read(self, path: str) -> Any:
        status, answer = self.http.call("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path} answered {status}: {str(answer)[:300]}")
        return answer


def warm_up(api: Api, stack: Stack, timeout: float) -> float:
    """One flow through every process (worker pool, broker, database); returns its seconds."""
    task_id, _ = api.submit("bench-warmup")
    deadline = time.monotonic() + timeout
    while True:
        doc = api.get(task_id)
        if doc["task_status"] in STOPPED:
            if doc["task_status"] != SUCCESS:
                raise SetupError(f"warm-up flow ended with status {doc['status_name']}: {doc['task_message']}")
            return doc["time_end"] - doc["time_create"]
        stack.check_alive()
        if time.monotonic() > deadline:
            raise SetupError(f"warm-up flow not done after {timeout:g}s; worker log:\n{stack.tail('worker')}")
        time.sleep(0.05)


def print_idle_cpu(stack: Stack, seconds: float) -> None:
    """What each process costs with nothing to do: polling and sweeps, not work."""
    time.sleep(2)  # the warm-up flow's last effects
    before = stack.cpu()
    time.sleep(seconds)
    after = stack.cpu()
    used = {key: (after[key] - before[key]) / seconds * 100 for key in after}
    figures = ", ".join(f"{key} {pct:.2f}" for key, pct in used.items())
    print(f"idle CPU over {seconds:g} s, % of one core: {figures}; all {sum(used.values()):.2f}")


def fetch_docs(api: Api, task_ids: list[str]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(api.get, task_ids))


# --- main ------------------------------------------------------------------------------------


def add_stack_options(p: argparse.ArgumentParser) -> None:
    """The options of the stack :func:`ready_stack` starts (with :func:`runner.run_parser`'s)."""
    p.add_argument("--log-level", default=None, help="ASYNCFLOW_LOG_LEVEL for the processes (default: theirs)")
    p.add_argument("--env", dest="extra_env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the processes, e.g. ASYNCFLOW_WORKER_PREFETCH=8")
    add_keep_options(p, "process logs")
    p.add_argument("--rabbitmq-vhost", default=None,
                   help="use this existing vhost (its asyncflow.* queues are purged) instead of a fresh one")
    p.add_argument("--redis-db", type=int, default=None, help="Redis db (default: first empty one from 9 up)")


def parsed(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` by ``p``, its ``--env`` items and counts checked."""
    args = p.parse_args(argv)
    for item in args.extra_env:
        if "=" not in item:
            p.error(f"--env wants KEY=VALUE, got {item!r}")
    check_positive(p, args)
    return args


def ready_stack(args: argparse.Namespace, run: Run) -> tuple[Backend, Stack, Api, float]:
    """The stack started on a backend of its own, healthy, one flow through it; removed when ``run`` ends.

    Also the warm-up flow's seconds.
    """
    log(f"backend {args.backend}: setting up (home {run.home})")
    backend = make_backend(args)
    run.exits.callback(backend.cleanup)
    extra_env = dict(item.split("=", 1) for item in args.extra_env)
    stack = Stack(run.home, backend, args.concurrency, args.log_level, extra_env)
    run.stop_at_end(stack, "processes")
    stack.start()
    stack.wait_healthy(60)
    api = Api(stack.url)
    warm = warm_up(api, stack, 120)
    log(f"stack ready on {stack.url}; warm-up flow took {warm * 1000:.1f} ms")
    return backend, stack, api, warm


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = run_parser(__doc__, ["embedded", "postgres-rabbitmq", "postgres-redis"], "embedded",
                   "concurrent HTTP clients (default 4)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of the text report")
    p.add_argument("--idle", type=float, default=0, metavar="SECONDS",
                   help="first measure the CPU each process uses while idle for this long")
    add_stack_options(p)
    return parsed(p, argv)


def bench(args: argparse.Namespace, run: Run) -> int:
    machine = machine_info()
    backend, stack, api, warm = ready_stack(args, run)
    if args.idle > 0:
        print_idle_cpu(stack, args.idle)

    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    m = measure(args, stack, lambda _i: api.submit(run_id), lambda _sub: api.all_stopped(run_id), "clients")

    docs = fetch_docs(api, m.sub.ids)
    results = analyse(docs)
    per_flow_ms = {k: round(v * 1000 / max(len(docs), 1), 2) for k, v in m.cpu.items()}
    summary: dict[str, Any] = {
        **summary_head(args, machine, backend, warm, m, "post_ms", (50, 90, 99), extra_env=args.extra_env),
        "results": results,
        "cpu": cpu_figures(m, per_flow_ms),
        "spec_reference": SPEC_REFERENCE,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_report(summary)
    done_seconds = [d["time_end"] - d["time_create"] for d in docs if d["task_status"] == SUCCESS]
    status = conclude("asyncflow", args, summary, m, results["succeeded"], done_seconds)
    if status == 1:
        log(f"not every flow succeeded: {results['statuses']}, {len(m.sub.errors)} submit errors "
            f"{m.sub.errors[:3]}")
    return status


def main(argv: list[str] | None = None) -> int:
    return guarded(parse_args(argv), bench, "af_bench_", "a process died", "process logs")


if __name__ == "__main__":
    sys.exit(main())
