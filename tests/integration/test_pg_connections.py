"""PostgreSQL connections: checked before use only after sitting idle, and replaced if dead."""

from __future__ import annotations

import gc
import os
import signal
import time
import uuid
import weakref
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Column, Integer, MetaData, Table, bindparam, func, select

from shared.config import Settings
from shared.consumer import StepConsumer
from shared.flows import load_flows
from shared.migrate import upgrade
from shared.pull.rules import TaskType, new_pull_task
from shared.service import TaskService
from shared.storage import StorageUnavailable, TaskFilter
from shared.storage import driver as driver_module
from shared.storage import sql as sql_module
from shared.storage.base import Save
from shared.storage.driver import autocommit_cursor
from shared.storage.sql import PostgresStore
from shared.storage.sql_pull import SqlPullStore
from shared.testing import QueuePublisher
from tests.integration.conftest import postgres_admin, postgres_schema
from tests.integration.test_store_contract import NOW, submitted
from tests.support import testmod

SUPPORT = Path(__file__).resolve().parents[1] / "support"

pytestmark = pytest.mark.postgres


def terminate(pid: int) -> None:
    admin, _ = postgres_admin()
    with admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


def kill_pooled_connection(store: PostgresStore) -> None:
    """Terminate the server side of the one connection in the store's pool, as a restart would."""
    with store.engine.connect() as conn:
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    terminate(pid)


def kept_backend(store: PostgresStore) -> int:
    """The server process of the connection the store keeps for its statements."""
    with autocommit_cursor(store.connections) as cursor:
        row = cursor.execute("SELECT pg_backend_pid() AS pid").fetchone()
    assert row is not None
    return int(row["pid"])


@pytest.mark.parametrize("kept", [False, True], ids=["pooled", "kept"])
@pytest.mark.parametrize(("idle_before_ping", "replaced"), [(0.0, True), (3600.0, False)])
def test_a_connection_killed_while_idle_is_replaced_only_if_it_idled_long_enough(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch, idle_before_ping: float, replaced: bool, kept: bool
) -> None:
    monkeypatch.setattr(sql_module, "IDLE_BEFORE_PING", idle_before_ping)
    store = PostgresStore(postgres_url)
    try:
        if kept:
            terminate(kept_backend(store))
        else:
            kill_pooled_connection(store)
        if replaced:
            assert store.get("no-such-task") is None  # pinged, found dead, replaced: no error
        else:
            # Not idle long enough to be pinged: the first use finds it dead (callers retry) ...
            with pytest.raises(StorageUnavailable):
                store.get("no-such-task")
        assert store.get("no-such-task") is None  # ... and a fresh one serves after
    finally:
        store.close()


def test_statements_run_on_the_driver_keep_one_connection_in_autocommit_and_transactions_get_another(
    postgres_url: str,
) -> None:
    """The hot statements run in autocommit on a connection kept between them; a
    transaction of SQLAlchemy's must still be one, on a connection of the pool."""
    store = PostgresStore(postgres_url)

    def in_a_transaction() -> bool:
        with store.transaction() as conn:
            assert store.engine.pool.checkedout() == 2  # the kept one and this one
            return conn.connection.driver_connection.autocommit is False  # type: ignore[union-attr]

    task = submitted(f"driver-{uuid.uuid4().hex}")
    try:
        assert store.create(task, NOW)[1]
        assert store.get(task.task_id) is not None
        backend = kept_backend(store)
        assert store.engine.pool.checkedout() == 1  # kept out between statements, one for all of them
        assert in_a_transaction()
        assert store.create(task, NOW) == (store.get(task.task_id), False)  # a duplicate: the INSERT failed
        assert kept_backend(store) == backend  # a failed statement does not cost the connection
        assert in_a_transaction()
        terminate(backend)
        with pytest.raises(StorageUnavailable):  # no ping (idle < 2 s): the first use finds it dead
            store.get(task.task_id)
        assert store.engine.pool.checkedout() == 0  # discarded, not kept
        assert store.get(task.task_id) is not None
        assert kept_backend(store) != backend
        assert in_a_transaction()
        store.close()
        assert store.engine.pool.checkedout() == 0  # closing gives the kept one back
    finally:
        store.close()


def test_a_forked_process_opens_its_own_connection_and_leaves_its_parents_alone(postgres_url: str) -> None:
    """A Celery pool process is forked from a worker that may have used the store: a
    socket shared by two processes would mix their statements' answers."""
    store = PostgresStore(postgres_url)
    try:
        parent = kept_backend(store)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its connection's server process, and go
            code = 1
            try:
                os.write(write, str(kept_backend(store)).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        child = int(os.read(read, 64) or b"0")
        os.close(read)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert child not in (0, parent)
        assert kept_backend(store) == parent  # the parent's connection still answers its own statements
    finally:
        store.close()


def test_statements_prepared_on_small_tables_do_not_scan_them_once_grown() -> None:
    """A new deployment's first steps run while af_attempts is nearly empty; psycopg
    prepares the statements then. The steps after the table has grown must still
    find their attempt by its key, not read the whole table."""
    with postgres_schema() as (url, schema):
        store = PostgresStore(url)
        publisher = QueuePublisher()
        service = TaskService(store, publisher, load_flows(SUPPORT / "flows.yaml"))
        consumer = StepConsumer(service, {"alpha": testmod.alpha, "beta": testmod.beta}, Settings())

        def run_flows(n: int) -> None:
            for _ in range(n):
                service.submit("noop", {})
            while publisher.messages:
                consumer.handle(publisher.messages.popleft(), continue_until=time.monotonic() + 60)

        try:
            run_flows(12)  # every statement of a step runs more than five times on the one connection
            admin, _ = postgres_admin()
            with admin:
                admin.execute(
                    f'INSERT INTO "{schema}".af_attempts (task_id, seq, cursor, type, attempt, module, command) '
                    "SELECT 'grown-' || g, 1, 0, 0, 1, 'alpha', 'step' FROM generate_series(1, 20000) g"
                )
            run_flows(10)
            # The first flows scanned a table of a few dozen rows, if at all; by key, the last
            # ones read a few rows per step; scanning the grown table, 20,000 per step.
            read = rows_scanned(schema, store)
        finally:
            store.close()
    assert read < 20_000, f"{read} rows of af_attempts read by sequential scans"


def test_only_the_hot_statements_are_prepared_and_they_are_prepared_anew_every_prepared_runs(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generic plan made while a table was tiny (once ANALYZE has seen it at one page,
    even a primary-key UPDATE's is a sequential scan) lasts PREPARED_RUNS executions at
    most; statements run through SQLAlchemy are planned on each execution."""
    monkeypatch.setattr(driver_module, "PREPARED_RUNS", 5)
    store = PostgresStore(postgres_url)

    def prepared() -> list[tuple[str, int]]:
        with autocommit_cursor(store.connections) as cursor:  # the pool's one connection
            rows = cursor.execute("SELECT statement, generic_plans + custom_plans AS runs FROM pg_prepared_statements")
            return [(row["statement"], row["runs"]) for row in rows.fetchall()]

    try:
        for _ in range(5):
            assert store.get("no-such-task") is None
        assert [runs for _, runs in prepared()] == [5]
        assert store.get("no-such-task") is None  # the sixth: every one dropped first, then prepared again
        assert [runs for _, runs in prepared()] == [1]
        for _ in range(8):
            store.list(TaskFilter(flow="noop"))
        assert len(prepared()) == 1  # the read alone
    finally:
        store.close()


def test_a_transition_prepared_on_libpq_is_made_again_every_prepared_runs_and_after_the_cursors_deallocate(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transition runs on libpq (DriverStatement.count), prepared out of psycopg's
    sight: dropped by name every PREPARED_RUNS of its executions, forgotten when the
    read's DEALLOCATE ALL (the cursor's own cycle) drops it, and prepared again when
    something else dropped it behind the store's back."""
    monkeypatch.setattr(driver_module, "PREPARED_RUNS", 3)
    store = PostgresStore(postgres_url)

    def ours() -> list[str]:
        with autocommit_cursor(store.connections) as cursor:
            rows = cursor.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE 'af%%'").fetchall()
            return sorted(row["name"] for row in rows)

    try:
        task, _ = store.create(submitted(f"libpq-{uuid.uuid4().hex}"), NOW)
        seen: set[str] = set()
        for i in range(12):
            assert store.save(replace(task, message=f"m{i}"), NOW + i) is True
            task = replace(task, message=f"m{i}", version=task.version + 1)
            assert store.get(task.task_id) == task  # the cursor's read, prepared; every 4th run drops them all
            now_prepared = ours()
            assert len(now_prepared) <= 1, now_prepared  # never more than the one in use
            seen.update(now_prepared)
        assert len(seen) > 2  # made again, under a new name, several times
        with autocommit_cursor(store.connections) as cursor:
            cursor.execute("DEALLOCATE ALL")  # not the store's: it does not know
        assert store.save(replace(task, message="after"), NOW + 30) is True
        task = replace(task, message="after", version=task.version + 1)
        assert store.save(replace(task, version=task.version - 1, message="stale"), NOW + 20) is False
        assert store.get(task.task_id) == task
    finally:
        store.close()


def test_a_transition_whose_parameters_change_type_is_prepared_once_per_types(postgres_url: str) -> None:
    """An integer goes as int2 or int4 by its size, None as an unknown: each set of
    parameter types is a statement of its own, as psycopg's cursor would prepare it."""
    store = PostgresStore(postgres_url)
    try:
        task, _ = store.create(submitted(f"types-{uuid.uuid4().hex}", priority=1), NOW)
        for priority, message in [(2, "small"), (70_000, "larger"), (3, None), (70_000, "larger again")]:
            assert store.save(replace(task, priority=priority, message=message), NOW + 1) is True
            task = replace(task, priority=priority, message=message, version=task.version + 1)
            assert store.get(task.task_id) == task
        with autocommit_cursor(store.connections) as cursor:
            rows = cursor.execute("SELECT count(*) AS n FROM pg_prepared_statements WHERE name LIKE 'af%%'").fetchall()
        assert rows[0]["n"] == 2  # int2 and int4 priorities; None and text are both sent untyped
    finally:
        store.close()


def test_a_transition_on_a_dead_connection_raises_storage_unavailable_and_the_next_gets_a_new_one(
    postgres_url: str,
) -> None:
    store = PostgresStore(postgres_url)
    try:
        task, _ = store.create(submitted(f"dead-{uuid.uuid4().hex}"), NOW)
        assert store.save(replace(task, message="before"), NOW + 1) is True
        task = replace(task, message="before", version=task.version + 1)
        backend = kept_backend(store)
        terminate(backend)
        with pytest.raises(StorageUnavailable):  # no ping (idle < 2 s): the transition finds it dead
            store.save(replace(task, message="lost"), NOW + 2)
        assert store.engine.pool.checkedout() == 0  # discarded, not kept
        assert store.save(replace(task, message="after"), NOW + 3) is True
        assert kept_backend(store) != backend
        assert store.get(task.task_id) == replace(task, message="after", version=task.version + 1)
    finally:
        store.close()


def test_a_store_dropped_unclosed_leaves_nothing_of_the_drivers_holding_its_connection(postgres_url: str) -> None:
    """The dumpers kept for its transitions refer to the connection: nothing global keeps them."""
    store = PostgresStore(postgres_url)
    task, _ = store.create(submitted(f"dropped-{uuid.uuid4().hex}"), NOW)
    assert store.save(replace(task, message="once"), NOW + 1) is True  # a transition on libpq
    with autocommit_cursor(store.connections) as cursor:
        assert cursor in driver_module._dumpers  # the transition's, kept
        kept = weakref.ref(cursor.connection)
    del store, cursor
    gc.collect()
    assert kept() is None


def test_a_transition_the_database_refuses_raises_psycopgs_error_and_keeps_the_connection(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    try:
        task, _ = store.create(submitted(f"refused-{uuid.uuid4().hex}"), NOW)
        backend = kept_backend(store)
        with pytest.raises(psycopg.errors.NumericValueOutOfRange):  # the column is an integer
            store.save(replace(task, priority=2**40 * 2**30), NOW + 1)
        assert kept_backend(store) == backend  # a refused statement does not cost the connection
        assert store.save(replace(task, message="fine"), NOW + 2) is True
    finally:
        store.close()


def test_transitions_saved_together_are_one_transaction_and_one_refused_writes_none(postgres_url: str) -> None:
    """save_many sends its statements in one pipeline, which PostgreSQL runs as one
    transaction: one refused rolls back the others, and its error is raised."""
    store = PostgresStore(postgres_url)
    try:
        tasks = [store.create(submitted(f"group-{i}-{uuid.uuid4().hex}"), NOW)[0] for i in range(3)]
        backend = kept_backend(store)
        assert store.save_many([Save(replace(t, message="together"), NOW + 1) for t in tasks]) == [True] * 3
        with autocommit_cursor(store.connections) as cursor:
            xids = cursor.execute(
                "SELECT count(DISTINCT xmin::text) AS n FROM af_tasks WHERE task_id = ANY(%s)",
                ([t.task_id for t in tasks],),
            ).fetchone()
        assert xids is not None and xids["n"] == 1  # one transaction wrote the three
        tasks = [replace(t, message="together", version=t.version + 1) for t in tasks]
        saves = [Save(replace(t, message="again"), NOW + 2) for t in tasks]
        saves[1] = saves[1]._replace(task=replace(tasks[1], priority=2**70))  # the column is an integer
        with pytest.raises(psycopg.errors.NumericValueOutOfRange):
            store.save_many(saves)
        assert [store.get(t.task_id) for t in tasks] == tasks  # none written
        assert kept_backend(store) == backend  # a refused statement does not cost the connection
        assert store.save_many([Save(replace(t, message="after"), NOW + 3) for t in tasks]) == [True] * 3
    finally:
        store.close()


def test_transitions_saved_together_after_their_statement_was_dropped_behind_the_stores_back(
    postgres_url: str,
) -> None:
    store = PostgresStore(postgres_url)
    try:
        tasks = [store.create(submitted(f"dropped-{i}-{uuid.uuid4().hex}"), NOW)[0] for i in range(2)]
        assert store.save_many([Save(replace(t, message="first"), NOW + 1) for t in tasks]) == [True, True]
        with autocommit_cursor(store.connections) as cursor:
            cursor.execute("DEALLOCATE ALL")  # not the store's: it does not know
        tasks = [replace(t, message="first", version=t.version + 1) for t in tasks]
        # Refused once, prepared again, sent again: nothing of the refused pipeline was written.
        assert store.save_many([Save(replace(t, message="second"), NOW + 2) for t in tasks]) == [True, True]
        assert store.save_many([Save(replace(t, message="third"), NOW + 3) for t in tasks]) == [False, False]
        assert [store.get(t.task_id).message for t in tasks] == ["second", "second"]  # type: ignore[union-attr]
    finally:
        store.close()


def test_transitions_saved_together_on_a_dead_connection_raise_storage_unavailable(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    try:
        tasks = [store.create(submitted(f"dead-group-{i}-{uuid.uuid4().hex}"), NOW)[0] for i in range(2)]
        terminate(kept_backend(store))
        with pytest.raises(StorageUnavailable):
            store.save_many([Save(replace(t, message="lost"), NOW + 1) for t in tasks])
        assert store.save_many([Save(replace(t, message="after"), NOW + 2) for t in tasks]) == [True, True]
    finally:
        store.close()


def test_a_statement_kept_prepared_runs_on_after_a_migration_changes_a_column_it_returns() -> None:
    """Migration 0007 changes the type of af_tasks.steps under running processes:
    PostgreSQL refuses a statement prepared before that returns the column
    ("cached plan must not change result type") until the statement is prepared anew."""
    with postgres_schema(migrate=False) as (url, schema):
        upgrade(url, "0006")
        store = PostgresStore(url)
        try:
            task, _ = store.create(submitted("t-before"), NOW)
            for _ in range(3):
                assert store.get(task.task_id) == task  # the read, prepared on the kept connection
            upgrade(url)  # to 0007, from another connection, as `asyncflow migrate` would
            assert store.get(task.task_id) == task
            assert store.get(task.task_id) == task
        finally:
            store.close()


def rows_scanned(schema: str, store: PostgresStore) -> int:
    """Rows of the schema's af_attempts read by sequential scans, every backend's included.

    Closes the store's connections: their backends report their statistics as they exit.
    """
    store.engine.dispose()
    admin, _ = postgres_admin()
    with admin:
        deadline = time.monotonic() + 10
        while True:
            # Backends still exiting have not reported yet: wait until none of the schema's is left.
            busy = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND query LIKE %s",
                (f"%{schema}%",),
            ).fetchone()
            if busy is not None and busy[0] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        admin.execute("SELECT pg_stat_clear_snapshot()")
        row = admin.execute(
            "SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables WHERE schemaname = %s AND relname = 'af_attempts'",
            (schema,),
        ).fetchone()
    return int(row[0]) if row is not None else 0


def test_a_store_dropped_without_closing_takes_its_engine_and_connections_with_it(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    kept_backend(store)
    engine = weakref.ref(store.engine)
    del store
    # A pass that runs finalizers (an unclosed connection's warns, and under -W error raises
    # inside its __del__) may leave their cycle to the next pass: a few passes, not one.
    for _ in range(3):
        gc.collect()
        if engine() is None:
            break
    assert engine() is None


def test_a_child_forked_while_a_thread_holds_the_kept_connections_lock_does_not_hang(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    kept = store.connections
    try:
        kept_backend(store)
        with kept._lock:  # as a thread of the parent would, at the moment of the fork
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    signal.alarm(10)
                    kept_backend(store)
                    code = 0
                finally:
                    os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        store.close()


def test_a_connection_in_use_when_the_store_closes_goes_back_to_the_pool_afterwards(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)
    with autocommit_cursor(store.connections) as cursor:
        store.close()
        cursor.execute("SELECT 1")
    assert store.engine.pool.checkedout() == 0


def test_a_connection_that_ran_transitions_is_freed_once_closed(postgres_url: str) -> None:
    """What DriverStatement.count keeps per connection does not keep the connection alive."""
    store = PostgresStore(postgres_url)
    try:
        task, _ = store.create(submitted(f"freed-{uuid.uuid4().hex}"), NOW)
        assert store.save(replace(task, message="x"), NOW + 1) is True
        with autocommit_cursor(store.connections) as cursor:
            conn = weakref.ref(cursor.connection)
    finally:
        store.close()
    store.engine.dispose()
    del cursor
    gc.collect()
    assert conn() is None


def test_a_kept_connection_goes_back_to_the_pool_without_the_transitions_statements(postgres_url: str) -> None:
    """A rollback in the pool makes psycopg drop every statement of the connection,
    unseen by DriverStatement.count: its own are dropped before, by name."""
    store = PostgresStore(postgres_url)
    try:
        task, _ = store.create(submitted(f"pooled-{uuid.uuid4().hex}"), NOW)
        assert store.save(replace(task, message="kept"), NOW + 1) is True
        backend = kept_backend(store)
        store.connections.release()  # every kept connection back to the pool
        with store.engine.connect() as conn:  # the same connection, from the pool
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one() == backend
            names = conn.exec_driver_sql("SELECT name FROM pg_prepared_statements").scalars().all()
        assert not [name for name in names if name.startswith("af_")]
    finally:
        store.close()


def test_a_transition_whose_prepare_is_refused_leaves_no_name_behind(postgres_url: str) -> None:
    """A statement PostgreSQL cannot prepare yet (a table a migration is about to
    create) is refused, and prepared once it can be."""
    table = f"af_later_{uuid.uuid4().hex[:8]}"
    later = Table(table, MetaData(), Column("n", Integer))
    store = PostgresStore(postgres_url)
    statement = driver_module.DriverStatement(
        select(func.count()).select_from(later).where(later.c.n == bindparam("n")), store.engine, prepared=True
    )
    try:
        with autocommit_cursor(store.connections) as cursor:
            with pytest.raises(psycopg.errors.UndefinedTable):
                statement.count(cursor, {"n": 1})
            assert not driver_module._own_prepared[cursor.connection].names
            cursor.execute(f"CREATE TABLE {table} (n integer)")
            cursor.execute(f"INSERT INTO {table} VALUES (1), (1), (2)")
            assert statement.count(cursor, {"n": 1}) == 2
            cursor.execute(f"DROP TABLE {table}")
    finally:
        store.close()


def test_a_batch_refuses_a_value_longer_than_its_column_and_stores_none_of_it(postgres_url: str) -> None:
    """A batch's columns go as arrays: cast to VARCHAR(n), a longer value would be cut short unseen."""
    store = PostgresStore(postgres_url)
    pull = SqlPullStore(store)
    pull.save_type(TaskType(task_type="video"), NOW)
    tag = uuid.uuid4().hex[:8]
    try:
        for each in (True, False):
            fine, long = submitted(f"fine-{tag}-{each}"), submitted(f"long-{tag}-{each}", user_id="u" * 129)
            with pytest.raises(psycopg.errors.StringDataRightTruncation):
                store.create_many([fine, long], NOW, each=each)
            assert store.get(fine.task_id) is None and store.get(long.task_id) is None
            tasks = [new_pull_task(f"{name}-{tag}-{each}", TaskType(task_type="video"), user, "", "{}", 0, NOW)
                     for name, user in (("fine", "u"), ("long", "u" * 129))]
            with pytest.raises(psycopg.errors.StringDataRightTruncation):
                pull.create_many(tasks, each=each)
            assert pull.get(tasks[0].task_id) is None and pull.get(tasks[1].task_id) is None
    finally:
        store.close()


def test_coalesced_creates_committed_before_the_read_of_the_others_failed_are_answered_stored(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrent single creates commit in one statement; the ids it skipped (replays) are
    read after it. If that read finds the database gone, the inserted tasks are still stored
    and answered so: only the skipped ones are answered with the error."""
    store = PostgresStore(postgres_url)
    tag = uuid.uuid4().hex[:8]
    old, _ = store.create(submitted(f"old-{tag}"), NOW)
    batch = [submitted(f"new-{tag}-1"), submitted(old.task_id), submitted(f"new-{tag}-2")]

    def connection_lost(*_: object) -> list[dict[str, object]]:
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(driver_module, "_each_row", connection_lost)
    try:
        first, replay, second = store.create_many(batch, NOW, each=True)
        assert first == (replace(batch[0], version=1), True) and second == (replace(batch[2], version=1), True)
        assert isinstance(replay, StorageUnavailable)
        # All or none: the batch's transaction is rolled back with the error.
        others = [submitted(f"none-{tag}-1"), submitted(old.task_id), submitted(f"none-{tag}-2")]
        with pytest.raises(StorageUnavailable):
            store.create_many(others, NOW)
        monkeypatch.undo()
        assert store.get(batch[0].task_id) == first[0] and store.get(batch[2].task_id) == second[0]  # type: ignore[index]
        assert store.get(others[0].task_id) is None and store.get(others[2].task_id) is None
    finally:
        store.close()
