"""The SQL task store (SQLAlchemy Core). The only place that runs the core's SQL.

Dialects are small subclasses chosen from the URL by :func:`open_store`.
"""

from __future__ import annotations

import builtins
import os
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Select,
    String,
    Subquery,
    cast,
    create_engine,
    event,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    union_all,
)
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from shared.sqlite import read_only_options, sqlite_engine
from shared.states import Phase, StepType, TaskStatus
from shared.storage.base import (
    CREATED_VERSION,
    AttemptRecord,
    Cursor,
    Outstanding,
    Save,
    StatusCounts,
    StorageUnavailable,
    Stored,
    TaskConflict,
    TaskEvent,
    TaskFilter,
    TaskPage,
    TaskQuery,
    TaskStore,
    batch_created,
    same_request,
)
from shared.storage.codec import json_text, task_from_row, task_to_row
from shared.storage.driver import (
    KEPT,
    DriverStatement,
    Inserted,
    KeptConnections,
    answers,
    autocommit_cursor,
    count_together,
    insert_new,
    prepare_on_request,
)
from shared.storage.schema import FIRST, LATER, SENT, attempts, metadata, task_events, tasks
from shared.storage.statements import (
    CREATE_NEW_TASKS,
    CREATE_NEW_TASKS_SQLITE,
    CREATE_TASK,
    CREATE_VALUES,
    GET_TASK,
    GET_TASKS,
    INSERT_ATTEMPT,
    NEXT_ATTEMPT_PREFIX,
    SAVE_IN_ONE_STATEMENT,
    SAVE_TASK,
    SAVED_COLUMNS,
    UPDATE_ATTEMPT,
)
from shared.task import Task

# Each kind of due message through its own partial index (migration 0008).
DUE_KINDS = {Outstanding.SENT: SENT, Outstanding.LATER: LATER, Outstanding.FIRST: FIRST}
# The distinct flows of the waiting first steps, oldest first, by probes of their index
# (a loose index scan: a DISTINCT would read every entry of a backlog).
WAITING_FLOWS = text(
    "WITH RECURSIVE f(flow) AS ("
    " SELECT min(flow) FROM af_tasks WHERE active_phase = 0 AND active_seq = 1"
    " UNION ALL SELECT (SELECT min(t.flow) FROM af_tasks t"
    " WHERE t.active_phase = 0 AND t.active_seq = 1 AND t.flow > f.flow)"
    " FROM f WHERE f.flow IS NOT NULL"
    # Ordered as the index is, or PostgreSQL may look for the oldest along due_at alone.
    ") SELECT f.flow, (SELECT t.due_at FROM af_tasks t"
    " WHERE t.active_phase = 0 AND t.active_seq = 1 AND t.flow = f.flow"
    " ORDER BY t.flow, t.due_at LIMIT 1) AS oldest"
    " FROM f WHERE f.flow IS NOT NULL ORDER BY oldest, f.flow"
)


class SqlStore(TaskStore):
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = self._make_engine(url)
        # A forked child (Celery prefork) must not reuse the parent's connections.
        ref = weakref.ref(self)

        def dispose_in_child() -> None:
            store = ref()
            if store is not None:
                store.engine.dispose(close=False)

        os.register_at_fork(after_in_child=dispose_in_child)

    def _make_engine(self, url: str) -> Engine:
        return create_engine(url, pool_pre_ping=True)

    # Dialects where a read, one statement, needs no BEGIN and COMMIT around it.
    reads_autocommit = False

    @contextmanager
    def transaction(self, read_only: bool = False, autocommit: bool = False) -> Iterator[Connection]:
        """A connection in a transaction, or in autocommit for a caller that runs one statement."""
        options: dict[str, Any] = read_only_options() if read_only else {}
        if autocommit or (read_only and self.reads_autocommit):
            options["isolation_level"] = "AUTOCOMMIT"
        try:
            with self.engine.connect() as conn:
                if options:
                    conn = conn.execution_options(**options)
                with conn.begin():
                    yield conn
        except IntegrityError:
            raise
        except OperationalError as exc:
            raise StorageUnavailable(f"database unavailable: {exc.orig or exc}") from exc
        except DBAPIError as exc:
            if exc.connection_invalidated:
                raise StorageUnavailable(f"database connection lost: {exc.orig or exc}") from exc
            raise

    def create_schema(self) -> None:
        """For tests and fakes; deployments use the Alembic migrations."""
        metadata.create_all(self.engine)

    def create(self, task: Task, now: float) -> tuple[Task, bool]:
        row = task_to_row(task, now) | {"version": CREATED_VERSION}
        try:
            with self.transaction() as conn:
                conn.execute(CREATE_TASK, row)
            return task_from_row(row), True
        except IntegrityError:
            return self._existing(task)

    def create_many(self, batch: Sequence[Task], now: float, each: bool = False) -> builtins.list[Stored[Task]]:
        rows = [task_to_row(task, now) | {"version": CREATED_VERSION} for task in batch]
        with self.transaction() as conn:
            new = conn.execute(CREATE_NEW_TASKS_SQLITE, rows).scalars()
            inserted: dict[str, dict[str, Any]] = {task_id: {} for task_id in new}  # nothing filled in
            taken = [task.task_id for task in batch if task.task_id not in inserted]
            found = [task_from_row(row) for row in conn.execute(GET_TASKS, {"b_task_ids": taken})] if taken else []
            return batch_created(batch, inserted, found, same_request, each)  # raising, it rolls the batch back

    def _existing(self, task: Task) -> tuple[Task, bool]:
        """The stored task whose id ``task`` reused: the same request again, or a conflict."""
        stored = self.get(task.task_id)
        if stored is None:  # deleted in between: vanishingly rare, report as a conflict
            raise TaskConflict(f"task id {task.task_id!r} could not be stored") from None
        if not same_request(stored, task):
            raise TaskConflict(f"task id {task.task_id!r} is already used") from None
        return stored, False

    def get(self, task_id: str) -> Task | None:
        with self.transaction(read_only=True) as conn:
            row = conn.execute(GET_TASK, {"b_task_id": task_id}).first()
        return task_from_row(row) if row is not None else None

    def get_many(self, task_ids: Sequence[str]) -> builtins.list[Task]:
        if not task_ids:
            return []
        with self.transaction(read_only=True) as conn:
            return [task_from_row(row) for row in conn.execute(GET_TASKS, {"b_task_ids": list(task_ids)})]

    def save(
        self,
        task: Task,
        now: float,
        attempt: AttemptRecord | None = None,
        event: TaskEvent | None = None,
        next_attempt: AttemptRecord | None = None,
    ) -> bool:
        with self.transaction() as conn:
            if conn.execute(SAVE_TASK, _saved(task, now)).rowcount != 1:
                return False
            for record in (attempt, next_attempt):
                if record is not None:
                    kind = record.write
                    statement = INSERT_ATTEMPT if kind == "insert" else UPDATE_ATTEMPT[kind]
                    conn.execute(statement, _attempt_params(record))
            if event is not None:
                conn.execute(
                    insert(task_events).values(
                        task_id=event.task_id, at=event.at, kind=event.kind, actor=event.actor, detail=dict(event.detail)
                    )
                )
        return True

    def events(self, task_id: str) -> builtins.list[TaskEvent]:
        query = select(task_events).where(task_events.c.task_id == task_id).order_by(task_events.c.event_id)
        with self.transaction(read_only=True) as conn:
            return [TaskEvent(r.task_id, float(r.at), r.kind, r.actor, r.detail) for r in conn.execute(query)]

    def list(self, where: TaskFilter) -> list[Task]:
        query = select(tasks).order_by(tasks.c.created_at.desc()).limit(where.limit)
        if where.flow is not None:
            query = query.where(tasks.c.flow == where.flow)
        if where.status is not None:
            query = query.where(tasks.c.status == int(where.status))
        if where.user_id is not None:
            query = query.where(tasks.c.user_id == where.user_id)
        with self.transaction(read_only=True) as conn:
            return [task_from_row(r) for r in conn.execute(query)]

    def attempts(self, task_id: str) -> builtins.list[AttemptRecord]:
        query = select(attempts).where(attempts.c.task_id == task_id).order_by(attempts.c.seq)
        with self.transaction(read_only=True) as conn:
            return [
                AttemptRecord(**{**r._mapping, "type": StepType(r.type)}) for r in conn.execute(query)
            ]

    def due(
        self, now: float, limit: int, kind: Outstanding, flow: str | None = None
    ) -> builtins.list[tuple[str, int, Phase]]:
        # due_at is NULL unless a message is outstanding, so a range scan of the
        # kind's index, whose condition this repeats, touches only the tasks that
        # need the scheduler now.
        query = (
            select(tasks.c.task_id, tasks.c.active_seq, tasks.c.active_phase)
            .where(tasks.c.due_at <= now, DUE_KINDS[kind])
            .order_by(tasks.c.due_at)
            .limit(limit)
        )
        if flow is not None:
            query = query.where(tasks.c.flow == flow)
        with self.transaction(read_only=True) as conn:
            return [(r.task_id, r.active_seq, Phase(r.active_phase)) for r in conn.execute(query)]

    def waiting_flows(self) -> builtins.list[str]:
        with self.transaction(read_only=True) as conn:
            return [str(flow) for flow in conn.execute(WAITING_FLOWS).scalars()]

    def ping(self) -> None:
        with self.transaction(read_only=True) as conn:
            conn.exec_driver_sql("SELECT 1")

    def close(self) -> None:
        self.engine.dispose()

    # --- reads for browsing (the dashboard) -------------------------------------------

    def page(self, query: TaskQuery) -> TaskPage:
        # The indexed filter, the time range and the keyset position: one range of one
        # index, (column, created_at) or created_at alone, read newest first.
        reach = _newest_first(select(tasks).where(*_indexed_conditions(query)))
        with self.transaction(read_only=True) as conn:
            if not query.residual:
                rows = conn.execute(reach.limit(query.limit)).all()
                found = [task_from_row(r) for r in rows]
                more = len(found) == query.limit
                return TaskPage(found, _cursor_of(found[-1]) if more else None)
            window = reach.limit(query.scan).subquery()
            rows = conn.execute(
                select(window)
                .where(*_residual_conditions(query, window))
                .order_by(window.c.created_at.desc(), window.c.task_id.desc())
                .limit(query.limit)
            ).all()
            found = [task_from_row(r) for r in rows]
            if len(found) == query.limit:
                return TaskPage(found, _cursor_of(found[-1]))
            # Short page: did the scan stop at its bound? Then the next page starts past it.
            last = conn.execute(
                _newest_first(select(tasks.c.created_at, tasks.c.task_id).where(*_indexed_conditions(query)))
                .offset(query.scan - 1)
                .limit(1)
            ).first()
        if last is None:
            return TaskPage(found, None)
        return TaskPage(found, (float(last.created_at), str(last.task_id)), partial=True)

    def count_by_status(
        self, user_id: str | None = None, flow: str | None = None, cap: int = 10_000, window: int = 50_000
    ) -> StatusCounts:
        if user_id is None and flow is None:
            # Per status, a count that stops at cap + 1 entries of the (status, created_at)
            # index: at most 7 short index ranges, one statement.
            parts = [
                select(literal(int(s)).label("status"), func.count().label("n")).select_from(
                    select(literal(1).label("one")).where(tasks.c.status == int(s)).limit(cap + 1).subquery()
                )
                for s in TaskStatus
            ]
            with self.transaction(read_only=True) as conn:
                rows = conn.execute(union_all(*parts)).all()
            return StatusCounts({TaskStatus(r.status): int(r.n) for r in rows if r.n}, cap, None)
        # The newest ``window`` tasks of the user (or flow), through its index.
        column = tasks.c.user_id if user_id is not None else tasks.c.flow
        newest = (
            select(tasks.c.status)
            .where(column == (user_id if user_id is not None else flow))
            .order_by(tasks.c.created_at.desc())
            .limit(window)
        )
        if user_id is not None and flow is not None:
            newest = newest.where(tasks.c.flow == flow)
        sub = newest.subquery()
        with self.transaction(read_only=True) as conn:
            rows = conn.execute(select(sub.c.status, func.count()).group_by(sub.c.status)).all()
        return StatusCounts({TaskStatus(int(status)): int(n) for status, n in rows}, None, window)

    def attempts_of(self, task_ids: Iterable[str]) -> dict[str, builtins.list[AttemptRecord]]:
        wanted = sorted(set(task_ids))
        found: dict[str, builtins.list[AttemptRecord]] = {}
        if not wanted:
            return found
        query = select(attempts).where(attempts.c.task_id.in_(wanted)).order_by(attempts.c.task_id, attempts.c.seq)
        with self.transaction(read_only=True) as conn:
            for r in conn.execute(query):
                found.setdefault(r.task_id, []).append(_attempt_from_row(r))
        return found

    def flow_attempts(self, flow: str, since: float, newest: int) -> builtins.list[AttemptRecord]:
        wanted = (
            select(tasks.c.task_id)
            .where(tasks.c.flow == flow, tasks.c.created_at >= since)
            .order_by(tasks.c.created_at.desc())
            .limit(newest)
        )
        query = select(attempts).where(attempts.c.task_id.in_(wanted.scalar_subquery()))
        with self.transaction(read_only=True) as conn:
            return [_attempt_from_row(r) for r in conn.execute(query)]


def _attempt_from_row(r: Any) -> AttemptRecord:
    return AttemptRecord(**{**r._mapping, "type": StepType(r.type)})


def _newest_first(query: Select[Any]) -> Select[Any]:
    return query.order_by(tasks.c.created_at.desc(), tasks.c.task_id.desc())


def _indexed_conditions(q: TaskQuery) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    indexed = q.indexed
    if indexed == "user_id":
        conditions.append(tasks.c.user_id == q.user_id)
    elif indexed == "flow":
        conditions.append(tasks.c.flow == q.flow)
    elif indexed == "status" and q.status is not None:
        conditions.append(tasks.c.status == int(q.status))
    if q.created_from is not None:
        conditions.append(tasks.c.created_at >= q.created_from)
    if q.created_until is not None:
        conditions.append(tasks.c.created_at < q.created_until)
    if q.after is not None:
        at, task_id = q.after
        # Written so the index range bound is plain (created_at <= at), the tie a filter.
        conditions.append(tasks.c.created_at <= at)
        conditions.append(or_(tasks.c.created_at < at, tasks.c.task_id < task_id))
    return conditions


def _residual_conditions(q: TaskQuery, window: Subquery) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    indexed = q.indexed
    if q.flow is not None and indexed != "flow":
        conditions.append(window.c.flow == q.flow)
    if q.status is not None and indexed != "status":
        conditions.append(window.c.status == int(q.status))
    if q.parameter is not None:
        path, text = q.parameter
        value = window.c.parameters[path if len(path) > 1 else path[0]].as_string()
        conditions.append(cast(value, String) == text)
    return conditions


def _cursor_of(task: Task) -> Cursor:
    return (task.created_at, task.task_id)


def _saved(task: Task, now: float) -> dict[str, Any]:
    """Parameters of SAVE_TASK: the new row, fenced by the version it was decided on (TaskStore.save)."""
    row = task_to_row(task, now) | {"version": task.version + 1}
    params = {"t_" + name: row[name] for name in SAVED_COLUMNS}
    params.update(b_task_id=task.task_id, b_version=task.version, b_created_at=task.created_at)
    return params


def _attempt_params(a: AttemptRecord, prefix: str = "a_") -> dict[str, Any]:
    return {prefix + name: value for name, value in _attempt_row(a).items()}


def _attempt_row(a: AttemptRecord) -> dict[str, Any]:
    return {
        "task_id": a.task_id,
        "seq": a.seq,
        "cursor": a.cursor,
        "type": int(a.type),
        "attempt": a.attempt,
        "module": a.module,
        "command": a.command,
        "started_at": a.started_at,
        "ended_at": a.ended_at,
        "outcome": a.outcome,
        "error": a.error,
        "worker": a.worker,
        "heartbeat_at": a.heartbeat_at,
        "progress": a.progress,
        "result": a.result,
    }


class SqliteStore(SqlStore):
    """Several processes (API, scheduler, workers) write one file: see shared.sqlite."""

    def _make_engine(self, url: str) -> Engine:
        return sqlite_engine(url)


class PostgresStore(SqlStore):
    """Every read and every transition is one statement, so one round trip.

    A single statement is atomic on its own: reads run without BEGIN and COMMIT
    (autocommit), and a transition's task update and attempt write are one
    statement, the attempt write a data-modifying CTE that runs only if the
    compare-and-set matched. Round trips, not CPU, are what a step costs here.
    These statements run on psycopg's cursor, a transition on libpq's own call (:mod:`shared.storage.driver`).
    """

    reads_autocommit = True

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._get = DriverStatement(GET_TASK, self.engine, prepared=True)
        self._create = DriverStatement(CREATE_TASK.values(CREATE_VALUES), self.engine)
        self._save = {kind: DriverStatement(s, self.engine, prepared=True) for kind, s in SAVE_IN_ONE_STATEMENT.items()}
        self._create_new = DriverStatement(CREATE_NEW_TASKS, self.engine, prepared=True, binary=True)

    def _make_engine(self, url: str) -> Engine:
        # Connections are kept, not opened per burst: a new PostgreSQL connection costs
        # a backend process and several round trips, more than the statement it serves.
        # 20 covers the API's request threads; overflow connections are closed on return.
        # The connections kept between statements (driver.KEPT) come on top.
        engine = create_engine(url, pool_size=20, max_overflow=20 + KEPT, json_serializer=json_text)
        ping_idle_connections(engine, IDLE_BEFORE_PING)
        prepare_on_request(engine)
        # The engine's connections for the hot statements, kept between them.
        self.connections = KeptConnections(engine, IDLE_BEFORE_PING)
        return engine

    def close(self) -> None:
        self.connections.release()
        super().close()

    def create(self, task: Task, now: float) -> tuple[Task, bool]:
        row = task_to_row(task, now) | {"version": CREATED_VERSION}
        try:
            with autocommit_cursor(self.connections) as cursor:
                self._create.run(cursor, row)
            return task_from_row(row), True
        except psycopg.IntegrityError:
            return self._existing(task)

    def create_many(self, batch: Sequence[Task], now: float, each: bool = False) -> builtins.list[Stored[Task]]:
        rows = [task_to_row(task, now) | {"version": CREATED_VERSION} for task in batch]

        def answer(inserted: Inserted) -> builtins.list[Stored[Task]]:
            found = map(task_from_row, inserted.found)
            return batch_created(batch, inserted.new, found, same_request, each, inserted.unread)

        return insert_new(self.connections, self._create_new, self._get, rows, each, answer)

    def get(self, task_id: str) -> Task | None:
        with autocommit_cursor(self.connections) as cursor:
            row = self._get.run(cursor, {"b_task_id": task_id}).fetchone()
        return task_from_row(row) if row is not None else None

    def save(
        self,
        task: Task,
        now: float,
        attempt: AttemptRecord | None = None,
        event: TaskEvent | None = None,
        next_attempt: AttemptRecord | None = None,
    ) -> bool:
        if event is not None:
            # An operator's action, rare: the history row makes it two statements, in one transaction.
            return super().save(task, now, attempt, event, next_attempt)
        statement, params = self._save_run(task, now, attempt, next_attempt)
        with autocommit_cursor(self.connections) as cursor:  # one statement: atomic on its own
            return statement.count(cursor, params) == 1

    def save_many(self, saves: Sequence[Save]) -> builtins.list[bool]:
        """All in one round trip and one commit (:func:`count_together`).

        In the order of the tasks' ids: two consumers' groups that share a task
        then wait for each other's commit instead of deadlocking. A statement
        refused rolls back the others, and its error is raised.
        """
        order = sorted(range(len(saves)), key=lambda i: saves[i].task.task_id)
        runs = [self._save_run(saves[i].task, saves[i].now, saves[i].attempt, saves[i].next_attempt) for i in order]
        with autocommit_cursor(self.connections) as cursor:
            counts = count_together(cursor, runs)
        written = [False] * len(saves)
        for i, count in zip(order, counts, strict=True):
            written[i] = count == 1
        return written

    def _save_run(
        self, task: Task, now: float, attempt: AttemptRecord | None, next_attempt: AttemptRecord | None
    ) -> tuple[DriverStatement, dict[str, Any]]:
        """The one statement that stores a transition, and its values."""
        params = _saved(task, now)
        kind = "none"
        if attempt is not None:
            kind = attempt.write
            params |= _attempt_params(attempt)
        if next_attempt is not None:
            kind += "+next"
            params |= _attempt_params(next_attempt, NEXT_ATTEMPT_PREFIX)
        return self._save[kind], params


# A pooled connection unused for this long is pinged before use; one in steady use is not.
IDLE_BEFORE_PING = 2.0


def ping_idle_connections(engine: Engine, idle: float) -> None:
    """Check a pooled connection before use only if it sat idle for ``idle`` seconds.

    SQLAlchemy's pool_pre_ping costs a round trip on every checkout, as much as
    the statement it guards. A connection in steady use proved itself moments
    ago; one that sat idle may have been closed by a database restart, and is
    replaced before anyone uses it. Under load, no checkout pays for a ping.
    """

    def idle_from(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    def alive(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is not None and time.monotonic() - since >= idle:
            answers(dbapi_conn)  # if not, the pool discards this connection and checks out another one

    event.listen(engine, "checkin", idle_from)
    event.listen(engine, "checkout", alive)


def open_store(url: str) -> SqlStore:
    if url.startswith("sqlite"):
        return SqliteStore(url)
    if url.startswith("postgresql"):
        return PostgresStore(url)
    return SqlStore(url)
