"""/api/schedules (SPEC §9): the HTTP contract, through the real app over the real services.

In process (``shared.testing.InProcess``) over a SQLite file: time is a manual
clock and the leader scheduler is stepped by hand, so "nothing fired" is exact.
"Nothing stored" is checked on the schedule store itself.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest

from oss_api.testing import TestClient, open_client
from shared.config import Settings
from shared.consumer import StepConsumer
from shared.flows import load_flows
from shared.schedules.definition import SCHEDULE_ID
from shared.storage import TaskFilter
from shared.storage.sql import SqliteStore
from shared.testing import InProcess, ManualClock

SUPPORT = Path(__file__).resolve().parents[1] / "support"
NOW = 1_700_000_000.0  # Tue 2023-11-14 22:13:20 UTC, the ManualClock's start
EVERY = {"flow": "noop", "every": 60}
ALICE, BOB, ROOT = "alice-key-0001", "bob-key-00002", "root-key-00003"
KEYS = f"{ALICE}=alice, {BOB}=bob, {ROOT}=ops:admin"

SCHEDULE_FIELDS = {
    "schedule_id", "flow", "parameters", "task_type", "task_stage", "task_content", "user_id",
    "run_at", "cron", "every", "timezone", "start_at", "end_at", "jitter", "overlap", "catchup_window",
    "pause_on_failure", "paused", "note", "created_at", "updated_at", "state", "next_fire_times",
    "last_scheduled_at", "running_task_id", "buffered",
}
RUN_FIELDS = {"scheduled_at", "fired_at", "task_id", "status", "state", "reason"}


def at(tz: str, *when: int) -> float:
    """Epoch seconds of a wall-clock time in ``tz``."""
    return datetime(*when, tzinfo=ZoneInfo(tz)).timestamp()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Api:
    client: TestClient
    app: InProcess

    @property
    def clock(self) -> ManualClock:
        return self.app.clock

    def create(self, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
        r = self.client.post("/api/schedules", json=body, headers=bearer(key) if key else None)
        assert r.status_code == 201, r.text
        doc = r.json()
        assert isinstance(doc, dict)
        return doc

    def get(self, path: str, key: str | None = None, **params: Any) -> httpx.Response:
        return self.client.get(path, params=params, headers=bearer(key) if key else None)

    def ok(self, method: str, path: str, body: Any = None, key: str | None = None) -> Any:
        r = self.client.request(method, path, json=body, headers=bearer(key) if key else None)
        assert r.status_code == 200, r.text
        return r.json()

    def runs(self, schedule_id: str, key: str | None = None, **params: Any) -> list[dict[str, Any]]:
        r = self.get(f"/api/schedules/{schedule_id}/runs", key, **params)
        assert r.status_code == 200, r.text
        runs = r.json()["runs"]
        assert isinstance(runs, list)
        return runs

    def step(self, seconds: float) -> None:
        """Let ``seconds`` pass, then let the leader fire what is due."""
        self.clock.advance(seconds)
        self.app.runtime.scheduler.step()

    def stored(self) -> dict[str, Any]:
        return {s.schedule_id: s for s in self.app.runtime.schedule_store.list(1000)}

    def task_ids(self) -> list[str]:
        return sorted(t.task_id for t in self.app.runtime.store.list(TaskFilter(limit=1000)))

    def drain(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Run every published step through the testmod consumers, in order."""
        monkeypatch.syspath_prepend(str(SUPPORT))
        testmod = importlib.import_module("testmod")
        runtime = self.app.runtime
        consumer = StepConsumer(
            runtime.service, {"alpha": testmod.alpha, "beta": testmod.beta}, runtime.settings,
            clock=self.clock,
        )
        while self.app.publisher.messages:
            consumer.handle(self.app.publisher.messages.popleft())


def serve(home: Path, settings: Settings | None = None) -> Iterator[Api]:
    store = SqliteStore(f"sqlite:///{home / 'asyncflow.sqlite'}")
    store.create_schema()
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), home, store, settings=settings)
    assert app.clock.now == NOW
    try:
        with open_client(app.runtime) as client:
            yield Api(client, app)
    finally:
        store.close()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    """The app over a SQLite file of its own."""
    yield from serve(tmp_path)


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[Api]:
    """The same, with API keys: alice, bob, and ops the admin."""
    yield from serve(tmp_path, Settings(home=tmp_path, api_keys=KEYS))


@pytest.fixture(scope="module")
def one_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    yield from serve(tmp_path_factory.mktemp("shared"))


@pytest.fixture
def shared(one_app: Api) -> Iterator[Api]:
    """One app for the many tests that fire nothing (the per-test app costs most of their time):
    each starts at NOW with no schedule, and must leave no task behind."""
    one_app.clock.now = NOW
    tasks = one_app.task_ids()
    yield one_app
    for sid in one_app.stored():
        one_app.app.runtime.schedule_store.delete(sid)
    assert one_app.task_ids() == tasks, "a request that should change nothing created a task"


def fields_of(response: httpx.Response) -> list[str]:
    body = response.json()
    return [d["field"] for d in body.get("detail", [])]


# --- POST /api/schedules ---------------------------------------------------------------------------


def test_post_returns_201_with_the_schedule_and_its_next_fire_times(shared: Api) -> None:
    api = shared
    doc = api.create({"schedule_id": "minutely", "flow": "noop", "parameters": {"n": 3}, "every": 60,
                      "note": "first"})
    assert set(doc) == SCHEDULE_FIELDS
    assert (doc["schedule_id"], doc["flow"], doc["parameters"]) == ("minutely", "noop", {"n": 3})
    assert doc["every"] == 60.0
    assert (doc["task_type"], doc["run_at"], doc["cron"]) == (None, None, None)
    assert (doc["timezone"], doc["overlap"], doc["catchup_window"]) == ("UTC", "skip", 300.0)
    assert doc["jitter"] == 0.0
    assert (doc["state"], doc["paused"], doc["note"]) == ("active", False, "first")
    assert (doc["created_at"], doc["updated_at"], doc["last_scheduled_at"]) == (NOW, NOW, NOW)
    assert (doc["running_task_id"], doc["buffered"]) == (None, [])
    # every 60 s counts from the epoch: the whole minutes after NOW.
    first = math.floor(NOW / 60) * 60 + 60
    assert doc["next_fire_times"] == [first + 60 * k for k in range(5)]
    assert api.get("/api/schedules/minutely").json() == doc
    assert list(api.stored()) == ["minutely"]
    assert api.task_ids() == [], "nothing fires at creation"


@pytest.mark.parametrize(
    "when, expected",
    [
        # 09:00 on weekdays in India (UTC+05:30): NOW is Wednesday 03:43 there.
        ({"cron": "0 9 * * 1-5", "timezone": "Asia/Kolkata"},
         [at("Asia/Kolkata", 2023, 11, d, 9, 0) for d in (15, 16, 17, 20, 21)]),
        # 02:30 in New York across the spring-forward gap of 2024-03-10: once, right after the gap.
        ({"cron": "30 2 * * *", "timezone": "America/New_York",
          "start_at": at("America/New_York", 2024, 3, 9, 0, 0)},
         [at("America/New_York", 2024, 3, 9, 2, 30), at("America/New_York", 2024, 3, 10, 3, 0),
          *(at("America/New_York", 2024, 3, d, 2, 30) for d in (11, 12, 13))]),
        # Six fields: seconds first.
        ({"cron": "15,45 0 12 * * *", "timezone": "Europe/Paris"},
         [at("Europe/Paris", 2023, 11, d, 12, 0, s) for d in (15, 16) for s in (15, 45)]
         + [at("Europe/Paris", 2023, 11, 17, 12, 0, 15)]),
    ],
    ids=["weekdays-kolkata", "dst-gap-new-york", "seconds-paris"],
)
def test_next_fire_times_of_a_cron_in_a_time_zone(
    shared: Api, when: dict[str, Any], expected: list[float]
) -> None:
    doc = shared.create({"flow": "noop", **when})
    assert doc["next_fire_times"] == expected


def test_next_fire_times_of_every_count_from_start_at(shared: Api) -> None:
    api = shared
    doc = api.create({"flow": "noop", "every": 600, "start_at": NOW + 123})
    assert doc["next_fire_times"] == [NOW + 123 + 600 * k for k in range(5)]
    doc = api.create({"flow": "noop", "every": 3600, "end_at": NOW + 3 * 3600})
    first = math.floor(NOW / 3600) * 3600 + 3600
    assert doc["next_fire_times"] == [first, first + 3600, first + 7200], "none after end_at"
    doc = api.create({"flow": "noop", "run_at": NOW + 90})
    assert doc["next_fire_times"] == [NOW + 90]


def test_without_a_schedule_id_one_is_generated(shared: Api) -> None:
    api = shared
    first = api.create(EVERY)
    second = api.create(EVERY)
    assert first["schedule_id"] != second["schedule_id"], "no id: no replay, two schedules"
    for doc in (first, second):
        assert re.fullmatch(SCHEDULE_ID, doc["schedule_id"])
        assert api.get(f"/api/schedules/{doc['schedule_id']}").json()["schedule_id"] == doc["schedule_id"]
    assert sorted(api.stored()) == sorted([first["schedule_id"], second["schedule_id"]])


def test_the_same_id_and_body_again_is_200_with_the_same_schedule(api: Api) -> None:
    body = {"schedule_id": "nightly", "flow": "noop", "parameters": {"a": [1, 2.5, "x"]},
            "cron": "0 2 * * *", "timezone": "Europe/Berlin", "overlap": "buffer_one", "jitter": 5}
    created = api.create(body)
    r = api.client.post("/api/schedules", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == created
    # Later, with a firing behind it, a replay still answers with the stored schedule.
    api.step(0)
    api.step(4 * 3600)
    stored = api.get("/api/schedules/nightly").json()
    assert stored["last_scheduled_at"] != created["last_scheduled_at"]
    r = api.client.post("/api/schedules", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == stored
    assert list(api.stored()) == ["nightly"]


@pytest.mark.parametrize(
    "change",
    [{"every": 120}, {"parameters": {"n": 2}}, {"flow": "three"}, {"overlap": "allow_all"},
     {"every": None, "cron": "* * * * *"}, {"catchup_window": 10}],
)
def test_the_same_id_with_another_body_is_409_and_changes_nothing(
    shared: Api, change: dict[str, Any]
) -> None:
    api = shared
    body = {"schedule_id": "s1", "flow": "noop", "parameters": {"n": 1}, "every": 60}
    created = api.create(body)
    r = api.client.post("/api/schedules", json={**body, **change})
    assert r.status_code == 409, r.text
    assert "s1" in r.json()["error"]
    assert api.get("/api/schedules/s1").json() == created
    assert api.stored()["s1"].version == 1


def test_replaying_a_one_off_after_it_fired_is_200(api: Api) -> None:
    """A client that retries its POST (lost answer) after the one-off ran gets the schedule, not a 422."""
    body = {"schedule_id": "once", "flow": "noop", "run_at": NOW + 60}
    api.create(body)
    api.step(0)
    api.step(60)
    assert [r["task_id"] for r in api.runs("once")] == [f"sch.once.{round((NOW + 60) * 1000)}"]
    api.clock.advance(3600)  # the run_at is now older than the catch-up window
    r = api.client.post("/api/schedules", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "done"


def valid(**extra: Any) -> dict[str, Any]:
    return {"flow": "noop", "every": 60, **extra}


BAD_BODIES = [
    ("bad cron", {"flow": "noop", "cron": "0 2 * *"}, "cron"),
    ("cron out of range", {"flow": "noop", "cron": "61 * * * *"}, "cron"),
    ("unknown time zone", {"flow": "noop", "cron": "0 2 * * *", "timezone": "Mars/Base"}, "timezone"),
    ("localtime", {"flow": "noop", "cron": "0 2 * * *", "timezone": "localtime"}, "timezone"),
    ("unknown flow", {"flow": "nosuchflow", "every": 60}, "flow"),
    ("unknown task type", {"task_type": "nosuchtype", "every": 60}, "task_type"),
    ("run_at beyond the catch-up window", {"flow": "noop", "run_at": NOW - 301}, "run_at"),
    ("run_at beyond its own window", {"flow": "noop", "run_at": NOW - 20, "catchup_window": 10}, "run_at"),
    ("end_at before start_at", valid(start_at=NOW + 100, end_at=NOW + 50), "end_at"),
    ("end_at equal to start_at", valid(start_at=NOW + 100, end_at=NOW + 100), "end_at"),
    ("overlap misspelt", valid(overlap="skipp"), "overlap"),
    ("flow and task_type", {"flow": "noop", "task_type": "t", "every": 60}, "flow"),
    ("neither flow nor task_type", {"every": 60}, "flow"),
    ("none of run_at, cron, every", {"flow": "noop"}, "run_at"),
    ("run_at and cron", {"flow": "noop", "run_at": NOW + 60, "cron": "* * * * *"}, "cron"),
    ("cron and every", {"flow": "noop", "cron": "* * * * *", "every": 60}, "every"),
    ("unknown field", valid(bogus=1), "bogus"),
    ("misspelt field", valid(timezon="UTC"), "timezon"),
    ("schedule_id with a space", valid(schedule_id="bad id"), "schedule_id"),
    ("schedule_id with a dot", valid(schedule_id="a.b"), "schedule_id"),
    ("schedule_id with a slash", valid(schedule_id="a/b"), "schedule_id"),
    ("schedule_id too long", valid(schedule_id="x" * 41), "schedule_id"),
    ("every too small", {"flow": "noop", "every": 0.5}, "every"),
    ("negative jitter", valid(jitter=-1), "jitter"),
    ("jitter as long as every", valid(jitter=60), "jitter"),
    ("every as text", {"flow": "noop", "every": "1h"}, "every"),
    ("parameters with a task_type", {"task_type": "t", "parameters": {}, "every": 60}, "parameters"),
    ("task_content with a flow", valid(task_content="x"), "task_content"),
]


@pytest.mark.parametrize("body, field", [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES])
def test_bad_input_is_422_naming_the_field_and_stores_nothing(
    shared: Api, body: dict[str, Any], field: str
) -> None:
    api = shared
    r = api.client.post("/api/schedules", json=body)
    assert r.status_code == 422, r.text
    assert field in fields_of(r), r.json()
    assert all(d["problem"] for d in r.json()["detail"])
    assert api.get("/api/schedules").json() == {"schedules": []}
    assert api.stored() == {}


def test_a_registered_v1_task_type_is_accepted(api: Api) -> None:
    r = api.client.post("/api/schedules", json={"task_type": "inbox", "every": 60})
    assert r.status_code == 422
    assert fields_of(r) == ["task_type"]
    registered = api.ok("POST", "/v1/register_task", {"task_config_data": {"task_type": "inbox"}})
    assert registered["code"] == 0, registered
    doc = api.create({"task_type": "inbox", "task_stage": "s1", "task_content": "{}", "every": 60})
    assert (doc["task_type"], doc["task_stage"], doc["task_content"]) == ("inbox", "s1", "{}")
    assert doc["flow"] is None


@pytest.mark.parametrize(
    "parameters, status",
    [({"blob": "x" * (70 * 1024)}, 413), ({"name": "a\u0000b"}, 422)],
    ids=["over-64-KiB", "NUL"],
)
def test_parameters_a_task_would_refuse_are_refused(
    api: Api, parameters: dict[str, Any], status: int
) -> None:
    """POST /api/tasks refuses these parameters; a schedule must not create such tasks at every firing."""
    refused = api.client.post("/api/tasks", json={"flow": "noop", "parameters": parameters})
    assert refused.status_code == status
    r = api.client.post("/api/schedules", json={"flow": "noop", "parameters": parameters, "every": 60})
    assert r.status_code == status, r.text[:300]
    assert api.stored() == {}


# --- GET, PATCH, DELETE --------------------------------------------------------------------------


def test_list_pages_by_id(shared: Api) -> None:
    api = shared
    assert api.get("/api/schedules").json() == {"schedules": []}
    for sid in ("c3", "a1", "b2", "d4"):
        api.create({"schedule_id": sid, **EVERY})

    def ids(**params: Any) -> list[str]:
        r = api.get("/api/schedules", **params)
        assert r.status_code == 200, r.text
        return [d["schedule_id"] for d in r.json()["schedules"]]

    assert ids() == ["a1", "b2", "c3", "d4"]
    assert ids(limit=2) == ["a1", "b2"]
    assert ids(limit=2, after="b2") == ["c3", "d4"]
    assert ids(limit=2, after="d4") == []
    assert ids(after="a") == ["a1", "b2", "c3", "d4"]
    every_doc = api.get("/api/schedules").json()["schedules"][0]
    assert set(every_doc) == SCHEDULE_FIELDS
    assert len(every_doc["next_fire_times"]) == 5
    for params in ({"limit": 0}, {"limit": 1001}, {"after": "bad id"}):
        assert api.get("/api/schedules", **params).status_code == 422, params


def test_patch_changes_the_timing_and_the_next_fire_times_follow(api: Api) -> None:
    api.create({"schedule_id": "s1", "flow": "noop", "parameters": {"n": 1}, "every": 60, "note": "n1"})
    api.clock.advance(10)
    doc = api.ok("PATCH", "/api/schedules/s1", {"every": 3600})
    first = math.floor((NOW + 10) / 3600) * 3600 + 3600
    assert doc["next_fire_times"] == [first + 3600 * k for k in range(5)]
    assert (doc["every"], doc["parameters"], doc["note"]) == (3600.0, {"n": 1}, "n1"), "the rest is kept"
    assert (doc["created_at"], doc["updated_at"]) == (NOW, NOW + 10)
    # From every to cron: the other kind of time is cleared with null.
    change = {"every": None, "cron": "0 9 * * 1-5", "timezone": "Asia/Kolkata"}
    doc = api.ok("PATCH", "/api/schedules/s1", change)
    assert (doc["every"], doc["cron"]) == (None, "0 9 * * 1-5")
    assert doc["next_fire_times"] == [at("Asia/Kolkata", 2023, 11, d, 9, 0) for d in (15, 16, 17, 20, 21)]
    doc = api.ok("PATCH", "/api/schedules/s1", {"parameters": {"n": 2}, "overlap": "allow_all", "note": "n2"})
    assert (doc["parameters"], doc["overlap"], doc["note"]) == ({"n": 2}, "allow_all", "n2")
    assert api.get("/api/schedules/s1").json() == doc
    assert api.stored()["s1"].version == 4


def test_the_scheduler_follows_a_patch_and_a_delete(api: Api) -> None:
    api.create({"schedule_id": "hourly", "flow": "noop", "every": 3600})
    api.create({"schedule_id": "doomed", **EVERY})
    api.step(0)  # the leader holds both
    api.ok("PATCH", "/api/schedules/hourly", {"every": 60})
    assert api.client.delete("/api/schedules/doomed").status_code == 204
    api.step(40)  # NOW + 40: a whole minute
    assert [r["scheduled_at"] for r in api.runs("hourly")] == [NOW + 40]
    assert api.task_ids() == [f"sch.hourly.{round((NOW + 40) * 1000)}"]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"cron": "* * * * *"}, "every"),  # on top of every: two kinds of time
        ({"every": None, "cron": "0 2 * *"}, "cron"),
        ({"every": 0.1}, "every"),
        ({"timezone": "Mars/Base"}, "timezone"),
        ({"start_at": NOW + 100, "end_at": NOW + 50}, "end_at"),
        ({"overlap": "skipp"}, "overlap"),
        ({"flow": "nosuchflow"}, "flow"),
        ({"jitter": -1}, "jitter"),
        ({"bogus": 1}, "bogus"),
        ({"schedule_id": "other"}, "schedule_id"),
        ({"every": None}, "run_at"),
    ],
)
def test_patch_with_a_bad_value_is_422_and_the_schedule_is_unchanged(
    shared: Api, change: dict[str, Any], field: str
) -> None:
    api = shared
    before = api.create({"schedule_id": "s1", **EVERY})
    api.clock.advance(5)
    r = api.client.patch("/api/schedules/s1", json=change)
    assert r.status_code == 422, r.text
    assert field in fields_of(r), r.json()
    assert api.get("/api/schedules/s1").json() == before
    assert api.stored()["s1"].version == 1


def test_patch_of_a_one_off_that_already_fired(api: Api) -> None:
    """Changing the note of a done one-off must not fail on its (past) run_at."""
    api.create({"schedule_id": "once", "flow": "noop", "run_at": NOW + 60})
    api.step(0)
    api.step(60)
    api.clock.advance(3600)
    r = api.client.patch("/api/schedules/once", json={"note": "ran fine"})
    assert r.status_code == 200, r.text
    assert (r.json()["note"], r.json()["state"]) == ("ran fine", "done")


def test_delete_removes_the_schedule_and_its_runs(api: Api) -> None:
    api.create({"schedule_id": "s1", **EVERY})
    api.create({"schedule_id": "s2", **EVERY})
    assert len(api.ok("POST", "/api/schedules/s1/trigger")["runs"]) == 1
    r = api.client.delete("/api/schedules/s1")
    assert r.status_code == 204 and r.content == b""
    assert api.get("/api/schedules/s1").status_code == 404
    assert api.get("/api/schedules/s1/runs").status_code == 404
    assert list(api.stored()) == ["s2"]
    assert api.app.runtime.schedule_store.runs("s1", 10) == []
    assert api.client.delete("/api/schedules/s1").status_code == 404
    # The id is free again.
    assert api.create({"schedule_id": "s1", "flow": "three", "every": 120})["flow"] == "three"
    assert api.runs("s1") == []


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "", None),
        ("PATCH", "", {"note": "x"}),
        ("DELETE", "", None),
        ("POST", "/pause", {"note": "x"}),
        ("POST", "/resume", None),
        ("POST", "/trigger", None),
        ("POST", "/backfill", {"start": NOW - 3600, "end": NOW}),
        ("GET", "/runs", None),
    ],
)
def test_an_unknown_id_is_404_on_every_route(shared: Api, method: str, path: str, body: Any) -> None:
    api = shared
    api.create({"schedule_id": "known", **EVERY})
    r = api.client.request(method, f"/api/schedules/nosuch{path}", json=body)
    assert r.status_code == 404, r.text
    assert r.json()["error"] == "no schedule 'nosuch'"
    assert list(api.stored()) == ["known"]


# --- pause, resume, trigger, backfill, runs ------------------------------------------------------


def test_pause_with_a_note_then_resume_and_nothing_fires_while_paused(api: Api) -> None:
    api.create({"schedule_id": "m", **EVERY})
    api.step(0)  # lead, load the timetable
    api.step(40)  # NOW + 40 = 22:14:00: the first firing
    assert [r["scheduled_at"] for r in api.runs("m")] == [NOW + 40]

    doc = api.ok("POST", "/api/schedules/m/pause", {"note": "db maintenance"})
    assert (doc["state"], doc["paused"], doc["note"]) == ("paused", True, "db maintenance")
    assert len(doc["next_fire_times"]) == 5, "what would fire once resumed"
    for _ in range(5):
        api.step(60)
    assert [r["scheduled_at"] for r in api.runs("m")] == [NOW + 40], "nothing fired while paused"
    assert api.task_ids() == [f"sch.m.{round((NOW + 40) * 1000)}"]
    assert api.get("/api/schedules/m").json()["state"] == "paused"
    # Pausing again without a note keeps the note.
    assert api.ok("POST", "/api/schedules/m/pause")["note"] == "db maintenance"

    api.clock.advance(5)  # NOW + 345
    doc = api.ok("POST", "/api/schedules/m/resume")
    assert (doc["state"], doc["paused"], doc["note"]) == ("active", False, "db maintenance")
    assert doc["next_fire_times"][0] == NOW + 400, "the firings of the pause are not made up for"
    api.step(55)  # NOW + 400
    runs = api.runs("m")
    assert [r["scheduled_at"] for r in runs] == [NOW + 400, NOW + 40]
    assert all(r["state"] in ("fired", "skipped") for r in runs)


def test_unpausing_through_patch_does_not_make_up_for_the_pause_either(api: Api) -> None:
    """PATCH {paused: false} is a resume: the firings that fell in the pause are not made up for."""
    api.create({"schedule_id": "m", **EVERY, "overlap": "allow_all"})
    api.step(0)
    api.step(40)  # fires NOW + 40
    api.ok("POST", "/api/schedules/m/pause", {"note": "x"})
    for _ in range(10):
        api.step(60)  # NOW + 640
    assert [r["scheduled_at"] for r in api.runs("m")] == [NOW + 40]
    doc = api.ok("PATCH", "/api/schedules/m", {"paused": False})
    assert doc["state"] == "active"
    assert doc["next_fire_times"][0] == NOW + 700, "the next one after now, as /resume gives"
    api.step(0.5)
    assert [r["scheduled_at"] for r in api.runs("m")] == [NOW + 40]
    assert len(api.task_ids()) == 1


def test_trigger_fires_now_and_the_task_shows_its_schedule(api: Api) -> None:
    api.create({"schedule_id": "nightly", "flow": "noop", "parameters": {"who": "ops"}, "cron": "0 3 * * *"})
    api.clock.advance(0.25)
    answer = api.ok("POST", "/api/schedules/nightly/trigger")
    task_id = f"sch.nightly.{round((NOW + 0.25) * 1000)}"
    assert answer == {"runs": [{"scheduled_at": NOW + 0.25, "fired_at": NOW + 0.25, "task_id": task_id,
                                "status": "pending", "state": "fired", "reason": None}]}
    task = api.get(f"/api/tasks/{task_id}").json()
    assert (task["flow"], task["parameters"], task["status_name"]) == ("noop", {"who": "ops"}, "pending")
    assert (task["schedule_id"], task["scheduled_at"]) == ("nightly", NOW + 0.25)
    listed = {t["task_id"]: t for t in api.get("/api/tasks").json()["tasks"]}
    assert (listed[task_id]["schedule_id"], listed[task_id]["scheduled_at"]) == ("nightly", NOW + 0.25)
    assert [m.task_id for m in api.app.publisher.messages] == [task_id], "its first step is published"
    # A task submitted by hand has no schedule.
    own = api.client.post("/api/tasks", json={"flow": "noop"}).json()
    assert (own["schedule_id"], own["scheduled_at"]) == (None, None)
    # A trigger while paused still applies the overlap policy: the first task still runs.
    api.ok("POST", "/api/schedules/nightly/pause")
    api.clock.advance(1)
    fired = api.ok("POST", "/api/schedules/nightly/trigger")["runs"]
    assert [(r["state"], r["reason"]) for r in fired] == [("skipped", "overlap")]
    assert len(api.runs("nightly")) == 2


def test_backfill_fires_each_missing_time_once(api: Api) -> None:
    api.create({"schedule_id": "nightly", "flow": "noop", "cron": "0 2 * * *", "overlap": "allow_all"})
    start, end = at("UTC", 2023, 11, 12), NOW - 3600
    runs = api.ok("POST", "/api/schedules/nightly/backfill", {"start": start, "end": end})["runs"]
    expected = [at("UTC", 2023, 11, d, 2) for d in (14, 13, 12)]
    assert [r["scheduled_at"] for r in runs] == expected, "newest first"
    assert all(r["state"] == "fired" and r["status"] == "pending" and r["fired_at"] == NOW for r in runs)
    assert [r["task_id"] for r in runs] == [f"sch.nightly.{round(t * 1000)}" for t in expected]
    assert api.task_ids() == sorted(r["task_id"] for r in runs)

    again = api.ok("POST", "/api/schedules/nightly/backfill", {"start": start, "end": end})
    assert again == {"runs": []}, "a second identical backfill creates nothing"
    wider = api.ok("POST", "/api/schedules/nightly/backfill", {"start": start - 86400, "end": NOW})["runs"]
    assert [r["scheduled_at"] for r in wider] == [at("UTC", 2023, 11, 11, 2)], "only the missing one"
    assert len(api.task_ids()) == 4
    assert [r["scheduled_at"] for r in api.runs("nightly")] == [*expected, at("UTC", 2023, 11, 11, 2)]

    r = api.client.post("/api/schedules/nightly/backfill", json={"start": NOW, "end": NOW - 86400})
    assert r.status_code == 422, r.text
    assert fields_of(r) == ["end"]
    for bad in ({"start": NOW}, {"start": "yesterday", "end": NOW}, {"start": 0, "end": NOW, "x": 1}):
        assert api.client.post("/api/schedules/nightly/backfill", json=bad).status_code == 422, bad
    assert len(api.task_ids()) == 4
    api.create({"schedule_id": "fast", "flow": "noop", "every": 1})
    r = api.client.post("/api/schedules/fast/backfill", json={"start": NOW - 3 * 3600, "end": NOW})
    assert r.status_code == 422, "more than 10,000 firings"
    assert fields_of(r) == ["end"]
    assert len(api.task_ids()) == 4


def test_runs_are_newest_first_with_the_status_of_the_task(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    api.create({"schedule_id": "m", **EVERY})
    api.step(0)
    api.step(40)  # fires NOW + 40
    first = f"sch.m.{round((NOW + 40) * 1000)}"
    runs = api.runs("m")
    assert runs == [{"scheduled_at": NOW + 40, "fired_at": NOW + 40, "task_id": first, "status": "pending",
                     "state": "fired", "reason": None}]
    api.drain(monkeypatch)
    assert api.get(f"/api/tasks/{first}").json()["status_name"] == "success"
    assert api.runs("m")[0]["status"] == "success"

    api.step(60)  # NOW + 100: the first ended, this one fires
    api.step(60)  # NOW + 160: the second still runs, skipped
    runs = api.runs("m")
    assert [r["scheduled_at"] for r in runs] == [NOW + 160, NOW + 100, NOW + 40]
    assert [r["status"] for r in runs] == ["skipped", "pending", "success"]
    assert runs[0] == {"scheduled_at": NOW + 160, "fired_at": None, "task_id": None, "status": "skipped",
                       "state": "skipped", "reason": "overlap"}
    assert all(set(r) == RUN_FIELDS for r in runs)
    assert [r["scheduled_at"] for r in api.runs("m", limit=1)] == [NOW + 160]
    assert [r["scheduled_at"] for r in api.runs("m", before=NOW + 160)] == [NOW + 100, NOW + 40]
    assert api.get("/api/schedules/m/runs", limit=0).status_code == 422


def test_a_v1_task_type_schedule_creates_v1_tasks(api: Api) -> None:
    inbox = {"task_config_data": {"task_type": "inbox", "max_retry_num": 2}}
    assert api.ok("POST", "/v1/register_task", inbox)["code"] == 0
    api.create({"schedule_id": "poll", "task_type": "inbox", "task_stage": "s1",
                "task_content": '{"folder": "in"}', "every": 300})
    api.step(0)
    api.step(100)  # NOW + 100 is a multiple of 300
    task_id = f"sch.poll.{round((NOW + 100) * 1000)}"
    assert [(r["task_id"], r["status"]) for r in api.runs("poll")] == [(task_id, "pending")]
    got = api.get("/v1/get_task", task_id=task_id).json()
    assert got["code"] == 0, got
    task = got["task_data"]
    assert (task["task_type"], task["task_stage"], task["task_content"], task["status"]) == (
        "inbox", "s1", '{"folder": "in"}', 1)
    assert task["max_retry_num"] == 2, "the type's settings"
    listed = api.get("/v1/get_task_list", task_type="inbox").json()
    assert [t["task_id"] for t in listed["task_list"]] == [task_id]
    assert api.task_ids() == [], "no flow task"
    # A worker takes and finishes it: the run shows the v1 status.
    held = api.ok("POST", "/v1/hold_tasks", {"task_type": "inbox"})
    assert [t["task_id"] for t in held["task_list"]] == [task_id]
    assert api.runs("poll")[0]["status"] == "running"
    assert api.ok("POST", "/v1/set_task", {"task_data": {"task_id": task_id, "status": 3}})["code"] == 0
    assert api.runs("poll")[0]["status"] == "success"


# --- API keys ------------------------------------------------------------------------------------------


def test_another_users_schedule_is_404_and_an_admin_sees_it(keyed: Api) -> None:
    doc = keyed.create({"schedule_id": "mine", **EVERY}, key=ALICE)
    assert doc["user_id"] == "alice"
    for method, path, body in [
        ("GET", "", None), ("GET", "/runs", None), ("POST", "/pause", {"note": "x"}),
        ("POST", "/resume", None),
        ("POST", "/trigger", None), ("POST", "/backfill", {"start": NOW - 600, "end": NOW}),
        ("PATCH", "", {"every": 120}), ("DELETE", "", None),
    ]:
        r = keyed.client.request(method, f"/api/schedules/mine{path}", json=body, headers=bearer(BOB))
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"] == "no schedule 'mine'"
    assert keyed.get("/api/schedules", BOB).json() == {"schedules": []}
    stored = keyed.stored()["mine"]
    assert (stored.version, stored.paused, stored.when.every) == (1, False, 60.0), "bob changed nothing"
    assert keyed.runs("mine", ALICE) == []
    assert keyed.get("/api/schedules/mine", ROOT).json() == keyed.get("/api/schedules/mine", ALICE).json()
    assert [d["schedule_id"] for d in keyed.get("/api/schedules", ROOT).json()["schedules"]] == ["mine"]
    assert keyed.client.get("/api/schedules/mine").status_code == 401
    assert keyed.client.post("/api/schedules", json=EVERY).status_code == 401
    assert keyed.client.post("/api/schedules", json={**EVERY, "user_id": "alice"},
                             headers=bearer(BOB)).status_code == 403
    assert list(keyed.stored()) == ["mine"]


def test_the_tasks_of_a_users_schedule_carry_the_users_id(keyed: Api) -> None:
    every = {**EVERY, "overlap": "allow_all"}
    keyed.create({"schedule_id": "mine", **every}, key=ALICE)
    keyed.create({"schedule_id": "theirs", **every, "user_id": "alice"}, key=ROOT)
    keyed.create({"schedule_id": "ops", **every}, key=ROOT)
    fired = keyed.ok("POST", "/api/schedules/mine/trigger", key=ALICE)["runs"][0]["task_id"]
    keyed.step(0)
    keyed.step(40)
    store = keyed.app.runtime.store
    for sid, user in (("mine", "alice"), ("theirs", "alice"), ("ops", "ops")):
        task_id = f"sch.{sid}.{round((NOW + 40) * 1000)}"
        assert store.get(task_id).user_id == user, sid
    assert store.get(fired).user_id == "alice"
    assert keyed.get(f"/api/tasks/{fired}", ALICE).json()["schedule_id"] == "mine"
    assert keyed.get(f"/api/tasks/{fired}", BOB).status_code == 404
    assert sorted(d["schedule_id"] for d in keyed.get("/api/schedules", ALICE).json()["schedules"]) == [
        "mine", "theirs"]
    assert keyed.get("/api/schedules", BOB).json() == {"schedules": []}


def test_a_users_list_pages_through_their_own_schedules(keyed: Api) -> None:
    """Paging with limit/after must not end early because of other users' schedules."""
    for sid in ("a1", "a2", "a3"):
        keyed.create({"schedule_id": sid, **EVERY}, key=ALICE)
    keyed.create({"schedule_id": "b1", **EVERY}, key=BOB)
    keyed.create({"schedule_id": "b2", **EVERY}, key=BOB)
    r = keyed.get("/api/schedules", BOB, limit=2)
    assert [d["schedule_id"] for d in r.json()["schedules"]] == ["b1", "b2"]
    r = keyed.get("/api/schedules", ALICE, limit=2, after="a2")
    assert [d["schedule_id"] for d in r.json()["schedules"]] == ["a3"]


def test_a_v1_schedule_of_a_user_creates_that_users_v1_tasks(keyed: Api) -> None:
    inbox = {"task_config_data": {"task_type": "inbox"}}
    assert keyed.ok("POST", "/v1/register_task", inbox, key=ROOT)["code"] == 0
    keyed.create({"schedule_id": "poll", "task_type": "inbox", "every": 60}, key=ALICE)
    task_id = keyed.ok("POST", "/api/schedules/poll/trigger", key=ALICE)["runs"][0]["task_id"]
    assert keyed.get("/v1/get_task", ALICE, task_id=task_id).json()["task_data"]["user_id"] == "alice"
    assert keyed.get("/v1/get_task", BOB, task_id=task_id).json()["code"] == 2


# --- OpenAPI ---------------------------------------------------------------------------------------------


def test_openapi_lists_the_schedule_paths(shared: Api) -> None:
    doc = shared.get("/openapi.json").json()
    paths = doc["paths"]
    expected = {
        "/api/schedules": {"get", "post"},
        "/api/schedules/{schedule_id}": {"get", "patch", "delete"},
        "/api/schedules/{schedule_id}/pause": {"post"},
        "/api/schedules/{schedule_id}/resume": {"post"},
        "/api/schedules/{schedule_id}/trigger": {"post"},
        "/api/schedules/{schedule_id}/backfill": {"post"},
        "/api/schedules/{schedule_id}/runs": {"get"},
    }
    for path, methods in expected.items():
        assert path in paths, path
        assert set(paths[path]) == methods, path
    body = doc["components"]["schemas"]["Definition"]["properties"]
    assert {"schedule_id", "flow", "task_type", "run_at", "cron", "every", "timezone", "overlap"} <= set(body)
