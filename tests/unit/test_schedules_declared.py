"""The ``schedules:`` section of flows.yaml: parsing, ``ScheduleService.declare`` and the scheduler's start.

Parse errors name the file, the schedule and the field. ``declare`` adds the new
schedules and updates those whose definition changed, leaving the rest (and the
state users gave them: pause, note, runs) alone. The schedule service runs over
a SQLite file with a manual clock (``shared.testing.InProcess``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from asyncflow import cli, serve
from shared.config import Settings
from shared.flows import FlowsError, FlowSet, load_flows
from shared.migrate import upgrade
from shared.schedules.definition import Definition
from shared.schedules.model import Overlap
from shared.schedules.service import InvalidSchedule, ScheduleService
from shared.storage.sql import SqliteStore
from shared.storage.sql_schedules import SqlScheduleStore
from shared.testing import InProcess

NOW = 1_700_000_000.0  # the ManualClock's start

FLOWS: dict[str, Any] = {
    "modules": {"alpha": {"import": "testmod"}},
    "flows": {
        "noop": {"steps": [{"normal": {"module": "alpha", "command": "step"}}]},
        "other": {"steps": [{"normal": {"module": "alpha", "command": "step"}}]},
    },
}
NIGHTLY = {"flow": "noop", "parameters": {"n": 1}, "cron": "0 2 * * *", "timezone": "Europe/Berlin"}


def write(path: Path, schedules: Any) -> Path:
    path.write_text(yaml.safe_dump({**FLOWS, "schedules": schedules}, sort_keys=False), encoding="utf-8")
    return path


def problems_of(path: Path) -> list[str]:
    with pytest.raises(FlowsError) as caught:
        load_flows(path)
    return caught.value.problems


# --- parsing -------------------------------------------------------------------------------------


def nightly(**changes: Any) -> dict[str, Any]:
    return {"nightly": {**NIGHTLY, **changes}}


PARSE_ERRORS = [
    ("bad-cron", nightly(cron="0 2 * *"), "nightly", "cron: cannot read '0 2 * *'"),
    ("cron-out-of-range", nightly(cron="0 25 * * *"), "nightly", "cron: cannot read '0 25 * * *'"),
    ("time-zone", nightly(timezone="Mars/Base"), "nightly", "timezone: unknown time zone 'Mars/Base'"),
    ("flow-not-in-file", nightly(flow="elsewhere"), "nightly", "flow: no flow 'elsewhere' in this file"),
    ("extra-field", nightly(bogus=1), "nightly", "bogus: Extra inputs are not permitted"),
    ("misspelt-field", nightly(timezon="UTC"), "nightly", "timezon: Extra inputs are not permitted"),
    ("id-with-space", {"bad id": NIGHTLY}, "bad id", "id must match"),
    ("id-with-dot", {"a.b": NIGHTLY}, "a.b", "id must match"),
    ("id-too-long", {"x" * 41: NIGHTLY}, "x" * 41, "id must match"),
    ("schedule_id-differs", nightly(schedule_id="daily"), "nightly", "schedule_id: differs from the key"),
    ("schedule_id-bad", nightly(schedule_id="bad id"), "nightly", "schedule_id: String should match"),
    ("two-times", nightly(every=60), "nightly", "every: give exactly one of run_at, cron, every"),
    ("no-time", {"nightly": {"flow": "noop"}}, "nightly", "run_at: give exactly one of run_at, cron, every"),
    ("flow-and-task_type", nightly(task_type="inbox"), "nightly", "flow: give exactly one of flow"),
    ("overlap", nightly(overlap="skipp"), "nightly", "overlap: Input should be"),
    ("every-as-text", nightly(cron=None, every="1h"), "nightly", "every: Input should be a valid number"),
    ("end-before-start", nightly(start_at=200, end_at=100), "nightly", "end_at: must be after start_at"),
    ("jitter", nightly(jitter=-1), "nightly", "jitter: Input should be greater than"),
    ("not-a-mapping", {"nightly": "0 2 * * *"}, "nightly", "(schedule): "),
]


@pytest.mark.parametrize(
    "schedules, schedule_id, expected", [c[1:] for c in PARSE_ERRORS], ids=[c[0] for c in PARSE_ERRORS]
)
def test_each_error_names_the_file_the_schedule_and_the_field(
    tmp_path: Path, schedules: dict[str, Any], schedule_id: str, expected: str
) -> None:
    path = write(tmp_path / "flows.yaml", schedules)
    problems = problems_of(path)
    assert any(p.startswith(f"{path}: schedule {schedule_id!r}: {expected}") for p in problems), problems


def test_errors_of_several_schedules_are_reported_together(tmp_path: Path) -> None:
    path = write(tmp_path / "flows.yaml", {
        "a": {**NIGHTLY, "cron": "bad"},
        "b": {**NIGHTLY, "timezone": "Nowhere/Land"},
        "c": NIGHTLY,
    })
    problems = problems_of(path)
    assert [p.split(": ")[1] for p in problems] == ["schedule 'a'", "schedule 'b'"], problems


def test_schedules_that_are_not_a_mapping_are_reported(tmp_path: Path) -> None:
    path = write(tmp_path / "flows.yaml", [NIGHTLY])
    assert problems_of(path) == [f"{path}: schedules: Input should be a valid dictionary"]


def test_a_valid_section_parses_with_the_key_as_schedule_id(tmp_path: Path) -> None:
    path = write(tmp_path / "flows.yaml", {
        "nightly": {**NIGHTLY, "overlap": "buffer_one", "pause_on_failure": True, "note": "n"},
        "poll": {"task_type": "inbox", "task_stage": "s1", "task_content": "{}", "every": 300, "jitter": 30},
        "once": {"flow": "other", "run_at": NOW + 3600, "schedule_id": "once"},
    })
    flows = load_flows(path)
    assert list(flows.schedules) == ["nightly", "poll", "once"]
    assert all(isinstance(d, Definition) for d in flows.schedules.values())
    nightly, poll, once = flows.schedules.values()
    assert (nightly.schedule_id, nightly.flow, nightly.parameters, nightly.cron, nightly.timezone) == (
        "nightly", "noop", {"n": 1}, "0 2 * * *", "Europe/Berlin")
    assert (nightly.overlap, nightly.pause_on_failure, nightly.note) == (Overlap.BUFFER_ONE, True, "n")
    assert (poll.schedule_id, poll.task_type, poll.task_stage, poll.every, poll.jitter) == (
        "poll", "inbox", "s1", 300.0, 30.0)
    assert (once.schedule_id, once.flow, once.run_at) == ("once", "other", NOW + 3600)
    # Without the section: none.
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(FLOWS), encoding="utf-8")
    assert load_flows(tmp_path / "plain.yaml").schedules == {}


def test_a_yaml_date_in_parameters_is_refused_or_stored(tmp_path: Path) -> None:
    """An unquoted date is a YAML date, not JSON: refuse it naming the field, or store it (not crash)."""
    path = write(tmp_path / "flows.yaml", {"nightly": {**NIGHTLY, "parameters": {"day": date(2024, 1, 1)}}})
    assert "day: 2024-01-01\n" in path.read_text(encoding="utf-8")
    try:
        flows = load_flows(path)
    except FlowsError as exc:
        where = f"{path}: schedule 'nightly': parameters"
        assert any(p.startswith(where) for p in exc.problems), exc.problems
        return
    store = SqliteStore(f"sqlite:///{tmp_path / 'asyncflow.sqlite'}")
    store.create_schema()
    try:
        app = InProcess(flows, tmp_path, store)
        app.runtime.schedules.declare(flows.schedules)
        stored = app.runtime.schedules.get("nightly").target.parameters
        assert stored["day"] in ("2024-01-01", date(2024, 1, 1))
    finally:
        store.close()


# --- declare -------------------------------------------------------------------------------------------


class Declared:
    """A runtime over a SQLite file whose flows.yaml the test rewrites."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.path = home / "flows.yaml"
        self.store = SqliteStore(f"sqlite:///{home / 'asyncflow.sqlite'}")
        self.store.create_schema()
        self.app = InProcess(self.load({}), home, self.store)

    def load(self, schedules: dict[str, Any]) -> FlowSet:
        return load_flows(write(self.path, schedules))

    @property
    def service(self) -> ScheduleService:
        return self.app.runtime.schedules

    def declare(self, schedules: dict[str, Any]) -> None:
        self.service.declare(self.load(schedules).schedules)

    def versions(self) -> dict[str, int]:
        return {s.schedule_id: s.version for s in self.service.list(1000)}

    def step(self, seconds: float) -> None:
        self.app.clock.advance(seconds)
        self.app.runtime.scheduler.step()


@pytest.fixture
def declared(tmp_path: Path) -> Iterator[Declared]:
    d = Declared(tmp_path)
    try:
        yield d
    finally:
        d.store.close()


def test_declare_adds_the_new_schedules(declared: Declared) -> None:
    often = {"flow": "other", "every": 600, "paused": True, "note": "later"}
    declared.declare({"nightly": NIGHTLY, "often": often})
    assert declared.versions() == {"nightly": 1, "often": 1}
    nightly = declared.service.get("nightly")
    target = nightly.target
    assert (target.flow, dict(target.parameters), target.user_id) == ("noop", {"n": 1}, None)
    assert (nightly.when.cron, nightly.when.timezone, nightly.created_at, nightly.paused) == (
        "0 2 * * *", "Europe/Berlin", NOW, False)
    assert len(declared.service.next_fire_times(nightly)) == 5
    stored = declared.service.get("often")
    assert (stored.paused, stored.note, stored.when.every) == (True, "later", 600.0), "as the file starts it"


def test_declaring_again_changes_nothing(declared: Declared) -> None:
    often = {"flow": "other", "every": 60, "jitter": 5, "overlap": "allow_all",
             "parameters": {"deep": {"list": [1, 2.5, "x", None, True]}}}
    schedules = {"nightly": NIGHTLY, "often": often}
    declared.declare(schedules)
    before = {s.schedule_id: s for s in declared.service.list(1000)}
    declared.app.clock.advance(30)
    declared.declare(schedules)
    assert {s.schedule_id: s for s in declared.service.list(1000)} == before, "not even updated_at"
    # Nor once the schedules have fired (their state moved, their definition did not).
    declared.step(0)
    declared.step(100)
    assert declared.service.runs("often", 10)
    fired = declared.versions()
    declared.declare(schedules)
    assert declared.versions() == fired


def test_a_changed_definition_is_updated_keeping_runs_pause_and_note(declared: Declared) -> None:
    declared.declare({"nightly": NIGHTLY})
    declared.app.clock.advance(10)
    runs = declared.service.trigger("nightly")
    assert len(runs) == 1
    declared.service.pause("nightly", "held by ops")
    version = declared.versions()["nightly"]

    declared.app.clock.advance(10)
    changed = {**NIGHTLY, "cron": "30 4 * * *", "parameters": {"n": 2}, "paused": False, "note": "file"}
    declared.declare({"nightly": changed})
    stored = declared.service.get("nightly")
    assert (stored.when.cron, dict(stored.target.parameters)) == ("30 4 * * *", {"n": 2})
    assert (stored.paused, stored.note) == (True, "held by ops"), "pause and note are the user's"
    assert (stored.created_at, stored.updated_at) == (NOW, NOW + 20)
    assert stored.version == version + 1
    assert [v.run.task_id for v in declared.service.runs("nightly", 10)] == [runs[0].run.task_id]
    assert declared.app.runtime.store.get(runs[0].run.task_id) is not None
    # Declaring the changed file again changes nothing more.
    declared.declare({"nightly": changed})
    assert declared.versions()["nightly"] == version + 1


def test_schedules_absent_from_the_file_are_left_alone(declared: Declared) -> None:
    declared.declare({"nightly": NIGHTLY, "dropped": {"flow": "noop", "every": 60}})
    by_api = Definition(schedule_id="by-api", flow="other", every=120, user_id="alice")
    api_made, created = declared.service.add(by_api)
    assert created
    before = {s.schedule_id: s for s in declared.service.list(1000)}
    declared.app.clock.advance(5)
    declared.declare({"nightly": NIGHTLY})  # "dropped" left the file
    assert {s.schedule_id: s for s in declared.service.list(1000)} == before
    assert declared.service.get("by-api") == api_made


def test_an_unknown_task_type_raises_invalid_schedule_naming_it(declared: Declared) -> None:
    flows = declared.load({"poll": {"task_type": "inbox", "every": 300}})
    with pytest.raises(InvalidSchedule) as caught:
        declared.service.declare(flows.schedules)
    assert [d["field"] for d in caught.value.detail] == ["schedules.poll.task_type"]
    assert "schedules.poll.task_type: " in str(caught.value)
    assert declared.versions() == {}
    # Once the type is registered, the same file applies.
    declared.app.runtime.pull_service.register_type({"task_type": "inbox"})
    declared.service.declare(flows.schedules)
    assert declared.versions() == {"poll": 1}
    assert declared.service.get("poll").target.task_type == "inbox"


def test_a_changed_definition_that_cannot_be_stored_names_the_schedule(declared: Declared) -> None:
    declared.declare({"nightly": NIGHTLY})
    with pytest.raises(InvalidSchedule) as caught:
        declared.declare({"nightly": {"task_type": "inbox", "cron": "0 2 * * *"}})
    assert [d["field"] for d in caught.value.detail] == ["schedules.nightly.task_type"]
    assert declared.service.get("nightly").target.flow == "noop"
    assert declared.versions() == {"nightly": 1}


def test_a_one_off_in_the_file_is_declared_again_after_it_fired(declared: Declared) -> None:
    """A run_at in flows.yaml that has fired must not stop the next start of the scheduler."""
    schedules = {"once": {"flow": "noop", "run_at": NOW + 60}}
    declared.declare(schedules)
    declared.step(0)
    declared.step(60)
    assert [v.run.scheduled_at for v in declared.service.runs("once", 10)] == [NOW + 60]
    version = declared.versions()["once"]
    declared.app.clock.advance(86400)  # a day later, the scheduler restarts
    declared.declare(schedules)
    assert declared.versions() == {"once": version}


# --- asyncflow scheduler -----------------------------------------------------------------------------------


def settings_for(tmp_path: Path, schedules: Any, **extra: Any) -> Settings:
    flows = write(tmp_path / "flows.yaml", schedules)
    return Settings(
        home=tmp_path,
        flows=flows,
        database_url=f"sqlite:///{tmp_path / 'asyncflow.sqlite'}",
        broker_url=f"sqla+sqlite:///{tmp_path / 'broker.sqlite'}",
        **extra,
    )


def stopped() -> threading.Event:
    stop = threading.Event()
    stop.set()
    return stop


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_scheduler replaces the root logger's handlers: keep pytest's."""
    monkeypatch.setattr(serve, "setup_logging", lambda level, process: None)


def stored_ids(settings: Settings) -> list[str]:
    store = SqliteStore(settings.resolved_database_url())
    try:
        return [s.schedule_id for s in SqlScheduleStore(store).list(100)]
    finally:
        store.close()


def test_run_scheduler_applies_the_schedules_then_stops(tmp_path: Path, quiet: None) -> None:
    settings = settings_for(tmp_path, {"nightly": NIGHTLY}, migrate_on_start=False)
    upgrade(settings.resolved_database_url())
    serve.run_scheduler(settings, stopped())
    assert stored_ids(settings) == ["nightly"]
    serve.run_scheduler(settings, stopped())  # again: nothing to change
    assert stored_ids(settings) == ["nightly"]


def test_run_scheduler_exits_naming_the_file_and_the_field_of_a_bad_task_type(
    tmp_path: Path, quiet: None
) -> None:
    settings = settings_for(tmp_path, {"poll": {"task_type": "inbox", "every": 300}}, migrate_on_start=False)
    upgrade(settings.resolved_database_url())
    with pytest.raises(SystemExit) as caught:
        serve.run_scheduler(settings, stopped())
    message = str(caught.value.code)
    assert message.startswith(f"{settings.flows}: "), message
    assert "schedules.poll.task_type: " in message
    assert "inbox" in message
    assert stored_ids(settings) == []


def test_run_scheduler_migrates_on_start_like_the_api(tmp_path: Path, quiet: None) -> None:
    """migrate_on_start (the default) prepares a fresh database, as `asyncflow api` does."""
    settings = settings_for(tmp_path, {"nightly": NIGHTLY}, outcome_patience=0)
    assert settings.migrate_on_start
    serve.run_scheduler(settings, stopped())
    assert stored_ids(settings) == ["nightly"]


def test_asyncflow_scheduler_reports_a_bad_schedule_in_flows_yaml(
    tmp_path: Path, quiet: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like `asyncflow api` and `worker`: the problems on stderr, no traceback."""
    settings = settings_for(tmp_path, {"nightly": {**NIGHTLY, "cron": "0 2 * *"}}, migrate_on_start=False)
    upgrade(settings.resolved_database_url())
    monkeypatch.setattr(serve, "_stop_on_signals", stopped)
    env = {"FLOWS": settings.flows, "HOME": tmp_path, "DATABASE_URL": settings.database_url,
           "BROKER_URL": settings.broker_url, "MIGRATE_ON_START": "false"}
    for name, value in env.items():
        monkeypatch.setenv(f"ASYNCFLOW_{name}", str(value))
    result = CliRunner().invoke(cli.main, ["scheduler"])
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert f"{settings.flows}: schedule 'nightly': cron: cannot read '0 2 * *'" in result.output
