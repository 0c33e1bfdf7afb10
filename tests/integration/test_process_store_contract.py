"""The process registry's contract, on the in-memory fake, SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from shared.storage import InMemoryStore, SqlStore, TaskStore
from shared.storage.base import ProcessRecord, ProcessStore
from shared.storage.memory import InMemoryProcessStore
from shared.storage.sql_processes import SqlProcessStore

SNAPSHOT = [
    {
        "name": "asyncflow_step_attempts",
        "type": "counter",
        "help": "Step attempts ended, by outcome",
        "samples": [["asyncflow_step_attempts_total", {"module": "alpha", "outcome": "succeeded"}, 3.0]],
    }
]


@pytest.fixture
def processes(store: TaskStore) -> ProcessStore:
    registry: ProcessStore
    if isinstance(store, SqlStore):
        registry = SqlProcessStore(store)
    else:
        assert isinstance(store, InMemoryStore)
        registry = InMemoryProcessStore()
    registry.purge(float("inf"))  # the PostgreSQL schema is shared by the run's tests
    return registry


def record(process_id: str = "host-a:41", seen_at: float = 100.0, **changes: object) -> ProcessRecord:
    fields: dict[str, object] = dict(
        process_id=process_id, role="worker", host="host-a", pid=41, started_at=90.0, seen_at=seen_at,
        detail={"modules": ["alpha"], "in_flight": []}, metrics=SNAPSHOT,
    )
    return ProcessRecord(**(fields | changes))  # type: ignore[arg-type]


def test_register_then_list_returns_the_row_as_written(processes: ProcessStore) -> None:
    processes.register(record())
    processes.register(record("host-b:7", role="api", host="host-b", pid=7, detail={"url": "http://b"}, metrics=[]))
    assert processes.list() == [
        record(),
        record("host-b:7", role="api", host="host-b", pid=7, detail={"url": "http://b"}, metrics=[]),
    ]


def test_renew_updates_seen_detail_and_metrics(processes: ProcessStore) -> None:
    processes.register(record())
    later = [dict(SNAPSHOT[0], samples=[["asyncflow_step_attempts_total", {"module": "alpha"}, 5.0]])]
    assert processes.renew("host-a:41", 105.0, {"in_flight": [{"task_id": "t1"}]}, later)
    [row] = processes.list()
    assert (row.seen_at, row.detail, row.metrics, row.started_at) == (105.0, {"in_flight": [{"task_id": "t1"}]}, later, 90.0)


def test_renew_of_an_unknown_process_says_so(processes: ProcessStore) -> None:
    assert processes.renew("nobody:1", 105.0, {}, []) is False
    assert processes.list() == []


def test_register_again_replaces_the_row_of_a_reused_process_id(processes: ProcessStore) -> None:
    processes.register(record())
    processes.stop("host-a:41", 101.0)
    processes.register(record(started_at=200.0, seen_at=200.0, metrics=[]))
    assert processes.list() == [record(started_at=200.0, seen_at=200.0, metrics=[])]


def test_stop_marks_the_row_and_keeps_it(processes: ProcessStore) -> None:
    processes.register(record())
    processes.stop("host-a:41", 130.0)
    [row] = processes.list()
    assert (row.stopped_at, row.seen_at, row.metrics) == (130.0, 130.0, SNAPSHOT)


def test_list_since_leaves_out_rows_not_seen_since(processes: ProcessStore) -> None:
    processes.register(record("old:1", seen_at=50.0))
    processes.register(record("new:2", seen_at=150.0))
    assert [r.process_id for r in processes.list(seen_since=100.0)] == ["new:2"]
    assert [r.process_id for r in processes.list()] == ["new:2", "old:1"]


def test_purge_deletes_rows_last_seen_before(processes: ProcessStore) -> None:
    processes.register(record("silent:1", seen_at=50.0))
    processes.register(record("stopped:2", seen_at=60.0))
    processes.stop("stopped:2", 70.0)
    processes.register(record("live:3", seen_at=150.0))
    assert processes.purge(100.0) == 2
    assert [r.process_id for r in processes.list()] == ["live:3"]
    assert processes.purge(100.0) == 0
