"""flows.yaml reloaded without a restart: `asyncflow flows reload` and SIGHUP, through real processes.

A flow added to the file is served once reloaded; an invalid file is refused and
the processes keep the flows they had, including an API worker that uvicorn
starts again after it died.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import SUPPORT, Stack

pytestmark = pytest.mark.e2e

ADDED = {
    "parameters": {"type": "object", "required": ["Size"], "properties": {"Size": {"type": "integer", "minimum": 1}}},
    "steps": [
        {"normal": {"module": "alpha", "command": "step", "timeout": 20}},
        {"normal": {"module": "beta", "command": "step", "timeout": 20}},
    ],
}
# Wrong in a way only the parameters declaration is: the file is otherwise fine.
BROKEN = ADDED | {"parameters": {"type": "object", "properties": {"Size": {"type": "integr"}}}}


def write_flows(path: Path, **extra: Any) -> None:
    data = yaml.safe_load((SUPPORT / "flows.yaml").read_text(encoding="utf-8"))
    data["flows"].update(extra)
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def submit(stack: Stack, flow: str, parameters: dict[str, Any]) -> httpx.Response:
    return stack.http.post(f"{stack.url}/api/tasks", json={"flow": flow, "parameters": parameters}, timeout=10)


def count(stack: Stack, key: str, text: str) -> int:
    return stack.log(key, tail=None).count(text)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[Stack, Path]]:
    flows = tmp_path / "flows.yaml"
    write_flows(flows)
    (tmp_path / "home").mkdir()
    with open_stack("embedded", tmp_path / "home", {"ASYNCFLOW_FLOWS": str(flows)}, groups=None) as stack:
        yield stack, flows


def test_up_serves_a_flow_added_by_a_reload_and_refuses_a_broken_file(up: tuple[Stack, Path]) -> None:
    stack, flows = up
    assert submit(stack, "added", {"Size": 1}).status_code == 404

    write_flows(flows, added=ADDED)
    done = stack.run_cli("flows", "reload")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"asyncflow up (pid {stack.procs['up'].pid}) signalled to reload {flows}")
    assert "api (pid " in done.stdout and "scheduler (pid " in done.stdout

    created = wait_for(lambda: (r := submit(stack, "added", {"Size": 2})).status_code == 201 and r, 30, "the new flow")
    assert stack.wait_stopped(created.json()["task_id"])["task_status"] == 0
    refused = submit(stack, "added", {"Size": "two"})
    assert refused.status_code == 422
    assert refused.json()["detail"] == [{"field": "parameters.Size", "problem": "'two' is not of type 'integer'"}]
    # The API and the scheduler each reloaded (the worker needs no reload).
    wait_for(lambda: count(stack, "up", "flows reloaded from") == 2, 30, "the api and the scheduler to reload")

    write_flows(flows, added=BROKEN)
    refused_reload = stack.run_cli("flows", "reload")
    assert refused_reload.returncode == 1
    assert refused_reload.stderr.strip() == (
        f"{flows}: flow 'added': parameters.properties.Size.type: "
        "'integr' is not one of ['array', 'boolean', 'integer', 'null', 'number', 'object', 'string']"
    )
    assert refused_reload.stdout == ""

    # SIGHUP straight to `up`, as `kill -HUP` does: each part refuses the file and keeps its flows.
    stack.procs["up"].send_signal(signal.SIGHUP)
    wait_for(lambda: count(stack, "up", "flows.yaml not reloaded") == 2, 30, "the api and the scheduler to refuse")
    assert submit(stack, "added", {"Size": 3}).status_code == 201
    assert submit(stack, "added", {"Size": 0}).status_code == 422
    assert stack._healthy()  # every part still runs


def uvicorn_workers(supervisor: int, count: int, without: int = 0) -> set[int] | None:
    """The pids of the supervisor's ``count`` API workers (leaving out ``without``), or None."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(supervisor)], capture_output=True, text=True).stdout
    pids = {int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line} - {without}
    return pids if len(pids) == count else None


def test_every_api_worker_reloads_and_one_started_again_reads_the_last_good_file(tmp_path: Path) -> None:
    flows = tmp_path / "flows.yaml"
    write_flows(flows)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCFLOW_")}
    stack = Stack("api-workers", tmp_path, env=env, worker_groups=[])
    stack.env.update(ASYNCFLOW_HOME=str(tmp_path), ASYNCFLOW_FLOWS=str(flows))
    assert stack.run_cli("db", "upgrade").returncode == 0
    api = stack.spawn("api", "api", "--port", str(stack.port), "--workers", "2")
    try:
        wait_for(stack._healthy, 60, "the API to answer /healthz")
        workers = wait_for(lambda: uvicorn_workers(api.pid, 2), 30, "two API workers")

        write_flows(flows, added=ADDED)
        done = stack.run_cli("flows", "reload", "--pid", str(api.pid))
        assert done.returncode == 0, done.stderr
        wait_for(lambda: count(stack, "api", "flows reloaded from") == 3, 30, "the supervisor and both workers")
        # Each request on a new connection: both workers answer some.
        assert all(submit(stack, "added", {"Size": 1}).status_code == 201 for _ in range(20))

        write_flows(flows, added=BROKEN)
        api.send_signal(signal.SIGHUP)
        wait_for(lambda: "flows.yaml not reloaded" in stack.log("api", tail=None), 30, "the supervisor to refuse")
        killed = min(workers)
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: uvicorn_workers(api.pid, 2, killed), 60, "uvicorn to start a worker in place of the killed one")
        wait_for(stack._healthy, 60, "the API to answer /healthz")
        assert all(submit(stack, "added", {"Size": 1}).status_code == 201 for _ in range(20))
        assert api.poll() is None
    finally:
        stack.stop()
