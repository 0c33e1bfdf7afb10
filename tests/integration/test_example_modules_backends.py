"""The example modules' contract tests again, on PostgreSQL and MariaDB.

The tests are imported from tests/unit/test_example_modules.py, so pytest
collects them here a second time with this file's ``settings``,
``instance_settings`` and ``probe`` fixtures:

- resource and monitor keep their tables in a throwaway PostgreSQL database;
- mysql creates instances on PostgreSQL (registry in that throwaway database)
  and on MariaDB (registry in a SQLite file), checked through a separate admin
  connection that logs in as the instance user.

An unreachable server skips these tests locally and fails them under CI=true.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pymysql
import pytest
from psycopg import sql

from modules import _db
from shared.config import Settings
from tests.conftest import require_service, unreachable
from tests.integration.conftest import postgres_admin
from tests.unit.test_example_modules import (  # noqa: F401  (collected again, on these backends)
    instance_names,
    test_a_deduct_that_cannot_be_covered_takes_nothing,
    test_a_name_taken_by_another_task_fails_and_its_rollback_spares_the_owner,
    test_a_retried_task_takes_its_quota_again_after_a_restore,
    test_an_alarm_is_recorded_as_kind_alarm,
    test_an_event_is_recorded_once_per_step_execution,
    test_an_unregistered_database_is_never_adopted_nor_dropped,
    test_bad_parameters_fail_permanently,
    test_check_accepts_a_request_that_fits,
    test_check_and_drop_instance_deprovision_by_name,
    test_check_refuses_more_than_is_free,
    test_concurrent_deducts_never_overdraw,
    test_concurrent_deliveries_of_one_deduct_deduct_once,
    test_deduct_delivered_twice_deducts_once,
    test_deduct_then_restore_balances_to_the_unit,
    test_existing_quota_rows_are_not_reseeded,
    test_fail_init_leaves_a_database_that_clean_instance_removes,
    test_init_creates_database_and_user_and_clean_removes_them,
    test_release_reservation_gives_back_another_tasks_deduction,
    test_restore_delivered_twice_gives_back_once,
    test_restore_without_a_deduction_changes_nothing,
    test_startup_seeds_the_configured_quota,
)

MARIADB = {"host": "127.0.0.1", "port": 3306, "user": "root"}
MARIADB_ADMIN_URL = "mysql+pymysql://root@127.0.0.1:3306/test"

POSTGRES = pytest.param("postgres", marks=pytest.mark.postgres)
MARIADB_PARAM = pytest.param("mariadb", marks=pytest.mark.mariadb)


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    _db.dispose_engines()


# ---------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="module")
def pg_admin() -> Iterator[tuple[psycopg.Connection, str]]:
    """An autocommit connection to the ``test`` database, and the user that worked."""
    conn, user = postgres_admin()
    with conn:
        yield conn, user


@pytest.fixture
def pg_database(pg_admin: tuple[psycopg.Connection, str]) -> Iterator[str]:
    """A fresh database for one test's module tables; dropped afterwards."""
    admin, user = pg_admin
    name = f"af_it_{uuid.uuid4().hex[:12]}"
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield f"postgresql+psycopg://{user}@127.0.0.1:5432/{name}"
    finally:
        _db.dispose_engines()
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class PostgresProbe:
    def __init__(self, admin: psycopg.Connection) -> None:
        self.admin = admin

    def database_exists(self, name: str) -> bool:
        return self._one("SELECT 1 FROM pg_database WHERE datname = %s", name)

    def user_exists(self, name: str) -> bool:
        return self._one("SELECT 1 FROM pg_roles WHERE rolname = %s AND rolcanlogin", name)

    def can_login(self, name: str, password: str) -> bool:
        """Logs in as the instance user and creates a table: it owns its database."""
        try:
            with psycopg.connect(
                host="127.0.0.1", port=5432, user=name, password=password, dbname=name, connect_timeout=5
            ) as conn:
                conn.execute("CREATE TABLE probe (x integer)")
                conn.execute("DROP TABLE probe")
        except psycopg.Error:
            return False
        return True

    def create_foreign(self, name: str) -> None:
        self.admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def drop(self, name: str) -> None:
        self.admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        self.admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))

    def _one(self, query: str, name: str) -> bool:
        return self.admin.execute(query, (name,)).fetchone() is not None


# ---------------------------------------------------------------- MariaDB


@pytest.fixture(scope="module")
def mariadb_admin() -> Iterator[pymysql.connections.Connection]:
    require_service("MariaDB", unreachable(3306))
    try:
        conn = pymysql.connect(**MARIADB, database="test", autocommit=True, connect_timeout=5)
    except pymysql.MySQLError as exc:
        require_service("MariaDB", f"cannot log in as root: {exc}")
        raise
    with conn:
        yield conn


class MariadbProbe:
    def __init__(self, admin: pymysql.connections.Connection) -> None:
        self.admin = admin

    def database_exists(self, name: str) -> bool:
        return self._one("SELECT 1 FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = %s", name)

    def user_exists(self, name: str) -> bool:
        return self._one("SELECT 1 FROM mysql.user WHERE User = %s", name)

    def can_login(self, name: str, password: str) -> bool:
        try:
            login = {**MARIADB, "user": name, "password": password, "database": name}
            conn = pymysql.connect(**login, connect_timeout=5)
        except pymysql.MySQLError:
            return False
        with conn, conn.cursor() as cur:
            cur.execute("CREATE TABLE probe (x integer)")
            cur.execute("DROP TABLE probe")
        return True

    def create_foreign(self, name: str) -> None:
        self._run(f"CREATE DATABASE `{name}`")

    def drop(self, name: str) -> None:
        self._run(f"DROP DATABASE IF EXISTS `{name}`")
        self._run(f"DROP USER IF EXISTS '{name}'@'%'")

    def _one(self, query: str, name: str) -> bool:
        with self.admin.cursor() as cur:
            cur.execute(query, (name,))
            return cur.fetchone() is not None

    def _run(self, statement: str) -> None:
        # Names here come from instance_names (t_ + hex), so formatting them in is safe.
        with self.admin.cursor() as cur:
            cur.execute(statement)


# ---------------------------------------------------------------- the fixtures the tests ask for


@pytest.fixture(params=[POSTGRES])
def settings(tmp_path: Path, pg_database: str) -> Settings:
    return Settings(home=tmp_path, database_url=pg_database)


@pytest.fixture(params=[POSTGRES, MARIADB_PARAM])
def instance_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def instance_settings(
    instance_backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Settings:
    if instance_backend == "postgres":
        _, user = request.getfixturevalue("pg_admin")
        admin_url = f"postgresql+psycopg://{user}@127.0.0.1:5432/test"
        registry_url = request.getfixturevalue("pg_database")
    else:
        request.getfixturevalue("mariadb_admin")
        admin_url, registry_url = MARIADB_ADMIN_URL, f"sqlite:///{tmp_path}/registry.sqlite"
    monkeypatch.setenv("ASYNCFLOW_MYSQL_ADMIN_URL", admin_url)
    return Settings(home=tmp_path, database_url=registry_url)


@pytest.fixture
def probe(instance_backend: str, request: pytest.FixtureRequest) -> PostgresProbe | MariadbProbe:
    if instance_backend == "postgres":
        return PostgresProbe(request.getfixturevalue("pg_admin")[0])
    return MariadbProbe(request.getfixturevalue("mariadb_admin"))
