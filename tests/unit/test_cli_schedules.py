"""`asyncflow schedule ...`: the CLI against the real API and schedule service, in-process.

The CLI's requests go to the app through a mock transport; time is a manual clock
(the service's and the CLI's "now"), and the leader scheduler is stepped by hand.
Local time is America/New_York (UTC-5 in November) so printed times are exact.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result

from asyncflow import cli, schedules_view
from asyncflow.client import ApiClient
from oss_api.testing import TestClient, open_client
from shared.flows import load_flows
from shared.testing import InProcess

SUPPORT = Path(__file__).resolve().parents[1] / "support"
NOW = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC = 17:13:20 -0500 in New York


@dataclass
class Cli:
    app: InProcess
    http: TestClient
    requests: list[httpx.Request]

    def __call__(self, *args: str, input: str | None = None) -> Result:
        return CliRunner().invoke(cli.main, ["schedule", *args], input=input)

    def ok(self, *args: str) -> str:
        result = self(*args)
        assert result.exit_code == 0, result.output
        return result.stdout

    def api(self, path: str) -> Any:
        r = self.http.get(path)
        assert r.status_code == 200, r.text
        return r.json()

    def step(self, seconds: float) -> None:
        self.app.clock.advance(seconds)
        self.app.runtime.scheduler.step()


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
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path)
    assert app.clock.now == NOW
    with open_client(app.runtime) as http:
        seen: list[httpx.Request] = []

        def forward(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            r = http.request(request.method, request.url.path, params=request.url.params,
                             headers=request.headers, content=request.content)
            return httpx.Response(r.status_code, headers=r.headers, content=r.content)

        monkeypatch.setattr(cli, "_client", lambda: ApiClient("http://asyncflow", transport=httpx.MockTransport(forward)))
        monkeypatch.setattr(schedules_view, "clock", app.clock)
        yield Cli(app, http, seen)


def body_of(request: httpx.Request) -> dict[str, Any]:
    doc = json.loads(request.content)
    assert isinstance(doc, dict)
    return doc


def rows(output: str) -> list[list[str]]:
    """Table lines split on runs of 2+ spaces."""
    return [re.split(r" {2,}", line.strip()) for line in output.splitlines()]


# --- add -------------------------------------------------------------------------------------


def test_add_at_a_relative_time(run: Cli) -> None:
    out = run.ok("add", "--flow", "noop", "--at", "+10m", "--id", "once", "-p", "n=3", "-p", "who=ops")
    sent = body_of(run.requests[-1])
    # Only what was given: the API's defaults apply to the rest.
    assert sent == {"schedule_id": "once", "flow": "noop", "parameters": {"n": 3, "who": "ops"},
                    "run_at": NOW + 600, "pause_on_failure": False, "paused": False}
    lines = out.splitlines()
    assert lines[0] == "schedule once  active"
    assert '  target    flow noop  parameters {"n": 3, "who": "ops"}' in lines
    assert "  when      at 2023-11-14 17:23:20 -0500" in lines
    assert "  next      2023-11-14 17:23:20 -0500  (in 10m)" in lines
    assert "  policy    overlap skip, catch-up window 5m, pause on failure no" in lines


def test_add_a_cron_in_a_time_zone_lists_the_next_five_in_local_time(run: Cli) -> None:
    out = run.ok("add", "--flow", "noop", "--cron", "0 2 * * *", "--timezone", "Europe/Paris", "--id", "nightly",
                 "--start", "2023-11-16T00:00", "--jitter", "30s", "--overlap", "buffer_one",
                 "--catchup-window", "1h", "--note", "nightly sweep")
    sent = body_of(run.requests[-1])
    # A time without offset is in --timezone: midnight in Paris is 23:00 UTC the day before.
    assert sent["start_at"] == datetime(2023, 11, 15, 23, 0, tzinfo=UTC).timestamp()
    assert (sent["cron"], sent["timezone"], sent["jitter"], sent["catchup_window"], sent["overlap"]) == (
        "0 2 * * *", "Europe/Paris", 30.0, 3600.0, "buffer_one")
    assert "  when      cron 0 2 * * * (Europe/Paris)" in out
    assert "  note      nightly sweep" in out
    assert "  jitter    up to 30s late" in out
    assert "  policy    overlap buffer_one, catch-up window 1h, pause on failure no" in out
    # 02:00 in Paris (UTC+1) is 20:00 the day before in New York; the first is on the 16th, from --start.
    # (Jitter delays the actual firing, not the scheduled times listed.)
    nexts = [line[12:37] for line in out.splitlines() if line.startswith(("  next", "           "))]
    assert nexts == [f"2023-11-{d} 20:00:00 -0500" for d in (15, 16, 17, 18, 19)]
    assert "(in 2d2h47m)" in out


def test_add_every_as_json(run: Cli) -> None:
    out = run.ok("add", "--flow", "noop", "--every", "1h30m", "--id", "often", "--paused", "--json")
    doc = json.loads(out)
    assert (doc["schedule_id"], doc["every"], doc["paused"], doc["state"]) == ("often", 5400.0, True, "paused")
    assert len(doc["next_fire_times"]) == 5, "what would fire once resumed"
    assert run.api("/api/schedules/often")["every"] == 5400.0


def test_adding_the_same_definition_again_says_so(run: Cli) -> None:
    run.ok("add", "--flow", "noop", "--every", "60", "--id", "e1")
    out = run.ok("add", "--flow", "noop", "--every", "1m", "--id", "e1")
    assert out.splitlines()[0] == "schedule e1 already exists with this definition"
    result = run("add", "--flow", "noop", "--every", "2m", "--id", "e1")
    assert result.exit_code == 1
    assert "Error: 409: schedule 'e1' exists with another definition" in result.output


def test_a_v1_task_type_target(run: Cli) -> None:
    result = run("add", "--task-type", "nosuchtype", "--stage", "s1", "--content", "x", "--every", "5m")
    assert result.exit_code == 1
    sent = body_of(run.requests[-1])
    assert (sent["task_type"], sent["task_stage"], sent["task_content"]) == ("nosuchtype", "s1", "x")
    assert "  task_type (--task-type): " in result.output


# --- bad input -------------------------------------------------------------------------------


def test_a_bad_cron_and_an_unknown_flow_are_each_named(run: Cli) -> None:
    result = run("add", "--flow", "nope", "--cron", "0 2 * *")
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == "Error: 422: invalid schedule"
    assert lines[1].startswith("  cron: cannot read '0 2 * *'"), lines
    assert lines[2] == "  flow: unknown flow 'nope' (known flows: long, noop, short, three)"
    assert run.api("/api/schedules")["schedules"] == []


def test_an_api_field_is_named_with_its_option(run: Cli) -> None:
    result = run("add", "--flow", "noop", "--at", "1600000000")  # long past: beyond the catch-up window
    assert result.exit_code == 1
    assert "\n  run_at (--at): 100000000 s in the past, beyond catchup_window\n" in result.output
    result = run("add", "--flow", "noop", "--every", "1h", "--id", "bad id!")
    assert result.exit_code == 1
    assert "Error: 422: invalid request\n  schedule_id (--id): String should match pattern" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cron", "* * * * *"], "give exactly one of --flow, --task-type"),
        (["--flow", "noop", "--task-type", "t", "--every", "5"], "give exactly one of --flow, --task-type"),
        (["--flow", "noop"], "give exactly one of --at, --cron, --every"),
        (["--flow", "noop", "--every", "5m", "--cron", "* * * * *"], "give exactly one of --at, --cron, --every"),
        (["--flow", "noop", "--every", "5 min"], "Invalid value for '--every': '5 min' is not a duration"),
        (["--flow", "noop", "--every", "1h", "--jitter", "-3"], "Invalid value for '--jitter'"),
        (["--flow", "noop", "--at", "tomorrow"], "Invalid value for --at: 'tomorrow' is not a time"),
        (["--flow", "noop", "--at", "+soon"], "Invalid value for --at: 'soon' is not a duration"),
        (["--flow", "noop", "--cron", "0 2 * * *", "--timezone", "Mars/Base"],
         "Invalid value for --timezone: unknown time zone 'Mars/Base'"),
        (["--flow", "noop", "--every", "1h", "--overlap", "queue"], "Invalid value for '--overlap'"),
        (["--flow", "noop", "--every", "1h", "-p", "novalue"], "expected KEY=VALUE"),
    ],
)
def test_usage_errors_are_caught_before_the_api(run: Cli, args: list[str], message: str) -> None:
    result = run("add", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert run.requests == []


def test_a_missing_schedule_is_a_404(run: Cli) -> None:
    for args in (["show", "gone"], ["pause", "gone"], ["trigger", "gone"], ["runs", "gone"], ["delete", "gone"]):
        result = run(*args)
        assert result.exit_code == 1, args
        assert "Error: 404: no schedule 'gone'" in result.output


# --- list, show, pause, resume -----------------------------------------------------------------


def test_list_shows_a_row_per_schedule(run: Cli) -> None:
    assert run.ok("list") == "no schedules\n"
    run.ok("add", "--flow", "noop", "--cron", "*/15 * * * *", "--id", "b-cron", "--note", "quarter hours")
    run.ok("add", "--flow", "noop", "--every", "300", "--id", "a-every", "--overlap", "allow_all")
    run.ok("add", "--flow", "noop", "--at", "+1h", "--id", "c-once", "--paused")
    assert rows(run.ok("list")) == [
        ["ID", "TARGET", "WHEN", "NEXT", "OVERLAP", "NOTE"],
        ["a-every", "noop", "every 5m", "2023-11-14 17:15:00 -0500", "allow_all"],
        ["b-cron", "noop", "cron */15 * * * * (UTC)", "2023-11-14 17:15:00 -0500", "skip", "quarter hours"],
        ["c-once", "noop", "at 2023-11-14 18:13:20 -0500", "paused", "skip"],
    ]
    result = run("list", "--limit", "1", "--after", "a-every")
    assert [r[0] for r in rows(result.stdout)] == ["ID", "b-cron"]
    assert "(more may follow: --after b-cron)" in result.stderr
    assert [d["schedule_id"] for d in json.loads(run.ok("list", "--json"))["schedules"]] == [
        "a-every", "b-cron", "c-once"]


def test_a_fired_one_off_is_done(run: Cli) -> None:
    run.ok("add", "--flow", "noop", "--at", "+1m", "--id", "once")
    run.step(61)
    assert rows(run.ok("list"))[1][3] == "done"
    assert run.ok("show", "once").startswith("schedule once  done (no more firings)\n")


def test_pause_and_resume(run: Cli) -> None:
    run.ok("add", "--flow", "noop", "--every", "10m", "--id", "ten", "--note", "first note")
    assert run.ok("pause", "ten", "--note", "db maintenance") == "schedule ten paused: db maintenance\n"
    assert run.api("/api/schedules/ten")["paused"] is True
    assert rows(run.ok("list"))[1][3] == "paused"
    shown = run.ok("show", "ten")
    assert shown.startswith("schedule ten  PAUSED\n  note      db maintenance\n")
    assert "  next " not in shown and "  if resumed " in shown
    run.step(3600)  # nothing fires while paused
    assert run.ok("runs", "ten") == "schedule ten has no runs yet\n"

    assert run.ok("resume", "ten") == "schedule ten resumed, next firing: 2023-11-14 18:20:00 -0500\n"
    assert run.api("/api/schedules/ten")["paused"] is False
    assert run.ok("show", "ten").startswith("schedule ten  active\n")
    assert run.ok("pause", "ten") == "schedule ten paused: db maintenance\n"  # the note is kept


# --- trigger, runs, backfill, delete -------------------------------------------------------------


def test_trigger_then_runs_shows_the_task(run: Cli) -> None:
    run.ok("add", "--flow", "noop", "--cron", "0 3 * * *", "--id", "nightly")
    run.app.clock.advance(0.25)
    out = run.ok("trigger", "nightly")
    task_id = f"sch.nightly.{round((NOW + 0.25) * 1000)}"
    assert out.splitlines()[0] == "schedule nightly triggered: 1 fired"
    assert rows(out)[2] == ["2023-11-14 17:13:20 -0500", "2023-11-14 17:13:20 -0500", "0", task_id, "pending"]
    assert run.app.runtime.service.get(task_id) is not None

    run.app.clock.advance(60)
    assert rows(run.ok("runs", "nightly")) == [
        ["SCHEDULED", "FIRED", "LATE(ms)", "TASK", "STATUS", "REASON"],
        ["2023-11-14 17:13:20 -0500", "2023-11-14 17:13:20 -0500", "0", task_id, "pending"],
    ]
    # A second trigger while the task runs: skipped by the overlap policy.
    out = run.ok("trigger", "nightly")
    assert out.splitlines()[0] == "schedule nightly triggered: 1 skipped (overlap)"
    runs = run.ok("runs", "nightly")
    assert [r[3:] for r in rows(runs)[1:]] == [["-", "skipped", "overlap"], [task_id, "pending"]]
    assert rows(runs)[1][:3] == ["2023-11-14 17:14:20 -0500", "-", "-"]
    assert json.loads(run.ok("runs", "nightly", "--limit", "1", "--json"))["runs"][0]["reason"] == "overlap"
    before = f"{NOW + 30:.0f}"
    assert [r[3] for r in rows(run.ok("runs", "nightly", "--before", before))[1:]] == [task_id]


def test_a_scheduled_firing_is_late_by_the_scheduler_step(run: Cli) -> None:
    run.ok("add", "--flow", "noop", "--every", "1m", "--id", "minutely")
    run.step(0)  # lead, load the timetable
    run.step(40.5)  # 17:14:00 was due half a second ago
    line = rows(run.ok("runs", "minutely"))[1]
    assert line[:4] == ["2023-11-14 17:14:00 -0500", "2023-11-14 17:14:00 -0500", "500", "sch.minutely.1700000040000"]
    shown = run.ok("show", "minutely")
    assert "\nruns (1 newest):\n  SCHEDULED " in shown
    assert "  running   task sch.minutely.1700000040000" in shown
    assert "  handled   every time up to 2023-11-14 17:14:00 -0500" in shown
    doc = json.loads(run.ok("show", "minutely", "--json"))
    assert [r["task_id"] for r in doc["runs"]] == ["sch.minutely.1700000040000"]
    assert doc["schedule"]["running_task_id"] == "sch.minutely.1700000040000"


def test_backfill_fires_the_missing_times_once(run: Cli) -> None:
    run.ok("add", "--flow", "noop", "--cron", "0 2 * * *", "--timezone", "UTC", "--id", "nightly",
           "--overlap", "allow_all")
    out = run.ok("backfill", "nightly", "--start", "2023-11-12T00:00Z", "--end", "-1h")
    lines = out.splitlines()
    assert lines[0] == "schedule nightly backfilled: 3 fired"
    # 02:00 UTC on the 12th, 13th and 14th, each the evening before in New York.
    assert [r[0] for r in rows(out)[2:]] == [f"2023-11-{d} 21:00:00 -0500" for d in (13, 12, 11)]
    assert all(r[3].startswith("sch.nightly.") for r in rows(out)[2:])
    assert body_of(run.requests[-1]) == {"start": datetime(2023, 11, 12, tzinfo=UTC).timestamp(),
                                        "end": NOW - 3600}
    assert len(rows(run.ok("runs", "nightly"))) == 4

    # Only the time that has no run yet; local time without offset.
    out = run.ok("backfill", "nightly", "--start", "2023-11-10 12:00", "--end", "now")
    assert out.splitlines()[0] == "schedule nightly backfilled: 1 fired"
    assert [r[0] for r in rows(out)[2:]] == ["2023-11-10 21:00:00 -0500"]
    assert run.ok("backfill", "nightly", "--start", "2023-11-10 12:00", "--end", "now") == (
        "schedule nightly backfilled: no new runs\n")
    assert len(rows(run.ok("runs", "nightly"))) == 5

    result = run("backfill", "nightly", "--start", "now", "--end", "-1d")
    assert result.exit_code == 1
    assert "Error: 422: invalid schedule\n  end: must not be before start" in result.output


def test_delete_asks_first(run: Cli) -> None:
    run.ok("add", "--flow", "noop", "--every", "5m", "--id", "doomed")
    result = run("delete", "doomed", input="n\n")
    assert result.exit_code == 1
    assert "delete schedule doomed (noop, every 5m)? [y/N]" in result.output
    assert "Aborted" in result.output
    assert run.http.get("/api/schedules/doomed").status_code == 200

    assert run("delete", "doomed", input="y\n").stdout.endswith("schedule doomed deleted\n")
    assert run.http.get("/api/schedules/doomed").status_code == 404

    run.ok("add", "--flow", "noop", "--every", "5m", "--id", "doomed2")
    assert run.ok("delete", "doomed2", "--yes") == "schedule doomed2 deleted\n"
    assert run.requests[-1].method == "DELETE"
    assert run.ok("list") == "no schedules\n"


# --- parsing, without the API ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, seconds",
    [("90", 90.0), ("1.5", 1.5), ("30s", 30.0), ("5m", 300.0), ("2h", 7200.0), ("1d", 86400.0),
     ("1h30m", 5400.0), ("2H", 7200.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert schedules_view.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "5 m", "-5", "5w", "1h 30m", "5ms"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        schedules_view.parse_duration(text)


def test_times(new_york: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schedules_view, "clock", lambda: NOW)
    parse = schedules_view.parse_time
    assert parse("1700000000") == parse("1700000000.0") == parse("now") == NOW
    assert parse("+10m") == NOW + 600 and parse("-2h") == NOW - 7200
    assert parse("2023-11-14T22:13:20Z") == parse("2023-11-14T23:13:20+01:00") == NOW
    assert parse("2023-11-14T17:13:20") == NOW  # local time
    assert parse("2023-11-14 23:13:20", schedules_view.zone("Europe/Paris")) == NOW
    assert parse("2023-11-15") == NOW + 6 * 3600 + 46 * 60 + 40  # local midnight
    assert schedules_view.fmt_time(NOW) == "2023-11-14 17:13:20 -0500"
    assert [schedules_view.fmt_duration(s) for s in (0.5, 45, 90, 3600, 93784)] == ["0.5s", "45s", "1m30s", "1h",
                                                                                   "1d2h3m4s"]
