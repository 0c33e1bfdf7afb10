"""The task service: load, decide, compare-and-set, then publish.

Every caller that changes a task (API, consumers, scheduler, CLI) goes through
:meth:`TaskService.apply`; the decision itself is :func:`shared.saga.decide`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

from shared import metrics
from shared.flows import FlowSet
from shared.saga import (  # noqa: F401 - InvalidAction is part of this API
    DEFAULT_TIMING,
    Decision,
    Due,
    Event,
    Expire,
    Failed,
    InvalidAction,
    PollLater,
    PublishFailed,
    Requeue,
    Started,
    Submit,
    Succeeded,
    Timing,
    decide,
)
from shared.states import Phase, StepType
from shared.storage import AttemptRecord, TaskFilter, TaskStore
from shared.task import Alarm, StepMessage, Task, new_task

log = logging.getLogger(__name__)

# A task changed by two writers at once is re-read and decided again; more
# rounds than this means something is spinning.
MAX_CAS_ROUNDS = 20


class ServiceError(Exception):
    status_code = 400


class UnknownFlow(ServiceError):
    status_code = 404


class TaskNotFound(ServiceError):
    status_code = 404


class Publisher(Protocol):
    def publish(self, message: StepMessage) -> None: ...

    def alarm(self, alarm: Alarm) -> None: ...

    def healthy(self) -> bool:
        """False while the broker is known to be down (publishing is pointless)."""
        ...


class TaskService:
    def __init__(
        self,
        store: TaskStore,
        publisher: Publisher,
        flows: FlowSet,
        clock: Callable[[], float] = time.time,
        timing: Timing = DEFAULT_TIMING,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.flows = flows
        self.clock = clock
        self.timing = timing

    # --- intake ------------------------------------------------------------

    def submit(
        self,
        flow_name: str,
        parameters: Mapping[str, Any],
        priority: int = 0,
        user_id: str | None = None,
        task_id: str | None = None,
    ) -> tuple[Task, bool]:
        """Store a new task and dispatch its first step; a known task_id returns the stored task."""
        flow = self.flows.get(flow_name)
        if flow is None:
            known = ", ".join(sorted(self.flows.flows)) or "none"
            raise UnknownFlow(f"unknown flow {flow_name!r} (known flows: {known})")
        now = self.clock()
        task = new_task(task_id or uuid.uuid4().hex, flow, parameters, now, priority, user_id)
        decision = decide(task, Submit(), now, self.timing)
        stored, created = self.store.create(decision.task, now)
        if created:
            metrics.SUBMITTED.labels(flow.name).inc()
            log.info("task submitted", extra={"task_id": stored.task_id, "flow": flow.name})
            self._publish(decision)
        return stored, created

    # --- transitions ---------------------------------------------------------

    def apply(self, task_id: str, event: Event, known: Task | None = None) -> Decision:
        """Decide ``event`` against the stored task and persist the result atomically.

        ``known`` is a copy the caller just stored (a consumer between the start
        and the outcome of an attempt): it saves a read, and if it is out of date
        the compare-and-set fails and the task is read again.
        """
        for _ in range(MAX_CAS_ROUNDS):
            from_copy = known is not None
            task = known if known is not None else self.store.get(task_id)
            known = None
            if task is None:
                raise TaskNotFound(f"no task {task_id!r}")
            now = self.clock()
            decision = decide(task, event, now, self.timing)
            if decision.ignored or decision.task is task:
                if from_copy:
                    continue  # judge a no-op against the stored task, not a copy
                return decision
            if self.store.save(decision.task, now, _attempt_record(task, event, now)):
                self._after(task, decision)
                # What is stored now, version included, for the caller's next ``known``.
                return replace(decision, task=replace(decision.task, version=task.version + 1))
        raise RuntimeError(f"task {task_id}: gave up after {MAX_CAS_ROUNDS} concurrent updates")

    def _after(self, before: Task, decision: Decision) -> None:
        task = decision.task
        if task.status is not before.status and task.status.is_terminal:
            metrics.FINISHED.labels(task.flow, task.status.label).inc()
            log.info(
                "task finished",
                extra={"task_id": task.task_id, "flow": task.flow, "status": task.status.label},
            )
        self._publish(decision)

    def _publish(self, decision: Decision) -> None:
        for message in decision.messages:
            if message.type is StepType.ROLLBACK and message.attempt == 1:
                metrics.ROLLBACKS.labels(message.flow, message.module).inc()
            if message.attempt > 1:
                metrics.RETRIES.labels(message.module, message.command).inc()
            try:
                self.publisher.publish(message)
            except Exception as exc:
                self._publish_failed(message, exc)
        for alarm in decision.alarms:
            metrics.ALARMS.labels(alarm.flow, alarm.module).inc()
            log.error(
                "ALARM: rollback failed, operator action needed (asyncflow resume %s): %s.%s: %s",
                alarm.task_id,
                alarm.module,
                alarm.command,
                alarm.error,
                extra={"task_id": alarm.task_id, "flow": alarm.flow, "step": alarm.cursor},
            )
            try:
                self.publisher.alarm(alarm)
            except Exception:
                log.exception("delivering the alarm failed", extra={"task_id": alarm.task_id})

    def _publish_failed(self, message: StepMessage, exc: Exception) -> None:
        """The transition is committed, the message is not: the sweep publishes it again."""
        extra = {"task_id": message.task_id, "step": message.cursor, "seq": message.seq}
        log.warning("publishing failed, the scheduler will publish it again: %s", exc, extra=extra)
        try:
            self.apply(message.task_id, PublishFailed(message.seq))
        except Exception:
            # Then the requeue sweep finds it after requeue_after instead.
            log.exception("could not mark the message for an early re-publish", extra=extra)

    # --- operator actions ---------------------------------------------------------

    def operate(self, task_id: str, event: Event) -> Task:
        """Cancel, Retry or Resume; raises InvalidAction when the state forbids it."""
        return self.apply(task_id, event).task

    def sweep(self, limit: int = 500) -> int:
        """Act on every outstanding message that is due; returns how many changed.

        Waiting messages are published, queued ones that nobody started are
        published again, running ones past their deadline count as failed. Safe
        in several schedulers at once: each change is a compare-and-set.
        """
        changed = 0
        can_publish = self.publisher.healthy()
        for task_id, seq, phase in self.store.due(self.clock(), limit):
            if phase is not Phase.RUNNING and not can_publish:
                continue  # leave it due; publishing now would only fail again
            event = _SWEEP_EVENTS[phase](seq)
            try:
                decision = self.apply(task_id, event)
            except TaskNotFound:
                continue
            if not decision.ignored:
                changed += 1
                if isinstance(event, Requeue | Expire):
                    log.warning(
                        "sweep: %s", type(event).__name__.lower(), extra={"task_id": task_id, "seq": seq}
                    )
        return changed

    # --- reads ------------------------------------------------------------------

    def get(self, task_id: str) -> Task:
        task = self.store.get(task_id)
        if task is None:
            raise TaskNotFound(f"no task {task_id!r}")
        return task

    def list(self, where: TaskFilter) -> list[Task]:
        return self.store.list(where)

    def attempts(self, task_id: str) -> list[AttemptRecord]:
        return self.store.attempts(task_id)


_SWEEP_EVENTS = {Phase.WAITING: Due, Phase.QUEUED: Requeue, Phase.RUNNING: Expire}


def _attempt_record(task: Task, event: Event, now: float) -> AttemptRecord | None:
    """The attempt-log write that goes with an accepted step event."""
    active = task.active
    if active is None or not isinstance(event, Started | Succeeded | Failed | PollLater | Expire):
        return None
    action = task.steps[active.cursor].action(active.type)
    base = dict(
        task_id=task.task_id,
        seq=active.seq,
        cursor=active.cursor,
        type=active.type,
        attempt=active.attempt,
        module=action.module,
        command=action.command,
    )
    if isinstance(event, Started):
        return AttemptRecord(**base, started_at=now)
    if isinstance(event, Succeeded):
        return AttemptRecord(**base, ended_at=now, outcome="succeeded")
    if isinstance(event, PollLater):
        return AttemptRecord(**base, ended_at=now, outcome="poll_later")
    if isinstance(event, Expire):
        return AttemptRecord(**base, ended_at=now, outcome="expired", error="no outcome by the deadline")
    outcome = "timed_out" if event.timed_out else "failed"
    return AttemptRecord(**base, ended_at=now, outcome=outcome, error=event.error)

