"""What the engine needs from storage, and the errors storage raises."""

from __future__ import annotations

import abc
import builtins
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, TypeVar

from shared.pull.rules import PullTask, TaskType
from shared.records import evolve
from shared.retry import reconnect_delay
from shared.schedules.model import Run, Schedule
from shared.states import Phase, StepType, TaskStatus
from shared.task import Task

log = logging.getLogger(__name__)
T = TypeVar("T")


class StorageError(Exception):
    """Root of storage errors."""


class Outstanding(Enum):
    """A kind of outstanding message, as :meth:`TaskStore.due` lists them: each apart, through an
    index of its own, so that a backlog of one kind never holds up another."""

    SENT = "sent"  # queued or running: requeued or expired when due
    LATER = "later"  # a later step's, waiting: a retry's backoff, a poll
    FIRST = "first"  # a batch's first step, waiting to be published

    def holds(self, phase: Phase, seq: int) -> bool:
        if self is Outstanding.SENT:
            return phase is not Phase.WAITING
        return phase is Phase.WAITING and (seq == 1) is (self is Outstanding.FIRST)


class StorageUnavailable(StorageError):
    """The database cannot be reached or refused the operation; try again later."""


class TaskConflict(StorageError):
    """A task with this id exists and belongs to another caller or flow."""


class UnknownType(StorageError):
    """A pull task whose type is not registered: there are no settings to create it with."""

    def __init__(self, task_id: str, task_type: str) -> None:
        super().__init__(f"unknown task_type {task_type!r}")
        self.task_id, self.task_type = task_id, task_type


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
    outcome: str | None = None  # succeeded, failed, timed_out, poll_later, expired, released (given back unrun)
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
class TaskEvent:
    """Something done to a task from outside its steps (cancel, retry, resume), kept as its history."""

    task_id: str
    at: float
    kind: str  # the action: cancel, retry, resume
    actor: str | None = None  # the API caller's user; None with authentication off
    # What the action changed: {"step": n} where it restarts, and for a parameter
    # correction {"parameters": {key: {"old": value, "new": value}}} ("old" absent for a new key).
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskFilter:
    flow: str | None = None
    status: TaskStatus | None = None
    user_id: str | None = None
    limit: int = 50


# A position in the newest-first order of tasks: (created_at, task_id) of the last one shown.
Cursor = tuple[float, str]


@dataclass(frozen=True)
class TaskQuery:
    """A page of tasks for browsing (the dashboard): newest first, resumed after ``after``.

    One equality filter (user_id, else flow, else status) and the time range are
    answered by an index on (that column, created_at). Any further filter (a second
    equality, ``parameter``) is applied to the newest ``scan`` tasks the indexed
    filter reaches past ``after``, so no page reads more than ``scan`` rows; a page
    cut short by that bound says so (:attr:`TaskPage.partial`) and resumes past it.
    """

    flow: str | None = None
    status: TaskStatus | None = None
    user_id: str | None = None
    created_from: float | None = None  # inclusive
    created_until: float | None = None  # exclusive
    # (path into the parameters, value as text): {"order": {"id": 7}} matches (("order", "id"), "7").
    parameter: tuple[tuple[str, ...], str] | None = None
    after: Cursor | None = None
    limit: int = 50
    scan: int = 10_000

    @property
    def indexed(self) -> str | None:
        """The equality filter an index answers; the others are residual."""
        for name in ("user_id", "flow", "status"):
            if getattr(self, name) is not None:
                return name
        return None

    @property
    def residual(self) -> bool:
        given = sum(getattr(self, n) is not None for n in ("user_id", "flow", "status"))
        return given > 1 or self.parameter is not None


@dataclass(frozen=True)
class TaskPage:
    tasks: list[Task]
    next: Cursor | None  # where the next page starts; None at the end
    partial: bool = False  # fewer than ``limit`` found within the scan bound; more may follow


@dataclass(frozen=True)
class StatusCounts:
    """Tasks by status, bounded: each count stops at ``cap`` (shown as "cap+"), and with a
    user or flow given only the newest ``window`` tasks of that user or flow are counted."""

    counts: Mapping[TaskStatus, int]
    cap: int | None
    window: int | None


def matches_parameter(parameters: Mapping[str, Any], wanted: tuple[tuple[str, ...], str]) -> bool:
    """Whether the value at ``wanted``'s path, as text, is ``wanted``'s value (the in-memory rule)."""
    path, text = wanted
    value: Any = parameters
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return False
        value = value[key]
    if isinstance(value, bool):
        return text == ("true" if value else "false")
    if isinstance(value, str | int | float):
        return str(value) == text
    return False


# The version a task is created at: a publisher may send the task as stored with
# its first message (StepMessage.known) without reading it back.
CREATED_VERSION = 1


class Save(NamedTuple):
    """One transition for :meth:`TaskStore.save_many`: :meth:`TaskStore.save`'s arguments, no operator's event."""

    task: Task
    now: float
    attempt: AttemptRecord | None = None
    next_attempt: AttemptRecord | None = None


class TaskStore(abc.ABC):
    """The only owner of task storage: every transition goes through :meth:`save`."""

    @abc.abstractmethod
    def create(self, task: Task, now: float) -> tuple[Task, bool]:
        """Insert ``task`` at :data:`CREATED_VERSION`; on an existing id return (stored task, False).

        Raises :class:`TaskConflict` when the stored task has another flow or user.
        """

    @abc.abstractmethod
    def create_many(self, batch: Sequence[Task], now: float, each: bool = False) -> list[Stored[Task]]:
        """Insert every task of ``batch`` (distinct ids) in one commit, as :meth:`create` would each.

        An id already stored gives (stored task, False). If one belongs to another
        flow or user, :class:`TaskConflict` is raised and no task of the batch is
        stored (all or nothing); with ``each``, that task's answer is the conflict
        and the others are stored (concurrent single creates, committed together).
        """

    @abc.abstractmethod
    def get(self, task_id: str) -> Task | None: ...

    def get_many(self, task_ids: Sequence[str]) -> builtins.list[Task]:
        """The stored tasks among ``task_ids`` (one query where the store can)."""
        return [task for task in map(self.get, task_ids) if task is not None]

    @abc.abstractmethod
    def save(
        self,
        task: Task,
        now: float,
        attempt: AttemptRecord | None = None,
        event: TaskEvent | None = None,
        next_attempt: AttemptRecord | None = None,
    ) -> bool:
        """Store ``task`` if the stored version still equals ``task.version``.

        And if it was created when ``task`` was (``created_at``): a copy of a task
        since deleted does not overwrite a new task that reuses its id. Returns
        False when another transition got there first (nothing written).
        ``attempt`` is written in the same transaction, as its ``write`` says:
        inserted, or its outcome or heartbeat updating the attempt already stored.
        ``next_attempt``, the start of the step the same worker runs next, is
        inserted in it too, and ``event`` (an operator's action) is appended to
        the task's history.
        """

    def save_many(self, saves: Sequence[Save]) -> builtins.list[bool]:
        """:meth:`save` each of ``saves`` (steps' transitions); which were written.

        Each is a compare-and-set of its own, as :meth:`save` does it. A store may
        commit them together (group commit; PostgreSQL's does, in one round trip),
        and then raises, nothing written, when one is refused. Saved one by one,
        as here, one that raises is not written (False) and the others go on:
        what was written is never hidden behind an error.
        """
        written = []
        for save in saves:
            try:
                written.append(self.save(save.task, save.now, save.attempt, next_attempt=save.next_attempt))
            except Exception:
                log.warning("a transition was not saved", exc_info=True, extra={"task_id": save.task.task_id})
                written.append(False)
        return written

    @abc.abstractmethod
    def events(self, task_id: str) -> builtins.list[TaskEvent]:
        """The task's history (:class:`TaskEvent`), oldest first."""

    @abc.abstractmethod
    def list(self, where: TaskFilter) -> list[Task]:
        """Newest first."""

    @abc.abstractmethod
    def attempts(self, task_id: str) -> builtins.list[AttemptRecord]: ...

    @abc.abstractmethod
    def due(
        self, now: float, limit: int, kind: Outstanding, flow: str | None = None
    ) -> builtins.list[tuple[str, int, Phase]]:
        """(task_id, seq, phase) of outstanding messages of ``kind`` whose due time has come,
        oldest first; only ``flow``'s if given."""

    @abc.abstractmethod
    def waiting_flows(self) -> builtins.list[str]:
        """The flows with a batch's first steps waiting to be published (Outstanding.FIRST),
        the flow of the oldest first."""

    @abc.abstractmethod
    def ping(self) -> None:
        """Raise :class:`StorageUnavailable` if the store cannot be used."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    # --- reads for browsing (the dashboard); bounded so they stay cheap on millions of tasks

    @abc.abstractmethod
    def page(self, query: TaskQuery) -> TaskPage:
        """Tasks matching ``query``, newest first (ties by task_id, descending)."""

    @abc.abstractmethod
    def count_by_status(
        self, user_id: str | None = None, flow: str | None = None, cap: int = 10_000, window: int = 50_000
    ) -> StatusCounts:
        """See :class:`StatusCounts` for the bounds."""

    @abc.abstractmethod
    def attempts_of(self, task_ids: Iterable[str]) -> dict[str, builtins.list[AttemptRecord]]:
        """The attempts of each of ``task_ids`` (those with any), by seq."""

    @abc.abstractmethod
    def flow_attempts(self, flow: str, since: float, newest: int) -> builtins.list[AttemptRecord]:
        """The attempts of the newest ``newest`` tasks of ``flow`` created at or after ``since``."""


def same_request(stored: Task, task: Task) -> bool:
    return stored.flow == task.flow and stored.user_id == task.user_id


def same_pull_request(stored: PullTask, task: PullTask) -> bool:
    return stored.task_type == task.task_type and stored.user_id == task.user_id


Created = TypeVar("Created", Task, PullTask)
# What create_many answers for one task of its batch: the task as stored and whether
# this call created it, or (with ``each``) what refused it: its id taken by another
# request, or for a pull task its type not registered.
Stored = tuple[Created, bool] | TaskConflict | UnknownType | StorageUnavailable


def batch_created(
    batch: Sequence[Created],
    inserted: Mapping[str, Mapping[str, Any]],
    found: Iterable[Created],
    same: Callable[[Created, Created], bool],
    each: bool = False,
    unread: StorageUnavailable | None = None,
) -> list[Stored[Created]]:
    """What a create_many answers once it knows what it ``inserted`` and the stored tasks ``found`` for the rest.

    ``inserted`` maps the id of each task inserted to the columns the store filled
    in (a pull task's settings, from its type's row). Its insert skips an id
    already stored instead of failing and undoing the batch (PostgreSQL waits for a
    concurrent create of that id, then skips it). Such a task must be the ``same``
    request again. If not, :class:`TaskConflict` is raised before anything is
    committed, so that none of the batch is stored; or, with ``each``, answered for
    that task alone while the others are committed. A pull task neither inserted
    nor stored is one whose type is not registered: :class:`UnknownType`, the same way.
    The stored tasks may be read after the others' commit: if that read found the
    database unavailable (``unread``), that is the answer of each task not inserted
    (with ``each``; else it is raised, nothing of the batch having been inserted).
    """
    stored = {task.task_id: task for task in found}
    answer: list[Stored[Created]] = []
    for task in batch:
        filled = inserted.get(task.task_id)
        if filled is not None:
            answer.append((evolve(task, version=CREATED_VERSION, **filled), True))
            continue
        if unread is not None:
            if not each:
                raise unread
            answer.append(unread)
            continue
        old = stored.get(task.task_id)
        if old is None or not same(old, task):
            refused: TaskConflict | UnknownType = TaskConflict(f"task id {task.task_id!r} is already used")
            if old is None and isinstance(task, PullTask):
                refused = UnknownType(task.task_id, task.task_type)
            if not each:
                raise refused
            answer.append(refused)
            continue
        answer.append((old, False))
    return answer


def all_stored(answer: Sequence[Stored[Created]]) -> list[tuple[Created, bool]]:
    """The answer of an all-or-none create_many, which raises what refused a task instead of answering it."""
    stored = []
    for one in answer:
        if not isinstance(one, tuple):
            raise one
        stored.append(one)
    return stored


def create_each(
    tasks: Sequence[Created], create_many: Callable[[Sequence[Created]], Sequence[Stored[Created]]]
) -> list[Stored[Created] | Exception]:
    """``create_many(batch, each=True)`` for ``tasks`` whose ids may repeat (concurrent replays of one request).

    A repeated id waits for a later transaction, where it finds the first one
    stored and is answered as a replay of it, or a conflict, as it would be alone.
    The first transaction's error is raised; a later one's is the answer of the
    tasks it was to store alone, since the tasks before it are committed.
    """
    answers: list[Stored[Created] | Exception | None] = [None] * len(tasks)
    pending = list(range(len(tasks)))
    while pending:
        seen: set[str] = set()
        first: list[int] = []
        later: list[int] = []
        for i in pending:
            (later if tasks[i].task_id in seen else first).append(i)
            seen.add(tasks[i].task_id)
        stored: Sequence[Stored[Created] | Exception]
        try:
            stored = create_many([tasks[i] for i in first])
        except Exception as exc:
            if len(pending) == len(tasks):
                raise
            stored = [exc] * len(first)
            later = []
        for i, answer in zip(first, stored, strict=True):
            answers[i] = answer
        pending = later
    return [answer for answer in answers if answer is not None]


@dataclass(frozen=True)
class TypeSummary:
    """A v1 task type at a glance: (stage, status) counts over its newest ``window`` tasks,
    and the lease of its running task leased longest ago."""

    by_stage: Mapping[tuple[str, int], int]
    window: int
    running: int
    oldest_lease_at: float | None  # when that task was leased (or last reported)


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
    def create_many(self, batch: Sequence[PullTask], each: bool = False) -> list[Stored[PullTask]]:
        """Insert every task of ``batch`` (distinct ids) at once, each with its type's retry and lease settings.

        The settings are read with the insert, as :meth:`create` reads them. As
        :meth:`TaskStore.create_many`: an id already stored gives (stored task,
        False); one of another type or user raises :class:`TaskConflict` and stores
        none of the batch, or with ``each`` is that task's answer alone; so does
        :class:`UnknownType` for a task whose type is not registered.
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

    @abc.abstractmethod
    def summary(self, task_type: str, window: int = 50_000) -> TypeSummary:
        """Counts by stage and status among the newest ``window`` tasks of ``task_type``, and its
        running leases (for the dashboard)."""


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


@dataclass(frozen=True)
class ProcessRecord:
    """One long-running process (api, worker or scheduler) as its registry row holds it.

    ``metrics`` is its last snapshot of Prometheus metrics (shared.exposition),
    ``detail`` what a dashboard shows of it (a worker's queues and attempts in flight).
    """

    process_id: str
    role: str  # api | worker | scheduler
    host: str
    pid: int
    started_at: float
    seen_at: float
    detail: Mapping[str, Any] = field(default_factory=dict)
    metrics: Sequence[Mapping[str, Any]] = ()
    stopped_at: float | None = None


class ProcessStore(abc.ABC):
    """The process registry: every process renews its row; rows of gone ones are kept a while."""

    @abc.abstractmethod
    def register(self, record: ProcessRecord) -> None:
        """Store ``record``, replacing any row of the same process id (a restart that reused it)."""

    @abc.abstractmethod
    def renew(
        self, process_id: str, seen_at: float, detail: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]]
    ) -> bool:
        """Update a registered process's row; False when there is none (purged: register again)."""

    @abc.abstractmethod
    def stop(self, process_id: str, at: float) -> None:
        """Mark a process stopped (a clean stop); its row stays until purged."""

    @abc.abstractmethod
    def list(self, seen_since: float | None = None) -> builtins.list[ProcessRecord]:
        """Rows last seen at or after ``seen_since`` (None: every row kept), by process id."""

    @abc.abstractmethod
    def purge(self, before: float) -> int:
        """Delete the rows last seen before ``before`` (stopped or silent since); how many."""
