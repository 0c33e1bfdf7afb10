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
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import SPEC_REFERENCE, STOPPED, SUCCESS, analyse, dist_ms, pct, print_report  # noqa: E402
from stack import Backend, SetupError, Stack, log, machine_cpu, machine_info, make_backend  # noqa: E402

FLOW = "noop"


# --- HTTP side --------------------------------------------------------------------------


class Api:
    def __init__(self, url: str) -> None:
        self.url = url
        self._local = threading.local()

    @property
    def client(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(base_url=self.url, timeout=30)
        return client

    def submit(self, user_id: str) -> tuple[str, float]:
        """POST one noop flow; returns (task_id, seconds the request took)."""
        t0 = time.perf_counter()
        r = self.client.post("/api/tasks", json={"flow": FLOW, "parameters": {}, "user_id": user_id})
        elapsed = time.perf_counter() - t0
        if r.status_code not in (200, 201):
            raise RuntimeError(f"submit answered {r.status_code}: {r.text[:300]}")
        return r.json()["task_id"], elapsed

    def get(self, task_id: str) -> dict[str, Any]:
        r = self.client.get(f"/api/tasks/{task_id}")
        r.raise_for_status()
        return r.json()

    def any_with_status(self, user_id: str, status: int) -> bool:
        r = self.client.get("/api/tasks", params={"user_id": user_id, "status": status, "limit": 1})
        r.raise_for_status()
        return bool(r.json()["tasks"])

    def all_stopped(self, user_id: str) -> bool:
        return not any(self.any_with_status(user_id, s) for s in (1, 2, 3))


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


@dataclass
class Submitted:
    task_ids: list[str] = field(default_factory=list)
    post_seconds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    first_start: float = 0.0  # perf_counter
    last_end: float = 0.0
    schedule_lag: list[float] = field(default_factory=list)  # latency mode: send time - planned time
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, task_id: str, seconds: float) -> None:
        with self.lock:
            self.task_ids.append(task_id)
            self.post_seconds.append(seconds)
            self.last_end = max(self.last_end, time.perf_counter())


def submit_burst(api: Api, run_id: str, n: int, clients: int, deadline: float) -> Submitted:
    out = Submitted()
    counter = iter(range(n))
    counter_lock = threading.Lock()

    def client_loop() -> None:
        while time.monotonic() < deadline:
            with counter_lock:
                if next(counter, None) is None:
                    return
            try:
                out.add(*api.submit(run_id))
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with out.lock:
                    out.errors.append(repr(exc))

    out.first_start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def submit_at_rate(api: Api, run_id: str, n: int, rate: float, clients: int, deadline: float) -> Submitted:
    """Open loop: request i leaves at t0 + i/rate whatever happened to the others."""
    out = Submitted()
    interval = 1.0 / rate

    def one(planned: float) -> None:
        out.schedule_lag.append(time.perf_counter() - planned)
        try:
            out.add(*api.submit(run_id))
        except Exception as exc:  # noqa: BLE001 - counted and reported
            with out.lock:
                out.errors.append(repr(exc))

    with ThreadPoolExecutor(max_workers=max(clients, 8)) as pool:
        t0 = out.first_start = time.perf_counter()
        for i in range(n):
            planned = t0 + i * interval
            delay = planned - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if time.monotonic() > deadline:
                break
            pool.submit(one, planned)
    return out


def wait_all_stopped(api: Api, stack: Stack, run_id: str, deadline: float) -> bool:
    last_note = time.monotonic()
    while time.monotonic() < deadline:
        stack.check_alive()
        if api.all_stopped(run_id):
            return True
        if time.monotonic() - last_note > 10:
            log("waiting for the flows to finish...")
            last_note = time.monotonic()
        time.sleep(0.1)
    return False


def fetch_docs(api: Api, task_ids: list[str]) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(api.get, task_ids))


# --- main ------------------------------------------------------------------------------------


def print_result_line(args: argparse.Namespace, summary: dict[str, Any], docs: list[dict[str, Any]],
                      status: int) -> None:
    """The key figures as one ``RESULT {json}`` line, the same keys as celery_chain.py's."""
    e2e = [(d["time_end"] - d["time_create"]) * 1000 for d in docs if d["task_status"] == SUCCESS]
    r, c = summary["results"], summary["cpu"]
    result = {
        "bench": "asyncflow", "backend": args.backend, "mode": "rate" if args.rate else "burst",
        "flows": args.flows, "rate": args.rate, "concurrency": args.concurrency, "clients": args.clients,
        "succeeded": r["succeeded"], "submit_errors": summary["submit"]["errors"],
        "timed_out": summary["timed_out"], "flows_per_s": r["flows_per_s"], "window_s": r["window_seconds"],
        "submits_per_s": summary["submit"]["per_s"],
        **{f"submit_done_p{p}_ms": round(v, 2) if (v := pct(e2e, p)) is not None else None for p in (50, 95, 99)},
        "cpu_s": c["by_process"], "cpu_per_flow_ms": c["per_flow_ms"], "cpu_others_s": c["others_seconds"],
        "machine_busy_pct": c["machine_busy_pct"], "loadavg_at_start": summary["machine"]["loadavg_at_start"],
        "exit_status": status,
    }
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["embedded", "postgres-rabbitmq", "postgres-redis"], default="embedded")
    p.add_argument("--flows", type=int, default=500, help="flows to run (default 500)")
    p.add_argument("--concurrency", type=int, default=2, help="worker pool processes (default 2)")
    p.add_argument("--rate", type=float, default=None, help="latency mode: submit at this many flows/s")
    p.add_argument("--clients", type=int, default=4, help="concurrent HTTP clients (default 4)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for submitting and finishing (default 600)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of the text report")
    p.add_argument("--log-level", default=None, help="ASYNCFLOW_LOG_LEVEL for the processes (default: theirs)")
    p.add_argument("--env", dest="extra_env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the processes, e.g. ASYNCFLOW_EMBEDDED_POLL_INTERVAL=0.01")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (process logs) even on success")
    p.add_argument("--postgres-admin-url", default=None,
                   help="libpq URL to create/drop the database (default postgres@ then root@127.0.0.1:5432)")
    p.add_argument("--rabbitmq-vhost", default=None,
                   help="use this existing vhost (its asyncflow.* queues are purged) instead of a fresh one")
    p.add_argument("--redis-db", type=int, default=None, help="Redis db (default: first empty one from 9 up)")
    args = p.parse_args(argv)
    for item in args.extra_env:
        if "=" not in item:
            p.error(f"--env wants KEY=VALUE, got {item!r}")
    if args.flows < 1 or args.concurrency < 1 or args.clients < 1 or (args.rate is not None and args.rate <= 0):
        p.error("--flows, --concurrency, --clients and --rate must be positive")
    return args


@contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGINT too: a shell that starts us in the background may have set it to "ignore".
    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def run(args: argparse.Namespace) -> int:
    machine = machine_info()
    home = Path(tempfile.mkdtemp(prefix="af_bench_"))
    backend: Backend | None = None
    stack: Stack | None = None
    keep = args.keep
    try:
        log(f"backend {args.backend}: setting up (home {home})")
        backend = make_backend(args)
        extra_env = dict(item.split("=", 1) for item in args.extra_env)
        stack = Stack(home, backend, args.concurrency, args.log_level, extra_env)
        stack.start()
        stack.wait_healthy(60)
        api = Api(stack.url)
        warm = warm_up(api, stack, 120)
        log(f"stack ready on {stack.url}; warm-up flow took {warm * 1000:.1f} ms")

        run_id = f"bench-{uuid.uuid4().hex[:10]}"
        deadline = time.monotonic() + args.timeout
        cpu0, machine0 = stack.cpu(), machine_cpu()
        t0 = time.perf_counter()
        if args.rate:
            log(f"submitting {args.flows} flows at {args.rate:g}/s")
            sub = submit_at_rate(api, run_id, args.flows, args.rate, args.clients, deadline)
        else:
            log(f"submitting {args.flows} flows with {args.clients} clients")
            sub = submit_burst(api, run_id, args.flows, args.clients, deadline)
        log(f"{len(sub.task_ids)} submitted in {sub.last_end - sub.first_start:.2f} s; waiting for them")
        finished = wait_all_stopped(api, stack, run_id, deadline)
        wall = time.perf_counter() - t0
        cpu1, machine1 = stack.cpu(), machine_cpu()
        timed_out = not finished or len(sub.task_ids) + len(sub.errors) < args.flows
        if timed_out:
            log(f"timed out after {args.timeout:g} s")
        stack.check_alive()

        docs = fetch_docs(api, sub.task_ids)
        results = analyse(docs)
        by_proc = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0}
        busy = machine1[0] - machine0[0]
        total = machine1[1] - machine0[1]
        summary: dict[str, Any] = {
            "machine": machine,
            "versions": backend.versions,
            "notes": backend.notes,
            "config": {
                "backend": args.backend, "flows": args.flows, "concurrency": args.concurrency,
                "rate": args.rate, "clients": args.clients, "timeout": args.timeout,
                "extra_env": args.extra_env,
            },
            "warmup_ms": round(warm * 1000, 2),
            "timed_out": timed_out,
            "client_wall_seconds": round(wall, 3),
            "submit": {
                "accepted": len(sub.task_ids),
                "errors": len(sub.errors),
                "first_errors": sub.errors[:3],
                "seconds": round(sub.last_end - sub.first_start, 3),
                "per_s": round(len(sub.task_ids) / max(sub.last_end - sub.first_start, 1e-9), 1),
                "post_ms": dist_ms(sub.post_seconds),
                "schedule_lag_ms": dist_ms(sub.schedule_lag),
            },
            "results": results,
            "cpu": {
                "window_seconds": round(wall, 3),
                "by_process": by_proc,
                "per_flow_ms": {k: round(v * 1000 / max(len(docs), 1), 2) for k, v in by_proc.items()},
                "others_seconds": round(busy - sum(by_proc.values()), 2),
                "machine_busy_pct": round(100 * busy / total, 1) if total else None,
            },
            "spec_reference": SPEC_REFERENCE,
        }
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            print_report(summary)
        status = 2 if timed_out else 1 if sub.errors or results["succeeded"] != args.flows else 0
        print_result_line(args, summary, docs, status)
        if timed_out:
            keep = True
            return 2
        if sub.errors or results["succeeded"] != args.flows:
            log(f"not every flow succeeded: {results['statuses']}, {len(sub.errors)} submit errors "
                f"{sub.errors[:3]}")
            keep = True
            return 1
        return 0
    except SetupError as exc:
        log(f"setup failed or a process died: {exc}")
        keep = True
        return 3
    except Exception as exc:  # noqa: BLE001 - report, clean up, and say where the logs are
        log(f"benchmark failed: {exc!r}")
        if stack is not None:
            for key, proc in stack.procs.items():
                if proc.poll() is not None:
                    log(f"{key} exited with {proc.returncode}; log tail:\n{stack.tail(key, 1500)}")
        keep = True
        return 3
    except KeyboardInterrupt:
        log("interrupted")
        keep = True
        return 130
    finally:
        if stack is not None:
            log("stopping the processes")
            t_stop = time.monotonic()
            stack.stop()
            log(f"stopped in {time.monotonic() - t_stop:.1f} s")
        if backend is not None:
            backend.cleanup()
        if keep:
            log(f"process logs kept in {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with interrupt_on_sigterm():
        return run(args)


if __name__ == "__main__":
    sys.exit(main())
