"""The example modules (resource, mysql, monitor) doing their real work on SQLite.

The resource and mysql tests are written against the fixtures ``settings``,
``instance_settings`` and ``probe`` only; tests/integration/test_example_modules_backends.py
imports them and runs them again on PostgreSQL and MariaDB by redefining those fixtures.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from modules import _db, monitor, mysql, resource
from shared.config import Settings
from shared.module import PermanentError, StepContext

SMALL = {"Cpu": 2, "Memory": 8, "Storage": 100}


def step(
    settings: Settings,
    task_id: str,
    parameters: dict[str, Any],
    *,
    step_type: int = 0,
    attempt: int = 1,
    key: str | None = None,
) -> StepContext:
    return StepContext(
        task_id=task_id,
        flow="create_mysql_instance",
        cursor=0,
        step_type=step_type,
        attempt=attempt,
        parameters=parameters,
        settings=settings,
        key=key,
    )


def new_task() -> str:
    return str(uuid.uuid4())


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    _db.dispose_engines()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path}/t.sqlite")


# ---------------------------------------------------------------- resource


def used(settings: Settings) -> dict[str, int]:
    return {name: row["used"] for name, row in resource.quota(settings).items()}


def test_startup_seeds_the_configured_quota(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCFLOW_RESOURCE_QUOTA", "Cpu=8,Memory=16,Storage=32")
    resource.start(settings)
    assert resource.quota(settings) == {
        "Cpu": {"total": 8, "used": 0, "free": 8},
        "Memory": {"total": 16, "used": 0, "free": 16},
        "Storage": {"total": 32, "used": 0, "free": 32},
    }


def test_existing_quota_rows_are_not_reseeded(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    resource.deduct_resource(step(settings, new_task(), SMALL))
    monkeypatch.setenv("ASYNCFLOW_RESOURCE_QUOTA", "Cpu=1,Memory=1,Storage=1")
    restarted = settings.model_copy()  # another process starting on the same database
    resource.start(restarted)
    assert resource.quota(restarted)["Cpu"] == {"total": 64, "used": 2, "free": 62}


def test_check_accepts_a_request_that_fits(settings: Settings) -> None:
    request = {"Cpu": 64, "Memory": 256, "Storage": 10000}
    assert resource.check_resource(step(settings, new_task(), request)) == {"ResourceChecked": True}
    assert used(settings) == {"Cpu": 0, "Memory": 0, "Storage": 0}  # a check takes nothing


def test_check_refuses_more_than_is_free(settings: Settings) -> None:
    with pytest.raises(PermanentError, match=r"^insufficient Memory: requested 999, free 256$"):
        resource.check_resource(step(settings, new_task(), {"Cpu": 1, "Memory": 999, "Storage": 1}))


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"Memory": 1, "Storage": 1}, "Cpu is missing"),
        ({"Cpu": "4", "Memory": 1, "Storage": 1}, "Cpu must be a positive integer, got '4'"),
        ({"Cpu": 1, "Memory": True, "Storage": 1}, "Memory must be a positive integer, got True"),
        ({"Cpu": 1, "Memory": 1, "Storage": 0}, "Storage must be a positive integer, got 0"),
        ({"Cpu": 1.5, "Memory": 1, "Storage": 1}, "Cpu must be a positive integer, got 1.5"),
    ],
)
def test_bad_parameters_fail_permanently(
    settings: Settings, parameters: dict[str, Any], message: str
) -> None:
    for command in (resource.check_resource, resource.deduct_resource):
        with pytest.raises(PermanentError, match=message):
            command(step(settings, new_task(), parameters))


def test_deduct_then_restore_balances_to_the_unit(settings: Settings) -> None:
    task = new_task()
    before = used(settings)
    assert resource.deduct_resource(step(settings, task, SMALL)) == {"ReservationId": task}
    assert used(settings) == {name: before[name] + SMALL[name] for name in SMALL}
    resource.restore_resource(step(settings, task, SMALL, step_type=1))
    assert used(settings) == before


def test_deduct_delivered_twice_deducts_once(settings: Settings) -> None:
    ctx = step(settings, new_task(), SMALL)
    resource.deduct_resource(ctx)
    resource.deduct_resource(ctx)
    assert used(settings) == SMALL


def test_restore_without_a_deduction_changes_nothing(settings: Settings) -> None:
    resource.restore_resource(step(settings, new_task(), SMALL, step_type=1))
    assert used(settings) == {"Cpu": 0, "Memory": 0, "Storage": 0}


def test_restore_delivered_twice_gives_back_once(settings: Settings) -> None:
    other, task = new_task(), new_task()
    resource.deduct_resource(step(settings, other, SMALL))
    resource.deduct_resource(step(settings, task, SMALL))
    for _ in range(2):
        resource.restore_resource(step(settings, task, SMALL, step_type=1))
    assert used(settings) == SMALL  # only ``other``'s share is still taken


def test_a_deduct_that_cannot_be_covered_takes_nothing(settings: Settings) -> None:
    task = new_task()
    # Cpu and Memory fit; Storage does not, after they were already updated.
    with pytest.raises(PermanentError, match="insufficient Storage: requested 20000, free 10000"):
        resource.deduct_resource(step(settings, task, {"Cpu": 4, "Memory": 4, "Storage": 20000}))
    assert used(settings) == {"Cpu": 0, "Memory": 0, "Storage": 0}
    assert resource.ledger(settings) == []
    resource.restore_resource(step(settings, task, SMALL, step_type=1))  # the rollback of that step
    assert used(settings) == {"Cpu": 0, "Memory": 0, "Storage": 0}


def test_a_retried_task_takes_its_quota_again_after_a_restore(settings: Settings) -> None:
    task = new_task()
    resource.deduct_resource(step(settings, task, SMALL))
    resource.restore_resource(step(settings, task, SMALL, step_type=1))
    resource.deduct_resource(step(settings, task, SMALL))  # operator retry: the step runs again
    assert used(settings) == SMALL
    resource.restore_resource(step(settings, task, SMALL, step_type=1))
    assert used(settings) == {"Cpu": 0, "Memory": 0, "Storage": 0}


def test_release_reservation_gives_back_another_tasks_deduction(settings: Settings) -> None:
    owner = new_task()
    resource.deduct_resource(step(settings, owner, SMALL))
    release = step(settings, new_task(), {"ReservationId": owner})
    resource.release_reservation(release)
    resource.release_reservation(release)
    assert used(settings) == {"Cpu": 0, "Memory": 0, "Storage": 0}
    with pytest.raises(PermanentError, match="ReservationId"):
        resource.release_reservation(step(settings, new_task(), {}))


def test_concurrent_deducts_never_overdraw(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCFLOW_RESOURCE_QUOTA", "Cpu=10,Memory=100,Storage=100")
    resource.start(settings)
    contenders = 8
    request = {"Cpu": 3, "Memory": 1, "Storage": 1}
    outcomes = _race(contenders, lambda: resource.deduct_resource(step(settings, new_task(), request)))
    won = sum(1 for outcome in outcomes if isinstance(outcome, dict))
    assert won == 3  # 3 x 3 Cpu fit in 10, a fourth would not
    assert all(isinstance(o, dict | PermanentError) for o in outcomes), outcomes
    assert resource.quota(settings)["Cpu"] == {"total": 10, "used": 9, "free": 1}
    assert used(settings) == {"Cpu": 9, "Memory": 3, "Storage": 3}


def test_concurrent_deliveries_of_one_deduct_deduct_once(settings: Settings) -> None:
    ctx = step(settings, new_task(), SMALL)
    outcomes = _race(6, lambda: resource.deduct_resource(ctx))
    assert outcomes == [{"ReservationId": ctx.task_id}] * 6
    assert used(settings) == SMALL


def _race(n: int, action: Callable[[], Any]) -> list[Any]:
    """Run ``action`` from ``n`` threads released at the same moment; results or exceptions."""
    gate = threading.Barrier(n)

    def contender() -> Any:
        gate.wait()
        try:
            return action()
        except Exception as exc:  # collected and asserted on by the caller
            return exc

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: contender(), range(n)))


# ---------------------------------------------------------------- mysql


class SqliteProbe:
    """Looks at embedded instances directly, without the module's code."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.sqlite"

    def database_exists(self, name: str) -> bool:
        return self._path(name).exists()

    def user_exists(self, name: str) -> bool:
        return self._password_hash(name) is not None

    def can_login(self, name: str, password: str) -> bool:
        return self._password_hash(name) == hashlib.sha256(password.encode()).hexdigest()

    def create_foreign(self, name: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._path(name).write_bytes(b"")

    def drop(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def _password_hash(self, name: str) -> str | None:
        if not self.database_exists(name):
            return None
        with closing(sqlite3.connect(f"file:{self._path(name)}?mode=ro", uri=True)) as conn:
            try:
                row = conn.execute("SELECT password_sha256 FROM users WHERE name = ?", (name,)).fetchone()
            except sqlite3.OperationalError:  # no users table yet
                return None
        return row[0] if row else None


@pytest.fixture
def instance_settings(settings: Settings) -> Settings:
    return settings


@pytest.fixture
def probe(instance_settings: Settings) -> SqliteProbe:
    return SqliteProbe(instance_settings.home / "instances")


@pytest.fixture
def instance_names(probe: Any) -> Iterator[Callable[[], str]]:
    """Unique instance names; whatever exists under them afterwards is dropped."""
    made: list[str] = []

    def new_name() -> str:
        made.append(f"t_{uuid.uuid4().hex[:12]}")
        return made[-1]

    yield new_name
    for name in made:
        probe.drop(name)


def registered(settings: Settings) -> dict[str, str]:
    """Instance name → owning task, straight from the registry table."""
    with _db.reading(settings.resolved_database_url()) as conn:
        return dict(conn.execute(select(mysql.registry.c.name, mysql.registry.c.task_id)).all())


def password_of(settings: Settings, name: str) -> str:
    query = select(mysql.registry.c.password).where(mysql.registry.c.name == name)
    with _db.reading(settings.resolved_database_url()) as conn:
        return conn.execute(query).scalar_one()


def test_default_instance_name_comes_from_the_task_id() -> None:
    assert mysql.instance_name({}, "3F2A9C1B-77d4-4e1a-9f0b-000000000000") == "af_3f2a9c1b77d4"
    assert mysql.instance_name({"Name": "orders_db"}, "ignored") == "orders_db"


@pytest.mark.parametrize("name", ["Orders", "1db", "x-y", "a" * 41, "", "db\n", 7])
def test_invalid_names_fail_init_permanently_and_clean_does_nothing(
    instance_settings: Settings, name: Any
) -> None:
    task = new_task()
    with pytest.raises(PermanentError, match="must match"):
        mysql.init_instance(step(instance_settings, task, {"Name": name}))
    assert mysql.clean_instance(step(instance_settings, task, {"Name": name}, step_type=1)) == {}


def test_init_creates_database_and_user_and_clean_removes_them(
    instance_settings: Settings, probe: Any, instance_names: Callable[[], str]
) -> None:
    name, task = instance_names(), new_task()
    ctx = step(instance_settings, task, {"Name": name})
    result = mysql.init_instance(ctx)
    assert result["InstanceName"] == name
    assert name in result["InstanceDsn"]
    password = password_of(instance_settings, name)
    assert password not in result["InstanceDsn"]
    assert probe.database_exists(name) and probe.user_exists(name)
    assert probe.can_login(name, password)

    assert mysql.init_instance(ctx) == result  # a redelivery changes nothing
    assert registered(instance_settings) == {name: task}

    rollback = step(instance_settings, task, {"Name": name}, step_type=1)
    mysql.clean_instance(rollback)
    assert not probe.database_exists(name) and not probe.user_exists(name)
    assert registered(instance_settings) == {}
    mysql.clean_instance(rollback)  # and so does a redelivered rollback


def test_a_name_taken_by_another_task_fails_and_its_rollback_spares_the_owner(
    instance_settings: Settings, probe: Any, instance_names: Callable[[], str]
) -> None:
    name, owner, intruder = instance_names(), new_task(), new_task()
    mysql.init_instance(step(instance_settings, owner, {"Name": name}))

    with pytest.raises(PermanentError, match=f"instance name '{name}' is already taken"):
        mysql.init_instance(step(instance_settings, intruder, {"Name": name}))
    mysql.clean_instance(step(instance_settings, intruder, {"Name": name}, step_type=1))

    assert probe.database_exists(name) and probe.user_exists(name)
    assert registered(instance_settings) == {name: owner}
    assert probe.can_login(name, password_of(instance_settings, name))


def test_fail_init_leaves_a_database_that_clean_instance_removes(
    instance_settings: Settings, probe: Any, instance_names: Callable[[], str]
) -> None:
    name, task = instance_names(), new_task()
    params = {"Name": name, "FailInit": True}
    with pytest.raises(PermanentError, match="FailInit"):
        mysql.init_instance(step(instance_settings, task, params))
    assert probe.database_exists(name)  # the partial work the rollback must undo

    mysql.clean_instance(step(instance_settings, task, params, step_type=1))
    assert not probe.database_exists(name) and not probe.user_exists(name)
    assert registered(instance_settings) == {}


def test_an_unregistered_database_is_never_adopted_nor_dropped(
    instance_settings: Settings, probe: Any, instance_names: Callable[[], str]
) -> None:
    name, task = instance_names(), new_task()
    probe.create_foreign(name)
    with pytest.raises(PermanentError, match="not managed here"):
        mysql.init_instance(step(instance_settings, task, {"Name": name}))
    mysql.clean_instance(step(instance_settings, task, {"Name": name}, step_type=1))
    assert probe.database_exists(name)
    assert registered(instance_settings) == {}


def test_check_and_drop_instance_deprovision_by_name(
    instance_settings: Settings, probe: Any, instance_names: Callable[[], str]
) -> None:
    name, owner = instance_names(), new_task()
    mysql.init_instance(step(instance_settings, owner, {"Name": name}))
    deprovision = step(instance_settings, new_task(), {"InstanceName": name})

    assert mysql.check_instance(deprovision) == {"ReservationId": owner}
    assert mysql.drop_instance(deprovision) == {"DroppedInstance": name}
    assert not probe.database_exists(name) and not probe.user_exists(name)
    assert mysql.drop_instance(deprovision) == {}  # redelivered: nothing left to do
    with pytest.raises(PermanentError, match=f"no instance named '{name}'"):
        mysql.check_instance(deprovision)


# ---------------------------------------------------------------- monitor


def test_an_event_is_recorded_once_per_step_execution(settings: Settings) -> None:
    task = new_task()
    params = {"Cpu": 2}
    delivery = step(settings, task, params, step_type=1)
    monitor.report_event(delivery)
    monitor.report_event(delivery)  # the same attempt delivered again
    # A second attempt after a lost first one (it had recorded the event) adds nothing.
    monitor.report_event(step(settings, task, params, step_type=1, attempt=2))
    monitor.report_event(step(settings, task, params, step_type=0))  # another step: recorded

    recorded = monitor.events(settings, task)
    assert [e["idempotency_key"] for e in recorded] == [f"{task}:0:1", f"{task}:0:0"]
    assert recorded[0]["kind"] == "event" and recorded[0]["payload"] == params
    assert monitor.events(settings, "another-task") == []


def test_an_alarm_is_recorded_as_kind_alarm(settings: Settings) -> None:
    task = new_task()
    alarm = {"Alarm": "rollback_failed", "Flow": "create_mysql_instance", "Cursor": 1,
             "Module": "mysql", "Command": "clean_instance", "Error": "boom"}
    monitor.report_event(step(settings, task, alarm, step_type=1, key=f"{task}:alarm:7"))
    [event] = monitor.events(settings, task)
    assert event["kind"] == "alarm"
    assert event["idempotency_key"] == f"{task}:alarm:7"
    assert event["payload"] == alarm


class _WebhookServer(ThreadingHTTPServer):
    def __init__(self, statuses: list[int]) -> None:
        super().__init__(("127.0.0.1", 0), _WebhookHandler)
        self.statuses = statuses  # answers to give, in order; then 200
        self.received: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/hook"


class _WebhookHandler(BaseHTTPRequestHandler):
    server: _WebhookServer

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append(json.loads(body))
        status = self.server.statuses.pop(0) if self.server.statuses else 200
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean


@pytest.fixture
def webhook(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[list[int]], _WebhookServer]]:
    servers: list[tuple[_WebhookServer, threading.Thread]] = []
    for proxy in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)

    def serve(statuses: list[int]) -> _WebhookServer:
        server = _WebhookServer(statuses)
        # A short poll interval: shutdown() waits for the loop to notice it.
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
        thread.start()
        servers.append((server, thread))
        monkeypatch.setenv("ASYNCFLOW_MONITOR_WEBHOOK_URL", server.url)
        return server

    yield serve
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_webhook_receives_each_event_once(
    settings: Settings, webhook: Callable[[list[int]], _WebhookServer]
) -> None:
    server = webhook([])
    task = new_task()
    delivery = step(settings, task, {"Alarm": "rollback_failed"}, step_type=1)
    monitor.report_event(delivery)
    monitor.report_event(delivery)

    [posted] = server.received
    assert posted["task_id"] == task and posted["kind"] == "alarm"
    assert posted["payload"] == {"Alarm": "rollback_failed"}
    assert posted["idempotency_key"] == f"{task}:0:1"
    assert monitor.events(settings, task)[0]["delivered_at"] is not None


def test_a_failed_webhook_fails_the_attempt_and_a_redelivery_posts_again(
    settings: Settings, webhook: Callable[[list[int]], _WebhookServer]
) -> None:
    server = webhook([503])
    delivery = step(settings, new_task(), {"Cpu": 1})
    with pytest.raises(httpx.HTTPStatusError):
        monitor.report_event(delivery)
    monitor.report_event(delivery)
    assert len(server.received) == 2
    [event] = monitor.events(settings, delivery.task_id)
    assert event["delivered_at"] is not None


# ---------------------------------------------------------------- engines


def test_sqlite_engines_use_wal_and_a_busy_timeout(settings: Settings) -> None:
    with _db.reading(settings.resolved_database_url()) as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


def test_a_forked_process_does_not_reuse_the_parents_engine(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = settings.resolved_database_url()
    parents = _db.engine(url)
    assert _db.engine(url) is parents
    monkeypatch.setattr(_db, "_owner_pid", -1)  # as seen from a child after fork
    assert _db.engine(url) is not parents
