"""Storage of v1 pull-mode tasks and task types; shares the SQL store's engine.

hold_tasks claims rows with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so
concurrent workers never get the same task and never wait on each other; on
SQLite the write transaction (BEGIN IMMEDIATE) serializes the claims.

The calls a worker makes per task (create_task, hold_tasks, get and set_task)
are one statement each, and on PostgreSQL they run on psycopg's cursor
(:mod:`shared.storage.driver`), as the saga's task reads and transitions do.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from sqlalchemy import any_, bindparam, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from shared.pull.rules import TYPE_SETTINGS, PullStatus, PullTask, TaskType, type_settings
from shared.records import evolve
from shared.storage.base import PullStore, Stored, TaskConflict, TypeSummary, batch_created, same_pull_request
from shared.storage.driver import (
    DriverStatement,
    Inserted,
    KeptConnections,
    autocommit_cursor,
    insert_new,
)
from shared.storage.schema import pull_tasks, task_types
from shared.storage.sql import PostgresStore, SqlStore
from shared.storage.statements import batch_rows

if TYPE_CHECKING:
    from sqlalchemy.dialects.postgresql import Insert as PostgresInsert
    from sqlalchemy.dialects.sqlite import Insert as SqliteInsert


def _create_statement(returning: bool = True) -> Any:
    """INSERT … SELECT: the new row's own values as parameters, the type's settings from its row.

    It returns the settings; without ``returning``, for many rows at once
    (executemany), its row count says how many found their type.
    """
    columns = [c.name for c in pull_tasks.columns]
    values = [
        task_types.c[c] if c in TYPE_SETTINGS else bindparam(c, type_=pull_tasks.c[c].type) for c in columns
    ]
    chosen = select(*values).where(task_types.c.task_type == bindparam("task_type"))
    statement = insert(pull_tasks).from_select(columns, chosen)
    return statement.returning(*(pull_tasks.c[c] for c in TYPE_SETTINGS)) if returning else statement


def _create_new_statement() -> Any:
    """A batch's insert (PostgreSQL): the rows' own values as arrays, each row's type's settings
    from its row, by id (as :data:`shared.storage.statements.CREATE_NEW_TASKS`); an id already
    stored, or of a type not registered, is skipped. It returns the id and the settings."""
    columns = [c.name for c in pull_tasks.columns]
    rows = batch_rows(c for c in pull_tasks.columns if c.name not in TYPE_SETTINGS)
    values = [task_types.c[c] if c in TYPE_SETTINGS else rows.c[c] for c in columns]
    chosen = select(*values).join_from(rows, task_types, task_types.c.task_type == rows.c.task_type)
    return (
        postgresql.insert(pull_tasks)
        .from_select(columns, chosen.order_by(rows.c.task_id))
        .on_conflict_do_nothing(index_elements=[pull_tasks.c.task_id])
        .returning(*(pull_tasks.c[c] for c in ("task_id", *TYPE_SETTINGS)))
    )


def _hold_statement(skip_locked: bool, limit_of_type: bool) -> Any:
    limit: Any = bindparam("held_limit")
    if limit_of_type:
        limit = select(task_types.c.schedule_limit).where(task_types.c.task_type == bindparam("held_type"))
        # No such type: LIMIT 0, not LIMIT NULL (no limit on PostgreSQL, an error on SQLite).
        limit = func.coalesce(limit.scalar_subquery(), 0)
    claim = (
        select(pull_tasks.c.task_id)
        .where(
            pull_tasks.c.task_type == bindparam("held_type"),
            pull_tasks.c.status == int(PullStatus.PENDING),
            pull_tasks.c.order_time <= bindparam("held_at"),
        )
        .order_by(pull_tasks.c.order_time)
        .limit(limit)
    )
    chosen: Any = pull_tasks.c.task_id.in_(claim)
    if skip_locked:
        # As an array, not IN: the planner cannot see a limit read from the type's row and
        # guessed a tenth of the table, then joined it by scanning the whole table (26 ms a
        # call at 48,000 pending once analyzed). An array is looked up through the key.
        chosen = pull_tasks.c.task_id == any_(func.array(claim.with_for_update(skip_locked=True).scalar_subquery()))
    now = bindparam("held_at", type_=pull_tasks.c.modify_time.type)
    heartbeat = bindparam("held_heartbeat", type_=pull_tasks.c.heartbeat_timeout.type)
    return (
        update(pull_tasks)
        .where(chosen)
        .values(
            status=int(PullStatus.RUNNING),
            modify_time=now,
            heartbeat_timeout=heartbeat,
            lease_until=now + func.coalesce(heartbeat, pull_tasks.c.max_processing_time),
            version=pull_tasks.c.version + 1,
        )
        .returning(*pull_tasks.columns)
    )


# By whether the claim skips locked rows (PostgreSQL: concurrent holds skip each other's rows;
# SQLite's write transaction, BEGIN IMMEDIATE, serializes them instead), then by whether the
# limit is the type's schedule_limit (read by the statement) or a parameter.
HOLD = {skip: {by_type: _hold_statement(skip, by_type) for by_type in (False, True)} for skip in (False, True)}
# Built once: create_task is the hot path, and building it costs more than running it.
CREATE_PULL_TASK = _create_statement()
CREATE_PULL_TASKS = _create_statement(returning=False)
GET_PULL_TASK = select(pull_tasks).where(pull_tasks.c.task_id == bindparam("b_task_id"))
GET_TASK_TYPE = select(task_types).where(task_types.c.task_type == bindparam("b_task_type"))
GET_TASK_TYPES = select(task_types).where(task_types.c.task_type.in_(bindparam("b_task_types", expanding=True)))
GET_PULL_TASKS = select(pull_tasks).where(pull_tasks.c.task_id.in_(bindparam("b_task_ids", expanding=True)))
# A batch's insert (PostgreSQL), each row with its type's settings read by the statement, not
# before it (a round trip per batch of coalesced create_task calls, benchmarks/README.md).
CREATE_NEW_PULL_TASKS = _create_new_statement()
# SQLite's: the settings given, read in the same transaction; an id already stored is skipped.
CREATE_NEW_PULL_TASKS_SQLITE = (
    sqlite.insert(pull_tasks).on_conflict_do_nothing(index_elements=[pull_tasks.c.task_id]).returning(pull_tasks.c.task_id)
)
# A report (set_task), the scheduler's expiry: every column but the key, if the version still matches.
SAVE_PULL_TASK = (
    update(pull_tasks)
    .where(pull_tasks.c.task_id == bindparam("b_task_id"), pull_tasks.c.version == bindparam("b_version"))
    .values({c.name: bindparam(c.name, type_=c.type) for c in pull_tasks.columns if c.name != "task_id"})
)


def _row(task: PullTask) -> dict[str, Any]:
    row = {k: getattr(task, k) for k in PullTask.__dataclass_fields__}
    row["status"] = int(task.status)
    row["lease_until"] = task.lease_until
    return row


def create_row(task: PullTask) -> dict[str, Any]:
    """Parameters of CREATE_PULL_TASK for a new task."""
    return _row(task) | {"version": 1}


def _task(row: Any) -> PullTask:
    m = dict(getattr(row, "_mapping", row))  # a SQLAlchemy row, or psycopg's dict
    m.pop("lease_until", None)
    m["status"] = PullStatus(m["status"])
    return PullTask(**m)


class SqlPullStore(PullStore):
    def __init__(self, sql: SqlStore) -> None:
        self.sql = sql
        postgres = sql.engine.dialect.name == "postgresql"
        self._hold = HOLD[postgres]
        self._driver: dict[str, DriverStatement] | None = None
        if postgres:
            self._driver = {
                "create": DriverStatement(CREATE_PULL_TASK, sql.engine),
                "create new": DriverStatement(CREATE_NEW_PULL_TASKS, sql.engine, prepared=True, binary=True),
                "get": DriverStatement(GET_PULL_TASK, sql.engine, prepared=True),
                "get type": DriverStatement(GET_TASK_TYPE, sql.engine, prepared=True),
                "save": DriverStatement(SAVE_PULL_TASK, sql.engine, prepared=True),
                # Prepared too: planning was half of PostgreSQL's CPU per claim, and a claim
                # walks the hold index in order and finds its rows by key, in the plan made once
                # as in each execution's (tests/integration/test_pg_plans.py).
                "hold": DriverStatement(self._hold[False], sql.engine, prepared=True),
                "hold by type": DriverStatement(self._hold[True], sql.engine, prepared=True),
            }

    def _connections(self) -> KeptConnections:
        assert isinstance(self.sql, PostgresStore), "the driver's statements run on PostgreSQL"
        return self.sql.connections

    def _read_one(self, name: str, statement: Any, values: dict[str, Any]) -> Any:
        """The row ``statement`` (the driver's ``name`` on PostgreSQL) reads, or None."""
        if self._driver is not None:
            rows, _ = self._run(name, values)
            return rows[0] if rows else None
        with self.sql.transaction(read_only=True) as conn:
            return conn.execute(statement, values).first()

    def _run(self, name: str, values: dict[str, Any]) -> tuple[builtins.list[dict[str, Any]], int]:
        """PostgreSQL: one of the hot statements, in autocommit (a statement is atomic on its own).

        Its rows (none without RETURNING) and how many it changed.
        """
        assert self._driver is not None
        statement = self._driver[name]
        with autocommit_cursor(self._connections()) as cursor:
            statement.run(cursor, values)
            return (cursor.fetchall() if cursor.description is not None else []), cursor.rowcount

    # --- task types ---------------------------------------------------------------

    def save_type(self, config: TaskType, now: float) -> TaskType:
        values = config.model_dump()
        with self.sql.transaction() as conn:
            found = conn.execute(
                select(task_types.c.task_type).where(task_types.c.task_type == config.task_type)
            ).first()
            if found is None:
                conn.execute(insert(task_types).values(**values, created_at=now, updated_at=now))
            else:
                conn.execute(
                    update(task_types)
                    .where(task_types.c.task_type == config.task_type)
                    .values(**values, updated_at=now)
                )
        return config

    def get_type(self, task_type: str) -> TaskType | None:
        row = self._read_one("get type", GET_TASK_TYPE, {"b_task_type": task_type})
        return _type(row) if row is not None else None

    def types(self) -> list[TaskType]:
        with self.sql.transaction(read_only=True) as conn:
            rows = conn.execute(select(task_types).order_by(task_types.c.task_type)).all()
        return [_type(r) for r in rows]

    # --- tasks ----------------------------------------------------------------------

    def create(self, task: PullTask) -> tuple[PullTask, bool] | None:
        # One statement reads the type's settings and inserts: create_task is a hot path.
        row = create_row(task)
        try:
            if self._driver is not None:
                rows, _ = self._run("create", row)
                inserted = rows[0] if rows else None
            else:
                with self.sql.transaction() as conn:
                    found = conn.execute(CREATE_PULL_TASK, row).first()
                inserted = dict(found._mapping) if found is not None else None
        except (IntegrityError, psycopg.IntegrityError):
            stored = self.get(task.task_id)
            if stored is None or (stored.task_type, stored.user_id) != (task.task_type, task.user_id):
                raise TaskConflict(f"task id {task.task_id!r} is already used") from None
            return stored, False
        if inserted is None:
            return None
        return evolve(task, version=1, **inserted), True

    def create_many(self, batch: Sequence[PullTask], each: bool = False) -> builtins.list[Stored[PullTask]]:
        rows = [create_row(task) for task in batch]
        if self._driver is not None:

            def answer(inserted: Inserted) -> builtins.list[Stored[PullTask]]:
                found = [_task(row) for row in inserted.found]
                return batch_created(batch, inserted.new, found, same_pull_request, each, inserted.unread)

            return insert_new(self._connections(), self._driver["create new"], self._driver["get"], rows, each, answer)
        with self.sql.transaction() as conn:
            names = sorted({task.task_type for task in batch})
            settings = {r.task_type: type_settings(_type(r)) for r in conn.execute(GET_TASK_TYPES, {"b_task_types": names})}
            typed = [row | settings[row["task_type"]] for row in rows if row["task_type"] in settings]
            new = set(conn.execute(CREATE_NEW_PULL_TASKS_SQLITE, typed).scalars()) if typed else set()
            inserted = {row["task_id"]: settings[row["task_type"]] for row in typed if row["task_id"] in new}
            taken = [task.task_id for task in batch if task.task_id not in inserted]
            found = [_task(row) for row in conn.execute(GET_PULL_TASKS, {"b_task_ids": taken})] if taken else []
            return batch_created(batch, inserted, found, same_pull_request, each)  # raising, it rolls the batch back

    def enqueue(self, task: PullTask) -> None:
        row = _row(evolve(task, version=1))
        stmt = self._upsert(row)
        with self.sql.transaction() as conn:
            conn.execute(stmt)

    def _upsert(self, row: dict[str, Any]) -> PostgresInsert | SqliteInsert:
        dialect = self.sql.engine.dialect.name
        stmt: PostgresInsert | SqliteInsert
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as postgres_insert

            stmt = postgres_insert(pull_tasks).values(**row)
        elif dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            stmt = sqlite_insert(pull_tasks).values(**row)
        else:
            raise NotImplementedError(f"pull-mode modules need PostgreSQL or SQLite, not {dialect}")
        again = {k: stmt.excluded[k] for k in row if k not in ("task_id", "create_time", "version")}
        return stmt.on_conflict_do_update(
            index_elements=[pull_tasks.c.task_id],
            set_={**again, "version": pull_tasks.c.version + 1},
            where=pull_tasks.c.status != int(PullStatus.PENDING),
        )

    def get(self, task_id: str) -> PullTask | None:
        row = self._read_one("get", GET_PULL_TASK, {"b_task_id": task_id})
        return _task(row) if row is not None else None

    def list(
        self,
        task_type: str | None,
        status: int | None,
        stage: str | None,
        limit: int,
        user_id: str | None = None,
    ) -> list[PullTask]:
        query = select(pull_tasks).order_by(pull_tasks.c.create_time.desc()).limit(limit)
        for column, value in (
            (pull_tasks.c.task_type, task_type),
            (pull_tasks.c.status, status),
            (pull_tasks.c.task_stage, stage),
            (pull_tasks.c.user_id, user_id),
        ):
            if value is not None:
                query = query.where(column == value)
        with self.sql.transaction(read_only=True) as conn:
            return [_task(r) for r in conn.execute(query)]

    def count(self, task_type: str) -> dict[int, int]:
        query = (
            select(pull_tasks.c.status, func.count())
            .where(pull_tasks.c.task_type == task_type)
            .group_by(pull_tasks.c.status)
        )
        with self.sql.transaction(read_only=True) as conn:
            return {int(status): int(n) for status, n in conn.execute(query)}

    def hold(
        self, task_type: str, limit: int | None, now: float, heartbeat_timeout: float | None = None
    ) -> builtins.list[PullTask]:
        # One UPDATE … RETURNING whose subquery picks the rows (and reads schedule_limit).
        params: dict[str, Any] = {"held_type": task_type, "held_at": now, "held_heartbeat": heartbeat_timeout}
        if limit is not None:
            params["held_limit"] = limit
        rows: Any
        if self._driver is not None:
            rows, _ = self._run("hold by type" if limit is None else "hold", params)
        else:
            with self.sql.transaction() as conn:
                rows = conn.execute(self._hold[limit is None], params).all()
        return sorted((_task(r) for r in rows), key=lambda t: t.order_time)

    def save(self, task: PullTask) -> bool:
        row = _row(task) | {"version": task.version + 1, "b_task_id": task.task_id, "b_version": task.version}
        del row["task_id"]  # the key is not set; a column name among the values would be
        if self._driver is not None:
            _, changed = self._run("save", row)
            return changed == 1
        with self.sql.transaction() as conn:
            return conn.execute(SAVE_PULL_TASK, row).rowcount == 1

    def due(self, now: float, limit: int) -> builtins.list[PullTask]:
        query = (
            select(pull_tasks)
            .where(pull_tasks.c.lease_until <= now)
            .order_by(pull_tasks.c.lease_until)
            .limit(limit)
        )
        with self.sql.transaction(read_only=True) as conn:
            return [_task(r) for r in conn.execute(query)]

    def summary(self, task_type: str, window: int = 50_000) -> TypeSummary:
        # The newest ``window`` through (task_type, create_time); running ones through the
        # hold index (task_type, status, ...): as many as workers hold, not the whole type.
        newest = (
            select(pull_tasks.c.task_stage, pull_tasks.c.status)
            .where(pull_tasks.c.task_type == task_type)
            .order_by(pull_tasks.c.create_time.desc())
            .limit(window)
            .subquery()
        )
        counts = select(newest.c.task_stage, newest.c.status, func.count()).group_by(
            newest.c.task_stage, newest.c.status
        )
        running = select(func.count(), func.min(pull_tasks.c.modify_time)).where(
            pull_tasks.c.task_type == task_type, pull_tasks.c.status == int(PullStatus.RUNNING)
        )
        with self.sql.transaction(read_only=True) as conn:
            by_stage = {(str(stage), int(status)): int(n) for stage, status, n in conn.execute(counts)}
            n, oldest = conn.execute(running).one()
        return TypeSummary(by_stage, window, int(n), float(oldest) if oldest is not None else None)


def _type(row: Any) -> TaskType:
    m = dict(getattr(row, "_mapping", row))  # a SQLAlchemy row, or psycopg's dict
    m.pop("created_at"), m.pop("updated_at")
    return TaskType(**m)
