"""Real databases for the integration and migration tiers.

PostgreSQL runs get a schema of their own (``af_test_<uuid>``) in the ``test``
database, reached through ``search_path`` in the URL and dropped afterwards, so
parallel runs and other suites never see each other's rows. When no server
answers, the tests skip locally and fail under CI=true (see tests/conftest.py).

The helpers are plain functions so tests/migrations can import them too:
``from tests.integration.conftest import postgres_schema``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, delete

from shared.migrate import upgrade
from shared.storage import InMemoryPullStore, InMemoryStore, PullStore, SqlStore, TaskStore, open_store
from shared.storage.base import ScheduleStore
from shared.storage.memory import InMemoryScheduleStore
from shared.storage.schema import (
    attempts,
    leases,
    pull_tasks,
    schedule_runs,
    schedules,
    task_events,
    task_types,
    tasks,
)
from shared.storage.sql_pull import SqlPullStore
from shared.storage.sql_schedules import SqlScheduleStore
from tests.conftest import require_service

SQL_BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]

PG_HOST = "127.0.0.1:5432"
PG_DATABASE = "test"
PG_USERS = ("postgres", "root")


def postgres_admin() -> tuple[psycopg.Connection, str]:
    """An autocommit connection to the test database, and the user that worked."""
    problems = []
    for user in PG_USERS:
        try:
            conn = psycopg.connect(
                f"postgresql://{user}@{PG_HOST}/{PG_DATABASE}", autocommit=True, connect_timeout=5
            )
        except psycopg.OperationalError as exc:
            problems.append(f"as {user}: {str(exc).strip()}")
            continue
        return conn, user
    require_service("PostgreSQL", "; ".join(problems))
    raise AssertionError("require_service returns only when there is no problem")


@contextmanager
def postgres_schema(migrate: bool = True) -> Iterator[tuple[str, str]]:
    """A fresh schema: yields (SQLAlchemy URL whose search_path is the schema, schema name)."""
    admin, user = postgres_admin()
    schema = f"af_test_{uuid.uuid4().hex[:16]}"
    with admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        url = (
            f"postgresql+psycopg://{user}@{PG_HOST}/{PG_DATABASE}"
            f"?options=-csearch_path%3D{schema}"
        )
        if migrate:
            upgrade(url)
        yield url, schema
    finally:
        # A fresh connection: the fault tests restart the server during the run.
        admin, _ = postgres_admin()
        with admin:
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def empty_tables(url: str) -> None:
    """Delete every row of every table (tests share one migrated schema per run)."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for table in (attempts, task_events, tasks, pull_tasks, task_types, schedule_runs, schedules, leases):
                conn.execute(delete(table))
    finally:
        engine.dispose()


def migrated_url(request: pytest.FixtureRequest, backend: str, sqlite_file: Path) -> str:
    """An empty, migrated database: a new SQLite file, or the run's PostgreSQL schema emptied."""
    if backend == "sqlite":
        url = f"sqlite:///{sqlite_file}"
        upgrade(url)
        return url
    url = str(request.getfixturevalue("postgres_url"))
    empty_tables(url)
    return url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """URL of a migrated PostgreSQL schema, created once per test run."""
    with postgres_schema(migrate=True) as (url, _schema):
        yield url


@contextmanager
def _sql_store(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> Iterator[SqlStore]:
    store = open_store(migrated_url(request, backend, tmp_path / "tasks.sqlite"))
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(params=SQL_BACKENDS)
def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlStore]:
    """An empty, migrated SQL store on SQLite and on PostgreSQL."""
    with _sql_store(request, request.param, tmp_path) as store:
        yield store


@pytest.fixture(params=["memory", *SQL_BACKENDS])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TaskStore]:
    """The shipped in-memory fake and the SQL stores: contract tests run on each."""
    if request.param == "memory":
        yield InMemoryStore()
        return
    with _sql_store(request, request.param, tmp_path) as sql:
        yield sql


@pytest.fixture
def pull_store(store: TaskStore) -> PullStore:
    """The v1 task store that goes with ``store``: in memory, or in the same database."""
    if isinstance(store, SqlStore):
        return SqlPullStore(store)
    return InMemoryPullStore()


@pytest.fixture
def schedule_store(store: TaskStore, pull_store: PullStore) -> ScheduleStore:
    """The schedule store that goes with ``store`` and ``pull_store``."""
    if isinstance(store, SqlStore):
        return SqlScheduleStore(store)
    assert isinstance(store, InMemoryStore) and isinstance(pull_store, InMemoryPullStore)
    return InMemoryScheduleStore(store, pull_store)


@pytest.fixture
def broker_url() -> Iterator[str]:
    """A RabbitMQ vhost of the test's own, deleted after it."""
    from tests.e2e.conftest import _drop_vhost, _rabbitmq_url  # it imports this module

    url, vhost = _rabbitmq_url()
    try:
        yield url
    finally:
        _drop_vhost(vhost)
