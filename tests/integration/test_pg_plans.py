"""PostgreSQL's plans of the v1 claim and of the due messages once the tables are large and analyzed.

A plan is chosen per execution from the table's statistics, so a statement that
reads a few rows of a small table may read the whole table once it has grown:
these tests load enough pending tasks for that choice to matter and ask
PostgreSQL what it would do.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import insert, select

from shared.flows import load_flows
from shared.pull.rules import PullStatus, TaskType, new_pull_task
from shared.service import Submission, TaskService
from shared.storage import Outstanding, SqlStore, open_store
from shared.storage.driver import DriverStatement
from shared.storage.schema import pull_tasks, tasks
from shared.storage.sql import DUE_KINDS, WAITING_FLOWS
from shared.storage.sql_pull import HOLD, SqlPullStore, create_row
from shared.testing import QueuePublisher
from tests.integration.conftest import empty_tables

pytestmark = pytest.mark.postgres

NOW = 1_700_000_000.0
SUPPORT = Path(__file__).resolve().parents[1] / "support"
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


def indexes(plan: dict[str, Any]) -> Iterator[str]:
    """The indexes an EXPLAIN (FORMAT JSON) plan reads."""
    if "Index Name" in plan:
        yield plan["Index Name"]
    for child in plan.get("Plans", []):
        yield from indexes(child)


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


@pytest.fixture
def backlog(postgres_url: str) -> Iterator[SqlStore]:
    """A store holding a batch backlog: PENDING first steps of ``noop`` waiting, then a few of ``three``."""
    empty_tables(postgres_url)
    store = open_store(postgres_url)
    service = TaskService(store, QueuePublisher(), load_flows(SUPPORT / "flows.yaml"))
    for _ in range(PENDING // 1000):
        service.submit_many([Submission("noop", {}) for _ in range(1000)])
    service.submit_many([Submission("three", {}) for _ in range(10)])
    with store.transaction() as conn:
        conn.exec_driver_sql("ANALYZE af_tasks")
    try:
        yield store
    finally:
        store.close()
        empty_tables(postgres_url)


def test_due_messages_of_each_kind_and_the_waiting_flows_are_found_through_their_indexes(backlog: SqlStore) -> None:
    from sqlalchemy.dialects import postgresql

    queries = {f"due {kind.value}": DUE_KINDS[kind] for kind in Outstanding}
    with backlog.engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert isinstance(raw, psycopg.Connection)
        plans = {}
        for name, condition in queries.items():
            query = select(tasks.c.task_id).where(tasks.c.due_at <= NOW * 2, condition, tasks.c.flow == "three")
            sql = str(query.order_by(tasks.c.due_at).limit(500).compile(
                dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}
            ))
            plans[name] = raw.execute("EXPLAIN (FORMAT JSON) " + sql).fetchone()
        plans["waiting flows"] = raw.execute("EXPLAIN (FORMAT JSON) " + str(WAITING_FLOWS)).fetchone()
        conn.rollback()
    expected = {"due sent": "ix_af_tasks_due_sent", "due later": "ix_af_tasks_due_later"}
    for name, found in plans.items():
        assert found is not None
        nodes = list(scans(found[0][0]["Plan"]))
        assert ("Seq Scan", "af_tasks") not in nodes, (name, nodes)
        # Each through its own index: through another, a backlog would be read past.
        assert set(indexes(found[0][0]["Plan"])) == {expected.get(name, "ix_af_tasks_due_first")}, name
    # Behind a backlog of ``noop``, the first steps of ``three`` are found all the same.
    assert len(backlog.due(NOW * 2, 500, Outstanding.FIRST, "three")) == 10
    assert backlog.waiting_flows() == ["noop", "three"]  # noop's waited longest
