"""PostgreSQL's plans of the v1 claim once the table is large and analyzed.

A plan is chosen per execution from the table's statistics, so a statement that
reads a few rows of a small table may read the whole table once it has grown:
these tests load enough pending tasks for that choice to matter and ask
PostgreSQL what it would do.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import insert

from shared.pull.rules import PullStatus, TaskType, new_pull_task
from shared.storage import SqlStore, open_store
from shared.storage.driver import DriverStatement
from shared.storage.schema import pull_tasks
from shared.storage.sql_pull import HOLD, SqlPullStore, create_row
from tests.integration.conftest import empty_tables

pytestmark = pytest.mark.postgres

NOW = 1_700_000_000.0
PENDING = 20_000


@pytest.fixture
def loaded(postgres_url: str) -> Iterator[SqlStore]:
    """A store whose type ``big`` has PENDING pending tasks, analyzed."""
    empty_tables(postgres_url)
    store = open_store(postgres_url)
    config = TaskType(task_type="big", schedule_limit=1)
    SqlPullStore(store).save_type(config, NOW)
    rows = [create_row(new_pull_task(f"t{i:05}", config, "u", "", "{}", 0, NOW + i)) for i in range(PENDING)]
    with store.transaction() as conn:
        conn.execute(insert(pull_tasks), rows)
        conn.exec_driver_sql("ANALYZE af_pull_tasks")
    try:
        yield store
    finally:
        store.close()
        empty_tables(postgres_url)


def scans(plan: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    """Each node of an EXPLAIN (FORMAT JSON) plan: its type and the table it reads."""
    yield plan["Node Type"], plan.get("Relation Name")
    for child in plan.get("Plans", []):
        yield from scans(child)


@pytest.mark.parametrize("limit_of_type", [True, False], ids=["type's limit", "given limit"])
# The plan of one execution, and the plan kept by a connection that prepared the statement.
@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_a_hold_reads_through_the_indexes_whatever_the_tables_size(
    loaded: SqlStore, limit_of_type: bool, plan: str
) -> None:
    statement = DriverStatement(HOLD[True][limit_of_type], loaded.engine)
    values = {"held_type": "big", "held_at": NOW + PENDING, "held_heartbeat": None, "held_limit": 1}
    with loaded.engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert isinstance(raw, psycopg.Connection)
        raw.execute(f"SET LOCAL plan_cache_mode = {plan}")
        found = raw.execute(b"EXPLAIN (FORMAT JSON) " + statement.sql, statement.params(values)).fetchone()
        conn.rollback()
    assert found is not None
    nodes = list(scans(found[0][0]["Plan"]))
    assert ("Seq Scan", "af_pull_tasks") not in nodes, nodes

    held = SqlPullStore(loaded).hold("big", None if limit_of_type else 1, NOW + PENDING)
    assert [(t.task_id, t.status) for t in held] == [("t00000", PullStatus.RUNNING)]
