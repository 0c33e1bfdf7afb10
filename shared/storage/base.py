"""What the engine needs from storage, and the errors storage raises."""

from __future__ import annotations

import abc
import builtins
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from shared.pull.rules import PullTask, TaskType
from shared.retry import reconnect_delay
from shared.schedules.model import Run, Schedule
from shared.states import Phase, StepType, TaskStatus
from shared.task import Task

log = logging.getLogger(__name__)
T = TypeVar("T")


class StorageError(Exception):
    """Root of storage errors."""


class StorageUnavailable(StorageError):
    """The database cannot be reached or refused the operation; try again later."""


class TaskConflict(StorageError):
    """A task with this id exists and belongs to another caller or flow."""


def patiently(
    call: Callable[[], T],
    patience: float,
    doing: str,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``call()``, again and again while the database is unavailable, for up to ``patience`` seconds.

    ``doing`` names the call in the log ("storing the outcome").

    Then the last :class:`StorageUnavailable` is raised. For work that is worth
    keeping through a short outage (a finished attempt's outcome); a caller that
    can simply come back later (a sweep, a request) should not wait.
    """
    deadline = clock() + patience
    failures = 0
    while True:
        try:
            return call()
        except StorageUnavailable as exc:
            pause = reconnect_delay(failures, first=0.5, cap=8.0)
            if clock() + pause > deadline:
                raise
            log.warning("database unavailable, %s again in %.1fs: %s", doing, pause, exc)
            sleep(pause)
            failures += 1


@dataclass(frozen=True)
class AttemptRecord:
    """One execution of one step message, kept for inspection."""

    task_id: str
    seq: int
    cursor: int
    type: StepType
    attempt: int
    module: str
    command: str
    started_at: float | None = None
    ended_at: float | None = None
    outcome: str | None = None  # succeeded, failed, timed_out, poll_later, expired
    error: str | None = None
    worker: str | None = None  # the process that ran it (shared.presence)
    heartbeat_at: float | None = None
    progress: Mapping[str, Any] | None = None  # what the handler last reported with a heartbeat
    result: Mapping[str, Any] | None = None  # what it merged into the task's parameters

    @property
    def write(self) -> str:
        """How it is stored: "insert" (a start, or a whole attempt whose start was not
        recorded), "outcome" (the end of a started one) or "heartbeat"."""
        if self.started_at is not None:
            return "insert"
        return "outcome" if self.outcome is not None else "heartbeat"


@dataclass(frozen=True)
class TaskFilter:
    flow: str | None = None
    status: TaskStatus | None = None
    user_id: str | None = None
    limit: int = 50


class TaskStore(abc.ABC):
    """The only owner of task storage: every transition goes through :meth:`save`."""

    @abc.abstractmethod
    def create(self, task: Task, now: float) -> tuple[Task, bool]:
        """Insert ``task``; on an existing id return (stored task, False).

        Raises :class:`TaskConflict` when the stored task has another flow or user.
        """

    @abc.abstractmethod
    def get(self, task_id: str) -> Task | None: ...

    @abc.abstractmethod
    def save(
        self, task: Task, now: float, attempt: AttemptRecord | None = None
    ) -> bool:
        """Store ``task`` if the stored version still equals ``task.version``.

        Returns False when another transition got there first (nothing written).
        ``attempt`` is written in the same transaction, as its ``write`` says:
        inserted, or its outcome or heartbeat updating the attempt already stored.
        """

    @abc.abstractmethod
    def list(self, where: TaskFilter) -> list[Task]:
        """Newest first."""

    @abc.abstractmethod
    def attempts(self, task_id: str) -> builtins.list[AttemptRecord]: ...

    @abc.abstractmethod
    def due(self, now: float, limit: int) -> builtins.list[tuple[str, int, Phase]]:
        """(task_id, seq, phase) of outstanding messages whose due time has come, oldest first."""

    @abc.abstractmethod
    def ping(self) -> None:
        """Raise :class:`StorageUnavailable` if the store cannot be used."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def same_request(stored: Task, task: Task) -> bool:
    return stored.flow == task.flow and stored.user_id == task.user_id


class PullStore(abc.ABC):
    """Storage of v1 pull-mode tasks and task types (seed 000); every change is a compare-and-set."""

    @abc.abstractmethod
    def save_type(self, config: TaskType, now: float) -> TaskType:
        """Insert or replace a task type's settings."""

    @abc.abstractmethod
    def get_type(self, task_type: str) -> TaskType | None: ...

    @abc.abstractmethod
    def types(self) -> list[TaskType]:
        """Registered task types, by name."""

    @abc.abstractmethod
    def create(self, task: PullTask) -> tuple[PullTask, bool] | None:
        """Insert ``task`` with its type's retry and lease settings; None for an unregistered type.

        On an existing id, returns (stored task, False), or raises
        :class:`TaskConflict` if it belongs to another type or user.
        """

    @abc.abstractmethod
    def enqueue(self, task: PullTask) -> None:
        """Insert ``task`` as pending; if its id exists and is not pending, make it pending again.

        A saga step published again (nobody started it in time) may have been
        leased by a hold whose start was never recorded: it goes back in the queue.
        A row still pending keeps its place (its order_time).
        """

    @abc.abstractmethod
    def get(self, task_id: str) -> PullTask | None: ...

    @abc.abstractmethod
    def list(
        self,
        task_type: str | None,
        status: int | None,
        stage: str | None,
        limit: int,
        user_id: str | None = None,
    ) -> list[PullTask]:
        """Newest first."""

    @abc.abstractmethod
    def count(self, task_type: str) -> dict[int, int]:
        """Tasks of ``task_type`` by status (statuses without tasks are absent)."""

    @abc.abstractmethod
    def hold(
        self, task_type: str, limit: int | None, now: float, heartbeat_timeout: float | None = None
    ) -> builtins.list[PullTask]:
        """Lease up to ``limit`` pending tasks whose order_time has come, smallest first.

        ``limit`` None: the type's schedule_limit (nothing for an unknown type).
        ``heartbeat_timeout``: the worker sends heartbeats; each lease ends that long
        after the last report (see PullTask.lease_until).
        Concurrent holds never return the same task.
        """

    @abc.abstractmethod
    def save(self, task: PullTask) -> bool:
        """Store ``task`` if the stored version still equals ``task.version``."""

    @abc.abstractmethod
    def due(self, now: float, limit: int) -> builtins.list[PullTask]:
        """Running tasks whose lease ended by ``now``, oldest lease first."""


class NotLeader(StorageError):
    """The lease a write was fenced by is no longer held: nothing was written."""


@dataclass(frozen=True)
class Lease:
    """Leadership of ``name`` (one scheduler fires): held by ``owner`` until ``expires_at``."""

    name: str
    owner: str
    epoch: int  # grows with every new owner; writes fenced by an older epoch are refused
    expires_at: float


@dataclass(frozen=True)
class Firing:
    """A schedule's new state, its new run records and the tasks they create: all or nothing.

    Written only if the stored schedule still has ``schedule.version``; ``promoted``
    are buffered runs that now fire (their records change instead of being added).
    """

    schedule: Schedule
    runs: tuple[Run, ...]
    promoted: frozenset[float] = frozenset()
    tasks: tuple[Task, ...] = ()
    pull_tasks: tuple[PullTask, ...] = ()


class ScheduleStore(abc.ABC):
    """Schedules, their runs and the leader lease. Every change is a compare-and-set on ``version``."""

    @abc.abstractmethod
    def add(self, schedule: Schedule) -> tuple[Schedule, bool]:
        """Insert ``schedule``; an existing id returns (stored schedule, False)."""

    @abc.abstractmethod
    def get(self, schedule_id: str) -> Schedule | None: ...

    @abc.abstractmethod
    def list(self, limit: int, after: str | None = None, user_id: str | None = None) -> list[Schedule]:
        """By id, those after ``after`` (of ``user_id``'s tasks, if given)."""

    @abc.abstractmethod
    def save(self, schedule: Schedule, changed: bool = True) -> bool:
        """Store ``schedule`` if the stored version is still ``schedule.version``.

        ``changed``: a user's change (definition, pause, resume), which the leader
        picks up from :meth:`changed_since`.
        """

    @abc.abstractmethod
    def delete(self, schedule_id: str) -> bool:
        """Remove the schedule and its runs; False if there was none."""

    @abc.abstractmethod
    def due(self, until: float, limit: int, after: tuple[float, str] | None = None) -> builtins.list[Schedule]:
        """Schedules to act on by ``until`` (not paused, with a next firing), by (fire_at, id).

        ``after``: only those past this (fire_at, id), to read a long list in pages.
        """

    @abc.abstractmethod
    def changed_since(self, since: float, limit: int) -> builtins.list[Schedule]:
        """Schedules users changed at or after ``since`` (paused ones included)."""

    @abc.abstractmethod
    def fire(self, firings: Iterable[Firing], lease: Lease | None, now: float) -> builtins.list[bool]:
        """Write each firing whose compare-and-set holds, in one transaction; per firing, whether it did.

        ``lease``: refuse everything (:class:`NotLeader`) unless it is still held.
        """

    @abc.abstractmethod
    def runs(self, schedule_id: str, limit: int, before: float | None = None) -> builtins.list[Run]:
        """Newest scheduled time first, those before ``before``."""

    @abc.abstractmethod
    def origins(self, task_ids: Iterable[str]) -> dict[str, Run]:
        """The run that created each of ``task_ids``, for those a schedule created."""

    @abc.abstractmethod
    def run_times(self, schedule_id: str, start: float, end: float) -> set[float]:
        """Scheduled times in [start, end] that already have a run."""

    @abc.abstractmethod
    def task_status(self, task_ids: Iterable[str]) -> dict[str, str]:
        """Status label of each existing task, flow (``TaskStatus``) or v1 (``PullStatus``)."""

    @abc.abstractmethod
    def acquire(self, name: str, owner: str, ttl: float, now: float) -> Lease | None:
        """Renew ``owner``'s lease, or take it over once expired; None while another holds it."""

    @abc.abstractmethod
    def release(self, lease: Lease) -> None:
        """Give the lease up (on a clean stop), so another scheduler takes over at once."""

    @abc.abstractmethod
    def purge(self, before: float, limit: int, tasks: bool) -> int:
        """Delete up to ``limit`` runs scheduled before ``before`` (and their ended tasks if ``tasks``)."""
