"""The Asyncflow v1 API, field by field, on SQLite and PostgreSQL (seed 000 §一)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from oss_api.app import create_app
from oss_api.testing import TestClient
from shared.flows import load_flows
from shared.scheduler import sweep_leases
from shared.storage.sql import SqlStore
from shared.testing import InProcess, ManualClock

SUPPORT = Path(__file__).resolve().parents[1] / "support"
TASK_FIELDS = {
    "user_id", "task_id", "task_type", "task_stage", "stage", "status", "priority", "crt_retry_num",
    "max_retry_num", "max_retry_interval", "max_processing_time", "schedule_log", "task_content",
    "order_time", "create_time", "modify_time",
}


class V1:
    def __init__(self, store: SqlStore, home: Path) -> None:
        app = InProcess(load_flows(SUPPORT / "flows.yaml"), home, store)
        self.runtime = app.runtime
        self.clock = app.clock
        self.http = TestClient(create_app(self.runtime))

    def post(self, path: str, body: Any) -> dict[str, Any]:
        response = self.http.post("/v1/" + path, json=body)
        assert response.status_code == 200, response.text
        return response.json()

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        response = self.http.get("/v1/" + path, params=params)
        assert response.status_code == 200, response.text
        return response.json()

    def register(self, task_type: str = "video", **config: Any) -> None:
        assert self.post("register_task_type", {"task_type_data": {"task_type": task_type, **config}})["code"] == 0

    def create(self, **data: Any) -> str:
        answer = self.post("create_task", {"task_data": {"task_type": "video", **data}})
        assert answer["code"] == 0 and answer["msg"] == "SUCCESS", answer
        return answer["task_id"]

    def hold(self, task_type: str = "video") -> list[dict[str, Any]]:
        answer = self.post("hold_tasks", {"task_type": task_type})
        assert answer["code"] == 0, answer
        return answer["task_list"]

    def set(self, **data: Any) -> dict[str, Any]:
        return self.post("set_task", {"task_data": data})

    def count(self) -> int:
        return self.get("get_task_counts_by_type", task_type="video")["task_count"]


@pytest.fixture
def v1(sql_store: SqlStore, tmp_path: Path) -> V1:
    return V1(sql_store, tmp_path)


def test_ping(v1: V1) -> None:
    assert v1.get("ping") == {"code": 0, "msg": "SUCCESS"}


def test_register_task_type_defaults_and_register_task_changes_some_fields(v1: V1) -> None:
    v1.register("video")
    v1.register("audio", schedule_limit=5, max_retry_num=1, max_retry_interval=-2)
    answer = v1.post("register_task", {"task_config_data": {"task_type": "video", "schedule_limit": 7}})
    assert answer == {"code": 0, "msg": "SUCCESS"}
    listed = v1.get("get_task_schedule_cfg_list")
    assert listed["code"] == 0
    assert listed["task_schedule_cfg_list"] == [
        {"task_type": "audio", "schedule_limit": 5, "schedule_interval": 1, "max_processing_time": 300,
         "max_retry_num": 1, "max_retry_interval": -2},
        {"task_type": "video", "schedule_limit": 7, "schedule_interval": 1, "max_processing_time": 300,
         "max_retry_num": 3, "max_retry_interval": 10},
    ]


def test_register_task_on_a_new_type_creates_it(v1: V1) -> None:
    # Seed 000 §一.1.2: register_task inserts the type's configuration too.
    answer = v1.post("register_task", {"task_config_data": {"task_type": "image", "schedule_limit": 3}})
    assert answer == {"code": 0, "msg": "SUCCESS"}
    (config,) = v1.get("get_task_schedule_cfg_list")["task_schedule_cfg_list"]
    assert config == {"task_type": "image", "schedule_limit": 3, "schedule_interval": 1, "max_processing_time": 300,
                      "max_retry_num": 3, "max_retry_interval": 10}
    assert v1.post("create_task", {"task_data": {"task_type": "image"}})["code"] == 0


def test_create_get_and_every_field(v1: V1) -> None:
    v1.register()
    task_id = v1.create(task_content='{"SourceUrl":"http://v/1"}', task_priority=3, user_id="alice")
    answer = v1.get("get_task", task_id=task_id)
    assert answer["code"] == 0 and answer["msg"] == "SUCCESS"
    data = answer["task_data"]
    assert set(data) == TASK_FIELDS
    assert (data["task_id"], data["user_id"], data["status"], data["task_content"]) == (
        task_id, "alice", 1, '{"SourceUrl":"http://v/1"}'
    )
    assert data["order_time"] == int(v1.clock.now - 3) and data["crt_retry_num"] == 0
    # A client-chosen task_id is the idempotency key.
    assert v1.create(task_id="mine-1") == "mine-1" == v1.create(task_id="mine-1")
    assert v1.count() == 2


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"task_data": {"task_type": "nope"}}, "NOT_FOUND"),
        ({"task_data": {}}, "INPUT_INVALID"),
        ({}, "INPUT_INVALID"),
        ({"task_data": {"task_type": "video", "task_priority": "high"}}, "INPUT_INVALID"),
        ({"task_data": {"task_type": "video", "task_content": {"not": "a string"}}}, "INPUT_INVALID"),
        ({"task_data": {"task_type": "video", "task_content": "x" * 5000}}, "INPUT_INVALID"),
        ({"task_data": {"task_type": "video", "task_id": "../../etc"}}, "INPUT_INVALID"),
    ],
)
def test_bad_create_is_refused_with_a_reason_and_nothing_stored(v1: V1, body: Any, reason: str) -> None:
    v1.register()
    answer = v1.post("create_task", body)
    assert answer["code"] != 0 and answer["msg"].startswith(reason + "::") and "task_id" not in answer
    assert v1.count() == 0


def test_create_tasks_stores_a_batch_in_order_with_each_type_s_settings(v1: V1) -> None:
    v1.register("video", max_retry_num=4)
    v1.register("audio", max_processing_time=60)
    v1.create(task_id="again", user_id="alice")
    tasks = [
        {"task_type": "video", "task_content": "a", "user_id": "alice"},
        {"task_type": "audio", "task_id": "mine", "task_priority": 2},
        {"task_type": "video", "task_id": "again", "user_id": "alice"},  # a replay
    ]
    answer = v1.post("create_tasks", {"task_list": tasks})
    assert answer["code"] == 0, answer
    ids = answer["task_id_list"]
    assert ids[1:] == ["mine", "again"] and ids[0].endswith("_video")
    first = v1.get("get_task", task_id=ids[0])["task_data"]
    assert (first["task_content"], first["user_id"], first["max_retry_num"], first["status"]) == ("a", "alice", 4, 1)
    mine = v1.get("get_task", task_id="mine")["task_data"]
    assert (mine["task_type"], mine["max_processing_time"], mine["order_time"]) == ("audio", 60, int(v1.clock.now - 2))
    assert v1.count() == 2 and [t["task_id"] for t in v1.hold("audio")] == ["mine"]


@pytest.mark.parametrize(
    ("bad", "reason", "names"),
    [
        ({"task_type": "nope"}, "NOT_FOUND", "tasks[1]: unknown task_type 'nope'"),
        ({"task_type": "video", "task_id": "t0"}, "INPUT_INVALID", "tasks[1]: task_id 't0' is also that of tasks[0]"),
        ({"task_type": "video", "task_id": "taken"}, "CONFLICT", "task id 'taken' is already used"),
        ({"task_type": "video", "task_priority": "high"}, "INPUT_INVALID", "task_list.1.task_priority"),
    ],
)
def test_one_refused_task_stores_none_of_the_batch(v1: V1, bad: dict[str, Any], reason: str, names: str) -> None:
    v1.register("video")
    v1.register("other")
    assert v1.post("create_task", {"task_data": {"task_type": "other", "task_id": "taken"}})["code"] == 0
    answer = v1.post("create_tasks", {"task_list": [{"task_type": "video", "task_id": "t0"}, bad, {"task_type": "video"}]})
    assert answer["code"] != 0 and answer["msg"].startswith(reason + "::") and names in answer["msg"], answer
    assert "task_id_list" not in answer
    assert v1.count() == 0


@pytest.mark.parametrize("task_list", [[], [{"task_type": "video"}] * 1001])
def test_create_tasks_takes_1_to_1000(v1: V1, task_list: list[Any]) -> None:
    v1.register()
    answer = v1.post("create_tasks", {"task_list": task_list})
    assert answer["code"] != 0 and answer["msg"].startswith("INPUT_INVALID::") and "task_list" in answer["msg"]
    assert v1.count() == 0


def test_malformed_json_is_refused(v1: V1) -> None:
    answer = v1.http.post("/v1/create_task", content=b"{nope").json()
    assert answer["code"] == 1 and answer["msg"].startswith("INPUT_INVALID::")


def test_hold_leases_up_to_schedule_limit_by_order_time(v1: V1) -> None:
    v1.register(schedule_limit=2)
    low = v1.create(task_priority=0)
    v1.clock.advance(1)
    high = v1.create(task_priority=100)
    v1.clock.advance(1)
    later = v1.create()
    held = v1.hold()
    assert [t["task_id"] for t in held] == [high, low]
    assert all(t["status"] == 2 and set(t) == TASK_FIELDS for t in held)
    assert [t["task_id"] for t in v1.hold()] == [later]
    assert v1.hold() == []
    assert v1.get("get_task", task_id=low)["task_data"]["status"] == 2


def test_failed_high_priority_task_does_not_jump_the_queue(v1: V1) -> None:
    v1.register(schedule_limit=1, max_retry_interval=10)
    vip = v1.create(task_priority=1000)
    v1.clock.advance(1)
    (held,) = v1.hold()
    assert held["task_id"] == vip
    other = v1.create()
    assert v1.set(task_id=vip, status=4, schedule_log="boom")["code"] == 0
    # The failed one waits its retry interval (1 s for the first retry) behind the others.
    assert [t["task_id"] for t in v1.hold()] == [other]
    assert v1.hold() == []
    v1.clock.advance(1)
    retried = v1.hold()
    assert [(t["task_id"], t["crt_retry_num"], t["schedule_log"]) for t in retried] == [(vip, 1, "boom")]


def test_retries_then_failed(v1: V1) -> None:
    v1.register(max_retry_num=2, max_retry_interval=-1)
    task_id = v1.create()
    for _ in range(2):
        (t,) = v1.hold()
        v1.set(task_id=task_id, status=4)
        v1.clock.advance(1)
    (t,) = v1.hold()
    assert v1.set(task_id=task_id, status=4)["code"] == 0
    data = v1.get("get_task", task_id=task_id)["task_data"]
    assert (data["status"], data["crt_retry_num"]) == (4, 2)


def test_multi_stage_goes_behind_waiting_tasks(v1: V1) -> None:
    v1.register(schedule_limit=1)
    first = v1.create(task_stage="submit")
    v1.clock.advance(1)
    second = v1.create(task_stage="submit")
    (t,) = v1.hold()
    assert t["task_id"] == first
    v1.clock.advance(1)
    answer = v1.set(task_id=first, status=1, task_stage="transcode", task_content='{"job":42}')
    assert answer == {"code": 0, "msg": "SUCCESS"}
    assert [t["task_id"] for t in v1.hold()] == [second]
    (again,) = v1.hold()
    assert (again["task_id"], again["task_stage"], again["task_content"]) == (first, "transcode", '{"job":42}')
    assert v1.set(task_id=first, status=3)["code"] == 0
    assert v1.get("get_task", task_id=first)["task_data"]["status"] == 3


def test_a_worker_that_sends_every_field_of_its_struct(v1: V1) -> None:
    """Zero values ("" and null, as struct-based clients send them) leave the stored value alone."""
    v1.register(schedule_limit=1)
    blank = {"task_id": "", "user_id": "", "task_stage": "", "task_content": "", "task_priority": 0}
    answer = v1.post("create_task", {"task_data": {**blank, "task_type": "video", "task_stage": "submit",
                                                   "task_content": '{"url":"u"}'}})
    assert answer["code"] == 0, answer
    task_id = answer["task_id"]
    (held,) = v1.hold()
    # "Not done yet, look again later": the held struct sent back with its status set to pending.
    again = {**held, "status": 1, "task_stage": "", "task_content": "", "schedule_log": None}
    assert v1.set(**again)["code"] == 0
    data = v1.get("get_task", task_id=task_id)["task_data"]
    assert (data["status"], data["stage"], data["task_content"], data["crt_retry_num"]) == (
        1, "submit", '{"url":"u"}', 0
    )
    v1.hold()
    assert v1.set(task_id=task_id, task_type="video", status=3, task_stage="", task_content="",
                  schedule_log="", crt_retry_num=0)["code"] == 0
    data = v1.get("get_task", task_id=task_id)["task_data"]
    assert (data["status"], data["stage"], data["task_content"]) == (3, "submit", '{"url":"u"}')


def test_set_task_refusals(v1: V1) -> None:
    v1.register()
    task_id = v1.create()
    pending = v1.set(task_id=task_id, status=3)
    assert pending["code"] == 3 and pending["msg"].startswith("CONFLICT::")
    assert v1.set(task_id="missing", status=3)["code"] == 2
    assert v1.set(task_id=task_id, status=9)["code"] == 1
    assert v1.post("set_task", {"task_data": {"status": 3}})["code"] == 1


def test_lease_expiry_returns_the_task_to_pending(v1: V1) -> None:
    v1.register(max_processing_time=60)
    task_id = v1.create()
    v1.hold()
    service = v1.runtime.pull_service
    v1.clock.advance(59)
    assert sweep_leases(service, v1.clock()) == 0
    v1.clock.advance(1)
    assert sweep_leases(service, v1.clock()) == 1
    data = v1.get("get_task", task_id=task_id)["task_data"]
    assert (data["status"], data["crt_retry_num"]) == (1, 1)


def test_a_heartbeat_lease_ends_when_the_reports_stop_not_at_max_processing_time(v1: V1) -> None:
    v1.register(max_processing_time=3600)
    task_id = v1.create()
    answer = v1.post("hold_tasks", {"task_type": "video", "heartbeat": True})
    assert [t["task_id"] for t in answer["task_list"]] == [task_id]
    timeout = answer["heartbeat_timeout"]
    assert timeout == 15.0  # three heartbeat intervals of 5 s
    service = v1.runtime.pull_service
    for _ in range(4):  # the worker reports it alive: each report renews the lease
        v1.clock.advance(timeout - 1)
        assert v1.set(task_id=task_id, status=2)["code"] == 0
        assert sweep_leases(service, v1.clock()) == 0
    v1.clock.advance(timeout)  # then silence: the worker is gone
    assert sweep_leases(service, v1.clock()) == 1
    data = v1.get("get_task", task_id=task_id)["task_data"]
    assert (data["status"], data["crt_retry_num"]) == (1, 1)
    assert data["schedule_log"].endswith("lease expired: worker lost, no heartbeat within 15 s")
    # Held again without heartbeats: the lease is max_processing_time again.
    v1.clock.advance(60)
    v1.hold()
    v1.clock.advance(timeout + 1)
    assert sweep_leases(service, v1.clock()) == 0


def test_metrics_count_creates_leases_reports_and_endings(v1: V1) -> None:
    def counts() -> dict[str, float]:
        samples = {
            "created": ("asyncflow_v1_tasks_created_total", {}),
            "leased": ("asyncflow_v1_tasks_leased_total", {}),
            "reported 1": ("asyncflow_v1_reports_total", {"status": "1"}),
            "reported 3": ("asyncflow_v1_reports_total", {"status": "3"}),
            "reported 4": ("asyncflow_v1_reports_total", {"status": "4"}),
            "succeeded": ("asyncflow_v1_tasks_finished_total", {"status": "3"}),
            "failed": ("asyncflow_v1_tasks_finished_total", {"status": "4"}),
        }
        return {
            key: REGISTRY.get_sample_value(name, {"task_type": "video", **labels}) or 0.0
            for key, (name, labels) in samples.items()
        }

    v1.register(max_retry_num=0)
    before = counts()
    done, failed, staged = v1.create(), v1.create(), v1.create()
    v1.create(task_id=done)  # the same task again: not a new one
    assert len(v1.hold()) == 3
    v1.set(task_id=done, status=3)
    v1.set(task_id=failed, status=4)
    v1.set(task_id=staged, status=1, task_stage="next")
    assert v1.set(task_id=done, status=3)["code"] == 3  # refused: not counted
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {
        "created": 3, "leased": 3, "reported 1": 1, "reported 3": 1, "reported 4": 1, "succeeded": 1, "failed": 1,
    }
    assert 'asyncflow_v1_tasks_leased_total{task_type="video"}' in v1.http.get("/metrics").text


def test_list_and_counts(v1: V1) -> None:
    v1.register()
    v1.register("audio")
    ids = [v1.create(task_stage="a" if i % 2 else "b") for i in range(5)]
    v1.post("create_task", {"task_data": {"task_type": "audio"}})
    v1.hold()
    listed = v1.get("get_task_list", task_type="video", status=2, limit=3)
    assert listed["code"] == 0 and len(listed["task_list"]) == 3
    assert all(t["status"] == 2 and t["task_type"] == "video" for t in listed["task_list"])
    staged = v1.get("get_task_list", task_type="video", stage="a", limit=100)["task_list"]
    assert sorted(t["task_id"] for t in staged) == sorted(ids[1::2])
    assert v1.get("get_task_list", limit=0)["code"] == 1
    counts = v1.get("get_task_counts_by_type", task_type="video")
    assert counts["task_count"] == 5 and counts["task_count_by_status"]["2"] == 5
    assert v1.get("get_task_counts_by_type", task_type="nope")["code"] == 2


def test_holds_that_arrive_together_share_claims_and_never_a_task(v1: V1) -> None:
    """64 hold_tasks calls at once through the API: served in batches, each task leased once."""
    v1.register(schedule_limit=3)
    for i in range(150):
        v1.create(task_id=f"t{i:03}")
    batches = REGISTRY.get_sample_value("asyncflow_api_intake_batch_size_count", {"call": "hold_tasks"}) or 0.0
    app = create_app(v1.runtime)

    async def hold_at_once() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://v1") as client:
            calls = [client.post("/v1/hold_tasks", json={"task_type": "video"}) for _ in range(64)]
            return [answer.json() for answer in await asyncio.gather(*calls)]

    answers = asyncio.run(hold_at_once())
    assert all(a["code"] == 0 and len(a["task_list"]) <= 3 for a in answers), answers
    held = Counter(t["task_id"] for a in answers for t in a["task_list"])
    assert len(held) == 150 and max(held.values()) == 1
    served = REGISTRY.get_sample_value("asyncflow_api_intake_batch_size_count", {"call": "hold_tasks"}) or 0.0
    assert 0 < served - batches < 64  # some calls waited for a claim in progress and shared the next


def test_concurrent_holders_never_share_a_task(sql_store: SqlStore, tmp_path: Path) -> None:
    """8 workers hold from one type until 5,000 tasks are drained: each task exactly once."""
    v1 = V1(sql_store, tmp_path)
    v1.register(schedule_limit=50)
    service = v1.runtime.pull_service
    service.clock = ManualClock(v1.clock.now)
    for i in range(5000):
        service.create("video", f'{{"n":{i}}}')
    seen: Counter[str] = Counter()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while batch := service.hold("video"):
                with lock:
                    seen.update(t.task_id for t in batch)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(seen) == 5000 and max(seen.values()) == 1
