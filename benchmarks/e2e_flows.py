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
import os
import platform
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"
FLOWS_FILE = SUPPORT / "flows.yaml"
FLOW = "noop"
STEPS = 3
MODULES = ("alpha", "beta")
STOPPED = {0, 4, 5, 6}  # success, failed, rollback failed, cancelled
SUCCESS = 0
QUEUES = ("asyncflow.alpha", "asyncflow.beta", "asyncflow.monitor", "asyncflow.default")

# SPEC.md §12, quoted (not measured here).
SPEC_REFERENCE = {
    "source": "SPEC.md §12 (2-core machine, PostgreSQL and RabbitMQ on it); quoted, not measured by this run",
    "targets": {
        "e2e_flows_per_s_min": 400,
        "e2e_p50_ms_at_50_per_s_max": 15,
        "step_dispatch_p50_ms_max": 5,
        "step_dispatch_p99_ms_max": 50,
    },
    "peers": [
        {"what": "Celery chain on RabbitMQ, no durable state", "flows_per_s": 334},
        {"what": "Celery chain + one PostgreSQL update per step", "flows_per_s": 270, "p50_ms_at_50_per_s": 7},
        {"what": "DBOS", "flows_per_s": "76-124", "p50_ms_at_50_per_s": "11-24"},
    ],
}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class SetupError(Exception):
    pass


# --- machine -----------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu_model, cpus = "unknown", os.cpu_count() or 0
    try:
        text = Path("/proc/cpuinfo").read_text()
        models = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
        if models:
            cpu_model, cpus = models[0], len(models)
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    os_name = platform.system()
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpu_model": cpu_model,
        "cpus": cpus,
        "memory_gib": mem_gib,
        "os": os_name,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in load] if load else None,
    }


# --- CPU accounting (our process trees vs the whole machine) -------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _session_cpu(sid: int) -> float:
    """CPU seconds (user+system, incl. reaped children) of every process in session ``sid``."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        # fields[0] is state (field 3); session is field 6; utime..cstime are fields 14..17.
        if int(fields[3]) != sid:
            continue
        total += sum(int(x) for x in fields[11:15])
    return total / CLK_TCK


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return (total - idle) / CLK_TCK, total / CLK_TCK


# --- backends ------------------------------------------------------------------------


@dataclass
class Backend:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _cleanups: list[Callable[[], None]] = field(default_factory=list)

    def cleanup(self) -> None:
        for fn in reversed(self._cleanups):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - cleanup is best effort, keep going
                log(f"cleanup step failed: {exc!r}")
        self._cleanups.clear()


def setup_postgres(backend: Backend, admin_url: str | None) -> None:
    import psycopg

    candidates = [admin_url] if admin_url else [
        "postgresql://postgres@127.0.0.1:5432/postgres",
        "postgresql://root@127.0.0.1:5432/postgres",
    ]
    last: Exception | None = None
    for url in candidates:
        try:
            admin = psycopg.connect(url, autocommit=True, connect_timeout=5)
            break
        except psycopg.Error as exc:
            last = exc
    else:
        raise SetupError(f"cannot connect to PostgreSQL as an admin ({candidates}): {last}")
    name = f"af_bench_{uuid.uuid4().hex[:10]}"
    with admin:
        backend.versions["postgresql"] = str(admin.execute("SHOW server_version").fetchone()[0])
        admin.execute(f'CREATE DATABASE "{name}"')
    info = psycopg.conninfo.conninfo_to_dict(url)
    user = info.get("user", "postgres")
    host, port = info.get("host", "127.0.0.1"), info.get("port", "5432")
    password = f":{info['password']}" if info.get("password") else ""
    backend.env["ASYNCFLOW_DATABASE_URL"] = f"postgresql+psycopg://{user}{password}@{host}:{port}/{name}"
    backend.notes.append(f"database {name} (created for this run, dropped at the end)")

    def drop() -> None:
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    backend._cleanups.append(drop)


def _rabbitmqctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60)


def setup_rabbitmq(backend: Backend, vhost: str | None) -> None:
    from kombu import Connection

    base = "amqp://guest:guest@127.0.0.1:5672/"
    if vhost is None and shutil.which("rabbitmqctl"):
        # A vhost of our own: other users of this RabbitMQ (tests, other benchmarks)
        # cannot take our messages, nor we theirs, and nothing is left over.
        vhost = f"af_bench_{uuid.uuid4().hex[:10]}"
        for args in (("add_vhost", vhost), ("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")):
            done = _rabbitmqctl(*args)
            if done.returncode != 0:
                raise SetupError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr.strip()}")
        backend._cleanups.append(lambda: _rabbitmqctl("delete_vhost", vhost))
        backend.notes.append(f"RabbitMQ vhost {vhost} (created for this run, deleted at the end)")
    elif vhost is None:
        vhost = "/"
    url = base + vhost  # the default vhost "/" gives amqp://...:5672//
    backend.env["ASYNCFLOW_BROKER_URL"] = url
    try:
        with Connection(url, connect_timeout=5) as conn:
            conn.connect()
            props = conn.connection.server_properties
            version = props.get("version", "?")
            backend.versions["rabbitmq"] = version.decode() if isinstance(version, bytes) else str(version)
            channel = conn.channel()
            purged = 0
            for queue in QUEUES:
                try:
                    purged += channel.queue_purge(queue) or 0
                except Exception:  # noqa: BLE001 - the queue does not exist: nothing to purge
                    channel = conn.channel()
            if purged:
                backend.notes.append(f"purged {purged} leftover messages from {', '.join(QUEUES)} on vhost {vhost}")
    except Exception as exc:
        raise SetupError(f"cannot reach RabbitMQ at {url}: {exc}") from exc
    if vhost == "/":
        backend.notes.append(
            "vhost / is shared: workers of other Asyncflow stacks on it consume the same queues"
        )


def _clean_redis(client: Any) -> int:
    keys = [
        k for pattern in ("asyncflow.*", "_kombu.*", "unacked*")
        for k in client.scan_iter(match=pattern)
    ]
    return client.delete(*keys) if keys else 0


def setup_redis(backend: Backend, db: int | None) -> None:
    import redis

    try:
        probe = redis.Redis(host="127.0.0.1", port=6379, db=0, socket_timeout=5)
        backend.versions["redis"] = str(probe.info("server")["redis_version"])
        databases = int(probe.config_get("databases").get("databases", 16))
    except Exception as exc:
        raise SetupError(f"cannot reach Redis at 127.0.0.1:6379: {exc}") from exc
    if db is None:
        # The first empty database from 9 up, so no one else's keys are touched.
        for candidate in range(9, databases):
            if redis.Redis(host="127.0.0.1", port=6379, db=candidate).dbsize() == 0:
                db = candidate
                break
        else:
            raise SetupError("no empty Redis database from 9 up; pass --redis-db")
    client = redis.Redis(host="127.0.0.1", port=6379, db=db)
    removed = _clean_redis(client)
    if removed:
        backend.notes.append(f"removed {removed} leftover kombu keys from Redis db {db}")
    backend.env["ASYNCFLOW_BROKER_URL"] = f"redis://127.0.0.1:6379/{db}"
    backend.notes.append(f"Redis db {db} (kombu keys removed at the end)")
    backend._cleanups.append(lambda: _clean_redis(client))


def make_backend(args: argparse.Namespace) -> Backend:
    backend = Backend(args.backend)
    try:
        if args.backend == "embedded":
            backend.versions["sqlite"] = sqlite3.sqlite_version
            backend.notes.append("SQLite task store + kombu SQLAlchemy transport on SQLite (no server)")
            return backend
        setup_postgres(backend, args.postgres_admin_url)
        if args.backend == "postgres-rabbitmq":
            setup_rabbitmq(backend, args.rabbitmq_vhost)
        else:
            setup_redis(backend, args.redis_db)
    except BaseException:
        backend.cleanup()
        raise
    return backend


# --- the processes -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    def __init__(
        self, home: Path, backend: Backend, concurrency: int, log_level: str | None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCFLOW_") and k != "TESTMOD_JOURNAL"}
        env.update(
            ASYNCFLOW_FLOWS=str(FLOWS_FILE),
            ASYNCFLOW_HOME=str(home),
            ASYNCFLOW_ALERT_COMMAND="",
            ASYNCFLOW_API_PORT=str(self.port),
            ASYNCFLOW_API_URL=self.url,
            PYTHONPATH=os.pathsep.join([str(SUPPORT), str(REPO)]),
        )
        if log_level:
            env["ASYNCFLOW_LOG_LEVEL"] = log_level
        env.update(backend.env)
        env.update(extra_env or {})
        self.env = env
        self.concurrency = concurrency

    def start(self) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "asyncflow", "db", "upgrade"],
            env=self.env, cwd=self.home, capture_output=True, text=True, timeout=180,
        )
        if done.returncode != 0:
            raise SetupError(f"asyncflow db upgrade failed:\n{done.stdout}\n{done.stderr}")
        self.env["ASYNCFLOW_MIGRATE_ON_START"] = "false"
        self.spawn("api", "api", "--port", str(self.port))
        self.spawn("scheduler", "scheduler")
        self.spawn("worker", "worker", *MODULES, "-c", str(self.concurrency))

    def spawn(self, key: str, *args: str) -> None:
        out = open(self.home / f"{key}.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self.procs[key] = subprocess.Popen(
                [sys.executable, "-m", "asyncflow", *args],
                env=self.env, cwd=self.home, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the worker's pool goes with it
            )
        finally:
            out.close()

    def check_alive(self) -> None:
        for key, proc in self.procs.items():
            if proc.poll() is not None:
                raise SetupError(f"{key} exited with {proc.returncode}; last log lines:\n{self.tail(key)}")

    def tail(self, key: str, chars: int = 3000) -> str:
        path = self.home / f"{key}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SetupError(f"API not healthy after {timeout:g}s; log:\n{self.tail('api')}")
            time.sleep(0.1)

    def cpu(self) -> dict[str, float]:
        return {key: _session_cpu(proc.pid) for key, proc in self.procs.items()}

    def stop(self, timeout: float = 20) -> None:
        # SIGTERM to each main process only: the Celery worker then stops its own pool.
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for key, proc in self.procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"{key} did not stop within {timeout:g}s of SIGTERM: SIGKILL")
            # Whatever is left of the group (pool children too) goes now.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait(timeout=10)


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


# --- figures -------------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float | None:
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def dist_ms(seconds: list[float]) -> dict[str, Any]:
    ms = [x * 1000 for x in seconds]
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50": round(pct(ms, 50), 2),
        "p90": round(pct(ms, 90), 2),
        "p99": round(pct(ms, 99), 2),
        "max": round(max(ms), 2),
        "mean": round(sum(ms) / len(ms), 2),
    }


def analyse(docs: list[dict[str, Any]]) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    done = [d for d in docs if d["task_status"] in STOPPED]
    for d in docs:
        statuses[d["status_name"]] = statuses.get(d["status_name"], 0) + 1
    ok = [d for d in done if d["task_status"] == SUCCESS]

    first_dispatch: list[float] = []
    next_dispatch: list[float] = []
    by_step: dict[int, list[float]] = {k: [] for k in range(1, STEPS)}
    in_step: list[float] = []
    finish: list[float] = []
    e2e: list[float] = []
    retried = 0
    for d in ok:
        e2e.append(d["time_end"] - d["time_create"])
        normal = sorted((a for a in d.get("attempts") or [] if a["type"] == 0), key=lambda a: a["seq"])
        if len(normal) != STEPS:
            retried += 1  # a retried attempt would blur the per-step figures; leave it out
            continue
        first_dispatch.append(normal[0]["started_at"] - d["time_create"])
        for k in range(1, STEPS):
            gap = normal[k]["started_at"] - normal[k - 1]["ended_at"]
            next_dispatch.append(gap)
            by_step[k].append(gap)
        in_step.extend(a["ended_at"] - a["started_at"] for a in normal)
        finish.append(d["time_end"] - normal[-1]["ended_at"])

    window = None
    if ok:
        window = max(d["time_end"] for d in ok) - min(d["time_create"] for d in docs)
    return {
        "statuses": statuses,
        "succeeded": len(ok),
        "stopped": len(done),
        "window_seconds": round(window, 3) if window else None,
        "flows_per_s": round(len(ok) / window, 1) if window and len(ok) == len(docs) else None,
        "submit_to_done_ms": dist_ms(e2e),
        "first_step_dispatch_ms": dist_ms(first_dispatch),
        "step_dispatch_ms": dist_ms(next_dispatch),
        "step_dispatch_by_step_ms": {f"{k}->{k + 1}": dist_ms(v) for k, v in by_step.items()},
        "in_step_ms": dist_ms(in_step),
        "last_step_end_to_task_end_ms": dist_ms(finish),
        "flows_with_extra_attempts": retried,
    }


# --- report --------------------------------------------------------------------------------


def _fmt(d: dict[str, Any]) -> str:
    if not d.get("n"):
        return "n/a"
    return f"p50 {d['p50']:8.2f}  p90 {d['p90']:8.2f}  p99 {d['p99']:8.2f}  max {d['max']:8.2f}  mean {d['mean']:8.2f}  (n={d['n']})"


def print_report(summary: dict[str, Any]) -> None:
    m, r, cfg = summary["machine"], summary["results"], summary["config"]
    print("=" * 78)
    print("Asyncflow end-to-end benchmark: 3-step no-op flows (tests/support/flows.yaml `noop`)")
    print("=" * 78)
    print(f"machine   : {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB RAM")
    print(f"os        : {m['os']}, kernel {m['kernel']}; Python {m['python']}")
    print(f"load avg  : {m['loadavg_at_start']} at start (1/5/15 min)")
    versions = ", ".join(f"{k} {v}" for k, v in summary["versions"].items())
    print(f"backend   : {cfg['backend']} ({versions})")
    for note in summary["notes"]:
        print(f"            {note}")
    mode = f"latency, {cfg['rate']:g} flows/s open loop" if cfg["rate"] else f"throughput, {cfg['clients']} HTTP clients"
    print(f"run       : {cfg['flows']} flows, mode {mode}, worker `alpha beta -c {cfg['concurrency']}`")
    if cfg["extra_env"]:
        print(f"extra env : {' '.join(cfg['extra_env'])}")
    print(f"warm-up   : 1 flow, {summary['warmup_ms']:.1f} ms submit->done")
    print()
    s = summary["submit"]
    print(f"submitted : {s['accepted']} accepted, {s['errors']} errors in {s['seconds']:.3f} s"
          f" = {s['per_s']:.1f} submits/s")
    print(f"POST latency (ms)           {_fmt(s['post_ms'])}")
    if cfg["rate"]:
        print(f"schedule lag (ms)           {_fmt(s['schedule_lag_ms'])}")
    print(f"outcome   : {r['statuses']}{'  TIMED OUT' if summary['timed_out'] else ''}")
    if r["flows_per_s"] is not None:
        label = "completed " if cfg["rate"] else "throughput"
        print(f"{label}: {r['flows_per_s']:.1f} flows/s  ({r['succeeded']} flows, first time_create -> "
              f"last time_end = {r['window_seconds']:.3f} s; client wall {summary['client_wall_seconds']:.3f} s)"
              + ("  [bounded by the offered rate]" if cfg["rate"] else ""))
    print()
    print("latencies in ms, server timestamps (task document and its attempt log):")
    print(f"  submit->done (time_end - time_create)   {_fmt(r['submit_to_done_ms'])}")
    print(f"  first-step dispatch (create->started)   {_fmt(r['first_step_dispatch_ms'])}")
    print(f"  step dispatch (prev ended->started)     {_fmt(r['step_dispatch_ms'])}")
    for k, d in r["step_dispatch_by_step_ms"].items():
        print(f"    step {k:<34}{_fmt(d)}")
    print(f"  in step (started->ended, no-op handler) {_fmt(r['in_step_ms'])}")
    print(f"  last step ended -> task time_end        {_fmt(r['last_step_end_to_task_end_ms'])}")
    if r["flows_with_extra_attempts"]:
        print(f"  ({r['flows_with_extra_attempts']} flows had extra attempts; left out of the step figures)")
    c = summary.get("cpu")
    if c:
        print()
        print(f"CPU during the run ({c['window_seconds']:.2f} s window, {m['cpus']} CPUs = "
              f"{c['window_seconds'] * m['cpus']:.2f} CPU-s available):")
        for key, secs in c["by_process"].items():
            print(f"  {key:<10} {secs:7.2f} CPU-s  {c['per_flow_ms'][key]:6.2f} ms/flow")
        print(f"  {'others':<10} {c['others_seconds']:7.2f} CPU-s  (database/broker servers, this script, "
              f"anything else on the machine)")
        print(f"  machine busy {c['machine_busy_pct']:.0f}%")
    print()
    print("-" * 78)
    print("Reference figures QUOTED FROM SPEC.md §12 (not measured by this run; spec machine:")
    print("2 cores with PostgreSQL and RabbitMQ on it):")
    print("  target: 3-step no-op flows end to end, durable   >= 400 flows/s")
    print("  target: at 50 flows/s, submit->done              p50 <= 15 ms")
    print("  target: per-step dispatch overhead               p50 <= 5 ms, p99 <= 50 ms")
    print("  peer:   Celery chain on RabbitMQ, no durable state            334 flows/s")
    print("  peer:   Celery chain + one PostgreSQL update per step         270 flows/s, p50 7 ms at 50/s")
    print("  peer:   DBOS                                                  76-124 flows/s, p50 11-24 ms at 50/s")
    print("-" * 78)


# --- main ------------------------------------------------------------------------------------


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
        cpu0, machine0 = stack.cpu(), _machine_cpu()
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
        cpu1, machine1 = stack.cpu(), _machine_cpu()
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
