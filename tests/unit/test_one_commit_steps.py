"""One commit per step (``record_start_after`` above 0): the start of a quick attempt is
recorded together with its outcome; a long attempt also records its start on its own.

The saga rules by example, then the consumer through the in-process harness, counting
the commits it makes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from shared.config import Settings
from shared.flows import Action, Flow, FlowSet, StepDef
from shared.module import Module, StepContext
from shared.saga import Cancel, Failed, Requeue, Started, Submit, Succeeded, Timing, decide
from shared.states import Phase, StepState, TaskStatus
from shared.storage import AttemptRecord, InMemoryStore, TaskEvent
from shared.task import Task, new_task
from shared.testing import Harness, wait_for

ONE_COMMIT = Timing(start_recorded_within=16.0)
FLOW = Flow(
    name="f",
    steps=tuple(
        StepDef(
            normal=Action(module="m", command=f"do{i}", retry=1, timeout=10),
            rollback=Action(module="m", command=f"undo{i}", timeout=10),
        )
        for i in range(3)
    ),
)


def submitted() -> Task:
    return decide(new_task("t1", FLOW, {}, now=100.0), Submit(), 100.0, ONE_COMMIT).task


def test_an_outcome_with_its_start_applies_to_the_queued_message_and_records_both() -> None:
    task = submitted()
    decision = decide(task, Succeeded(1, {"a": 1}, started_at=101.0), 102.0, ONE_COMMIT)
    task = decision.task
    assert task.status is TaskStatus.RUNNING and task.started_at == 101.0
    step = task.steps[0]
    assert (step.state, step.attempts, step.time_start, step.time_end) == (
        StepState.SUCCEEDED,
        1,
        101.0,
        102.0,
    )
    assert task.parameters == {"a": 1}
    assert [(m.cursor, m.seq) for m in decision.messages] == [(1, 2)]


def test_an_outcome_without_its_start_does_not_apply_to_a_queued_message() -> None:
    task = submitted()
    assert decide(task, Succeeded(1), 102.0, ONE_COMMIT).ignored
    assert decide(task, Succeeded(2, started_at=101.0), 102.0, ONE_COMMIT).ignored  # another seq


def test_a_failure_with_its_start_counts_the_attempt_and_waits_for_the_retry() -> None:
    task = decide(submitted(), Failed(1, "boom", started_at=101.0), 102.0, ONE_COMMIT).task
    assert task.steps[0].attempts == 1 and task.steps[0].message == "boom"
    assert task.active is not None and (task.active.phase, task.active.attempt) == (Phase.WAITING, 2)


def test_a_recorded_start_then_an_outcome_with_its_start_is_still_one_attempt() -> None:
    task = decide(submitted(), Started(1), 101.0, ONE_COMMIT).task
    task = decide(task, Succeeded(1, started_at=101.0), 102.0, ONE_COMMIT).task
    assert task.steps[0].state is StepState.SUCCEEDED and task.steps[0].attempts == 1


def test_cancel_of_a_queued_step_waits_for_its_outcome_then_compensates_it() -> None:
    task = decide(submitted(), Succeeded(1, started_at=101.0), 102.0, ONE_COMMIT).task
    task = decide(task, Cancel(), 103.0, ONE_COMMIT).task
    assert task.cancel_requested and task.status is TaskStatus.RUNNING
    assert task.active is not None and task.active.phase is Phase.QUEUED and task.active.due_at == 103.0 + 16
    # A consumer was running step 1 all along: its outcome starts the rollback, step 1 included.
    decision = decide(task, Succeeded(2, started_at=102.5), 104.0, ONE_COMMIT)
    assert decision.task.status is TaskStatus.ROLLING_BACK
    assert [(m.cursor, m.type) for m in decision.messages] == [(1, 1)]


def test_cancel_of_a_queued_step_that_never_ran_compensates_the_earlier_steps() -> None:
    task = decide(submitted(), Succeeded(1, started_at=101.0), 102.0, ONE_COMMIT).task
    task = decide(task, Cancel(), 103.0, ONE_COMMIT).task
    assert decide(task, Requeue(2), 103.0 + 15, ONE_COMMIT).ignored  # not yet due
    decision = decide(task, Requeue(2), 103.0 + 16, ONE_COMMIT)
    assert decision.task.status is TaskStatus.ROLLING_BACK
    assert decision.task.steps[1].attempts == 0  # step 1 never ran: not compensated
    assert [(m.cursor, m.type) for m in decision.messages] == [(0, 1)]


def test_with_starts_recorded_first_cancel_of_a_queued_step_is_immediate() -> None:
    task = decide(new_task("t1", FLOW, {}, now=100.0), Submit(), 100.0).task
    task = decide(task, Cancel(), 101.0).task
    assert task.status is TaskStatus.CANCELLED


# --- the consumer ---------------------------------------------------------------------------


class CountingStore(InMemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.commits: list[AttemptRecord | None] = []

    def save(
        self,
        task: Task,
        now: float,
        attempt: AttemptRecord | None = None,
        event: TaskEvent | None = None,
        next_attempt: AttemptRecord | None = None,
    ) -> bool:
        saved = super().save(task, now, attempt, event, next_attempt)
        if saved:
            self.commits.append(attempt)
        return saved


def harness(tmp_path: Path, handler: Any, record_start_after: float) -> tuple[Harness, CountingStore]:
    module = Module("m")
    for i in range(3):
        module.command(f"do{i}")(handler)
        module.command(f"undo{i}")(lambda ctx: None)
    store = CountingStore()
    settings = Settings(home=tmp_path, record_start_after=record_start_after)
    return Harness(FlowSet({"f": FLOW}, {}, "test"), {"m": module}, store, settings), store


@pytest.mark.parametrize(("record_start_after", "commits_per_step"), [(0.0, 2), (5.0, 1)])
def test_commits_per_quick_step(tmp_path: Path, record_start_after: float, commits_per_step: int) -> None:
    h, store = harness(tmp_path, lambda ctx: {f"done{ctx.cursor}": True}, record_start_after)
    task, _ = h.service.submit("f", {})
    before = len(store.commits)
    h.run()
    done = h.service.get(task.task_id)
    assert done.status is TaskStatus.SUCCESS and done.parameters == {
        "done0": True,
        "done1": True,
        "done2": True,
    }
    assert len(store.commits) - before == 3 * commits_per_step
    attempts = h.service.attempts(task.task_id)
    assert [(a.cursor, a.outcome) for a in attempts] == [(0, "succeeded"), (1, "succeeded"), (2, "succeeded")]
    assert all(a.started_at is not None and a.ended_at is not None for a in attempts)


def test_a_long_attempt_records_its_start_while_it_runs(tmp_path: Path) -> None:
    seen_running = threading.Event()

    def slow(ctx: StepContext) -> dict[str, Any]:
        if ctx.cursor == 1:
            # Wait, inside the handler, until the consumer has recorded the start on its own.
            wait_for(
                lambda: (
                    (t := h.store.get(ctx.task_id)) is not None
                    and t.active is not None
                    and t.active.phase is Phase.RUNNING
                ),
                10,
                "the start of a long attempt to be recorded",
            )
            seen_running.set()
        return {}

    h, store = harness(tmp_path, slow, record_start_after=0.2)
    task, _ = h.service.submit("f", {})
    h.run()
    assert seen_running.is_set()
    assert h.service.get(task.task_id).status is TaskStatus.SUCCESS
    # Steps 0 and 2: one commit each; step 1: its start, then its outcome.
    assert [a is not None and a.outcome is None for a in store.commits] == [False, True, False, False]


def test_a_failing_quick_step_is_retried_and_compensated_with_one_commit_each(tmp_path: Path) -> None:
    def failing(ctx: StepContext) -> dict[str, Any]:
        if ctx.cursor == 1:
            raise RuntimeError("boom")
        return {}

    h, store = harness(tmp_path, failing, record_start_after=5.0)
    task, _ = h.service.submit("f", {})
    h.run()
    done = h.service.get(task.task_id)
    assert done.status is TaskStatus.FAILED
    outcomes = [(a.cursor, a.type, a.outcome) for a in h.service.attempts(task.task_id)]
    assert outcomes == [
        (0, 0, "succeeded"),
        (1, 0, "failed"),
        (1, 0, "failed"),
        (1, 1, "succeeded"),
        (0, 1, "succeeded"),
    ]
    written = [a for a in store.commits if a is not None]  # the others are the scheduler's (the retry's due time)
    assert len(written) == 5 and all(a.started_at is not None and a.outcome is not None for a in written)


def test_a_cancel_while_a_quick_step_runs_compensates_it_and_the_steps_before(tmp_path: Path) -> None:
    ran: list[tuple[int, int]] = []

    def step(ctx: StepContext) -> dict[str, Any]:
        ran.append((ctx.cursor, ctx.step_type))
        if ctx.cursor == 1 and ctx.step_type == 0:
            h.service.operate(ctx.task_id, Cancel())  # the operator cancels while it runs
        return {}

    h, _ = harness(tmp_path, step, record_start_after=5.0)
    for i in range(3):
        h.consumer.modules["m"].commands[f"undo{i}"] = step
    task, _ = h.service.submit("f", {})
    h.run()
    done = h.service.get(task.task_id)
    assert done.status is TaskStatus.CANCELLED
    assert ran == [(0, 0), (1, 0), (1, 1), (0, 1)]  # step 1 ran, so it is compensated too


@pytest.mark.parametrize("record_start_after", [0.0, 0.1])
def test_a_long_attempt_is_kept_alive_with_heartbeats_carrying_its_progress(
    tmp_path: Path, record_start_after: float
) -> None:
    def reporting(ctx: StepContext) -> dict[str, Any]:
        if ctx.cursor == 1:
            ctx.heartbeat(rows=7)

            def stored_progress() -> Any:
                running = [a for a in h.store.attempts(ctx.task_id) if a.cursor == 1]
                return running and running[0].heartbeat_at is not None and running[0].progress

            # Inside the handler: the worker's heartbeats renew the attempt while it works.
            assert wait_for(stored_progress, 10, "a heartbeat with the handler's progress") == {"rows": 7}
        return {}

    module = Module("m")
    for i in range(3):
        module.command(f"do{i}")(reporting)
        module.command(f"undo{i}")(lambda ctx: None)
    settings = Settings(home=tmp_path, record_start_after=record_start_after, heartbeat_interval=0.05)
    h = Harness(FlowSet({"f": FLOW}, {}, "test"), {"m": module}, CountingStore(), settings)
    task, _ = h.service.submit("f", {})
    h.run()
    assert h.service.get(task.task_id).status is TaskStatus.SUCCESS
    step1 = [a for a in h.service.attempts(task.task_id) if a.cursor == 1]
    assert [(a.outcome, a.progress) for a in step1] == [("succeeded", {"rows": 7})]
    assert step1[0].worker and step1[0].heartbeat_at is not None
