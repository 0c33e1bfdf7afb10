"""A worker killed during a ten-minute step: its heartbeats stop, and the attempt
is failed and run again within three heartbeat intervals, not at the end of its
timeout. Real processes; the worker and its pool get SIGKILL."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import Stack

pytestmark = pytest.mark.e2e

INTERVAL = 1.0
WORKER = "worker-alpha"


# The embedded default is covered through `up` in test_up_supervision.py.
@pytest.fixture(scope="module", params=["postgres-rabbitmq"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"ASYNCFLOW_HEARTBEAT_INTERVAL": str(INTERVAL)}
    with open_stack(request.param, tmp_path_factory.mktemp("heartbeats"), env, [["alpha"]]) as s:
        yield s


def running_attempt(stack: Stack, task_id: str) -> dict | None:
    attempts = stack.get(task_id)["attempts"]
    return attempts[-1] if attempts and attempts[-1]["outcome"] is None else None


def test_a_killed_worker_is_noticed_by_its_heartbeats_not_its_timeout(stack: Stack, tmp_path: Path) -> None:
    gate = tmp_path / "go"
    task_id = stack.submit("long", {"wait_for_file": {"0": str(gate)}})["task_id"]

    def beating() -> dict | None:
        attempt = running_attempt(stack, task_id)
        return attempt if attempt and attempt["heartbeat_at"] else None

    first = wait_for(beating, 30, "the running attempt's first heartbeat")
    assert first["progress"] == {"waiting_for": str(gate)}  # what the handler reported
    assert first["worker"]

    stack.kill(WORKER)  # the worker and its pool, mid-step (timeout 600 s)
    killed_at = time.time()
    stack.respawn(WORKER)
    gate.touch()
    doc = stack.wait_stopped(task_id, timeout=60)

    assert doc["task_status"] == 0, doc
    lost, rerun = doc["attempts"]
    assert (lost["outcome"], rerun["outcome"]) == ("expired", "succeeded"), doc["attempts"]
    assert lost["error"].startswith("worker lost: no heartbeat"), lost
    # The last heartbeat came at most one interval before the kill; three missed ones
    # fail the attempt (plus a sweep tick and a loaded machine's slack).
    assert lost["ended_at"] - killed_at < 3 * INTERVAL + 2.0, (lost, killed_at)


def test_a_quick_step_sends_no_heartbeat(stack: Stack) -> None:
    task_id = stack.submit("long", {})["task_id"]
    doc = stack.wait_stopped(task_id, timeout=30)
    assert doc["task_status"] == 0, doc
    assert [a["heartbeat_at"] for a in doc["attempts"]] == [None]
