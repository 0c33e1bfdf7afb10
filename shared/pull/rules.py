"""Pull-mode tasks of the Asyncflow v1 API (seeds 000 and 001): the rules, no I/O.

Workers in any language lease pending tasks of a type with hold_tasks and report
with set_task. Ordering is one number, ``order_time`` (seed 000 §三.2): the
smallest is leased first.

    created, or a stage succeeded:    order_time = now - priority
    failed (or its lease expired):    order_time = now + the retry delay (shared.retry)

so a high-priority task that fails does not jump the queue during its retry
interval, and a task entering a new stage goes behind the ones already waiting.
Statuses: 1 pending, 2 running, 3 success, 4 failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from pydantic import BaseModel, ConfigDict, Field

from shared.names import NAME
from shared.records import evolve
from shared.retry import retry_delay

# Room for a pull-mode saga step's "<task id (64)>.<seq>"; the width of af_pull_tasks.task_id.
MAX_TASK_ID = 80
MAX_CONTENT_BYTES = 4096  # seed 001 §三.2: task_content is a small context (JSON, a URL...)
MAX_LOG_BYTES = 4096


class PullStatus(IntEnum):
    PENDING = 1
    RUNNING = 2
    SUCCESS = 3
    FAILED = 4


class InvalidReport(Exception):
    """A set_task that the task's state does not allow (not running, unknown status)."""


class TaskType(BaseModel):
    """Scheduling settings of one task type, with the documented defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_type: str = Field(pattern=NAME)
    schedule_limit: int = Field(default=100, ge=1, le=1000)  # tasks per hold_tasks
    schedule_interval: int = Field(default=1, ge=0, le=3600)  # seconds between polls (for workers)
    max_processing_time: int = Field(default=300, ge=1, le=7 * 24 * 3600)  # lease, seconds
    max_retry_num: int = Field(default=3, ge=0, le=1000)
    max_retry_interval: int = Field(default=10, ge=-24 * 3600, le=24 * 3600)  # shared.retry


@dataclass(frozen=True)
class PullTask:
    task_id: str
    task_type: str
    user_id: str
    task_stage: str
    status: PullStatus
    priority: int
    crt_retry_num: int
    max_retry_num: int
    max_retry_interval: int
    max_processing_time: int
    schedule_log: str
    task_content: str
    order_time: float
    create_time: float
    modify_time: float
    version: int = 0
    # Leased by a worker that sends heartbeats (set_task status 2): the lease ends this
    # long after its last report. None: max_processing_time after it.
    heartbeat_timeout: float | None = None

    @property
    def lease_until(self) -> float | None:
        """When a running task's lease ends; None when it is not running."""
        if self.status is not PullStatus.RUNNING:
            return None
        return self.modify_time + (self.heartbeat_timeout or self.max_processing_time)


@dataclass(frozen=True)
class Report:
    """What a worker's set_task says (fields it did not send are None)."""

    status: PullStatus
    task_stage: str | None = None
    task_content: str | None = None
    schedule_log: str | None = None
    crt_retry_num: int | None = None


# What a new task takes from its type: its retries and its lease.
TYPE_SETTINGS = ("max_retry_num", "max_retry_interval", "max_processing_time")


def type_settings(config: TaskType) -> dict[str, int]:
    """The values of ``config``'s TYPE_SETTINGS, for a new task of its type."""
    return {name: getattr(config, name) for name in TYPE_SETTINGS}


def new_pull_task(
    task_id: str,
    config: TaskType,
    user_id: str,
    stage: str,
    content: str,
    priority: int,
    now: float,
) -> PullTask:
    return PullTask(
        task_id=task_id,
        task_type=config.task_type,
        user_id=user_id,
        task_stage=stage,
        status=PullStatus.PENDING,
        priority=priority,
        crt_retry_num=0,
        max_retry_num=config.max_retry_num,
        max_retry_interval=config.max_retry_interval,
        max_processing_time=config.max_processing_time,
        schedule_log="",
        task_content=content,
        order_time=now - priority,
        create_time=now,
        modify_time=now,
    )


def leased(task: PullTask, now: float, heartbeat_timeout: float | None = None) -> PullTask:
    return evolve(task, status=PullStatus.RUNNING, modify_time=now, heartbeat_timeout=heartbeat_timeout)


def _failed_attempt(task: PullTask, now: float) -> PullTask:
    """One more failure: retry after the interval, or fail for good."""
    if task.crt_retry_num >= task.max_retry_num:
        return evolve(task, status=PullStatus.FAILED, modify_time=now)
    delay = retry_delay(task.crt_retry_num, task.max_retry_interval)
    return evolve(
        task,
        status=PullStatus.PENDING,
        crt_retry_num=task.crt_retry_num + 1,
        order_time=now + delay,
        modify_time=now,
    )


def reported(task: PullTask, report: Report, now: float) -> PullTask:
    """The task after a worker's set_task."""
    after = _reported(task, report, now)
    # A lease's heartbeat timeout ends with the lease.
    return after if after.status is PullStatus.RUNNING else evolve(after, heartbeat_timeout=None)


def _reported(task: PullTask, report: Report, now: float) -> PullTask:
    if task.status is not PullStatus.RUNNING:
        raise InvalidReport(
            f"task {task.task_id} is {task.status.name.lower()}, not running: only a leased task can be set"
        )
    task = evolve(
        task,
        task_content=report.task_content if report.task_content is not None else task.task_content,
        schedule_log=report.schedule_log if report.schedule_log is not None else task.schedule_log,
    )
    if report.status is PullStatus.SUCCESS:
        return evolve(task, status=PullStatus.SUCCESS, modify_time=now)
    if report.status is PullStatus.FAILED:
        return _failed_attempt(task, now)
    if report.status is PullStatus.RUNNING:  # progress: the lease starts again
        return evolve(task, modify_time=now)
    # PENDING: a retry counted by the worker, or the next stage (seed 001 §三.3).
    if report.crt_retry_num is not None and report.crt_retry_num > task.crt_retry_num:
        return _failed_attempt(task, now)
    stage = report.task_stage if report.task_stage is not None else task.task_stage
    return evolve(
        task,
        status=PullStatus.PENDING,
        task_stage=stage,
        crt_retry_num=0 if stage != task.task_stage else task.crt_retry_num,
        order_time=now - task.priority,
        modify_time=now,
    )


def expire(task: PullTask, now: float) -> PullTask | None:
    """A running task past max_processing_time counts as a failed attempt (seed 000 §三.5).

    A line is added to schedule_log, so whoever reads the task sees why it ran again.
    """
    end = task.lease_until
    if end is None or now < end:
        return None
    if task.heartbeat_timeout:
        line = f"lease expired: worker lost, no heartbeat within {task.heartbeat_timeout:g} s"
    else:
        line = f"lease expired: no report within max_processing_time ({task.max_processing_time} s)"
    log = f"{task.schedule_log}\n{line}" if task.schedule_log else line
    return _failed_attempt(evolve(task, schedule_log=log[-MAX_LOG_BYTES:], heartbeat_timeout=None), now)
