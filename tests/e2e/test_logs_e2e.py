"""JSON logs from real processes: every line of a worker's stderr is one JSON object, and
the lines about a task's steps (ours, the module's own, what it prints, Celery's
"received" and "succeeded" in Celery's pool, from the worker and from its pool
process, and the worker's report of a killed pool process) carry the fields of the
attempt they are about."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import open_stack

pytestmark = pytest.mark.e2e

MODULE = '''
import logging
import os
import signal

from shared.module import Module

logmod = Module("logmod")
log = logging.getLogger("logmod")


@logmod.command("work")
def work(ctx):
    log.info("working on step %d", ctx.cursor)
    print(f"printed by step {ctx.cursor}")  # becomes a log line too
    return {}


@logmod.command("die_once")
def die_once(ctx):
    if ctx.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the pool process: its worker reports the loss
    return work(ctx)
'''

FLOWS = """
modules:
  logmod: {import: logmod}
flows:
  logged:
    steps:
      - normal: {module: logmod, command: work, timeout: 20}
      - normal: {module: logmod, command: die_once, timeout: 20, retry: 1, max_retry_interval: -0.2}
"""

ATTEMPT_KEYS = ("task_id", "flow", "step", "seq", "attempt", "module", "command")


def json_lines(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    assert lines, f"{path} is empty"
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line in {path.name}: {line!r}") from None
    return parsed


@pytest.mark.parametrize("pool", ["kombu", "celery"])
def test_worker_lines_are_json_and_carry_the_attempt(tmp_path: Path, pool: str) -> None:
    (tmp_path / "logmod.py").write_text(MODULE)
    (tmp_path / "flows.yaml").write_text(FLOWS)
    env = {
        "ASYNCFLOW_LOG_FORMAT": "json",
        "ASYNCFLOW_FLOWS": str(tmp_path / "flows.yaml"),
        "ASYNCFLOW_ALERT_COMMAND": "",
        "ASYNCFLOW_WORKER_POOL": pool,
    }
    stderr = tmp_path / "worker.err"
    with open_stack("embedded", tmp_path, env=env, groups=[]) as stack:
        # The worker with its stderr apart: Celery's banner goes to stdout.
        with open(tmp_path / "worker.out", "wb") as out, open(stderr, "wb") as err:
            stack.procs["worker"] = subprocess.Popen(
                [sys.executable, "-m", "asyncflow", "worker", "logmod", "-c", "1"],
                env=stack.env, stdout=out, stderr=err, cwd=tmp_path, start_new_session=True,
            )
        task_id = stack.submit("logged")["task_id"]
        doc = stack.wait_stopped(task_id, timeout=30)
        assert doc["task_status"] == 0, doc
    # The stack is stopped: every line, shutdown included, has been written.

    lines = json_lines(stderr)
    assert {line["process"] for line in lines} == {"worker"}
    assert all(line["time"].endswith("Z") and line["level"] and line["logger"] for line in lines)
    pids = {line["pid"] for line in lines}
    assert len(pids) >= 2, "lines from the worker and from its pool process"

    about_task = [line for line in lines if line.get("task_id") == task_id]
    for line in about_task:
        assert all(key in line for key in ATTEMPT_KEYS), line
        assert (line["flow"], line["module"]) == ("logged", "logmod"), line

    def attempts(logger: str, text: str) -> list[tuple[int, int, str]]:
        """(step, attempt, command) of the lines about the task from ``logger`` saying ``text``."""
        return sorted(
            (line["step"], line["attempt"], line["command"])
            for line in about_task
            if line["logger"] == logger and text in line["message"]
        )

    ran = [(0, 1, "work"), (1, 2, "die_once")]
    lost = [(1, 1, "die_once")]
    # Step 1's first attempt ran in the delivery of step 0 (its module's next step):
    # no message of its own was received, and that delivery never returned. Its
    # lines, and the report of its loss, still carry its own fields.
    assert attempts("logmod", "working on step") == ran
    assert attempts("shared.consumer", "step attempt succeeded in") == ran
    assert attempts("shared.consumer", "step attempt lost") == lost
    if pool == "kombu":
        assert attempts("printed", "printed by step") == ran
        # The killed consumer process: the worker's main process reports the attempt it ran.
        assert attempts("shared.messaging.consumers", "ended during a step: worker process lost") == lost
        (report,) = [line for line in about_task if line["logger"] == "shared.messaging.consumers"]
        assert report["pid"] not in {line["pid"] for line in about_task if line["logger"] == "logmod"}
        starting = [line for line in lines if line["message"].startswith("consuming ")]
    else:
        assert attempts("celery.worker.strategy", "received") == ran
        assert attempts("celery.app.trace", "succeeded") == [(1, 2, "die_once")]
        assert attempts("celery.redirected", "printed by step") == ran
        assert attempts("celery.worker.request", "WorkerLostError") == lost
        (error,) = [line for line in about_task if line["logger"] == "celery.worker.request"]
        assert "WorkerLostError" in error["exception"]
        assert any("exited with" in line["message"] for line in lines if line["logger"] == "multiprocessing")
        # Celery's lines come from two processes: "received" from the worker's main one.
        received = {line["pid"] for line in about_task if "received" in line["message"]}
        succeeded = {line["pid"] for line in about_task if "succeeded" in line["message"]}
        assert not received & succeeded
        starting = [line for line in lines if line["message"].endswith(" ready.")]
    # Lines about no attempt carry none of its fields.
    assert starting and not any(key in starting[0] for key in ATTEMPT_KEYS)

    # The API and the scheduler write JSON too (stdout and stderr together).
    for key in ("api", "scheduler"):
        assert {line["process"] for line in json_lines(tmp_path / f"{key}.log")} == {key}
