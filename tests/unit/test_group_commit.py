"""Several deliveries in flight in one consumer process, their transitions committed together
(shared.group_commit.GroupCommit), through the in-process harness.

What is stored must be what the same flows store when each delivery is handled alone,
one transition per commit; only the number of commits may differ.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import metrics
from shared.config import Settings
from shared.flows import load_flows
from shared.group_commit import FLUSH_AFTER, RELEASE_AFTER, Flight, GroupCommit
from shared.logs import AttemptFields, attempt_context, current_attempt
from shared.module import Module, StepContext
from shared.saga import Cancel, Heartbeat, Released, Started
from shared.states import Phase, TaskStatus
from shared.storage import InMemoryStore, StorageUnavailable
from shared.storage.base import Save
from shared.task import StepMessage
from shared.testing import Harness
from tests.support import testmod

FLOWS = load_flows(Path(__file__).resolve().parents[1] / "support" / "flows.yaml")
FAR = 1e9  # seconds: every step fits in its delivery


class CountingStore(InMemoryStore):
    """Records the size of each group of transitions written together; fails on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: list[int] = []
        self.unavailable = 0  # the next this many groups find the database down, and each of theirs alone
        self._down = False

    def save_many(self, saves: Sequence[Save]) -> list[bool]:
        self._down = self.unavailable > 0
        if self._down:
            self.unavailable -= 1
            raise StorageUnavailable("database down (test)")
        self.groups.append(len(saves))
        return super().save_many(saves)

    def save(self, task: Any, now: float, *args: Any, **kwargs: Any) -> bool:
        if self._down:
            raise StorageUnavailable("database down (test)")
        return super().save(task, now, *args, **kwargs)


def harness(modules: dict[str, Module] | None = None, **overrides: Any) -> Harness:
    modules = modules or {"alpha": testmod.alpha, "beta": testmod.beta}
    return Harness(FLOWS, modules, store=CountingStore(), settings=Settings(home=Path(".t"), **overrides))


def run_alone(h: Harness) -> None:
    """Each delivery handled alone, as a consumer process holding one at a time."""
    for _ in range(10_000):
        if h.publisher.messages:
            h.consumer.handle(h.publisher.messages.popleft(), continue_until=h.clock() + FAR)
        elif not h._release_due():
            return
    raise RuntimeError("flows did not settle")


def run_grouped(h: Harness, holding: int) -> list[tuple[Flight, BaseException | None]]:
    """Up to ``holding`` deliveries in flight, in rounds, as a consumer process with that prefetch."""
    ended: list[tuple[Flight, BaseException | None]] = []
    group = GroupCommit(h.consumer, lambda flight, exc: ended.append((flight, exc)))
    for _ in range(10_000):
        while h.publisher.messages and len(group) < holding:
            message = h.publisher.messages.popleft()
            group.start(message, message, continue_until=h.clock() + FAR)
        if group.work() or h.publisher.messages:
            continue
        assert not len(group), "a held delivery that no round moves on"
        if not h._release_due():
            return ended
    raise RuntimeError("flows did not settle")


def take(h: Harness, group: GroupCommit, count: int, runs_on: bool = True) -> None:
    """The next ``count`` messages published, each taken as a delivery (its own key).

    ``runs_on``: a delivery may run the flow's next steps itself.
    """
    for _ in range(count):
        message = h.publisher.messages.popleft()
        group.start(message, message, continue_until=h.clock() + FAR if runs_on else None)


def stories(h: Harness, task_ids: list[str]) -> list[tuple[Any, ...]]:
    """What each task ended as, and its attempt log, without times and ids."""
    told = []
    for task_id in task_ids:
        task = h.service.get(task_id)
        attempts = [(a.cursor, int(a.type), a.attempt, a.outcome, a.error) for a in h.service.attempts(task_id)]
        told.append((task.status, [s.state for s in task.steps], task.version, attempts))
    return told


def submit_all(h: Harness, submissions: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [h.service.submit(flow, parameters)[0].task_id for flow, parameters in submissions]


PARAMETERS = st.fixed_dictionaries(
    {},
    optional={
        "fail_at": st.lists(st.integers(0, 2), max_size=2),
        "fail_rollback_at": st.lists(st.integers(0, 2), max_size=1),
        "flaky": st.dictionaries(st.sampled_from(["0", "1", "2"]), st.integers(1, 2), max_size=2),
        "poll": st.dictionaries(st.sampled_from(["0", "1", "2"]), st.integers(1, 2), max_size=1),
    },
)
SUBMISSIONS = st.lists(st.tuples(st.sampled_from(["three", "noop", "short"]), PARAMETERS), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(submissions=SUBMISSIONS, holding=st.integers(2, 8), start_after=st.sampled_from([0.0, 1.0]))
def test_flows_held_together_store_what_each_alone_stores(
    submissions: list[tuple[str, dict[str, Any]]], holding: int, start_after: float
) -> None:
    """Successes, failures, retries, polls and rollbacks: the same tasks and attempt logs,
    with starts stored before the handlers run or with their outcomes."""
    alone = harness(record_start_after=start_after)
    alone_ids = submit_all(alone, submissions)
    run_alone(alone)

    grouped = harness(record_start_after=start_after)
    grouped_ids = submit_all(grouped, submissions)
    # No flush behind a handler, which a loaded host can make any of these take: it publishes a
    # next step instead of running it on, one write more (tested on its own below).
    with patch("shared.group_commit.FLUSH_AFTER", 3600.0):
        ended = run_grouped(grouped, holding)

    assert stories(grouped, grouped_ids) == stories(alone, alone_ids)
    assert all(exc is None for _, exc in ended)
    settled = {TaskStatus.SUCCESS, TaskStatus.FAILED, TaskStatus.ROLLBACK_FAILED}
    assert all(grouped.service.get(t).status in settled for t in grouped_ids)


def test_the_first_steps_of_flows_taken_together_start_in_one_commit_and_go_on_together() -> None:
    h = harness()
    task_ids = submit_all(h, [("noop", {})] * 4)
    run_grouped(h, holding=4)
    assert [h.service.get(t).status for t in task_ids] == [TaskStatus.SUCCESS] * 4
    store = h.store
    assert isinstance(store, CountingStore)
    # Four starts, then three rounds of four outcomes (each with the next step's start): 16 transitions.
    assert store.groups == [4, 4, 4, 4]


def test_a_start_the_database_refused_ends_its_delivery_with_the_error_and_nothing_runs() -> None:
    h = harness()
    (task_id,) = submit_all(h, [("noop", {})])
    store = h.store
    assert isinstance(store, CountingStore)
    store.unavailable = 1
    ended: list[tuple[Flight, BaseException | None]] = []
    group = GroupCommit(h.consumer, lambda flight, exc: ended.append((flight, exc)))
    message = h.publisher.messages.popleft()
    group.start("delivery", message)
    while len(group):
        group.work()
    ((flight, exc),) = ended
    assert flight.key == "delivery" and isinstance(exc, StorageUnavailable)
    assert h.service.attempts(task_id) == []  # nothing started, nothing ran: the message is tried again


def test_an_outcome_the_database_refused_is_stored_once_it_is_back_within_the_patience() -> None:
    h = harness(outcome_patience=60.0)
    (task_id,) = submit_all(h, [("noop", {})])
    store = h.store
    assert isinstance(store, CountingStore)
    group = GroupCommit(h.consumer, lambda flight, exc: None)
    message = h.publisher.messages.popleft()
    group.start("delivery", message, continue_until=h.clock() + FAR)
    group.work()  # the start, stored
    store.unavailable = 2
    slept: list[float] = []
    h.consumer.sleep = slept.append
    while len(group):
        group.work()
    assert len(slept) == 2  # a pause after each refusal
    assert h.service.get(task_id).status is TaskStatus.SUCCESS
    assert [a.outcome for a in h.service.attempts(task_id)] == ["succeeded"] * 3


def test_an_outcome_refused_past_the_patience_is_left_to_the_expiry_sweep() -> None:
    h = harness(outcome_patience=5.0)
    (task_id,) = submit_all(h, [("noop", {})])
    store = h.store
    assert isinstance(store, CountingStore)
    group = GroupCommit(h.consumer, lambda flight, exc: None)
    group.start("delivery", h.publisher.messages.popleft(), continue_until=h.clock() + FAR)
    group.work()  # the start, stored
    store.unavailable = 1_000

    def sleep(seconds: float) -> None:
        h.clock.now += 3.0

    h.consumer.sleep = sleep
    while len(group):
        group.work()
    attempts = h.service.attempts(task_id)
    assert [(a.cursor, a.outcome) for a in attempts] == [(0, None)]  # still running: the sweep expires it


def behind_a_long_handler(runs_on: bool) -> tuple[Harness, str, str, list[bool], float]:
    """Two ``short`` flows held together, driven to their end; the second's first handler runs
    until the first's outcome is committed, or for 5 s.

    Returns the harness, both task ids, whether the long handler saw that commit, and how long
    the rounds took. ``runs_on``: a delivery may run the flow's next step itself.
    """
    h = harness({"alpha": Module("alpha"), "beta": Module("beta")})
    committed = threading.Event()
    seen: list[bool] = []

    @h.consumer.modules["alpha"].command("step")
    def step(ctx: StepContext) -> None:
        if ctx.parameters.get("long"):
            seen.append(committed.wait(5.0))

    @h.consumer.modules["beta"].command("step")
    def other(ctx: StepContext) -> None:
        return None

    quick, slow = submit_all(h, [("short", {}), ("short", {"long": True})])
    store = h.store
    assert isinstance(store, CountingStore)
    original = store.save_many

    def save_many(saves: Sequence[Save]) -> list[bool]:
        written = original(saves)
        if any(s.task.task_id == quick and s.attempt is not None and s.attempt.outcome for s in saves):
            committed.set()
        return written

    store.save_many = save_many  # type: ignore[method-assign]
    group = GroupCommit(h.consumer, lambda flight, exc: None)
    take(h, group, 2, runs_on)
    started = time.monotonic()
    while len(group):
        group.work()
    return h, quick, slow, seen, time.monotonic() - started


def test_an_outcome_does_not_wait_behind_a_long_handler_of_another_delivery() -> None:
    """The pulse thread commits what waits once another delivery's handler runs past FLUSH_AFTER."""
    _, _, _, seen_stored, took = behind_a_long_handler(runs_on=False)
    # The quick flow's outcome, finished before the long handler began, was committed meanwhile.
    assert seen_stored == [True]
    assert took < 2.0 + FLUSH_AFTER


def test_each_delivery_runs_in_its_own_logging_context() -> None:
    """A delivery's fields (task, step) go with it across its pauses, not onto the delivery resumed next."""
    h = harness({"alpha": Module("alpha"), "beta": testmod.beta})
    seen: list[tuple[str, str | None]] = []

    @h.consumer.modules["alpha"].command("step")
    def step(ctx: StepContext) -> None:
        fields = current_attempt()
        seen.append((ctx.task_id, fields.task_id if fields is not None else None))

    submit_all(h, [("noop", {})] * 3)
    group = GroupCommit(h.consumer, lambda flight, exc: None)
    for _ in range(3):
        message = h.publisher.messages.popleft()
        with attempt_context(AttemptFields.of(message)):  # as the consumer process takes a delivery
            group.start(message, message, continue_until=h.clock() + FAR)
    assert current_attempt() is None
    while len(group):
        group.work()
        assert current_attempt() is None
    assert len(seen) == 6
    assert all(task_id == logged for task_id, logged in seen), seen


def test_a_delivery_that_runs_on_tells_who_notes_the_steps_held() -> None:
    h = harness()
    submit_all(h, [("noop", {})] * 2)
    noted: list[list[StepMessage]] = []
    group = GroupCommit(h.consumer, lambda flight, exc: None, lambda flights: noted.append([f.message for f in flights]))
    take(h, group, 2)
    while len(group):
        group.work()
    cursors = [[m.cursor for m in held] for held in noted]
    assert cursors[:2] == [[0], [0, 0]]  # each delivery, as it is taken
    assert [1, 0] in cursors or [0, 1] in cursors  # one ran on to its next step, the other waited
    assert cursors[-1] == []  # none held at the end


@pytest.mark.parametrize("holding", [2, 5])
def test_a_cancelled_task_s_queued_step_does_not_run_when_held_with_others(holding: int) -> None:
    h = harness()
    cancelled, other = submit_all(h, [("three", {}), ("three", {})])
    h.service.operate(cancelled, Cancel())
    run_grouped(h, holding)
    assert h.service.get(cancelled).status is TaskStatus.CANCELLED
    assert h.service.get(other).status is TaskStatus.SUCCESS


def test_a_group_the_store_refuses_goes_on_change_by_change_and_only_the_bad_one_fails() -> None:
    h = harness()
    good, bad, other = submit_all(h, [("noop", {})] * 3)
    store = h.store
    assert isinstance(store, CountingStore)
    original_many, original_one = store.save_many, store.save

    def save_many(saves: Sequence[Save]) -> list[bool]:
        if any(s.task.task_id == bad for s in saves):
            raise TypeError("a value the database cannot take (test)")
        return original_many(saves)

    def save(task: Any, now: float, *args: Any, **kwargs: Any) -> bool:
        if task.task_id == bad:
            raise TypeError("a value the database cannot take (test)")
        return original_one(task, now, *args, **kwargs)

    store.save_many = save_many  # type: ignore[method-assign]
    store.save = save  # type: ignore[method-assign]
    ended: list[tuple[Flight, BaseException | None]] = []
    group = GroupCommit(h.consumer, lambda flight, exc: ended.append((flight, exc)))
    while h.publisher.messages:
        message = h.publisher.messages.popleft()
        group.start(message, message, continue_until=h.clock() + FAR)
    while len(group):
        group.work()
    assert h.service.get(good).status is TaskStatus.SUCCESS and h.service.get(other).status is TaskStatus.SUCCESS
    failures = [(flight.message.task_id, type(exc)) for flight, exc in ended if exc is not None]
    assert failures == [(bad, TypeError)]  # its delivery ends with the error, as a lone consumer's would


def test_outcomes_committed_behind_a_long_handler_have_their_next_steps_published() -> None:
    """Run here, a next step would wait for the long handler with its start stored and no pulse."""
    h, quick, slow, seen_stored, _ = behind_a_long_handler(runs_on=True)
    assert seen_stored == [True]
    published = [(m.task_id, m.cursor) for m in h.publisher.messages]
    assert published == [(quick, 1)]  # not run on here; the slow flow's step 1 ran on after its handler
    assert h.service.get(slow).status is TaskStatus.SUCCESS


def heartbeats_counted(h: Harness, task_ids: list[str], seq: int, enough: int = 3) -> threading.Event:
    """Set once each of ``task_ids`` has had ``enough`` heartbeats stored for its attempt ``seq``."""
    beats = dict.fromkeys(task_ids, 0)
    beaten = threading.Event()
    apply = h.service.apply

    def counting(task_id: str, event: Any, *args: Any, **kwargs: Any) -> Any:
        decision = apply(task_id, event, *args, **kwargs)
        if isinstance(event, Heartbeat) and event.seq == seq and task_id in beats and not decision.ignored:
            beats[task_id] += 1
            if min(beats.values()) >= enough:
                beaten.set()
        return decision

    h.service.apply = counting  # type: ignore[method-assign]
    return beaten


def long_and_quick_steps(h: Harness, long_step: int, beaten: threading.Event, ran: list[str]) -> None:
    """``short``'s two steps; a task with ``long`` in its parameters works at ``long_step`` until ``beaten``."""

    def handler(step: int) -> Any:
        def run(ctx: StepContext) -> None:
            ran.append(ctx.task_id)
            if ctx.parameters.get("long") and step == long_step:
                beaten.wait(5.0)

        return run

    h.consumer.modules["alpha"].command("step")(handler(0))
    h.consumer.modules["beta"].command("step")(handler(1))


@pytest.mark.parametrize("long_step", [0, 1])
def test_a_held_delivery_whose_start_is_stored_sends_heartbeats_while_it_waits_its_turn(long_step: int) -> None:
    """Its task shows it running: without heartbeats the sweep would take it for lost and run it again.

    Until it is given back (here never: the flush behind a long handler is off, as when the
    database refuses it). ``long_step`` 0: both starts were stored in one commit, then the
    first delivery's handler runs long. 1: both outcomes of step 0 started step 1 here in one
    commit, then the first delivery's step 1 runs long.
    """
    h = harness({"alpha": Module("alpha"), "beta": Module("beta")}, heartbeat_interval=0.05)
    ran: list[str] = []
    slow, waiting = submit_all(h, [("short", {"long": True}), ("short", {})])
    beaten = heartbeats_counted(h, [waiting], seq=long_step + 1)  # the waiting one's attempt of that step
    long_and_quick_steps(h, long_step, beaten, ran)
    group = GroupCommit(h.consumer, lambda flight, exc: None)
    take(h, group, 2)
    with patch("shared.group_commit.FLUSH_AFTER", 3600.0):
        while len(group):
            group.work()

    # The long handler returned once they came: they were sent while the other waited its turn.
    assert beaten.is_set(), "no heartbeats for the delivery waiting behind the long handler"
    assert ran.index(waiting, long_step * 2) > ran.index(slow, long_step * 2)
    assert [h.service.get(t).status for t in (slow, waiting)] == [TaskStatus.SUCCESS] * 2


def test_a_step_kept_after_a_step_run_on_is_handed_on_in_its_own_logging_context() -> None:
    """Three-step flows: the step handed on follows a step run on to, whose logging context
    its delivery is paused in; ending it there must not disturb the thread's own."""
    h = harness({"alpha": Module("alpha"), "beta": Module("beta")}, record_start_after=1.0)
    first, second, taken = submit_all(h, [("noop", {}), ("noop", {}), ("short", {"long": True})])

    @h.consumer.modules["alpha"].command("step")
    def step(ctx: StepContext) -> None:
        deadline = time.monotonic() + 5.0
        while ctx.parameters.get("long") and len(h.publisher.messages) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)

    h.consumer.modules["beta"].command("step")(lambda ctx: None)
    group = GroupCommit(h.consumer, lambda flight, exc: None)
    take(h, group, 2)
    group.work()  # step 0's outcomes, step 1 kept here
    group.work()  # step 1 run on to, its outcomes, step 2 kept here
    take(h, group, 1)  # its step 0 runs now, long: both steps 2 are handed on
    while len(group):
        group.work()
    assert sorted((m.task_id, m.cursor) for m in h.publisher.messages) == sorted([(first, 2), (second, 2)])
    assert current_attempt() is None
    take(h, group, 2)
    while len(group):
        group.work()
    assert [h.service.get(t).status for t in (first, second, taken)] == [TaskStatus.SUCCESS] * 3


def test_with_starts_written_with_outcomes_next_steps_kept_here_are_handed_on_behind_a_long_handler() -> None:
    """A commit keeps the next steps of two flows to run here, their starts not stored (to be
    written with their outcomes); a delivery taken next runs long: both are published for other
    consumers while it runs, and end here without running."""
    h = harness({"alpha": Module("alpha"), "beta": Module("beta")}, record_start_after=1.0)
    ran: list[tuple[str, int]] = []
    first, second, taken = submit_all(h, [("short", {}), ("short", {}), ("short", {"long": True})])

    def handler(step: int) -> Any:
        def run(ctx: StepContext) -> None:
            ran.append((ctx.task_id, step))
            if ctx.parameters.get("long") and step == 0:
                deadline = time.monotonic() + 5.0
                while len(h.publisher.messages) < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)

        return run

    h.consumer.modules["alpha"].command("step")(handler(0))
    h.consumer.modules["beta"].command("step")(handler(1))
    group = GroupCommit(h.consumer, lambda flight, exc: None)
    take(h, group, 2)
    group.work()  # their outcomes, each keeping step 1 here, still queued
    assert [h.service.get(t).active.phase for t in (first, second)] == [Phase.QUEUED] * 2  # type: ignore[union-attr]
    assert [(m.task_id, m.cursor) for m in h.publisher.messages] == [(taken, 0)], "kept here, not published"
    take(h, group, 1)  # its step 0 runs now, long
    while len(group):
        group.work()
    assert sorted((m.task_id, m.cursor) for m in h.publisher.messages) == sorted([(first, 1), (second, 1)])
    assert (first, 1) not in ran and (second, 1) not in ran
    take(h, group, 2)
    while len(group):
        group.work()

    assert [h.service.get(t).status for t in (first, second, taken)] == [TaskStatus.SUCCESS] * 3
    assert sorted(ran) == sorted((t, step) for t in (first, second, taken) for step in (0, 1))


def published_for(h: Harness, task_id: str, cursor: int, within: float = 5.0) -> bool:
    """Waits until a message for ``task_id``'s step ``cursor`` is published; whether it was."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if any((m.task_id, m.cursor) == (task_id, cursor) for m in list(h.publisher.messages)):
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("long_step", [0, 1])
def test_a_held_delivery_whose_start_is_stored_is_given_back_behind_a_long_handler(long_step: int) -> None:
    """Its start was stored with the long one's (``long_step`` 0), or with the outcome of the
    step before it (1): the same attempt goes out as a new message for another consumer, and
    its delivery ends here without running it."""
    h = harness({"alpha": Module("alpha"), "beta": Module("beta")})
    ran: list[tuple[str, int]] = []
    slow, waiting = submit_all(h, [("short", {"long": True}), ("short", {})])
    seen: list[bool] = []

    def handler(step: int) -> Any:
        def run(ctx: StepContext) -> None:
            ran.append((ctx.task_id, step))
            if ctx.parameters.get("long") and step == long_step:
                seen.append(published_for(h, waiting, long_step))

        return run

    h.consumer.modules["alpha"].command("step")(handler(0))
    h.consumer.modules["beta"].command("step")(handler(1))
    group = GroupCommit(h.consumer, lambda flight, exc: None)
    take(h, group, 2)
    while len(group):
        group.work()

    assert seen == [True], "not handed on while the long handler ran"
    assert (waiting, long_step) not in ran
    [again] = [m for m in h.publisher.messages if m.task_id == waiting]
    log = [(a.seq, a.cursor, a.attempt, a.outcome) for a in h.service.attempts(waiting)]
    assert log[-1] == (again.seq - 1, long_step, 1, "released")  # its attempt, given back before it ran
    assert (again.cursor, again.attempt) == (long_step, 1)
    take(h, group, 1)  # another consumer's, say
    while len(group):
        group.work()
    task = h.service.get(waiting)
    assert task.status is TaskStatus.SUCCESS and task.steps[long_step].attempts == 1  # not a try of its own
    assert h.service.get(slow).status is TaskStatus.SUCCESS


def test_a_delivery_whose_start_waits_for_its_commit_is_given_back_behind_a_long_handler() -> None:
    """Taken while another delivery's start was committed: the other's handler runs long before
    the round commits this start. It is given back still queued: its attempt goes out as a new
    message (the one held here stale), with nothing in the attempt log, and the delivery ends
    here without running it."""
    h = harness({"alpha": Module("alpha"), "beta": testmod.beta})
    ran: list[tuple[str, int]] = []
    slow, waiting = submit_all(h, [("noop", {"long": True}), ("noop", {})])
    seen: list[bool] = []

    @h.consumer.modules["alpha"].command("step")
    def step(ctx: StepContext) -> None:
        ran.append((ctx.task_id, ctx.cursor))
        if ctx.parameters.get("long") and ctx.cursor == 0:
            seen.append(published_for(h, waiting, 0))

    ended: list[str] = []
    group = GroupCommit(h.consumer, lambda flight, exc: ended.append(flight.message.task_id))
    take(h, group, 1)
    group.work()  # its start, committed
    held = h.publisher.messages[0]
    take(h, group, 1)  # this start waits for the round's commit, after the long handler
    while len(group):
        group.work()

    assert seen == [True] and (waiting, 0) not in ran and sorted(ended) == sorted([slow, waiting])
    [again] = list(h.publisher.messages)
    assert (again.task_id, again.seq, again.attempt) == (held.task_id, held.seq + 1, held.attempt)
    assert h.service.attempts(waiting) == []
    take(h, group, 1)
    while len(group):
        group.work()
    assert [h.service.get(t).status for t in (slow, waiting)] == [TaskStatus.SUCCESS] * 2


def two_started(h: Harness, ran: list[str], ended: list[str]) -> tuple[GroupCommit, str, str]:
    """Two ``noop`` flows held, their starts committed: their handlers run next round."""
    first, second = submit_all(h, [("noop", {}), ("noop", {})])
    h.consumer.modules["alpha"].command("step")(lambda ctx: ran.append(ctx.task_id))
    group = GroupCommit(h.consumer, lambda flight, exc: ended.append(flight.message.task_id))
    take(h, group, 2)
    group.work()
    return group, first, second


def test_held_deliveries_are_given_back_behind_a_long_alarm_command() -> None:
    """An alarm's command runs on the rounds' thread between deliveries (a monitor that does not
    answer, say): the deliveries whose starts are stored go out for another consumer, as behind
    a long handler, and end here without running."""
    h = harness({"alpha": Module("alpha"), "beta": testmod.beta})
    ran: list[str] = []
    ended: list[str] = []
    group, first, second = two_started(h, ran, ended)
    seen: list[bool] = []
    group.beside(lambda: seen.append(published_for(h, first, 0) and published_for(h, second, 0)))
    while len(group):
        group.work()

    assert seen == [True], "not handed on while the alarm's command ran"
    assert ran == [] and sorted(ended) == sorted([first, second])
    take(h, group, 2)  # another consumer's, say
    while len(group):
        group.work()
    assert [h.service.get(t).status for t in (first, second)] == [TaskStatus.SUCCESS] * 2


def test_an_alarm_command_shorter_than_release_after_gives_back_nothing_after_a_long_round() -> None:
    """Timed from its own start: the round before it, which ran most of RELEASE_AFTER, does not count."""
    h = harness({"alpha": Module("alpha"), "beta": testmod.beta})
    ran: list[str] = []
    group, first, second = two_started(h, ran, [])
    group._began -= RELEASE_AFTER * 0.95  # as after a round of handlers that long
    group.beside(lambda: time.sleep(FLUSH_AFTER * 4))
    while len(group):
        group.work()
    assert not h.publisher.messages and set(ran) == {first, second}  # nothing given back: both ran here
    assert [h.service.get(t).status for t in (first, second)] == [TaskStatus.SUCCESS] * 2


@pytest.mark.parametrize("failure", ["raised", "unavailable"])
def test_a_held_delivery_that_could_not_be_given_back_runs_here_after_the_long_handler(failure: str) -> None:
    """The commit that would give it back fails (a defect, or the database down): nothing is lost,
    it runs here once the long handler ends, as before there was a give-back."""
    h = harness({"alpha": Module("alpha"), "beta": testmod.beta})
    slow, waiting = submit_all(h, [("short", {"long": True}), ("short", {})])
    tried = threading.Event()
    apply_many = h.service.apply_many

    def failing(changes: Sequence[Any]) -> list[Any]:
        if any(isinstance(c.event, Released) for c in changes):
            tried.set()
            if failure == "raised":
                raise RuntimeError("a defect (test)")
            return [StorageUnavailable("database down (test)")] * len(changes)
        return apply_many(changes)

    h.service.apply_many = failing  # type: ignore[method-assign]

    @h.consumer.modules["alpha"].command("step")
    def step(ctx: StepContext) -> None:
        if ctx.parameters.get("long"):
            tried.wait(5.0)

    group = GroupCommit(h.consumer, lambda flight, exc: None)
    take(h, group, 2)
    while len(group):
        group.work()

    assert tried.is_set()
    assert [h.service.get(t).status for t in (slow, waiting)] == [TaskStatus.SUCCESS] * 2
    assert [a.outcome for a in h.service.attempts(waiting)] == ["succeeded", "succeeded"]
    assert not h.publisher.messages  # nothing went out for another consumer


def test_a_retry_is_counted_once_however_often_its_message_goes_out() -> None:
    """Counted when the try is dispatched: not again when published after its backoff, requeued
    by the sweep, or given back."""
    h = harness()
    retries = metrics.RETRIES.labels("alpha", "step")
    before = retries._value.get()
    (task_id,) = submit_all(h, [("short", {"flaky": {"0": 1}})])
    h.consumer.handle(h.publisher.messages.popleft())  # fails: its retry waits out its backoff
    assert retries._value.get() == before + 1
    h._release_due()  # published once due
    h._release_due()  # not started by its requeue time: published again
    assert [m.attempt for m in h.publisher.messages] == [2, 2]
    message = h.publisher.messages.popleft()
    h.service.apply(task_id, Started(message.seq))
    h.service.apply(task_id, Released(message.seq))  # given back: the same try, as a new message
    h.publisher.messages.clear()
    run_alone(h)
    assert h.service.get(task_id).status is TaskStatus.SUCCESS
    assert retries._value.get() == before + 1


def test_next_steps_kept_here_end_here_even_when_publishing_them_fails() -> None:
    """Behind a long handler, a kept next step whose publish raises still ends its delivery here
    (else the process could not stop); the requeue sweep publishes it."""
    h = harness({"alpha": Module("alpha"), "beta": testmod.beta}, record_start_after=1.0)
    first, taken = submit_all(h, [("short", {}), ("short", {"long": True})])
    publish, tried = h.service.publish, threading.Event()

    def failing(messages: Sequence[StepMessage]) -> None:
        tried.set()
        raise RuntimeError("the broker is gone (test)")

    @h.consumer.modules["alpha"].command("step")
    def step(ctx: StepContext) -> None:
        if ctx.parameters.get("long") and ctx.cursor == 0:
            h.service.publish = failing  # type: ignore[method-assign]
            tried.wait(5.0)
            h.service.publish = publish  # type: ignore[method-assign]

    group = GroupCommit(h.consumer, lambda flight, exc: None)
    take(h, group, 1)
    group.work()  # its outcome: step 1 kept here, queued
    take(h, group, 1)  # its step 0 runs long
    while len(group):
        group.work()
    assert tried.is_set()
    assert h.service.get(first).active.phase is Phase.QUEUED  # type: ignore[union-attr]  # not run here
    run_alone(h)
    assert [h.service.get(t).status for t in (first, taken)] == [TaskStatus.SUCCESS] * 2


def test_a_handler_shorter_than_release_after_gives_back_nothing_it_holds() -> None:
    """A step of a few hundred milliseconds: the start held behind it waits its turn rather than
    going round again (a commit and a delivery more)."""
    h = harness({"alpha": Module("alpha"), "beta": testmod.beta})
    slow, waiting = submit_all(h, [("short", {"long": True}), ("short", {})])

    assert FLUSH_AFTER < 0.3 < RELEASE_AFTER

    @h.consumer.modules["alpha"].command("step")
    def step(ctx: StepContext) -> None:
        if ctx.parameters.get("long") and ctx.cursor == 0:
            time.sleep(0.3)

    group = GroupCommit(h.consumer, lambda flight, exc: None)
    take(h, group, 2)
    while len(group):
        group.work()
    assert not h.publisher.messages
    assert [a.outcome for a in h.service.attempts(waiting)] == ["succeeded", "succeeded"]
    assert [h.service.get(t).status for t in (slow, waiting)] == [TaskStatus.SUCCESS] * 2


def test_a_start_held_behind_several_handlers_waits_no_longer_than_release_after() -> None:
    """Two handlers of most of a second each, one after the other in a round: the start held
    behind both is given back once the round has run RELEASE_AFTER, though neither alone has."""
    h = harness({"alpha": Module("alpha"), "beta": testmod.beta})
    first, second, third = submit_all(h, [("short", {"long": True}), ("short", {"long": True}), ("short", {})])
    assert 0.6 < RELEASE_AFTER < 1.2

    @h.consumer.modules["alpha"].command("step")
    def step(ctx: StepContext) -> None:
        if ctx.parameters.get("long") and ctx.cursor == 0:
            time.sleep(0.6)

    group = GroupCommit(h.consumer, lambda flight, exc: None)
    take(h, group, 3, runs_on=False)
    while len(group):
        group.work()
    assert [a.outcome for a in h.service.attempts(third)] == ["released"]
    assert [(m.task_id, m.cursor) for m in h.publisher.messages if m.task_id == third] == [(third, 0)]
