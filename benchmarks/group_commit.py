#!/usr/bin/env python
"""What storing several steps' transitions in one transaction would save on PostgreSQL.

Group commit (a consumer that takes several messages and stores their outcomes
together) is not built. This measures its ground before anyone builds it: N
``noop`` flows (tests/support/flows.yaml) run through ``TaskService`` and
``StepConsumer`` as in step_path.py, and every transition statement the store
sends is recorded with its parameters. Those statements are then replayed, the
same SQL with the same values, on a second database holding the same new tasks:

- ``each``: one statement, one commit (autocommit), as the store runs them today;
- ``group G``: the same transition of G flows (each flow's start, or its first
  outcome, ...) in one transaction: one commit for G statements;
- ``pipeline G``: the same, in psycopg's pipeline mode: one round trip as well.

A flow's own statements keep their order, so every compare-and-set matches as it
did. The modes alternate, round by round, on the same machine; each prints the
PostgreSQL server's CPU, this process's CPU and the wall time per transition.

    .venv/bin/python benchmarks/group_commit.py --flows 2000 --rounds 3 --group 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from stack import REPO, SUPPORT, Backend, machine_info, servers_cpu, setup_postgres  # noqa: E402

sys.path[:0] = [str(SUPPORT), str(REPO)]

import psycopg  # noqa: E402
import testmod  # noqa: E402

from shared.config import Settings  # noqa: E402
from shared.consumer import StepConsumer  # noqa: E402
from shared.flows import load_flows  # noqa: E402
from shared.migrate import upgrade  # noqa: E402
from shared.service import TaskService, timing_of  # noqa: E402
from shared.storage import open_store  # noqa: E402
from shared.storage.driver import DriverStatement  # noqa: E402
from shared.testing import QueuePublisher  # noqa: E402

# (sql, parameters) of one statement, and which flow it belongs to.
Recorded = tuple[bytes, dict[str, Any]]


@contextmanager
def recording(statements: set[int]) -> Iterator[list[Recorded]]:
    """Every run of one of ``statements`` (by id), as sent."""
    sent: list[Recorded] = []
    run = DriverStatement.run

    def record(self: DriverStatement, cursor: Any, values: Any) -> Any:
        if id(self) in statements:
            sent.append((self.sql, self.params(values)))
        return run(self, cursor, values)

    DriverStatement.run = record  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        DriverStatement.run = run  # type: ignore[method-assign]


def record_flows(url: str, flows: int) -> tuple[list[dict[str, Any]], list[list[Recorded]]]:
    """Run ``flows`` flows; the new task rows, and each flow's transition statements in order."""
    upgrade(url)
    settings = Settings(home=Path("."), database_url=url)
    store = open_store(url)
    publisher = QueuePublisher()
    service = TaskService(store, publisher, load_flows(SUPPORT / "flows.yaml"), timing=timing_of(settings))
    consumer = StepConsumer(service, {"alpha": testmod.alpha, "beta": testmod.beta}, settings)
    ids = [service.submit("noop", {})[0].task_id for _ in range(flows)]
    plain = url.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(plain) as conn:
        rows = conn.execute("SELECT * FROM af_tasks").fetchall()
        names = [c.name for c in conn.execute("SELECT * FROM af_tasks LIMIT 0").description or []]
    by_flow: dict[str, list[Recorded]] = defaultdict(list)
    with recording({id(s) for s in store._save.values()}) as sent:  # type: ignore[attr-defined]
        while publisher.messages:
            message = publisher.messages.popleft()
            before = len(sent)
            consumer.handle(message, continue_until=time.monotonic() + 3600)
            by_flow[message.task_id].extend(sent[before:])
    store.close()
    return [dict(zip(names, row, strict=True)) for row in rows], [by_flow[i] for i in ids]


def reset(conn: psycopg.Connection[Any], rows: list[dict[str, Any]]) -> None:
    """The replay database back to the new tasks, and analysed, outside the measured time."""
    conn.execute("TRUNCATE af_tasks, af_attempts")
    names = list(rows[0])
    with conn.cursor() as cur, cur.copy(f"COPY af_tasks ({', '.join(names)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row([json.dumps(v) if isinstance(v, dict | list) else v for v in row.values()])
    conn.execute("VACUUM ANALYZE af_tasks")
    conn.execute("VACUUM ANALYZE af_attempts")


def replay(conn: psycopg.Connection[Any], flows: list[list[Recorded]], mode: str, group: int) -> dict[str, float]:
    """Send every flow's statements: per step index, ``group`` flows at a time."""
    steps = max(len(f) for f in flows)
    count = sum(len(f) for f in flows)
    cpu, wall, server = time.process_time(), time.perf_counter(), servers_cpu()["postgresql"]
    with conn.cursor() as cur:
        for step in range(steps):
            batch = [f[step] for f in flows if step < len(f)]
            size = 1 if mode == "each" else group
            for first in range(0, len(batch), size):
                chunk = batch[first : first + size]
                transaction = conn.transaction() if size > 1 else nullcontext()
                pipeline = conn.pipeline() if mode == "pipeline" else nullcontext()
                with transaction, pipeline:
                    for sql, params in chunk:
                        cur.execute(sql, params, prepare=True)
                        if mode != "pipeline":
                            matched = cur.fetchone()
                            assert matched is not None and next(iter(matched)) == 1, "a transition did not match"
    server_s = servers_cpu()["postgresql"] - server
    per = 1e6 / count
    return {
        "postgresql_cpu_us": round(server_s * per, 1),
        "client_cpu_us": round((time.process_time() - cpu) * per, 1),
        "wall_us": round((time.perf_counter() - wall) * per, 1),
        "statements": count,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flows", type=int, default=2000, help="flows recorded and replayed (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every mode, alternating (default 3)")
    p.add_argument("--group", type=int, default=8, help="transitions per transaction when grouped (default 8)")
    p.add_argument("--postgres-admin-url", default=None, help="where to create the run's databases")
    args = p.parse_args(argv)
    recorded, replayed = Backend("postgres"), Backend("postgres")
    setup_postgres(recorded, args.postgres_admin_url)
    setup_postgres(replayed, args.postgres_admin_url)
    modes = ["each", "group", "pipeline"]
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    try:
        rows, flows = record_flows(recorded.env["ASYNCFLOW_DATABASE_URL"], args.flows)
        url = replayed.env["ASYNCFLOW_DATABASE_URL"]
        upgrade(url)
        with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
            for _ in range(args.rounds):
                for mode in modes:
                    reset(conn, rows)
                    time.sleep(0.5)  # the VACUUM's own work out of the way
                    results[mode].append(replay(conn, flows, mode, args.group))
    finally:
        recorded.cleanup()
        replayed.cleanup()
    summary = {
        m: {k: statistics.median(r[k] for r in rs) for k in ("postgresql_cpu_us", "client_cpu_us", "wall_us")}
        for m, rs in results.items()
    }
    for mode, figures in summary.items():
        label = "each (autocommit)" if mode == "each" else f"{mode} of {args.group}"
        print(f"{label:<22} per transition: PostgreSQL {figures['postgresql_cpu_us']:7.1f} µs CPU, "
              f"this process {figures['client_cpu_us']:6.1f} µs CPU, wall {figures['wall_us']:7.1f} µs "
              f"(rounds: {[r['postgresql_cpu_us'] for r in results[mode]]})")
    statements = results["each"][0]["statements"]
    result = {"flows": args.flows, "transitions": statements, "group": args.group, "median": summary,
              "rounds": results, "versions": recorded.versions, "machine": machine_info()}
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
