"""The dashboard on a big table: server time of /ui pages over 1,000,000 stored tasks (PostgreSQL).

Creates a database of its own (``af_bench_ui_<random>``, dropped at the end),
migrates it, bulk-loads --tasks tasks with COPY (three flows, a thousand users,
every status, parameters with an order id; the newest 2,000 tasks get attempts),
runs VACUUM ANALYZE, then serves the real app in-process and times each page
--repeat times: the request through the ASGI app, routing, the store's queries
and the Jinja2 rendering; no network and no browser. Prints the figures and the
machine.

    python benchmarks/ui.py [--tasks 1000000] [--repeat 15] [--admin-url postgresql://postgres@127.0.0.1/postgres]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import REPO, SUPPORT, machine_info  # noqa: E402

sys.path.insert(0, str(REPO))
import psycopg  # noqa: E402

from oss_api.testing import open_client  # noqa: E402
from shared.config import Settings  # noqa: E402
from shared.flows import load_flows  # noqa: E402
from shared.migrate import upgrade  # noqa: E402
from shared.runtime import Runtime  # noqa: E402
from shared.states import StepState, StepType, TaskStatus  # noqa: E402
from shared.storage.codec import step_to_json  # noqa: E402
from shared.task import new_task  # noqa: E402

FLOWS = ("three", "noop", "short")
# Roughly what a busy system holds: mostly done, a few failing, a handful stuck.
STATUS_WEIGHTS = {
    TaskStatus.SUCCESS: 90.0,
    TaskStatus.FAILED: 5.0,
    TaskStatus.CANCELLED: 2.0,
    TaskStatus.RUNNING: 1.5,
    TaskStatus.PENDING: 1.0,
    TaskStatus.ROLLING_BACK: 0.45,
    TaskStatus.ROLLBACK_FAILED: 0.05,
}
TASK_COLUMNS = (
    "task_id", "flow", "status", "cursor", "message", "priority", "user_id", "parameters", "steps",
    "created_at", "started_at", "ended_at", "updated_at", "cancel_requested", "seq", "version",
)
ATTEMPT_COLUMNS = ("task_id", "seq", "cursor", "type", "attempt", "module", "command", "started_at",
                   "ended_at", "outcome", "error", "worker", "result")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--admin-url", default=None, help="a PostgreSQL URL allowed to CREATE DATABASE")
    return p.parse_args(argv)


def admin_connection(url: str | None) -> tuple[psycopg.Connection[Any], str]:
    candidates = [url] if url else ["postgresql://postgres@127.0.0.1:5432/postgres",
                                    "postgresql://root@127.0.0.1:5432/postgres"]
    problems = []
    for candidate in candidates:
        try:
            return psycopg.connect(candidate, autocommit=True, connect_timeout=5), candidate
        except psycopg.Error as exc:
            problems.append(f"{candidate}: {exc}")
    raise SystemExit("cannot connect to PostgreSQL as an admin: " + "; ".join(problems))


def steps_json(flow_steps: int, status: TaskStatus, task: Any) -> str:
    """The steps column of a task of ``status`` (states roughly as that status implies)."""
    steps = []
    for i, step in enumerate(task.steps):
        done = status is TaskStatus.SUCCESS or i < flow_steps - 1
        state = StepState.SUCCEEDED if done else StepState.FAILED
        rollback_state = StepState.SUCCEEDED if status in (TaskStatus.FAILED, TaskStatus.CANCELLED) else StepState.PENDING
        steps.append(step_to_json(step.__class__(**{**step.__dict__, "state": state, "rollback_state": rollback_state})))
    return json.dumps(steps)


def task_rows(n: int, now: float, seed: int = 7) -> Iterator[tuple[Any, ...]]:
    rng = random.Random(seed)
    flows = load_flows(SUPPORT / "flows.yaml")
    statuses = list(STATUS_WEIGHTS)
    weights = list(STATUS_WEIGHTS.values())
    templates = {}
    for name in FLOWS:
        flow = flows.get(name)
        assert flow is not None
        sample = new_task("x", flow, {}, now)
        for status in statuses:
            templates[(name, status)] = (steps_json(len(flow.steps), status, sample), len(flow.steps))
    start = now - n * 0.25  # one task every 250 ms, the newest now
    for i in range(n):
        flow = FLOWS[i % len(FLOWS)]
        status = rng.choices(statuses, weights)[0]
        steps, count = templates[(flow, status)]
        created = start + i * 0.25
        ended = created + 2.0 if status in (TaskStatus.SUCCESS, TaskStatus.FAILED, TaskStatus.CANCELLED) else None
        message = "step 2 (beta.step) failed: RuntimeError: card declined" if status is TaskStatus.FAILED else None
        parameters = json.dumps({"order": {"id": i}, "customer": f"c{i % 50_000}", "amount": i % 997})
        yield (
            f"{uuid.UUID(int=rng.getrandbits(128)).hex}", flow, int(status),
            count - 1 if status is not TaskStatus.PENDING else 0, message, 0, f"user{i % 1000}",
            parameters, steps, created, created + 0.01, ended, ended or created, False, count, 1,
        )


def attempt_rows(task_id: str, created: float, flow_steps: int) -> Iterator[tuple[Any, ...]]:
    at = created + 0.02
    for cursor in range(flow_steps):
        result = json.dumps({f"done_{cursor}": f"{task_id}:{cursor}"})
        yield (task_id, cursor + 1, cursor, int(StepType.NORMAL), 1, "alpha", "step", at, at + 0.05,
               "succeeded", None, "bench-worker", result)
        at += 0.1


def load(conn: psycopg.Connection[Any], n: int, now: float) -> tuple[str, float]:
    newest: list[tuple[str, float, int]] = []
    with conn.cursor() as cur:
        with cur.copy(f"COPY af_tasks ({', '.join(TASK_COLUMNS)}) FROM STDIN") as copy:
            for row in task_rows(n, now):
                copy.write_row(row)
                if row[9] >= now - 2000 * 0.25:
                    newest.append((row[0], row[9], row[14]))
        with cur.copy(f"COPY af_attempts ({', '.join(ATTEMPT_COLUMNS)}) FROM STDIN") as copy:
            for task_id, created, steps in newest:
                for attempt in attempt_rows(task_id, created, steps):
                    copy.write_row(attempt)
    conn.execute("VACUUM ANALYZE af_tasks")
    conn.execute("VACUUM ANALYZE af_attempts")
    return newest[-1][0], newest[-1][1]


def timed(client: Any, path: str, repeat: int) -> dict[str, float]:
    client.get(path)  # warm: connections, templates, plans
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        response = client.get(path)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])
    times.sort()
    return {"median_ms": round(statistics.median(times), 1), "p90_ms": round(times[int(0.9 * (len(times) - 1))], 1),
            "max_ms": round(times[-1], 1), "bytes": len(response.content)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    admin, admin_url = admin_connection(args.admin_url)
    name = f"af_bench_ui_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    info = psycopg.conninfo.conninfo_to_dict(admin_url)
    user, host, port = info.get("user", "postgres"), info.get("host", "127.0.0.1"), info.get("port", "5432")
    url = f"postgresql+psycopg://{user}@{host}:{port}/{name}"
    try:
        upgrade(url)
        now = time.time()
        started = time.perf_counter()
        with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
            page_task, _ = load(conn, args.tasks, now)
            size = conn.execute("SELECT pg_size_pretty(pg_total_relation_size('af_tasks'))").fetchone()
            version = conn.execute("SHOW server_version").fetchone()
        loaded = time.perf_counter() - started
        with tempfile.TemporaryDirectory() as home:
            settings = Settings(home=Path(home), database_url=url, flows=SUPPORT / "flows.yaml")
            runtime = Runtime(settings)
            pages = {
                "/ui?limit=1000 (1,000 newest)": "/ui?limit=1000",
                "/ui (50 newest)": "/ui",
                "/ui?status=failed&limit=1000": "/ui?status=failed&limit=1000",
                "/ui?flow=three&user=user7 (two filters)": "/ui?flow=three&user=user7",
                "/ui?param=order.id=999990 (bounded scan)": f"/ui?param=order.id%3D{args.tasks - 10}",
                "/ui/tasks/{id} (task page)": f"/ui/tasks/{page_task}",
                "/ui/alarms": "/ui/alarms",
                "/ui/flows?window=1h": "/ui/flows?window=1h",
            }
            results = {}
            with open_client(runtime) as client:
                for label, path in pages.items():
                    results[label] = timed(client, path, args.repeat)
            runtime.close()
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
    print(json.dumps({
        "tasks": args.tasks,
        "table_size": size[0] if size else None,
        "postgresql": version[0] if version else None,
        "load_seconds": round(loaded, 1),
        "repeat": args.repeat,
        "pages": results,
        "machine": machine_info(),
    }, indent=2))


if __name__ == "__main__":
    main()
