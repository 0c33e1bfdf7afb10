"""An in-memory store for unit tests of the engine and of user modules."""

from __future__ import annotations

import threading
from dataclasses import replace

from shared.states import Phase
from shared.storage.base import AttemptRecord, TaskConflict, TaskFilter, TaskStore, same_request
from shared.task import Task


class InMemoryStore(TaskStore):
    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}
        self._attempts: dict[tuple[str, int], AttemptRecord] = {}
        self._lock = threading.Lock()

    def create(self, task: Task, now: float) -> tuple[Task, bool]:
        with self._lock:
            stored = self._tasks.get(task.task_id)
            if stored is not None:
                if not same_request(stored, task):
                    raise TaskConflict(f"task id {task.task_id!r} is already used")
                return stored, False
            self._tasks[task.task_id] = replace(task, version=1)
            return self._tasks[task.task_id], True

    def get(self, task_id: str) -> Task | None:
        return self._tasks.get(task_id)

    def save(self, task: Task, now: float, attempt: AttemptRecord | None = None) -> bool:
        with self._lock:
            stored = self._tasks.get(task.task_id)
            if stored is None or stored.version != task.version:
                return False
            self._tasks[task.task_id] = replace(task, version=task.version + 1)
            if attempt is not None:
                key = (attempt.task_id, attempt.seq)
                previous = self._attempts.get(key)
                if previous is not None and attempt.started_at is None:
                    attempt = replace(attempt, started_at=previous.started_at)
                self._attempts[key] = attempt
            return True

    def list(self, where: TaskFilter) -> list[Task]:
        found = [
            t
            for t in self._tasks.values()
            if (where.flow is None or t.flow == where.flow)
            and (where.status is None or t.status == where.status)
            and (where.user_id is None or t.user_id == where.user_id)
        ]
        found.sort(key=lambda t: t.created_at, reverse=True)
        return found[: where.limit]

    def attempts(self, task_id: str) -> list[AttemptRecord]:
        return sorted(
            (a for (tid, _), a in self._attempts.items() if tid == task_id), key=lambda a: a.seq
        )

    def due(self, now: float, limit: int) -> list[tuple[str, int, Phase]]:
        ready = sorted(
            (t.active.due_at, t.task_id, t.active.seq, t.active.phase)
            for t in self._tasks.values()
            if t.active is not None and t.active.due_at is not None and t.active.due_at <= now
        )
        return [(task_id, seq, phase) for _, task_id, seq, phase in ready[:limit]]

    def ping(self) -> None:
        return None
