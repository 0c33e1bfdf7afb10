"""Shared fixtures: our own environment cleared, real services found or skipped.

Real-service fixtures skip locally with the reason when the service is absent;
under CI (CI=true) they fail instead, so a green CI run means they ran.
"""

from __future__ import annotations

import compileall
import os
import socket
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
    """Fault tests stop shared services (RabbitMQ, PostgreSQL): run them last."""
    items.sort(key=lambda item: item.get_closest_marker("faults") is not None)
