"""A PostgreSQL store whose server refuses connections says so: StorageUnavailable, which
callers turn into a 503 or a retry, never an unexpected error (no server needed)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shared.flows import Action, Flow, StepDef
from shared.saga import Submit, decide
from shared.storage import StorageUnavailable
from shared.storage.sql import PostgresStore
from shared.task import new_task

FLOW = Flow(name="one", steps=(StepDef(normal=Action(module="m", command="c")),))


@pytest.fixture
def unreachable() -> Iterator[PostgresStore]:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = PostgresStore(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test?connect_timeout=2")
    yield store
    store.close()


TASK = decide(new_task("t-unreachable", FLOW, {}, 1.0), Submit(), 1.0).task
CALLS: dict[str, Callable[[PostgresStore], Any]] = {
    "get": lambda store: store.get(TASK.task_id),
    "create": lambda store: store.create(TASK, 1.0),
    "save": lambda store: store.save(TASK, 2.0),
    "attempts": lambda store: store.attempts(TASK.task_id),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_every_call_reports_the_database_unavailable(unreachable: PostgresStore, call: Callable[[PostgresStore], Any]) -> None:
    with pytest.raises(StorageUnavailable, match="database unavailable"):
        call(unreachable)
