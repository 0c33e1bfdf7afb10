"""The first message of a task carries the task as stored (``StepMessage.known``).

Its consumer decides the step's start on that copy instead of reading the task;
the start's compare-and-set proves the copy current. Whatever happened to the task
between its submit and the delivery, what is stored and what runs must be what
the same delivery without the copy gives.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from shared.config import Settings
from shared.flows import load_flows
from shared.module import Module, StepContext
from shared.records import evolve
from shared.saga import Cancel, PublishFailed, Retry
from shared.scheduler.sweeps import sweep_tasks
from shared.service import Submission, TaskService
from shared.states import StepState
from shared.storage import InMemoryStore
from shared.storage.base import Save
from shared.storage.codec import task_from_row
from shared.task import StepMessage, Task
from shared.testing import Harness

FLOWS = load_flows(Path(__file__).resolve().parents[1] / "support" / "flows.yaml")
FAR = 1e9  # seconds: with this long to go on, every step runs on in the delivery that started the flow


class CountingStore(InMemoryStore):
    """Counts the reads of a task by id: what a consumer does before a step it cannot start blind."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def get(self, task_id: str) -> Task | None:
        self.reads += 1
        return super().get(task_id)


def recording() -> tuple[dict[str, Module], list[tuple[str, int, dict[str, Any]]]]:
    """Modules alpha and beta whose commands note what ran, on which parameters."""
    ran: list[tuple[str, int, dict[str, Any]]] = []
    modules = {name: Module(name) for name in ("alpha", "beta")}
    for module in modules.values():

        @module.command("step")
        def step(ctx: StepContext) -> None:
            ran.append(("step", ctx.cursor, dict(ctx.parameters)))

        @module.command("undo")
        def undo(ctx: StepContext) -> None:
            ran.append(("undo", ctx.cursor, dict(ctx.parameters)))

    return modules, ran


def harness(**settings: Any) -> tuple[Harness, CountingStore, list[tuple[str, int, dict[str, Any]]]]:
    modules, ran = recording()
    store = CountingStore()
    return Harness(FLOWS, modules, store=store, settings=Settings(home=Path(".t"), **settings)), store, ran


def until(h: Harness, within: float | None) -> float | None:
    """The ``continue_until`` of a delivery that may go on for ``within`` seconds (None: publish every step)."""
    return None if within is None else h.clock() + within


def over_the_wire(message: StepMessage) -> StepMessage:
    """The message as a consumer gets it from the broker: its payload through JSON."""
    return StepMessage.from_payload(json.loads(json.dumps(message.to_payload())))


@pytest.mark.parametrize(
    "submit",
    [
        lambda service: service.submit("three", {"Name": "a"})[0],
        lambda service: service.submit_each([Submission("three", {"Name": "a"})])[0][0],
    ],
    ids=["submit", "submit_each"],  # a batch's first steps are the sweep's to publish
)
def test_the_first_message_carries_the_task_exactly_as_stored(submit: Callable[[TaskService], Task]) -> None:
    h, store, _ = harness()
    task = submit(h.service)
    (message,) = h.publisher.messages
    assert message.known is not None
    assert task_from_row(over_the_wire(message).known) == store.get(task.task_id) == task


def test_a_batch_s_first_message_published_by_the_sweep_carries_the_task_as_stored() -> None:
    h, store, ran = harness()
    (task, _), (other, _) = h.service.submit_many([Submission("three", {"Name": "a"}), Submission("three", {})])
    assert not h.publisher.messages  # stored waiting: the sweep publishes them
    assert sweep_tasks(h.service, h.clock()) == 2
    first = next(m for m in h.publisher.messages if m.task_id == task.task_id)
    assert first.known is not None and task_from_row(over_the_wire(first).known) == store.get(task.task_id)
    store.reads = 0
    h.consumer.handle(over_the_wire(first))
    assert store.reads == 0 and ran[0] == ("step", 0, {"Name": "a"})


class OneUnreadableRow(InMemoryStore):
    """A store with one task whose row cannot be read back (a newer release's, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.unreadable = ""
        self.groups: list[int] = []  # the size of each group of transitions committed

    def save_many(self, saves: Sequence[Save]) -> list[bool]:
        self.groups.append(len(saves))
        return super().save_many(saves)

    def get(self, task_id: str) -> Task | None:
        if task_id == self.unreadable:
            raise ValueError(f"task {task_id}: unknown step state 99")
        return super().get(task_id)

    def get_many(self, task_ids: Sequence[str]) -> list[Task]:
        return [task for task in map(self.get, task_ids) if task is not None]


def test_a_task_that_cannot_be_read_holds_back_only_its_own_first_step() -> None:
    store = OneUnreadableRow()
    h = Harness(FLOWS, recording()[0], store=store, settings=Settings(home=Path(".t")))
    stored = h.service.submit_many([Submission("three", {"n": n}) for n in range(5)])
    store.unreadable = stored[2][0].task_id
    store.groups = []
    assert sweep_tasks(h.service, h.clock()) == 4
    assert store.groups == [4]  # the others still committed together
    assert sorted(m.task_id for m in h.publisher.messages) == sorted(t.task_id for t, _ in stored if t.task_id != store.unreadable)
    store.unreadable = ""  # readable again (the release that wrote it is back): the next pass publishes it
    assert sweep_tasks(h.service, h.clock()) == 1


@pytest.mark.parametrize("within", [None, FAR], ids=["published", "run on"])
def test_its_consumer_starts_the_step_without_reading_the_task(within: float | None) -> None:
    h, store, ran = harness()
    task, _ = h.service.submit("three", {"Name": "a"})
    store.reads = 0
    h.consumer.handle(over_the_wire(h.publisher.messages.popleft()), continue_until=until(h, within))
    assert store.reads == 0
    assert ran[0] == ("step", 0, {"Name": "a"})
    h.run()  # the later steps, published or run on
    stored = h.service.get(task.task_id)
    assert stored.status.label == "success"
    assert [r[:2] for r in ran] == [("step", 0), ("step", 1), ("step", 2)]
    if within is None:
        # Published, the next messages carry no copy: the task as stored is read for them.
        assert len(h.delivered) == 2 and all(m.known is None for m in h.delivered)
    else:
        assert h.delivered == []  # run on, each known from the write before it


def test_a_step_started_only_with_its_outcome_reads_the_task_first() -> None:
    """Without a write before the handler runs, nothing would prove the copy current."""
    h, store, ran = harness(record_start_after=1.0)
    h.service.submit("three", {"Name": "a"})
    store.reads = 0
    h.consumer.handle(over_the_wire(h.publisher.messages.popleft()))
    assert store.reads == 1
    assert ran == [("step", 0, {"Name": "a"})]


@pytest.mark.parametrize(
    "spoil",
    [
        lambda known, other: {k: v for k, v in known.items() if k != "steps"},  # a copy this release cannot read
        lambda known, other: other,  # another task's copy
    ],
    ids=["unreadable", "another task's"],
)
def test_a_copy_the_consumer_cannot_use_is_set_aside_and_the_task_read(
    spoil: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]],
) -> None:
    h, store, ran = harness()
    task, _ = h.service.submit("three", {"Name": "a"})
    h.service.submit("three", {"Name": "b"})
    first, other = h.publisher.messages
    store.reads = 0
    h.consumer.handle(over_the_wire(evolve(first, known=spoil(dict(first.known or {}), dict(other.known or {})))))
    assert store.reads == 1
    assert ran == [("step", 0, {"Name": "a"})]
    assert h.service.get(task.task_id).steps[0].state is StepState.SUCCEEDED
    assert h.service.get(other.task_id).steps[0].state is StepState.PENDING


@pytest.mark.parametrize("carry", [True, False], ids=["with its copy", "without"])
def test_a_first_message_of_a_task_deleted_since_is_dropped(carry: bool) -> None:
    """A purged task (shared.schedules deletes ended runs' tasks) whose first message comes late."""
    h, store, ran = harness()
    task, _ = h.service.submit("three", {"Name": "a"})
    first = h.publisher.messages.popleft()
    del store._tasks[task.task_id]  # the in-memory store has no delete of its own
    h.consumer.handle(over_the_wire(first if carry else evolve(first, known=None)))
    assert ran == []
    assert store.get(task.task_id) is None


def nothing(service: TaskService, task_id: str) -> None:
    pass


def cancelled(service: TaskService, task_id: str) -> None:
    service.operate(task_id, Cancel())


def cancelled_then_retried_with_other_parameters(service: TaskService, task_id: str) -> None:
    service.operate(task_id, Cancel())
    service.operate(task_id, Retry({"Name": "corrected"}))


def publish_failed(service: TaskService, task_id: str) -> None:
    service.apply(task_id, PublishFailed(1))  # a write that leaves the step as it was: only the version moves


@pytest.mark.parametrize(
    "meanwhile", [nothing, cancelled, cancelled_then_retried_with_other_parameters, publish_failed]
)
@pytest.mark.parametrize("within", [None, FAR], ids=["published", "run on"])
def test_whatever_happened_since_the_submit_the_copy_changes_nothing_stored_or_run(
    meanwhile: Callable[[TaskService, str], None], within: float | None
) -> None:
    outcomes = []
    for carry in (True, False):
        h, _, ran = harness()
        task, _ = h.service.submit("three", {"Name": "a"}, task_id="t-1")
        first = h.publisher.messages.popleft()
        meanwhile(h.service, task.task_id)
        delivered = over_the_wire(first if carry else evolve(first, known=None))
        h.consumer.handle(delivered, continue_until=until(h, within))
        h.run()
        outcomes.append((h.service.get(task.task_id), h.service.attempts(task.task_id), ran))
    with_copy, read = outcomes
    assert with_copy == read
