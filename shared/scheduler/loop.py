"""``asyncflow scheduler``: one leader fires schedules and runs the sweeps; the others stand by.

Leadership is a lease row in the database (:meth:`ScheduleStore.acquire`), renewed
every third of its time to live. A scheduler killed with SIGKILL stops renewing,
and another takes over once the lease expires. Firings are fenced twice: by the
lease's epoch and by each schedule's version, so a deposed leader that wakes up
late cannot fire anything the new one fired.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from shared import metrics
from shared.pull.service import PullService
from shared.scheduler.sweeps import sweep_leases, sweep_tasks
from shared.schedules.service import ScheduleService
from shared.schedules.timetable import Timetable, wake_at
from shared.service import TaskService
from shared.storage import Outstanding, StorageUnavailable
from shared.storage.base import Lease, NotLeader, ProcessStore

log = logging.getLogger(__name__)

LEADER = "scheduler"
FIRE_BATCH = 500
LOAD_PAGE = 2000
STANDBY_POLL = 0.5
# Users' changes are read from this long before the previous read, for changes
# that committed just after it and for API hosts whose clocks lag a little.
CHANGE_SKEW = 1.0
# The leader asks the broker this often whether it lost the messages it held.
BROKER_WATCH = 1.0


@dataclass(frozen=True)
class Cadence:
    """How often the leader does what (seconds)."""

    sweep: float = 0.2  # governance sweeps (retries due, requeues, expiries)
    lease_ttl: float = 5.0  # a dead leader is replaced within this
    load_ahead: float = 60.0  # schedules due within this are held in memory
    changes: float = 0.2  # users' changes are picked up within this
    retention: float = 0.0  # runs older than this are deleted (0: kept)
    retention_tasks: bool = False  # with the ended tasks they created
    process_retention: float = 86400.0  # registry rows of processes gone this long are deleted


class Scheduler:
    def __init__(
        self,
        service: TaskService,
        pull: PullService,
        schedules: ScheduleService,
        cadence: Cadence = Cadence(),
        clock: Callable[[], float] = time.time,
        owner: str | None = None,
        processes: ProcessStore | None = None,
        backlogged: Callable[[], frozenset[str]] | None = None,
        room: Callable[[], Mapping[str, int]] | None = None,
        broker_lost: Callable[[], bool] | None = None,
    ) -> None:
        self.service = service
        self.pull = pull
        self.schedules = schedules
        self.cadence = cadence
        self.clock = clock
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.processes = processes
        self.backlogged = backlogged  # modules whose queues hold messages waiting (sweep_tasks)
        self.room = room  # how many of a batch's first steps each module's queue may take (sweep_tasks)
        self.broker_lost = broker_lost  # whether the broker lost what it held since last asked (QueueDepths.lost)
        # When the broker was last found to have lost what it held, or this scheduler took
        # the lead (not knowing whether it had): None once every message it may have lost
        # has been swept (:meth:`_may_hold_back`).
        self._broker_lost_at: float | None = None
        self.lease: Lease | None = None
        self.timetable = Timetable()
        self._due = dict.fromkeys(("renew", "load", "changes", "sweep", "purge", "processes", "broker"), 0.0)
        self._changes_read_at = 0.0
        self._loaded: tuple[float, str] | None = None  # where the last page of due schedules ended

    def tick(self) -> int:
        """One pass of every sweep; returns how many records changed.

        The pass over tasks stops after a tenth of the lease, so that the lease is
        renewed and schedules fire on time while a backlog is swept: under load,
        500 requeues (a write and a publish each) outlasted the lease, and the
        leader lost the lead at every pass.
        """
        now = self.clock()
        until = time.monotonic() + self.cadence.lease_ttl / 10
        backlogged = self.backlogged if self._may_hold_back(now) else None
        swept = sweep_tasks(self.service, now, until=until, backlogged=backlogged, room=self.room)
        return swept + sweep_leases(self.pull, now)

    def _may_hold_back(self, now: float) -> bool:
        """Whether the sweep may leave a queued message due in its queue's backlog.

        Not once the broker may have lost what it held: every message it lost comes
        due within requeue_after of that, before the moment it was found (published
        or held back before it), and a queue's depth counts only those published
        since. Until each outstanding message due before then has been swept, which
        under a backlog of requeues may take longer than requeue_after (a pass is
        bounded), or until requeue_holds times requeue_after, the bound a held
        message has anyway.
        """
        if self._broker_lost_at is None:
            return True
        timing = self.service.timing
        lost_by = self._broker_lost_at + timing.requeue_after
        if now < lost_by or (
            now < self._broker_lost_at + timing.requeue_holds * timing.requeue_after
            # Strictly before: one published again in the pass that found the loss is due at lost_by.
            and self.service.due(math.nextafter(lost_by, -math.inf), 1, Outstanding.SENT)
        ):
            return False
        self._broker_lost_at = None
        return True

    def _watch_broker(self, broker_lost: Callable[[], bool], now: float) -> None:
        self._due["broker"] = now + BROKER_WATCH
        try:
            lost = broker_lost()
        except Exception as exc:  # down, most likely: asked again at the next watch
            log.debug("scheduler: could not ask the broker whether it lost its messages: %s", exc)
            return
        if lost:
            self._broker_lost_at = now
            log.warning(
                "scheduler: the broker holds none of the messages it was given (restarted, purged, or new); "
                "queued steps are published again as they come due"
            )

    def run(self, stop: threading.Event) -> None:
        """Lead or stand by until ``stop`` is set; on a clean stop, hand the lease over."""
        log.info("scheduler %s started", self.owner)
        try:
            while not stop.is_set():
                try:
                    wait = self.step()
                except StorageUnavailable as exc:
                    log.warning("scheduler: database unavailable: %s", exc)
                    wait = self.cadence.sweep
                except Exception:
                    # A bug in one schedule or task must not stop the timers of all the others.
                    log.exception("scheduler pass failed")
                    wait = self.cadence.sweep
                stop.wait(max(0.0, wait))
        finally:
            if self.lease is not None:
                try:
                    self.schedules.store.release(self.lease)
                except Exception:
                    log.exception("could not release the scheduler lease")

    def step(self) -> float:
        """Whatever is due now; returns how long to sleep before the next thing is."""
        now = self.clock()
        c = self.cadence
        if now >= self._due["renew"]:
            self._renew(now)
        if self.lease is None:
            return self._due["renew"] - now
        if now >= self._due["load"]:
            self._load(now)
        if now >= self._due["changes"]:
            self._read_changes(now)
            self._due["changes"] = now + c.changes
        try:
            self._fire(now)
        except NotLeader as exc:
            log.warning("scheduler %s: lost the lead: %s", self.owner, exc)
            self._stand_by()
            return self._due["renew"] - now
        if self.broker_lost is not None and now >= self._due["broker"]:
            self._watch_broker(self.broker_lost, now)
        if now >= self._due["sweep"]:
            metrics.SCHEDULER_LAG.observe(now - self._due["sweep"])
            if self.tick():
                self._due["sweep"] = now  # more may be due right away
            else:
                self._due["sweep"] = now + c.sweep
        if c.retention > 0 and now >= self._due["purge"]:
            self._purge(now)
        if self.processes is not None and now >= self._due["processes"]:
            self.processes.purge(now - c.process_retention)
            self._due["processes"] = now + 60.0
        wake = min(self._due[k] for k in ("renew", "load", "changes", "sweep"))
        if self.broker_lost is not None:
            wake = min(wake, self._due["broker"])
        following = self.timetable.next_at()
        if following is not None:
            wake = min(wake, following)
        return wake - self.clock()

    def _load(self, now: float) -> None:
        """Read the next page of schedules coming due within load_ahead into the timetable.

        Pages are small and read once a second, so reading never holds firing up
        for long; a schedule already held at its version costs only its decoding.
        """
        page = self.schedules.store.due(now + self.cadence.load_ahead, LOAD_PAGE, self._loaded)
        for s in page:
            self.timetable.put(s, now)
        if len(page) == LOAD_PAGE:
            last = page[-1]
            self._loaded = (wake_at(last) or now, last.schedule_id)
            self._due["load"] = now  # more to read: next pass
        else:
            # Read to the end: from now on, what enters the window since the last page.
            self._loaded = (now + self.cadence.load_ahead, "")
            self._due["load"] = now + 1.0

    def _renew(self, now: float) -> None:
        c = self.cadence
        lease = self.schedules.store.acquire(LEADER, self.owner, c.lease_ttl, now)
        metrics.SCHEDULER_LEADER.set(0 if lease is None else 1)
        # The leader renews at a third of the lease; the others ask often, so that one
        # takes over soon after the lease of a dead leader runs out.
        self._due["renew"] = now + (c.lease_ttl / 3 if lease else min(c.lease_ttl / 3, STANDBY_POLL))
        if lease is None:
            if self.lease is not None:
                log.warning("scheduler %s: another scheduler leads now", self.owner)
                self._stand_by()
            return
        if self.lease is None or lease.epoch != self.lease.epoch:
            log.info("scheduler %s leads (epoch %d)", self.owner, lease.epoch)
            self.timetable.clear()
            self._loaded = None
            self._due.update(load=now, changes=now, sweep=now, broker=now)
            # What the broker lost before this lead began (a restart while another scheduler
            # led, and told it) is not known here: as if it had lost everything.
            self._broker_lost_at = now if self.broker_lost is not None else None
            self._changes_read_at = now  # the full load reads what is due
        self.lease = lease

    def _stand_by(self) -> None:
        self.lease = None
        metrics.SCHEDULER_LEADER.set(0)
        self.timetable.clear()
        self._due["renew"] = self.clock() + min(self.cadence.lease_ttl / 3, STANDBY_POLL)

    def _read_changes(self, now: float) -> None:
        for s in self.schedules.store.changed_since(self._changes_read_at - CHANGE_SKEW, 10_000):
            self.timetable.put(s, now)
        self._changes_read_at = now

    def _fire(self, now: float) -> None:
        while due := self.timetable.pop_due(now, FIRE_BATCH):
            for s in self.schedules.fire_due(due, self.lease):
                # Not before a moment from now: one that had nothing to do yet is not
                # tried again in a loop.
                self.timetable.put(s, now, not_before=now + 0.001)
            now = self.clock()

    def _purge(self, now: float) -> None:
        """Delete old runs in batches, for at most a tenth of a second, so firing is not held up."""
        c = self.cadence
        deadline = time.monotonic() + 0.1
        while time.monotonic() < deadline:
            if self.schedules.store.purge(now - c.retention, 1000, c.retention_tasks) < 1000:
                self._due["purge"] = now + 60.0
                return
        self._due["purge"] = now + 1.0
