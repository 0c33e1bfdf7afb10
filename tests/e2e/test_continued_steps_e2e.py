"""A worker that runs a flow's next step itself (no publish, no delivery) and is killed
there: the step must be recovered from what the database holds, as a published one is.

One worker serves both modules of the ``short`` flow, so step 1 runs in the delivery of
step 0. Its handler does the work and then SIGKILLs the worker and itself, before the
outcome is stored. The start of step 1 was stored with step 0's outcome (in every mode:
the task shows a step run on to as running), so the attempt misses its heartbeats,
expires, and runs again as attempt 2.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import Stack, tries

pytestmark = [pytest.mark.e2e]

WORKER = "worker-alpha+beta"
TIMING = {
    "ASYNCFLOW_REQUEUE_AFTER": "2",
    "ASYNCFLOW_EXPIRE_GRACE": "2",
    "ASYNCFLOW_HEARTBEAT_INTERVAL": "1",
}


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("continued")
    with open_stack("postgres-rabbitmq", home, TIMING, [["alpha", "beta"]]) as stack:
        yield stack


def test_a_quick_flow_runs_in_one_delivery(one_worker: Stack) -> None:
    task = one_worker.submit("noop", {})
    doc = one_worker.wait_stopped(task["task_id"])
    assert doc["task_status"] == 0, doc
    pids = {e["pid"] for e in one_worker.executions(task["task_id"])}
    assert len(pids) == 1, "steps 1 and 2 ran in the process that ran step 0"


def test_worker_killed_in_a_step_it_continued_to_is_recovered(one_worker: Stack, tmp_path: Path) -> None:
    marker = tmp_path / f"killed-{time.time_ns()}"
    task = one_worker.submit("short", {"kill_worker_after": {"1": str(marker)}})
    wait_for(lambda: marker.exists() and one_worker.procs[WORKER].poll() is not None, 30, "the worker to die")
    first = one_worker.executions(task["task_id"])
    assert [(e["cursor"], e["attempt"]) for e in first] == [(0, 1), (1, 1)]
    assert first[0]["pid"] == first[1]["pid"], "step 1 ran in the delivery of step 0"

    one_worker.respawn(WORKER)
    doc = one_worker.wait_stopped(task["task_id"], timeout=60)
    assert doc["task_status"] == 0, doc
    runs = [(e["cursor"], e["attempt"]) for e in one_worker.executions(task["task_id"])]
    attempts = tries(doc)
    assert runs == [(0, 1), (1, 1), (1, 2)]
    assert attempts == [(0, 1, "succeeded"), (1, 1, "expired"), (1, 2, "succeeded")]
