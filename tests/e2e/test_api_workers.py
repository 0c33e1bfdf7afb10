"""`asyncflow api --workers N`: several API processes on one port, one /metrics."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.testing import wait_for
from tests.e2e.stack import SUPPORT, Stack

pytestmark = pytest.mark.e2e


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Stack]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCFLOW_")}
    stack = Stack("api-workers", tmp_path, env=env, worker_groups=[])
    stack.env.update(
        ASYNCFLOW_HOME=str(tmp_path), ASYNCFLOW_FLOWS=str(SUPPORT / "flows.yaml"), ASYNCFLOW_HEARTBEAT_INTERVAL="0.5"
    )
    assert stack.run_cli("db", "upgrade").returncode == 0
    stack.spawn("api", "api", "--port", str(stack.port), "--workers", "2")
    try:
        wait_for(stack._healthy, 60, "the API to answer /healthz")
        yield stack
    finally:
        stack.stop()


def test_two_api_processes_serve_one_port_and_their_metrics_add_up(api: Stack) -> None:
    # The fixture waited for one process to answer; the other may still be starting.
    wait_for(
        lambda: len(set(re.findall(r"api\[(\d+)\].*Started server process", api.log("api", tail=None)))) == 2,
        60,
        "both API processes to start",
    )
    # Enough connections that both processes accept some (each is a new connection).
    for _ in range(40):
        response = api.http.post(f"{api.url}/api/tasks", json={"flow": "noop", "parameters": {}})
        assert response.status_code == 201, response.text
    # Whichever process took each request, /metrics counts all of them: the other
    # process's counts as of its last registry renewal (every heartbeat interval).
    wait_for(
        lambda: 'asyncflow_tasks_submitted_total{flow="noop"} 40.0' in api.http.get(f"{api.url}/metrics").text,
        30,
        "both API processes' submissions in /metrics",
    )
