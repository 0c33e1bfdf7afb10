"""Properties of the saga for any flow shape and any sequence of step outcomes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.flows import Action, Flow, StepDef
from shared.saga import (
    Cancel,
    Decision,
    Due,
    Event,
    Expire,
    Failed,
    Heartbeat,
    PollLater,
    Released,
    Requeue,
    Started,
    Submit,
    Succeeded,
    Timing,
)
from shared.saga import decide as saga_decide
from shared.states import STOPPED, Phase, StepState, StepType, TaskStatus
from shared.task import Task, new_task

flows = st.lists(
    st.tuples(st.integers(0, 2), st.booleans(), st.integers(0, 2)), min_size=1, max_size=6
).map(
    lambda specs: Flow(
        name="p",
        steps=tuple(
            StepDef(
                normal=Action(module="m", command=f"do{i}", retry=retry),
                rollback=Action(module="m", command=f"undo{i}", retry=rb_retry) if has_rb else None,
            )
            for i, (retry, has_rb, rb_retry) in enumerate(specs)
        ),
    )
)

OUTCOMES = ["ok", "fail", "timeout", "poll", "duplicate", "cancel", "requeue", "expire", "release"]


# Starts recorded before each attempt, or (one commit per step) mostly with the outcome.
# With heartbeats, a running attempt is renewed by its worker and expires when they stop.
TIMINGS = {
    "start-first": Timing(),
    "one-commit": Timing(start_recorded_within=16.0),
    "heartbeats": Timing(heartbeat_timeout=15.0),
}


@pytest.mark.parametrize("mode", list(TIMINGS))
@settings(max_examples=400, deadline=None)
@given(flow=flows, data=st.data())
def test_any_outcome_sequence_ends_stopped_with_exact_reverse_compensation(
    mode: str, flow: Flow, data: st.DataObject
) -> None:
    timing = TIMINGS[mode]
    one_commit = timing.start_recorded_within > 0

    def decide(task: Task, event: Event, now: float) -> Decision:
        return saga_decide(task, event, now, timing)

    now = 1000.0
    # A batch's tasks are stored with their first step waiting for the sweep.
    decision = decide(new_task("t", flow, {}, now), Submit(deferred=data.draw(st.booleans())), now)
    task = decision.task
    completed: list[int] = []  # normal steps that succeeded, in order
    failed_step: int | None = None
    compensated: list[int] = []  # rollbacks that succeeded, in order
    seen_seqs: list[int] = []
    ran: set[int] = set()  # normal steps whose handler ran at least once
    polls = 0

    for _ in range(500):
        if task.status in STOPPED:
            break
        active = task.active
        assert active is not None, "a running task always has an outstanding message"
        now += 1
        if active.phase is Phase.WAITING:
            task = decide(task, Due(active.seq), active.due_at or now).task
            continue
        outcome = data.draw(st.sampled_from(OUTCOMES))
        if outcome == "cancel":
            if task.status in (TaskStatus.PENDING, TaskStatus.RUNNING):
                task = decide(task, Cancel(), now).task
                if one_commit and active.phase is Phase.QUEUED and data.draw(st.booleans()):
                    # A consumer was already running it without a recorded start: its
                    # work is done, so its outcome must still lead to its compensation.
                    task = decide(task, Succeeded(active.seq, started_at=now - 0.5), now).task
                    completed.append(active.cursor)
                    ran.add(active.cursor)
                    seen_seqs.append(active.seq)
            continue
        if outcome == "duplicate" and seen_seqs:
            # A replay of an old message never changes anything.
            stale = decide(task, Started(data.draw(st.sampled_from(seen_seqs))), now)
            assert stale.ignored or stale.task.active.seq not in seen_seqs
            continue
        if outcome == "requeue":
            # The sweep re-publishes a queued message: same seq, still only one start.
            now = max(now, active.due_at)
            # Its module's queue may hold a backlog: the message is then left where it is.
            module = task.steps[active.cursor].action(active.type).module
            backlogged = data.draw(st.sampled_from([frozenset(), frozenset({module}), frozenset({"other"})]))
            requeued = decide(task, Requeue(active.seq, backlogged), now)
            if one_commit and task.cancel_requested and task.status is not TaskStatus.ROLLING_BACK:
                pass  # a cancelled step nobody started in time never ran; the rollback begins
            elif module in backlogged and active.held < timing.requeue_holds:
                held = replace(active, due_at=now + timing.requeue_after, held=active.held + 1)
                assert not requeued.messages and requeued.task.active == held
            else:
                assert [m.seq for m in requeued.messages] == [active.seq]
            task = requeued.task
            continue
        start: float | None = None
        if one_commit and outcome != "expire" and data.draw(st.booleans()):
            start = now - 0.5  # the outcome records the start too
        else:
            started = decide(task, Started(active.seq, heartbeats=timing.heartbeat_timeout > 0), now)
            assert not started.ignored and not started.messages
            task = started.task
            deadline = now + task.steps[active.cursor].action(active.type).timeout + timing.expire_grace
            for _ in range(data.draw(st.integers(0, 3)) if timing.heartbeat_timeout else 0):
                now += 5
                beat = decide(task, Heartbeat(active.seq, {"done": now}), now)
                # Renewed, never past its own deadline, nothing sent.
                assert not beat.ignored and not beat.messages
                assert beat.task.active.due_at == min(deadline, now + timing.heartbeat_timeout)
                task = beat.task
        seen_seqs.append(active.seq)
        if outcome == "release":
            # Given back before its handler ran, started or still queued: the same attempt, as a new message.
            running = start is None
            assert decide(task, Released(active.seq, running=not running), now).ignored  # not in that phase
            released = decide(task, Released(active.seq, running=running), now)
            assert not released.ignored
            if task.cancel_requested and active.type is StepType.NORMAL:
                assert released.task.status is TaskStatus.ROLLING_BACK or released.task.status in STOPPED
            else:
                again = released.task.active
                assert again is not None and again.phase is Phase.QUEUED
                assert (again.seq, again.cursor, again.type, again.attempt) == (
                    active.seq + 1, active.cursor, active.type, active.attempt
                )
                assert [m.seq for m in released.messages] == [again.seq]
            task = released.task
            continue
        if active.type is StepType.NORMAL:
            ran.add(active.cursor)  # its handler runs (or may have, if it expires)
        if outcome == "poll" and polls < 5:
            polls += 1
            task = decide(task, PollLater(active.seq, 2.0, started_at=start), now).task
            continue
        if outcome == "expire":
            now = max(now, task.active.due_at)
            result = decide(task, Expire(active.seq), now)
            if active.type is StepType.NORMAL and result.task.status is TaskStatus.ROLLING_BACK:
                failed_step = active.cursor
        elif outcome == "ok":
            result = decide(task, Succeeded(active.seq, {f"r{active.cursor}": 1}, started_at=start), now)
            if active.type is StepType.NORMAL:
                completed.append(active.cursor)
            else:
                compensated.append(active.cursor)
        else:
            result = decide(task, Failed(active.seq, "x", timed_out=outcome == "timeout", started_at=start), now)
            if active.type is StepType.NORMAL and result.task.status is TaskStatus.ROLLING_BACK:
                failed_step = active.cursor
        task = result.task
        # Late duplicate of the message just finished: ignored.
        assert decide(task, Succeeded(active.seq), now).ignored
        assert decide(task, Succeeded(active.seq, started_at=now), now).ignored

    assert task.status in STOPPED, f"not stopped after 500 events: {task.status}"
    assert task.active is None

    undo_candidates = completed + ([failed_step] if failed_step is not None else [])
    # A step cancelled between attempts (waiting for a retry or a poll) may have
    # left partial work, so it is compensated like a failed one.
    cancelled = {i for i, s in enumerate(task.steps) if s.state is StepState.CANCELLED}
    assert cancelled <= ran, f"steps {cancelled - ran} compensated though their handlers never ran"
    undo_candidates += sorted(cancelled)
    expected = [i for i in sorted(set(undo_candidates), reverse=True) if flow.steps[i].rollback]

    if task.status is TaskStatus.SUCCESS:
        assert completed == list(range(len(flow.steps))) and compensated == []
    elif task.status in (TaskStatus.FAILED, TaskStatus.CANCELLED):
        assert compensated == expected
    else:  # ROLLBACK_FAILED: compensation stopped part-way, in the same order
        assert compensated == expected[: len(compensated)]
        assert len(compensated) < len(expected)

    # Nothing is emitted once stopped: every step event is stale.
    for seq in seen_seqs + [task.seq + 1]:
        late_events: tuple[Event, ...] = (
            Started(seq), Succeeded(seq), Succeeded(seq, started_at=now), Failed(seq, "late", started_at=now),
            Failed(seq, "late"), Due(seq), Requeue(seq), Expire(seq), Heartbeat(seq), Released(seq),
        )
        for event in late_events:
            late = decide(task, event, now)
            assert late.ignored and not late.messages and late.task is task
