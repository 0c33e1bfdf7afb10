"""Whether a process answers: the API by /healthz, a worker or scheduler by its registry row.

Every process renews its row in af_processes (shared.presence) each
``heartbeat_interval``; a row renewed within three intervals and not marked
stopped means the process runs and reaches the database. `asyncflow up` waits
on this before saying "is up"; `asyncflow health ROLE` (a container's
healthcheck) asks it once for this host.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterable

from shared.storage.base import ProcessRecord, ProcessStore

# Missed renewals before a process counts as gone (as for attempts' heartbeats).
MISSED_BEATS = 3


def live(records: Iterable[ProcessRecord], now: float, interval: float) -> list[ProcessRecord]:
    """The rows of processes that renewed within MISSED_BEATS intervals and did not stop."""
    since = now - MISSED_BEATS * interval
    return [r for r in records if r.stopped_at is None and r.seen_at >= since]


def seen_pids(store: ProcessStore, host: str, now: float, interval: float) -> set[int]:
    """The pids on ``host`` whose registry row is live."""
    return {r.pid for r in live(store.list(seen_since=now - MISSED_BEATS * interval), now, interval) if r.host == host}


def health(store: ProcessStore, role: str, host: str, now: float, interval: float) -> str | None:
    """Why no ``role`` process on ``host`` counts as alive, or None when one does."""
    rows = [r for r in live(store.list(seen_since=now - MISSED_BEATS * interval), now, interval) if r.host == host]
    if any(r.role == role for r in rows):
        return None
    return f"no {role} process on {host} renewed its registry row in the last {MISSED_BEATS * interval:g}s"


def this_host() -> str:
    return socket.gethostname()


def local_url(host: str, port: int) -> str:
    """Where this machine reaches an API bound to ``host``:``port`` (a wildcard address is reached locally)."""
    reach = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{reach}]:{port}" if ":" in reach else f"http://{reach}:{port}"


def api_answers(url: str) -> bool:
    # urllib rather than httpx: httpx logs every request, and `up` asks several times a second.
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:  # refused, timed out, or an HTTP error status
        return False
