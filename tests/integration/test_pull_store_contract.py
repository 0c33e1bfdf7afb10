"""The PullStore contract, written once and run on every backend.

The shipped InMemoryPullStore, SQLite and PostgreSQL (marked ``postgres``) must
behave the same, so tests and users' tests written against the fake hold on a
real database. The property machine of tests/unit/test_pull_properties.py runs
here on SQL as well.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from sqlalchemy import delete

from shared.migrate import upgrade
from shared.pull.rules import PullStatus, PullTask, TaskType, new_pull_task
from shared.storage import PullStore, SqlStore, TaskConflict, open_store
from shared.storage.base import UnknownType
from shared.storage.schema import pull_tasks, task_types
from shared.storage.sql_pull import SqlPullStore
from tests.unit.test_pull_properties import PullTasks

NOW = 1_700_000_000.0


def a_task(task_id: str, task_type: str = "video", priority: int = 0, now: float = NOW, user: str = "u") -> PullTask:
    return new_pull_task(task_id, TaskType(task_type=task_type), user, "stage", "{}", priority, now)


@pytest.fixture
def typed(pull_store: PullStore) -> PullStore:
    pull_store.save_type(
        TaskType(task_type="video", schedule_limit=3, max_processing_time=60, max_retry_num=2, max_retry_interval=-4),
        NOW,
    )
    return pull_store


def test_task_types_are_saved_replaced_and_listed_by_name(pull_store: PullStore) -> None:
    assert pull_store.get_type("video") is None and pull_store.types() == []
    pull_store.save_type(TaskType(task_type="video"), NOW)
    pull_store.save_type(TaskType(task_type="audio", schedule_limit=7), NOW)
    pull_store.save_type(TaskType(task_type="video", max_retry_num=9), NOW + 1)
    assert [t.task_type for t in pull_store.types()] == ["audio", "video"]
    assert pull_store.get_type("video") == TaskType(task_type="video", max_retry_num=9)


def test_create_takes_the_types_settings_and_refuses_an_unknown_type(typed: PullStore) -> None:
    assert typed.create(a_task("x", task_type="nope")) is None
    created = typed.create(a_task("t1"))
    assert created is not None
    task, new = created
    assert new and task.version == 1
    assert (task.max_retry_num, task.max_retry_interval, task.max_processing_time) == (2, -4, 60)
    assert typed.get("t1") == task


def test_create_again_returns_the_stored_task_or_a_conflict(typed: PullStore) -> None:
    first = typed.create(a_task("t1"))
    again = typed.create(replace(a_task("t1"), task_content="other"))
    assert first is not None and again == (first[0], False)
    with pytest.raises(TaskConflict):
        typed.create(a_task("t1", user="someone else"))


def stored(task: PullTask) -> PullTask:
    """``task`` as the store creates it: version 1, with the settings of the type ``typed`` registers."""
    return replace(task, version=1, max_retry_num=2, max_retry_interval=-4, max_processing_time=60)


def test_create_many_stores_all_or_none(typed: PullStore) -> None:
    first, _ = typed.create(a_task("old"))  # type: ignore[misc]
    batch = [a_task(f"n{i}", priority=i) for i in range(3)] + [replace(a_task("old"), task_content="again")]
    assert typed.create_many(batch) == [(stored(t), True) for t in batch[:3]] + [(first, False)]
    assert [typed.get(f"n{i}") for i in range(3)] == [stored(t) for t in batch[:3]]
    with pytest.raises(TaskConflict, match="'old'"):
        typed.create_many([a_task("m0"), a_task("old", user="someone else")])
    assert typed.get("m0") is None


def test_create_many_each_answers_a_conflict_alone_and_stores_the_others(typed: PullStore) -> None:
    first, _ = typed.create(a_task("old"))  # type: ignore[misc]
    batch = [a_task("m0"), a_task("old", user="someone else"), replace(a_task("old"), task_content="again"), a_task("m1")]
    answers = typed.create_many(batch, each=True)
    assert answers[0] == (stored(batch[0]), True) and answers[3] == (stored(batch[3]), True)
    assert isinstance(answers[1], TaskConflict) and "'old'" in str(answers[1])
    assert answers[2] == (first, False)
    assert typed.get("m0") == stored(batch[0]) and typed.get("old") == first
    [alone] = typed.create_many([a_task("m2")], each=True)  # a batch of one: no transaction around it
    assert alone == (stored(a_task("m2")), True) and typed.get("m2") == alone[0]  # type: ignore[index]


def test_create_many_keeps_every_value_as_given(typed: PullStore) -> None:
    # PostgreSQL takes a batch's columns as arrays: no value may be read back otherwise than given.
    content = '{"q": "say \\"hi\\"", "set": "{a,b}", "u": "é 中文 🙂", "n": null}'
    batch = [replace(a_task(f"c{i}", user='o"dd, {user}'), task_content=content, task_stage="") for i in range(3)]
    assert typed.create_many(batch, each=True) == [(stored(t), True) for t in batch]
    assert [typed.get(t.task_id) for t in batch] == [stored(t) for t in batch]


def test_create_many_takes_each_type_s_settings_and_refuses_an_unknown_type(typed: PullStore) -> None:
    typed.save_type(TaskType(task_type="audio", max_retry_num=7, max_retry_interval=5, max_processing_time=9), NOW)
    batch = [a_task("v1"), a_task("a1", task_type="audio"), a_task("x1", task_type="nope"), a_task("v2")]
    answers = typed.create_many(batch, each=True)
    assert answers[1] == (replace(batch[1], version=1, max_retry_num=7, max_retry_interval=5, max_processing_time=9), True)
    assert isinstance(answers[2], UnknownType) and answers[2].task_type == "nope"
    assert [answers[0], answers[3]] == [(stored(batch[0]), True), (stored(batch[3]), True)]
    assert typed.get("x1") is None and typed.get("a1") == answers[1][0]  # type: ignore[index]
    # All or none: an unknown type refuses the whole batch.
    with pytest.raises(UnknownType, match="'nope'"):
        typed.create_many([a_task("v3"), a_task("x2", task_type="nope")])
    assert typed.get("v3") is None
    [alone] = typed.create_many([a_task("x3", task_type="nope")], each=True)
    assert isinstance(alone, UnknownType) and typed.get("x3") is None


def test_create_many_racing_single_creates_of_its_ids(typed: PullStore) -> None:
    # Whoever commits an id first owns it: the batch neither fails nor claims the others'.
    ids = [f"r{i}" for i in range(40)]
    singles: dict[str, bool] = {}

    def create_each() -> None:
        for task_id in reversed(ids):
            singles[task_id] = typed.create(a_task(task_id))[1]  # type: ignore[index]

    racer = threading.Thread(target=create_each)
    racer.start()
    batch = typed.create_many([a_task(i) for i in ids])
    racer.join()
    assert [t.task_id for t, _ in batch] == ids
    assert [created + singles[task_id] for task_id, (_, created) in zip(ids, batch, strict=True)] == [1] * 40


def test_hold_leases_due_pending_tasks_by_order_time_up_to_the_limit(typed: PullStore) -> None:
    for i, priority in enumerate([0, 5, 2, 9]):
        typed.create(a_task(f"t{i}", priority=priority))
    typed.create(a_task("later", now=NOW + 100))  # order_time in the future: not due
    held = typed.hold("video", None, NOW)  # the type's schedule_limit: 3
    assert [t.task_id for t in held] == ["t3", "t1", "t2"]
    assert all(t.status is PullStatus.RUNNING and t.modify_time == NOW for t in held)
    assert [t.task_id for t in typed.hold("video", 10, NOW)] == ["t0"]
    assert typed.hold("video", 10, NOW) == [] and typed.hold("nope", None, NOW) == []
    assert typed.get("t1") == held[1]


def test_concurrent_holds_never_return_the_same_task(typed: PullStore) -> None:
    for i in range(60):
        typed.create(a_task(f"t{i}"))
    got: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def worker() -> None:
        barrier.wait(timeout=30)
        while batch := typed.hold("video", 2, NOW):
            with lock:
                got.extend(t.task_id for t in batch)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(got) == sorted(f"t{i}" for i in range(60))


def test_save_is_a_compare_and_set_on_the_version(typed: PullStore) -> None:
    created = typed.create(a_task("t1"))
    assert created is not None
    task = created[0]
    assert typed.save(replace(task, task_stage="next"))
    assert not typed.save(replace(task, task_stage="lost"))  # decided on version 1, now 2
    stored = typed.get("t1")
    assert stored is not None and (stored.task_stage, stored.version) == ("next", 2)


def test_due_lists_running_tasks_whose_lease_ended(typed: PullStore) -> None:
    for i in range(3):
        typed.create(a_task(f"t{i}"))
    # The three are due at the same order_time: which two the hold leases is not ordered.
    held = typed.hold("video", 2, NOW)
    assert typed.due(NOW + 59, 10) == []
    assert sorted(t.task_id for t in typed.due(NOW + 60, 10)) == sorted(t.task_id for t in held)
    assert len(held) == 2 and len(typed.due(NOW + 60, 1)) == 1


def test_enqueue_inserts_or_puts_back_a_task_that_is_not_pending(pull_store: PullStore) -> None:
    step = replace(a_task("f.1", task_type="dns"), max_processing_time=20)
    pull_store.enqueue(step)
    assert pull_store.get("f.1") == replace(step, version=1)
    pull_store.enqueue(replace(step, order_time=NOW + 50))  # still pending: keeps its place
    stored = pull_store.get("f.1")
    assert stored is not None and stored.order_time == NOW
    (held,) = pull_store.hold("dns", 10, NOW)
    pull_store.enqueue(replace(step, order_time=NOW + 5, create_time=NOW + 5))
    again = pull_store.get("f.1")
    assert again is not None
    assert (again.status, again.order_time, again.create_time) == (PullStatus.PENDING, NOW + 5, NOW)
    assert again.version == held.version + 1


def test_list_newest_first_with_filters_and_count_by_status(typed: PullStore) -> None:
    for i in range(4):
        typed.create(replace(a_task(f"t{i}", now=NOW + i, user="a" if i % 2 else "b"), task_stage=f"s{i % 2}"))
    typed.hold("video", 1, NOW + 10)
    assert [t.task_id for t in typed.list("video", None, None, 10)] == ["t3", "t2", "t1", "t0"]
    assert [t.task_id for t in typed.list("video", None, "s1", 10, user_id="a")] == ["t3", "t1"]
    assert [t.task_id for t in typed.list(None, int(PullStatus.RUNNING), None, 10)] == ["t0"]
    assert [t.task_id for t in typed.list("video", None, None, 2)] == ["t3", "t2"]
    assert typed.count("video") == {int(PullStatus.PENDING): 3, int(PullStatus.RUNNING): 1}
    assert typed.count("audio") == {}


class SqlitePullTasks(PullTasks):
    # One migrated file for every example, emptied at the start of each: migrating
    # a new file per example would cost more than the example.
    sql: SqlStore | None = None

    @staticmethod
    def open_store() -> PullStore:  # type: ignore[override]
        sql = SqlitePullTasks.sql
        assert sql is not None
        with sql.transaction() as conn:
            conn.execute(delete(pull_tasks))
            conn.execute(delete(task_types))
        return SqlPullStore(sql)


def test_pull_task_properties_hold_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'pull.sqlite'}"
    upgrade(url)
    SqlitePullTasks.sql = open_store(url)
    SqlitePullTasks.TestCase.settings = settings(
        max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    try:
        SqlitePullTasks.TestCase().runTest()
    finally:
        SqlitePullTasks.sql.close()
        SqlitePullTasks.sql = None
