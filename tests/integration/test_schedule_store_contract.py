"""The ScheduleStore contract, written once and run in memory, on SQLite and on PostgreSQL."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError

from shared.pull.rules import PullTask, TaskType, new_pull_task
from shared.schedules.model import Run, RunState, Schedule, SkipReason, Target, When, task_id_of
from shared.states import TaskStatus
from shared.storage import PullStore, SqlStore, TaskStore
from shared.storage.base import Firing, Lease, NotLeader, ScheduleStore
from shared.storage.sql_schedules import SqlScheduleStore
from shared.task import new_task
from tests.unit.test_saga import flow

FLOW = flow(0, 0)

NOW = 1_700_000_000.0


def every_minute(schedule_id: str = "s1", **target: Any) -> Schedule:
    return Schedule(
        schedule_id=schedule_id,
        target=Target(**target) if target else Target(flow="f", parameters={"n": 1}),
        when=When(every=60.0),
        created_at=NOW,
        updated_at=NOW,
        cursor=NOW,
        next_at=NOW + 60,
    )


def fired(schedule_id: str, at: float) -> Run:
    return Run(schedule_id, at, RunState.FIRED, fired_at=at + 0.01, task_id=task_id_of(schedule_id, at))


def a_pull_task(task_id: str) -> PullTask:
    return new_pull_task(task_id, TaskType(task_type="video"), "", "", "{}", 0, NOW)


def test_add_get_list_and_replay(schedule_store: ScheduleStore) -> None:
    stored, created = schedule_store.add(every_minute("b"))
    assert created and stored.version == 1
    again, created = schedule_store.add(replace(every_minute("b"), note="other"))
    assert not created and again == stored
    schedule_store.add(every_minute("a"))
    assert [s.schedule_id for s in schedule_store.list(10)] == ["a", "b"]
    assert [s.schedule_id for s in schedule_store.list(10, after="a")] == ["b"]
    assert schedule_store.get("b") == stored
    assert schedule_store.get("nope") is None


def test_save_is_a_compare_and_set_and_feeds_the_change_list(schedule_store: ScheduleStore) -> None:
    stored, _ = schedule_store.add(every_minute())
    paused = replace(stored, paused=True, note="maintenance", updated_at=NOW + 5)
    assert schedule_store.save(paused)
    assert not schedule_store.save(paused), "the same version twice: the second must lose"
    now_stored = schedule_store.get("s1")
    assert now_stored is not None and now_stored.paused and now_stored.version == 2
    assert [s.schedule_id for s in schedule_store.changed_since(NOW + 5, 10)] == ["s1"]
    assert schedule_store.changed_since(NOW + 6, 10) == []


def test_due_skips_paused_and_finished_and_orders_by_time(schedule_store: ScheduleStore) -> None:
    early, _ = schedule_store.add(replace(every_minute("early"), next_at=NOW + 10))
    schedule_store.add(every_minute("later"))
    schedule_store.add(replace(every_minute("paused"), paused=True))
    schedule_store.add(replace(every_minute("done"), next_at=None))
    assert [s.schedule_id for s in schedule_store.due(NOW + 60, 10)] == ["early", "later"]
    assert [s.schedule_id for s in schedule_store.due(NOW + 30, 10)] == ["early"]
    assert schedule_store.due(NOW + 60, 1) == [early]


def test_a_firing_writes_state_runs_and_tasks_together(
    schedule_store: ScheduleStore, store: TaskStore
) -> None:
    stored, _ = schedule_store.add(every_minute())
    at = NOW + 60
    task = new_task(task_id_of("s1", at), FLOW, {"n": 1}, at)
    after = replace(stored, cursor=at, next_at=at + 60, running=task.task_id)
    assert schedule_store.fire([Firing(after, (fired("s1", at),), tasks=(task,))], None, at) == [True]
    assert store.get(task.task_id) is not None
    [run] = schedule_store.runs("s1", 10)
    assert run == fired("s1", at)
    assert schedule_store.task_status([task.task_id, "missing"]) == {task.task_id: TaskStatus.PENDING.label}
    now_stored = schedule_store.get("s1")
    assert now_stored is not None and now_stored.cursor == at and now_stored.version == 2
    # A firing decided on the old version changes nothing: no run, no task.
    other = new_task("other", FLOW, {}, at)
    assert schedule_store.fire([Firing(after, (fired("s1", at + 60),), tasks=(other,))], None, at) == [False]
    assert store.get("other") is None
    assert len(schedule_store.runs("s1", 10)) == 1


def test_a_batch_with_one_stale_firing_writes_the_others(schedule_store: ScheduleStore) -> None:
    a, _ = schedule_store.add(every_minute("a"))
    b, _ = schedule_store.add(every_minute("b"))
    assert schedule_store.save(replace(b, note="changed by a user"))
    at = NOW + 60
    result = schedule_store.fire(
        [
            Firing(replace(a, cursor=at), (fired("a", at),)),
            Firing(replace(b, cursor=at), (fired("b", at),)),
        ],
        None,
        at,
    )
    assert result == [True, False]
    assert len(schedule_store.runs("a", 10)) == 1 and schedule_store.runs("b", 10) == []


def test_one_run_per_schedule_and_time_whoever_writes_it(sql_store: SqlStore) -> None:
    """Two writers that both pass the compare-and-set (which a version check prevents, but the
    key must hold on its own): the database refuses the second record of a firing."""
    schedule_store = SqlScheduleStore(sql_store)
    stored, _ = schedule_store.add(every_minute())
    at = NOW + 60
    assert schedule_store.fire([Firing(replace(stored, cursor=at), (fired("s1", at),))], None, at) == [True]
    again = schedule_store.get("s1")
    assert again is not None
    with pytest.raises(IntegrityError):
        schedule_store.fire([Firing(again, (fired("s1", at),))], None, at)
    assert len(schedule_store.runs("s1", 10)) == 1


def test_buffered_runs_are_promoted_in_place(schedule_store: ScheduleStore) -> None:
    stored, _ = schedule_store.add(every_minute())
    at = NOW + 60
    buffered = Run("s1", at, RunState.BUFFERED)
    assert schedule_store.fire([Firing(replace(stored, cursor=at, buffered=(at,)), (buffered,))], None, at)
    current = schedule_store.get("s1")
    assert current is not None and current.buffered == (at,)
    start = fired("s1", at)
    assert schedule_store.fire([Firing(replace(current, buffered=()), (start,), promoted=frozenset({at}))], None, at)
    assert schedule_store.runs("s1", 10) == [start]


def test_runs_newest_first_with_paging_and_skips(schedule_store: ScheduleStore) -> None:
    stored, _ = schedule_store.add(every_minute())
    runs = [fired("s1", NOW + 60), Run("s1", NOW + 120, RunState.SKIPPED, reason=SkipReason.MISSED.value)]
    assert schedule_store.fire([Firing(replace(stored, cursor=NOW + 120), tuple(runs))], None, NOW + 130)
    assert [r.scheduled_at for r in schedule_store.runs("s1", 10)] == [NOW + 120, NOW + 60]
    assert [r.scheduled_at for r in schedule_store.runs("s1", 10, before=NOW + 120)] == [NOW + 60]
    assert schedule_store.run_times("s1", NOW, NOW + 100) == {NOW + 60}
    assert schedule_store.runs("s1", 10)[0].reason == "missed"


def test_v1_tasks_are_created_with_their_type_settings(schedule_store: ScheduleStore, pull_store: PullStore) -> None:
    pull_store.save_type(TaskType(task_type="video", max_retry_num=7), NOW)
    stored, _ = schedule_store.add(every_minute("v", task_type="video"))
    at = NOW + 60
    task = a_pull_task(task_id_of("v", at))
    assert schedule_store.fire([Firing(replace(stored, cursor=at), (fired("v", at),), pull_tasks=(task,))], None, at)
    created = pull_store.get(task.task_id)
    assert created is not None and created.max_retry_num == 7
    assert schedule_store.task_status([task.task_id]) == {task.task_id: "pending"}


def test_delete_removes_the_schedule_and_its_runs(schedule_store: ScheduleStore) -> None:
    stored, _ = schedule_store.add(every_minute())
    assert schedule_store.fire([Firing(replace(stored, cursor=NOW + 60), (fired("s1", NOW + 60),))], None, NOW)
    assert schedule_store.delete("s1")
    assert not schedule_store.delete("s1")
    assert schedule_store.get("s1") is None and schedule_store.runs("s1", 10) == []


def test_the_lease_has_one_holder_until_it_expires(schedule_store: ScheduleStore) -> None:
    a = schedule_store.acquire("scheduler", "a", 5.0, NOW)
    assert a is not None and a.epoch == 1
    assert schedule_store.acquire("scheduler", "b", 5.0, NOW + 1) is None
    renewed = schedule_store.acquire("scheduler", "a", 5.0, NOW + 4)
    assert renewed == Lease("scheduler", "a", 1, NOW + 9)
    assert schedule_store.acquire("scheduler", "b", 5.0, NOW + 8) is None
    b = schedule_store.acquire("scheduler", "b", 5.0, NOW + 9)
    assert b is not None and b.owner == "b" and b.epoch == 2
    # a's late renewal fails, and so does a firing fenced by its lease.
    assert schedule_store.acquire("scheduler", "a", 5.0, NOW + 10) is None
    stored, _ = schedule_store.add(every_minute())
    with pytest.raises(NotLeader):
        schedule_store.fire([Firing(replace(stored, cursor=NOW + 60), (fired("s1", NOW + 60),))], renewed, NOW + 10)
    assert schedule_store.runs("s1", 10) == []
    assert schedule_store.fire([Firing(replace(stored, cursor=NOW + 60), (fired("s1", NOW + 60),))], b, NOW + 10)
    # A clean stop hands over at once.
    schedule_store.release(b)
    c = schedule_store.acquire("scheduler", "c", 5.0, NOW + 10)
    assert c is not None and c.epoch == 3


def test_purge_deletes_old_runs_in_batches_and_only_ended_tasks(
    schedule_store: ScheduleStore, store: TaskStore
) -> None:
    stored, _ = schedule_store.add(every_minute())
    times = [NOW + 60 * i for i in range(1, 6)]
    tasks = [new_task(task_id_of("s1", t), FLOW, {}, t) for t in times]
    ended = replace(tasks[0], status=TaskStatus.SUCCESS)
    tasks[0] = ended
    firing = Firing(replace(stored, cursor=times[-1]), tuple(fired("s1", t) for t in times), tasks=tuple(tasks))
    assert schedule_store.fire([firing], None, NOW)
    assert schedule_store.purge(times[2], 1, tasks=True) == 1
    assert schedule_store.purge(times[2], 10, tasks=True) == 1
    assert schedule_store.purge(times[2], 10, tasks=True) == 0
    assert [r.scheduled_at for r in schedule_store.runs("s1", 10)] == times[2:][::-1]
    assert store.get(tasks[0].task_id) is None, "an ended task of a purged run goes with it"
    assert store.get(tasks[1].task_id) is not None, "a task still pending stays"


def test_due_reads_in_pages_past_a_key_even_when_many_share_a_time(schedule_store: ScheduleStore) -> None:
    for i in range(5):
        schedule_store.add(every_minute(f"s{i}"))  # all due at NOW + 60
    schedule_store.add(replace(every_minute("z"), next_at=NOW + 30))
    first = schedule_store.due(NOW + 60, 3)
    assert [s.schedule_id for s in first] == ["z", "s0", "s1"]
    rest = schedule_store.due(NOW + 60, 3, after=(NOW + 60, "s1"))
    assert [s.schedule_id for s in rest] == ["s2", "s3", "s4"]
    assert schedule_store.due(NOW + 60, 3, after=(NOW + 60, "s4")) == []
