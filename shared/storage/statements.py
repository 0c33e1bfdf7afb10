"""The task store's hot statements, built once with bind parameters.

Building a SQLAlchemy statement (``update(...).where(...).values(...)``) and
computing its cache key costs more CPU than running it; the hot paths (read a
task, store a transition, record an attempt) execute these with a dict of
parameters instead. Parameters of the WHERE clauses are prefixed ``b_``, those
of attempt rows ``a_`` (``n_`` for the start of the next attempt stored with a
transition): plain column names are SQLAlchemy's for SET and VALUES.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Column, String, bindparam, column, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.selectable import TableValuedAlias
from sqlalchemy.types import TypeEngine

from shared.storage.schema import attempts, tasks

# Columns a transition writes: all but the key and the creation time.
SAVED_COLUMNS = tuple(c.name for c in tasks.columns if c.name not in ("task_id", "created_at"))
ATTEMPT_COLUMNS = tuple(c.name for c in attempts.columns)

GET_TASK = select(tasks).where(tasks.c.task_id == bindparam("b_task_id"))
GET_TASKS = select(tasks).where(tasks.c.task_id.in_(bindparam("b_task_ids", expanding=True)))
CREATE_TASK = insert(tasks)
# Every column as a bind parameter of its own name, for a statement compiled once.
CREATE_VALUES = {c.name: bindparam(c.name, type_=c.type) for c in tasks.columns}


def batch_rows(columns: Iterable[Column[Any]]) -> TableValuedAlias:
    """A batch's rows as the relation ``r`` (PostgreSQL): each column's values in one array,
    the bind parameter of the column's name.

    One statement then stores the whole batch: run row by row in psycopg's pipeline,
    a batch of three cost the client twice the CPU and half as much again in time
    (benchmarks/README.md, "A batch in one statement").
    """
    columns = list(columns)
    arrays = (bindparam(c.name, type_=postgresql.ARRAY(_unbounded(c.type), dimensions=1)) for c in columns)
    return func.unnest(*arrays).table_valued(*(column(c.name, c.type) for c in columns)).render_derived("r")


def _unbounded(type_: TypeEngine[Any]) -> TypeEngine[Any]:
    # A cast to VARCHAR(64) cuts a longer value short without a word; the insert into
    # the column refuses it, as a row's own insert does.
    return String() if isinstance(type_, String) and type_.length else type_


# A batch's insert: ids already stored are skipped and only the inserted ones returned.
# Rows go in by id, so that two batches sharing ids (concurrent replays of one request)
# wait for each other's commit instead of deadlocking.
_NEW_ROWS = batch_rows(tasks.columns)
CREATE_NEW_TASKS = (
    postgresql.insert(tasks)
    .from_select(list(_NEW_ROWS.c.keys()), select(_NEW_ROWS).order_by(_NEW_ROWS.c.task_id))
    .on_conflict_do_nothing(index_elements=[tasks.c.task_id])
    .returning(tasks.c.task_id)
)
# SQLite's, a row at a time (executemany) in one transaction.
CREATE_NEW_TASKS_SQLITE = (
    sqlite.insert(tasks).on_conflict_do_nothing(index_elements=[tasks.c.task_id]).returning(tasks.c.task_id)
)

SAVE_TASK = (
    update(tasks)
    .where(
        tasks.c.task_id == bindparam("b_task_id"),
        tasks.c.version == bindparam("b_version"),
        tasks.c.created_at == bindparam("b_created_at"),
    )
    .values({name: bindparam("t_" + name, type_=tasks.c[name].type) for name in SAVED_COLUMNS})
)
INSERT_ATTEMPT = insert(attempts).values(
    {name: bindparam("a_" + name, type_=attempts.c[name].type) for name in ATTEMPT_COLUMNS}
)


def _attempt_values(*names: str) -> dict[str, Any]:
    return {name: bindparam("a_" + name, type_=attempts.c[name].type) for name in names}


# What each kind of attempt write (AttemptRecord.write) sets on the stored attempt.
_UPDATES = {
    "outcome": _attempt_values("ended_at", "outcome", "error", "result"),
    "heartbeat": _attempt_values("heartbeat_at", "progress"),
}
UPDATE_ATTEMPT = {
    kind: update(attempts)
    .where(attempts.c.task_id == bindparam("a_task_id"), attempts.c.seq == bindparam("a_seq"))
    .values(values)
    for kind, values in _UPDATES.items()
}


NEXT_ATTEMPT_PREFIX = "n_"


def _save_in_one_statement() -> dict[str, Any]:
    """PostgreSQL: the transition and its attempt writes as one statement.

    Each attempt write is a data-modifying CTE reading the updated task row, so it
    runs only if the compare-and-set matched; the statement returns 1 or 0. Keys
    are AttemptRecord.write ("none" without one), plus "+next" when the start of
    the next attempt is inserted too.
    """
    changed = SAVE_TASK.returning(tasks.c.task_id).cte("changed")
    counted = select(func.count()).select_from(changed)

    def inserted(prefix: str, name: str) -> Any:
        values = select(*(bindparam(prefix + c.name, type_=c.type) for c in attempts.columns)).select_from(changed)
        return insert(attempts).from_select(list(ATTEMPT_COLUMNS), values).cte(name)

    statements = {"none": counted, "insert": counted.add_cte(inserted("a_", "attempt"))}
    for kind, values in _UPDATES.items():
        # The attempt's whole key as parameters: a generic plan's index condition then
        # covers both columns (joined to ``changed`` alone, it covered seq alone).
        change = (
            update(attempts)
            .where(
                attempts.c.task_id == bindparam("a_task_id"),
                attempts.c.seq == bindparam("a_seq"),
                attempts.c.task_id == changed.c.task_id,
            )
            .values(values)
        )
        statements[kind] = counted.add_cte(change.cte("attempt"))
    for kind in list(statements):
        statements[kind + "+next"] = statements[kind].add_cte(inserted(NEXT_ATTEMPT_PREFIX, "next_attempt"))
    return statements


SAVE_IN_ONE_STATEMENT = _save_in_one_statement()
