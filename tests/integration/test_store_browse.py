"""The dashboard's bounded reads, on the in-memory fake, SQLite and PostgreSQL."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shared.flows import Action, Flow, StepDef
from shared.pull.rules import TaskType, new_pull_task
from shared.states import StepType, TaskStatus
from shared.storage import AttemptRecord, PullStore, TaskStore
from shared.storage.base import TaskQuery
from shared.task import Task, new_task

FLOW = Flow(name="f", steps=(StepDef(normal=Action(module="m", command="c")),))
OTHER = Flow(name="g", steps=(StepDef(normal=Action(module="m", command="c")),))


def _add(store: TaskStore, n: int, at: float, flow: Flow = FLOW, user: str | None = None, **params: Any) -> Task:
    task = new_task(f"t{n:03d}", flow, params, at, user_id=user)
    stored, created = store.create(task, at)
    assert created
    return stored


def _set_status(store: TaskStore, task: Task, status: TaskStatus) -> None:
    assert store.save(replace(task, status=status), task.created_at)


def _ids(tasks: list[Task]) -> list[str]:
    return [t.task_id for t in tasks]


def test_pages_are_newest_first_and_resume_after_the_cursor(store: TaskStore) -> None:
    for n in range(7):
        _add(store, n, 100.0 + n // 2)  # pairs share a creation time: ties order by task_id
    first = store.page(TaskQuery(limit=3))
    assert _ids(first.tasks) == ["t006", "t005", "t004"]
    assert first.next == (102.0, "t004")
    second = store.page(TaskQuery(limit=3, after=first.next))
    assert _ids(second.tasks) == ["t003", "t002", "t001"]
    last = store.page(TaskQuery(limit=3, after=second.next))
    assert _ids(last.tasks) == ["t000"] and last.next is None and not last.partial


def test_filters_combine_with_the_time_range(store: TaskStore) -> None:
    for n in range(6):
        _add(store, n, 100.0 + n, flow=FLOW if n % 2 else OTHER, user="ann" if n < 3 else "bob")
    assert _ids(store.page(TaskQuery(flow="f")).tasks) == ["t005", "t003", "t001"]
    assert _ids(store.page(TaskQuery(flow="f", user_id="ann")).tasks) == ["t001"]
    assert _ids(store.page(TaskQuery(created_from=102.0, created_until=104.0)).tasks) == ["t003", "t002"]
    assert _ids(store.page(TaskQuery(user_id="bob", created_from=104.0)).tasks) == ["t005", "t004"]


def test_status_filter_alone_and_as_a_residual(store: TaskStore) -> None:
    tasks = [_add(store, n, 100.0 + n, user="ann") for n in range(4)]
    _set_status(store, tasks[1], TaskStatus.FAILED)
    _set_status(store, tasks[3], TaskStatus.FAILED)
    assert _ids(store.page(TaskQuery(status=TaskStatus.FAILED)).tasks) == ["t003", "t001"]
    assert _ids(store.page(TaskQuery(status=TaskStatus.FAILED, user_id="ann")).tasks) == ["t003", "t001"]


def test_parameter_filter_matches_nested_values_as_text(store: TaskStore) -> None:
    _add(store, 0, 100.0, order={"id": 7}, name="x")
    _add(store, 1, 101.0, order={"id": 8}, name="y")
    _add(store, 2, 102.0, order={"id": "7"}, name="x")
    assert _ids(store.page(TaskQuery(parameter=(("order", "id"), "7"))).tasks) == ["t002", "t000"]
    assert _ids(store.page(TaskQuery(parameter=(("name",), "y"))).tasks) == ["t001"]
    assert store.page(TaskQuery(parameter=(("missing",), "x"))).tasks == []


def test_a_residual_filter_reads_at_most_scan_rows_and_resumes_past_them(store: TaskStore) -> None:
    for n in range(10):
        _add(store, n, 100.0 + n, name="hit" if n in (1, 8) else "miss")
    query = TaskQuery(parameter=(("name",), "hit"), scan=4, limit=5)
    first = store.page(query)
    assert _ids(first.tasks) == ["t008"]
    assert first.partial and first.next == (106.0, "t006")  # the 4th newest: where the scan stopped
    second = store.page(replace(query, after=first.next))
    assert second.tasks == [] and second.partial and second.next == (102.0, "t002")
    third = store.page(replace(query, after=second.next))
    assert _ids(third.tasks) == ["t001"] and third.next is None and not third.partial


def test_counts_by_status_stop_at_the_cap(store: TaskStore) -> None:
    tasks = [_add(store, n, 100.0 + n, flow=FLOW if n < 5 else OTHER, user="ann") for n in range(7)]
    for t in tasks[:2]:
        _set_status(store, t, TaskStatus.SUCCESS)
    everything = store.count_by_status(cap=3)
    assert everything.counts == {TaskStatus.PENDING: 4, TaskStatus.SUCCESS: 2}  # 5 pending, capped at 3 + 1
    assert everything.cap == 3
    of_flow = store.count_by_status(flow="f")
    assert of_flow.counts == {TaskStatus.PENDING: 3, TaskStatus.SUCCESS: 2}
    newest = store.count_by_status(user_id="ann", window=4)
    assert newest.counts == {TaskStatus.PENDING: 4} and newest.window == 4


def test_attempts_of_several_tasks_and_of_a_flow(store: TaskStore) -> None:
    old = _add(store, 0, 10.0)
    new = _add(store, 1, 100.0)
    other = _add(store, 2, 100.0, flow=OTHER)
    for task in (old, new, other):
        record = AttemptRecord(task.task_id, 1, 0, StepType.NORMAL, 1, "m", "c", started_at=task.created_at)
        assert store.save(task, task.created_at, record)
    assert set(store.attempts_of(["t000", "t001", "nope"])) == {"t000", "t001"}
    assert [a.task_id for a in store.flow_attempts("f", since=50.0, newest=10)] == ["t001"]
    assert [a.task_id for a in store.flow_attempts("f", since=0.0, newest=1)] == ["t001"]


def test_a_task_type_summary_counts_stages_and_the_oldest_lease(pull_store: PullStore) -> None:
    config = pull_store.save_type(TaskType(task_type="scan"), 1.0)
    for n, stage in enumerate(["fetch", "fetch", "parse"]):
        assert pull_store.create(new_pull_task(f"p{n}", config, "ann", stage, "", 0, now=10.0 + n)) is not None
    held = pull_store.hold("scan", 2, now=20.0)
    assert len(held) == 2
    summary = pull_store.summary("scan")
    assert summary.by_stage == {("fetch", 2): 2, ("parse", 1): 1}
    assert (summary.running, summary.oldest_lease_at) == (2, 20.0)
    assert pull_store.summary("scan", window=1).by_stage == {("parse", 1): 1}
