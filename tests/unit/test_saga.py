"""The saga transition function, by example (see test_saga_properties for the rules)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.flows import Action, Flow, StepDef
from shared.saga import (
    Cancel,
    Due,
    Expire,
    Failed,
    Heartbeat,
    InvalidAction,
    PollLater,
    PublishFailed,
    Released,
    Requeue,
    Resume,
    Retry,
    Started,
    Submit,
    Succeeded,
    Timing,
    decide,
)
from shared.states import Phase, StepCode, StepState, StepType, TaskStatus
from shared.task import Command, Task, new_task


def flow(*retries: int, rollbacks: tuple[bool, ...] | None = None) -> Flow:
    rollbacks = rollbacks or tuple(True for _ in retries)
    return Flow(
        name="f",
        steps=tuple(
            StepDef(
                normal=Action(module="m", command=f"do{i}", retry=r, timeout=10),
                rollback=Action(module="m", command=f"undo{i}", retry=1) if rb else None,
            )
            for i, (r, rb) in enumerate(zip(retries, rollbacks, strict=True))
        ),
    )


def submitted(f: Flow, params: dict | None = None) -> Task:
    d = decide(new_task("t1", f, params or {"Cpu": 4}, now=100.0), Submit(), 100.0)
    assert len(d.messages) == 1
    return d.task


def run(task: Task, *outcomes: object, now: float = 200.0) -> Task:
    """Start the outstanding message and apply each outcome in turn."""
    for outcome in outcomes:
        if task.active.phase is Phase.WAITING:
            now = max(now, task.active.due_at)
            task = decide(task, Due(task.active.seq), now).task
        task = decide(task, Started(task.active.seq), now).task
        task = decide(task, outcome(task.active.seq), now).task  # type: ignore[operator]
    return task


def ok(result: dict | None = None):
    return lambda seq: Succeeded(seq, result or {})


def fail(seq: int) -> Failed:
    return Failed(seq, "boom")


def test_submit_stores_cursor_zero_status_one_and_queues_step_zero() -> None:
    task = new_task("t1", flow(0, 0), {"Cpu": 4}, now=100.0)
    d = decide(task, Submit(), 100.0)
    assert d.task.status is TaskStatus.PENDING and d.task.cursor == 0
    (msg,) = d.messages
    assert (msg.cursor, msg.type, msg.command, msg.parameters) == (0, StepType.NORMAL, "do0", {"Cpu": 4})
    assert d.task.active.phase is Phase.QUEUED


def test_a_deferred_submit_leaves_step_zero_waiting_due_at_once_for_the_sweep() -> None:
    task = new_task("t1", flow(0, 0), {"Cpu": 4}, now=100.0)
    d = decide(task, Submit(deferred=True), 100.0)
    assert d.messages == () and d.task.status is TaskStatus.PENDING
    assert (d.task.active.seq, d.task.active.cursor, d.task.active.phase, d.task.active.due_at) == (1, 0, Phase.WAITING, 100.0)
    assert decide(d.task, Due(1), 99.0).ignored  # not before it is due
    released = decide(d.task, Due(1), 100.5)
    (msg,) = released.messages
    assert (msg.seq, msg.cursor, msg.command) == (1, 0, "do0")
    assert released.task.active.phase is Phase.QUEUED


def test_started_sets_running_and_success_merges_results_and_advances() -> None:
    task = submitted(flow(0, 0))
    task = decide(task, Started(task.active.seq), 101.0).task
    assert task.status is TaskStatus.RUNNING and task.started_at == 101.0
    d = decide(task, Succeeded(task.active.seq, {"InstanceId": "i-1"}), 102.0)
    assert d.task.parameters == {"Cpu": 4, "InstanceId": "i-1"}
    assert d.task.cursor == 1 and d.messages[0].cursor == 1
    assert d.messages[0].parameters["InstanceId"] == "i-1"
    final = run(d.task, ok())
    assert final.status is TaskStatus.SUCCESS and final.active is None and final.ended_at


def test_failure_rolls_back_failed_step_then_earlier_in_reverse() -> None:
    task = run(submitted(flow(0, 0, 0)), ok(), ok(), fail)
    assert task.status is TaskStatus.ROLLING_BACK and task.cursor == 2
    assert task.steps[2].state is StepState.FAILED and task.steps[2].message == "boom"
    assert task.message == "step 2 (m.do2) failed: boom"
    order = []
    while task.active:
        order.append((task.active.cursor, task.active.type))
        task = run(task, ok())
    assert order == [(2, StepType.ROLLBACK), (1, StepType.ROLLBACK), (0, StepType.ROLLBACK)]
    assert task.status is TaskStatus.FAILED and task.cursor == 2


def test_steps_without_rollback_are_skipped() -> None:
    task = run(submitted(flow(0, 0, 0, rollbacks=(True, False, True))), ok(), ok(), fail)
    assert task.active.cursor == 2
    task = run(task, ok())
    assert task.active.cursor == 0 and task.steps[1].rollback_state is StepState.SKIPPED


def test_retry_redelivers_after_backoff_without_consuming_a_new_step() -> None:
    task = run(submitted(flow(2)), fail)
    assert task.active.phase is Phase.WAITING and task.active.attempt == 2
    assert task.active.due_at == 200.0 + 1.0  # uniform retry_interval default
    d = decide(task, Due(task.active.seq), 201.0)
    assert d.messages[0].attempt == 2
    task = run(d.task, fail, fail)
    assert task.status is TaskStatus.ROLLING_BACK and task.steps[0].attempts == 3


def test_progressive_backoff_follows_min_pow2_max() -> None:
    action = Command.of(Action(module="m", command="c", max_retry_interval=10))
    assert [action.backoff(n) for n in range(1, 8)] == [1, 2, 4, 8, 10, 10, 10]
    assert Command.of(Action(module="m", command="c", max_retry_interval=-3)).backoff(5) == 3


def test_permanent_failure_skips_remaining_retries() -> None:
    task = submitted(flow(5))
    task = decide(task, Started(task.active.seq), 1.0).task
    task = decide(task, Failed(task.active.seq, "no quota", permanent=True), 1.0).task
    assert task.status is TaskStatus.ROLLING_BACK


def test_rollback_failure_stops_with_alarm_and_resume_continues() -> None:
    task = run(submitted(flow(0, 0)), ok(), fail)  # rollback of step 1 pending
    task = decide(task, Started(task.active.seq), 1.0).task
    d = decide(task, Failed(task.active.seq, "x"), 1.0)  # rollback retry=1 → retried
    assert d.task.status is TaskStatus.ROLLING_BACK
    task = decide(d.task, Due(d.task.active.seq), 2.0).task
    task = decide(task, Started(task.active.seq), 2.0).task
    d = decide(task, Failed(task.active.seq, "disk gone"), 2.0)
    assert d.task.status is TaskStatus.ROLLBACK_FAILED and d.task.active is None
    (alarm,) = d.alarms
    assert (alarm.cursor, alarm.command, alarm.error) == (1, "undo1", "disk gone")
    resumed = decide(d.task, Resume(), 3.0)
    assert resumed.messages[0].cursor == 1 and resumed.messages[0].type is StepType.ROLLBACK
    final = run(resumed.task, ok(), ok())
    assert final.status is TaskStatus.FAILED


def test_stale_and_duplicate_events_change_nothing() -> None:
    task = submitted(flow(0, 0))
    seq = task.active.seq
    started = decide(task, Started(seq), 1.0).task
    assert decide(started, Started(seq), 1.0).ignored  # redelivered message
    assert decide(started, Succeeded(seq + 1), 1.0).ignored  # unknown seq
    done = decide(started, Succeeded(seq), 1.0).task
    assert decide(done, Succeeded(seq), 1.0).ignored  # late duplicate outcome
    assert decide(done, Failed(seq, "late"), 1.0).task is done


def test_poll_later_keeps_attempt_and_merges_state() -> None:
    task = submitted(flow(0))
    task = decide(task, Started(task.active.seq), 1.0).task
    d = decide(task, PollLater(task.active.seq, 5.0, {"JobId": "j1"}), 1.0)
    assert d.task.active.phase is Phase.WAITING and d.task.active.due_at == 6.0
    assert d.task.active.attempt == 1 and d.task.parameters["JobId"] == "j1"


def test_cancel_while_running_waits_for_the_attempt_then_compensates_it() -> None:
    task = run(submitted(flow(0, 0, 0)), ok())
    task = decide(task, Started(task.active.seq), 1.0).task  # step 1 running
    task = decide(task, Cancel(), 1.0).task
    assert task.cancel_requested and task.active.phase is Phase.RUNNING
    d = decide(task, Succeeded(task.active.seq), 2.0)
    assert d.messages[0].cursor == 1 and d.messages[0].type is StepType.ROLLBACK
    final = run(d.task, ok(), ok())
    assert final.status is TaskStatus.CANCELLED


def test_cancel_of_queued_step_skips_it_and_compensates_earlier() -> None:
    task = run(submitted(flow(0, 0)), ok())  # step 1 queued, never started
    d = decide(task, Cancel(), 1.0)
    assert d.messages[0].cursor == 0 and d.task.steps[1].state is StepState.PENDING
    stale = decide(d.task, Started(task.active.seq), 1.0)
    assert stale.ignored


def test_cancel_pending_task_ends_cancelled_at_once() -> None:
    d = decide(submitted(flow(0)), Cancel(), 1.0)
    assert d.task.status is TaskStatus.CANCELLED and not d.messages


@pytest.mark.parametrize("status", [TaskStatus.SUCCESS, TaskStatus.FAILED, TaskStatus.ROLLING_BACK])
def test_cancel_refused_unless_pending_or_running(status: TaskStatus) -> None:
    with pytest.raises(InvalidAction):
        decide(replace(submitted(flow(0)), status=status), Cancel(), 1.0)


def test_retry_restarts_from_first_undone_step() -> None:
    task = run(submitted(flow(0, 0, 0, rollbacks=(False, True, True))), ok(), ok(), fail)
    task = run(task, ok(), ok())  # rollbacks of 2 and 1; step 0 has none
    assert task.status is TaskStatus.FAILED
    d = decide(task, Retry(), 5.0)
    assert d.task.status is TaskStatus.RUNNING and d.messages[0].cursor == 1
    assert d.task.steps[0].state is StepState.SUCCEEDED
    assert d.task.steps[2].state is StepState.PENDING and d.task.steps[2].attempts == 0
    with pytest.raises(InvalidAction):
        decide(d.task, Retry(), 5.0)


def test_resume_only_for_failed_rollback() -> None:
    with pytest.raises(InvalidAction):
        decide(submitted(flow(0)), Resume(), 1.0)


def test_requeue_republishes_a_queued_message_only_once_due() -> None:
    task = submitted(flow(0))
    seq, due = task.active.seq, task.active.due_at
    assert due == 100.0 + 30.0  # DEFAULT_TIMING.requeue_after
    assert decide(task, Requeue(seq), due - 1).ignored
    d = decide(task, Requeue(seq), due)
    (msg,) = d.messages
    assert msg.seq == seq and d.task.active.due_at == due + 30.0
    started = decide(d.task, Started(seq), due + 1).task
    assert decide(started, Requeue(seq), due + 1000).ignored  # running: nothing to re-publish


def test_a_requeue_leaves_a_message_in_its_queue_s_backlog_and_looks_again_later() -> None:
    task = submitted(flow(0))
    seq, due = task.active.seq, task.active.due_at
    d = decide(task, Requeue(seq, frozenset({"m"})), due)
    assert not d.messages and not d.ignored
    assert d.task.active == replace(task.active, due_at=due + 30.0, held=1)  # same message, same phase
    assert decide(d.task, Requeue(seq, frozenset({"m"})), due + 29).ignored  # not due again yet
    (again,) = decide(d.task, Requeue(seq, frozenset({"other"})), due + 30).messages  # the backlog is gone
    assert again.seq == seq
    assert decide(d.task, Started(seq), due + 1).task.active.phase is Phase.RUNNING  # the copy queued starts


def test_a_message_is_held_in_a_backlog_a_bounded_number_of_times_and_one_refused_never() -> None:
    timing = Timing(requeue_holds=3)
    backlog = frozenset({"m"})
    task = decide(new_task("t1", flow(0), {}, now=100.0), Submit(), 100.0, timing).task
    seq, now = task.active.seq, task.active.due_at
    for held in range(1, 4):
        d = decide(task, Requeue(seq, backlog), now, timing)
        assert not d.messages and d.task.active.held == held
        task, now = d.task, d.task.active.due_at
    d = decide(task, Requeue(seq, backlog), now, timing)  # lost after all, perhaps: published again
    assert [m.seq for m in d.messages] == [seq] and d.task.active.held == 0
    refused = decide(d.task, PublishFailed(seq), now, timing).task
    assert decide(refused, Requeue(seq, backlog), refused.active.due_at, timing).messages


def test_publish_failure_brings_the_requeue_forward() -> None:
    task = submitted(flow(0))
    d = decide(task, PublishFailed(task.active.seq), 101.0, Timing(publish_retry=2.0))
    assert d.task.active.due_at == 103.0 and not d.messages
    assert decide(d.task, Requeue(task.active.seq), 103.0).messages


def test_expired_attempt_counts_as_failed_and_late_outcome_is_ignored() -> None:
    task = submitted(flow(1))
    seq = task.active.seq
    task = decide(task, Started(seq), 200.0, Timing(expire_grace=5.0)).task
    assert task.active.due_at == 200.0 + 10 + 5.0  # timeout 10 + grace
    assert decide(task, Expire(seq), 214.0).ignored
    d = decide(task, Expire(seq), 215.0)
    assert d.task.active.attempt == 2 and d.task.steps[0].code == StepCode.TIMED_OUT
    assert "no outcome within 10s" in d.task.steps[0].message
    assert decide(d.task, Succeeded(seq), 216.0).ignored  # the lost worker came back too late


HEARTBEATS = Timing(expire_grace=5.0, heartbeat_timeout=3.0)


def test_heartbeats_renew_a_running_attempt_up_to_its_own_deadline() -> None:
    task = submitted(flow(1))  # step timeout 10
    seq = task.active.seq
    task = decide(task, Started(seq, heartbeats=True), 200.0, HEARTBEATS).task
    assert task.active.due_at == 203.0  # silent for 3 s: lost
    for now in (202.0, 204.0, 206.0, 208.0, 210.0, 212.0):
        task = decide(task, Heartbeat(seq, {"done": now}), now, HEARTBEATS).task
        assert task.active.due_at == min(now + 3.0, 215.0)  # started + timeout 10 + grace 5
    assert decide(task, Heartbeat(seq), 214.0, HEARTBEATS).task.active.due_at == 215.0  # capped


def test_an_attempt_whose_heartbeats_stop_fails_as_lost_and_is_retried() -> None:
    task = submitted(flow(1))
    seq = task.active.seq
    task = decide(task, Started(seq, heartbeats=True), 200.0, HEARTBEATS).task
    task = decide(task, Heartbeat(seq), 201.0, HEARTBEATS).task
    assert decide(task, Expire(seq), 203.9, HEARTBEATS).ignored  # not due yet
    d = decide(task, Expire(seq), 204.0, HEARTBEATS)
    step = d.task.steps[0]
    assert step.code == StepCode.FAILED and step.message == "worker lost: no heartbeat for 3s"
    assert d.task.active.attempt == 2
    assert decide(d.task, Heartbeat(seq), 204.5, HEARTBEATS).ignored  # the old attempt's worker is gone


def test_heartbeats_do_not_outlast_the_timeout() -> None:
    task = submitted(flow(1))
    seq = task.active.seq
    task = decide(task, Started(seq, heartbeats=True), 200.0, HEARTBEATS).task
    for now in range(201, 215):
        task = decide(task, Heartbeat(seq), float(now), HEARTBEATS).task
    d = decide(task, Expire(seq), 215.0, HEARTBEATS)
    assert d.task.steps[0].code == StepCode.TIMED_OUT and "no outcome within 10s" in d.task.steps[0].message


def test_a_heartbeat_only_applies_to_a_running_attempt() -> None:
    task = submitted(flow(1))
    seq = task.active.seq
    assert "while it is queued" in (decide(task, Heartbeat(seq), 201.0, HEARTBEATS).ignored or "")
    running = decide(task, Started(seq, heartbeats=True), 200.0, HEARTBEATS).task
    assert decide(running, Heartbeat(seq + 1), 201.0, HEARTBEATS).ignored


def test_an_attempt_started_without_heartbeats_is_bounded_by_its_timeout_only() -> None:
    # A v1 worker that did not opt in: silence is not loss.
    task = submitted(flow(1))
    task = decide(task, Started(task.active.seq), 200.0, HEARTBEATS).task
    assert task.active.due_at == 215.0


def test_a_started_attempt_given_back_goes_out_again_as_the_same_attempt() -> None:
    # A consumer process gave it back from behind a long step before its handler ran.
    task = submitted(flow(1))
    seq = task.active.seq
    task = decide(task, Started(seq, heartbeats=True), 200.0, HEARTBEATS).task
    d = decide(task, Released(seq), 201.0, HEARTBEATS)
    again = d.task.active
    assert (again.seq, again.cursor, again.type, again.attempt, again.phase) == (
        seq + 1, 0, StepType.NORMAL, 1, Phase.QUEUED
    )
    assert [(m.seq, m.cursor, m.attempt) for m in d.messages] == [(seq + 1, 0, 1)]
    assert d.task.status is TaskStatus.RUNNING  # a module did take it
    step = d.task.steps[0]
    assert (step.state, step.attempts, step.time_start) == (StepState.PENDING, 0, None)  # it never ran
    assert decide(d.task, Started(seq), 202.0).ignored  # the copy it held is stale
    restarted = decide(d.task, Started(seq + 1), 202.0).task
    assert restarted.steps[0].attempts == 1 and restarted.steps[0].time_start == 202.0


def test_only_a_running_attempt_can_be_given_back() -> None:
    task = submitted(flow(1))
    assert "while it is queued" in (decide(task, Released(task.active.seq), 201.0).ignored or "")


def test_a_cancelled_task_s_first_attempt_given_back_is_not_run_nor_compensated() -> None:
    task = run(submitted(flow(0, 0)), Succeeded)
    seq = task.active.seq
    task = decide(task, Started(seq), 201.0).task
    task = decide(task, Cancel(), 202.0).task  # running: its outcome would start the rollback
    d = decide(task, Released(seq), 203.0)
    # Its handler never ran: the compensation starts at the step before it.
    assert d.task.status is TaskStatus.ROLLING_BACK
    assert (d.task.steps[1].state, d.task.steps[1].attempts, d.task.steps[1].time_start) == (StepState.PENDING, 0, None)
    assert [(m.cursor, m.type) for m in d.messages] == [(0, StepType.ROLLBACK)]


def test_a_cancelled_task_s_retry_given_back_is_compensated_as_its_first_try_may_have_left_work() -> None:
    task = submitted(flow(1, 0))
    seq = task.active.seq
    task = decide(task, Started(seq), 200.0).task
    task = decide(task, Failed(seq, "boom"), 201.0).task
    if task.active.phase is Phase.WAITING:  # its backoff
        task = decide(task, Due(task.active.seq), task.active.due_at).task
    seq = task.active.seq
    task = decide(task, Started(seq), 300.0).task
    task = decide(task, Cancel(), 301.0).task
    d = decide(task, Released(seq), 302.0)
    assert d.task.steps[0].state is StepState.CANCELLED
    assert [(m.cursor, m.type) for m in d.messages] == [(0, StepType.ROLLBACK)]


def test_a_queued_attempt_held_unstarted_is_given_back_only_while_still_queued() -> None:
    task = submitted(flow(1))
    seq = task.active.seq
    d = decide(task, Released(seq, running=False), 201.0)
    assert [(m.seq, m.cursor, m.attempt) for m in d.messages] == [(seq + 1, 0, 1)]
    running = decide(task, Started(seq), 201.0).task  # another consumer took a copy of it first
    assert decide(running, Released(seq, running=False), 202.0).ignored  # not this holder's to give back


@pytest.mark.parametrize("releases", [1, 2])
def test_a_first_try_given_back_and_then_cancelled_is_not_compensated(releases: int) -> None:
    task = run(submitted(flow(0, 0)), Succeeded)
    for n in range(releases):
        seq = task.active.seq
        task = decide(task, Started(seq), 201.0 + n).task
        task = decide(task, Released(seq), 201.5 + n).task
    d = decide(task, Cancel(), 210.0)  # its new message still queued: compensated at once
    assert d.task.steps[1].state is StepState.PENDING
    assert [(m.cursor, m.type) for m in d.messages] == [(0, StepType.ROLLBACK)]
