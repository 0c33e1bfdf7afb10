#!/usr/bin/env python
"""Intake: flows accepted per second, one per request and in batches.

Starts `asyncflow api` alone (no worker, no scheduler: what is measured is the
intake, each first step left on its module's queue) on a fresh backend, then runs
three phases of `--seconds` each, with `--clients` client processes over
keep-alive connections, alternating `--rounds` times:

  single    POST /api/tasks, one `noop` flow per request
  batch     POST /api/batches, `--batch` `noop` flows per request
  v1 batch  POST /v1/create_tasks, `--batch` v1 tasks (60-byte task_content) per request

A single submit is stored and its first step published before the answer; a
batch is stored, its first steps left waiting for the scheduler to publish; each
v1 task is stored. At the end the tasks in the database are counted against
those the clients were told were created. Prints tasks/s, request latency, CPU
per task of the API and of the servers, and the machine. SPEC §12: batch
submits ≥ 15,000 tasks/s.

Then, unless `--no-release`, the other half of a batch: `asyncflow scheduler`
starts and publishes every first step the batches left waiting; printed are
the steps released per second and the CPU per step of the scheduler and the
servers (no worker runs: each message stays in its module's queue, and the
scheduler is told to fill the queues without bound, `ASYNCFLOW_RELEASE_AHEAD`).
With `--drain`, a worker starts beside the scheduler instead, every flow runs
to its end with the first steps published as the queues make room, and the
flows done per second and the CPU per flow are printed.

    .venv/bin/python benchmarks/intake.py --backend postgres-rabbitmq --clients 4 --batch 500
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import pct  # noqa: E402
from loadgen import KeepAlive  # noqa: E402
from stack import SetupError, Stack, log, machine_info, make_backend, servers_cpu  # noqa: E402


def client_loop(job: tuple[str, str, int, float, int]) -> tuple[int, int, list[float]]:
    url, kind, batch, seconds, client = job
    created = errors = 0
    latencies: list[float] = []
    with KeepAlive(url) as http:
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            n += 1
            t0 = time.perf_counter()
            if kind == "single":
                status, answer = http.call("POST", "/api/tasks", {"flow": "noop", "parameters": {"client": client, "n": n}})
                ok = status == 201
                count = 1
            elif kind == "batch":
                body = {"tasks": [{"flow": "noop", "parameters": {"client": client, "n": n}}] * batch}
                status, answer = http.call("POST", "/api/batches", body)
                ok = status == 200
                count = sum(t["created"] for t in answer["tasks"]) if ok else 0
            else:
                body = {"task_list": [{"task_type": V1_TYPE, "task_content": "y" * 60}] * batch}
                _, reply = http.call("POST", "/v1/create_tasks", body)
                ok = isinstance(reply, dict) and reply.get("code") == 0
                count = len(reply["task_id_list"]) if ok else 0
            latencies.append(time.perf_counter() - t0)
            created += count
            errors += not ok
    return created, errors, latencies


V1_TYPE = "bench_intake"
PHASES = ("single", "batch", "v1 batch")


def phase(pool: Any, stack: Stack, kind: str, batch: int, clients: int, seconds: float) -> dict[str, Any]:
    api_before, servers_before = stack.cpu().get("api", 0.0), servers_cpu()
    started = time.monotonic()
    results = pool.map(client_loop, [(stack.url, kind, batch, seconds, c) for c in range(clients)])
    wall = time.monotonic() - started
    servers_after = servers_cpu()
    created = sum(r[0] for r in results)
    lat = sorted(x for r in results for x in r[2])
    per_task = 1000 / max(created, 1)
    return {
        "tasks": created, "errors": sum(r[1] for r in results), "tasks_per_s": created / wall,
        "requests": len(lat), "p50_ms": (pct(lat, 50) or 0) * 1000, "p99_ms": (pct(lat, 99) or 0) * 1000,
        "api_cpu_ms": (stack.cpu().get("api", 0.0) - api_before) * per_task,
        "servers_cpu_ms": {k: (servers_after[k] - servers_before[k]) * per_task for k in servers_after},
    }


def waiting_first_steps(database_url: str) -> int:
    """Tasks whose first step waits for the scheduler to publish it."""
    from sqlalchemy import func, select

    from shared.states import Phase
    from shared.storage import open_store
    from shared.storage.schema import tasks

    store = open_store(database_url)
    try:
        with store.transaction(read_only=True) as conn:
            query = select(func.count()).select_from(tasks).where(tasks.c.active_phase == Phase.WAITING)
            return int(conn.execute(query).scalar_one())
    finally:
        store.close()


def release(stack: Stack, database_url: str, timeout: float) -> dict[str, Any]:
    """Start the scheduler and time it publishing the first steps the batches left waiting."""
    waiting = waiting_first_steps(database_url)
    servers_before = servers_cpu()
    started = time.monotonic()
    # No worker takes them: unbounded, or it would stop at each queue's ASYNCFLOW_RELEASE_AHEAD.
    stack.env["ASYNCFLOW_RELEASE_AHEAD"] = str(10**9)
    stack.spawn("scheduler", "scheduler")
    left = waiting
    while left and time.monotonic() - started < timeout:
        time.sleep(0.5)
        stack.check_alive()
        left = waiting_first_steps(database_url)
    wall = time.monotonic() - started
    servers_after = servers_cpu()
    released = waiting - left
    per_task = 1000 / max(released, 1)
    return {
        "released": released, "left": left, "per_s": released / wall, "seconds": wall,
        "scheduler_cpu_ms": stack.cpu().get("scheduler", 0.0) * per_task,
        "servers_cpu_ms": {k: (servers_after[k] - servers_before[k]) * per_task for k in servers_after},
    }


def flows_done(database_url: str) -> tuple[int, int]:
    """(flows that succeeded, flows stored)."""
    from sqlalchemy import func, select

    from shared.states import TaskStatus
    from shared.storage import open_store
    from shared.storage.schema import tasks

    store = open_store(database_url)
    try:
        with store.transaction(read_only=True) as conn:
            done = select(func.count()).select_from(tasks).where(tasks.c.status == TaskStatus.SUCCESS)
            return int(conn.execute(done).scalar_one()), int(conn.execute(select(func.count()).select_from(tasks)).scalar_one())
    finally:
        store.close()


def drain(stack: Stack, database_url: str, timeout: float) -> dict[str, Any]:
    """Start the scheduler and a worker: every stored flow runs to its end, the batches'
    first steps published as their queues make room (ASYNCFLOW_RELEASE_AHEAD, the default)."""
    done, total = flows_done(database_url)
    servers_before = servers_cpu()
    started = time.monotonic()
    stack.spawn("worker", "worker", "alpha", "beta", "-c", "2")
    stack.spawn("scheduler", "scheduler")
    while done < total and time.monotonic() - started < timeout:
        time.sleep(0.5)
        stack.check_alive()
        done, total = flows_done(database_url)
    wall = time.monotonic() - started
    servers_after = servers_cpu()
    cpu = stack.cpu()
    per_flow = 1000 / max(done, 1)
    return {
        "done": done, "left": total - done, "per_s": done / wall, "seconds": wall,
        "cpu_ms": {k: cpu.get(k, 0.0) * per_flow for k in ("scheduler", "worker")},
        "servers_cpu_ms": {k: (servers_after[k] - servers_before[k]) * per_flow for k in servers_after},
    }


def stored_tasks(database_url: str) -> int:
    """Flows and v1 tasks in the database."""
    from sqlalchemy import func, select

    from shared.storage import open_store
    from shared.storage.schema import pull_tasks, tasks

    store = open_store(database_url)
    try:
        with store.transaction(read_only=True) as conn:
            return sum(int(conn.execute(select(func.count()).select_from(t)).scalar_one()) for t in (tasks, pull_tasks))
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["postgres-rabbitmq", "postgres-redis", "embedded"],
                        default="postgres-rabbitmq")
    parser.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--batch", type=int, default=500, help="flows per batch request (default 500)")
    parser.add_argument("--seconds", type=float, default=10, help="seconds per phase (default 10)")
    parser.add_argument("--rounds", type=int, default=2, help="single, batch alternations (default 2)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated, of {', '.join(PHASES)} (default all)")
    parser.add_argument("--api-workers", type=int, default=1, help="API processes (asyncflow api --workers)")
    parser.add_argument("--no-release", action="store_true",
                        help="do not start the scheduler to publish the batches' first steps afterwards")
    parser.add_argument("--release-timeout", type=float, default=300,
                        help="seconds the scheduler gets to publish them (default 300)")
    parser.add_argument("--drain", action="store_true",
                        help="instead, start the scheduler and a worker and run every flow to its end, paced")
    parser.add_argument("--postgres-admin-url", default=None)
    parser.add_argument("--rabbitmq-vhost", default=None)
    parser.add_argument("--redis-db", type=int, default=None)
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",")]
    if not set(phases) <= set(PHASES):
        parser.error(f"--phases: each of {', '.join(PHASES)}")

    home = Path(tempfile.mkdtemp(prefix="af-intake-"))
    backend = make_backend(args)
    stack = None
    runs: list[tuple[str, dict[str, Any]]] = []
    warm_up = 0
    try:
        stack = Stack(home, backend, concurrency=1, log_level="WARNING")
        done = subprocess.run(
            [sys.executable, "-m", "asyncflow", "db", "upgrade"],
            env=stack.env, cwd=home, capture_output=True, text=True, timeout=180,
        )
        if done.returncode != 0:
            raise SetupError(done.stderr)
        stack.env["ASYNCFLOW_MIGRATE_ON_START"] = "false"
        stack.spawn("api", "api", "--port", str(stack.port), "--workers", str(args.api_workers))
        stack.wait_healthy(60)
        body = {"task_type_data": {"task_type": V1_TYPE}}
        with KeepAlive(stack.url) as setup:
            _, reply = setup.call("POST", "/v1/register_task_type", body)
        if not isinstance(reply, dict) or reply.get("code") != 0:
            raise SetupError(f"register_task_type failed: {reply}")
        with multiprocessing.get_context("spawn").Pool(args.clients) as pool:
            warm = [(stack.url, kind, 2, 0.5, c) for kind in phases for c in range(args.clients)]
            warm_up = sum(r[0] for r in pool.map(client_loop, warm))
            for r in range(args.rounds):
                for kind in phases:
                    log(f"round {r + 1}: {kind}")
                    runs.append((kind, phase(pool, stack, kind, args.batch, args.clients, args.seconds)))
        stack.check_alive()
        database_url = stack.env.get("ASYNCFLOW_DATABASE_URL") or f"sqlite:///{home / 'asyncflow.sqlite'}"
        stored = stored_tasks(database_url)
        released = drained = None
        if args.drain:
            drained = drain(stack, database_url, args.release_timeout)
        elif not args.no_release:
            released = release(stack, database_url, args.release_timeout)
    except SetupError as exc:
        log(f"setup failed: {exc}")
        return 3
    finally:
        if stack is not None:
            stack.stop()
        backend.cleanup()

    m = machine_info()
    print(f"machine : {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB; {m['os']}, kernel {m['kernel']}; "
          f"Python {m['python']}; load {m['loadavg_at_start']}")
    print(f"backend : {args.backend} {backend.versions}; `asyncflow api --workers {args.api_workers}`; "
          f"{args.clients} client processes on the same machine, {args.seconds:g} s per phase")
    for name, r in runs:
        servers = ", ".join(f"{k} {v:.3f}" for k, v in r["servers_cpu_ms"].items() if v)
        label = name if name == "single" else f"{name} of {args.batch}"
        print(f"{label:<17}: {r['tasks_per_s']:8.0f} tasks/s ({r['tasks']} created, {r['errors']} failed requests); "
              f"request p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms; CPU ms/task: api {r['api_cpu_ms']:.3f}, "
              f"{servers}")
    for name in phases:
        rates = [r["tasks_per_s"] for n, r in runs if n == name]
        print(f"median {name}: {statistics.median(rates):.0f} tasks/s")
    accepted = sum(r["tasks"] for _, r in runs) + warm_up
    print(f"stored  : {stored} tasks in the database; the clients were told {accepted} were created")
    if released is not None:
        servers = ", ".join(f"{k} {v:.3f}" for k, v in released["servers_cpu_ms"].items() if v)
        print(f"release : {released['released']} first steps published by the scheduler in {released['seconds']:.1f} s, "
              f"{released['per_s']:.0f}/s, {released['left']} left; CPU ms/step: scheduler "
              f"{released['scheduler_cpu_ms']:.3f} (its start included), {servers}")
    if drained is not None:
        servers = ", ".join(f"{k} {v:.3f}" for k, v in drained["servers_cpu_ms"].items() if v)
        print(f"drain   : {drained['done']} flows run to their end by `worker alpha beta -c 2` in "
              f"{drained['seconds']:.1f} s, {drained['per_s']:.0f}/s, {drained['left']} left; CPU ms/flow: "
              f"scheduler {drained['cpu_ms']['scheduler']:.3f}, worker {drained['cpu_ms']['worker']:.3f} "
              f"(their starts included), {servers}")
    complete = (released is None or released["left"] == 0) and (drained is None or drained["left"] == 0)
    return 0 if stored == accepted and complete and all(r["errors"] == 0 for _, r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
