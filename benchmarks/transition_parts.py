#!/usr/bin/env python
"""Where PostgreSQL's CPU goes in a transition: the task row, the attempt rows, the commit.

A step's transition is one statement (``SAVE_IN_ONE_STATEMENT``): the task row's
compare-and-set, and as data-modifying CTEs the write of the attempt that ended
(its outcome) and the insert of the next attempt. This records the transitions
of N ``noop`` flows, as ``group_commit.py`` does, and replays them one commit
each on a second database holding the same new tasks, in these variants,
alternating round by round:

- ``whole``: as the store sends them (checked: the same versions and attempt rows);
- ``no attempt update``: the same, without the update of the attempt that ended;
- ``no attempt insert``: without the insert of the attempt that starts;
- ``task row only``: without either attempt write;
- ``task row, no JSON``: the task row's compare-and-set without its two JSON
  columns (``parameters``, ``steps``), which every transition now writes whole;
- ``one-row UPDATE``: per transition, instead, the statement of the Celery-chain
  peer (``celery_chain.py``): one column of a three-column row set by its key,
  a row per flow;
- ``round trip``: per transition, ``SELECT 1``: what a round trip costs the
  server without a write or a commit.

It prints the PostgreSQL server's CPU per transition of each (every server
process: run it on a quiet machine), medians over the rounds, and each round's.

    .venv/bin/python benchmarks/transition_parts.py --flows 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import psycopg  # noqa: E402
from group_commit import record_flows, reset, state, two_databases  # noqa: E402
from sqlalchemy import bindparam, create_engine, update  # noqa: E402
from stack import machine_info, servers_cpu  # noqa: E402

from shared.migrate import upgrade  # noqa: E402
from shared.storage.driver import DriverStatement  # noqa: E402
from shared.storage.schema import tasks  # noqa: E402
from shared.storage.statements import SAVE_TASK, SAVED_COLUMNS  # noqa: E402

# A recorded transition: the kind of statement (a key of SAVE_IN_ONE_STATEMENT) and its values.
Recorded = tuple[str, dict[str, Any]]


def _without(write: str) -> Callable[[str], str]:
    """``kind`` without its attempt update (``write`` "update") or its attempt insert ("insert")."""

    def reduce(kind: str) -> str:
        base, _, nxt = kind.partition("+")
        if write == "insert":
            return "none" if base == "insert" else base
        return ("none" if base in ("outcome", "heartbeat") else base) + (f"+{nxt}" if nxt else "")

    return reduce


VARIANTS: dict[str, Callable[[str], str] | None] = {
    "whole": lambda kind: kind,
    "no attempt update": _without("update"),
    "no attempt insert": _without("insert"),
    "task row only": lambda kind: "none",
    "task row, no JSON": lambda kind: "narrow",
    "one-row UPDATE": None,
    "round trip": None,
}
NARROW = update(tasks).where(SAVE_TASK.whereclause).values(
    {n: bindparam("t_" + n, type_=tasks.c[n].type) for n in SAVED_COLUMNS if n not in ("parameters", "steps")}
)
PEER_UPDATE = b"UPDATE chain_rows SET step = step + 1 WHERE id = %(id)s"


def transitions(url: str, flows: int) -> tuple[list[dict[str, Any]], list[Recorded], tuple[int, int], Any]:
    """``group_commit.record_flows`` with each transition as its kind and values, flow by flow
    (as they were sent: each flow ran whole in its first step's delivery), and the
    statements by kind, the narrow task row's among them."""
    rows, by_flow, end, statements = record_flows(url, flows)
    kinds = {id(statement): kind for kind, statement in statements.items()}
    sent = [(kinds[id(statement)], values) for flow in by_flow for statement, values in flow]
    statements["narrow"] = DriverStatement(NARROW, create_engine(url), prepared=True)
    return rows, sent, end, statements


def replay(conn: psycopg.Connection[Any], sent: list[Recorded], statements: Any, variant: str) -> float:
    """Send one statement per recorded transition, one commit each; PostgreSQL's CPU µs per transition."""
    reduce = VARIANTS[variant]
    server = servers_cpu()["postgresql"]
    with conn.cursor() as cur:
        for number, (kind, values) in enumerate(sent):
            if reduce is not None:
                # Prepared and made again as the store does: a generic plan made on the
                # empty tables of the reset would scan af_attempts whole at every step.
                statements[reduce(kind)].run(cur, values)
            elif variant == "one-row UPDATE":
                cur.execute(PEER_UPDATE, {"id": number // 4}, prepare=True)
            else:
                cur.execute(b"SELECT 1", prepare=True)
    return round((servers_cpu()["postgresql"] - server) * 1e6 / len(sent), 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flows", type=int, default=2000, help="flows recorded and replayed (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every variant, alternating (default 3)")
    p.add_argument("--postgres-admin-url", default=None, help="where to create the run's databases")
    args = p.parse_args(argv)
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with two_databases(args.postgres_admin_url) as (recorded_url, url, versions):
        rows, sent, end, statements = transitions(recorded_url, args.flows)
        upgrade(url)
        with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
            conn.execute("CREATE TABLE chain_rows (id integer PRIMARY KEY, step integer NOT NULL, updated_at double precision)")
            conn.execute("INSERT INTO chain_rows SELECT g, 0, 0 FROM generate_series(0, %s) g", (len(sent) // 4,))
            conn.execute("ANALYZE chain_rows")
            for table in ("af_tasks", "af_attempts", "chain_rows"):
                conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
            for _ in range(args.rounds):
                for variant in VARIANTS:
                    reset(conn, rows)
                    time.sleep(0.5)  # the VACUUM's own work out of the way
                    results[variant].append(replay(conn, sent, statements, variant))
                    if variant == "whole" and state(conn) != end:
                        raise SystemExit(f"the replay did not store what the run did ({state(conn)} != {end})")
    median = {v: statistics.median(r) for v, r in results.items()}
    for variant, figure in median.items():
        print(f"{variant:<18} PostgreSQL {figure:6.1f} µs CPU per transition (by round: {results[variant]})")
    result = {"flows": args.flows, "transitions": len(sent), "median_us": median, "rounds_us": results,
              "versions": versions, "machine": machine_info()}
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
