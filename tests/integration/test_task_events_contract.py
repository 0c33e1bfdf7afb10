"""A task's history (operator actions) in every TaskStore: written with the transition, or not at all."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy.exc import StatementError

from shared.saga import Retry, decide
from shared.schedules.model import task_id_of
from shared.states import TaskStatus
from shared.storage import SqlStore, TaskEvent, TaskStore
from shared.storage.base import Firing, ScheduleStore
from shared.task import Task, new_task
from tests.integration.test_schedule_store_contract import FLOW, every_minute, fired
from tests.integration.test_store_contract import NOW, submitted


def failed(task_id: str) -> Task:
    return replace(submitted(task_id), status=TaskStatus.FAILED, active=None, ended_at=NOW)


def retry_event(task_id: str, at: float, actor: str | None = "alice") -> TaskEvent:
    detail = {"step": 0, "parameters": {"Name": {"old": "db-ü-名前", "new": "db2"}, "Tags": {"new": [1, {"a": None}]}}}
    return TaskEvent(task_id, at, "retry", actor, detail)


def test_an_event_is_stored_with_the_transition_and_read_back_oldest_first(store: TaskStore) -> None:
    store.create(failed("t-1"), NOW)
    store.create(failed("t-2"), NOW)
    task = store.get("t-1")
    assert task is not None and store.events("t-1") == []
    retried = decide(task, Retry({"Name": "db2"}), NOW + 1).task
    assert store.save(retried, NOW + 1, event=retry_event("t-1", NOW + 1)) is True
    stored = store.get("t-1")
    assert stored is not None and stored.parameters["Name"] == "db2" and stored.status is TaskStatus.RUNNING
    cancel = TaskEvent("t-1", NOW + 2, "cancel", None, {})
    assert store.save(replace(stored, cancel_requested=True), NOW + 2, event=cancel) is True
    assert store.events("t-1") == [retry_event("t-1", NOW + 1), cancel]
    assert store.events("t-2") == [] and store.events("nope") == []


def test_a_lost_compare_and_set_writes_no_event(store: TaskStore) -> None:
    store.create(failed("t-1"), NOW)
    task = store.get("t-1")
    assert task is not None
    assert store.save(decide(task, Retry(), NOW + 1).task, NOW + 1, event=retry_event("t-1", NOW + 1))
    # A second action decided on the same (now stale) version loses, and leaves no trace.
    assert store.save(decide(task, Retry(), NOW + 1).task, NOW + 1, event=retry_event("t-1", NOW + 1, "bob")) is False
    assert [e.actor for e in store.events("t-1")] == ["alice"]


def test_a_transition_whose_event_cannot_be_stored_is_not_stored_either(sql_store: SqlStore) -> None:
    sql_store.create(failed("t-1"), NOW)
    task = sql_store.get("t-1")
    assert task is not None
    unstorable = TaskEvent("t-1", NOW + 1, "retry", None, {"x": object()})  # not JSON
    with pytest.raises((TypeError, StatementError)):  # as the driver reports it
        sql_store.save(decide(task, Retry({"Name": "x"}), NOW + 1).task, NOW + 1, event=unstorable)
    assert sql_store.get("t-1") == task
    assert sql_store.events("t-1") == []


def test_retention_deletes_the_history_of_the_tasks_it_deletes(
    schedule_store: ScheduleStore, store: TaskStore
) -> None:
    stored, _ = schedule_store.add(every_minute())
    times = [NOW + 60, NOW + 120]
    tasks = [new_task(task_id_of("s1", t), FLOW, {}, t) for t in times]
    tasks[0] = replace(tasks[0], status=TaskStatus.SUCCESS)
    firing = Firing(replace(stored, cursor=times[-1]), tuple(fired("s1", t) for t in times), tasks=tuple(tasks))
    assert schedule_store.fire([firing], None, NOW)
    for task in tasks:
        current = store.get(task.task_id)
        assert current is not None
        assert store.save(current, NOW, event=TaskEvent(task.task_id, NOW, "cancel", "ops", {}))
    assert schedule_store.purge(NOW + 1000, 10, tasks=True) == 2
    assert store.get(tasks[0].task_id) is None and store.events(tasks[0].task_id) == []
    assert store.get(tasks[1].task_id) is not None, "a task still pending stays"
    assert len(store.events(tasks[1].task_id)) == 1, "and so does its history"
