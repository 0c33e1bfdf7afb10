"""The v1 pull-mode task service: task types, create, hold, set, and lease expiry."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared import metrics
from shared.pull.rules import (
    MAX_TASK_ID,
    PullStatus,
    PullTask,
    Report,
    TaskType,
    expire,
    new_pull_task,
    reported,
)
from shared.service import DuplicateTaskId, ServiceError, TaskNotFound, at_index
from shared.storage import PullStore
from shared.storage.base import UnknownType, all_stored, create_each
from shared.transition import compare_and_set

if TYPE_CHECKING:
    from shared.pull.steps import StepLeases


@dataclass(frozen=True)
class NewPullTask:
    """One task of a batch: what create_task takes."""

    task_type: str
    content: str = ""
    user_id: str = ""
    priority: int = 0
    stage: str = ""
    task_id: str | None = None


class UnknownTaskType(ServiceError):
    status_code = 404


class ReservedTaskType(ServiceError):
    """The task type is a pull-mode module: flows.yaml owns its settings and its tasks."""

    status_code = 409


class PullService:
    def __init__(
        self,
        store: PullStore,
        clock: Callable[[], float] = time.time,
        steps: StepLeases | None = None,
        heartbeat_timeout: float = 15.0,
    ) -> None:
        """``steps``: the task types that are pull-mode modules of flows.yaml, if any.

        ``heartbeat_timeout``: how long the lease of a worker that sends heartbeats
        lasts after its last report (the saga's, for the same liveness everywhere).
        """
        self.store = store
        self.clock = clock
        self.steps = steps
        self.heartbeat_timeout = heartbeat_timeout

    def _flow_steps(self, task_type: str) -> StepLeases | None:
        return self.steps if self.steps is not None and self.steps.owns(task_type) else None

    def _not_reserved(self, task_type: str, what: str) -> None:
        if self._flow_steps(task_type) is not None:
            raise ReservedTaskType(
                f"task type {task_type!r} is a pull-mode module of flows.yaml: {what}"
            )

    def register_type(self, fields: Mapping[str, Any], partial: bool = False) -> TaskType:
        """Create or change a task type; ``partial`` keeps the fields not given (register_task)."""
        self._not_reserved(str(fields.get("task_type")), "its settings are in flows.yaml")
        current = self.store.get_type(str(fields.get("task_type"))) if partial else None
        base = current.model_dump() if current is not None else {}
        config = TaskType.model_validate({**base, **{k: v for k, v in fields.items() if v is not None}})
        return self.store.save_type(config, self.clock())

    def task_type(self, name: str) -> TaskType:
        steps = self._flow_steps(name)
        if steps is not None:
            return steps.types[name]
        config = self.store.get_type(name)
        if config is None:
            raise _unknown(name)
        return config

    def create(
        self,
        task_type: str,
        content: str,
        user_id: str = "",
        priority: int = 0,
        stage: str = "",
        task_id: str | None = None,
    ) -> tuple[PullTask, bool]:
        self._not_reserved(task_type, "its tasks are the steps of flows; submit a flow")
        # The type in the id is for people reading it; the uuid makes it unique, so it may be cut.
        task_id = task_id or f"{uuid.uuid4().hex}_{task_type}"[:MAX_TASK_ID]
        # The type's settings (retries, lease) are filled in by the store, in the same statement.
        task = new_pull_task(task_id, TaskType(task_type=task_type), user_id, stage, content, priority, self.clock())
        created = self.store.create(task)
        if created is None:
            raise _unknown(task_type)
        if created[1]:
            metrics.V1_CREATED.labels(task_type).inc()
        return created

    def create_many(self, batch: Sequence[NewPullTask]) -> list[tuple[PullTask, bool]]:
        """Store every task of ``batch`` at once, or none: the error names the refused one, ``tasks[i]``."""
        first_at: dict[str, int] = {}
        tasks = []
        for i, task in enumerate(self._new_tasks(batch)):
            if not isinstance(task, ServiceError) and task.task_id in first_at:
                task = DuplicateTaskId(f"task_id {task.task_id!r} is also that of tasks[{first_at[task.task_id]}]")
            if isinstance(task, ServiceError):
                raise at_index(task, i) from None
            first_at[task.task_id] = i
            tasks.append(task)
        try:
            return self._counted(all_stored(self.store.create_many(tasks)))
        except UnknownType as exc:
            raise at_index(_unknown(exc.task_type), first_at[exc.task_id]) from None

    def create_each(self, batch: Sequence[NewPullTask]) -> list[tuple[PullTask, bool] | Exception]:
        """Concurrent create_task calls (the API's, coalesced), stored together, in one commit.

        Each is answered as :meth:`create` would answer it alone: the task as
        stored and whether it is new, or the error that refused it, which takes
        nothing from the others. A database error is raised for all of them.
        """
        prepared = self._new_tasks(batch)
        stored = create_each(
            [task for task in prepared if isinstance(task, PullTask)],
            lambda tasks: self.store.create_many(tasks, each=True),
        )
        self._counted([answer for answer in stored if isinstance(answer, tuple)])
        answers = (_unknown(answer.task_type) if isinstance(answer, UnknownType) else answer for answer in stored)
        return [task if isinstance(task, ServiceError) else next(answers) for task in prepared]

    def _new_tasks(self, batch: Sequence[NewPullTask]) -> list[PullTask | ServiceError]:
        """The tasks of ``batch``, or why each cannot be created.

        Their types' settings are the store's to fill in, read with the insert
        (:meth:`PullStore.create_many`): a read of each type first was a round trip
        per batch of coalesced calls.
        """
        now = self.clock()
        configs: dict[str, TaskType] = {}
        tasks: list[PullTask | ServiceError] = []
        for new in batch:
            task_id = new.task_id or f"{uuid.uuid4().hex}_{new.task_type}"[:MAX_TASK_ID]
            config = configs.get(new.task_type)
            if config is None:
                try:
                    self._not_reserved(new.task_type, "its tasks are the steps of flows; submit a flow")
                except ServiceError as exc:
                    tasks.append(exc)
                    continue
                config = configs[new.task_type] = TaskType(task_type=new.task_type)  # its settings: the store's
            tasks.append(new_pull_task(task_id, config, new.user_id, new.stage, new.content, new.priority, now))
        return tasks

    def _counted(self, stored: list[tuple[PullTask, bool]]) -> list[tuple[PullTask, bool]]:
        for task, created in stored:
            if created:
                metrics.V1_CREATED.labels(task.task_type).inc()
        return stored

    def types(self) -> list[TaskType]:
        """Registered task types and those of pull-mode modules, by name."""
        found = {t.task_type: t for t in self.store.types()}
        found.update(self.steps.types if self.steps is not None else {})
        return [found[name] for name in sorted(found)]

    def hold(self, task_type: str, heartbeat: bool = False) -> list[PullTask]:
        """Lease pending tasks of ``task_type``; with ``heartbeat`` the worker promises a
        set_task with status 2 at least every third of ``heartbeat_timeout`` while it works,
        and a lease whose reports stop ends after ``heartbeat_timeout``."""
        return self._hold(task_type, heartbeat, 1)[0]

    def hold_each(self, batch: Sequence[tuple[str, bool]]) -> list[list[PullTask] | Exception]:
        """Concurrent hold_tasks calls (the API's, coalesced), each a (task_type, heartbeat).

        Each is answered as :meth:`hold` would answer it, as if the calls came one
        after another, those of one type and heartbeat together in their order: they
        share one claim of as many tasks as their limits add up to, handed out oldest
        first. A call whose claim failed gets the error; the others keep their tasks.
        """
        answers: list[list[PullTask] | Exception] = [[] for _ in batch]
        calls: dict[tuple[str, bool], list[int]] = {}
        for i, call in enumerate(batch):
            calls.setdefault(call, []).append(i)
        for (task_type, heartbeat), at in calls.items():
            shares: Sequence[list[PullTask] | Exception]
            try:
                shares = self._hold(task_type, heartbeat, len(at))
            except Exception as exc:  # this claim's callers are told; the other claims stand
                shares = [exc] * len(at)
            for i, share in zip(at, shares, strict=True):
                answers[i] = share
        return answers

    def _hold(self, task_type: str, heartbeat: bool, calls: int) -> list[list[PullTask]]:
        """The tasks of ``calls`` consecutive holds of ``task_type``, claimed at once."""
        steps = self._flow_steps(task_type)
        timeout = self.heartbeat_timeout if heartbeat else None
        if steps is not None:
            limit = steps.types[task_type].schedule_limit
            leased = self.store.hold(task_type, limit * calls, self.clock(), timeout)
            leased = steps.started(leased, heartbeat) if leased else []
        elif calls == 1:
            # schedule_limit is read by the claim itself: one statement per poll.
            leased = self.store.hold(task_type, None, self.clock(), timeout)
            if not leased:
                self.task_type(task_type)  # an unknown type is an error, not an empty queue
            limit = len(leased)
        else:
            limit = self.task_type(task_type).schedule_limit
            leased = self.store.hold(task_type, limit * calls, self.clock(), timeout)
        if leased:
            metrics.V1_LEASED.labels(task_type).inc(len(leased))
        return [leased[i * limit : (i + 1) * limit] for i in range(calls)]

    def set(self, task_id: str, report: Report) -> PullTask:
        task = self.get(task_id)
        steps = self._flow_steps(task.task_type)
        new = steps.report(task, report, self.clock()) if steps is not None else self._save_report(task, report)
        metrics.V1_REPORTED.labels(task.task_type, int(report.status)).inc()
        if new.status in (PullStatus.SUCCESS, PullStatus.FAILED):
            metrics.V1_FINISHED.labels(task.task_type, int(new.status)).inc()
        return new

    def _save_report(self, task: PullTask, report: Report) -> PullTask:
        now = self.clock()
        _, new = compare_and_set(
            f"task {task.task_id}",
            lambda: self.get(task.task_id),
            lambda current: reported(current, report, now),  # raises InvalidReport
            lambda _, new: self.store.save(new),
            known=task,
        )
        return new

    def due(self, now: float, limit: int) -> list[PullTask]:
        """Leases ended by ``now``: the scheduler's work."""
        return self.store.due(now, limit)

    def expire(self, task: PullTask, now: float) -> bool:
        """A lease past max_processing_time is a failed attempt (retry or fail); False if it was not."""
        _, new = compare_and_set(
            f"task {task.task_id}",
            lambda: self.get(task.task_id),
            lambda current: expire(current, now),
            lambda _, new: None if new is None else self.store.save(new),
            known=task,
        )
        if new is not None:
            metrics.V1_LEASE_EXPIRIES.labels(task.task_type).inc()
        return new is not None  # compare_and_set returns a change only once it is stored

    def list(
        self, task_type: str | None, status: int | None, stage: str | None, limit: int, user_id: str | None
    ) -> list[PullTask]:
        """Newest first."""
        return self.store.list(task_type, status, stage, limit, user_id=user_id)

    def count(self, task_type: str) -> dict[int, int]:
        """Tasks of a known ``task_type`` by status, every status present."""
        self.task_type(task_type)
        counts = self.store.count(task_type)
        return {int(s): counts.get(int(s), 0) for s in PullStatus}

    def get(self, task_id: str) -> PullTask:
        task = self.store.get(task_id)
        if task is None:
            raise TaskNotFound(f"no task {task_id!r}")
        return task


def _unknown(task_type: str) -> UnknownTaskType:
    return UnknownTaskType(f"unknown task_type {task_type!r}: register it with register_task_type")
