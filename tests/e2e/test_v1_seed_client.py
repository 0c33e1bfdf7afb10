"""Workers written from seed 000 alone drive multi-stage tasks through a real API and scheduler.

Four processes of ``tests/support/seed_worker.py`` (standard library only) work
the seed 003 video flow concurrently: stages, a poll that looks again, failures
retried by the server, a retry counted by the worker, a task that fails for
good, and a worker that vanishes holding a lease, which the scheduler's sweep
takes back. Then every lease is checked against what the interface promises.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import open_stack
from tests.e2e.stack import REPO, Stack

pytestmark = pytest.mark.e2e

WORKER = REPO / "tests" / "support" / "seed_worker.py"
TASK_TYPE = "video"
WORKERS = 4
MAX_RETRY_NUM = 2
RETRY_SECONDS = 1  # uniform: max_retry_interval = -1
LEASE_SECONDS = 2
PLANS = ["ok", "ok", "ok", "fail_once", "ok", "count_retry", "ok", "always_fail", "ok", "ok"]
TASKS = 100
VANISHING = 3  # the first tasks whose plan is replaced by "vanish"
STAGES = {
    "ok": ["moderate", "poll", "poll", "transcode"],
    "vanish": ["moderate", "poll", "poll", "transcode", "transcode"],
    "fail_once": ["moderate", "poll", "poll", "transcode", "transcode"],
    "count_retry": ["moderate", "poll", "poll", "transcode", "transcode"],
    "always_fail": ["moderate"] * (MAX_RETRY_NUM + 1),
}


@pytest.fixture(scope="module", params=["embedded", "postgres-rabbitmq"])
def v1_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with open_stack(request.param, tmp_path_factory.mktemp("v1-seed-" + request.param), groups=[["alpha"]]) as s:
        yield s


def v1(stack: Stack, path: str, body: dict[str, Any] | None = None, **query: Any) -> dict[str, Any]:
    if body is None:
        response = stack.http.get(f"{stack.url}/v1/{path}", params=query, timeout=10)
    else:
        response = stack.http.post(f"{stack.url}/v1/{path}", json=body, timeout=10)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["code"] == 0 and answer["msg"] == "SUCCESS", answer
    return answer


def plan_of(n: int) -> str:
    return "vanish" if n < VANISHING else PLANS[n % len(PLANS)]


def test_seed_workers_through_stages_retries_failures_and_a_lost_lease(v1_stack: Stack, tmp_path: Path) -> None:
    v1(v1_stack, "register_task_type", {"task_type_data": {
        "task_type": TASK_TYPE, "schedule_limit": 5, "schedule_interval": 1, "max_processing_time": LEASE_SECONDS,
        "max_retry_num": MAX_RETRY_NUM, "max_retry_interval": -RETRY_SECONDS,
    }})
    plans = {}
    for n in range(TASKS):
        content = json.dumps({"n": n, "plan": plan_of(n)})
        answer = v1(v1_stack, "create_task", {"task_data": {
            "task_id": "", "task_type": TASK_TYPE, "task_content": content, "task_priority": 0,
            "user_id": "uploader", "task_stage": "moderate",
        }})
        plans[answer["task_id"]] = plan_of(n)

    outputs = [tmp_path / f"worker-{i}.jsonl" for i in range(WORKERS)]
    started = time.monotonic()
    workers = [
        subprocess.Popen([sys.executable, str(WORKER), v1_stack.url, TASK_TYPE, str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for out in outputs
    ]
    try:
        logs = [w.communicate(timeout=180)[0] for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    print(f"\n[{v1_stack.name}] {WORKERS} seed workers finished {TASKS} tasks in {time.monotonic() - started:.1f}s")
    assert [w.returncode for w in workers] == [0] * WORKERS, logs
    leases = [json.loads(line) for out in outputs for line in out.read_text().splitlines()]

    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for lease in sorted(leases, key=lambda r: r["held_at"]):
        by_task[lease["task_id"]].append(lease)
    assert set(by_task) == set(plans)
    assert all(lease["status"] == 2 for lease in leases)
    refused = [lease for lease in leases if "answer" in lease and lease["answer"]["code"] != 0]
    assert not refused, refused[:3]
    assert len({lease["pid"] for lease in leases}) >= 2, "the work was not shared"

    for task_id, held in by_task.items():
        plan = plans[task_id]
        assert [lease["stage"] for lease in held] == STAGES[plan], (plan, held)
        for before, after in zip(held, held[1:], strict=False):
            if "set_at" not in before:
                # Nobody reported: the task came back only once its lease was over.
                assert after["held_at"] >= before["held_at"] + LEASE_SECONDS, (plan, before, after)
                assert after["crt_retry_num"] == before["crt_retry_num"] + 1
                continue
            # Never two holders at once: the next lease follows the report of the last.
            assert before["set_at"] < after["held_at"], (plan, before, after)
            counted = plan == "count_retry" and before["stage"] == "transcode" and before["crt_retry_num"] == 0
            if before["reported"] == 4 or counted:
                # A failed attempt waits out its retry interval.
                assert after["held_at"] >= before["set_at"] + RETRY_SECONDS, (plan, before, after)
                assert after["crt_retry_num"] == before["crt_retry_num"] + 1

        data = v1(v1_stack, "get_task", task_id=task_id)["task_data"]
        content = json.loads(data["task_content"])
        if plan == "always_fail":
            assert (data["status"], data["crt_retry_num"]) == (4, MAX_RETRY_NUM), data
            assert data["schedule_log"] == "moderation refused the upload"
        else:
            assert (data["status"], data["stage"], data["user_id"]) == (3, "transcode", "uploader"), data
            assert content["url"] == f"https://cdn.example/job-{content['n']}.mp4"
            assert content["polls"] == 1

    expected = Counter("4" if plan == "always_fail" else "3" for plan in plans.values())
    counts = v1(v1_stack, "get_task_counts_by_type", task_type=TASK_TYPE)
    assert counts["task_count"] == TASKS
    assert {k: v for k, v in counts["task_count_by_status"].items() if v} == dict(expected)
