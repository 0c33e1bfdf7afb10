"""A batch's first steps wait in the database while their module's queue is full.

Real processes: the API and the scheduler, no worker at first, so nothing leaves
the queue; with ``ASYNCFLOW_RELEASE_AHEAD=5`` the scheduler publishes five first
steps of a batch of thirty and keeps the rest waiting, then publishes them as a
worker empties the queue.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import Stack

pytestmark = pytest.mark.e2e

AHEAD = 5


@pytest.fixture(scope="module", params=["embedded", "postgres-rabbitmq"])
def paced(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"ASYNCFLOW_RELEASE_AHEAD": str(AHEAD)}
    with open_stack(request.param, tmp_path_factory.mktemp("paced-" + request.param), env, []) as stack:
        yield stack


def phases(stack: Stack, task_ids: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for task_id in task_ids:
        phase = (stack.get(task_id)["current"] or {}).get("phase", "none")
        counts[phase] = counts.get(phase, 0) + 1
    return counts


def test_a_batch_is_published_as_far_as_its_queue_has_room(paced: Stack) -> None:
    body = {"tasks": [{"flow": "short", "parameters": {}} for _ in range(30)]}
    answer = paced.http.post(paced.url + "/api/batches", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    ids = [t["task_id"] for t in answer.json()["tasks"]]
    wait_for(lambda: phases(paced, ids).get("queued") == AHEAD, 30, f"{AHEAD} first steps to be published")
    time.sleep(1.0)  # five sweeps more: the queue stays full, the rest wait
    assert phases(paced, ids) == {"queued": AHEAD, "waiting": 30 - AHEAD}
    paced.spawn("worker", "worker", "alpha", "beta", "-c", "1")
    for task_id in ids:
        assert paced.wait_stopped(task_id, timeout=120)["task_status"] == 0
