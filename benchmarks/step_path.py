#!/usr/bin/env python
"""Asyncflow's own cost per flow, without a broker or HTTP: one process, PostgreSQL.

Submits N ``noop`` flows (tests/support/flows.yaml) through ``TaskService.submit``
with a publisher that keeps the messages in memory, then runs each first step with
``StepConsumer.handle``, which runs the flow's next two steps on in the same call
(the default). What it measures is the code Asyncflow owns on a step's path: the
saga decision, the row codec, the statements and the pulse, with PostgreSQL's
round trips; not Celery, kombu, uvicorn or FastAPI.

It prints the process CPU and wall time per flow of each phase, and the database's
side of the whole run: the PostgreSQL server processes' CPU, the WAL written (the
cluster's, so nothing else should be writing) and how many task-row updates were
HOT (heap-only: no index entry written). CPU time is noisy
on a shared machine: for a figure that is not, count instructions under
callgrind at two sizes and take the difference, which cancels start-up and
warm-up:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/step_path.py --flows 30
    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/step_path.py --flows 130
    # (Collected of the second - Collected of the first) / 100 = instructions per flow

    .venv/bin/python benchmarks/step_path.py --flows 2000
    .venv/bin/python benchmarks/step_path.py --flows 2000 --log-level INFO  # with a worker's log lines
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from stack import REPO, SUPPORT, Backend, machine_info, servers_cpu, setup_postgres  # noqa: E402

sys.path[:0] = [str(SUPPORT), str(REPO)]

import psycopg  # noqa: E402
import testmod  # noqa: E402

from shared.config import Settings  # noqa: E402
from shared.consumer import StepConsumer  # noqa: E402
from shared.flows import load_flows  # noqa: E402
from shared.logs import setup_logging  # noqa: E402
from shared.migrate import upgrade  # noqa: E402
from shared.service import TaskService, timing_of  # noqa: E402
from shared.states import TaskStatus  # noqa: E402
from shared.storage import SqlStore, open_store  # noqa: E402
from shared.testing import QueuePublisher  # noqa: E402

WARM_UP = 50


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flows", type=int, default=1000, help="flows measured (default 1000)")
    p.add_argument("--postgres-admin-url", default=None, help="where to create the run's database")
    p.add_argument("--log-level", default=None,
                   help="log as a worker does, at this level, to a temporary file (default: no logging)")
    args = p.parse_args(argv)
    if args.log_level:
        log_as_worker(args.log_level)
    backend = Backend("postgres")
    setup_postgres(backend, args.postgres_admin_url)
    try:
        url = backend.env["ASYNCFLOW_DATABASE_URL"]
        store, publisher, service, consumer = in_process(url)

        def run(flows: int) -> dict[str, float]:
            """Submit ``flows`` flows, then run them; CPU and wall ms per flow of each phase."""
            figures: dict[str, float] = {}
            cpu, wall = time.process_time(), time.perf_counter()
            ids = [service.submit("noop", {})[0].task_id for _ in range(flows)]
            figures |= {"submit_cpu_ms": time.process_time() - cpu, "submit_wall_ms": time.perf_counter() - wall}
            cpu, wall = time.process_time(), time.perf_counter()
            while publisher.messages:
                consumer.handle(publisher.messages.popleft(), continue_until=time.monotonic() + 3600)
            figures |= {"steps_cpu_ms": time.process_time() - cpu, "steps_wall_ms": time.perf_counter() - wall}
            unfinished = [i for i in ids if service.get(i).status is not TaskStatus.SUCCESS]  # type: ignore[union-attr]
            if unfinished:
                raise SystemExit(f"{len(unfinished)} flows did not succeed, e.g. {unfinished[0]}")
            return {k: round(v * 1000 / flows, 3) for k, v in figures.items()}

        run(WARM_UP)
        before = database_counters(url)
        figures = run(args.flows)
        after = database_counters(url)
        figures |= {
            "postgresql_cpu_ms": round((after["cpu_s"] - before["cpu_s"]) * 1000 / args.flows, 3),
            "wal_bytes": round((after["wal_bytes"] - before["wal_bytes"]) / args.flows),
            "task_updates": round((after["updates"] - before["updates"]) / args.flows, 2),
            "task_updates_hot": round((after["hot_updates"] - before["hot_updates"]) / args.flows, 2),
        }
        store.close()
    finally:
        backend.cleanup()
    result = {"flows": args.flows, "per_flow": figures, "versions": backend.versions, "machine": machine_info()}
    print(f"{args.flows} flows, per flow: submit {figures['submit_cpu_ms']} ms CPU ({figures['submit_wall_ms']} wall), "
          f"three steps {figures['steps_cpu_ms']} ms CPU ({figures['steps_wall_ms']} wall); "
          f"PostgreSQL {figures['postgresql_cpu_ms']} ms CPU, {figures['wal_bytes']} WAL bytes, "
          f"{figures['task_updates']} task-row updates of which {figures['task_updates_hot']} HOT")
    print("RESULT " + json.dumps(result))
    return 0


def in_process(url: str) -> tuple[SqlStore, QueuePublisher, TaskService, StepConsumer]:
    """The store, a publisher keeping the messages, the service and the consumer, on a migrated ``url``."""
    upgrade(url)
    settings = Settings(home=Path("."), database_url=url)
    store = open_store(url)
    publisher = QueuePublisher()
    service = TaskService(store, publisher, load_flows(SUPPORT / "flows.yaml"), timing=timing_of(settings))
    return store, publisher, service, StepConsumer(service, {"alpha": testmod.alpha, "beta": testmod.beta}, settings)


def log_as_worker(level: str) -> None:
    """The worker's logging (text lines with the attempt's fields), into a file deleted at exit."""
    setup_logging(Settings(home=Path("."), log_level=level), "worker")
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(tempfile.TemporaryFile("w"))  # noqa: SIM115 - open until the process exits


def database_counters(url: str) -> dict[str, float]:
    """The server's CPU, the cluster's WAL position and the task table's update counts, now."""
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
        # The statistics of this backend's transactions are flushed at most once a second.
        conn.execute("SELECT pg_stat_force_next_flush()")
        time.sleep(1.1)
        wal = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        updates = conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'af_tasks'"
        ).fetchone()
    assert wal is not None and updates is not None
    return {"cpu_s": servers_cpu()["postgresql"], "wal_bytes": float(wal[0]),
            "updates": float(updates[0]), "hot_updates": float(updates[1])}


if __name__ == "__main__":
    sys.exit(main())
