"""PostgreSQL connections: checked before use only after sitting idle, and replaced if dead."""

from __future__ import annotations

import pytest

from shared.storage import StorageUnavailable
from shared.storage import sql as sql_module
from shared.storage.sql import PostgresStore
from tests.integration.conftest import postgres_admin

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
