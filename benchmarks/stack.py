"""The stack a benchmark runs on: a backend, Asyncflow's processes, and the machine.

A backend is an isolated task store and broker (embedded SQLite, or a fresh
PostgreSQL database with a RabbitMQ vhost of its own or an empty Redis db from 9
up), removed by ``Backend.cleanup``. A ``Stack`` starts ``asyncflow api``,
``asyncflow scheduler`` and ``asyncflow worker`` on it as subprocesses, each in a
process group of its own, and accounts for the CPU they use.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "support"
FLOWS_FILE = SUPPORT / "flows.yaml"
MODULES = ("alpha", "beta")
QUEUES = ("asyncflow.alpha", "asyncflow.beta", "asyncflow.monitor", "asyncflow.default")


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
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _proc_stats() -> Iterator[tuple[str, list[str]]]:
    """(process name, the /proc/<pid>/stat fields after it) of every live process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        yield stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()


def _session_cpu(sid: int) -> float:
    """CPU seconds (user+system, incl. reaped children) of every process in session ``sid``."""
    # fields[0] is state (field 3); session is field 6; utime..cstime are fields 14..17.
    ticks = sum(sum(int(x) for x in fields[11:15]) for _, fields in _proc_stats() if int(fields[3]) == sid)
    return ticks / CLK_TCK


def _session_rss(sid: int) -> float:
    """Resident memory (MiB) of every live process in session ``sid``, summed.

    Pages shared between a worker and its forked pool count once per process: a
    figure to compare with itself across a run, not the tree's footprint.
    """
    # rss, in pages, is field 24.
    pages = sum(int(fields[21]) for _, fields in _proc_stats() if int(fields[3]) == sid)
    return round(pages * PAGE_SIZE / 2**20, 1)


# The servers a run talks to, by process name: their share of "others".
SERVERS = {"postgres": "postgresql", "beam.smp": "rabbitmq", "redis-server": "redis"}


def servers_cpu() -> dict[str, float]:
    """CPU seconds (user+system) of the PostgreSQL, RabbitMQ and Redis processes, reaped ones included.

    A backend that ends (its connection closed) is reaped by the postmaster, whose
    cutime and cstime then hold its CPU: with them the sum never goes back, and a
    difference of two readings counts the backends that ended in between (without
    them it went negative when a busy backend ended).
    """
    total = dict.fromkeys(SERVERS.values(), 0.0)
    for name, fields in _proc_stats():
        if name in SERVERS:
            total[SERVERS[name]] += sum(int(x) for x in fields[11:15]) / CLK_TCK
    return total


def machine_cpu() -> tuple[float, float]:
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


class Processes:
    """Named subprocesses, each in a process group and session of its own, logging to ``home/<name>.log``."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home = home
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def launch(self, key: str, argv: list[str]) -> None:
        out = open(self.home / f"{key}.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self.procs[key] = subprocess.Popen(
                argv, env=self.env, cwd=self.home, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a worker's pool goes with it
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

    def log_exited(self) -> None:
        for key, proc in self.procs.items():
            if proc.poll() is not None:
                log(f"{key} exited with {proc.returncode}; log tail:\n{self.tail(key, 1500)}")

    def cpu(self) -> dict[str, float]:
        return {key: _session_cpu(proc.pid) for key, proc in self.procs.items()}

    def rss(self) -> dict[str, float]:
        return {key: _session_rss(proc.pid) for key, proc in self.procs.items()}

    def stop(self, timeout: float = 20) -> None:
        # SIGTERM to each main process only: a Celery worker then stops its own pool.
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


class Stack(Processes):
    def __init__(
        self, home: Path, backend: Backend, concurrency: int, log_level: str | None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
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
        super().__init__(home, env)
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
        self.launch(key, [sys.executable, "-m", "asyncflow", *args])

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
