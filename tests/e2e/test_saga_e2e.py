"""The saga through real processes: API, scheduler and workers as subprocesses.

Runs on every backend of the ``stack`` fixture. What really executed is read
from the test modules' journal, not only from the task document.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.config import Settings
from shared.processes import runs
from shared.runtime import Runtime
from shared.testing import wait_for
from tests.e2e.stack import Stack

pytestmark = pytest.mark.e2e

NORMAL, ROLLBACK = 0, 1


def ran(stack: Stack, task_id: str) -> list[tuple[int, int]]:
    """(cursor, type) of every execution, in order."""
    return [(e["cursor"], e["type"]) for e in stack.executions(task_id)]


def test_success_runs_every_step_once_and_merges_results(stack: Stack) -> None:
    task = stack.submit("three", {"Cpu": 4})
    assert task["task_status"] == 1 and task["task_cursor"] == 0
    doc = stack.wait_stopped(task["task_id"])
    assert doc["task_status"] == 0, doc
    assert ran(stack, task["task_id"]) == [(0, NORMAL), (1, NORMAL), (2, NORMAL)]
    assert doc["parameters"]["Cpu"] == 4
    assert {f"done_{i}" for i in range(3)} <= set(doc["parameters"])
    assert doc["time_start"] and doc["time_end"] >= doc["time_start"] >= doc["time_create"]
    assert [s["state"] for s in doc["steps"]] == ["succeeded"] * 3


def test_steps_run_in_processes_whose_start_up_objects_the_collector_skips(stack: Stack) -> None:
    """The worker settles its heap before it forks (shared.heap): a full collection in a
    consumer process walked every module, the Celery app and the flows again, about 80 ms."""
    task = stack.submit("three", {})
    stack.wait_stopped(task["task_id"])
    frozen = [e["frozen"] for e in stack.executions(task["task_id"])]
    assert len(frozen) == 3 and min(frozen) > 10_000, frozen


def test_a_batch_runs_each_flow_as_a_single_submit_would(stack: Stack) -> None:
    # Published together (on RabbitMQ, confirmed once): each flow still runs once, its own way.
    ids = [f"batch-{uuid.uuid4().hex[:8]}-{i}" for i in range(12)]
    fails = {ids[3], ids[7]}
    body = {"tasks": [{"flow": "three", "task_id": i, "parameters": {"fail_at": [1]} if i in fails else {}} for i in ids]}
    answer = stack.http.post(stack.url + "/api/batches", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert [(t["task_id"], t["created"]) for t in answer.json()["tasks"]] == [(i, True) for i in ids]
    for task_id in ids:
        doc = stack.wait_stopped(task_id)
        if task_id in fails:
            assert doc["task_status"] == 4, doc
            assert ran(stack, task_id) == [(0, NORMAL), (1, NORMAL), (1, NORMAL), (1, NORMAL), (1, ROLLBACK), (0, ROLLBACK)]
        else:
            assert doc["task_status"] == 0, doc
            assert ran(stack, task_id) == [(0, NORMAL), (1, NORMAL), (2, NORMAL)]


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_failure_at_each_step_compensates_it_and_earlier_steps_in_reverse(stack: Stack, fail_at: int) -> None:
    task = stack.submit("three", {"fail_at": [fail_at]})
    doc = stack.wait_stopped(task["task_id"])
    assert doc["task_status"] == 4, doc
    assert doc["task_cursor"] == fail_at
    assert f"step {fail_at}" in doc["task_message"]
    retries = [0, 2, 0][fail_at]
    expected = [(i, NORMAL) for i in range(fail_at)]
    expected += [(fail_at, NORMAL)] * (retries + 1)
    expected += [(i, ROLLBACK) for i in range(fail_at, -1, -1)]
    assert ran(stack, task["task_id"]) == expected
    failed = doc["steps"][fail_at]
    assert failed["state"] == "failed" and failed["code"] == 1 and failed["attempts"] == retries + 1
    assert all(s["rollback_state"] == "succeeded" for s in doc["steps"][: fail_at + 1])
    assert all(s["state"] == "pending" for s in doc["steps"][fail_at + 1 :])


def test_retry_after_backoff_then_success(stack: Stack) -> None:
    task = stack.submit("three", {"flaky": {"1": 2}})
    doc = stack.wait_stopped(task["task_id"])
    assert doc["task_status"] == 0, doc
    attempts = [a for a in doc["attempts"] if a["cursor"] == 1]
    assert [a["outcome"] for a in attempts] == ["failed", "failed", "succeeded"]
    assert [a["attempt"] for a in attempts] == [1, 2, 3]
    # Re-delivered after the step's retry_interval (0.2 s), not at once.
    for before, after in zip(attempts, attempts[1:], strict=False):
        assert after["started_at"] - before["ended_at"] >= 0.19


def test_hanging_handler_is_stopped_by_its_timeout(stack: Stack) -> None:
    task = stack.submit("three", {"hang_at": [2]})
    doc = stack.wait_stopped(task["task_id"], timeout=60)
    assert doc["task_status"] == 4, doc
    step = doc["steps"][2]
    assert step["code"] == 2 and "timed out" in step["message"]
    (attempt,) = [a for a in doc["attempts"] if a["cursor"] == 2 and a["type"] == NORMAL]
    assert attempt["outcome"] == "timed_out"
    assert 1.9 <= attempt["ended_at"] - attempt["started_at"] < 10
    assert ran(stack, task["task_id"])[-3:] == [(2, ROLLBACK), (1, ROLLBACK), (0, ROLLBACK)]


def test_handler_that_ignores_the_interrupt_is_killed(stack: Stack) -> None:
    task = stack.submit("three", {"hang_hard_at": [2]})
    doc = stack.wait_stopped(task["task_id"], timeout=60)
    assert doc["task_status"] == 4, doc
    (attempt,) = [a for a in doc["attempts"] if a["cursor"] == 2 and a["type"] == NORMAL]
    assert attempt["outcome"] == "timed_out" and "hard time limit" in attempt["error"]
    # The worker replaced its killed pool process and keeps working.
    assert stack.wait_stopped(stack.submit("three")["task_id"])["task_status"] == 0


def test_rollback_failure_stops_raises_alarm_and_resume_retries_it(stack: Stack) -> None:
    task = stack.submit("three", {"fail_at": [2], "fail_rollback_at": [1]})
    doc = stack.wait_stopped(task["task_id"])
    assert doc["task_status"] == 5, doc
    assert "rollback of step 1" in doc["task_message"]
    assert doc["steps"][1]["rollback_state"] == "failed"
    assert doc["steps"][0]["rollback_state"] == "pending"  # compensation stopped there
    # Rollback of step 1 has no retry: one attempt, then the alarm.
    assert ran(stack, task["task_id"])[-2:] == [(2, ROLLBACK), (1, ROLLBACK)]
    alarms = wait_for(lambda: _alarms(stack, task["task_id"]), 30, "the alarm to be recorded")
    assert len(alarms) == 1 and alarms[0]["payload"]["Command"] == "undo"

    resumed = stack.post(f"/api/tasks/{task['task_id']}/resume")
    assert resumed.status_code == 200 and resumed.json()["task_status"] == 3
    doc = stack.wait_stopped(task["task_id"])
    assert doc["task_status"] == 5  # still failing: a second alarm
    wait_for(lambda: len(_alarms(stack, task["task_id"])) == 2, 30, "a second alarm")


def _alarms(stack: Stack, task_id: str) -> list[dict]:
    from modules import monitor

    settings = Settings(home=stack.home, database_url=stack.env.get("ASYNCFLOW_DATABASE_URL"))
    monitor.module.start(settings)
    return [e for e in monitor.events(settings, task_id) if e["kind"] != "event"]


def test_cancel_while_a_step_polls_compensates_started_steps(stack: Stack) -> None:
    task = stack.submit("three", {"poll": {"1": 10_000}})
    task_id = task["task_id"]
    wait_for(lambda: stack.get(task_id)["parameters"].get("polled_1", 0) >= 2, 30, "step 1 to poll")
    response = stack.post(f"/api/tasks/{task_id}/cancel")
    assert response.status_code == 200, response.text
    doc = stack.wait_stopped(task_id)
    assert doc["task_status"] == 6, doc
    assert ran(stack, task_id)[-2:] == [(1, ROLLBACK), (0, ROLLBACK)]
    assert doc["steps"][2]["state"] == "pending"
    assert stack.post(f"/api/tasks/{task_id}/cancel").status_code == 409


def test_poll_later_does_not_use_retries(stack: Stack) -> None:
    task = stack.submit("three", {"poll": {"0": 3}})
    doc = stack.wait_stopped(task["task_id"])
    assert doc["task_status"] == 0, doc
    outcomes = [a["outcome"] for a in doc["attempts"] if a["cursor"] == 0]
    assert outcomes == ["poll_later"] * 3 + ["succeeded"]
    assert doc["parameters"]["polled_0"] == 3 and doc["steps"][0]["attempts"] == 1


def test_operator_retry_runs_the_failed_task_again(stack: Stack, tmp_path: Path) -> None:
    guard = tmp_path / "broken"
    guard.touch()
    task = stack.submit("three", {"fail_if_exists": {"2": str(guard)}})
    assert stack.wait_stopped(task["task_id"])["task_status"] == 4
    guard.unlink()
    response = stack.post(f"/api/tasks/{task['task_id']}/retry")
    assert response.status_code == 200 and response.json()["task_status"] == 2
    doc = stack.wait_stopped(task["task_id"])
    assert doc["task_status"] == 0, doc
    # Compensation had undone steps 0 and 1, so the retry redoes them first.
    assert ran(stack, task["task_id"])[-3:] == [(0, NORMAL), (1, NORMAL), (2, NORMAL)]


def test_idempotent_resubmit_returns_the_same_task_and_runs_it_once(stack: Stack) -> None:
    task_id = uuid.uuid4().hex
    first = stack.submit("three", {"n": 1}, task_id=task_id)
    second = stack.submit("three", {"n": 2}, task_id=task_id)
    assert second["task_id"] == task_id and second["parameters"]["n"] == 1
    assert stack.wait_stopped(task_id)["task_status"] == 0
    assert ran(stack, task_id) == [(0, NORMAL), (1, NORMAL), (2, NORMAL)]
    assert first["time_create"] == second["time_create"]


def test_concurrent_submits_are_each_answered_as_alone_and_each_new_flow_runs_once(stack: Stack) -> None:
    # Submits that arrive together are stored in one commit (oss_api.coalesce):
    # new ones, replays of one id, and one id claimed by two flows, all at once.
    tag = uuid.uuid4().hex[:8]
    bodies = [{"flow": "three", "task_id": f"new-{tag}-{i}", "parameters": {}} for i in range(16)]
    bodies += [{"flow": "three", "task_id": f"same-{tag}", "parameters": {}}] * 8
    bodies += [{"flow": flow, "task_id": f"clash-{tag}", "parameters": {}} for flow in ["three", "noop"] * 4]
    start = threading.Barrier(len(bodies))

    def post(body: dict[str, Any]) -> httpx.Response:
        start.wait(10)
        return stack.http.post(stack.url + "/api/tasks", json=body, timeout=30)

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(post, bodies))
    assert [a.status_code for a in answers[:16]] == [201] * 16, [a.text for a in answers[:16]]
    assert sorted(a.status_code for a in answers[16:24]) == [200] * 7 + [201]
    assert len({a.json()["time_create"] for a in answers[16:24]}) == 1  # one task, the others its replays
    clash = answers[24:]
    winner = next(a.json()["flow"] for a in clash if a.status_code == 201)
    assert sorted(a.status_code for a in clash) == [200] * 3 + [201] + [409] * 4
    assert all(a.json()["flow"] == winner for a in clash if a.status_code != 409)
    for body in bodies[:17] + bodies[24:25]:
        assert stack.wait_stopped(body["task_id"])["task_status"] == 0
        assert ran(stack, body["task_id"]) == [(0, NORMAL), (1, NORMAL), (2, NORMAL)]


def test_killed_pool_process_counts_as_a_failed_attempt(stack: Stack) -> None:
    task = stack.submit("three", {"hang_first": [1]})
    task_id = task["task_id"]
    entry = wait_for(
        lambda: next((e for e in stack.executions(task_id) if e["cursor"] == 1), None),
        30, "step 1 to start",
    )
    os.kill(entry["pid"], signal.SIGKILL)
    doc = stack.wait_stopped(task_id)
    assert doc["task_status"] == 0, doc
    attempts = [a for a in doc["attempts"] if a["cursor"] == 1]
    assert attempts[0]["outcome"] == "failed" and "lost" in attempts[0]["error"]
    assert attempts[-1]["outcome"] == "succeeded" and attempts[-1]["attempt"] == 2


def test_a_handler_no_signal_reaches_is_killed_by_the_main_process(stack: Stack) -> None:
    # Step 2 blocks the time limit's signal: its process can neither interrupt nor kill itself.
    task = stack.submit("three", {"hang_deaf_at": [2]})
    entry = wait_for(
        lambda: next((e for e in stack.executions(task["task_id"]) if e["cursor"] == 2), None), 30, "step 2 to start"
    )
    seen = time.monotonic()
    doc = stack.wait_stopped(task["task_id"], timeout=60)
    assert doc["task_status"] == 4, doc
    (attempt,) = [a for a in doc["attempts"] if a["cursor"] == 2 and a["type"] == NORMAL]
    # Failed by the kill (timed_out) or by the expiry sweep (expired), whichever came first.
    assert attempt["outcome"] in ("timed_out", "expired"), attempt
    # At its attempt's hard limit, the step's 2 s timeout and the grace (1 s), though on
    # embedded it ran on from step 1 in a delivery allowed 20 + 5 + 1 s.
    wait_for(lambda: not runs(entry["pid"]), 30, "the stuck process to be killed")
    assert time.monotonic() - seen < 20, "killed at its own limit, not at its delivery's"
    (alpha,) = [key for key in stack.procs if key.startswith("worker-alpha")]
    assert "ended during a step: killed after the hard time limit of 3s" in stack.log(alpha, tail=None)
    assert stack.wait_stopped(stack.submit("three")["task_id"])["task_status"] == 0


def test_the_workers_row_lists_the_attempt_in_flight(stack: Stack, tmp_path: Path) -> None:
    release = tmp_path / "release"
    task = stack.submit("three", {"wait_for_file": {"1": str(release)}})
    settings = Settings(home=stack.home, database_url=stack.env.get("ASYNCFLOW_DATABASE_URL"))
    runtime = Runtime(settings)
    store = runtime.process_store

    def in_flight() -> list[dict] | None:
        for row in store.list(seen_since=time.time() - 30):
            if row.role == "worker" and "beta" in row.detail.get("modules", []):
                attempts = [a for a in row.detail["in_flight"] if a["task_id"] == task["task_id"]]
                if attempts:
                    return attempts
        return None

    try:
        (attempt,) = wait_for(in_flight, 20, "the worker's row to list the attempt")
        assert attempt["module"] == "beta" and attempt["command"] == "step" and attempt["started"] > 0
        entry = wait_for(
            lambda: next((e for e in stack.executions(task["task_id"]) if e["cursor"] == 1), None), 30, "step 1"
        )
        assert entry["pid"] == attempt["pid"]
    finally:
        release.touch()
        runtime.close()
    assert stack.wait_stopped(task["task_id"])["task_status"] == 0
