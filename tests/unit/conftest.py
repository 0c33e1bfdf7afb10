"""Fixtures of the unit tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.storage import InMemoryStore, TaskStore
from shared.storage.sql import SqliteStore


@pytest.fixture(params=["sqlite", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TaskStore]:
    if request.param == "memory":
        yield InMemoryStore()
        return
    sql = SqliteStore(f"sqlite:///{tmp_path / 'tasks.sqlite'}")
    sql.create_schema()
    try:
        yield sql
    finally:
        sql.close()
