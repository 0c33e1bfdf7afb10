"""Governance sweeps (SPEC §4, seed 000 §三.5): act on whatever has come due by ``now``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from shared.pull.service import PullService
from shared.saga import Expire, Requeue
from shared.service import TaskNotFound, TaskService
from shared.states import Phase
from shared.storage import Outstanding

log = logging.getLogger(__name__)


def sweep_tasks(
    service: TaskService,
    now: float,
    limit: int = 500,
    until: float | None = None,
    backlogged: Callable[[], frozenset[str]] | None = None,
    room: Callable[[], Mapping[str, int]] | None = None,
) -> int:
    """Act on every outstanding saga message due by ``now``; returns how many changed.

    Queued messages that nobody started are published again and running ones
    past their deadline count as failed, one by one; then waiting messages are
    published in groups (one commit, one publish): later steps', then a batch's
    first steps, flow by flow. With
    ``until`` (on ``time.monotonic``) the pass stops there, after one thing at
    least, and leaves the rest due for the next one: under load each takes a
    write and a publish, and 500 of them can outlast the scheduler's lease.

    ``backlogged`` names the modules whose queues hold messages waiting now,
    asked once per pass, when a queued message is first due: the queued messages
    of those modules are left in their queues (:class:`Requeue`).

    ``room`` tells how many more messages each module's queue may be given now:
    a batch's first steps are published flow by flow, oldest first, as far as
    their module's queue has room, and the rest wait in the database, where a
    backlog costs no write until it is published. Without it, or without an
    answer, they wait (a broker that cannot count its queues: published when due).
    """
    changed = left = 0
    can_publish = service.publisher.healthy()
    busy: frozenset[str] | None = None
    # Each kind asked apart: a backlog of a batch's first steps, waiting by the
    # hundred thousand, must not hold up an expiry or a retry due behind it.
    for n, (task_id, seq, phase) in enumerate(service.due(now, limit, Outstanding.SENT)):
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
        # Waiting messages go in groups: a read, a commit and a publish for each.
        later = service.due(now, limit, Outstanding.LATER)
        if later:
            changed += service.publish_due([(task_id, seq) for task_id, seq, _ in later])
        changed += _release_first_steps(service, now, limit, until, room, changed)
    return changed


def _release_first_steps(
    service: TaskService,
    now: float,
    limit: int,
    until: float | None,
    room: Callable[[], Mapping[str, int]] | None,
    done: int,
) -> int:
    """Publish a batch's first steps, flow by flow (the oldest waiting first), as far as
    their module's queue has room; a module not counted (pull-mode, or of a flow no
    longer declared) takes them all."""
    flows = service.waiting_flows()
    if not flows:
        return 0
    try:
        free = dict(room()) if room is not None else {}
    except NotImplementedError:
        free = {}  # a broker whose queues cannot be counted: not paced
    except Exception as exc:  # the broker did not answer: the steps wait in the store, safe
        log.warning("sweep: queue depths unknown, a batch's first steps wait: %s", exc)
        return 0
    released = 0
    for flow, module in flows:
        if (released or done) and until is not None and time.monotonic() >= until:
            break
        count = min(limit, free[module]) if module in free else limit
        due = service.due(now, count, Outstanding.FIRST, flow) if count > 0 else []
        if due:
            released += service.publish_due([(task_id, seq) for task_id, seq, _ in due])
            if module in free:
                free[module] -= len(due)
    return released


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
