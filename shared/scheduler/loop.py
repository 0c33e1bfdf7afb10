"""``asyncflow scheduler``: the sweeps, over and over, until told to stop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from shared.pull.service import PullService
from shared.scheduler.sweeps import sweep_leases, sweep_tasks
from shared.service import TaskService
from shared.storage import StorageUnavailable

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        service: TaskService,
        pull: PullService,
        tick: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.service = service
        self.pull = pull
        self.tick_seconds = tick
        self.clock = clock

    def tick(self) -> int:
        """One pass of every sweep; returns how many records changed."""
        now = self.clock()
        return sweep_tasks(self.service, now) + sweep_leases(self.pull, now)

    def run(self, stop: threading.Event) -> None:
        """Sweep until ``stop`` is set; straight on while there is work, else every tick."""
        log.info("scheduler started, tick %.3fs", self.tick_seconds)
        while not stop.is_set():
            try:
                changed = self.tick()
            except StorageUnavailable as exc:
                log.warning("sweep skipped, database unavailable: %s", exc)
                changed = 0
            except Exception:
                # A bug in one task must not stop the timers of all the others.
                log.exception("sweep failed")
                changed = 0
            if not changed:
                stop.wait(self.tick_seconds)
