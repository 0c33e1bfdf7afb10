"""Pull-mode modules: flow steps leased by v1 workers, with the saga's retries,
timeouts and rollback, on SQLite and PostgreSQL.

The test plays the external worker over HTTP (hold_tasks / set_task); the
push-mode steps around it run in-process, from the published messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncflow.sdk import Done, Job, Worker
from oss_api.app import create_app
from oss_api.testing import TestClient
from shared.config import Settings
from shared.consumer import StepConsumer
from shared.flows import load_flows
from shared.saga import Cancel
from shared.states import TaskStatus
from shared.storage.sql import SqlStore
from shared.testing import InProcess
from tests.support import testmod

SUPPORT = Path(__file__).resolve().parents[1] / "support"
GRACE = 15.0  # Settings.expire_grace's default


class Flow:
    """One API, the push-mode modules in-process, and the test as the pull-mode worker."""

    def __init__(self, store: SqlStore, home: Path, settings: Settings | None = None) -> None:
        app = InProcess(load_flows(SUPPORT / "pull_flows.yaml"), home, store, settings=settings)
        self.clock, self.publisher, self.runtime = app.clock, app.publisher, app.runtime
        self.service = self.runtime.service
        self.consumer = StepConsumer(
            self.service, {"alpha": testmod.alpha, "beta": testmod.beta}, self.runtime.settings, clock=self.clock
        )
        self.http = TestClient(create_app(self.runtime))

    def submit(self, **parameters: Any) -> str:
        task, _ = self.service.submit("with_dns", parameters)
        self.run_push()
        return task.task_id

    def run_push(self) -> None:
        while self.publisher.messages:
            self.consumer.handle(self.publisher.messages.popleft())

    def later(self, seconds: float) -> None:
        """Let time pass: the scheduler publishes what became due, push steps run."""
        self.clock.advance(seconds)
        self.runtime.scheduler.tick()
        self.run_push()

    def post(self, path: str, body: Any) -> dict[str, Any]:
        response = self.http.post("/v1/" + path, json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def hold(self) -> list[dict[str, Any]]:
        answer = self.post("hold_tasks", {"task_type": "dns"})
        assert answer["code"] == 0, answer
        return answer["task_list"]

    def hold_one(self) -> tuple[str, str, dict[str, Any]]:
        (task,) = self.hold()
        return task["task_id"], task["task_stage"], json.loads(task["task_content"])

    def set(self, task_id: str, status: int, **fields: Any) -> dict[str, Any]:
        answer = self.post("set_task", {"task_data": {"task_id": task_id, "status": status, **fields}})
        self.run_push()
        return answer

    def status(self, task_id: str) -> TaskStatus:
        return self.service.get(task_id).status


@pytest.fixture
def flow(sql_store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Flow:
    monkeypatch.setenv("TESTMOD_JOURNAL", str(tmp_path / "journal"))
    return Flow(sql_store, tmp_path)


def journal(tmp_path: Path) -> list[tuple[int, str]]:
    lines = (tmp_path / "journal").read_text().splitlines() if (tmp_path / "journal").exists() else []
    return [(e["cursor"], e["what"]) for e in map(json.loads, lines)]


def test_a_pull_step_runs_between_push_steps(flow: Flow, tmp_path: Path) -> None:
    task_id = flow.submit(Name="db1")
    assert flow.status(task_id) is TaskStatus.RUNNING
    step_id, stage, content = flow.hold_one()
    assert step_id == f"{task_id}.2" and stage == "add_record"
    assert content["task_id"] == task_id and content["step"] == 1 and content["rollback"] is False
    assert content["attempt"] == 1 and content["command"] == "add_record" and content["timeout"] == 5
    assert content["idempotency_key"] == f"{task_id}:1:0:1"
    # The stored Parameters, with what step 0 added.
    assert content["parameters"]["Name"] == "db1" and "done_0" in content["parameters"]
    assert flow.hold() == []  # leased once
    answer = flow.set(step_id, 3, task_content='{"Record": "db1.example"}', schedule_log="added")
    assert answer == {"code": 0, "msg": "SUCCESS"}
    task = flow.service.get(task_id)
    assert task.status is TaskStatus.SUCCESS
    assert task.parameters["Record"] == "db1.example" and "done_2" in task.parameters
    assert journal(tmp_path) == [(0, "do"), (2, "do")]
    row = flow.http.get(f"/v1/get_task?task_id={step_id}").json()
    assert (row["task_data"]["status"], row["task_data"]["schedule_log"]) == (3, "added")


def test_a_later_failure_rolls_back_through_the_pull_worker(flow: Flow, tmp_path: Path) -> None:
    task_id = flow.submit(fail_at=[2])
    step_id, _, _ = flow.hold_one()
    flow.set(step_id, 3, task_content='{"Record": "r"}')
    # Step 2 failed: its compensation is step 1's, leased by the pull worker.
    undo_id, stage, content = flow.hold_one()
    assert stage == "remove_record" and content["rollback"] is True and content["step"] == 1
    assert content["parameters"]["Record"] == "r"
    assert flow.status(task_id) is TaskStatus.ROLLING_BACK
    flow.set(undo_id, 3)
    assert flow.status(task_id) is TaskStatus.FAILED
    assert journal(tmp_path) == [(0, "do"), (2, "do"), (0, "undo")]


def test_a_failed_pull_step_is_retried_then_compensated(flow: Flow, tmp_path: Path) -> None:
    task_id = flow.submit()
    first, _, _ = flow.hold_one()
    assert flow.set(first, 4, schedule_log="registrar said no")["code"] == 0
    assert flow.hold() == []  # the retry waits its interval
    flow.later(0.3)
    second, _, content = flow.hold_one()
    assert second != first and content["attempt"] == 2
    flow.set(second, 4, schedule_log="still no")
    # retry: 1 is used up. Step 1 itself is compensated first (its work may be half done).
    undo, stage, _ = flow.hold_one()
    assert stage == "remove_record"
    flow.set(undo, 3)
    task = flow.service.get(task_id)
    assert task.status is TaskStatus.FAILED
    assert "still no" in (task.message or "")
    assert journal(tmp_path) == [(0, "do"), (0, "undo")]


def test_a_lease_past_the_timeout_fails_the_attempt_and_a_late_report_is_refused(flow: Flow) -> None:
    task_id = flow.submit()
    lost, _, _ = flow.hold_one()
    flow.later(5 + GRACE)  # timeout + grace: the saga's expiry
    flow.later(0.3)  # the retry's backoff
    again, _, content = flow.hold_one()
    assert content["attempt"] == 2
    late = flow.set(lost, 3, task_content='{"Record": "late"}')
    assert late["code"] == 3 and late["msg"].startswith("CONFLICT::this attempt of the step is over")
    flow.set(again, 3, task_content='{"Record": "on time"}')
    task = flow.service.get(task_id)
    assert task.status is TaskStatus.SUCCESS and task.parameters["Record"] == "on time"


def test_success_reported_after_the_timeout_counts_as_a_timeout(flow: Flow) -> None:
    task_id = flow.submit()
    step_id, _, _ = flow.hold_one()
    flow.clock.advance(6)  # past the 5 s timeout, before the sweep's grace is over
    assert flow.set(step_id, 3)["code"] == 0
    step = flow.service.get(task_id).steps[1]
    assert step.attempts == 1 and "timeout" in (step.message or "")
    flow.later(0.3)
    assert flow.hold_one()[2]["attempt"] == 2


def test_status_1_polls_again_with_the_merged_content(flow: Flow) -> None:
    task_id = flow.submit()
    step_id, _, _ = flow.hold_one()
    flow.set(step_id, 1, task_content='{"JobId": "j-7"}')
    assert flow.hold() == []
    flow.later(0.3)  # poll_interval in flows.yaml
    again, _, content = flow.hold_one()
    assert content["parameters"]["JobId"] == "j-7" and content["attempt"] == 1  # polling uses no retry
    flow.set(again, 3)
    assert flow.status(task_id) is TaskStatus.SUCCESS


def test_a_step_published_again_is_leased_once(flow: Flow) -> None:
    flow.submit()
    # Nobody leased it within requeue_after: the sweep publishes it again.
    flow.later(31)
    step_id, _, _ = flow.hold_one()
    flow.later(10)  # started (deadline 5 s + grace): nothing to publish again
    assert flow.hold() == []
    assert flow.set(step_id, 3)["code"] == 0


def test_a_lease_whose_start_was_lost_goes_back_to_the_queue(flow: Flow, sql_store: SqlStore) -> None:
    task_id = flow.submit()
    # A hold that committed its lease but died before recording the start.
    (leased,) = flow.runtime.pull_store.hold("dns", 10, flow.clock())
    assert flow.hold() == []
    flow.later(31)  # the saga still sees it queued and publishes it again
    step_id, _, content = flow.hold_one()
    assert step_id == leased.task_id and content["attempt"] == 1
    flow.set(step_id, 3)
    assert flow.status(task_id) is TaskStatus.SUCCESS


def test_a_cancelled_task_is_not_leased(flow: Flow, tmp_path: Path) -> None:
    task_id = flow.submit()
    flow.service.operate(task_id, Cancel())
    flow.run_push()
    assert flow.hold() == []
    assert flow.status(task_id) is TaskStatus.CANCELLED
    assert journal(tmp_path) == [(0, "do"), (0, "undo")]


def test_the_module_is_a_task_type_that_only_flows_feed(flow: Flow) -> None:
    types = flow.http.get("/v1/get_task_schedule_cfg_list").json()["task_schedule_cfg_list"]
    assert {"task_type": "dns", "schedule_limit": 10, "schedule_interval": 0,
            "max_processing_time": 20, "max_retry_num": 0, "max_retry_interval": 0} in types
    created = flow.post("create_task", {"task_data": {"task_type": "dns"}})
    assert created["code"] == 3 and "submit a flow" in created["msg"]
    registered = flow.post("register_task_type", {"task_type_data": {"task_type": "dns"}})
    assert registered["code"] == 3 and "flows.yaml" in registered["msg"]


def test_a_result_that_is_not_a_json_object_is_refused_and_changes_nothing(flow: Flow) -> None:
    task_id = flow.submit()
    step_id, _, _ = flow.hold_one()
    answer = flow.set(step_id, 3, task_content="not json")
    assert answer["code"] == 1 and "JSON object" in answer["msg"]
    assert flow.status(task_id) is TaskStatus.RUNNING
    assert flow.set(step_id, 3, task_content="{}")["code"] == 0
    assert flow.status(task_id) is TaskStatus.SUCCESS


def test_the_python_sdk_works_flow_steps_too(flow: Flow) -> None:
    task_id = flow.submit(Name="db5")
    worker = Worker("http://testserver", "dns", http=flow.http, poll_interval=0.05)
    seen: list[dict[str, Any]] = []

    @worker.stage("add_record")
    def add(job: Job) -> Done:
        step = job.content_json()
        seen.append(step)
        return Done({"Record": step["parameters"]["Name"] + ".example"})

    with worker:
        (outcome,) = worker.run_once()
    assert outcome == Done({"Record": "db5.example"})
    flow.run_push()
    task = flow.service.get(task_id)
    assert task.status is TaskStatus.SUCCESS and task.parameters["Record"] == "db5.example"
    assert seen[0]["command"] == "add_record"


def test_status_1_with_a_higher_retry_count_is_a_failed_attempt(flow: Flow) -> None:
    task_id = flow.submit()
    step_id, _, _ = flow.hold_one()
    assert flow.set(step_id, 1, crt_retry_num=1, schedule_log="try again")["code"] == 0
    step = flow.service.get(task_id).steps[1]
    assert step.message == "try again"
    flow.later(0.3)  # the retry's backoff
    assert flow.hold_one()[2]["attempt"] == 2


@pytest.fixture
def beating(sql_store: SqlStore, tmp_path: Path) -> Flow:
    """Heartbeats every second: an attempt not heard from for 3 s is lost (the step's timeout is 5 s)."""
    return Flow(sql_store, tmp_path, Settings(home=tmp_path, heartbeat_interval=1.0))


def hold_with_heartbeats(flow: Flow) -> str:
    answer = flow.post("hold_tasks", {"task_type": "dns", "heartbeat": True})
    assert answer["code"] == 0 and answer["heartbeat_timeout"] == 3.0, answer
    (task,) = answer["task_list"]
    return str(task["task_id"])


def test_a_worker_that_sends_heartbeats_keeps_its_step_and_its_progress_is_recorded(beating: Flow) -> None:
    task_id = beating.submit()
    leased = hold_with_heartbeats(beating)
    beating.later(2)
    assert beating.set(leased, 2, task_content='{"percent": 50}')["code"] == 0
    beating.later(2)  # 4 s after the start: without that heartbeat the attempt was lost at 3
    attempts = beating.service.attempts(task_id)
    assert [(a.outcome, a.progress) for a in attempts if a.cursor == 1] == [(None, {"percent": 50})]
    assert beating.set(leased, 3, task_content='{"Record": "r"}')["code"] == 0
    assert beating.status(task_id) is TaskStatus.SUCCESS


def test_a_worker_whose_heartbeats_stop_loses_its_step_before_the_timeout(beating: Flow) -> None:
    task_id = beating.submit()
    leased = hold_with_heartbeats(beating)
    beating.later(3)  # no report for the heartbeat timeout: the worker is lost
    step = [a for a in beating.service.attempts(task_id) if a.cursor == 1]
    assert [(a.outcome, a.error) for a in step] == [("expired", "worker lost: no heartbeat for 3s")]
    refused = beating.set(leased, 2)
    assert refused["code"] == 3 and "attempt of the step is over" in refused["msg"]
    beating.later(0.3)  # the retry's backoff
    _, _, content = beating.hold_one()
    assert content["attempt"] == 2
