#!/usr/bin/env python
"""What storing several steps' transitions together would save on PostgreSQL.

Group commit (a consumer that takes several messages and stores their outcomes
together) was measured here before it was built (it is now, opt-in:
shared/group_commit.py, ``ASYNCFLOW_WORKER_PREFETCH``). This replays: N
``noop`` flows (tests/support/flows.yaml) run through ``TaskService`` and
``StepConsumer`` as in step_path.py, and every transition statement the store
sends is recorded with its parameters. Those statements are then replayed, the
same SQL with the same values, on a second database holding the same new tasks:

- ``each``: one statement, one round trip and one commit each (autocommit), as
  the store runs them today;
- ``grouped``: the same transition of G flows (each flow's start, or its first
  outcome, ...) in one transaction, BEGIN, the G and COMMIT each a round trip:
  one commit for the G, and two round trips more;
- ``pipelined``: those G sent in psycopg's pipeline mode, one round trip for
  the G; PostgreSQL runs the statements between two syncs of a pipeline as one
  implicit transaction, so this is one commit for the G as well.

A flow's own statements keep their order, so every compare-and-set matches as it
did; after each replay the tasks' versions and the attempt rows are checked
against the recorded run's. The modes alternate, round by round, on the same
machine; each prints per transition the PostgreSQL server's CPU (every server
process: run it on a quiet machine), its WAL flushes, this process's CPU and
the wall time. Autovacuum is off on the replayed tables, so that it runs in no
round.

    .venv/bin/python benchmarks/group_commit.py --flows 2000 --rounds 3 --group 8
    .venv/bin/python benchmarks/group_commit.py --flows 2000 --rounds 3 --group 4
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
import psycopg  # noqa: E402
from stack import Backend, machine_info, servers_cpu, setup_postgres  # noqa: E402
from step_path import in_process  # noqa: E402  (it puts the project on sys.path)

from shared.migrate import upgrade  # noqa: E402
from shared.storage.driver import DriverStatement  # noqa: E402

# One statement as the store ran it, with the values it was given.
Recorded = tuple[DriverStatement, dict[str, Any]]
MODES = ("each", "grouped", "pipelined")


@contextmanager
def recording(statements: set[int]) -> Iterator[list[Recorded]]:
    """Every run of one of ``statements`` (by id), in order: through the cursor
    (``run``) or, as a transition goes, on libpq's own call (``count``)."""
    sent: list[Recorded] = []
    originals = {name: getattr(DriverStatement, name) for name in ("run", "count")}

    def recorder(original: Any) -> Any:
        def record(self: DriverStatement, cursor: Any, values: Any) -> Any:
            if id(self) in statements:
                sent.append((self, dict(values)))
            return original(self, cursor, values)

        return record

    for name, original in originals.items():
        setattr(DriverStatement, name, recorder(original))
    try:
        yield sent
    finally:
        for name, original in originals.items():
            setattr(DriverStatement, name, original)


def record_flows(
    url: str, flows: int
) -> tuple[list[dict[str, Any]], list[list[Recorded]], tuple[int, int], dict[str, DriverStatement]]:
    """Run ``flows`` flows: the new task rows, each flow's transitions in order, the end state, and
    the store's transition statements by kind (a key of ``SAVE_IN_ONE_STATEMENT``)."""
    store, publisher, service, consumer = in_process(url)
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
    with psycopg.connect(plain) as conn:
        end = state(conn)
    rows_by_name = [dict(zip(names, row, strict=True)) for row in rows]
    return rows_by_name, [by_flow[i] for i in ids], end, dict(store._save)  # type: ignore[attr-defined]


@contextmanager
def two_databases(admin_url: str | None) -> Iterator[tuple[str, str, dict[str, str]]]:
    """A new database to record a run in and another to replay it in: their URLs and the server's versions.

    Both are dropped at the end.
    """
    recorded, replayed = Backend("postgres"), Backend("postgres")
    try:
        setup_postgres(recorded, admin_url)
        setup_postgres(replayed, admin_url)
        yield recorded.env["ASYNCFLOW_DATABASE_URL"], replayed.env["ASYNCFLOW_DATABASE_URL"], recorded.versions
    finally:
        recorded.cleanup()
        replayed.cleanup()


def state(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """The sum of the tasks' versions and the number of attempt rows: equal after equal transitions."""
    row = conn.execute("SELECT (SELECT sum(version) FROM af_tasks), (SELECT count(*) FROM af_attempts)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def wal_syncs(conn: psycopg.Connection[Any]) -> int:
    # A backend reports its statistics at most once a second: this one's are flushed
    # as the first statement ends, so the second reads them whole.
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()
    assert row is not None
    return int(row[0])


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
    """Send every flow's statements: per step index, ``group`` flows at a time in ``mode``."""
    # The parameters converted before the clock starts: the store converts them before it sends.
    sent = [[(statement.sql, statement.params(values)) for statement, values in f] for f in flows]
    steps = max(len(f) for f in sent)
    count = sum(len(f) for f in sent)
    size = 1 if mode == "each" else group
    in_transaction = mode == "grouped"
    syncs = wal_syncs(conn)
    cpu, wall, server = time.process_time(), time.perf_counter(), servers_cpu()["postgresql"]
    with conn.cursor() as cur:
        for step in range(steps):
            batch = [f[step] for f in sent if step < len(f)]
            for first in range(0, len(batch), size):
                with conn.pipeline() if mode == "pipelined" else nullcontext():
                    if in_transaction:
                        cur.execute(b"BEGIN")
                    for sql, params in batch[first : first + size]:
                        cur.execute(sql, params, prepare=True)
                    if in_transaction:
                        cur.execute(b"COMMIT")
    seconds = {
        "postgresql_cpu_us": servers_cpu()["postgresql"] - server,
        "client_cpu_us": time.process_time() - cpu,
        "wall_us": time.perf_counter() - wall,
    }
    figures = {k: round(v * 1e6 / count, 1) for k, v in seconds.items()}
    return figures | {"wal_syncs": round((wal_syncs(conn) - syncs) / count, 3), "statements": count}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flows", type=int, default=2000, help="flows recorded and replayed (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every mode, alternating (default 3)")
    p.add_argument("--group", type=int, default=8, help="transitions per transaction when grouped (default 8)")
    p.add_argument("--postgres-admin-url", default=None, help="where to create the run's databases")
    args = p.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with two_databases(args.postgres_admin_url) as (recorded_url, url, versions):
        rows, flows, end, _ = record_flows(recorded_url, args.flows)
        upgrade(url)
        with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
            for table in ("af_tasks", "af_attempts"):
                conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
            for _ in range(args.rounds):
                for mode in MODES:
                    reset(conn, rows)
                    time.sleep(0.5)  # the VACUUM's own work out of the way
                    results[mode].append(replay(conn, flows, mode, args.group))
                    if state(conn) != end:
                        raise SystemExit(f"{mode}: the replay did not store what the run did ({state(conn)} != {end})")
    keys = ("postgresql_cpu_us", "client_cpu_us", "wall_us", "wal_syncs")
    summary = {m: {k: statistics.median(r[k] for r in rs) for k in keys} for m, rs in results.items()}
    labels = {"each": "one commit each", "grouped": f"{args.group} in a transaction", "pipelined": f"{args.group} pipelined"}
    for mode, figures in summary.items():
        print(f"{labels[mode]:<28} per transition: PostgreSQL {figures['postgresql_cpu_us']:6.1f} µs CPU "
              f"{figures['wal_syncs']:.3f} WAL flushes, this process {figures['client_cpu_us']:6.1f} µs CPU, "
              f"wall {figures['wall_us']:6.1f} µs (PostgreSQL by round: {[r['postgresql_cpu_us'] for r in results[mode]]})")
    statements = results["each"][0]["statements"]
    result = {"flows": args.flows, "transitions": statements, "group": args.group, "median": summary,
              "rounds": results, "versions": versions, "machine": machine_info()}
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
