#!/usr/bin/env python
"""Celery's worker against Asyncflow's own consumer processes, on the same steps.

Both sides consume the same queues (``asyncflow.alpha``, ``asyncflow.beta``) of a
RabbitMQ vhost of their own, and both run each message through the same
:class:`shared.consumer.StepConsumer` on the same PostgreSQL database:

  celery  ``asyncflow worker alpha beta -c 1``: Celery's consumer in the main
          process, the steps in its one prefork pool process
  kombu   ``asyncflow worker alpha beta -c 1 --pool kombu``: one consumer process
          of our own taking its messages from the broker and running them, under
          a main process that supervises it (shared.messaging.consumers)

Both keep each attempt's time limits, report a killed process's attempt, bound
their stop and retry a message the database refused.

A round starts one side's worker, warms it up on ``--warm-up`` flows, then
stores ``--flows`` three-step no-op flows in batches (``TaskService.submit_many``
in this process: each first step published to its queue) and waits until all
of them succeeded. The worker's CPU per flow (all its processes, and its main
process alone), and PostgreSQL's and RabbitMQ's, are read over the measured
flows only. Sides alternate, ``--rounds`` times each, on the same database and
vhost.

    .venv/bin/python benchmarks/consumers.py --flows 2000 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import CLK_TCK, MODULES, REPO, SetupError, Stack, log, machine_info, make_backend, servers_cpu  # noqa: E402

sys.path.insert(0, str(REPO))

FLOW = "noop"
SIDES = ("celery", "kombu")


def own_cpu(pid: int) -> float:
    """CPU seconds (user+system) of process ``pid`` alone: a Celery worker's main process, not its pool."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def succeeded(database_url: str, ids: list[str]) -> int:
    import psycopg

    from shared.states import TaskStatus

    with psycopg.connect(database_url.replace("+psycopg", "")) as conn:
        row = conn.execute(
            "SELECT count(*) FROM af_tasks WHERE task_id = ANY(%s) AND status = %s", (ids, int(TaskStatus.SUCCESS))
        ).fetchone()
    return int(row[0]) if row else 0


def submit(service: Any, count: int, batch: int) -> list[str]:
    from shared.service import Submission

    ids = [f"c{uuid.uuid4().hex}" for _ in range(count)]
    for start in range(0, count, batch):
        # Concurrent submits' path: each first step published now (a batch's waits for a scheduler).
        service.submit_each([Submission(FLOW, {}, task_id=i) for i in ids[start : start + batch]])
    return ids


def wait_for(database_url: str, ids: list[str], stack: Stack, timeout: float) -> float:
    """Seconds until every task of ``ids`` succeeded."""
    started = time.monotonic()
    while succeeded(database_url, ids) < len(ids):
        stack.check_alive()
        if time.monotonic() - started > timeout:
            raise SetupError(f"{len(ids)} flows not all done after {timeout:g}s")
        time.sleep(0.1)  # the count's own cost stays out of PostgreSQL's figure
    return time.monotonic() - started


def run_round(side: str, backend: Any, home: Path, args: argparse.Namespace, service: Any) -> dict[str, float]:
    stack = Stack(home, backend, concurrency=1, log_level=args.log_level)
    stack.env["ASYNCFLOW_MIGRATE_ON_START"] = "false"
    stack.spawn("consumer", "worker", *MODULES, "-c", "1", "--pool", side)
    url = stack.env["ASYNCFLOW_DATABASE_URL"]
    try:
        wait_for(url, submit(service, args.warm_up, args.batch), stack, 120)
        main = stack.procs["consumer"].pid
        cpu, main_cpu, servers = stack.cpu()["consumer"], own_cpu(main), servers_cpu()
        seconds = wait_for(url, submit(service, args.flows, args.batch), stack, args.timeout)
        cpu, main_cpu = stack.cpu()["consumer"] - cpu, own_cpu(main) - main_cpu
        after = servers_cpu()
    finally:
        stack.stop()
    per_flow = 1000 / args.flows
    return {
        "flows_per_s": args.flows / seconds,
        "consumer_ms": cpu * per_flow,
        "main_process_ms": main_cpu * per_flow,
        "postgresql_ms": (after["postgresql"] - servers["postgresql"]) * per_flow,
        "rabbitmq_ms": (after["rabbitmq"] - servers["rabbitmq"]) * per_flow,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flows", type=int, default=2000, help="flows measured per round (default 2000)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each side, alternating (default 2)")
    p.add_argument("--warm-up", type=int, default=100, help="flows run before each measurement (default 100)")
    p.add_argument("--batch", type=int, default=500, help="flows stored per submit_many (default 500)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a round may take (default 600)")
    p.add_argument("--log-level", default=None, help="ASYNCFLOW_LOG_LEVEL of the consumers (default: INFO)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    p.add_argument("--postgres-admin-url", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.backend, args.rabbitmq_vhost = "postgres-rabbitmq", None
    backend = make_backend(args)
    results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    try:
        with tempfile.TemporaryDirectory(prefix="af-consumers-") as tmp:
            home = Path(tmp)
            # This process stores the flows: the consumers' environment, without their processes.
            os.environ.update(Stack(home, backend, concurrency=1, log_level=args.log_level).env)
            from shared.config import Settings
            from shared.migrate import upgrade
            from shared.runtime import Runtime

            upgrade(os.environ["ASYNCFLOW_DATABASE_URL"])
            runtime = Runtime(Settings())
            for r in range(args.rounds):
                for side in SIDES if r % 2 == 0 else reversed(SIDES):
                    figures = run_round(side, backend, home, args, runtime.service)
                    results[side].append(figures)
                    log(f"round {r + 1} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
            runtime.close()
    finally:
        backend.cleanup()
    print(f"machine : {machine_info()}")
    print(f"backend : PostgreSQL {backend.versions.get('postgresql')}, RabbitMQ {backend.versions.get('rabbitmq')}")
    print(f"run     : {args.flows} three-step no-op flows per round, {args.rounds} rounds per side, alternating")
    for side in SIDES:
        for key in ("flows_per_s", "consumer_ms", "main_process_ms", "postgresql_ms", "rabbitmq_ms"):
            print(f"{side:7} {key:16}: " + " · ".join(f"{f[key]:.2f}" for f in results[side]))
    ratios = [c["consumer_ms"] / k["consumer_ms"] for c, k in zip(results["celery"], results["kombu"], strict=True)]
    print("consumer CPU per flow, celery / kombu, by round: " + " · ".join(f"{x:.2f}" for x in ratios))
    if args.json:
        print(json.dumps({"machine": machine_info(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
