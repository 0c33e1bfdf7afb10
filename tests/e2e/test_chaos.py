"""Chaos soak: two hundred real flows while consumers are SIGKILLed, RabbitMQ is
stopped and started, and the API is killed; then an audit of every effect.

The flows are the shipped create_mysql_instance (quota ledger, real instance,
monitor events) with time limits shortened so lost attempts expire quickly.
The figures are printed in the test run's output.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from modules import _db, monitor, mysql, resource
from shared.config import Settings
from shared.states import STOPPED
from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import REPO, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.outage]

TASKS = 200
MIN_FAULTS = 15
WORKERS = {"worker-resource": ["resource"], "worker-mysql": ["mysql"], "worker-monitor": ["monitor"]}
# What each task asks for, and how it must end (status, steps rolled back).
MODES = {
    "ok": ({}, 0),
    "over_quota": ({"Memory": 10**9}, 4),
    "init_fails": ({"FailInit": True}, 4),
    "deduct_fails": ({"FailCommands": ["deduct_resource"]}, 4),
}


def short_flows(home: Path) -> Path:
    """flows.yaml with 5 s time limits and retries everywhere: a lost attempt expires fast."""
    data = yaml.safe_load((REPO / "flows.yaml").read_text())
    for flow in data["flows"].values():
        for step in flow["steps"]:
            for action in (step["normal"], step.get("rollback")):
                if action:
                    action.update(timeout=5, retry=max(action.get("retry", 0), 3), max_retry_interval=-0.2)
                    action.pop("max_retry_interval", None)
    path = home / "flows.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("chaos")
    env = {
        "ASYNCFLOW_FLOWS": str(short_flows(home)),
        "ASYNCFLOW_REQUEUE_AFTER": "3",
        "ASYNCFLOW_EXPIRE_GRACE": "2",
        "ASYNCFLOW_PUBLISH_RETRY": "0.5",
        "ASYNCFLOW_SHUTDOWN_GRACE": "3",
        "ASYNCFLOW_RESOURCE_QUOTA": "Cpu=1000000,Memory=1000000,Storage=1000000",
    }
    with open_stack("postgres-rabbitmq", home, env, list(WORKERS.values())) as stack:
        yield stack
    _db.dispose_engines()


class Load:
    """Submits tasks with client-chosen ids, retrying through API kills until accepted."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.accepted: dict[str, str] = {}  # task_id -> mode
        self.retries = 0

    def submit(self, mode: str) -> None:
        task_id = f"chaos-{uuid.uuid4().hex[:16]}"
        params = {"Cpu": 1, "Memory": 1, "Storage": 1} | MODES[mode][0]
        body = {"flow": "create_mysql_instance", "parameters": params, "task_id": task_id}
        deadline = time.monotonic() + 120
        while True:
            try:
                response = self.stack.http.post(self.stack.url + "/api/tasks", json=body, timeout=15)
                if response.status_code in (200, 201):
                    self.accepted[task_id] = mode
                    return
            except httpx.TransportError:
                pass  # the API was killed mid-request: the same id is safe to send again
            self.retries += 1
            if time.monotonic() > deadline:
                raise AssertionError(f"{task_id} not accepted within 120 s")
            time.sleep(0.2)


class Chaos(threading.Thread):
    def __init__(self, stack: Stack, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.stack, self.stop = stack, stop
        self.kills = Counter[str]()
        self.broker_restarts = 0
        self.last_fault = time.monotonic()
        self.error: BaseException | None = None
        self.ctl = shutil.which("rabbitmqctl")  # None: no broker restarts here

    def enough(self) -> bool:
        """MIN_FAULTS, among them an API kill and, where rabbitmqctl is, a broker restart."""
        restarted = self.broker_restarts > 0 or self.ctl is None
        faults = sum(self.kills.values()) + self.broker_restarts
        return faults >= MIN_FAULTS and self.kills["api"] > 0 and restarted

    def run(self) -> None:
        rng = random.Random(7)
        try:
            while not self.stop.wait(rng.uniform(0.5, 1.5)):
                # An API killed is down for the seconds its restart takes, and submits wait
                # for it: one fault in eight, so the soak is not mostly an API outage.
                fault = rng.choice(["worker"] * 6 + ["api"] + ["broker"])
                if fault == "broker" and self.ctl and self.broker_restarts < 2:
                    subprocess.run([self.ctl, "stop_app"], check=True, capture_output=True, timeout=120)
                    time.sleep(3)  # the outage itself
                    subprocess.run([self.ctl, "start_app"], check=True, capture_output=True, timeout=120)
                    self.broker_restarts += 1
                else:
                    key = "api" if fault == "api" else rng.choice(list(WORKERS))
                    self.stack.kill(key)  # SIGKILL, the whole process group
                    self.stack.respawn(key)
                    self.kills[key] += 1
                self.last_fault = time.monotonic()
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_chaos_soak_every_accepted_task_ends_and_the_ledger_balances(
    chaos: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(home=chaos.home, database_url=chaos.env["ASYNCFLOW_DATABASE_URL"])
    resource.start(settings)
    before = resource.quota(settings)
    load, stop = Load(chaos), threading.Event()
    chaotic = Chaos(chaos, stop)
    started = time.monotonic()
    chaotic.start()
    rng = random.Random(11)
    modes = rng.choices(list(MODES), weights=[50, 15, 15, 20], k=TASKS)
    for mode in modes:
        load.submit(mode)
        time.sleep(0.08)  # ~10 submits/s, so faults land while work is in flight
    wait_for(chaotic.enough, 120, "faults of every kind")
    stop.set()
    chaotic.join(timeout=180)
    assert chaotic.error is None, chaotic.error
    for key in [*WORKERS, "api"]:  # everything is running again
        assert chaos.procs[key].poll() is None, chaos.log(key)
    chaos.wait_healthy(60)  # the last fault may have been an API kill: it is listening again

    def all_stopped() -> list[dict] | None:
        docs = [chaos.get(task_id) for task_id in load.accepted]
        return docs if all(d["task_status"] in STOPPED for d in docs) else None

    docs = wait_for(all_stopped, 240, "every accepted task to reach a terminal state", interval=1)
    settled = time.monotonic()

    # Nothing unaccepted was stored; everything accepted ended as the saga says.
    stored = {t["task_id"] for t in chaos.http.get(chaos.url + "/api/tasks", params={"limit": 1000}).json()["tasks"]}
    assert stored == set(load.accepted)
    by_id = {d["task_id"]: d for d in docs}
    wrong = {t: (m, by_id[t]["task_status"]) for t, m in load.accepted.items() if by_id[t]["task_status"] != MODES[m][1]}
    assert not wrong, wrong

    # The quota ledger balances to the unit: exactly one deduction per success.
    successes = [t for t, m in load.accepted.items() if m == "ok"]
    after = resource.quota(settings)
    for name in ("Cpu", "Memory", "Storage"):
        assert after[name]["used"] - before[name]["used"] == len(successes), name
    ledger = Counter((row["reservation"], row["kind"]) for row in resource.ledger(settings, limit=10_000))
    for task_id, mode in load.accepted.items():
        deducted, restored = ledger[(task_id, "deduct")], ledger[(task_id, "restore")]
        assert deducted <= 1 and restored <= 1, task_id
        assert (deducted - restored) == (1 if mode == "ok" else 0), (task_id, mode)

    # Instances exist exactly for the successes; each failed task reported once.
    instances = {i["task_id"] for i in mysql.instances(settings)}
    assert instances == set(successes)
    events = Counter(e["task_id"] for e in monitor.events(settings) if e["kind"] == "event")
    assert all(events[t] == 1 for t, m in load.accepted.items() if m != "ok"), events
    assert all(events[t] == 0 for t in successes)

    stale = sum(chaos.log(k, tail=None).count("stale step message ignored") for k in WORKERS)
    expired = sum(1 for d in docs for a in d["attempts"] if a["outcome"] == "expired")
    slowest = max(d["time_end"] - d["time_create"] for d in docs)
    figures = (
        f"\nchaos soak: {len(load.accepted)} tasks accepted ({load.retries} submit retries), "
        f"{sum(1 for d in docs if d['task_status'] == 0)} succeeded, "
        f"{sum(1 for d in docs if d['task_status'] == 4)} compensated; "
        f"kills {dict(chaotic.kills)}, RabbitMQ restarts {chaotic.broker_restarts}; "
        f"stale or duplicate messages dropped {stale}, "
        f"attempts expired by the sweep {expired}; slowest task {slowest:.1f}s; "
        f"all terminal {settled - chaotic.last_fault:.1f}s after the last fault; "
        f"run {settled - started:.0f}s"
    )
    with capsys.disabled():  # the figures belong in the test run's output
        print(figures)
