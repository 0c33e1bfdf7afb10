#!/usr/bin/env python
"""Peer benchmark: a plain Celery chain of three no-op steps, one PostgreSQL UPDATE per step.

What a service without Asyncflow would run for the same three-step flow: the
submitter INSERTs a row for the flow into ``peer_flows`` and sends a Celery chain
of three steps; each step runs ``UPDATE peer_flows SET step = step + 1 WHERE id =
%s`` (the last one also sets ``done_at``). Both timestamps are the database
server's clock (``clock_timestamp()``).

The Celery worker is a subprocess (prefork pool, ``--concurrency`` processes) with
the settings Asyncflow's workers use: JSON, acks late, prefetch multiplier 4, no
result backend, publisher confirms on RabbitMQ. It runs on a fresh PostgreSQL
database and a RabbitMQ vhost of its own, both removed at the end.

Throughput mode (default): ``--clients`` threads submit N flows as fast as they
can; flows/s = N / (last done_at - first created_at).
Latency mode (--rate R): submit N flows at R flows/s (open loop);
submit->done = done_at - created_at of each flow.

The exit status is 0 when every flow finished, 1 when a submit failed, 2 on
--timeout, 3 when setup failed or the worker died, 130 when interrupted.

    .venv/bin/python benchmarks/celery_chain.py --flows 500
    .venv/bin/python benchmarks/celery_chain.py --rate 50 --flows 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
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

from celery import Celery, chain

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from figures import pct  # noqa: E402
from stack import (  # noqa: E402
    REPO,
    Backend,
    SetupError,
    _session_cpu,
    log,
    machine_cpu,
    machine_info,
    setup_postgres,
    setup_rabbitmq,
)

QUEUE = "peer"
STEP_TASK = "peer.step"
STEPS = 3
DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672//"

SCHEMA = (
    "CREATE TABLE peer_flows (id text PRIMARY KEY, step int NOT NULL DEFAULT 0,"
    " created_at double precision NOT NULL, done_at double precision)"
)
INSERT = "INSERT INTO peer_flows (id, created_at) VALUES (%s, extract(epoch FROM clock_timestamp())::float8)"
UPDATE = "UPDATE peer_flows SET step = step + 1 WHERE id = %s"
UPDATE_LAST = (
    "UPDATE peer_flows SET step = step + 1, done_at = extract(epoch FROM clock_timestamp())::float8"
    " WHERE id = %s"
)


# --- the Celery side (imported by the worker as ``celery_chain:app``) ---------------------


def make_app(broker_url: str, confirm_publish: bool) -> Celery:
    app = Celery("peer", broker=broker_url, set_as_current=False)
    conf: dict[str, Any] = dict(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        worker_prefetch_multiplier=4,
        task_default_queue=QUEUE,
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    if confirm_publish:
        conf["broker_transport_options"] = {"confirm_publish": True}
    app.conf.update(conf)
    app.task(name=STEP_TASK, shared=False)(step)
    return app


_conn: Any = None


def _db() -> Any:
    """One connection per pool process, opened on its first step."""
    global _conn
    if _conn is None or _conn.closed:
        import psycopg

        _conn = psycopg.connect(os.environ["PEER_DATABASE_URL"], autocommit=True)
    return _conn


def step(flow_id: str, last: bool) -> None:
    _db().execute(UPDATE_LAST if last else UPDATE, (flow_id,))


app = make_app(os.environ.get("PEER_BROKER_URL", DEFAULT_BROKER), os.environ.get("PEER_CONFIRM_PUBLISH") == "1")


# --- figures ---------------------------------------------------------------------------------


def dist_ms(seconds: list[float]) -> dict[str, Any]:
    ms = [x * 1000 for x in seconds]
    if not ms:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(ms)}
    for p in (50, 90, 95, 99):
        out[f"p{p}"] = round(pct(ms, p), 2)
    out["max"] = round(max(ms), 2)
    out["mean"] = round(sum(ms) / len(ms), 2)
    return out


def fmt(d: dict[str, Any]) -> str:
    if not d.get("n"):
        return "n/a"
    return (f"p50 {d['p50']:8.2f}  p95 {d['p95']:8.2f}  p99 {d['p99']:8.2f}  max {d['max']:8.2f}"
            f"  mean {d['mean']:8.2f}  (n={d['n']})")


# --- the worker process ----------------------------------------------------------------------


class Worker:
    def __init__(self, home: Path, db_url: str, broker_url: str, concurrency: int, confirm_publish: bool,
                 log_level: str) -> None:
        self.home = home
        self.log_path = home / "worker.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCFLOW_", "PEER_"))}
        env.update(
            PEER_DATABASE_URL=db_url,
            PEER_BROKER_URL=broker_url,
            PEER_CONFIRM_PUBLISH="1" if confirm_publish else "0",
            PYTHONPATH=os.pathsep.join([str(BENCH_DIR), str(REPO)]),
        )
        self.env = env
        self.args = [
            sys.executable, "-m", "celery", "-A", "celery_chain:app", "worker",
            "--queues", QUEUE,
            "--concurrency", str(concurrency),
            "--pool", "prefork",
            "--hostname", f"peer@%h.{os.getpid()}",
            "--without-gossip",
            "--without-mingle",
            "--loglevel", log_level,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        out = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                self.args, env=self.env, cwd=self.home, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group and session: the pool goes with it
            )
        finally:
            out.close()

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else "(no log)"

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise SetupError(f"worker exited with {self.proc.returncode}; last log lines:\n{self.tail()}")

    def cpu(self) -> float:
        return _session_cpu(self.proc.pid) if self.proc is not None else 0.0

    def stop(self, timeout: float = 20) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()  # warm shutdown: the worker stops its own pool
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"worker did not stop within {timeout:g}s of SIGTERM: SIGKILL")
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(timeout=10)


# --- submitting ------------------------------------------------------------------------------


class Submitter:
    """INSERT the flow's row, then send its chain: what a service's request handler would do."""

    def __init__(self, celery: Celery, db_url: str) -> None:
        self.celery = celery
        self.db_url = db_url
        self._local = threading.local()
        self._conns: list[Any] = []
        self._lock = threading.Lock()

    def conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            import psycopg

            conn = self._local.conn = psycopg.connect(self.db_url, autocommit=True)
            with self._lock:
                self._conns.append(conn)
        return conn

    def submit(self, flow_id: str) -> float:
        t0 = time.perf_counter()
        self.conn().execute(INSERT, (flow_id,))
        steps = [
            self.celery.signature(STEP_TASK, args=(flow_id, k == STEPS), immutable=True)
            for k in range(1, STEPS + 1)
        ]
        chain(*steps).apply_async()
        return time.perf_counter() - t0

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self.celery.close()


@dataclass
class Submitted:
    ids: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    schedule_lag: list[float] = field(default_factory=list)
    first_start: float = 0.0
    last_end: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def one(self, sub: Submitter, flow_id: str) -> None:
        try:
            secs = sub.submit(flow_id)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            with self.lock:
                self.errors.append(repr(exc))
            return
        with self.lock:
            self.ids.append(flow_id)
            self.seconds.append(secs)
            self.last_end = max(self.last_end, time.perf_counter())


def submit_burst(sub: Submitter, run_id: str, n: int, clients: int, deadline: float) -> Submitted:
    out = Submitted()
    counter = iter(range(n))
    counter_lock = threading.Lock()

    def client_loop() -> None:
        while time.monotonic() < deadline:
            with counter_lock:
                i = next(counter, None)
            if i is None:
                return
            out.one(sub, f"{run_id}-{i}")

    out.first_start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def submit_at_rate(sub: Submitter, run_id: str, n: int, rate: float, clients: int, deadline: float) -> Submitted:
    """Open loop: flow i leaves at t0 + i/rate whatever happened to the others."""
    out = Submitted()
    interval = 1.0 / rate

    def one(i: int, planned: float) -> None:
        out.schedule_lag.append(time.perf_counter() - planned)
        out.one(sub, f"{run_id}-{i}")

    with ThreadPoolExecutor(max_workers=max(clients, 8)) as pool:
        t0 = out.first_start = time.perf_counter()
        for i in range(n):
            planned = t0 + i * interval
            delay = planned - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if time.monotonic() > deadline:
                break
            pool.submit(one, i, planned)
    return out


def done_count(conn: Any, prefix: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM peer_flows WHERE id LIKE %s AND done_at IS NOT NULL", (prefix + "%",)
    ).fetchone()
    return int(row[0])


def wait_done(conn: Any, worker: Worker, prefix: str, n: int, deadline: float, poll: float = 0.1) -> bool:
    last_note = time.monotonic()
    while time.monotonic() < deadline:
        worker.check_alive()
        if done_count(conn, prefix) >= n:
            return True
        if time.monotonic() - last_note > 10:
            log("waiting for the flows to finish...")
            last_note = time.monotonic()
        time.sleep(poll)
    return False


# --- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["postgres-rabbitmq"], default="postgres-rabbitmq")
    p.add_argument("--flows", type=int, default=500, help="flows to run (default 500)")
    p.add_argument("--concurrency", type=int, default=2, help="worker pool processes (default 2)")
    p.add_argument("--rate", type=float, default=None, help="latency mode: submit at this many flows/s")
    p.add_argument("--clients", type=int, default=4, help="concurrent submitting threads (default 4)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for submitting and finishing (default 600)")
    p.add_argument("--no-confirm-publish", dest="confirm_publish", action="store_false",
                   help="publish without RabbitMQ publisher confirms (Celery's default; Asyncflow uses them)")
    p.add_argument("--log-level", default="WARNING", help="worker log level (default WARNING)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (worker log) even on success")
    p.add_argument("--postgres-admin-url", default=None,
                   help="libpq URL to create/drop the database (default postgres@ then root@127.0.0.1:5432)")
    args = p.parse_args(argv)
    if args.flows < 1 or args.concurrency < 1 or args.clients < 1 or (args.rate is not None and args.rate <= 0):
        p.error("--flows, --concurrency, --clients and --rate must be positive")
    return args


@contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def warm_up(sub: Submitter, conn: Any, worker: Worker, timeout: float) -> float:
    flow_id = f"warmup-{uuid.uuid4().hex[:8]}"
    sub.submit(flow_id)
    if not wait_done(conn, worker, flow_id, 1, time.monotonic() + timeout, poll=0.02):
        raise SetupError(f"warm-up flow not done after {timeout:g}s; worker log:\n{worker.tail()}")
    created, done = conn.execute("SELECT created_at, done_at FROM peer_flows WHERE id = %s", (flow_id,)).fetchone()
    return done - created


def print_report(s: dict[str, Any]) -> None:
    m, cfg, r, c, sub = s["machine"], s["config"], s["results"], s["cpu"], s["submit"]
    print("=" * 78)
    print("Peer benchmark: Celery chain of 3 no-op steps, one PostgreSQL UPDATE per step")
    print("=" * 78)
    print(f"machine   : {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB RAM")
    print(f"os        : {m['os']}, kernel {m['kernel']}; Python {m['python']}")
    print(f"load avg  : {m['loadavg_at_start']} at start (1/5/15 min)")
    versions = ", ".join(f"{k} {v}" for k, v in s["versions"].items())
    print(f"backend   : {cfg['backend']} ({versions})")
    for note in s["notes"]:
        print(f"            {note}")
    mode = (f"latency, {cfg['rate']:g} flows/s open loop" if cfg["rate"]
            else f"throughput, {cfg['clients']} submitting threads")
    print(f"run       : {cfg['flows']} flows, mode {mode}")
    print(f"worker    : celery prefork -c {cfg['concurrency']}, acks late, prefetch x4, JSON, no result "
          f"backend, publisher confirms {'on' if cfg['confirm_publish'] else 'off'}")
    print(f"warm-up   : 1 flow, {s['warmup_ms']:.1f} ms submit->done")
    print()
    print(f"submitted : {sub['accepted']} accepted, {sub['errors']} errors in {sub['seconds']:.3f} s"
          f" = {sub['per_s']:.1f} submits/s")
    print(f"submit (INSERT + apply_async), ms  {fmt(sub['submit_ms'])}")
    if cfg["rate"]:
        print(f"schedule lag (ms)                  {fmt(sub['schedule_lag_ms'])}")
    print(f"outcome   : {r['done']} of {cfg['flows']} flows done{'  TIMED OUT' if s['timed_out'] else ''}")
    if r["flows_per_s"] is not None:
        label = "completed " if cfg["rate"] else "throughput"
        print(f"{label}: {r['flows_per_s']:.1f} flows/s  ({r['done']} flows, first created_at -> "
              f"last done_at = {r['window_seconds']:.3f} s; client wall {s['client_wall_seconds']:.3f} s)"
              + ("  [bounded by the offered rate]" if cfg["rate"] else ""))
    print()
    print("latencies in ms, database server timestamps:")
    print(f"  submit->done (done_at - created_at)  {fmt(r['submit_to_done_ms'])}")
    print()
    print(f"CPU during the run ({c['window_seconds']:.2f} s window, {m['cpus']} CPUs = "
          f"{c['window_seconds'] * m['cpus']:.2f} CPU-s available):")
    for key, secs in c["by_process"].items():
        print(f"  {key:<10} {secs:7.2f} CPU-s  {c['per_flow_ms'][key]:6.2f} ms/flow")
    print(f"  {'others':<10} {c['others_seconds']:7.2f} CPU-s  (database/broker servers, this script, "
          f"anything else on the machine)")
    print(f"    of which this script (the submitter): {c['script_seconds']:.2f} CPU-s")
    print(f"  machine busy {c['machine_busy_pct']:.0f}%")


def run(args: argparse.Namespace) -> int:
    import celery
    import kombu
    import psycopg

    machine = machine_info()
    home = Path(tempfile.mkdtemp(prefix="peer_bench_"))
    backend = Backend(args.backend)
    worker: Worker | None = None
    submitter: Submitter | None = None
    monitor: Any = None
    keep = args.keep
    try:
        log(f"backend {args.backend}: setting up (home {home})")
        try:
            setup_postgres(backend, args.postgres_admin_url)
            setup_rabbitmq(backend, None)
        except psycopg.Error as exc:
            raise SetupError(f"PostgreSQL setup failed: {exc!r}") from exc
        backend.versions.update(celery=celery.__version__, kombu=kombu.__version__)
        db_url = backend.env["ASYNCFLOW_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://", 1)
        broker_url = backend.env["ASYNCFLOW_BROKER_URL"]
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(SCHEMA)
        worker = Worker(home, db_url, broker_url, args.concurrency, args.confirm_publish, args.log_level)
        worker.start()
        submitter = Submitter(make_app(broker_url, args.confirm_publish), db_url)
        monitor = psycopg.connect(db_url, autocommit=True)
        warm = warm_up(submitter, monitor, worker, 120)
        log(f"worker ready; warm-up flow took {warm * 1000:.1f} ms")

        run_id = f"bench-{uuid.uuid4().hex[:10]}"
        deadline = time.monotonic() + args.timeout
        worker0, script0, machine0 = worker.cpu(), sum(os.times()[:2]), machine_cpu()
        t0 = time.perf_counter()
        if args.rate:
            log(f"submitting {args.flows} flows at {args.rate:g}/s")
            sub = submit_at_rate(submitter, run_id, args.flows, args.rate, args.clients, deadline)
        else:
            log(f"submitting {args.flows} flows with {args.clients} threads")
            sub = submit_burst(submitter, run_id, args.flows, args.clients, deadline)
        log(f"{len(sub.ids)} submitted in {sub.last_end - sub.first_start:.2f} s; waiting for them")
        finished = wait_done(monitor, worker, run_id + "-", len(sub.ids), deadline)
        wall = time.perf_counter() - t0
        worker1, script1, machine1 = worker.cpu(), sum(os.times()[:2]), machine_cpu()
        timed_out = not finished or len(sub.ids) + len(sub.errors) < args.flows
        if timed_out:
            log(f"timed out after {args.timeout:g} s")
        worker.check_alive()

        rows = monitor.execute(
            "SELECT step, created_at, done_at FROM peer_flows WHERE id LIKE %s", (run_id + "-%",)
        ).fetchall()
        done = [(c, d) for step_no, c, d in rows if d is not None and step_no == STEPS]
        window = max(d for _, d in done) - min(c for _, c, _ in rows) if done else None
        all_done = len(done) == args.flows
        e2e = [d - c for c, d in done]
        worker_cpu = round(worker1 - worker0, 2)
        busy, total = machine1[0] - machine0[0], machine1[1] - machine0[1]
        per_flow = 1000 / max(len(done), 1)
        summary: dict[str, Any] = {
            "machine": machine,
            "versions": backend.versions,
            "notes": backend.notes,
            "config": {
                "backend": args.backend, "flows": args.flows, "concurrency": args.concurrency,
                "rate": args.rate, "clients": args.clients, "timeout": args.timeout,
                "confirm_publish": args.confirm_publish,
            },
            "warmup_ms": round(warm * 1000, 2),
            "timed_out": timed_out,
            "client_wall_seconds": round(wall, 3),
            "submit": {
                "accepted": len(sub.ids),
                "errors": len(sub.errors),
                "first_errors": sub.errors[:3],
                "seconds": round(sub.last_end - sub.first_start, 3),
                "per_s": round(len(sub.ids) / max(sub.last_end - sub.first_start, 1e-9), 1),
                "submit_ms": dist_ms(sub.seconds),
                "schedule_lag_ms": dist_ms(sub.schedule_lag),
            },
            "results": {
                "done": len(done),
                "window_seconds": round(window, 3) if window else None,
                "flows_per_s": round(len(done) / window, 1) if window and all_done else None,
                "submit_to_done_ms": dist_ms(e2e),
            },
            "cpu": {
                "window_seconds": round(wall, 3),
                "by_process": {"worker": worker_cpu},
                "per_flow_ms": {"worker": round(worker_cpu * per_flow, 2)},
                "others_seconds": round(busy - worker_cpu, 2),
                "script_seconds": round(script1 - script0, 2),
                "machine_busy_pct": round(100 * busy / total, 1) if total else None,
            },
        }
        print_report(summary)
        status = 2 if timed_out else 1 if sub.errors or not all_done else 0
        r, c, d = summary["results"], summary["cpu"], summary["results"]["submit_to_done_ms"]
        result = {
            "bench": "celery_chain", "backend": args.backend, "mode": "rate" if args.rate else "burst",
            "flows": args.flows, "rate": args.rate, "concurrency": args.concurrency, "clients": args.clients,
            "succeeded": len(done), "submit_errors": len(sub.errors), "timed_out": timed_out,
            "flows_per_s": r["flows_per_s"], "window_s": r["window_seconds"],
            "submits_per_s": summary["submit"]["per_s"],
            "submit_done_p50_ms": d.get("p50"), "submit_done_p95_ms": d.get("p95"),
            "submit_done_p99_ms": d.get("p99"),
            "cpu_s": c["by_process"], "cpu_per_flow_ms": c["per_flow_ms"], "cpu_others_s": c["others_seconds"],
            "cpu_script_s": c["script_seconds"], "machine_busy_pct": c["machine_busy_pct"],
            "loadavg_at_start": machine["loadavg_at_start"], "exit_status": status,
        }
        print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
        if status:
            log(f"not every flow finished: {len(done)} of {args.flows}, {len(sub.errors)} submit errors "
                f"{sub.errors[:3]}")
            keep = True
        return status
    except SetupError as exc:
        log(f"setup failed or the worker died: {exc}")
        keep = True
        return 3
    except Exception as exc:  # noqa: BLE001 - report, clean up, and say where the log is
        log(f"benchmark failed: {exc!r}")
        if worker is not None and worker.proc is not None and worker.proc.poll() is not None:
            log(f"worker exited with {worker.proc.returncode}; log tail:\n{worker.tail(1500)}")
        keep = True
        return 3
    except KeyboardInterrupt:
        log("interrupted")
        keep = True
        return 130
    finally:
        if monitor is not None:
            monitor.close()
        if submitter is not None:
            submitter.close()
        if worker is not None:
            log("stopping the worker")
            t_stop = time.monotonic()
            worker.stop()
            log(f"stopped in {time.monotonic() - t_stop:.1f} s")
        backend.cleanup()
        if keep:
            log(f"worker log kept in {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with interrupt_on_sigterm():
        return run(args)


if __name__ == "__main__":
    sys.exit(main())
