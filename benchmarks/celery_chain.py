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
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import celery
import kombu
import psycopg
from celery import Celery, chain

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from figures import (  # noqa: E402
    conclude,
    cpu_figures,
    dist_ms,
    fmt,
    print_cpu,
    print_heading,
    print_outcome,
    print_submits,
    summary_head,
)
from runner import Run, add_keep_options, check_positive, guarded, measure, run_parser, wait_for  # noqa: E402
from stack import REPO, Backend, Processes, SetupError, log, machine_info, setup_postgres, setup_rabbitmq  # noqa: E402

QUEUE = "peer"
STEP_TASK = "peer.step"
STEPS = 3
PERCENTILES = (50, 90, 95, 99)
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
        _conn = psycopg.connect(os.environ["PEER_DATABASE_URL"], autocommit=True)
    return _conn


def step(flow_id: str, last: bool) -> None:
    _db().execute(UPDATE_LAST if last else UPDATE, (flow_id,))


app = make_app(os.environ.get("PEER_BROKER_URL", DEFAULT_BROKER), os.environ.get("PEER_CONFIRM_PUBLISH") == "1")


# --- the worker process ----------------------------------------------------------------------


class Worker(Processes):
    def __init__(self, home: Path, db_url: str, broker_url: str, concurrency: int, confirm_publish: bool,
                 log_level: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCFLOW_", "PEER_"))}
        env.update(
            PEER_DATABASE_URL=db_url,
            PEER_BROKER_URL=broker_url,
            PEER_CONFIRM_PUBLISH="1" if confirm_publish else "0",
            PYTHONPATH=os.pathsep.join([str(BENCH_DIR), str(REPO)]),
        )
        super().__init__(home, env)
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

    def start(self) -> None:
        self.launch("worker", self.args)


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
            conn = self._local.conn = psycopg.connect(self.db_url, autocommit=True)
            with self._lock:
                self._conns.append(conn)
        return conn

    def submit(self, flow_id: str) -> tuple[str, float]:
        """Returns (flow_id, seconds the submit took)."""
        t0 = time.perf_counter()
        self.conn().execute(INSERT, (flow_id,))
        steps = [
            self.celery.signature(STEP_TASK, args=(flow_id, k == STEPS), immutable=True)
            for k in range(1, STEPS + 1)
        ]
        chain(*steps).apply_async()
        return flow_id, time.perf_counter() - t0

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self.celery.close()


def done_count(conn: Any, prefix: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM peer_flows WHERE id LIKE %s AND done_at IS NOT NULL", (prefix + "%",)
    ).fetchone()
    return int(row[0])


# --- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = run_parser(__doc__, ["postgres-rabbitmq"], "postgres-rabbitmq", "concurrent submitting threads (default 4)")
    p.add_argument("--no-confirm-publish", dest="confirm_publish", action="store_false",
                   help="publish without RabbitMQ publisher confirms (Celery's default; Asyncflow uses them)")
    p.add_argument("--log-level", default="WARNING", help="worker log level (default WARNING)")
    add_keep_options(p, "worker log")
    args = p.parse_args(argv)
    check_positive(p, args)
    return args


def warm_up(sub: Submitter, conn: Any, worker: Worker, timeout: float) -> float:
    flow_id = f"warmup-{uuid.uuid4().hex[:8]}"
    sub.submit(flow_id)
    if not wait_for(lambda: done_count(conn, flow_id) >= 1, worker.check_alive, time.monotonic() + timeout,
                    poll=0.02):
        raise SetupError(f"warm-up flow not done after {timeout:g}s; worker log:\n{worker.tail('worker')}")
    created, done = conn.execute("SELECT created_at, done_at FROM peer_flows WHERE id = %s", (flow_id,)).fetchone()
    return done - created


def print_report(s: dict[str, Any]) -> None:
    cfg, r = s["config"], s["results"]
    print_heading(s, "Peer benchmark: Celery chain of 3 no-op steps, one PostgreSQL UPDATE per step")
    mode = (f"latency, {cfg['rate']:g} flows/s open loop" if cfg["rate"]
            else f"throughput, {cfg['clients']} submitting threads")
    print(f"run       : {cfg['flows']} flows, mode {mode}")
    print(f"worker    : celery prefork -c {cfg['concurrency']}, acks late, prefetch x4, JSON, no result "
          f"backend, publisher confirms {'on' if cfg['confirm_publish'] else 'off'}")
    print(f"warm-up   : 1 flow, {s['warmup_ms']:.1f} ms submit->done")
    print()
    print_submits(s, "submit_ms", "submit (INSERT + apply_async), ms", 35, mid=95)
    print_outcome(s, f"{r['done']} of {cfg['flows']} flows done", r["done"], "created_at", "done_at")
    print()
    print("latencies in ms, database server timestamps:")
    print(f"  submit->done (done_at - created_at)  {fmt(r['submit_to_done_ms'], 95)}")
    print_cpu(s)


def bench(args: argparse.Namespace, run: Run) -> int:
    machine = machine_info()
    backend = Backend(args.backend)
    run.exits.callback(backend.cleanup)
    log(f"backend {args.backend}: setting up (home {run.home})")
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
    worker = Worker(run.home, db_url, broker_url, args.concurrency, args.confirm_publish, args.log_level)
    run.stop_at_end(worker, "worker")
    worker.start()
    submitter = Submitter(make_app(broker_url, args.confirm_publish), db_url)
    run.exits.callback(submitter.close)
    monitor = psycopg.connect(db_url, autocommit=True)
    run.exits.callback(monitor.close)
    warm = warm_up(submitter, monitor, worker, 120)
    log(f"worker ready; warm-up flow took {warm * 1000:.1f} ms")

    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    m = measure(args, worker, lambda i: submitter.submit(f"{run_id}-{i}"),
                lambda sub: done_count(monitor, run_id + "-") >= len(sub.ids), "threads")

    rows = monitor.execute(
        "SELECT step, created_at, done_at FROM peer_flows WHERE id LIKE %s", (run_id + "-%",)
    ).fetchall()
    done = [(c, d) for step_no, c, d in rows if d is not None and step_no == STEPS]
    window = max(d for _, d in done) - min(c for _, c, _ in rows) if done else None
    all_done = len(done) == args.flows
    e2e = [d - c for c, d in done]
    per_flow = 1000 / max(len(done), 1)
    summary: dict[str, Any] = {
        **summary_head(args, machine, backend, warm, m, "submit_ms", PERCENTILES,
                       confirm_publish=args.confirm_publish),
        "results": {
            "done": len(done),
            "window_seconds": round(window, 3) if window else None,
            "flows_per_s": round(len(done) / window, 1) if window and all_done else None,
            "submit_to_done_ms": dist_ms(e2e, PERCENTILES),
        },
        "cpu": cpu_figures(m, {k: round(v * per_flow, 2) for k, v in m.cpu.items()}, submits=True),
    }
    print_report(summary)
    status = conclude("celery_chain", args, summary, m, len(done), e2e)
    if status:
        log(f"not every flow finished: {len(done)} of {args.flows}, {len(m.sub.errors)} submit errors "
            f"{m.sub.errors[:3]}")
    return status


def main(argv: list[str] | None = None) -> int:
    return guarded(parse_args(argv), bench, "peer_bench_", "the worker died", "worker log")


if __name__ == "__main__":
    sys.exit(main())
