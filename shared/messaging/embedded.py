"""The embedded broker: kombu's SQLAlchemy transport on a SQLite file.

Two changes over the stock transport: the SQLite file runs in WAL mode with a
busy timeout, since the API, the scheduler and every worker process poll it
at once; and ``polling_interval`` is honoured instead of being handed to
``create_engine`` (which rejects it).
"""

from __future__ import annotations

from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import sqlalchemy as sqla
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine

ALIAS = "asyncflow_sqlite"
SCHEME = "sqla+sqlite"


class Channel(sqla.Channel):
    def _engine_from_config(self) -> Engine:
        url = self.connection.client.hostname
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine


class Transport(sqla.Transport):
    Channel = Channel


def kombu_url(url: str) -> str:
    """Route ``sqla+sqlite://`` URLs to this transport; leave others alone."""
    if not url.startswith(SCHEME + ":"):
        return url
    TRANSPORT_ALIASES.setdefault(ALIAS, f"{__name__}:Transport")
    return f"{ALIAS}+{url[len('sqla+'):]}"
