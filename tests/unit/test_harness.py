"""The shipped Harness drives the 'three' flow of tests/support through the saga.

Each scenario runs on the InMemoryStore fake and on SQLite. ``Harness.delivered``
shows the messages in the order modules received them; testmod's journal shows
which handlers really ran (a stale message is delivered but runs nothing).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from shared.config import Settings
from shared.flows import load_flows
from shared.module import Module, StepContext
from shared.saga import Cancel, InvalidAction, Resume, Retry
from shared.service import TaskService
from shared.states import Phase, StepCode, StepState, StepType, TaskStatus
from shared.storage import InMemoryStore, TaskStore
from shared.storage.sql import SqliteStore
from shared.task import Task
from shared.testing import Harness

SUPPORT = Path(__file__).resolve().parents[1] / "support"
N, R = StepType.NORMAL, StepType.ROLLBACK
START = 1_700_000_000.0  # ManualClock's start


@dataclass
class Run:
    harness: Harness
    testmod: ModuleType
    journal: Path

    @property
    def service(self) -> TaskService:
        return self.harness.service

    def submit(self, parameters: dict[str, Any], flow: str = "three") -> str:
        task, created = self.service.submit(flow, parameters)
        assert created
        return task.task_id

    def task(self, task_id: str) -> Task:
        return self.service.get(task_id)

    def delivered(self) -> list[tuple[int, StepType]]:
        return [(m.cursor, m.type) for m in self.harness.delivered]

    def ran(self) -> list[tuple[int, int, int, str]]:
        """(cursor, type, attempt, do/undo) of every handler execution, in order."""
        if not self.journal.exists():
            return []
        lines = [json.loads(line) for line in self.journal.read_text(encoding="utf-8").splitlines()]
        return [(e["cursor"], e["type"], e["attempt"], e["what"]) for e in lines]

    def deliver_one(self) -> None:
        """Deliver just the next queued message (to act between two steps)."""
        message = self.harness.publisher.messages.popleft()
        self.harness.delivered.append(message)
        self.harness.consumer.handle(message)


@pytest.fixture(params=["memory", "sqlite"])
def run(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Run]:
    monkeypatch.syspath_prepend(str(SUPPORT))
    journal = tmp_path / "journal.jsonl"
    monkeypatch.setenv("TESTMOD_JOURNAL", str(journal))
    testmod = importlib.import_module("testmod")
    store: TaskStore
    if request.param == "memory":
        store = InMemoryStore()
    else:
        sql = SqliteStore(f"sqlite:///{tmp_path / 'tasks.sqlite'}")
        sql.create_schema()
        store = sql
    harness = Harness(
        load_flows(SUPPORT / "flows.yaml"),
        {"alpha": testmod.alpha, "beta": testmod.beta},
        store=store,
        settings=Settings(home=tmp_path),
    )
    try:
        yield Run(harness, testmod, journal)
    finally:
        store.close()


def test_success_runs_every_step_once_in_order(run: Run) -> None:
    task_id = run.submit({"Cpu": 2})
    run.harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.SUCCESS
    assert (task.cursor, task.active, task.message) == (2, None, None)
    assert task.ended_at == START
    assert run.delivered() == [(0, N), (1, N), (2, N)]
    assert run.ran() == [(0, 0, 1, "do"), (1, 0, 1, "do"), (2, 0, 1, "do")]
    assert task.parameters == {
        "Cpu": 2,
        "done_0": f"{task_id}:0:0:1",
        "done_1": f"{task_id}:1:0:1",
        "done_2": f"{task_id}:2:0:1",
    }
    assert [(s.state, s.rollback_state, s.attempts, s.code) for s in task.steps] == [
        (StepState.SUCCEEDED, StepState.PENDING, 1, StepCode.OK)
    ] * 3
    assert [(a.cursor, a.type, a.attempt, a.outcome) for a in run.service.attempts(task_id)] == [
        (0, N, 1, "succeeded"), (1, N, 1, "succeeded"), (2, N, 1, "succeeded")
    ]
    assert run.harness.publisher.alarms == []


# Step 1 (beta.step) has retry 2: three attempts before it counts as failed.
@pytest.mark.parametrize(
    "failing, expected",
    [
        (0, [(0, N), (0, R)]),
        (1, [(0, N), (1, N), (1, N), (1, N), (1, R), (0, R)]),
        (2, [(0, N), (1, N), (2, N), (2, R), (1, R), (0, R)]),
    ],
    ids=["step0", "step1", "step2"],
)
def test_a_failed_step_is_compensated_from_itself_down_to_step_0(
    run: Run, failing: int, expected: list[tuple[int, StepType]]
) -> None:
    task_id = run.submit({"fail_at": [failing]})
    run.harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.FAILED
    assert run.delivered() == expected
    assert [(c, t) for c, t, _, _ in run.ran()] == [(c, int(t)) for c, t in expected]
    command = "beta.step" if failing == 1 else "alpha.step"
    assert task.message == f"step {failing} ({command}) failed: RuntimeError: forced failure at step {failing}"
    assert task.cursor == failing  # the farthest step reached, for good
    failed = task.steps[failing]
    assert (failed.state, failed.code, failed.message) == (
        StepState.FAILED, StepCode.FAILED, f"RuntimeError: forced failure at step {failing}"
    )
    assert failed.attempts == failed.normal.retry + 1
    for k, step in enumerate(task.steps):
        if k < failing:
            assert step.state is StepState.SUCCEEDED
        if k > failing:
            assert (step.state, step.attempts) == (StepState.PENDING, 0)
        assert step.rollback_state is (StepState.SUCCEEDED if k <= failing else StepState.PENDING)
    assert run.harness.publisher.alarms == []


def test_a_flaky_step_is_retried_after_its_backoff_then_succeeds(run: Run) -> None:
    task_id = run.submit({"flaky": {"1": 2}})
    run.harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.SUCCESS
    assert run.delivered() == [(0, N), (1, N), (1, N), (1, N), (2, N)]
    assert task.steps[1].attempts == 3
    assert task.parameters["done_1"] == f"{task_id}:1:0:3"  # each attempt has its own key
    step1 = [(a.attempt, a.outcome, a.error) for a in run.service.attempts(task_id) if a.cursor == 1]
    assert step1 == [
        (1, "failed", "RuntimeError: flaky failure, attempt 1"),
        (2, "failed", "RuntimeError: flaky failure, attempt 2"),
        (3, "succeeded", None),
    ]
    # Uniform backoff of beta.step: retry_interval 0.2 s before each retry.
    assert run.harness.clock.now - START == pytest.approx(0.4)


def test_a_step_that_stays_flaky_uses_up_its_retries_and_fails(run: Run) -> None:
    task_id = run.submit({"flaky": {"1": 3}})
    run.harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.FAILED
    assert task.steps[1].attempts == 3
    assert run.delivered() == [(0, N), (1, N), (1, N), (1, N), (1, R), (0, R)]


def test_poll_later_runs_the_step_again_without_using_a_retry(run: Run) -> None:
    task_id = run.submit({"poll": {"1": 2}})
    run.harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.SUCCESS
    assert run.delivered() == [(0, N), (1, N), (1, N), (1, N), (2, N)]
    assert task.steps[1].attempts == 1
    assert task.parameters["polled_1"] == 2  # state the handler kept in Parameters
    step1 = [(a.attempt, a.outcome) for a in run.service.attempts(task_id) if a.cursor == 1]
    assert step1 == [(1, "poll_later"), (1, "poll_later"), (1, "succeeded")]
    assert run.harness.clock.now - START == pytest.approx(0.4)


def test_a_failed_rollback_stops_with_an_alarm_and_resume_runs_it_again(run: Run) -> None:
    task_id = run.submit({"fail_at": [2], "fail_rollback_at": [1]})
    run.harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.ROLLBACK_FAILED
    assert run.delivered() == [(0, N), (1, N), (2, N), (2, R), (1, R)]  # step 0 not compensated
    assert task.message == "rollback of step 1 (beta.undo) failed: RuntimeError: forced rollback failure at step 1"
    assert [s.rollback_state for s in task.steps] == [StepState.PENDING, StepState.FAILED, StepState.SUCCEEDED]
    assert task.active is None
    (alarm,) = run.harness.publisher.alarms
    assert (alarm.task_id, alarm.flow, alarm.cursor, alarm.module, alarm.command) == (
        task_id, "three", 1, "beta", "undo"
    )
    assert alarm.error == "RuntimeError: forced rollback failure at step 1"

    resumed = run.service.operate(task_id, Resume())
    assert resumed.status is TaskStatus.ROLLING_BACK
    assert resumed.active is not None
    assert (resumed.active.cursor, resumed.active.type, resumed.active.phase) == (1, R, Phase.QUEUED)
    run.harness.run()
    task = run.task(task_id)
    # The rollback still fails (its parameters have not changed): stopped again, a second alarm.
    assert task.status is TaskStatus.ROLLBACK_FAILED
    assert run.delivered() == [(0, N), (1, N), (2, N), (2, R), (1, R), (1, R)]
    first, second = run.harness.publisher.alarms
    assert (second.cursor, second.module, second.command) == (1, "beta", "undo")
    assert second.seq > first.seq
    with pytest.raises(InvalidAction):
        run.service.operate(task_id, Retry())


def test_a_rollback_is_retried_before_the_alarm(run: Run) -> None:
    # alpha.undo (step 0's rollback) has retry 1: two attempts.
    task_id = run.submit({"fail_at": [1], "fail_rollback_at": [0]})
    run.harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.ROLLBACK_FAILED
    assert run.delivered() == [(0, N), (1, N), (1, N), (1, N), (1, R), (0, R), (0, R)]
    assert task.steps[0].rollback_attempts == 2
    (alarm,) = run.harness.publisher.alarms
    assert (alarm.cursor, alarm.module, alarm.command) == (0, "alpha", "undo")


def test_cancel_before_the_first_step_runs_stops_without_running_anything(run: Run) -> None:
    task_id = run.submit({})
    cancelled = run.service.operate(task_id, Cancel())
    assert cancelled.status is TaskStatus.CANCELLED
    run.harness.run()
    assert run.task(task_id).status is TaskStatus.CANCELLED
    assert run.delivered() == [(0, N)]  # delivered, recognised as stale...
    assert run.ran() == []  # ...and never executed


def test_cancel_while_a_step_waits_compensates_from_that_step(run: Run) -> None:
    task_id = run.submit({"poll": {"1": 5}})
    run.deliver_one()  # step 0 succeeds
    run.deliver_one()  # step 1 answers "poll later": it waits
    waiting = run.task(task_id)
    assert waiting.active is not None and waiting.active.phase is Phase.WAITING
    task = run.service.operate(task_id, Cancel())
    assert task.status is TaskStatus.ROLLING_BACK
    assert task.steps[1].state is StepState.CANCELLED
    run.harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.CANCELLED
    assert task.message == "cancelled by operator"
    assert run.delivered() == [(0, N), (1, N), (1, R), (0, R)]
    with pytest.raises(InvalidAction):
        run.service.operate(task_id, Cancel())


def test_cancel_while_a_step_runs_lets_it_finish_then_compensates(run: Run) -> None:
    harness = run.harness
    beta = Module("beta")

    @beta.command("step")
    def step(ctx: StepContext) -> dict[str, Any]:
        # The operator cancels while this attempt is running.
        task = harness.service.operate(ctx.task_id, Cancel())
        assert task.status is TaskStatus.RUNNING and task.cancel_requested
        return {"beta_ran": True}

    beta.command("undo")(lambda ctx: None)
    harness.consumer.modules["beta"] = beta

    task_id = run.submit({})
    harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.CANCELLED
    assert task.parameters["beta_ran"] is True
    assert task.steps[1].state is StepState.SUCCEEDED
    assert [s.rollback_state for s in task.steps] == [StepState.SUCCEEDED, StepState.SUCCEEDED, StepState.PENDING]
    assert run.delivered() == [(0, N), (1, N), (1, R), (0, R)]


def test_retry_runs_a_failed_task_again_from_its_failed_step(run: Run, tmp_path: Path) -> None:
    # 'noop' has no rollbacks: nothing before the failed step was undone.
    guard = tmp_path / "step-2-broken"
    guard.touch()
    task_id = run.submit({"fail_if_exists": {"2": str(guard)}}, flow="noop")
    run.harness.run()
    assert run.task(task_id).status is TaskStatus.FAILED
    assert run.delivered() == [(0, N), (1, N), (2, N)]

    guard.unlink()  # the operator fixes the cause
    retried = run.service.operate(task_id, Retry())
    assert (retried.status, retried.cursor, retried.message) == (TaskStatus.RUNNING, 2, None)
    run.harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.SUCCESS
    assert run.delivered() == [(0, N), (1, N), (2, N), (2, N)]
    assert [s.attempts for s in task.steps] == [1, 1, 1]
    assert [(c, attempt, what) for c, _, attempt, what in run.ran()] == [
        (0, 1, "do"), (1, 1, "do"), (2, 1, "do"), (2, 1, "do")
    ]


def test_retry_first_redoes_the_steps_the_compensation_undid(run: Run, tmp_path: Path) -> None:
    guard = tmp_path / "step-2-broken"
    guard.touch()
    task_id = run.submit({"fail_if_exists": {"2": str(guard)}})
    run.harness.run()
    assert run.task(task_id).status is TaskStatus.FAILED
    assert run.delivered() == [(0, N), (1, N), (2, N), (2, R), (1, R), (0, R)]

    guard.unlink()
    retried = run.service.operate(task_id, Retry())
    assert (retried.status, retried.cursor) == (TaskStatus.RUNNING, 0)
    run.harness.run()
    task = run.task(task_id)
    assert task.status is TaskStatus.SUCCESS
    assert run.delivered()[6:] == [(0, N), (1, N), (2, N)]
    assert [(s.state, s.rollback_state) for s in task.steps] == [(StepState.SUCCEEDED, StepState.PENDING)] * 3


def test_operator_actions_refuse_the_wrong_state(run: Run) -> None:
    task_id = run.submit({})
    run.harness.run()
    for action, words in [(Cancel(), "only pending or running"), (Retry(), "only failed or cancelled"),
                          (Resume(), "only a failed rollback")]:
        with pytest.raises(InvalidAction, match=words):
            run.service.operate(task_id, action)
    assert run.task(task_id).status is TaskStatus.SUCCESS
