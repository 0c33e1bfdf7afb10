"""Governance sweeps (SPEC §4, seed 000 §三.5): act on whatever has come due by ``now``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shared.pull.service import PullService
from shared.saga import Expire, Requeue
from shared.service import TaskNotFound, TaskService
from shared.states import Phase

log = logging.getLogger(__name__)


def sweep_tasks(
    service: TaskService,
    now: float,
    limit: int = 500,
    until: float | None = None,
    backlogged: Callable[[], frozenset[str]] | None = None,
) -> int:
    """Act on every outstanding saga message due by ``now``; returns how many changed.

    Queued messages that nobody started are published again and running ones
    past their deadline count as failed, one by one; then waiting messages are
    published, those of a pass together (one commit, one publish). With
    ``until`` (on ``time.monotonic``) the pass stops there, after one thing at
    least, and leaves the rest due for the next one: under load each takes a
    write and a publish, and 500 of them can outlast the scheduler's lease.

    ``backlogged`` names the modules whose queues hold messages waiting now,
    asked once per pass, when a queued message is first due: the queued messages
    of those modules are left in their queues (:class:`Requeue`).
    """
    changed = left = 0
    can_publish = service.publisher.healthy()
    busy: frozenset[str] | None = None
    # Asked apart: a backlog of a batch's first steps, waiting by the hundred
    # thousand, must not hold up an expiry due behind it.
    for n, (task_id, seq, phase) in enumerate(service.due(now, limit, waiting=False)):
        if n and until is not None and time.monotonic() >= until:
            break  # at least one a pass, however slow the query before it
        if phase is not Phase.RUNNING and not can_publish:
            continue  # leave it due; publishing now would only fail again
        event: Requeue | Expire
        if phase is Phase.QUEUED:
            if busy is None:
                busy = _backlogged(backlogged)
            event = Requeue(seq, busy)
        else:
            event = Expire(seq)
        try:
            decision = service.apply(task_id, event)
        except TaskNotFound:
            continue
        if decision.ignored:
            continue
        changed += 1
        if isinstance(event, Requeue) and not decision.messages:
            left += 1
        else:
            log.warning("sweep: %s", type(event).__name__.lower(), extra={"task_id": task_id, "seq": seq})
    if left:
        log.info("sweep: %d queued message(s) not started in time left in their queue's backlog", left)
    if can_publish and (until is None or changed == 0 or time.monotonic() < until):
        # One group: a batch's first steps come due together, a read, a commit and a publish for all.
        waiting = service.due(now, limit, waiting=True)
        if waiting:
            changed += service.publish_due([(task_id, seq) for task_id, seq, _ in waiting])
    return changed


def _backlogged(backlogged: Callable[[], frozenset[str]] | None) -> frozenset[str]:
    if backlogged is None:
        return frozenset()
    try:
        return backlogged()
    except Exception as exc:  # no answer: publish again, as without the check
        log.warning("sweep: queue depths unknown, queued messages due are published again: %s", exc)
        return frozenset()


def sweep_leases(pull: PullService, now: float, limit: int = 500) -> int:
    """Expire v1 leases past max_processing_time: a failed attempt each (retry or fail)."""
    return sum(pull.expire(task, now) for task in pull.due(now, limit))
