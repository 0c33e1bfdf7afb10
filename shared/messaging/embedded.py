"""The embedded broker: kombu's SQLAlchemy transport on a SQLite file.

Two changes over the stock transport: the SQLite file runs in WAL mode with a
busy timeout, since the API, the scheduler and every worker process poll it
at once; and ``polling_interval`` is honoured instead of being handed to
``create_engine`` (which rejects it).
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import sqlalchemy as sqla
from sqlalchemy.engine import Engine

from shared.sqlite import sqlite_engine

ALIAS = "asyncflow_sqlite"
SCHEME = "sqla+sqlite"


class Channel(sqla.Channel):
    def _engine_from_config(self) -> Engine:
        # kombu issues its own BEGIN IMMEDIATE when it takes a message.
        return sqlite_engine(self.connection.client.hostname, immediate_writes=False)


class Transport(sqla.Transport):
    Channel = Channel


def kombu_url(url: str) -> str:
    """Route ``sqla+sqlite://`` URLs to this transport; leave others alone."""
    if not url.startswith(SCHEME + ":"):
        return url
    TRANSPORT_ALIASES.setdefault(ALIAS, f"{__name__}:Transport")
    return f"{ALIAS}+{url[len('sqla+'):]}"
