"""A broker connection a process keeps between uses (the intake's batches, the scheduler's
queue depths): opening one costs more than what is sent on it.

Given up after an idle spell long enough for the broker or a firewall to have dropped it,
and not used in a forked process, where the parent's socket is not the child's own.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class KeptConnection:
    """One kombu connection, kept by the process that opened it. Not thread-safe: its owner locks."""

    IDLE_AT_MOST = 20.0

    def __init__(self, what: str) -> None:
        self.what = what  # for the log: whose connection it is
        self.conn: Any = None
        self._owner = 0  # the pid that opened it
        self._used = 0.0

    def owned(self) -> bool:
        """Whether a connection this process opened is kept."""
        return self.conn is not None and self._owner == os.getpid()

    def fit(self) -> bool:
        """Whether a connection this process opened is kept and was used lately; one idle too long is dropped."""
        if self.owned() and time.monotonic() - self._used > self.IDLE_AT_MOST:
            self.drop()
        return self.owned()

    def open(self, connect: Callable[[], Any]) -> Any:
        """A new connection, kept in place of any other (the parent's, after a fork, is left open for it)."""
        self.conn = connect()
        self._owner = os.getpid()
        return self.conn

    def used(self) -> None:
        self._used = time.monotonic()

    def drop(self) -> None:
        """Close it, if this process opened it, whatever the broker answers."""
        conn, self.conn = self.conn, None
        if conn is not None and self._owner == os.getpid():
            try:
                conn.close()
            except Exception as exc:  # it is being given up on anyway
                log.debug("closing a %s connection: %s", self.what, exc)
