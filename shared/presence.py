"""Every long-running process registers itself and renews its row (af_processes).

A :class:`Presence` thread registers the process at start, then every
``heartbeat_interval`` seconds stores what it is doing (``detail``: what the
dashboard shows) and a snapshot of its metrics (shared.exposition), which the
API's /metrics adds up. A clean stop marks the row stopped; a killed process
simply stops renewing and counts as gone after three intervals.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib import metadata
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry

from shared.exposition import Family, snapshot
from shared.storage.base import ProcessRecord, ProcessStore

if TYPE_CHECKING:
    from shared.runtime import Runtime

log = logging.getLogger(__name__)

ROLES = ("api", "worker", "scheduler")


def this_process() -> str:
    """A process's id in the registry: host and pid, as attempts name the process that ran them."""
    return f"{socket.gethostname()}:{os.getpid()}"


def version() -> str:
    try:
        return metadata.version("asyncflow")
    except metadata.PackageNotFoundError:
        return "unknown"


def own_metrics() -> list[Family]:
    """This process's metrics (an API process, a scheduler)."""
    return snapshot(REGISTRY)


def pool_metrics() -> list[Family]:
    """A worker's metrics: its own and its pool processes', added up from the shared files
    (asyncflow.metrics.prepare_multiprocess); its own alone without them."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return own_metrics()
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # untyped in prometheus_client
    return snapshot(registry)


def attempts_in_flight() -> list[dict[str, Any]]:
    """The step attempts a Celery worker's pool runs now, from Celery's own bookkeeping."""
    from celery.worker import state

    running = []
    for request in list(state.active_requests):
        args = request.args or [{}]
        payload = args[0] if isinstance(args[0], Mapping) else {}
        if "task_id" not in payload:
            continue  # an alarm delivery
        if hasattr(request, "running_step"):  # the delivery may have run on to a later step
            payload = request.running_step()[0].to_payload()
        # time_start: wall clock; None until a pool process took it
        running.append(attempt_in_flight(payload, request.time_start, request.worker_pid))
    return oldest_first(running)


def attempt_in_flight(payload: Mapping[str, Any], started: float | None, pid: int | None) -> dict[str, Any]:
    """One attempt a worker runs now, as its registry row lists it: the step message's payload, and where."""
    return {
        "task_id": payload["task_id"],
        "seq": payload.get("seq"),
        "module": payload.get("module"),
        "command": payload.get("command"),
        "started": started,
        "pid": pid,
    }


def oldest_first(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(attempts, key=lambda a: (a["started"] or 0.0, a["task_id"]))


def worker_detail(
    modules: list[str],
    queues: list[str],
    concurrency: int,
    in_flight: Callable[[], list[dict[str, Any]]],
) -> Callable[[], dict[str, Any]]:
    def detail() -> dict[str, Any]:
        return {
            "modules": modules,
            "queues": queues,
            "concurrency": concurrency,
            "in_flight": in_flight(),
            "version": version(),
        }

    return detail


class Presence:
    """Keeps this process's registry row: registered at :meth:`start`, renewed, stopped at :meth:`stop`.

    A renewal that fails (database down) is logged and tried again at the next
    interval; a row purged meanwhile is registered again.
    """

    def __init__(
        self,
        store: ProcessStore,
        role: str,
        interval: float,
        collect: Callable[[], list[Family]] = own_metrics,
        detail: Callable[[], Mapping[str, Any]] = dict,
        clock: Callable[[], float] = time.time,
        process_id: str | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        self.store = store
        self.role = role
        self.interval = interval
        self.collect = collect
        self.detail = detail
        self.clock = clock
        self.process_id = process_id or this_process()
        self.started_at = clock()
        self._registered = False
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        # Held while the row is renewed. A fork (a worker starting a pool process) waits
        # for it: a child forked mid-renewal would inherit the locks it held (SQLite's
        # own, a pool's) taken for good, and block on the first of them it needs.
        self._renewing = threading.Lock()

    def record(self) -> ProcessRecord:
        """This process as its row says it now, metrics fresh."""
        return ProcessRecord(
            process_id=self.process_id,
            role=self.role,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
            seen_at=self.clock(),
            detail=dict(self.detail()),
            metrics=self.collect(),
        )

    def beat(self) -> None:
        """Register, or renew the row (registering again if it was purged)."""
        record = self.record()
        if self._registered and self.store.renew(record.process_id, record.seen_at, record.detail, record.metrics):
            return
        self.store.register(record)
        self._registered = True

    def start(self) -> Presence:
        renewing = self._renewing
        os.register_at_fork(before=renewing.acquire, after_in_parent=renewing.release, after_in_child=renewing.release)
        self._thread = threading.Thread(target=self._run, name=f"presence {self.role}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                with self._renewing:
                    self.beat()
            except Exception:
                log.exception("renewing this %s process's registry row failed", self.role)
            if self._stopped.wait(self.interval):
                return

    def stop(self) -> None:
        """Stop renewing and mark the row stopped (a clean stop)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval)
        try:
            if self._registered:
                self.store.renew(self.process_id, self.clock(), dict(self.detail()), self.collect())
            self.store.stop(self.process_id, self.clock())
        except Exception:
            log.exception("marking this %s process stopped failed", self.role)


def serve_worker(runtime: Runtime, modules: list[str], concurrency: int) -> Presence:
    """Keep a Celery worker's row from now until Celery's warm shutdown (a cold one leaves it to go silent)."""
    from celery.signals import worker_shutdown

    presence = worker_presence(runtime, modules, concurrency, attempts_in_flight)
    worker_shutdown.connect(lambda **_: presence.stop(), weak=False)
    return presence


def worker_presence(
    runtime: Runtime, modules: list[str], concurrency: int, in_flight: Callable[[], list[dict[str, Any]]]
) -> Presence:
    """A worker's row, renewed from now on, with its pool's metrics and the attempts ``in_flight`` lists."""
    from shared.messaging import queue_name

    queues = [queue_name(m) for m in modules]
    return Presence(
        runtime.process_store,
        "worker",
        runtime.settings.heartbeat_interval,
        collect=pool_metrics,
        detail=worker_detail(modules, queues, concurrency, in_flight),
    ).start()


@contextmanager
def serving_scheduler(runtime: Runtime) -> Iterator[Presence]:
    """Keep a scheduler's row while the block runs; its detail says whether it leads."""
    scheduler = runtime.scheduler

    def detail() -> dict[str, Any]:
        return {"leader": scheduler.lease is not None, "owner": scheduler.owner, "version": version()}

    presence = Presence(runtime.process_store, "scheduler", runtime.settings.heartbeat_interval, detail=detail)
    presence.start()
    try:
        yield presence
    finally:
        presence.stop()
