"""What the engine needs from storage, and the errors storage raises."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from shared.states import Phase, StepType, TaskStatus
from shared.task import Task


class StorageError(Exception):
    """Root of storage errors."""


class StorageUnavailable(StorageError):
    """The database cannot be reached or refused the operation; try again later."""


class TaskConflict(StorageError):
    """A task with this id exists and belongs to another caller or flow."""


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
        ``attempt`` is inserted or updated in the same transaction.
        """

    @abc.abstractmethod
    def list(self, where: TaskFilter) -> list[Task]:
        """Newest first."""

    @abc.abstractmethod
    def attempts(self, task_id: str) -> list[AttemptRecord]: ...

    @abc.abstractmethod
    def due(self, now: float, limit: int) -> list[tuple[str, int, Phase]]:
        """(task_id, seq, phase) of outstanding messages whose due time has come, oldest first."""

    @abc.abstractmethod
    def ping(self) -> None:
        """Raise :class:`StorageUnavailable` if the store cannot be used."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def same_request(stored: Task, task: Task) -> bool:
    return stored.flow == task.flow and stored.user_id == task.user_id
