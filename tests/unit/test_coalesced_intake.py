"""Concurrent submits and create_task calls stored together (oss_api.coalesce), each answered as if alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from oss_api.coalesce import Coalescer
from shared import metrics
from shared.flows import Action, Flow, FlowSet, StepDef
from shared.parameters import InvalidParameters
from shared.pull.rules import TaskType
from shared.pull.service import NewPullTask, PullService, UnknownTaskType
from shared.service import Submission, TaskService, UnknownFlow
from shared.storage import InMemoryPullStore, InMemoryStore, StorageUnavailable, TaskConflict
from shared.testing.clock import ManualClock
from shared.testing.fakes import QueuePublisher

# --- the coalescer -----------------------------------------------------------------------------


class Recorder:
    """A store function that records its batches; the first one waits until released."""

    def __init__(self, answer: Any = None) -> None:
        self.batches: list[list[Any]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.answer = answer or (lambda item: item * 10)

    def __call__(self, batch: Sequence[Any]) -> list[Any]:
        self.batches.append(list(batch))
        self.entered.set()
        if len(self.batches) == 1:
            assert self.release.wait(10)
        return [self.answer(item) for item in batch]


async def wait_until(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.001)


async def queued_behind(coalescer: Coalescer[int, Any], store: Recorder, first: int, rest: Sequence[int]) -> list[Any]:
    """The answers of ``first``, stored alone while ``rest`` arrive and wait, then of ``rest``."""
    head = asyncio.create_task(coalescer(first))
    await wait_until(store.entered)
    tail = [asyncio.create_task(coalescer(n)) for n in rest]
    await asyncio.sleep(0.01)  # all of them are waiting now
    store.release.set()
    return await asyncio.gather(head, *tail, return_exceptions=True)


def test_a_call_alone_is_stored_at_once_in_a_batch_of_one() -> None:
    store = Recorder()
    store.release.set()

    async def main() -> list[int]:
        coalescer = Coalescer("test", store, 10)
        return [await coalescer(1), await coalescer(2)]

    assert asyncio.run(main()) == [10, 20]
    assert store.batches == [[1], [2]]


def test_calls_that_arrive_while_a_batch_is_stored_go_together_in_the_next() -> None:
    store = Recorder()
    sizes = metrics.INTAKE_BATCH.labels("together")
    counted = sizes._sum.get()  # type: ignore[attr-defined]

    assert asyncio.run(queued_behind(Coalescer("together", store, 10), store, 1, (2, 3, 4))) == [10, 20, 30, 40]
    assert store.batches == [[1], [2, 3, 4]]
    assert sizes._sum.get() - counted == 4  # type: ignore[attr-defined]


def test_a_batch_holds_at_most_most_calls() -> None:
    store = Recorder()

    asyncio.run(queued_behind(Coalescer("test", store, 2), store, 0, range(1, 6)))
    assert store.batches == [[0], [1, 2], [3, 4], [5]]


def test_each_caller_gets_its_own_answer_or_error() -> None:
    def answer(item: int) -> Any:
        return ValueError(f"bad {item}") if item % 2 else item

    store = Recorder(answer)

    answers = asyncio.run(queued_behind(Coalescer("test", store, 10), store, 0, (1, 2, 3)))
    assert answers[0] == 0 and answers[2] == 2
    assert [str(a) for a in (answers[1], answers[3])] == ["bad 1", "bad 3"]


def test_an_error_of_the_whole_batch_reaches_each_caller_and_the_next_batch_runs() -> None:
    calls: list[list[int]] = []

    def store(batch: Sequence[int]) -> list[int]:
        calls.append(list(batch))
        if len(calls) == 1:
            raise ConnectionError("database down")
        return list(batch)

    async def main() -> tuple[Any, int]:
        coalescer = Coalescer("test", store, 10)
        failed = await asyncio.gather(coalescer(1), return_exceptions=True)
        return failed[0], await coalescer(2)

    failed, answer = asyncio.run(main())
    assert isinstance(failed, ConnectionError) and answer == 2


def test_a_store_that_answers_the_wrong_number_fails_the_batch_instead_of_leaving_callers_waiting() -> None:
    async def main() -> Any:
        coalescer: Coalescer[int, int] = Coalescer("test", lambda batch: [], 10)
        return await asyncio.wait_for(asyncio.gather(coalescer(1), return_exceptions=True), 5)

    [failed] = asyncio.run(main())
    assert isinstance(failed, RuntimeError) and "1 items stored, 0 answered" in str(failed)


def test_a_caller_that_went_away_does_not_stop_the_others() -> None:
    store = Recorder()

    async def main() -> int:
        coalescer = Coalescer("test", store, 10)
        first = asyncio.create_task(coalescer(1))
        await wait_until(store.entered)
        gone = asyncio.create_task(coalescer(2))
        stays = asyncio.create_task(coalescer(3))
        await asyncio.sleep(0.01)
        gone.cancel()
        store.release.set()
        await first
        return await stays

    assert asyncio.run(main()) == 30
    assert store.batches == [[1], [2, 3]]  # stored anyway, as a request cut off mid-call may be


# --- the services: each answered as it would be alone ------------------------------------------

FLOW = Flow(
    name="f",
    steps=(StepDef(normal=Action(module="m", command="do")),),
    parameters={"type": "object", "properties": {"Cpu": {"type": "integer"}}, "required": ["Cpu"]},
)
OTHER = Flow(name="g", steps=(StepDef(normal=Action(module="m", command="do")),))


def task_service() -> tuple[TaskService, QueuePublisher]:
    publisher = QueuePublisher()
    flows = FlowSet({"f": FLOW, "g": OTHER}, {}, "test")
    return TaskService(InMemoryStore(), publisher, flows, clock=ManualClock(50.0)), publisher


def test_submit_each_answers_every_submission_as_alone_and_publishes_the_new_ones() -> None:
    svc, publisher = task_service()
    svc.submit("f", {"Cpu": 1}, user_id="alice", task_id="taken")
    publisher.messages.clear()
    answers = svc.submit_each(
        [
            Submission("f", {"Cpu": 2}, user_id="alice", task_id="a"),
            Submission("nope", {}, task_id="b"),  # unknown flow
            Submission("f", {"Cpu": "x"}, task_id="c"),  # invalid parameters
            Submission("f", {"Cpu": 3}, user_id="bob", task_id="taken"),  # another user's id
            Submission("f", {"Cpu": 1}, user_id="alice", task_id="taken"),  # a replay
            Submission("g", {}, user_id="alice", task_id="a"),  # the first one's id, another flow
            Submission("f", {"Cpu": 2}, user_id="alice", task_id="a"),  # the first one again
            Submission("g", {}),  # no id: a new one
        ]
    )
    new_a, created_a = answers[0]  # type: ignore[misc]
    assert created_a and new_a.task_id == "a" and new_a.parameters == {"Cpu": 2}
    assert isinstance(answers[1], UnknownFlow)
    assert isinstance(answers[2], InvalidParameters)
    assert isinstance(answers[3], TaskConflict)
    assert answers[4] == (svc.get("taken"), False)
    assert isinstance(answers[5], TaskConflict)
    assert answers[6] == (svc.get("a"), False)
    new_g, created_g = answers[7]  # type: ignore[misc]
    assert created_g and new_g.flow == "g"
    # Only the two new tasks' first steps are published.
    assert sorted(m.task_id for m in publisher.messages) == sorted(["a", new_g.task_id])


def test_submit_each_of_a_refused_first_lets_a_later_one_with_its_id_be_created() -> None:
    svc, _ = task_service()
    answers = svc.submit_each([Submission("f", {}, task_id="x"), Submission("f", {"Cpu": 1}, task_id="x")])
    assert isinstance(answers[0], InvalidParameters)
    assert answers[1][1] is True  # type: ignore[index]


def test_create_each_answers_every_task_as_alone() -> None:
    store = InMemoryPullStore()
    store.save_type(TaskType(task_type="video", max_retry_num=7), 1.0)
    svc = PullService(store, clock=ManualClock(50.0))
    svc.create("video", "{}", user_id="u", task_id="taken")
    answers = svc.create_each(
        [
            NewPullTask("video", "{}", "u", task_id="a"),
            NewPullTask("unknown", "{}", "u", task_id="b"),
            NewPullTask("video", "{}", "other", task_id="taken"),
            NewPullTask("video", "{}", "u", task_id="taken"),
            NewPullTask("video", "{}", "u", task_id="a"),
        ]
    )
    created, new = answers[0]  # type: ignore[misc]
    assert new and created.task_id == "a" and created.max_retry_num == 7  # the type's settings
    assert isinstance(answers[1], UnknownTaskType)
    assert isinstance(answers[2], TaskConflict)
    assert answers[3] == (svc.get("taken"), False)
    assert answers[4] == (svc.get("a"), False)


def test_a_repeated_id_whose_later_transaction_fails_leaves_the_committed_ones_answered() -> None:
    # The first transaction committed: its tasks are stored and must be answered (and published) as such.
    svc, publisher = task_service()
    store = svc.store
    calls = []

    def create_many(tasks: Any, now: float, each: bool = False) -> Any:
        calls.append([t.task_id for t in tasks])
        if len(calls) > 1:
            raise StorageUnavailable("database unavailable: gone")
        return InMemoryStore.create_many(store, tasks, now, each)  # type: ignore[arg-type]

    store.create_many = create_many  # type: ignore[method-assign]
    answers = svc.submit_each([Submission("g", {}, task_id="a"), Submission("g", {}, task_id="a"), Submission("g", {})])
    assert len(calls) == 2 and calls[1] == ["a"]
    assert answers[0][1] is True and answers[2][1] is True  # type: ignore[index]
    assert isinstance(answers[1], StorageUnavailable)
    assert sorted(m.task_id for m in publisher.messages) == sorted(["a", answers[2][0].task_id])  # type: ignore[index]


def test_the_first_transactions_error_is_every_submissions() -> None:
    svc, publisher = task_service()

    def down(tasks: Any, now: float, each: bool = False) -> Any:
        raise StorageUnavailable("database unavailable: gone")

    svc.store.create_many = down  # type: ignore[method-assign]
    with pytest.raises(StorageUnavailable):
        svc.submit_each([Submission("g", {}, task_id="a"), Submission("g", {}, task_id="a")])
    assert not publisher.messages


def pull_service() -> PullService:
    """Types video (two tasks a hold) and audio (one), with five video tasks and two audio ones, oldest first."""
    store = InMemoryPullStore()
    store.save_type(TaskType(task_type="video", schedule_limit=2), 1.0)
    store.save_type(TaskType(task_type="audio", schedule_limit=1), 1.0)
    clock = ManualClock(50.0)
    svc = PullService(store, clock=clock)
    for task_id in ("v0", "v1", "a0", "v2", "v3", "a1", "v4"):
        svc.create("video" if task_id[0] == "v" else "audio", "{}", task_id=task_id)
        clock.advance(1)
    return svc


HOLDS = [("video", False), ("audio", False), ("video", False), ("nope", False), ("video", True), ("video", False)]


def test_hold_each_answers_every_call_as_consecutive_holds_would() -> None:
    one_by_one = pull_service()
    alone: list[Any] = []
    for task_type, heartbeat in HOLDS:
        try:
            alone.append([t.task_id for t in one_by_one.hold(task_type, heartbeat)])
        except UnknownTaskType as exc:
            alone.append(type(exc))
    assert alone == [["v0", "v1"], ["a0"], ["v2", "v3"], UnknownTaskType, ["v4"], []]

    together = pull_service()
    claims: list[tuple[str, int | None]] = []
    hold = together.store.hold

    def counted(task_type: str, limit: int | None, now: float, heartbeat_timeout: float | None = None) -> Any:
        claims.append((task_type, limit))
        return hold(task_type, limit, now, heartbeat_timeout)

    together.store.hold = counted  # type: ignore[method-assign]
    answers = together.hold_each(HOLDS)
    # As if one after another, those of one type and heartbeat together: the three plain
    # video holds share a claim of their limits added up, and come before the heartbeat one.
    assert [[t.task_id for t in a] if isinstance(a, list) else type(a) for a in answers] == [
        ["v0", "v1"], ["a0"], ["v2", "v3"], UnknownTaskType, [], ["v4"],
    ]
    assert claims == [("video", 6), ("audio", None), ("nope", None), ("video", None)]


def test_hold_each_tells_a_failed_claims_callers_only() -> None:
    svc = pull_service()
    hold = svc.store.hold

    def audio_down(task_type: str, limit: int | None, now: float, heartbeat_timeout: float | None = None) -> Any:
        if task_type == "audio":
            raise StorageUnavailable("database unavailable: gone")
        return hold(task_type, limit, now, heartbeat_timeout)

    svc.store.hold = audio_down  # type: ignore[method-assign]
    answers = svc.hold_each([("audio", False), ("video", False), ("audio", False), ("video", False)])
    assert isinstance(answers[0], StorageUnavailable) and answers[2] is answers[0]
    assert [[t.task_id for t in a] for a in (answers[1], answers[3]) if isinstance(a, list)] == [["v0", "v1"], ["v2", "v3"]]
