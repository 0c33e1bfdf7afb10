"""Schedules through real processes: the leading scheduler killed with SIGKILL, again and again.

On PostgreSQL three schedulers run; on the embedded default (SQLite) one, killed
and started again. Either way every scheduled second must have exactly one run
record, fired, with its task created and run to the end.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, select

from shared.states import TaskStatus
from shared.storage.schema import leases
from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import SUPPORT, Stack

pytestmark = pytest.mark.e2e
LEASE_TTL = 2.0
KILLS = 2


@pytest.fixture(params=["embedded", pytest.param("postgres-rabbitmq", marks=[pytest.mark.postgres, pytest.mark.rabbitmq])])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A short shutdown grace: the stack's SIGTERM reaches the worker's pool too, and a
    # step message it had just taken would otherwise hold the worker's exit for 30 s.
    env = {"ASYNCFLOW_SCHEDULER_LEASE_TTL": str(LEASE_TTL), "ASYNCFLOW_SHUTDOWN_GRACE": "3"}
    groups = [["alpha", "beta", "monitor"]]
    with open_stack(request.param, tmp_path_factory.mktemp("schedules"), env, groups) as s:
        yield s


def database_url(stack: Stack) -> str:
    return stack.env.get("ASYNCFLOW_DATABASE_URL") or f"sqlite:///{stack.home / 'asyncflow.sqlite'}"


def leader_pid(stack: Stack) -> int | None:
    engine = create_engine(database_url(stack))
    try:
        with engine.connect() as conn:
            row = conn.execute(select(leases.c.owner, leases.c.expires_at).where(leases.c.name == "scheduler")).first()
    finally:
        engine.dispose()
    if row is None or row.expires_at < time.time():
        return None
    return int(row.owner.split(":")[1])


def runs(stack: Stack, schedule_id: str) -> list[dict[str, Any]]:
    response = stack.http.get(f"{stack.url}/api/schedules/{schedule_id}/runs", params={"limit": 1000}, timeout=10)
    assert response.status_code == 200, response.text
    return list(response.json()["runs"])


def test_schedules_fire_exactly_once_across_scheduler_kills(stack: Stack) -> None:
    extra = ["scheduler2", "scheduler3"] if stack.name != "embedded" else []
    for key in extra:
        stack.spawn(key, "scheduler")
    body = {"schedule_id": "each-second", "flow": "noop", "every": 1, "overlap": "allow_all"}
    created = stack.http.post(f"{stack.url}/api/schedules", json=body, timeout=10)
    assert created.status_code == 201, created.text
    assert len(created.json()["next_fire_times"]) == 5

    kills = 0
    for _ in range(KILLS):
        seen = len(runs(stack, "each-second"))
        wait_for(lambda: len(runs(stack, "each-second")) >= seen + 3, 20, "three more firings")
        pid = wait_for(lambda: leader_pid(stack), 10, "a scheduler to lead")
        [key] = [k for k, p in stack.procs.items() if p.pid == pid]
        stack.kill(key, signal.SIGKILL)
        kills += 1
        stack.respawn(key)
    seen = len(runs(stack, "each-second"))
    wait_for(lambda: len(runs(stack, "each-second")) >= seen + LEASE_TTL + 3, 20, "firings after the last kill")
    stack.http.post(f"{stack.url}/api/schedules/each-second/pause", json={"note": "test over"}, timeout=10)

    records = runs(stack, "each-second")
    times = sorted(r["scheduled_at"] for r in records)
    assert len(times) == len(set(times)), "one firing recorded twice"
    assert {r["state"] for r in records} == {"fired"}, [r for r in records if r["state"] != "fired"]
    expected = list(range(int(times[0]), int(times[-1]) + 1))
    assert [int(t) for t in times] == expected, "a scheduled second has no run"
    assert len(times) >= KILLS * 3 + LEASE_TTL
    # Fired late only around a kill: the longest lateness stays within the lease time and a second.
    lateness = [r["fired_at"] - r["scheduled_at"] for r in records]
    assert max(lateness) <= LEASE_TTL + 1.5, sorted(lateness)[-5:]
    assert kills == KILLS

    task_ids = [r["task_id"] for r in records]
    assert len(set(task_ids)) == len(task_ids)

    def all_done() -> bool:
        return all(stack.get(t)["task_status"] == TaskStatus.SUCCESS for t in task_ids)

    wait_for(all_done, 60, "every task a schedule created to succeed")
    one = stack.get(records[0]["task_id"])
    assert one["schedule_id"] == "each-second" and one["scheduled_at"] == records[0]["scheduled_at"]


def test_asyncflow_up_fires_flows_yaml_and_cli_schedules(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The embedded default as a new user runs it: `asyncflow up`, a schedule in flows.yaml, one from the CLI."""
    home = tmp_path_factory.mktemp("up-schedules")
    flows = home / "flows.yaml"
    flows.write_text(
        (SUPPORT / "flows.yaml").read_text()
        + "\nschedules:\n  from-yaml:\n    flow: noop\n    every: 1\n    overlap: allow_all\n"
    )
    env = {"ASYNCFLOW_FLOWS": str(flows), "ASYNCFLOW_SHUTDOWN_GRACE": "3"}
    with open_stack("embedded", home, env, groups=None) as stack:
        added = stack.run_cli("schedule", "add", "--flow", "noop", "--every", "1s", "--overlap", "allow_all",
                              "--id", "from-cli")
        assert added.returncode == 0, added.stderr
        for schedule_id in ("from-yaml", "from-cli"):
            wait_for(lambda sid=schedule_id: len(runs(stack, sid)) >= 3, 30, f"{schedule_id} to fire three times")
        listed = stack.run_cli("schedule", "list")
        assert listed.returncode == 0 and "from-yaml" in listed.stdout and "from-cli" in listed.stdout
        shown = stack.run_cli("schedule", "runs", "from-cli")
        assert shown.returncode == 0 and "sch.from-cli." in shown.stdout
        first = runs(stack, "from-yaml")[-1]
        wait_for(lambda: stack.get(first["task_id"])["task_status"] == TaskStatus.SUCCESS, 30, "its task to succeed")
