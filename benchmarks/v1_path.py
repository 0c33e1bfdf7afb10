#!/usr/bin/env python
"""The v1 API's own cost per call, without HTTP: one process, PostgreSQL.

Creates N tasks of a registered type through ``PullService.create`` (create_task),
leases them one per call through ``PullService.hold`` (hold_tasks, schedule_limit
1) and reports each done through ``PullService.set`` (set_task), then creates N
more in batches of ``--batch`` through ``PullService.create_many`` (create_tasks,
its figures per task) and in batches of ``--coalesced`` through
``PullService.create_each`` (concurrent create_task calls, which the API stores
together, per task): the service and
the store with PostgreSQL's round trips, not uvicorn, FastAPI or the body checks
(``v1_api.py`` measures those too, over HTTP).

It prints the process CPU and wall time per call of each. For a figure the
machine's noise does not move, count instructions under callgrind at two sizes
and take the difference, which cancels start-up and warm-up:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/v1_path.py --calls 50
    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python benchmarks/v1_path.py --calls 250
    # (Collected of the second - Collected of the first) / 200 = instructions per create + hold + set

    .venv/bin/python benchmarks/v1_path.py --calls 3000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from stack import REPO, Backend, machine_info, setup_postgres  # noqa: E402

sys.path.insert(0, str(REPO))

from shared.migrate import upgrade  # noqa: E402
from shared.pull.rules import PullStatus, Report  # noqa: E402
from shared.pull.service import NewPullTask, PullService  # noqa: E402
from shared.storage import open_store  # noqa: E402
from shared.storage.sql_pull import SqlPullStore  # noqa: E402

WARM_UP = 50
TASK_TYPE = "bench"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=1000, help="calls of each endpoint measured (default 1000)")
    p.add_argument("--batch", type=int, default=500, help="tasks per create_many call (default 500)")
    p.add_argument("--coalesced", type=int, default=3,
                   help="tasks per create_each call, as concurrent create_task calls stored together (default 3)")
    p.add_argument("--postgres-admin-url", default=None, help="where to create the run's database")
    args = p.parse_args(argv)
    backend = Backend("postgres")
    setup_postgres(backend, args.postgres_admin_url)
    try:
        url = backend.env["ASYNCFLOW_DATABASE_URL"]
        upgrade(url)
        store = open_store(url)
        service = PullService(SqlPullStore(store))  # type: ignore[arg-type]
        service.register_type({"task_type": TASK_TYPE, "schedule_limit": 1, "max_processing_time": 3600})

        def run(calls: int) -> dict[str, float]:
            """``calls`` creates, then as many holds and sets; CPU and wall ms per call of each."""
            figures: dict[str, float] = {}

            def timed(name: str, one: object) -> None:
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(calls):
                    one()  # type: ignore[operator]
                figures[name + "_cpu_ms"] = time.process_time() - cpu
                figures[name + "_wall_ms"] = time.perf_counter() - wall

            held: list[str] = []
            timed("create", lambda: service.create(TASK_TYPE, "{}"))
            timed("hold", lambda: held.extend(t.task_id for t in service.hold(TASK_TYPE)))
            if len(held) != calls:
                raise SystemExit(f"{calls} holds leased {len(held)} tasks")
            done = iter(held)
            timed("set", lambda: service.set(next(done), Report(PullStatus.SUCCESS)))
            figures = {k: v * 1000 / calls for k, v in figures.items()}

            def per_task(name: str, size: int, create: Callable[[list[NewPullTask]], object]) -> None:
                batches = [[NewPullTask(TASK_TYPE, "{}") for _ in range(size)] for _ in range(max(1, calls // size))]
                cpu, wall = time.process_time(), time.perf_counter()
                for batch in batches:
                    create(batch)
                figures[name + "_cpu_ms"] = (time.process_time() - cpu) * 1000 / (len(batches) * size)
                figures[name + "_wall_ms"] = (time.perf_counter() - wall) * 1000 / (len(batches) * size)

            per_task("batch", args.batch, service.create_many)  # create_tasks: all or none
            per_task("each", args.coalesced, service.create_each)  # create_task calls coalesced by the API
            return {k: round(v, 3) for k, v in figures.items()}

        run(WARM_UP)
        figures = run(args.calls)
        store.close()
    finally:
        backend.cleanup()
    result = {"calls": args.calls, "per_call": figures, "versions": backend.versions, "machine": machine_info()}
    print(f"{args.calls} calls each, per call: "
          + ", ".join(f"{name} {figures[name + '_cpu_ms']} ms CPU ({figures[name + '_wall_ms']} wall)"
                      for name in ("create", "hold", "set")))
    print(f"create_many in batches of {args.batch}, per task: {figures['batch_cpu_ms']} ms CPU "
          f"({figures['batch_wall_ms']} wall)")
    print(f"create_each in batches of {args.coalesced}, per task: {figures['each_cpu_ms']} ms CPU "
          f"({figures['each_wall_ms']} wall)")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
