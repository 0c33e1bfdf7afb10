"""Shared fixtures: our own environment cleared, real services found or skipped.

Real-service fixtures skip locally with the reason when the service is absent;
under CI (CI=true) they fail instead, so a green CI run means they ran.
"""

from __future__ import annotations

import compileall
import os
import random
import socket
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("ASYNCFLOW_"):
            monkeypatch.delenv(key)


def unreachable(port: int) -> str | None:
    """Why nothing answers on 127.0.0.1:``port``, or None when something does."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return None
    except OSError as exc:
        return f"nothing listens on 127.0.0.1:{port} ({exc})"


def require_service(name: str, problem: str | None) -> None:
    """Skip (locally) or fail (CI) when a real service is not usable."""
    if problem is None:
        return
    message = f"{name} is not available: {problem}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: real-service tests must run)")
    pytest.skip(message)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile the project once for the hundreds of processes the tests start.

    Where PYTHONDONTWRITEBYTECODE is set (as on some CI machines) no process
    leaves its bytecode behind, and each one started compiled the project's
    sources again: about 0.4 s of CPU per API, worker or scheduler started.
    """
    for package in ("asyncflow", "shared", "oss_api", "modules", "tests/support"):
        compileall.compile_dir(REPO / package, quiet=1)


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.e2e.conftest import close_vhosts

    close_vhosts()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test a node id of its own; fault tests last.

    Schemathesis names a test per API operation, but under pytest 9.2 they all
    get the test function's node id, and pytest-xdist tells tests apart by node
    id: with ``-n`` one operation ran and the other thirty were dropped without a
    word. The check after the renaming turns any such case into an error.
    """
    for item in items:
        label = getattr(item, "operation_label", None)  # a schemathesis test
        if label and item._id.params is None:  # pytest's own node id, private: no public setter
            item._id = item._id.with_params(label)
    twice = sorted(node_id for node_id, n in Counter(item.nodeid for item in items).items() if n > 1)
    if twice:
        raise pytest.UsageError(f"tests with the same node id (-n would run one of each): {twice}")
    # Fault tests stop and kill what other tests use.
    items.sort(key=lambda item: item.get_closest_marker("faults") is not None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that stops a shared server never runs beside others.

    With ``-n`` (pytest-xdist) the README runs ``-m 'not outage'`` in two
    processes, then the outage tests alone: RabbitMQ or PostgreSQL stopped under
    the other process's tests would fail them.
    """
    if os.environ.get("PYTEST_XDIST_WORKER") and item.get_closest_marker("outage"):
        pytest.fail(
            "this test stops RabbitMQ or PostgreSQL under the other tests: run it without -n "
            "(pytest -n 2 -m 'not outage' && pytest -m outage)",
            pytrace=False,
        )


def redis_db() -> int:
    """A Redis database (1-15) for a stack; parallel test processes draw from apart shares."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    share = [db for db in range(1, 16) if db % count == index % count]
    return random.choice(share)
