"""An operator fixes a task that failed on a bad parameter, with the real CLI against `asyncflow up`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shared.testing import wait_for
from tests.e2e.conftest import open_stack

pytestmark = pytest.mark.e2e


def test_a_bad_parameter_is_fixed_with_retry_param_and_the_history_shows_it(tmp_path: Path) -> None:
    with open_stack("embedded", tmp_path, env={"ASYNCFLOW_HEARTBEAT_INTERVAL": "0.3"}, groups=None) as stack:
        # Step 1 of noop fails for as long as the parameter says so.
        submitted = stack.run_cli("submit", "noop", "--param", "fail_at=[1]", "--param", "Cpu=4", "--wait")
        assert submitted.returncode == 1, submitted.stdout + submitted.stderr
        task_id = submitted.stdout.split()[1]
        assert "status 4 failed (compensated)" in submitted.stdout
        assert "rollback" not in submitted.stdout  # noop has none to run

        # The fix; and step 1 now works until a file appears, reporting its progress meanwhile.
        signal_file = tmp_path / "go"
        wait = json.dumps({"1": str(signal_file)})
        retried = stack.run_cli("retry", task_id, "--param", "fail_at=[]", "--param", f"wait_for_file={wait}")
        assert retried.returncode == 0, retried.stdout + retried.stderr
        assert retried.stdout.splitlines()[1:] == ["  fail_at: [1] → []", f"  wait_for_file: (unset) → {wait}"]

        # Watched through a pipe, not a terminal: one line per change, never the whole task again.
        watch = subprocess.Popen([sys.executable, "-m", "asyncflow", "status", task_id, "--watch"],
                                 env=stack.env, cwd=stack.home, stdout=subprocess.PIPE, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in watch.stdout or ()))
        reader.start()
        try:
            wait_for(lambda: any("] progress waiting_for=" in line for line in lines), 20, "progress in the watch")
            signal_file.touch()
            assert watch.wait(timeout=20) == 0
        finally:
            watch.kill()
            reader.join()
        assert lines[0] == f"task {task_id}  flow noop  status 2 running", lines
        assert lines[-1] == "status 0 success", lines
        assert sum(line.startswith("task ") for line in lines) == 1
        assert all(re.match(r"  \[\d\] |status \d", line) for line in lines[1:]), lines
        assert "  [1] beta.step  succeeded" in "\n".join(lines)

        doc = stack.get(task_id)
        assert doc["task_status"] == 0 and doc["parameters"]["fail_at"] == [] and doc["parameters"]["Cpu"] == 4
        (event,) = doc["events"]
        assert (event["kind"], event["actor"]) == ("retry", None)
        assert event["detail"]["parameters"]["fail_at"] == {"old": [1], "new": []}
        shown = stack.run_cli("status", task_id)
        assert re.search(r"  history:\n    \S+ \S+ \S+  retry by anonymous, from step 1: fail_at: \[1\] → \[\]; ",
                         shown.stdout), shown.stdout

        listed = stack.run_cli("list", "--flow", "noop", "--status", "success")
        header, row = listed.stdout.splitlines()
        assert header.split() == ["TASK", "FLOW", "STATUS", "CREATED", "DURATION", "USER", "MESSAGE"]
        assert row.split()[:3] == [task_id, "noop", "success"]
        assert json.loads(stack.run_cli("list", "--json").stdout)[0]["task_id"] == task_id
