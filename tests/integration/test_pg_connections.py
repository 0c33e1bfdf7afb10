"""PostgreSQL connections: checked before use only after sitting idle, and replaced if dead."""

from __future__ import annotations

import uuid

import pytest

from shared.storage import StorageUnavailable
from shared.storage import sql as sql_module
from shared.storage.sql import PostgresStore
from tests.integration.conftest import postgres_admin
from tests.integration.test_store_contract import NOW, submitted

pytestmark = pytest.mark.postgres


def kill_pooled_connection(store: PostgresStore) -> None:
    """Terminate the server side of the one connection in the store's pool, as a restart would."""
    with store.engine.connect() as conn:
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    admin, _ = postgres_admin()
    with admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


@pytest.mark.parametrize(("idle_before_ping", "replaced"), [(0.0, True), (3600.0, False)])
def test_a_connection_killed_while_idle_is_replaced_only_if_it_idled_long_enough(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch, idle_before_ping: float, replaced: bool
) -> None:
    monkeypatch.setattr(sql_module, "IDLE_BEFORE_PING", idle_before_ping)
    store = PostgresStore(postgres_url)
    try:
        kill_pooled_connection(store)
        if replaced:
            assert store.get("no-such-task") is None  # pinged, found dead, replaced: no error
        else:
            # Not idle long enough to be pinged: the first use finds it dead (callers retry) ...
            with pytest.raises(StorageUnavailable):
                store.get("no-such-task")
        assert store.get("no-such-task") is None  # ... and the pool has a fresh one after
    finally:
        store.close()


def test_statements_run_on_the_driver_give_their_connection_back_ready_for_transactions(postgres_url: str) -> None:
    """The hot statements run in autocommit; a transaction after them must still be one."""
    store = PostgresStore(postgres_url)

    def out_of_autocommit() -> bool:
        with store.transaction() as conn:
            # One connection in the pool all along: each use handed it back (or replaced it).
            assert store.engine.pool.checkedout() == 1
            return conn.connection.driver_connection.autocommit is False  # type: ignore[union-attr]

    task = submitted(f"driver-{uuid.uuid4().hex}")
    try:
        assert store.create(task, NOW)[1]
        assert store.get(task.task_id) is not None
        assert out_of_autocommit()
        assert store.create(task, NOW) == (store.get(task.task_id), False)  # a duplicate: the INSERT failed
        assert out_of_autocommit()
        kill_pooled_connection(store)
        with pytest.raises(StorageUnavailable):  # no ping (idle < 2 s): the first use finds it dead
            store.get(task.task_id)
        assert out_of_autocommit()
        assert store.get(task.task_id) is not None
    finally:
        store.close()
