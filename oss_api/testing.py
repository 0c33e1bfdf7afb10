"""The HTTP API in-process, for tests: the real app over a given runtime."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from oss_api.app import create_app
from shared.runtime import Runtime

with warnings.catch_warnings():
    # starlette >= 1.x prefers httpx2 for its TestClient and warns when it falls back
    # to httpx (a project dependency); the client works the same either way.
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from fastapi.testclient import TestClient


@contextmanager
def open_client(runtime: Runtime, raise_server_exceptions: bool = True) -> Iterator[TestClient]:
    """A client of ``create_app(runtime)``, with the app's start-up and shutdown run around it."""
    with TestClient(create_app(runtime), raise_server_exceptions=raise_server_exceptions) as client:
        yield client

__all__ = ["TestClient", "open_client"]
