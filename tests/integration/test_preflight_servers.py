"""The version check against the real local servers: it reads their versions and lets them pass."""

from __future__ import annotations

import pytest

from shared import preflight
from shared.config import Settings
from tests.conftest import require_service, unreachable
from tests.integration.conftest import postgres_admin

RABBIT = "amqp://guest:guest@127.0.0.1:5672//"
REDIS = "redis://127.0.0.1:6379/0"


@pytest.mark.postgres
def test_postgresql_version_is_read_and_passes() -> None:
    conn, user = postgres_admin()
    conn.close()
    url = f"postgresql+psycopg://{user}@127.0.0.1:5432/test"
    assert preflight.probe_postgresql(url) >= preflight.POSTGRESQL.version
    preflight.check_servers(Settings(database_url=url, broker_url="memory://"))


@pytest.mark.rabbitmq
def test_rabbitmq_version_is_read_and_passes() -> None:
    require_service("RabbitMQ", unreachable(5672))
    assert preflight.probe_rabbitmq(RABBIT) >= preflight.RABBITMQ.version
    preflight.check_servers(Settings(broker_url=RABBIT))


@pytest.mark.redis
def test_redis_version_is_read_and_passes() -> None:
    require_service("Redis", unreachable(6379))
    assert preflight.probe_redis(REDIS) >= preflight.REDIS.version
    preflight.check_servers(Settings(broker_url=REDIS))


@pytest.mark.redis
def test_a_real_server_below_the_floor_is_refused_with_its_own_version() -> None:
    """The floor raised above what the local Redis reports: the message carries the real version."""
    require_service("Redis", unreachable(6379))
    found = preflight.probe_redis(REDIS)
    above = preflight.Minimum("Redis", (found[0] + 1,), "test floor")
    message = preflight.refusal(above, found, preflight.location(REDIS))
    assert message is not None and f"Redis {preflight.shown(found)} at redis://127.0.0.1:6379" in message
