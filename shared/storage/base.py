"""What the engine needs from storage, and the errors storage raises."""

from __future__ import annotations

import abc
import builtins
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from shared.pull.rules import PullTask, TaskType
from shared.retry import reconnect_delay
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
    outcome: str | None = None  # succeeded, failed, timed_out, poll_later
    error: str | None = None


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
        ``attempt`` is written in the same transaction: inserted when it carries
        ``started_at`` (a start, or a whole attempt whose start was not recorded),
        else its outcome updates the attempt already stored.
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
    def hold(self, task_type: str, limit: int | None, now: float) -> builtins.list[PullTask]:
        """Lease up to ``limit`` pending tasks whose order_time has come, smallest first.

        ``limit`` None: the type's schedule_limit (nothing for an unknown type).
        Concurrent holds never return the same task.
        """

    @abc.abstractmethod
    def save(self, task: PullTask) -> bool:
        """Store ``task`` if the stored version still equals ``task.version``."""

    @abc.abstractmethod
    def due(self, now: float, limit: int) -> builtins.list[PullTask]:
        """Running tasks whose lease ended by ``now``, oldest lease first."""
