"""A pull-mode module's steps worked by a plain-HTTP worker (curl + jq), between
push-mode steps run by Celery workers, through real processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.testing import wait_for
from tests.conftest import require_service
from tests.e2e.conftest import open_stack
from tests.e2e.stack import REPO, SUPPORT, Stack

pytestmark = pytest.mark.e2e

WORKER = REPO / "examples" / "dns_worker.sh"
NORMAL, ROLLBACK = 0, 1


class DnsWorker:
    def __init__(self, stack: Stack) -> None:
        self.records = stack.home / "records.txt"
        self.output = stack.home / "dns_worker.out"
        self.stack = stack
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.output, "ab") as out:
            self.proc = subprocess.Popen(
                [str(WORKER), self.stack.url, "dns", str(self.records)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its subshells and curl go with it
            )

    def stop(self) -> None:
        if self.proc is not None:
            # The whole group: a curl left running would still lease a step for a worker that is gone.
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def lines(self) -> list[str]:
        return self.records.read_text().splitlines() if self.records.exists() else []

    def ran(self, task_id: str) -> list[str]:
        """Commands the worker ran for ``task_id``, in order."""
        text = self.output.read_text() if self.output.exists() else ""
        return [line.split()[0] for line in text.splitlines() if f" {task_id}." in line]


@pytest.fixture(scope="module", params=["embedded", "postgres-rabbitmq"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    missing = [tool for tool in ("curl", "jq") if shutil.which(tool) is None]
    require_service("curl/jq", f"missing {', '.join(missing)}" if missing else None)
    env = {
        "ASYNCFLOW_FLOWS": str(SUPPORT / "pull_flows.yaml"),
        # An attempt whose worker vanished expires 1 s after its 5 s timeout.
        "ASYNCFLOW_EXPIRE_GRACE": "1",
    }
    home = tmp_path_factory.mktemp("pull-" + request.param)
    with open_stack(request.param, home, env=env, groups=[["alpha", "beta"]]) as s:
        yield s


@pytest.fixture
def dns(stack: Stack) -> Iterator[DnsWorker]:
    worker = DnsWorker(stack)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


def ran(stack: Stack, task_id: str) -> list[tuple[int, int]]:
    return [(e["cursor"], e["type"]) for e in stack.executions(task_id)]


def test_the_shell_worker_runs_the_pull_step_of_a_flow(stack: Stack, dns: DnsWorker) -> None:
    task = stack.submit("with_dns", {"Name": "db1"})
    doc = stack.wait_stopped(task["task_id"])
    assert doc["task_status"] == 0, doc
    assert doc["parameters"]["Record"] == "db1.example.internal"
    assert f"db1 {task['task_id']}" in dns.lines()
    assert dns.ran(task["task_id"]) == ["add_record"]
    assert ran(stack, task["task_id"]) == [(0, NORMAL), (2, NORMAL)]


def test_a_later_failure_is_compensated_by_the_shell_worker_too(stack: Stack, dns: DnsWorker) -> None:
    task = stack.submit("with_dns", {"Name": "db2", "fail_at": [2]})
    doc = stack.wait_stopped(task["task_id"])
    assert doc["task_status"] == 4, doc
    assert dns.ran(task["task_id"]) == ["add_record", "remove_record"]
    assert not any(line.startswith("db2 ") for line in dns.lines())
    assert ran(stack, task["task_id"]) == [(0, NORMAL), (2, NORMAL), (0, ROLLBACK)]
    assert [s["rollback_state"] for s in doc["steps"]][:2] == ["succeeded", "succeeded"]


def test_a_refusing_pull_step_is_retried_then_compensated(stack: Stack, dns: DnsWorker) -> None:
    task = stack.submit("with_dns", {"Name": "db3", "DnsFail": True})
    doc = stack.wait_stopped(task["task_id"])
    assert doc["task_status"] == 4, doc
    assert "registrar refused db3" in doc["task_message"]
    assert dns.ran(task["task_id"]) == ["add_record", "add_record", "remove_record"]  # retry: 1
    assert ran(stack, task["task_id"]) == [(0, NORMAL), (0, ROLLBACK)]


def test_a_worker_that_vanishes_with_the_lease_is_replaced_and_its_late_report_refused(
    stack: Stack, dns: DnsWorker
) -> None:
    dns.stop()
    task = stack.submit("with_dns", {"Name": "db4"})

    def hold() -> list[dict]:
        answer = stack.http.post(f"{stack.url}/v1/hold_tasks", json={"task_type": "dns"}, timeout=10).json()
        assert answer["code"] == 0, answer
        return answer["task_list"]

    (lost,) = wait_for(hold, 30, "the dns step to be leasable")
    dns.start()  # the step comes back to it after 5 s timeout + 1 s grace + 0.3 s backoff
    doc = stack.wait_stopped(task["task_id"], timeout=60)
    assert doc["task_status"] == 0, doc
    assert doc["steps"][1]["attempts"] == 2
    late = {"task_data": {"task_id": lost["task_id"], "status": 3, "task_content": "{}"}}
    answer = stack.http.post(f"{stack.url}/v1/set_task", json=late, timeout=10).json()
    assert answer["code"] == 3 and "over" in answer["msg"], answer


def test_the_module_is_listed_as_a_task_type(stack: Stack) -> None:
    listed = stack.http.get(f"{stack.url}/v1/get_task_schedule_cfg_list", timeout=10).json()
    assert any(t["task_type"] == "dns" and t["max_retry_num"] == 0 for t in listed["task_schedule_cfg_list"])
    assert Path(WORKER).stat().st_mode & 0o111
