"""The shipped flows.yaml and example modules, through the CLI, as a user runs them.

Embedded: one `asyncflow up`. PostgreSQL + RabbitMQ: API, scheduler and one
worker per module as separate processes, instances created on PostgreSQL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from modules import _db, monitor, mysql, resource
from shared.config import Settings
from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import REPO, Stack, unique

pytestmark = pytest.mark.e2e

REQUEST = ["--param", "Cpu=4", "--param", "Memory=8", "--param", "Storage=500"]


@pytest.fixture(scope="module", params=["embedded", "postgres-rabbitmq"])
def example(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"ASYNCFLOW_FLOWS": str(REPO / "flows.yaml")}
    groups = None  # embedded: everything through `asyncflow up`, as a user starts it
    if request.param == "postgres-rabbitmq":
        env["ASYNCFLOW_MYSQL_ADMIN_URL"] = "database"  # instances on the test's PostgreSQL
        groups = [["resource"], ["mysql"], ["monitor"]]
    with open_stack(request.param, tmp_path_factory.mktemp(request.param), env, groups) as stack:
        yield stack
        drop_instances(stack)
    _db.dispose_engines()


def drop_instances(stack: Stack) -> None:
    """The instances are databases of their own on the server: they outlive the stack's."""
    admin = stack.env.get("ASYNCFLOW_MYSQL_ADMIN_URL")
    if admin is None:
        return
    listed = stack.http.get(f"{stack.url}/api/tasks", params={"limit": 1000}, timeout=10)
    assert listed.status_code == 200, listed.text
    server = mysql.PostgresServer(admin)
    for name in {t["parameters"].get("InstanceName") for t in listed.json()["tasks"]} - {None}:
        server.drop(name)


def settings_of(stack: Stack) -> Settings:
    return Settings(home=stack.home, database_url=stack.env.get("ASYNCFLOW_DATABASE_URL"))


def used(stack: Stack) -> dict[str, int]:
    return {name: row["used"] for name, row in resource.quota(settings_of(stack)).items()}


def instance_exists(stack: Stack, name: str) -> bool:
    admin = stack.env.get("ASYNCFLOW_MYSQL_ADMIN_URL")
    if admin is None:
        return (stack.home / "instances" / f"{name}.sqlite").exists()
    with _db.admin_connection(admin) as conn:
        found = conn.exec_driver_sql("SELECT 1 FROM pg_database WHERE datname = %(n)s", {"n": name})
        return found.first() is not None


def submit(stack: Stack, *args: str) -> tuple[int, str, dict]:
    """`asyncflow submit ... --wait`; returns exit code, output and the final document."""
    result = stack.run_cli("submit", "create_mysql_instance", *args, "--wait")
    task_id = result.stdout.split()[1]
    return result.returncode, result.stdout + result.stderr, stack.get(task_id)


def rollbacks(doc: dict) -> list[int]:
    return [a["cursor"] for a in doc["attempts"] if a["type"] == 1]


def test_create_succeeds_deducts_quota_and_creates_the_database(example: Stack) -> None:
    before = used(example)
    name = unique("inst").lower()
    code, out, doc = submit(example, *REQUEST, "--param", f"Name={name}")
    assert code == 0, out
    assert "status 0 success" in out and "resource.check_resource" in out
    assert doc["parameters"]["InstanceName"] == name and doc["parameters"]["ReservationId"]
    after = used(example)
    assert {k: after[k] - before[k] for k in after} == {"Cpu": 4, "Memory": 8, "Storage": 500}
    assert instance_exists(example, name)

    status = example.run_cli("status", doc["task_id"])
    assert status.returncode == 0 and "status 0 success" in status.stdout
    assert "mysql.init_instance" in status.stdout

    # And deprovisioning gives everything back.
    result = example.run_cli("submit", "delete_mysql_instance", "--param", f"InstanceName={name}", "--wait")
    assert result.returncode == 0, result.stdout + result.stderr
    assert used(example) == before
    assert not instance_exists(example, name)


def test_over_quota_fails_at_step_zero_and_changes_nothing(example: Stack) -> None:
    before = used(example)
    code, out, doc = submit(example, "--param", "Cpu=1", "--param", "Memory=999999", "--param", "Storage=1")
    assert code == 1 and doc["task_status"] == 4, out
    assert "insufficient Memory" in doc["task_message"]
    assert rollbacks(doc) == [0]  # monitor.report_event records the refusal
    assert used(example) == before
    events = monitor.events(settings_of(example), doc["task_id"])
    assert [e["kind"] for e in events] == ["event"]


def test_init_failure_cleans_its_partial_database(example: Stack) -> None:
    before = used(example)
    name = unique("half").lower()
    code, out, doc = submit(example, *REQUEST, "--param", f"Name={name}", "--param", "FailInit=true")
    assert code == 1 and doc["task_status"] == 4, out
    assert doc["task_cursor"] == 1 and rollbacks(doc) == [1, 0]
    assert not instance_exists(example, name)
    assert used(example) == before


def test_deduct_failure_compensates_every_step_in_reverse(example: Stack) -> None:
    before = used(example)
    name = unique("late").lower()
    code, out, doc = submit(
        example, *REQUEST, "--param", f"Name={name}", "--param", 'FailCommands=["deduct_resource"]'
    )
    assert code == 1 and doc["task_status"] == 4, out
    assert doc["task_cursor"] == 2 and rollbacks(doc) == [2, 1, 0]
    assert not instance_exists(example, name)
    assert used(example) == before
    assert not [i for i in mysql.instances(settings_of(example)) if i["name"] == name]


def test_failing_rollback_stops_and_raises_an_alarm(example: Stack) -> None:
    code, out, doc = submit(
        example, *REQUEST, "--param", 'FailCommands=["deduct_resource", "restore_resource"]'
    )
    assert code == 1 and doc["task_status"] == 5, out
    assert "rollback of step 2" in doc["task_message"]
    alarms = wait_for(
        lambda: [e for e in monitor.events(settings_of(example), doc["task_id"]) if e["kind"] != "event"],
        30, "the alarm",
    )
    payload = alarms[0]["payload"]
    payload = json.loads(payload) if isinstance(payload, str) else payload
    assert payload["Command"] == "restore_resource"
