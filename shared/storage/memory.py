"""In-memory stores for unit tests of the engine and of user modules.

They keep the contract of the SQL stores (tests/integration/test_store_contract.py
and test_pull_store_contract.py run on both), so tests written against them hold
on a real database.
"""

from __future__ import annotations

import builtins
import threading
from dataclasses import replace

from shared.pull.rules import PullStatus, PullTask, TaskType
from shared.states import Phase
from shared.storage.base import (
    AttemptRecord,
    PullStore,
    TaskConflict,
    TaskFilter,
    TaskStore,
    same_request,
)
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

    def attempts(self, task_id: str) -> builtins.list[AttemptRecord]:
        return sorted(
            (a for (tid, _), a in self._attempts.items() if tid == task_id), key=lambda a: a.seq
        )

    def due(self, now: float, limit: int) -> builtins.list[tuple[str, int, Phase]]:
        ready = sorted(
            (t.active.due_at, t.task_id, t.active.seq, t.active.phase)
            for t in self._tasks.values()
            if t.active is not None and t.active.due_at is not None and t.active.due_at <= now
        )
        return [(task_id, seq, phase) for _, task_id, seq, phase in ready[:limit]]

    def ping(self) -> None:
        return None


class InMemoryPullStore(PullStore):
    def __init__(self) -> None:
        self._types: dict[str, TaskType] = {}
        self._tasks: dict[str, PullTask] = {}
        self._lock = threading.Lock()

    def save_type(self, config: TaskType, now: float) -> TaskType:
        with self._lock:
            self._types[config.task_type] = config
        return config

    def get_type(self, task_type: str) -> TaskType | None:
        return self._types.get(task_type)

    def types(self) -> list[TaskType]:
        return [self._types[name] for name in sorted(self._types)]

    def create(self, task: PullTask) -> tuple[PullTask, bool] | None:
        with self._lock:
            config = self._types.get(task.task_type)
            if config is None:
                return None
            stored = self._tasks.get(task.task_id)
            if stored is not None:
                if (stored.task_type, stored.user_id) != (task.task_type, task.user_id):
                    raise TaskConflict(f"task id {task.task_id!r} is already used")
                return stored, False
            task = replace(
                task,
                max_retry_num=config.max_retry_num,
                max_retry_interval=config.max_retry_interval,
                max_processing_time=config.max_processing_time,
                version=1,
            )
            self._tasks[task.task_id] = task
            return task, True

    def enqueue(self, task: PullTask) -> None:
        with self._lock:
            stored = self._tasks.get(task.task_id)
            if stored is None:
                self._tasks[task.task_id] = replace(task, version=1)
            elif stored.status is not PullStatus.PENDING:
                self._tasks[task.task_id] = replace(
                    task, create_time=stored.create_time, version=stored.version + 1
                )

    def get(self, task_id: str) -> PullTask | None:
        return self._tasks.get(task_id)

    def list(
        self,
        task_type: str | None,
        status: int | None,
        stage: str | None,
        limit: int,
        user_id: str | None = None,
    ) -> list[PullTask]:
        found = [
            t
            for t in list(self._tasks.values())
            if (task_type is None or t.task_type == task_type)
            and (status is None or t.status == status)
            and (stage is None or t.task_stage == stage)
            and (user_id is None or t.user_id == user_id)
        ]
        found.sort(key=lambda t: t.create_time, reverse=True)
        return found[:limit]

    def count(self, task_type: str) -> dict[int, int]:
        counts: dict[int, int] = {}
        for t in list(self._tasks.values()):
            if t.task_type == task_type:
                counts[int(t.status)] = counts.get(int(t.status), 0) + 1
        return counts

    def hold(self, task_type: str, limit: int | None, now: float) -> builtins.list[PullTask]:
        with self._lock:
            if limit is None:
                config = self._types.get(task_type)
                limit = config.schedule_limit if config is not None else 0
            ready = sorted(
                (
                    t
                    for t in self._tasks.values()
                    if t.task_type == task_type and t.status is PullStatus.PENDING and t.order_time <= now
                ),
                key=lambda t: t.order_time,
            )[:limit]
            held = [replace(t, status=PullStatus.RUNNING, modify_time=now, version=t.version + 1) for t in ready]
            self._tasks.update((t.task_id, t) for t in held)
            return held

    def save(self, task: PullTask) -> bool:
        with self._lock:
            stored = self._tasks.get(task.task_id)
            if stored is None or stored.version != task.version:
                return False
            self._tasks[task.task_id] = replace(task, version=task.version + 1)
            return True

    def due(self, now: float, limit: int) -> builtins.list[PullTask]:
        running = sorted(
            (t for t in list(self._tasks.values()) if t.status is PullStatus.RUNNING),
            key=lambda t: t.modify_time + t.max_processing_time,
        )
        return [t for t in running if t.modify_time + t.max_processing_time <= now][:limit]
