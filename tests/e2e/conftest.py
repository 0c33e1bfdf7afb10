"""Backends for end-to-end tests: the embedded default, PostgreSQL + RabbitMQ, PostgreSQL + Redis."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from tests.conftest import redis_db, require_service, unreachable
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


class _Vhosts:
    """Fresh RabbitMQ vhosts, so runs on one machine never share queues.

    rabbitmqctl boots an Erlang VM per call (about a second): the next vhost is
    made, and used ones deleted, on a thread of their own while tests run.
    """

    def __init__(self, ctl: str) -> None:
        self.ctl = ctl
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="vhosts")
        self.ready: Future[str] | None = None
        self.deleting: list[Future[None]] = []

    def take(self) -> str:
        ready, self.ready = self.ready, self.thread.submit(self._add)
        try:
            return ready.result() if ready is not None else self._add()
        except (OSError, subprocess.SubprocessError):  # made while RabbitMQ was restarting
            return self._add()

    def drop(self, vhost: str) -> None:
        self.deleting.append(self.thread.submit(self._delete, vhost))

    def close(self) -> None:
        if self.ready is not None:
            with suppress(OSError, subprocess.SubprocessError):
                self.drop(self.ready.result())
        for deleting in self.deleting:
            with suppress(OSError, subprocess.SubprocessError):
                deleting.result()
        self.thread.shutdown()

    def _add(self) -> str:
        vhost = unique("af_e2e")
        self._ctl("add_vhost", vhost)
        self._ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        return vhost

    def _delete(self, vhost: str) -> None:
        self._ctl("delete_vhost", vhost)

    def _ctl(self, *args: str) -> None:
        subprocess.run([self.ctl, *args], check=True, capture_output=True, timeout=60)


_vhosts: _Vhosts | None = None


def _rabbitmq_url() -> tuple[str, str | None]:
    """A fresh vhost when rabbitmqctl is at hand, so parallel runs don't share queues."""
    global _vhosts
    require_service("RabbitMQ", unreachable(5672))
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        return "amqp://guest:guest@127.0.0.1:5672//", None
    if _vhosts is None:
        _vhosts = _Vhosts(ctl)
    vhost = _vhosts.take()
    return f"amqp://guest:guest@127.0.0.1:5672/{vhost}", vhost


def _drop_vhost(vhost: str | None) -> None:
    if vhost and _vhosts is not None:
        _vhosts.drop(vhost)


def close_vhosts() -> None:
    """Delete the vhost made ahead and wait for the deletions (end of the session)."""
    if _vhosts is not None:
        _vhosts.close()


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
            url = f"redis://127.0.0.1:6379/{redis_db()}"
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
