"""The embedded broker: kombu's SQLAlchemy transport on a SQLite file.

Three changes over the stock transport: the SQLite file runs in WAL mode with a
busy timeout, since the API, the scheduler and every worker process poll it
at once; ``polling_interval`` is honoured instead of being handed to
``create_engine`` (which rejects it); and on Linux a consumer with nothing to
do sleeps until the broker file changes (inotify) instead of polling, so a
published message is taken within milliseconds and an idle worker costs nothing.
"""

from __future__ import annotations

import logging
import os
import select
import time
from pathlib import Path
from queue import Empty
from typing import Any
from weakref import WeakSet

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import sqlalchemy as sqla
from sqlalchemy.engine import Engine, make_url

from shared.sqlite import sqlite_engine

log = logging.getLogger(__name__)

ALIAS = "asyncflow_sqlite"
SCHEME = "sqla+sqlite"

# With wake-ups, an idle consumer still looks once in this long: a safety net in
# case a change went unnoticed, not the way messages are found.
WOKEN_POLL_INTERVAL = 1.0


class BrokerFileWatch:
    """Wakes a waiting consumer when the broker's SQLite file is written (a publish).

    Watches the file's folder (the write-ahead log comes and goes) for writes to
    the database or its log. Events that arrive while the consumer polls stay
    queued in the inotify descriptor, so a wake-up is never lost between an empty
    poll and the next wait.
    """

    def __init__(self, database: Path) -> None:
        from inotify_simple import INotify, flags  # type: ignore[import-untyped]

        self._names = {database.name, database.name + "-wal"}
        self._inotify = INotify()
        self._inotify.add_watch(str(database.parent), flags.MODIFY | flags.CREATE | flags.MOVED_TO)
        self._stop_read, self._stop_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._inotify.fileno(), select.POLLIN)
        self._poll.register(self._stop_read, select.POLLIN)
        _watches.add(self)

    def wait(self, timeout: float) -> bool:
        """Return when the broker file changes, or after ``timeout`` seconds: False;
        or at once when the process is stopping (:func:`wake_for_stop`): True."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready = {fd for fd, _ in self._poll.poll(max(1, int(left * 1000)))}
            if self._stop_read in ready:
                return True
            if ready:
                events = self._inotify.read(timeout=0)
                # wd -1 is an overflow: changes were missed, so look.
                if any(e.wd == -1 or e.name in self._names for e in events):
                    return False
        return False

    def stop(self) -> None:
        """End the current and every later wait at once (a write to a pipe: safe in a signal handler)."""
        try:
            os.write(self._stop_write, b"x")
        except BlockingIOError:
            pass  # a byte is there already

    def close(self) -> None:
        _watches.discard(self)
        self._inotify.close()
        os.close(self._stop_read)
        os.close(self._stop_write)


# The watches of this process, for wake_for_stop.
_watches: WeakSet[BrokerFileWatch] = WeakSet()


def wake_for_stop() -> None:
    """Let the consumers waiting on the broker file see at once that the process is stopping.

    A worker told to stop checks between waits, and a wait lasts up to the
    transport's timeout: without this, every stop of an idle worker began with
    two seconds of nothing.
    """
    for watch in list(_watches):
        watch.stop()


def watch_for(url: str) -> BrokerFileWatch | None:
    """A watch on the SQLite broker at ``url``, or None where the platform has no inotify."""
    database = make_url(url).database
    if not database or database == ":memory:":
        return None
    try:
        return BrokerFileWatch(Path(database).resolve())
    except (ImportError, OSError) as exc:
        log.info("embedded broker: polling every interval (no file watch: %s)", exc)
        return None


class Channel(sqla.Channel):
    def _engine_from_config(self) -> Engine:
        # kombu issues its own BEGIN IMMEDIATE when it takes a message.
        return sqlite_engine(self.connection.client.hostname, immediate_writes=False)


class Transport(sqla.Transport):
    Channel = Channel

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)  # type: ignore[no-untyped-call]
        self._watch: BrokerFileWatch | None = None
        self._watch_tried = False

    def drain_events(self, connection: Any, timeout: float | None = None, **_: Any) -> None:
        """kombu's loop, with the sleep between empty polls replaced by a wait on the file."""
        if not self._watch_tried:
            self._watch_tried = True
            self._watch = watch_for(self.client.hostname)  # type: ignore[union-attr]  # set by kombu
        watch = self._watch
        started = time.monotonic()
        interval = self.polling_interval or 0.0
        if watch is not None:
            interval = max(interval, WOKEN_POLL_INTERVAL)
        while True:
            try:
                self.cycle.get(self._deliver, timeout=timeout)  # type: ignore[union-attr]  # set by kombu
                return
            except Empty:
                waited = time.monotonic() - started
                if timeout is not None and waited >= timeout:
                    raise TimeoutError() from None  # socket.timeout, as kombu's loop raises
                pause = interval if timeout is None else min(interval, timeout - waited)
                if watch is not None:
                    if watch.wait(pause):
                        raise TimeoutError() from None  # the caller's loop then sees it is to stop
                elif pause:
                    time.sleep(pause)

    def close_connection(self, connection: Any) -> None:
        if self._watch is not None:
            self._watch.close()
        self._watch, self._watch_tried = None, False
        super().close_connection(connection)  # type: ignore[no-untyped-call]


def kombu_url(url: str) -> str:
    """Route ``sqla+sqlite://`` URLs to this transport; leave others alone."""
    if not url.startswith(SCHEME + ":"):
        return url
    TRANSPORT_ALIASES.setdefault(ALIAS, f"{__name__}:Transport")
    return f"{ALIAS}+{url[len('sqla+'):]}"
