"""/metrics: one exposition for the whole stack, gathered at scrape time.

The registry rows of every process (shared.presence), this process's own
metrics fresh, and what only a question at scrape time answers: queue depths
from the broker, active v1 leases from the database. Each of those parts runs
on a thread of its own under a deadline: a broker or database that does not
answer leaves its part out (and counts ``asyncflow_scrape_errors_total{part}``)
instead of holding the scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from shared import metrics
from shared.exposition import Family, Labels, gauge, render, stack
from shared.messaging import queue_name
from shared.messaging.depth import QueueDepths
from shared.presence import Presence
from shared.runtime import Runtime

log = logging.getLogger(__name__)

T = TypeVar("T")
# Each part of a scrape gets this long; Prometheus's own scrape timeout is 10 s by default.
PART_TIMEOUT = 2.0
# v1 task types asked about per scrape, at most (one indexed count each).
MAX_TASK_TYPES = 200


class StackMetrics:
    def __init__(self, runtime: Runtime, presence: Presence, timeout: float = PART_TIMEOUT) -> None:
        self.runtime = runtime
        self.presence = presence
        self.timeout = timeout
        self._running: dict[str, Future[object]] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="metrics")
        self._depths = QueueDepths(runtime.settings, timeout)

    def exposition(self) -> bytes:
        rt = self.runtime
        interval = rt.settings.heartbeat_interval
        own = self.presence.record()
        records = self._part("processes", rt.process_store.list) or []
        families = stack(records, own, own.seen_at, interval)
        families += self._part("queue_depth", self._queue_depth) or []
        families += self._part("leases", self._leases) or []
        # Errors counted during this scrape show in the next one: the own snapshot was taken first.
        return render(sorted(families, key=lambda f: str(f["name"])))

    def _part(self, part: str, compute: Callable[[], T]) -> T | None:
        """``compute()`` within the deadline; None (and an error counted) if it fails or is late.

        A part still running from an earlier scrape is not started again: a hung
        broker holds one thread, not one per scrape.
        """
        earlier = self._running.get(part)
        if earlier is not None and not earlier.done():
            metrics.SCRAPE_ERRORS.labels(part).inc()
            return None
        future = self._pool.submit(compute)
        self._running[part] = future  # type: ignore[assignment]  # Future is invariant; only done() is read
        try:
            return future.result(timeout=self.timeout)
        except TimeoutError:
            log.warning("/metrics: %s took over %gs, left out", part, self.timeout)
        except Exception as exc:
            log.warning("/metrics: %s left out: %s", part, exc)
        metrics.SCRAPE_ERRORS.labels(part).inc()
        return None

    def queue_depths(self, queues: list[str]) -> dict[str, int] | None:
        """Messages waiting in each of ``queues``, or None if the broker did not answer in time."""
        return self._part("queue_depth_ui", lambda: self._depths(queues))

    def _queue_depth(self) -> list[Family]:
        flows = self.runtime.flows
        modules = sorted(flows.push_module_names())
        alert_module = self.runtime.settings.alert_command.partition(".")[0]
        if alert_module and alert_module not in modules:
            modules.append(alert_module)
        depths = self._depths([queue_name(m) for m in modules])
        values: dict[Labels, float] = {(("queue", q),): float(n) for q, n in depths.items()}
        return [gauge("asyncflow_queue_depth", "Step messages waiting in each module queue", values)]

    def _leases(self) -> list[Family]:
        store = self.runtime.pull_store
        values: dict[Labels, float] = {}
        for config in store.types()[:MAX_TASK_TYPES]:
            # window=1: only the running count, through the (task_type, status) index.
            running = store.summary(config.task_type, window=1).running
            values[(("task_type", config.task_type),)] = float(running)
        return [gauge("asyncflow_v1_leases_active", "v1 tasks leased to a worker now", values)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._depths.close()

