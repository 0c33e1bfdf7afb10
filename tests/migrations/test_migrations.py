"""Alembic migrations from empty equal the models, on SQLite and on PostgreSQL.

Nothing is ignored in the comparison: column types and server defaults are
compared too (``compare_type``/``compare_server_default``), besides tables,
columns, nullability and indexes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, inspect

from shared.migrate import alembic_config, downgrade, upgrade
from shared.storage.schema import metadata
from tests.integration.conftest import postgres_schema

CORE_TABLES = {
    "af_tasks", "af_attempts", "af_task_types", "af_pull_tasks", "af_schedules", "af_schedule_runs", "af_leases",
    "af_task_events", "af_processes",
}


class Database:
    def __init__(self, url: str, schema: str | None) -> None:
        self.url = url
        self.schema = schema  # where the tables must land (PostgreSQL), None for SQLite
        self.engine: Engine = create_engine(url)

    def tables(self) -> set[str]:
        with self.engine.connect() as conn:
            return set(inspect(conn).get_table_names(schema=self.schema))

    def revision(self) -> str | None:
        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def differences(self) -> list:
        with self.engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            return compare_metadata(context, metadata)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        db = Database(f"sqlite:///{tmp_path / 'migrate.sqlite'}", None)
        try:
            yield db
        finally:
            db.engine.dispose()
        return
    with postgres_schema(migrate=False) as (url, schema):
        db = Database(url, schema)
        try:
            yield db
        finally:
            db.engine.dispose()


def head() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None
    return head


def test_the_migrations_form_one_line_of_history() -> None:
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert len(script.get_heads()) == 1
    assert len(script.get_bases()) == 1


def test_upgrade_from_empty_matches_the_models(database: Database) -> None:
    assert database.tables() == set()
    upgrade(database.url)
    assert database.tables() == CORE_TABLES | {"alembic_version"}
    assert database.revision() == head()
    assert database.differences() == []


def test_upgrade_twice_is_a_no_op(database: Database) -> None:
    upgrade(database.url)
    upgrade(database.url)
    assert database.revision() == head()
    assert database.differences() == []


def test_downgrade_to_base_removes_the_tables(database: Database) -> None:
    upgrade(database.url)
    downgrade(database.url, "base")
    assert database.tables() == {"alembic_version"}
    assert database.revision() is None
    # And the way back up still works from there.
    upgrade(database.url)
    assert database.tables() == CORE_TABLES | {"alembic_version"}
    assert database.differences() == []


def test_comparison_would_notice_a_drift(database: Database) -> None:
    """Guard against a comparison that passes vacuously (e.g. the wrong schema)."""
    upgrade(database.url)
    with database.engine.begin() as conn:
        conn.exec_driver_sql("DROP INDEX ix_af_tasks_due_sent")
        conn.exec_driver_sql("ALTER TABLE af_attempts ADD COLUMN extra INTEGER")
    kinds = sorted(str(diff[0]) if isinstance(diff, tuple) else "modify" for diff in database.differences())
    assert kinds == ["add_index", "remove_column"]
