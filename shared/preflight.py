"""The servers' versions, checked when a process starts: an old one stops it with a clear message.

Without this check an old server fails later and obscurely (Redis 6.0 answers
the broker's ``ZRANGE … BYSCORE REV`` with "value is not an integer or out of
range" on every run). A server that does not answer is not refused here: the
processes already ride out outages, so the check is skipped with a warning.
"""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from shared.config import Settings

log = logging.getLogger(__name__)

Version = tuple[int, ...]

# A check never holds a start up for long: a server that does not answer within
# this many seconds is left to the process's own reconnects.
CONNECT_TIMEOUT = 3.0


@dataclass(frozen=True)
class Minimum:
    server: str
    version: Version
    why: str


# The README's "Requirements" lists the same floors; keep them together.
POSTGRESQL = Minimum("PostgreSQL", (13,), "the oldest release Asyncflow is built and tested for")
RABBITMQ = Minimum("RabbitMQ", (3, 8), "the oldest release Asyncflow is built and tested for")
REDIS = Minimum("Redis", (6, 2), "the Redis broker transport uses ZRANGE … BYSCORE REV")
SQLITE = Minimum("SQLite", (3, 35), "the embedded store uses UPDATE … RETURNING")


def parse_version(text: str) -> Version:
    """The leading dotted number of a version string: "3.13.7+dfsg" and "6.2.14" alike."""
    found = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if found is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in found.group(1).split("."))


def postgres_version(server_version_num: int) -> Version:
    """PostgreSQL's ``server_version_num``: 150020 is 15.20 (and 90624 is 9.6.24, before 10)."""
    if server_version_num >= 100000:
        return server_version_num // 10000, server_version_num % 10000
    return server_version_num // 10000, server_version_num // 100 % 100, server_version_num % 100


def shown(version: Version) -> str:
    return ".".join(str(part) for part in version)


def refusal(minimum: Minimum, found: Version, where: str) -> str | None:
    """What to tell the operator when ``found`` is below ``minimum``; None when it is enough."""
    if found >= minimum.version:
        return None
    return (
        f"{minimum.server} {shown(found)} at {where} is too old: Asyncflow needs {minimum.server} "
        f"{shown(minimum.version)} or later ({minimum.why}). Upgrade the server or point Asyncflow at another one."
    )


def location(url: str) -> str:
    """scheme://host:port of a URL, without its credentials (for messages)."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port else "")


# --- probes (I/O): the version a server reports -------------------------------------------


def probe_postgresql(url: str) -> Version:
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(url, connect_args={"connect_timeout": int(CONNECT_TIMEOUT)}, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return postgres_version(int(conn.execute(text("SHOW server_version_num")).scalar_one()))
    finally:
        engine.dispose()


def probe_redis(url: str) -> Version:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT)
    try:
        return parse_version(str(client.info("server")["redis_version"]))
    finally:
        client.close()


def probe_rabbitmq(url: str) -> Version:
    from kombu.connection import Connection

    with Connection(url, connect_timeout=CONNECT_TIMEOUT) as conn:  # type: ignore[no-untyped-call]
        conn.ensure_connection(max_retries=0)
        version = conn.connection.server_properties.get("version", "")
    return parse_version(version.decode() if isinstance(version, bytes) else str(version))


Probe = Callable[[str], Version]
PROBES: Mapping[Minimum, Probe] = {POSTGRESQL: probe_postgresql, REDIS: probe_redis, RABBITMQ: probe_rabbitmq}


def servers(settings: Settings) -> list[tuple[Minimum, str]]:
    """The servers ``settings`` point at that have a minimum version, with their URLs."""
    found = []
    database, broker = settings.resolved_database_url(), settings.resolved_broker_url()
    if database.startswith("postgresql"):
        found.append((POSTGRESQL, database))
    kind = settings.broker_kind()
    if kind == "redis":
        found.append((REDIS, broker))
    elif kind == "rabbitmq":
        found.append((RABBITMQ, broker))
    return found


def check_servers(settings: Settings, probes: Mapping[Minimum, Probe] = PROBES) -> None:
    """Stop the start (SystemExit with the reason) when a configured server is too old."""
    problems = []
    if settings.resolved_database_url().startswith("sqlite") or settings.is_embedded_broker():
        problems.append(refusal(SQLITE, sqlite3.sqlite_version_info, "this Python's sqlite3 library"))
    for minimum, url in servers(settings):
        try:
            found = probes[minimum](url)
        except Exception as exc:  # any driver's error: unreachable now is not "too old"
            log.warning("could not read the %s version at %s (%s); not checked", minimum.server, location(url), exc)
            continue
        problems.append(refusal(minimum, found, location(url)))
    refused = [p for p in problems if p]
    if refused:
        raise SystemExit("\n".join(refused))
