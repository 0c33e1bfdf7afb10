"""Outages of the broker and of the database under a running PostgreSQL + RabbitMQ stack.

These tests stop RabbitMQ and PostgreSQL for a few seconds (everything else on
the machine sees it too), so the suite runs them last and on their own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import Stack
from tests.e2e.test_faults import BETA, TIMING, runs_of, started

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.outage]


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("outage")
    with open_stack("postgres-rabbitmq", home, TIMING, [["alpha"], ["beta", "monitor"]]) as stack:
        yield stack


def test_broker_outage_intake_keeps_accepting_and_dispatch_resumes(
    outage: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        pytest.skip("rabbitmqctl is needed to stop RabbitMQ")
    subprocess.run([ctl, "stop_app"], check=True, capture_output=True, timeout=120)
    try:
        accepted, took = [], []
        for _ in range(5):
            t0 = time.monotonic()
            accepted.append(outage.submit("short", {})["task_id"])
            took.append(time.monotonic() - t0)
        assert max(took) < 10  # accepted without waiting for the broker
    finally:
        subprocess.run([ctl, "start_app"], check=True, capture_output=True, timeout=120)
    back = time.monotonic()
    for task_id in accepted:
        assert outage.wait_stopped(task_id, timeout=90)["task_status"] == 0
        assert runs_of(outage, task_id) == [(0, 0, 1), (1, 0, 1)]
    figures = (
        f"\nbroker down: {len(accepted)} submits accepted in {', '.join(f'{t * 1000:.0f}' for t in took)} ms; "
        f"all done {time.monotonic() - back:.1f}s after the broker returned"
    )
    with capsys.disabled():
        print(figures)


def test_database_outage_503_then_recovery_without_restart(outage: Stack, tmp_path: Path) -> None:
    cluster = _pg_cluster()
    gate = tmp_path / "go"
    task = outage.submit("short", {"wait_for_file": {"1": str(gate)}})
    started(outage, task["task_id"], 1)
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", *cluster, "stop", "-m", "fast"],
                   check=True, capture_output=True, timeout=120)
    try:
        response = outage.http.get(f"{outage.url}/api/tasks/{task['task_id']}", timeout=10)
        assert response.status_code == 503
        assert "database is unavailable" in response.json()["error"]
        refused = outage.http.post(outage.url + "/api/tasks", json={"flow": "short"}, timeout=10)
        assert refused.status_code == 503
        gate.touch()  # the handler finishes while the database is down
        wait_for(lambda: "storing the outcome again" in outage.log(BETA, tail=None), 30, "the outcome retries")
    finally:
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", *cluster, "start"],
                       check=True, capture_output=True, timeout=120)
    doc = outage.wait_stopped(task["task_id"], timeout=90)
    assert doc["task_status"] == 0, doc
    # The outcome was kept and stored once the database came back: no second run.
    assert [a["outcome"] for a in doc["attempts"] if a["cursor"] == 1] == ["succeeded"]
    later = outage.submit("short", {})
    assert outage.wait_stopped(later["task_id"])["task_status"] == 0


def _pg_cluster() -> list[str]:
    if shutil.which("pg_ctlcluster") is None or not Path("/etc/postgresql").is_dir():
        pytest.skip("pg_ctlcluster is needed to stop PostgreSQL")
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    return [version, "main"]
