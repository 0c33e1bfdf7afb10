"""`asyncflow submit/status/list/retry/resume`: the CLI against the real API and services, in-process.

The CLI's requests go to the app through a mock transport; the test modules
(tests/support/testmod.py) run in this process through the real step consumer.
Between two fetches of a following command (--wait, --watch), one step message
is delivered and the clock moves one second, so each command sees the task
progress exactly as a worker would make it. Local time is America/New_York.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from rich.console import Console

from asyncflow import cli, schedules_view, task_view
from asyncflow.client import ApiClient
from oss_api.testing import TestClient, open_client
from shared.consumer import StepConsumer
from shared.flows import load_flows
from shared.saga import Heartbeat, Started, Succeeded
from shared.testing import InProcess

SUPPORT = Path(__file__).resolve().parents[1] / "support"
NOW = 1_700_000_000.0  # 2023-11-14 17:13:20 -0500 in New York

FLOWS = """
modules:
  alpha: {import: testmod}
  beta: {import: testmod}
flows:
  two:
    steps:
      - normal: {module: alpha, command: step, timeout: 20}
        rollback: {module: alpha, command: undo, timeout: 20}
      - normal: {module: beta, command: step, timeout: 20}
        rollback: {module: beta, command: undo, timeout: 20}
  plain:
    steps:
      - normal: {module: alpha, command: step, timeout: 20}
  sized:
    parameters:
      type: object
      properties:
        Cpu: {type: integer, minimum: 1, maximum: 64}
        fail_at: {type: array}
      required: [Cpu]
    steps:
      - normal: {module: alpha, command: step, timeout: 20}
        rollback: {module: alpha, command: undo, timeout: 20}
"""


@dataclass
class Cli:
    app: InProcess
    http: TestClient
    consumer: StepConsumer

    def __call__(self, *args: str) -> Result:
        return CliRunner().invoke(cli.main, list(args))

    def ok(self, *args: str) -> str:
        result = self(*args)
        assert result.exit_code == 0, result.output
        return result.stdout

    def doc(self, task_id: str) -> dict[str, Any]:
        r = self.http.get(f"/api/tasks/{task_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def submit(self, flow: str, **parameters: Any) -> str:
        self.app.clock.advance(1.0)
        r = self.http.post("/api/tasks", json={"flow": flow, "parameters": parameters})
        assert r.status_code == 201, r.text
        return str(r.json()["task_id"])

    def step(self) -> bool:
        """Deliver one step message, a second later; False when none is left."""
        if not self.app.publisher.messages:
            return False
        self.app.clock.advance(1.0)
        self.consumer.handle(self.app.publisher.messages.popleft())
        return True

    def drain(self) -> None:
        while self.step():
            pass


@pytest.fixture
def new_york() -> Iterator[None]:
    before = os.environ.get("TZ")
    os.environ["TZ"] = "America/New_York"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_york: None) -> Iterator[Cli]:
    monkeypatch.syspath_prepend(str(SUPPORT))
    testmod = importlib.import_module("testmod")
    (tmp_path / "flows.yaml").write_text(FLOWS)
    app = InProcess(load_flows(tmp_path / "flows.yaml"), tmp_path)
    consumer = StepConsumer(app.runtime.service, {"alpha": testmod.alpha, "beta": testmod.beta},
                            app.runtime.settings, clock=app.clock)
    with open_client(app.runtime) as http:

        def forward(request: httpx.Request) -> httpx.Response:
            r = http.request(request.method, request.url.path, params=request.url.params,
                             headers=request.headers, content=request.content)
            return httpx.Response(r.status_code, headers=r.headers, content=r.content)

        monkeypatch.setattr(cli, "_client", lambda: ApiClient("http://asyncflow", transport=httpx.MockTransport(forward)))
        monkeypatch.setattr(schedules_view, "clock", app.clock)
        runner = Cli(app, http, consumer)
        def deliver(_seconds: float) -> None:
            assert runner.step(), "the command waits for a task that nothing can move any more"

        monkeypatch.setattr(task_view, "pause", deliver)
        yield runner


def rows(output: str) -> list[list[str]]:
    return [re.split(r" {2,}", line.strip()) for line in output.splitlines()]


# --- list ---------------------------------------------------------------------------------


def test_list_is_a_table_with_a_header_local_times_and_durations(run: Cli) -> None:
    first = run.submit("plain")
    run.drain()  # each message a second after the one before
    second = run.submit("two", fail_at=[1])
    run.drain()
    third = run.submit("plain")
    table = rows(run.ok("list"))
    assert table[0] == ["TASK", "FLOW", "STATUS", "CREATED", "DURATION", "USER", "MESSAGE"]
    assert [r[:6] for r in table[1:]] == [
        [third, "plain", "pending", "2023-11-14 17:13:28", "-", "-"],
        [second, "two", "failed", "2023-11-14 17:13:23", "3.0s", "-"],  # 4 messages, from 17:13:24 to :27
        [first, "plain", "success", "2023-11-14 17:13:21", "0.0s", "-"],
    ]
    assert table[2][6].startswith("step 1 (beta.step) failed: RuntimeError: forced failure")


def test_list_filters_by_flow_status_by_name_or_number_and_limit(run: Cli) -> None:
    done = run.submit("plain")
    run.drain()
    waiting = run.submit("plain")
    other = run.submit("two")
    assert [r[0] for r in rows(run.ok("list", "--flow", "plain"))[1:]] == [waiting, done]
    assert [r[0] for r in rows(run.ok("list", "--status", "success"))[1:]] == [done]
    assert [r[0] for r in rows(run.ok("list", "--status", "1"))[1:]] == [other, waiting]
    assert [r[0] for r in rows(run.ok("list", "--limit", "1"))[1:]] == [other]
    assert run.ok("list", "--status", "rolling-back") == "no tasks match\n"
    result = run("list", "--status", "broken")
    assert result.exit_code == 2 and "'broken' is not a status (success (0), pending (1)" in result.output
    docs = json.loads(run.ok("list", "--json", "--flow", "two"))
    assert [d["task_id"] for d in docs] == [other]


def test_every_option_of_list_status_retry_and_resume_has_help(run: Cli) -> None:
    for command in ("list", "status", "retry", "resume", "submit"):
        ctx = cli.main.make_context("asyncflow", [command, "--help"], resilient_parsing=True)
        sub = cli.main.get_command(ctx, command)
        assert sub is not None
        for param in sub.params:
            if param.param_type_name == "option" and param.name != "help":
                assert getattr(param, "help", None), f"{command} {param.opts} has no help"
    assert "--status STATUS" in run.ok("list", "--help")


# --- retry / resume with corrected parameters ---------------------------------------------------------


def test_retry_with_param_fixes_a_bad_parameter_and_the_history_says_so(run: Cli) -> None:
    task_id = run.submit("two", fail_at=[0], Cpu=4)
    run.drain()
    assert run.doc(task_id)["status_name"] == "failed"
    out = run.ok("retry", task_id, "--param", "fail_at=[]", "-p", "Zone=eu")
    assert out.splitlines() == [
        f"task {task_id}: retry accepted, status 2 running",
        "  fail_at: [0] → []",
        '  Zone: (unset) → "eu"',
    ]
    run.drain()
    doc = run.doc(task_id)
    assert doc["status_name"] == "success"
    assert {k: v for k, v in doc["parameters"].items() if not k.startswith("done_")} == {
        "fail_at": [], "Cpu": 4, "Zone": "eu"}
    assert {"done_0", "done_1"} <= set(doc["parameters"])
    (event,) = doc["events"]
    assert (event["kind"], event["actor"], event["detail"]) == (
        "retry", None, {"step": 0, "parameters": {"fail_at": {"old": [0], "new": []}, "Zone": {"new": "eu"}}}
    )
    status = run.ok("status", task_id)
    assert "  history:\n    2023-11-14 17:13:23 -0500  retry by anonymous, from step 0: fail_at: [0] → []; " \
           'Zone: (unset) → "eu"' in status


def test_retry_param_is_checked_against_the_flow_declaration(run: Cli) -> None:
    task_id = run.submit("sized", Cpu=4, fail_at=[0])
    run.drain()
    result = run("retry", task_id, "--param", "Cpu=many", "--param", "fail_at=[]")
    assert result.exit_code == 1
    assert "Error: 422: invalid parameters for flow 'sized'" in result.output
    assert "  parameters.Cpu (--param): " in result.output
    doc = run.doc(task_id)
    assert (doc["status_name"], doc["parameters"]["Cpu"], doc["events"]) == ("failed", 4, [])
    # Not failed yet: the state is what is wrong, whatever the parameters.
    pending = run.submit("sized", Cpu=4)
    result = run("retry", pending, "--param", "Cpu=many")
    assert result.exit_code == 1 and "Error: 409: task" in result.output and "only failed or cancelled" in result.output


def test_resume_with_param_fixes_a_failed_rollback(run: Cli) -> None:
    task_id = run.submit("two", fail_at=[1], fail_rollback_at=[0])
    run.drain()
    assert run.doc(task_id)["status_name"] == "rollback_failed"
    out = run.ok("resume", task_id, "-p", "fail_rollback_at=[]")
    assert out.splitlines() == [f"task {task_id}: resume accepted, status 3 rolling back",
                                "  fail_rollback_at: [0] → []"]
    run.drain()
    doc = run.doc(task_id)
    assert doc["status_name"] == "failed"
    assert [(e["kind"], e["detail"]["step"]) for e in doc["events"]] == [("resume", 0)]
    # Without --param nothing is sent: the action as it always was.
    assert run("resume", task_id).output.startswith("Error: 409: ")


# --- following a task -----------------------------------------------------------------------------


def test_submit_wait_prints_changes_then_the_task_without_rollbacks_that_never_ran(run: Cli) -> None:
    result = run("submit", "two", "-p", "Cpu=4", "--wait")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    task_id = lines[0].split()[1]
    assert lines[:6] == [
        f"task {task_id} submitted (two)",
        "  [0] alpha.step  succeeded  0.0s",
        "status 2 running",
        "  [1] beta.step  succeeded  0.0s",
        "status 0 success",
        "",
    ]
    final = "\n".join(lines[6:])
    assert final.startswith(f"task {task_id}  flow two\n  status 0 success\n")
    assert "\n  steps:\n    [0] alpha.step  succeeded  0.0s\n    [1] beta.step  succeeded  0.0s\n  attempts:" in final
    assert "rollback" not in final  # none ran, none was due


def test_wait_on_a_failed_task_shows_the_rollbacks_that_ran_or_are_due_and_exits_1(run: Cli) -> None:
    task_id = run.submit("two", fail_at=[1])
    result = run("status", task_id, "--wait")
    assert result.exit_code == 1
    failure = "(RuntimeError: forced failure at step 1)"
    assert result.stdout.split("\n\n")[0].splitlines() == [
        f"task {task_id}  flow two  status 1 pending",
        "  [0] alpha.step  succeeded  0.0s",
        "status 2 running",
        "  [0] alpha.step  succeeded  0.0s  rollback alpha.undo: pending",  # due: the task rolls back
        f"  [1] beta.step  failed  0.0s  rollback beta.undo: pending  {failure}",
        "status 3 rolling back  (step 1 (beta.step) failed: RuntimeError: forced failure at step 1)",
        f"  [1] beta.step  failed  0.0s  rollback beta.undo: succeeded 0.0s  {failure}",
        "  [0] alpha.step  succeeded  0.0s  rollback alpha.undo: succeeded 0.0s",
        "status 4 failed (compensated)  (step 1 (beta.step) failed: RuntimeError: forced failure at step 1)",
    ]
    assert "    [0] alpha.step  succeeded  0.0s  rollback alpha.undo: succeeded 0.0s\n" in result.stdout


def test_watch_when_not_a_terminal_prints_only_what_changes(run: Cli) -> None:
    task_id = run.submit("two")
    run.step()  # step 0 done
    result = run("status", task_id, "--watch")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"task {task_id}  flow two  status 2 running",
        "  [0] alpha.step  succeeded  0.0s",
        "  [1] beta.step  succeeded  0.0s",
        "status 0 success",
    ]
    # Already over: where it stands, once.
    assert run.ok("status", task_id, "--watch").splitlines() == [
        f"task {task_id}  flow two  status 0 success",
        "  [0] alpha.step  succeeded  0.0s",
        "  [1] beta.step  succeeded  0.0s",
    ]


def test_watch_reports_the_running_attempts_progress(run: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    task_id = run.submit("plain")
    seq = run.doc(task_id)["current"]["seq"]
    run.app.publisher.messages.clear()  # this test plays the worker
    run.app.runtime.service.apply(task_id, Started(seq, heartbeats=True))
    progress = iter([{"copied": 10}, {"copied": 10}, {"copied": 80}])

    def beat(_seconds: float) -> None:
        value = next(progress, None)
        run.app.clock.advance(1.0)
        if value is None:
            run.app.runtime.service.apply(task_id, Succeeded(seq))
            return
        run.app.runtime.service.apply(task_id, Heartbeat(seq, value))

    monkeypatch.setattr(task_view, "pause", beat)
    out = run.ok("status", task_id, "--watch")
    assert out.splitlines() == [
        f"task {task_id}  flow plain  status 2 running",
        "  [0] alpha.step  running  0.0s",
        "  [0] progress copied=10",
        "  [0] progress copied=80",
        "  [0] alpha.step  succeeded  4.0s",
        "status 0 success",
    ]


def test_the_live_view_draws_steps_durations_timeline_and_the_running_attempt(run: Cli) -> None:
    task_id = run.submit("two", fail_at=[1])
    run.drain()
    run.ok("retry", task_id, "-p", "fail_at=[]")
    message = run.app.publisher.messages.popleft()  # a worker starts step 0 again and is still at it
    run.app.clock.advance(1.0)
    run.app.runtime.service.apply(task_id, Started(message.seq, heartbeats=True))
    seq = message.seq
    run.app.clock.advance(2.0)
    run.app.runtime.service.apply(task_id, Heartbeat(seq, {"rows": 1200}))
    run.app.clock.advance(1.0)
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(task_view.live_view(run.doc(task_id), run.app.clock.now))
    text = console.export_text()
    lines = text.splitlines()
    assert lines[0] == f"task {task_id}  flow two  status 2 running"
    assert lines[1].startswith("  created 2023-11-14 17:13:21 -0500  running for 7.0s")  # since its first start
    header = next(line for line in lines if line.startswith("#"))
    assert header.split() == ["#", "STEP", "STATE", "TRIES", "TOOK", "TIMELINE", "ROLLBACK", "NOW"]
    step0 = next(line for line in lines if line.startswith("0 "))
    assert "alpha.step" in step0 and "running" in step0 and "3.0s" in step0
    assert "attempt 1 for 3.0s, last heartbeat 1.0s ago, progress rows=1200" in step0
    assert "alpha.undo: pending" not in step0  # a retry reset it: no rollback due now
    bar = re.search(r"\|(.{24})\|", step0)
    assert bar is not None and bar.group(1).endswith("███") and bar.group(1).startswith(" ")


def test_watch_on_a_terminal_redraws_in_place(run: Cli) -> None:
    task_id = run.submit("two")
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=150, color_system=None)
    doc = task_view.watch_live(lambda: run.doc(task_id), console, interval=0)
    assert doc["status_name"] == "success"
    # Each drawing erases the one before (cursor up, erase line; six lines high) and takes its place.
    erase = "\r" + "\x1b[2K" + "\x1b[1A\x1b[2K" * 5
    frames = out.getvalue().split(erase)
    statuses = [re.search(r"status \d [a-z ]+", f).group(0) for f in frames]  # type: ignore[union-attr]
    assert statuses == ["status 1 pending", "status 2 running", "status 0 success", "status 0 success"]
    assert all(f.count(f"task {task_id}") == 1 for f in frames)
    last = frames[-1].splitlines()
    assert last[3].split() == ["#", "STEP", "STATE", "TRIES", "TOOK", "TIMELINE", "ROLLBACK", "NOW"]
    assert last[4].startswith("0  alpha.step  succeeded  1      0.0s  |█ ")
    assert last[5].startswith("1  beta.step   succeeded  1      0.0s  |") and last[5].rstrip().endswith("█|")
