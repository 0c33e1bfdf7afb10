"""`asyncflow up` supervises its parts: it says "is up" only once all of them answer, refuses a
taken port before starting anything, and killed with SIGKILL, takes its parts with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.storage import open_store
from shared.storage.sql_processes import SqlProcessStore
from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import Stack

pytestmark = pytest.mark.e2e


def children_of(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def three_or_none(pids: set[int]) -> set[int] | None:
    return pids if len(pids) >= 3 else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead: it waits only for its parent to read its status.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_children_of_up_die_with_it_even_on_sigkill(tmp_path: Path) -> None:
    with open_stack("embedded", tmp_path, groups=None) as stack:
        up = stack.procs["up"]
        parts = wait_for(lambda: three_or_none(children_of(up.pid)), 30, "api, scheduler and worker to start")
        up.send_signal(signal.SIGKILL)  # the main process only, as `kill -9 <pid>` does
        up.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in parts), 30, f"the parts of up ({sorted(parts)}) to stop")


GATED_FLOWS = """
modules:
  gated: {import: gatemod}
  monitor: {import: modules.monitor}
flows:
  gated_one:
    steps:
      - normal: {module: gated, command: step, timeout: 10}
"""


def live_roles(stack: Stack, children: set[int]) -> set[str]:
    """The roles whose registry row (shared.presence) a child of `up` keeps."""
    store = SqlProcessStore(open_store(f"sqlite:///{stack.home / 'asyncflow.sqlite'}"))
    try:
        return {r.role for r in store.list() if r.stopped_at is None and r.pid in children}
    finally:
        store.sql.engine.dispose()


def test_up_says_it_is_up_only_once_every_part_answers(tmp_path: Path) -> None:
    """The worker is held in its start-up: the API and the scheduler answer, yet `up` is not up."""
    flows, gate = tmp_path / "flows.yaml", tmp_path / "gate"
    flows.write_text(GATED_FLOWS)
    env = {"ASYNCFLOW_FLOWS": str(flows), "GATEMOD_OPEN": str(gate), "ASYNCFLOW_HEARTBEAT_INTERVAL": "0.5"}
    with open_stack("embedded", tmp_path, env=env, groups=None) as stack:  # returns once /healthz answers
        up = stack.procs["up"]
        wait_for(lambda: "scheduler" in live_roles(stack, children_of(up.pid)), 30, "the scheduler to register")
        assert "worker" not in live_roles(stack, children_of(up.pid))  # it waits at the gate
        assert "asyncflow is up" not in stack.log("up", tail=None)
        gate.touch()
        wait_for(lambda: "asyncflow is up" in stack.log("up", tail=None), 30, "up to say it is up")
        assert {"scheduler", "worker"} <= live_roles(stack, children_of(up.pid))
        assert stack.run_cli("submit", "gated_one", "--wait", timeout=60).returncode == 0


def test_a_second_up_on_a_taken_port_says_so_at_once(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCFLOW_")}
    env |= {"ASYNCFLOW_HOME": str(tmp_path / "home"), "ASYNCFLOW_FLOWS": str(Path("flows.yaml").resolve())}
    with socket.socket() as taken:  # what a running `up` holds
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "asyncflow", "up", "--port", str(port)],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )
        took = time.monotonic() - started
    assert second.returncode == 1, second.stderr
    assert f"the API cannot listen on 127.0.0.1:{port}" in second.stderr
    assert f"asyncflow up --port {port + 1}" in second.stderr
    assert took < 8, f"refused only after {took:.1f}s"
    # Nothing was started: no migration ran, no part logged a line.
    assert not (tmp_path / "home" / "asyncflow.sqlite").exists()
    assert "api[" not in second.stderr and "is up" not in second.stderr


def test_a_worker_killed_under_up_is_started_again_and_its_long_step_recovers(tmp_path: Path) -> None:
    """kill -9 of the worker during a ten-minute step: `up` starts it again, and the attempt
    whose heartbeats stopped runs again, long before its timeout."""
    gate = tmp_path / "go"
    env = {"ASYNCFLOW_HEARTBEAT_INTERVAL": "1"}
    with open_stack("embedded", tmp_path, env=env, groups=None) as stack:
        up = stack.procs["up"]
        wait_for(lambda: "is up" in stack.log("up"), 60, "up to be up")
        task_id = stack.submit("long", {"wait_for_file": {"0": str(gate)}})["task_id"]
        wait_for(lambda: (stack.get(task_id)["attempts"] or [{}])[-1].get("heartbeat_at"), 30, "a heartbeat")
        [worker] = [p for p in children_of(up.pid) if "worker" in Path(f"/proc/{p}/cmdline").read_text()]
        for pid in children_of(worker) | {worker}:
            os.kill(pid, signal.SIGKILL)  # the worker and its pool, mid-step
        wait_for(lambda: "worker started again" in stack.log("up"), 30, "up to start the worker again")
        gate.touch()
        doc = stack.wait_stopped(task_id, timeout=60)
        assert doc["task_status"] == 0, doc
        lost, rerun = doc["attempts"]
        assert lost["error"].startswith("worker lost: no heartbeat") and rerun["outcome"] == "succeeded"
        assert up.poll() is None  # up kept running
