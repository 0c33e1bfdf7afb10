"""`asyncflow up` supervises its parts: killed with SIGKILL, it takes them with it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from shared.testing import wait_for
from tests.e2e.conftest import open_stack

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
