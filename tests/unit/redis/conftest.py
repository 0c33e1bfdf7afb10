"""Fixtures of the fake-Redis tier: one FakeServer per test behind kombu's real Redis transport."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import kombu.pools
import pytest
from celery import Celery
from kombu.transport import redis as kombu_redis

from shared.config import Settings
from shared.messaging import CeleryPublisher, make_celery
from shared.runtime import Runtime
from shared.storage import InMemoryStore
from shared.testing import ManualClock
from tests.unit.redis.support import DB, FLOWS, SCRIPT, Script, Worker, connection_class_on, unique_broker_url

# Short enough for a test to wait out, long enough to act within.
PAUSE = 0.2


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: socket.socket, address: Any) -> None:
        raise OSError(f"the fake-Redis tier opens no network connection (asked for {address!r})")

    def no_lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(f"the fake-Redis tier looks up no host (asked for {host!r})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", no_lookup)


@pytest.fixture(autouse=True)
def script() -> Iterator[Script]:
    SCRIPT.reset()
    yield SCRIPT
    SCRIPT.reset()


@pytest.fixture
def fake_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[fakeredis.FakeServer]:
    """The Redis of this test: every connection kombu opens reaches it."""
    server = fakeredis.FakeServer()
    monkeypatch.setattr(kombu_redis.Channel, "connection_class", connection_class_on(server))
    try:
        yield server
    finally:
        server.connected = True
        kombu.pools.reset()


@pytest.fixture
def redis_client(fake_server: fakeredis.FakeServer) -> Iterator[fakeredis.FakeRedis]:
    """A client of its own on the broker's database, to look at what kombu stored."""
    client = fakeredis.FakeRedis(server=fake_server, db=DB)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, broker_url=unique_broker_url(), database_url="sqlite://")


@pytest.fixture
def make_publisher(
    settings: Settings, fake_server: fakeredis.FakeServer
) -> Iterator[Callable[..., CeleryPublisher]]:
    """A publisher with its own app over this test's Redis; keyword arguments change the settings."""
    apps: list[Celery] = []

    def make(**overrides: Any) -> CeleryPublisher:
        changed = settings.model_copy(update=overrides)
        app = make_celery(changed)
        apps.append(app)
        publisher = CeleryPublisher(app, changed)
        publisher.PAUSE_AFTER_FAILURE = PAUSE
        return publisher

    try:
        yield make
    finally:
        for app in apps:
            app.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def runtime(settings: Settings, clock: ManualClock, fake_server: fakeredis.FakeServer) -> Iterator[Runtime]:
    """The real runtime, its CeleryPublisher included, over an in-memory store and this test's Redis."""
    rt = Runtime(settings, flows=FLOWS, store=InMemoryStore(), clock=clock)
    try:
        yield rt
    finally:
        rt.close()
        if "celery" in rt.__dict__:
            rt.celery.close()


@pytest.fixture
def publisher(runtime: Runtime) -> CeleryPublisher:
    publisher = runtime.service.publisher
    assert isinstance(publisher, CeleryPublisher)
    publisher.PAUSE_AFTER_FAILURE = PAUSE
    return publisher


@pytest.fixture
def worker(runtime: Runtime, clock: ManualClock) -> Iterator[Worker]:
    w = Worker(runtime, clock)
    try:
        yield w
    finally:
        w.close()
