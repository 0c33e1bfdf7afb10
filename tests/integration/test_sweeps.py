"""Governance sweeps against real stores: several schedulers at once act once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest

from shared.flows import parse_flows
from shared.pull.service import PullService
from shared.saga import Timing
from shared.scheduler import Cadence, Scheduler, sweep_tasks
from shared.schedules.service import ScheduleService
from shared.service import Submission, TaskService
from shared.states import Phase, StepCode, TaskStatus
from shared.storage import PullStore, StorageUnavailable, TaskStore
from shared.storage.base import ScheduleStore
from shared.task import StepMessage
from shared.testing import ManualClock, QueuePublisher

FLOWS = parse_flows(
    {"flows": {"one": {"steps": [{"normal": {"module": "m", "command": "c", "timeout": 10}}]}}}
)
TIMING = Timing(requeue_after=5, expire_grace=2)


def sweep_together(schedulers: list[TaskService], now: float) -> list[int]:
    """Each scheduler's sweep at ``now``, all started at once on threads of their own: what each changed."""
    barrier = threading.Barrier(len(schedulers))
    changed: list[int] = []

    def sweep(service: TaskService) -> None:
        barrier.wait(timeout=30)
        changed.append(sweep_tasks(service, now, limit=1000))

    threads = [threading.Thread(target=sweep, args=(s,)) for s in schedulers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return changed


def test_concurrent_schedulers_republish_each_lost_message_once(store: TaskStore) -> None:  # noqa: F811
    clock, publisher = ManualClock(), QueuePublisher()
    schedulers = [TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING) for _ in range(4)]
    ids = [schedulers[0].submit("one", {})[0].task_id for _ in range(40)]
    publisher.messages.clear()  # as if the broker lost every one of them
    clock.advance(5)

    changed = sweep_together(schedulers, clock())

    assert sum(changed) == 40
    assert sorted(m.task_id for m in publisher.messages) == sorted(ids)
    assert all(m.seq == 1 for m in publisher.messages)  # the same message again, not a new one
    assert sweep_tasks(schedulers[0], clock()) == 0  # nothing due until requeue_after passes again


def test_concurrent_schedulers_publish_each_first_step_of_a_batch_once_and_together(store: TaskStore) -> None:  # noqa: F811
    class Counting(QueuePublisher):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[int] = []

        def publish_many(self, messages: Sequence[StepMessage]) -> list[tuple[StepMessage, Exception]]:
            self.calls.append(len(messages))
            return super().publish_many(messages)

    clock, publisher = ManualClock(), Counting()
    schedulers = [TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING) for _ in range(3)]
    stored = schedulers[0].submit_many([Submission("one", {"n": i}) for i in range(60)])
    assert not publisher.messages and publisher.calls == []  # stored, nothing published

    changed = sweep_together(schedulers, clock())

    assert sum(changed) == 60
    assert sorted(m.task_id for m in publisher.messages) == sorted(task.task_id for task, _ in stored)
    assert {(m.seq, m.cursor) for m in publisher.messages} == {(1, 0)}
    assert max(publisher.calls) > 1  # a scheduler's group goes to the broker together
    assert {service.get(t.task_id).active.phase for service in schedulers[:1] for t, _ in stored} == {Phase.QUEUED}
    assert sweep_tasks(schedulers[0], clock()) == 0


def test_a_batch_s_first_steps_are_stored_and_published_in_one_group(store: TaskStore) -> None:  # noqa: F811
    clock, publisher = ManualClock(), QueuePublisher()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING)
    stored = service.submit_many([Submission("one", {"n": i}) for i in range(30)])
    writes: list[int] = []
    save_many = store.save_many
    store.save_many = lambda saves: writes.append(len(saves)) or save_many(saves)  # type: ignore[method-assign]
    assert sweep_tasks(service, clock()) == 30
    assert writes == [30]
    assert sorted(m.task_id for m in publisher.messages) == sorted(task.task_id for task, _ in stored)


def test_a_sweep_that_cannot_store_a_batch_s_release_raises_and_leaves_it_waiting(store: TaskStore) -> None:  # noqa: F811
    clock, publisher = ManualClock(), QueuePublisher()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING)
    stored = service.submit_many([Submission("one", {"n": i}) for i in range(3)])

    tries: list[str] = []

    def down(*args: object, **kwargs: object) -> bool:
        tries.append("write")
        raise StorageUnavailable("the database went away")

    store.save_many, store.save = down, down  # type: ignore[method-assign,assignment]
    with pytest.raises(StorageUnavailable):  # as a sweep's single apply raises it: the scheduler waits
        sweep_tasks(service, clock())
    assert len(tries) == 2  # the group's write, then one alone: the others are not tried
    assert not publisher.messages
    assert {store.get(task.task_id).active.phase for task, _ in stored} == {Phase.WAITING}  # type: ignore[union-attr]


TWO_MODULES = parse_flows(
    {
        "flows": {
            "one": {"steps": [{"normal": {"module": "m", "command": "c", "timeout": 10}}]},
            "two": {"steps": [{"normal": {"module": "n", "command": "c", "timeout": 10}}]},
        }
    }
)


def test_a_batch_s_first_steps_are_published_as_far_as_their_queue_has_room(store: TaskStore) -> None:  # noqa: F811
    clock, publisher = ManualClock(), QueuePublisher()
    service = TaskService(store, publisher, TWO_MODULES, clock=clock, timing=TIMING)
    ones = [t.task_id for t, _ in service.submit_many([Submission("one", {"n": i}) for i in range(30)])]
    twos = [t.task_id for t, _ in service.submit_many([Submission("two", {"n": i}) for i in range(5)])]
    room = {"m": 10, "n": 100}
    assert sweep_tasks(service, clock(), room=lambda: room) == 15
    # Ten of module m's (the oldest; here all came due at once), and all of n's.
    published = {m.task_id for m in publisher.messages}
    assert len(published & set(ones)) == 10 and set(twos) <= published
    # The others wait in the store, unwritten.
    assert {store.get(i).version for i in set(ones) - published} == {1}  # type: ignore[union-attr]
    room["m"] = 0  # its queue full
    assert sweep_tasks(service, clock(), room=lambda: room) == 0
    room["m"] = 100

    def unknown() -> dict[str, int]:
        raise OSError("broker unreachable")

    def uncountable() -> dict[str, int]:
        raise NotImplementedError("no queue depth for this broker")

    # Without an answer about the queues, they wait in the store, safe; a broker
    # that cannot count its queues gets them as they come due.
    assert sweep_tasks(service, clock(), room=unknown) == 0
    assert sweep_tasks(service, clock(), room=uncountable) == 20
    assert sorted(m.task_id for m in publisher.messages) == sorted(ones + twos)


def test_flows_sharing_a_module_are_released_oldest_first(store: TaskStore) -> None:  # noqa: F811
    shared = parse_flows(
        {
            "flows": {
                "a": {"steps": [{"normal": {"module": "m", "command": "c", "timeout": 10}}]},
                "b": {"steps": [{"normal": {"module": "m", "command": "c", "timeout": 10}}]},
            }
        }
    )
    clock, publisher = ManualClock(), QueuePublisher()
    service = TaskService(store, publisher, shared, clock=clock, timing=TIMING)
    bs = {t.task_id for t, _ in service.submit_many([Submission("b", {"n": i}) for i in range(3)])}
    clock.advance(1)
    as_ = {t.task_id for t, _ in service.submit_many([Submission("a", {"n": i}) for i in range(3)])}
    clock.advance(1)
    # Flow b's came first: b goes first, though a comes first by name.
    assert sweep_tasks(service, clock(), room=lambda: {"m": 4}) == 4
    published = {m.task_id for m in publisher.messages}
    assert bs <= published and len(published & as_) == 1


def test_a_batch_s_first_steps_lost_between_the_sweep_s_commit_and_its_publish_are_published_again(
    store: TaskStore,  # noqa: F811
) -> None:
    clock, publisher = ManualClock(), QueuePublisher()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING)
    ids = sorted(task.task_id for task, _ in service.submit_many([Submission("one", {"n": i}) for i in range(5)]))
    assert sweep_tasks(service, clock()) == 5
    publisher.messages.clear()  # the scheduler died after its commit, before the broker had them
    clock.advance(TIMING.requeue_after)
    assert sweep_tasks(service, clock()) == 5
    assert sorted(m.task_id for m in publisher.messages) == ids and {m.seq for m in publisher.messages} == {1}


def test_a_backlog_of_waiting_first_steps_does_not_hold_up_an_expiry_due_after_them(store: TaskStore) -> None:  # noqa: F811
    from shared.saga import Started

    clock, publisher = ManualClock(), QueuePublisher()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING)
    task, _ = service.submit("one", {})
    service.apply(task.task_id, Started(1))  # then its worker dies
    clock.advance(1)
    service.submit_many([Submission("one", {"n": i}) for i in range(30)])  # due before the expiry
    clock.advance(10 + 2)
    assert sweep_tasks(service, clock(), limit=10) == 1 + 10
    assert service.get(task.task_id).status is TaskStatus.FAILED
    assert sweep_tasks(service, clock(), limit=10) == 10


def test_sweep_expires_running_attempts_past_their_deadline(store: TaskStore) -> None:  # noqa: F811
    from shared.saga import Started

    clock, publisher = ManualClock(), QueuePublisher()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING)
    task, _ = service.submit("one", {})
    service.apply(task.task_id, Started(1))  # then its worker dies
    clock.advance(10 + 2 - 0.01)
    assert sweep_tasks(service, clock()) == 0
    clock.advance(0.02)
    assert sweep_tasks(service, clock()) == 1
    expired = service.get(task.task_id)
    # One step, no retry, no rollback: the lost attempt fails the task outright.
    assert expired.status is TaskStatus.FAILED and expired.steps[0].code == StepCode.TIMED_OUT
    (attempt,) = service.attempts(task.task_id)
    assert attempt.outcome == "expired"


def test_sweep_leaves_queued_messages_while_the_broker_is_down(store: TaskStore) -> None:  # noqa: F811
    class DownPublisher(QueuePublisher):
        def healthy(self) -> bool:
            return False

    clock, publisher = ManualClock(), DownPublisher()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING)
    task, _ = service.submit("one", {})
    publisher.messages.clear()
    clock.advance(100)
    assert sweep_tasks(service, clock()) == 0 and not publisher.messages
    stored = service.get(task.task_id)
    assert stored.active is not None and stored.active.phase is Phase.QUEUED


def test_a_sweep_pass_stops_at_its_deadline_and_the_next_passes_finish_the_rest(store: TaskStore) -> None:  # noqa: F811
    class SlowPublisher(QueuePublisher):
        def publish(self, message: StepMessage) -> None:
            time.sleep(0.02)  # a publish under load: a write and a broker round trip
            super().publish(message)

    clock, publisher = ManualClock(), SlowPublisher()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING)
    ids = [service.submit("one", {})[0].task_id for _ in range(30)]
    publisher.messages.clear()  # as if the broker lost every one of them
    clock.advance(5)
    began = time.monotonic()
    first = sweep_tasks(service, clock(), until=began + 0.1)
    assert 1 <= first < 30 and time.monotonic() - began < 0.5
    passes = [first]
    while sum(passes) < 30 and len(passes) < 100:
        passes.append(sweep_tasks(service, clock(), until=time.monotonic() + 0.1))
    assert sorted(m.task_id for m in publisher.messages) == sorted(ids)  # each published again once
    assert sweep_tasks(service, clock()) == 0


def test_queued_messages_of_a_module_with_a_backlog_are_left_in_its_queue(store: TaskStore) -> None:  # noqa: F811
    clock, publisher = ManualClock(), QueuePublisher()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING)
    ids = [service.submit("one", {})[0].task_id for _ in range(5)]
    publisher.messages.clear()  # still waiting in the broker, behind a backlog
    asked: list[int] = []

    def backlogged() -> frozenset[str]:
        asked.append(1)
        return frozenset({"m"})

    clock.advance(5)
    assert sweep_tasks(service, clock(), backlogged=backlogged) == 5
    assert not publisher.messages and asked == [1]  # asked once a pass, nothing published
    assert all(service.get(i).active.due_at == clock() + 5 for i in ids)
    assert sweep_tasks(service, clock(), backlogged=backlogged) == 0  # not due again before requeue_after

    def unknown() -> frozenset[str]:
        raise TimeoutError("the broker did not answer")

    clock.advance(5)
    assert sweep_tasks(service, clock(), backlogged=unknown) == 5  # no answer: published again, as before
    assert sorted(m.task_id for m in publisher.messages) == sorted(ids)


def _leader(
    service: TaskService, pull_store: PullStore, schedule_store: ScheduleStore, clock: ManualClock, lost: Callable[[], bool]
) -> Scheduler:
    """A scheduler whose queues all hold a backlog, on a lease the manual clock's jumps never outlast."""
    pull = PullService(pull_store, clock=clock)
    return Scheduler(
        service,
        pull,
        ScheduleService(schedule_store, service, pull, clock=clock),
        Cadence(lease_ttl=600),
        clock,
        backlogged=lambda: frozenset({"m"}),
        broker_lost=lost,
    )


def test_once_the_broker_lost_what_it_held_the_leader_holds_nothing_back_for_requeue_after(
    store: TaskStore, pull_store: PullStore, schedule_store: ScheduleStore  # noqa: F811
) -> None:
    clock, publisher = ManualClock(), QueuePublisher()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING)
    answers = [True, False]  # a broker never asked, then one that kept its canary
    asked: list[float] = []

    def broker_lost() -> bool:
        asked.append(clock())
        if not answers:
            raise ConnectionRefusedError("the broker is down")  # asked again at the next watch
        return answers.pop(0)

    scheduler = _leader(service, pull_store, schedule_store, clock, broker_lost)
    begun = clock()
    ids = [service.submit("one", {})[0].task_id for _ in range(2)]
    publisher.messages.clear()
    clock.advance(1)
    scheduler.step()  # leads, and asks at once
    for _ in range(4):
        clock.advance(0.2)
        scheduler.step()  # not asked again within the second
    later = service.submit("one", {})[0].task_id
    clock.advance(3.2)
    scheduler.step()  # the first two come due within requeue_after of the loss: published again
    assert sorted(m.task_id for m in publisher.messages) == sorted([later, *ids])
    publisher.messages.clear()
    clock.advance(5)
    scheduler.step()  # past it, the backlog holds all three back, though the broker did not answer
    assert not publisher.messages
    assert asked == pytest.approx([begun + 1, begun + 5, begun + 10])


def test_the_leader_holds_nothing_back_until_what_the_broker_may_have_lost_has_been_swept(
    store: TaskStore, pull_store: PullStore, schedule_store: ScheduleStore  # noqa: F811
) -> None:
    class Down(QueuePublisher):
        up = True

        def healthy(self) -> bool:
            return self.up

    clock, publisher = ManualClock(), Down()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=TIMING)
    scheduler = _leader(service, pull_store, schedule_store, clock, lambda: False)
    ids = [service.submit("one", {})[0].task_id for _ in range(2)]
    publisher.messages.clear()
    clock.advance(1)
    scheduler.step()  # takes the lead: what the broker lost before is not known, as if everything
    publisher.up = False
    for _ in range(2):
        clock.advance(5)
        scheduler.step()  # due, but nothing can be published: they stay due
    publisher.up = True
    clock.advance(1)
    scheduler.step()  # requeue_after is long past, but they were never swept: published, not held
    assert sorted(m.task_id for m in publisher.messages) == sorted(ids)
    publisher.messages.clear()
    clock.advance(5)
    scheduler.step()  # swept since: the backlog holds them back
    assert not publisher.messages


def test_a_message_held_in_a_backlog_requeue_holds_times_is_published_again(store: TaskStore) -> None:  # noqa: F811
    # It may have been lost after all (between a commit and its publish): late, not never.
    clock, publisher = ManualClock(), QueuePublisher()
    service = TaskService(store, publisher, FLOWS, clock=clock, timing=replace(TIMING, requeue_holds=2))
    task_id = service.submit("one", {})[0].task_id
    publisher.messages.clear()
    for _ in range(2):
        clock.advance(5)
        assert sweep_tasks(service, clock(), backlogged=lambda: frozenset({"m"})) == 1
        assert not publisher.messages
    clock.advance(5)
    assert sweep_tasks(service, clock(), backlogged=lambda: frozenset({"m"})) == 1
    assert [m.task_id for m in publisher.messages] == [task_id]
