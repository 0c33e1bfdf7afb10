"""create_task and hold_tasks calls/s of the v1 API, with several concurrent clients.

Starts `asyncflow api` (one process) on a fresh PostgreSQL database (or the
embedded SQLite default), then for each phase runs N client processes that
call one endpoint in a loop for a fixed time, over keep-alive connections:

  create_task  POST /v1/create_task, a 60-byte task_content
  hold_tasks   POST /v1/hold_tasks on a type whose pending tasks were bulk-loaded
               (and analyzed) first, `--schedule-limit` tasks per call (default 1: one task per call)

Prints calls/s, latency percentiles and the machine, next to the seed's figures
(create_task 3,000 QPS, hold_tasks 2,000 QPS on 2 cores / 4 GB with MySQL),
which are quoted, not measured here.

    python benchmarks/v1_api.py [--backend postgres|embedded] [--clients 8] [--seconds 10] [--api-workers 1]
                                [--load python|wrk] [--server uvicorn|uvicorn-h11|granian] [--busy 0]

`--server` runs the same application under another ASGI server, to compare them:
`uvicorn` is `asyncflow api` (uvicorn with httptools and uvloop, from
uvicorn[standard]); `uvicorn-h11` is uvicorn on its pure-Python HTTP parser and
asyncio's loop; `granian` needs `pip install granian` (not a dependency).

`--busy N` runs N processes of no part of the stack, each spinning on a core,
while the phases run: other load taking the CPU, as another tenant's would.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import pct  # noqa: E402
from loadgen import KeepAlive  # noqa: E402
from stack import Backend, SetupError, Stack, log, machine_info, servers_cpu, setup_postgres  # noqa: E402

SEED = {"create_task": 3000, "hold_tasks": 2000}

# The API application as `asyncflow api --workers N` loads it in each process.
APP = "oss_api.app:app_from_environment"
# How each server is started, after `python -m`; None: `asyncflow api` itself.
SERVERS: dict[str, list[str] | None] = {
    "uvicorn": None,
    "uvicorn-h11": ["uvicorn", "--factory", APP, "--http", "h11", "--loop", "asyncio", "--no-access-log",
                    "--log-level", "warning", "--host", "127.0.0.1"],
    "granian": ["granian", "--interface", "asgi", "--factory", APP, "--no-access-log", "--log-level", "warning",
                "--host", "127.0.0.1"],
}


def client_loop(args: tuple[str, str, dict[str, Any], float]) -> tuple[int, int, list[float]]:
    url, path, body, seconds = args
    ok = errors = 0
    latencies: list[float] = []
    with KeepAlive(url, timeout=30) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            _, answer = http.call("POST", path, body)
            latencies.append(time.perf_counter() - t0)
            if isinstance(answer, dict) and answer.get("code") == 0:
                ok += 1
            else:
                errors += 1
    return ok, errors, latencies


def phase(pool: Any, url: str, path: str, body: dict[str, Any], clients: int, seconds: float) -> dict[str, Any]:
    started = time.monotonic()
    results = pool.map(client_loop, [(url, path, body, seconds)] * clients)
    wall = time.monotonic() - started
    ok = sum(r[0] for r in results)
    errors = sum(r[1] for r in results)
    lat = sorted(x for r in results for x in r[2])
    return {
        "calls": ok, "errors": errors, "calls_per_s": ok / seconds, "wall_s": wall,
        "p50_ms": (pct(lat, 50) or 0) * 1000, "p99_ms": (pct(lat, 99) or 0) * 1000,
    }


# wrk's Lua hooks: POST the body, count answers that are not HTTP 200 with code 0.
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = %s
wrk.headers["Content-Type"] = "application/json"
bad = 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function response(status, headers, body)
  if status ~= 200 or not body:find('"code":0,', 1, true) then bad = bad + 1 end
end
function done(summary, latency, requests)
  local total = 0
  for _, t in ipairs(threads) do total = total + t:get("bad") end
  io.write(string.format("CALLS %%d BAD %%d P50 %%d P99 %%d\\n", summary.requests, total,
    latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_phase(url: str, path: str, body: dict[str, Any], connections: int, seconds: float) -> dict[str, Any]:
    """The same phase driven by wrk (C, one process): the clients take less of the machine."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % json.dumps(json.dumps(body)))
    try:
        done = subprocess.run(
            ["wrk", "-t2", f"-c{connections}", f"-d{seconds:g}s", "-s", script.name, url + path],
            capture_output=True, text=True, timeout=seconds + 60, check=True,
        )
    finally:
        Path(script.name).unlink()
    found = re.search(r"CALLS (\d+) BAD (\d+) P50 (\d+) P99 (\d+)", done.stdout)
    if found is None:
        raise SetupError(f"wrk printed no summary: {done.stdout} {done.stderr}")
    calls, bad, p50_us, p99_us = (int(g) for g in found.groups())
    return {
        "calls": calls - bad, "errors": bad, "calls_per_s": (calls - bad) / seconds, "wall_s": seconds,
        "p50_ms": p50_us / 1000, "p99_ms": p99_us / 1000,
    }


@contextmanager
def busy(count: int) -> Iterator[None]:
    """``count`` processes spinning on the cores meanwhile."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def prefill(database_url: str, task_type: str, count: int) -> None:
    """Bulk-insert pending tasks straight into the table (the thing measured is hold_tasks)."""
    from sqlalchemy import insert

    from shared.pull.rules import TaskType, new_pull_task
    from shared.storage import open_store
    from shared.storage.schema import pull_tasks
    from shared.storage.sql_pull import _row

    store = open_store(database_url)
    config = TaskType(task_type=task_type)
    now = time.time() - 60
    rows = [
        _row(new_pull_task(f"{uuid.uuid4().hex}_{task_type}", config, "", "", "x" * 60, 0, now + i * 1e-4))
        | {"version": 1}
        for i in range(count)
    ]
    with store.transaction() as conn:
        for start in range(0, count, 5000):
            conn.execute(insert(pull_tasks), rows[start : start + 5000])
        if conn.dialect.name == "postgresql":
            # As autovacuum would within a minute: the claim is then planned for the table's
            # real size, as in any deployment, not for the empty table of the migration.
            conn.exec_driver_sql("ANALYZE af_pull_tasks")
    store.close()


def intake_batch_mean(exposition: str, call: str) -> float | None:
    """Mean of asyncflow_api_intake_batch_size for ``call``: requests per batch (here each a transaction: no id repeats)."""
    found = {}
    for kind in ("sum", "count"):
        hit = re.search(rf'^asyncflow_api_intake_batch_size_{kind}{{call="{call}"}} (\S+)$', exposition, re.M)
        found[kind] = float(hit.group(1)) if hit else 0.0
    return found["sum"] / found["count"] if found["count"] else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["postgres", "embedded"], default="postgres")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--schedule-limit", type=int, default=1)
    parser.add_argument("--api-workers", type=int, default=1, help="API processes (asyncflow api --workers)")
    parser.add_argument(
        "--load", choices=["python", "wrk"], default="python",
        help="clients: --clients Python processes, or wrk with --clients connections (as seed 000 measured)",
    )
    parser.add_argument("--server", choices=list(SERVERS), default="uvicorn", help="the ASGI server (see above)")
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on the cores during the phases")
    args = parser.parse_args(argv)
    if args.load == "wrk" and shutil.which("wrk") is None:
        parser.error("--load wrk needs wrk on PATH (Debian: apt-get install wrk)")

    backend = Backend(args.backend)
    home = Path(tempfile.mkdtemp(prefix="af-v1-bench-"))
    stack = None
    try:
        if args.backend == "postgres":
            setup_postgres(backend, None)
        stack = Stack(home, backend, concurrency=1, log_level="WARNING")
        done = subprocess.run(
            [sys.executable, "-m", "asyncflow", "db", "upgrade"],
            env=stack.env, cwd=home, capture_output=True, text=True, timeout=180,
        )
        if done.returncode != 0:
            raise SetupError(done.stderr)
        stack.env["ASYNCFLOW_MIGRATE_ON_START"] = "false"
        server = SERVERS[args.server]
        if server is None:
            stack.spawn("api", "api", "--port", str(stack.port), "--workers", str(args.api_workers))
        else:
            stack.launch("api", [sys.executable, "-m", *server, "--port", str(stack.port),
                                 "--workers", str(args.api_workers)])
        stack.wait_healthy(60)
        url = stack.url
        for task_type, limit in (("bench_create", 100), ("bench_hold", args.schedule_limit)):
            body = {"task_type_data": {"task_type": task_type, "schedule_limit": limit}}
            assert httpx.post(url + "/v1/register_task_type", json=body).json()["code"] == 0
        database_url = stack.env.get("ASYNCFLOW_DATABASE_URL") or f"sqlite:///{home / 'asyncflow.sqlite'}"
        needed = int(SEED["hold_tasks"] * 3 * args.seconds * args.schedule_limit)
        log(f"bulk-loading {needed} pending tasks for hold_tasks")
        prefill(database_url, "bench_hold", needed)

        calls = {
            "create_task": {"task_data": {"task_type": "bench_create", "task_content": "y" * 60}},
            "hold_tasks": {"task_type": "bench_hold"},
        }
        results = {}
        # wrk needs no client processes: starting them would take the CPU from the first phase.
        workers: Any = multiprocessing.get_context("spawn").Pool(args.clients) if args.load == "python" else nullcontext()
        with workers as pool, busy(args.busy):
            for name, body in calls.items():
                log(f"{name} phase")
                api_before, pg_before = stack.cpu()["api"], servers_cpu()["postgresql"]
                if args.load == "wrk":
                    results[name] = wrk_phase(url, "/v1/" + name, body, args.clients, args.seconds)
                else:
                    results[name] = phase(pool, url, "/v1/" + name, body, args.clients, args.seconds)
                calls_done = max(results[name]["calls"], 1)
                results[name]["api_cpu_ms"] = 1000 * (stack.cpu()["api"] - api_before) / calls_done
                results[name]["pg_cpu_ms"] = 1000 * (servers_cpu()["postgresql"] - pg_before) / calls_done
        stack.check_alive()
        # Each API process's counts reach /metrics with its next heartbeat; the hold phase outlasts one.
        exposition = httpx.get(url + "/metrics").text
        for name in calls:
            results[name]["per_batch"] = intake_batch_mean(exposition, name)
    except SetupError as exc:
        log(f"setup failed: {exc}")
        return 3
    finally:
        if stack is not None:
            stack.stop()
        backend.cleanup()

    m = machine_info()
    clients = (
        f"wrk with {args.clients} connections" if args.load == "wrk" else f"{args.clients} client processes"
    ) + " on the same machine"
    print(f"machine : {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB; {m['os']}, kernel {m['kernel']}; "
          f"Python {m['python']}; load {m['loadavg_at_start']}")
    served = "`asyncflow api" if args.server == "uvicorn" else f"`{args.server} (benchmark's command)"
    beside = f"; {args.busy} processes spinning on the cores meanwhile" if args.busy else ""
    print(f"backend : {args.backend} {backend.versions}; {served} --workers {args.api_workers}`; "
          f"{clients}, {args.seconds:g} s per phase{beside}")
    for name, r in results.items():
        extra = f", {args.schedule_limit} task(s) per call" if name == "hold_tasks" else ""
        print(f"{name:<12}: {r['calls_per_s']:8.0f} calls/s ({r['calls']} ok, {r['errors']} errors{extra}); "
              f"latency p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms; "
              f"CPU per call: api {r['api_cpu_ms']:.2f} ms, PostgreSQL {r['pg_cpu_ms']:.2f} ms   "
              f"[seed 000, MySQL, 2c4g, quoted: {SEED[name]} QPS]")
    for name, what in (("create_task", "stored per transaction"), ("hold_tasks", "served per claim")):
        per_batch = results[name].get("per_batch")
        if per_batch is not None:
            print(f"{name} calls {what} (coalesced by the API): {per_batch:.1f} on average")
    return 0 if all(r["errors"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
