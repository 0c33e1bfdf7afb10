"""The servers' minimum versions: parsing, comparison, the message, and which servers are checked."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from shared import preflight
from shared.config import Settings
from shared.preflight import POSTGRESQL, RABBITMQ, REDIS, Minimum, Version

PG = "postgresql+psycopg://app:s3cret@db.example:5433/tasks"
RABBIT = "amqp://guest:guest@mq.example:5672//"
REDIS_URL = "redis://:pw@cache.example:6379/0"


@pytest.mark.parametrize(
    ("text", "version"),
    [("6.2.14", (6, 2, 14)), ("3.13.7+dfsg-1", (3, 13, 7)), ("v7.2", (7, 2)), ("4.0.0-beta.1", (4, 0, 0)), ("16", (16,))],
)
def test_parse_version_reads_the_leading_dotted_number(text: str, version: Version) -> None:
    assert preflight.parse_version(text) == version


def test_parse_version_refuses_what_is_no_version() -> None:
    with pytest.raises(ValueError, match="not a version"):
        preflight.parse_version("unknown")


@pytest.mark.parametrize(("num", "version"), [(150020, (15, 20)), (130000, (13, 0)), (90624, (9, 6, 24))])
def test_postgres_version_num(num: int, version: Version) -> None:
    assert preflight.postgres_version(num) == version


@pytest.mark.parametrize(
    ("found", "refused"),
    [((6, 0, 16), True), ((6, 1, 99), True), ((6, 2), False), ((6, 2, 0), False), ((7, 0, 15), False), ((5,), True)],
)
def test_redis_floor_is_6_2(found: Version, refused: bool) -> None:
    assert (preflight.refusal(REDIS, found, "redis://h:6379") is not None) is refused


def test_the_message_names_server_version_minimum_reason_and_place() -> None:
    message = preflight.refusal(REDIS, (6, 0, 16), "redis://cache.example:6379")
    assert message == (
        "Redis 6.0.16 at redis://cache.example:6379 is too old: Asyncflow needs Redis 6.2 or later "
        "(the Redis broker transport uses ZRANGE … BYSCORE REV). "
        "Upgrade the server or point Asyncflow at another one."
    )


def test_location_drops_credentials_and_path() -> None:
    assert preflight.location(PG) == "postgresql+psycopg://db.example:5433"
    assert preflight.location(REDIS_URL) == "redis://cache.example:6379"


@pytest.mark.parametrize(
    ("database", "broker", "expected"),
    [
        (None, None, []),
        (PG, None, [(POSTGRESQL, PG)]),
        (PG, RABBIT, [(POSTGRESQL, PG), (RABBITMQ, RABBIT)]),
        (None, REDIS_URL, [(REDIS, REDIS_URL)]),
        ("sqlite:///x.sqlite", "memory://", []),
    ],
)
def test_servers_follow_the_urls(
    database: str | None, broker: str | None, expected: list[tuple[Minimum, str]]
) -> None:
    assert preflight.servers(Settings(database_url=database, broker_url=broker)) == expected


@pytest.mark.parametrize(
    ("broker", "kind"),
    [
        (None, "embedded"),
        ("amqp://guest:guest@mq:5672//", "rabbitmq"),
        ("amqps://mq:5671//", "rabbitmq"),
        ("pyamqp://mq//", "rabbitmq"),
        ("redis://cache:6379/0", "redis"),
        ("rediss://cache:6380/0", "redis"),
        ("memory://", "other"),
    ],
)
def test_the_broker_kind_is_read_off_the_url(broker: str | None, kind: str) -> None:
    assert Settings(broker_url=broker).broker_kind() == kind


def probes(**versions: Version) -> dict[Minimum, preflight.Probe]:
    by_name = {"postgresql": POSTGRESQL, "redis": REDIS, "rabbitmq": RABBITMQ}
    return {by_name[name]: (lambda url, v=v: v) for name, v in versions.items()}


def test_an_old_server_stops_the_start_with_every_reason() -> None:
    settings = Settings(database_url=PG, broker_url=REDIS_URL)
    with pytest.raises(SystemExit) as stopped:
        preflight.check_servers(settings, probes(postgresql=(12, 17), redis=(6, 0, 16)))
    message = str(stopped.value.code)
    assert "PostgreSQL 12.17 at postgresql+psycopg://db.example:5433 is too old" in message
    assert "Redis 6.0.16 at redis://cache.example:6379 is too old" in message
    assert "s3cret" not in message and "pw@" not in message


def test_recent_servers_pass() -> None:
    settings = Settings(database_url=PG, broker_url=RABBIT)
    preflight.check_servers(settings, probes(postgresql=(16, 2), rabbitmq=(3, 13, 7)))


def test_an_unreachable_server_is_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    def down(url: str) -> Version:
        raise ConnectionRefusedError("connection refused")

    settings = Settings(database_url=PG, broker_url=RABBIT)
    with caplog.at_level(logging.WARNING, logger="shared.preflight"):
        preflight.check_servers(settings, {POSTGRESQL: down, RABBITMQ: down})
    assert "could not read the PostgreSQL version at postgresql+psycopg://db.example:5433" in caplog.text
    assert "could not read the RabbitMQ version" in caplog.text


def test_an_old_sqlite_library_stops_the_embedded_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 31, 1))
    with pytest.raises(SystemExit, match=r"SQLite 3\.31\.1 at this Python's sqlite3 library is too old"):
        preflight.check_servers(Settings(), {})
