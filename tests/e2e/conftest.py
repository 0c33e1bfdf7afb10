"""Backends for end-to-end tests: the embedded default, PostgreSQL + RabbitMQ, PostgreSQL + Redis."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import require_service, unreachable
from tests.e2e.stack import Stack, unique
from tests.integration.conftest import postgres_admin

BACKENDS = ["embedded", "postgres-rabbitmq", "postgres-redis"]


class PostgresDatabase:
    def __init__(self) -> None:
        admin, user = postgres_admin()
        with admin:
            self.name = unique("af_e2e")
            admin.execute(f'CREATE DATABASE "{self.name}"')
        self.url = f"postgresql+psycopg://{user}@127.0.0.1:5432/{self.name}"

    def drop(self) -> None:
        # A fresh connection: the server may have been restarted by a fault test.
        admin, _ = postgres_admin()
        with admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def _rabbitmq_url() -> tuple[str, str | None]:
    """A fresh vhost when rabbitmqctl is at hand, so parallel runs don't share queues."""
    require_service("RabbitMQ", unreachable(5672))
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        return "amqp://guest:guest@127.0.0.1:5672//", None
    vhost = unique("af_e2e")
    subprocess.run([ctl, "add_vhost", vhost], check=True, capture_output=True, timeout=60)
    subprocess.run(
        [ctl, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"],
        check=True, capture_output=True, timeout=60,
    )
    return f"amqp://guest:guest@127.0.0.1:5672/{vhost}", vhost


def _drop_vhost(vhost: str | None) -> None:
    if vhost:
        subprocess.run(["rabbitmqctl", "delete_vhost", vhost], capture_output=True, timeout=60)


@contextmanager
def open_stack(
    backend: str,
    home: Path,
    env: dict[str, str] | None = None,
    groups: list[list[str]] | None = None,
) -> Iterator[Stack]:
    """A running stack on ``backend`` with a database and a vhost of its own.

    ``groups``: one worker process per list of modules; None runs `asyncflow up`.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCFLOW_")}
    full_env = base | (env or {})
    cleanups: list[Callable[[], None]] = []
    if backend != "embedded":
        db = PostgresDatabase()
        cleanups.append(db.drop)
        full_env["ASYNCFLOW_DATABASE_URL"] = db.url
        if backend == "postgres-rabbitmq":
            url, vhost = _rabbitmq_url()
            cleanups.append(lambda: _drop_vhost(vhost))
        else:
            require_service("Redis", unreachable(6379))
            url = f"redis://127.0.0.1:6379/{random.randint(1, 15)}"
        full_env["ASYNCFLOW_BROKER_URL"] = url
        if full_env.get("ASYNCFLOW_MYSQL_ADMIN_URL") == "database":
            full_env["ASYNCFLOW_MYSQL_ADMIN_URL"] = db.url
    stack = Stack(backend, home, full_env, groups)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
        for cleanup in reversed(cleanups):
            cleanup()


@pytest.fixture(scope="module", params=BACKENDS)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    backend: str = request.param
    # Embedded: one worker for all; otherwise separate consumers per module, as deployed.
    groups = [["alpha", "beta", "monitor"]] if backend == "embedded" else [["alpha"], ["beta", "monitor"]]
    with open_stack(backend, tmp_path_factory.mktemp(backend), groups=groups) as s:
        yield s
