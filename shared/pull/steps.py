"""Saga steps of pull-mode modules: leased by external workers through the v1 API.

A pull-mode module's queue is a table. Publishing one of its step messages
writes a v1 task: task_type = the module, task_stage = the command, task_id =
``<task id>.<seq>``, task_content = the step as JSON. ``hold_tasks`` leases it and
records the start of the attempt in the saga; ``set_task`` is turned into the
saga's outcome event. The saga alone decides what follows (next step, retry
after backoff, rollback, poll later), with the timeouts and retries of flows.yaml,
exactly as for push-mode modules. The v1 row only mirrors the attempt: its own
retry count stays 0 and its lease ends with the step's deadline.

The ``seq`` in the id fences workers: a report for an attempt that has been
decided already (it timed out and ran again elsewhere, the task was cancelled)
is refused as stale instead of deciding the newer attempt.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shared.flows import FlowSet, ModuleDecl
from shared.module import idempotency_key
from shared.pull.rules import InvalidReport, PullStatus, PullTask, Report, TaskType
from shared.records import evolve
from shared.saga import Event, Failed, Heartbeat, PollLater, Started, Succeeded, message_for
from shared.service import Publisher, TaskNotFound, TaskService, publish_each
from shared.states import StepType
from shared.storage import PullStore
from shared.task import Alarm, StepMessage, Task

log = logging.getLogger(__name__)

MAX_PROCESSING_TIME = 7 * 24 * 3600  # TaskType's bound


# --- the mapping, no I/O ---------------------------------------------------------------


def step_id(task_id: str, seq: int) -> str:
    return f"{task_id}.{seq}"


def parse_step_id(pull_id: str) -> tuple[str, int] | None:
    task_id, dot, seq = pull_id.rpartition(".")
    if not dot or not task_id or not seq.isdigit():
        return None
    return task_id, int(seq)


def step_content(message: StepMessage) -> str:
    """What the worker gets for a step: where it is in its flow, and the Parameters."""
    return json.dumps(
        {
            "task_id": message.task_id,
            "flow": message.flow,
            "step": message.cursor,
            "rollback": message.type is StepType.ROLLBACK,
            "attempt": message.attempt,
            "command": message.command,
            "timeout": message.timeout,
            "idempotency_key": idempotency_key(
                message.task_id, message.cursor, int(message.type), message.attempt
            ),
            "parameters": dict(message.parameters),
        },
        ensure_ascii=False,
    )


def lease_seconds(timeout: float, grace: float) -> int:
    """The v1 lease ends with the saga's deadline for the attempt."""
    return min(max(1, math.ceil(timeout + grace)), MAX_PROCESSING_TIME)


def step_task(message: StepMessage, now: float, grace: float) -> PullTask:
    return PullTask(
        task_id=step_id(message.task_id, message.seq),
        task_type=message.module,
        user_id="",
        task_stage=message.command,
        status=PullStatus.PENDING,
        priority=0,
        crt_retry_num=0,
        max_retry_num=0,  # the saga retries, with a new seq
        max_retry_interval=0,
        max_processing_time=lease_seconds(message.timeout, grace),
        schedule_log="",
        task_content=step_content(message),
        order_time=now,
        create_time=now,
        modify_time=now,
    )


def module_task_type(name: str, decl: ModuleDecl, flows: FlowSet, grace: float) -> TaskType:
    """The v1 task type of a pull-mode module, as get_task_schedule_cfg_list shows it."""
    timeouts = [a.timeout for f in flows.flows.values() for _, _, a in f.actions() if a.module == name]
    return TaskType(
        task_type=name,
        schedule_limit=decl.schedule_limit,
        schedule_interval=decl.schedule_interval,
        max_processing_time=lease_seconds(max(timeouts, default=1), grace),
        max_retry_num=0,
        max_retry_interval=0,
    )


def step_result(content: str | None) -> dict[str, Any]:
    """A worker's task_content: a JSON object merged into the task's Parameters, or nothing."""
    if content is None or not content.strip():
        return {}
    try:
        value = json.loads(content)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidStepReport(
            "task_content of a flow step must be a JSON object (merged into the task's Parameters) or empty"
        )
    return value


class InvalidStepReport(ValueError):
    """A set_task for a flow step whose fields cannot be used."""


def step_event(report: Report, seq: int, task: Task, poll_interval: float, now: float) -> Event | None:
    """The saga event a worker's set_task stands for; None for progress (status 2).

    A success reported after the step's timeout counts as a timeout, as it does
    for a push-mode handler that overran: the saga may already be deciding
    what comes next.
    """
    result = step_result(report.task_content)
    if report.status is PullStatus.RUNNING:
        return None
    # Status 1 with a higher crt_retry_num is seed 001's way to report a failed attempt.
    if report.status is PullStatus.FAILED or (report.crt_retry_num or 0) > 0:
        return Failed(seq, report.schedule_log or "the worker reported a failure")
    if report.status is PullStatus.PENDING:
        return PollLater(seq, poll_interval, result)
    active = task.active
    if active is not None and active.seq == seq and active.started_at is not None:
        timeout = task.steps[active.cursor].action(active.type).timeout
        if now - active.started_at > timeout:
            return Failed(seq, f"reported after the {timeout:g}s timeout", timed_out=True)
    return Succeeded(seq, result)


# --- the edges -----------------------------------------------------------------------------


class StepQueue:
    """Publishes step messages of pull-mode modules into the v1 task table."""

    def __init__(
        self,
        store: PullStore,
        modules: Mapping[str, ModuleDecl],
        grace: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.modules = dict(modules)
        self.grace = grace
        self.clock = clock

    def publish(self, message: StepMessage) -> None:
        self.store.enqueue(step_task(message, self.clock(), self.grace))


class RoutingPublisher:
    """Step messages of pull-mode modules go to the v1 table, the rest to the broker."""

    def __init__(self, broker: Publisher, queue: StepQueue) -> None:
        self.broker = broker
        self.queue = queue

    def publish(self, message: StepMessage) -> None:
        if message.module in self.queue.modules:
            self.queue.publish(message)
        else:
            self.broker.publish(message)

    def publish_many(self, messages: Sequence[StepMessage]) -> list[tuple[StepMessage, Exception]]:
        pulled = [m for m in messages if m.module in self.queue.modules]
        failed = publish_each(self.queue, pulled)
        return failed + self.broker.publish_many([m for m in messages if m.module not in self.queue.modules])

    def alarm(self, alarm: Alarm) -> None:
        self.broker.alarm(alarm)

    def healthy(self) -> bool:
        return self.broker.healthy()


class StepLeases:
    """hold_tasks and set_task for the task types that are pull-mode modules."""

    def __init__(self, saga: TaskService, store: PullStore, flows: FlowSet, grace: float) -> None:
        self.saga = saga
        self.store = store
        self.modules = flows.pull_modules()
        self.types = {name: module_task_type(name, decl, flows, grace) for name, decl in self.modules.items()}

    def owns(self, task_type: str) -> bool:
        return task_type in self.modules

    def started(self, leased: list[PullTask], heartbeats: bool = False) -> list[PullTask]:
        """Record the start of each leased step; give the worker only those the saga accepted."""
        given = []
        for row in leased:
            parsed = parse_step_id(row.task_id)
            reason = None
            if parsed is None:
                reason = "not a flow step id"
            else:
                try:
                    decision = self.saga.apply(parsed[0], Started(parsed[1], heartbeats))
                    reason = decision.ignored
                except TaskNotFound as exc:
                    reason = str(exc)
            if reason is None:
                # The stored Parameters, not the published copy: the database is the truth.
                given.append(evolve(row, task_content=step_content(message_for(decision.task))))
                continue
            # A copy of an attempt already started elsewhere, or of a cancelled task.
            log.info("pull-mode step not leased: %s", reason, extra={"task_id": row.task_id})
            self.store.save(evolve(row, status=PullStatus.FAILED, schedule_log=f"not leased: {reason}"))
        return given

    def report(self, row: PullTask, report: Report, now: float) -> PullTask:
        """Turn a set_task into the saga's event; refused if that attempt is over."""
        parsed = parse_step_id(row.task_id)
        if parsed is None:
            raise InvalidReport(f"task {row.task_id} is not a flow step")
        task_id, seq = parsed
        task = self.saga.get(task_id)
        event = step_event(report, seq, task, self.modules[row.task_type].poll_interval, now)
        if event is None:
            return self._progress(row, task_id, seq, report, now)
        decision = self.saga.apply(task_id, event, known=task)
        if decision.ignored:
            raise InvalidReport(f"this attempt of the step is over: {decision.ignored}")
        ended = evolve(
            row,
            status=PullStatus.FAILED if isinstance(event, Failed) else PullStatus.SUCCESS,
            schedule_log=report.schedule_log if report.schedule_log is not None else _log_for(event),
            task_content=report.task_content if report.task_content is not None else row.task_content,
            modify_time=now,
        )
        # The saga holds the outcome; the row only mirrors it, so a lost race here is harmless.
        self.store.save(ended)
        return ended

    def _progress(self, row: PullTask, task_id: str, seq: int, report: Report, now: float) -> PullTask:
        """A status-2 report. From a worker that sends heartbeats it renews the attempt;
        otherwise the step's timeout in flows.yaml still bounds it, and nothing changes."""
        if row.status is not PullStatus.RUNNING:
            raise InvalidReport(f"this attempt of the step is over: its lease ended ({row.status.name.lower()})")
        if not row.heartbeat_timeout:
            return row
        progress = step_result(report.task_content) or None
        decision = self.saga.apply(task_id, Heartbeat(seq, progress), worker=f"v1:{row.task_type}")
        if decision.ignored:
            raise InvalidReport(f"this attempt of the step is over: {decision.ignored}")
        renewed = evolve(row, modify_time=now)
        self.store.save(renewed)
        return renewed


def _log_for(event: Event) -> str:
    if isinstance(event, Failed):
        return event.error
    if isinstance(event, PollLater):
        return f"not finished: leased again in {event.after:g}s"
    return "done"
