"""Schedules: firing lateness under load, and exactly-once across leader kills.

Runs real `asyncflow scheduler` processes on a fresh PostgreSQL database (or the
embedded SQLite default). The schedules create v1 tasks of a registered type, so
no worker is involved: what is measured is the scheduler and the database.

  lateness   --stored schedules in the table, of which enough fire every minute
             to make --per-minute firings a minute (each every 60 s, spread over
             the minute); the rest are yearly crons that do not fire. Reports the
             lateness (fired_at - scheduled_at) of every firing after a warm-up,
             and the leader's RSS and CPU.
  failover   --schedules schedules firing every second, --schedulers processes;
             the leader is killed with SIGKILL every --kill-every seconds and
             started again. Reports double firings (by task and by run), missed
             seconds, and the longest lateness, which bounds the failover gap.

    python benchmarks/schedules.py lateness [--backend postgres|embedded] [--stored 100000] [--per-minute 10000]
                                            [--seconds 120]
    python benchmarks/schedules.py failover [--backend postgres|embedded] [--schedules 1000] [--schedulers 3]
                                            [--seconds 120] [--kill-every 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import pct  # noqa: E402
from stack import REPO, SUPPORT, Backend, Processes, SetupError, log, machine_info, setup_postgres  # noqa: E402

sys.path.insert(0, str(REPO))
from sqlalchemy import func, select  # noqa: E402

from shared.migrate import upgrade  # noqa: E402
from shared.pull.rules import TaskType  # noqa: E402
from shared.schedules.definition import Definition  # noqa: E402
from shared.storage import open_store  # noqa: E402
from shared.storage.schema import leases, pull_tasks, schedule_runs  # noqa: E402
from shared.storage.sql_pull import SqlPullStore  # noqa: E402
from shared.storage.sql_schedules import SqlScheduleStore  # noqa: E402

TASK_TYPE = "bench_tick"
LEASE_TTL = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["lateness", "failover"])
    p.add_argument("--backend", choices=["postgres", "embedded"], default="postgres")
    p.add_argument("--stored", type=int, default=100_000, help="lateness: schedules in the table")
    p.add_argument("--per-minute", type=int, default=10_000, help="lateness: firings a minute")
    p.add_argument("--schedules", type=int, default=1_000, help="failover: schedules firing every second")
    p.add_argument("--schedulers", type=int, default=3, help="failover: scheduler processes")
    p.add_argument("--kill-every", type=float, default=10.0, help="failover: seconds between leader kills")
    p.add_argument("--seconds", type=float, default=120.0, help="how long to fire")
    p.add_argument("--warm-up", type=float, default=15.0, help="lateness: seconds left out at the start")
    p.add_argument("--postgres-admin-url", default=None)
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, SQLite files)")
    return p.parse_args(argv)


def definitions(args: argparse.Namespace, now: float) -> list[Definition]:
    if args.mode == "failover":
        return [
            Definition(schedule_id=f"tick{i}", task_type=TASK_TYPE, every=1, overlap="allow_all")
            for i in range(args.schedules)
        ]
    active = args.per_minute  # each fires once a minute
    base = int(now) - int(now) % 60
    found = [
        Definition(
            schedule_id=f"minute{i}",
            task_type=TASK_TYPE,
            every=60,
            start_at=base + (i * 60.0 / active),
            overlap="allow_all",
        )
        for i in range(active)
    ]
    found += [
        Definition(schedule_id=f"yearly{i}", task_type=TASK_TYPE, cron=f"{i % 60} 3 1 1 *", overlap="allow_all")
        for i in range(max(0, args.stored - active))
    ]
    return found


def prepare(url: str, args: argparse.Namespace) -> None:
    upgrade(url)
    store = open_store(url)
    try:
        SqlPullStore(store).save_type(TaskType(task_type=TASK_TYPE, max_processing_time=3600), time.time())
        now = time.time()
        made = [d.schedule(str(d.schedule_id), now) for d in definitions(args, now)]
        t0 = time.monotonic()
        SqlScheduleStore(store).add_many(made)
        log(f"stored {len(made)} schedules in {time.monotonic() - t0:.1f}s")
    finally:
        store.close()


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def leader_pid(url: str) -> int | None:
    store = open_store(url)
    try:
        with store.transaction(read_only=True) as conn:
            row = conn.execute(select(leases.c.owner, leases.c.expires_at).where(leases.c.name == "scheduler")).first()
    finally:
        store.close()
    if row is None or row.expires_at < time.time():
        return None
    return int(row.owner.split(":")[1])


def run_rows(url: str, since: float, until: float) -> list[Any]:
    store = open_store(url)
    try:
        with store.transaction(read_only=True) as conn:
            return list(
                conn.execute(
                    select(schedule_runs).where(
                        schedule_runs.c.scheduled_at >= since, schedule_runs.c.scheduled_at <= until
                    )
                )
            )
    finally:
        store.close()


def lateness_ms(rows: list[Any]) -> dict[str, Any]:
    late = [(r.fired_at - r.scheduled_at) * 1000 for r in rows if r.fired_at is not None]
    return {
        "firings": len(late),
        "p50_ms": pct(late, 50),
        "p90_ms": pct(late, 90),
        "p99_ms": pct(late, 99),
        "max_ms": max(late) if late else None,
    }


def longest_pause(moments: list[float]) -> float | None:
    ordered = sorted(set(moments))
    return max((b - a for a, b in zip(ordered, ordered[1:], strict=False)), default=None)


def start_scheduler(procs: Processes, key: str) -> None:
    procs.launch(key, [sys.executable, "-m", "asyncflow", "scheduler"])


def lateness(args: argparse.Namespace, url: str, procs: Processes) -> dict[str, Any]:
    start_scheduler(procs, "scheduler")
    pid = procs.procs["scheduler"].pid
    t0 = time.time()
    samples: list[tuple[float, float | None, float]] = []
    while time.time() - t0 < args.seconds:
        time.sleep(5)
        procs.check_alive()
        samples.append((time.time() - t0, rss_mib(pid), procs.cpu()["scheduler"]))
    end = time.time()
    rows = [r for r in run_rows(url, t0 + args.warm_up, end - 2) if r.state == "fired"]
    measured = end - 2 - (t0 + args.warm_up)
    cpu_first, cpu_last = samples[0][2], samples[-1][2]
    rss = [s[1] for s in samples if s[1] is not None]
    return {
        **lateness_ms(rows),
        "firings_per_minute": len(rows) / measured * 60,
        "leader_rss_mib": {"first": rss[0] if rss else None, "last": rss[-1] if rss else None, "max": max(rss, default=None)},
        "leader_cpu_percent": 100 * (cpu_last - cpu_first) / (samples[-1][0] - samples[0][0]),
        "leader_cpu_ms_per_firing": 1000 * (cpu_last - cpu_first) / max(1, len(rows) * (samples[-1][0] - samples[0][0]) / measured),
    }


def failover(args: argparse.Namespace, url: str, procs: Processes) -> dict[str, Any]:
    for i in range(args.schedulers):
        start_scheduler(procs, f"scheduler{i}")
    t0 = time.time()
    kills = []
    next_kill = t0 + args.kill_every
    while time.time() - t0 < args.seconds:
        time.sleep(max(0.0, min(next_kill, t0 + args.seconds) - time.time()))
        if time.time() < next_kill:
            break
        pid = leader_pid(url)
        keys = [k for k, p in procs.procs.items() if p.pid == pid]
        if keys:
            os.killpg(pid, signal.SIGKILL)
            procs.procs[keys[0]].wait()
            kills.append(round(time.time() - t0, 1))
            start_scheduler(procs, keys[0])
        next_kill += args.kill_every
    # Let the last leader catch up, then count every second of the whole run.
    time.sleep(LEASE_TTL + 3)
    first, last = int(t0) + 2, int(t0 + args.seconds)
    rows = run_rows(url, first, last)
    store = open_store(url)
    try:
        with store.transaction(read_only=True) as conn:
            tasks = conn.execute(
                select(func.count(), func.count(func.distinct(pull_tasks.c.task_id))).where(
                    pull_tasks.c.task_type == TASK_TYPE
                )
            ).one()
    finally:
        store.close()
    seen: dict[tuple[str, float], int] = {}
    for r in rows:
        seen[(r.schedule_id, r.scheduled_at)] = seen.get((r.schedule_id, r.scheduled_at), 0) + 1
    expected = args.schedules * (last - first + 1)
    fired = [r for r in rows if r.state == "fired"]
    return {
        "kills_at_s": kills,
        "expected_firings": expected,
        "runs": len(rows),
        "fired": len(fired),
        "double_runs": sum(n - 1 for n in seen.values() if n > 1),
        "missed": expected - len(seen),
        "not_fired": len(rows) - len(fired),
        "tasks": tasks[0],
        "double_tasks": tasks[0] - tasks[1],
        "lateness": lateness_ms(fired),
        # The longest stretch without any firing: what a failover costs.
        "longest_pause_s": longest_pause([r.fired_at for r in fired]),
        "lease_ttl_s": LEASE_TTL,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="af-bench-schedules-"))
    backend = Backend(args.backend)
    procs: Processes | None = None
    try:
        if args.backend == "postgres":
            setup_postgres(backend, args.postgres_admin_url)
            url = backend.env["ASYNCFLOW_DATABASE_URL"]
        else:
            url = f"sqlite:///{home / 'asyncflow.sqlite'}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCFLOW_")}
        env.update(
            ASYNCFLOW_HOME=str(home),
            ASYNCFLOW_DATABASE_URL=url,
            ASYNCFLOW_FLOWS=str(SUPPORT / "flows.yaml"),
            ASYNCFLOW_MIGRATE_ON_START="false",
            ASYNCFLOW_SCHEDULER_LEASE_TTL=str(LEASE_TTL),
            ASYNCFLOW_LOG_LEVEL="WARNING",
            PYTHONPATH=os.pathsep.join([str(SUPPORT), str(REPO)]),
        )
        prepare(url, args)
        procs = Processes(home, env)
        result = lateness(args, url, procs) if args.mode == "lateness" else failover(args, url, procs)
        report = {"bench": f"schedules-{args.mode}", "machine": machine_info(), "backend": args.backend,
                  "options": {k: v for k, v in vars(args).items() if k not in ("postgres_admin_url", "keep")},
                  **result}
        print(json.dumps(report, indent=1))
        print("RESULT " + json.dumps(report))
        return 0
    except SetupError as exc:
        log(f"setup failed: {exc}")
        return 2
    finally:
        if procs is not None:
            procs.stop()
        backend.cleanup()
        if args.keep:
            log(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
