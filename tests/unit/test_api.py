"""The native HTTP API over a real TaskService (SQLite file or the in-memory fake).

"Nothing stored" is always checked by listing the store itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from oss_api.testing import TestClient, open_client
from shared.config import Settings
from shared.consumer import StepConsumer
from shared.flows import load_flows
from shared.runtime import Runtime
from shared.scheduler.sweeps import sweep_tasks
from shared.states import Phase, StepType, TaskStatus
from shared.storage import InMemoryStore, StorageUnavailable, TaskFilter, TaskStore
from shared.testing import InProcess, ManualClock, QueuePublisher

SUPPORT = Path(__file__).resolve().parents[1] / "support"
MAX_BODY = 256 * 1024  # request body limit for these tests; parameters stay at the 64 KiB default
PARAMETERS_LIMIT = 64 * 1024

TASK_FIELDS = {
    "task_id", "flow", "task_status", "status_name", "task_message", "task_cursor", "time_create",
    "time_start", "time_end", "priority", "user_id", "cancel_requested", "parameters", "steps",
    "current", "attempts", "events", "schedule_id", "scheduled_at",
}
STEP_FIELDS = {
    "code", "message", "time_start", "time_end",
    "normal_module", "normal_command", "normal_timeout", "normal_retry",
    "rollback_module", "rollback_command", "rollback_timeout", "rollback_retry",
    "state", "rollback_state", "attempts", "rollback_attempts", "rollback_time_start", "rollback_time_end",
}


@dataclass
class Api:
    client: TestClient
    store: TaskStore
    publisher: QueuePublisher
    clock: ManualClock
    runtime: Runtime

    def submit(self, body: dict[str, Any], **kwargs: Any) -> Any:
        self.clock.advance(1.0)  # distinct creation times: "newest first" is then exact
        return self.client.post("/api/tasks", json=body, **kwargs)

    def stored(self) -> list[str]:
        return [t.task_id for t in self.store.list(TaskFilter(limit=1000))]

    def published(self) -> list[tuple[str, int, StepType, str, str]]:
        return [(m.task_id, m.cursor, m.type, m.module, m.command) for m in self.publisher.messages]

    def sweep(self) -> int:
        """The scheduler's sweep at the API's clock: publishes the first steps batches left waiting."""
        return sweep_tasks(self.runtime.service, self.clock())

    def drain(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Run every published message through the testmod consumers, in order (a sweep first)."""
        self.sweep()
        monkeypatch.syspath_prepend(str(SUPPORT))
        testmod = importlib.import_module("testmod")
        consumer = StepConsumer(
            self.runtime.service,
            {"alpha": testmod.alpha, "beta": testmod.beta},
            self.runtime.settings,
            clock=self.clock,
        )
        while self.publisher.messages:
            consumer.handle(self.publisher.messages.popleft())


@pytest.fixture
def api(tmp_path: Path, store: TaskStore) -> Iterator[Api]:
    settings = Settings(home=tmp_path, max_body_bytes=MAX_BODY)
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path, store, settings=settings)
    with open_client(app.runtime) as client:
        yield Api(client, store, app.publisher, app.clock, app.runtime)


def error_of(response: Any) -> str:
    body = response.json()
    assert set(body) <= {"error", "detail"}, body
    return body["error"]


# --- submit ---------------------------------------------------------------------------------


def test_submit_returns_201_with_the_full_task_document_and_publishes_step_0(api: Api) -> None:
    r = api.submit({"flow": "three", "parameters": {"Cpu": 4, "Name": "db1"}, "priority": 3,
                    "user_id": "alice", "task_id": "task-1"})
    assert r.status_code == 201, r.text
    doc = r.json()
    assert set(doc) == TASK_FIELDS
    now = api.clock.now
    assert {k: v for k, v in doc.items() if k not in ("steps", "current")} == {
        "task_id": "task-1",
        "flow": "three",
        "task_status": 1,
        "status_name": "pending",
        "task_message": None,
        "task_cursor": 0,
        "time_create": now,
        "time_start": None,
        "time_end": None,
        "priority": 3,
        "user_id": "alice",
        "cancel_requested": False,
        "parameters": {"Cpu": 4, "Name": "db1"},
        "attempts": None,
        "events": None,  # the history is in GET /api/tasks/{id} only
        "schedule_id": None,  # submitted, not fired by a schedule
        "scheduled_at": None,
    }
    # Queued: due for a re-publish if no worker starts it within requeue_after.
    assert doc["current"] == {
        "seq": 1, "cursor": 0, "type": 0, "attempt": 1, "phase": "queued", "due_at": now + 30.0
    }
    assert len(doc["steps"]) == 3
    for step in doc["steps"]:
        assert set(step) == STEP_FIELDS
        assert {k: step[k] for k in ("code", "message", "time_start", "time_end", "state", "rollback_state",
                                      "attempts", "rollback_attempts", "rollback_time_start",
                                      "rollback_time_end")} == {
            "code": 0, "message": None, "time_start": None, "time_end": None, "state": "pending",
            "rollback_state": "pending", "attempts": 0, "rollback_attempts": 0,
            "rollback_time_start": None, "rollback_time_end": None,
        }
    defs = [
        {"normal_module": s["normal_module"], "normal_command": s["normal_command"],
         "normal_timeout": s["normal_timeout"], "normal_retry": s["normal_retry"],
         "rollback_module": s["rollback_module"], "rollback_command": s["rollback_command"],
         "rollback_timeout": s["rollback_timeout"], "rollback_retry": s["rollback_retry"]}
        for s in doc["steps"]
    ]
    assert defs == [
        {"normal_module": "alpha", "normal_command": "step", "normal_timeout": 20.0, "normal_retry": 0,
         "rollback_module": "alpha", "rollback_command": "undo", "rollback_timeout": 20.0, "rollback_retry": 1},
        {"normal_module": "beta", "normal_command": "step", "normal_timeout": 20.0, "normal_retry": 2,
         "rollback_module": "beta", "rollback_command": "undo", "rollback_timeout": 20.0, "rollback_retry": 0},
        {"normal_module": "alpha", "normal_command": "step", "normal_timeout": 2.0, "normal_retry": 0,
         "rollback_module": "alpha", "rollback_command": "undo", "rollback_timeout": 20.0, "rollback_retry": 0},
    ]
    assert api.published() == [("task-1", 0, StepType.NORMAL, "alpha", "step")]
    (message,) = api.publisher.messages
    assert (message.seq, message.attempt, message.timeout, message.retry) == (1, 1, 20.0, 0)
    assert message.parameters == {"Cpu": 4, "Name": "db1"}
    assert api.stored() == ["task-1"]
    assert api.client.get("/api/tasks/task-1").json() == {**doc, "attempts": [], "events": []}


def test_a_step_without_rollback_shows_none(api: Api) -> None:
    doc = api.submit({"flow": "noop"}).json()
    assert doc["parameters"] == {}
    assert {(s["rollback_module"], s["rollback_command"], s["rollback_state"]) for s in doc["steps"]} == {
        (None, None, "none")
    }
    assert len(doc["task_id"]) >= 16  # generated when not given


def test_replaying_a_task_id_returns_200_and_the_same_document_without_publishing(api: Api) -> None:
    body = {"flow": "three", "parameters": {"Cpu": 1}, "task_id": "same"}
    first = api.submit(body)
    assert first.status_code == 201
    again = api.submit(body)
    assert again.status_code == 200, again.text
    assert again.json() == first.json()
    assert len(api.publisher.messages) == 1
    assert api.stored() == ["same"]


def test_the_idempotency_key_header_works_like_a_task_id(api: Api) -> None:
    headers = {"Idempotency-Key": "order-42:create"}
    first = api.submit({"flow": "three"}, headers=headers)
    assert first.status_code == 201, first.text
    assert first.json()["task_id"] == "order-42:create"
    again = api.submit({"flow": "three"}, headers=headers)
    assert again.status_code == 200
    assert again.json() == first.json()
    assert len(api.publisher.messages) == 1
    assert api.stored() == ["order-42:create"]


def test_a_task_id_of_another_user_or_flow_is_a_conflict(api: Api) -> None:
    assert api.submit({"flow": "three", "task_id": "t1", "user_id": "alice"}).status_code == 201
    r = api.submit({"flow": "three", "task_id": "t1", "user_id": "bob"})
    assert r.status_code == 409
    assert "t1" in error_of(r) and "already used" in error_of(r)
    r = api.submit({"flow": "noop", "task_id": "t1", "user_id": "alice"})
    assert r.status_code == 409
    assert api.stored() == ["t1"]
    assert api.store.get("t1").user_id == "alice"  # type: ignore[union-attr]
    assert len(api.publisher.messages) == 1


def test_an_unknown_flow_is_404_naming_the_known_flows_and_stores_nothing(api: Api) -> None:
    r = api.submit({"flow": "thre", "parameters": {"Cpu": 1}})
    assert r.status_code == 404
    known = ", ".join(sorted(api.runtime.flows.flows))  # tests/support/flows.yaml: noop, three, ...
    assert "noop" in known and "three" in known
    assert error_of(r) == f"unknown flow 'thre' (known flows: {known})"
    assert api.stored() == []
    assert not api.publisher.messages


@pytest.mark.parametrize("body", [b'{"flow": "three",', b"{flow: three}", b'{"flow": "three"}}'])
def test_malformed_json_is_400(api: Api, body: bytes) -> None:
    r = api.client.post("/api/tasks", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert error_of(r).startswith("malformed JSON")
    assert api.stored() == []


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_in_parameters_are_malformed_json(api: Api, number: bytes) -> None:
    # Python's JSON parser accepts them; JSON does not, and PostgreSQL's jsonb rejects them.
    body = b'{"flow": "three", "parameters": {"nested": {"x": ' + number + b"}}}"
    r = api.client.post("/api/tasks", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert error_of(r).startswith("malformed JSON")
    assert api.stored() == []
    assert not api.publisher.messages


@pytest.mark.parametrize(
    "field, value",
    [
        ("parameters", [1, 2]),
        ("parameters", "Cpu=4"),
        ("priority", "high"),
        ("priority", 10**9),
        ("flow", 5),
        ("user_id", ["alice"]),
        ("task_id", "has space"),
        ("task_id", "x" * 65),
    ],
)
def test_wrong_types_are_422_naming_the_field(api: Api, field: str, value: Any) -> None:
    body = {"flow": "three", "parameters": {"Cpu": 1}, field: value}
    r = api.submit(body)
    assert r.status_code == 422, r.text
    assert error_of(r).startswith(f"invalid request: {field}: ")
    assert [d["field"] for d in r.json()["detail"]] == [field]
    assert api.stored() == []
    assert not api.publisher.messages


def test_a_body_that_is_not_an_object_is_422(api: Api) -> None:
    r = api.client.post("/api/tasks", json=["three"])
    assert r.status_code == 422
    assert api.stored() == []


def test_a_missing_flow_is_422(api: Api) -> None:
    r = api.submit({"parameters": {}})
    assert r.status_code == 422
    assert error_of(r) == "invalid request: flow: Field required"


def test_an_unknown_body_field_is_422(api: Api) -> None:
    r = api.submit({"flow": "three", "params": {"Cpu": 1}})
    assert r.status_code == 422
    assert error_of(r) == "invalid request: params: Extra inputs are not permitted"
    assert api.stored() == []


def test_parameters_over_64_kib_are_413_and_nothing_is_stored(api: Api) -> None:
    # {"x":"…"} serializes to len(value) + 8 bytes.
    at_limit = {"x": "a" * (PARAMETERS_LIMIT - 8)}
    r = api.submit({"flow": "three", "parameters": at_limit, "task_id": "fits"})
    assert r.status_code == 201, r.text

    over = {"x": "a" * (PARAMETERS_LIMIT - 7)}
    r = api.submit({"flow": "three", "parameters": over, "task_id": "too-big"})
    assert r.status_code == 413
    assert error_of(r) == f"parameters are {PARAMETERS_LIMIT + 1} bytes; the limit is {PARAMETERS_LIMIT}"
    assert api.stored() == ["fits"]
    assert [m.task_id for m in api.publisher.messages] == ["fits"]


def test_a_body_over_max_body_bytes_is_413(api: Api) -> None:
    big = {"flow": "three", "parameters": {"x": "a" * MAX_BODY}, "task_id": "huge"}
    r = api.submit(big)
    assert r.status_code == 413
    assert error_of(r) == f"request body over {MAX_BODY} bytes"
    assert api.stored() == []


def test_a_streamed_body_over_max_body_bytes_is_413(api: Api) -> None:
    """No Content-Length (chunked upload): the limit is enforced on the bytes read."""

    def chunks() -> Iterator[bytes]:
        yield b'{"flow": "three", "task_id": "streamed", "parameters": {"x": "'
        for _ in range(MAX_BODY // 8192 + 1):
            yield b"a" * 8192
        yield b'"}}'

    r = api.client.post("/api/tasks", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert error_of(r) == f"request body over {MAX_BODY} bytes"
    assert api.stored() == []


# --- read ------------------------------------------------------------------------------------


# --- batch submit ---------------------------------------------------------------------------


def test_a_batch_stores_every_task_and_the_sweep_publishes_each_first_step(api: Api) -> None:
    assert api.submit({"flow": "three", "task_id": "old", "user_id": "alice"}).status_code == 201
    tasks = [{"flow": "three", "task_id": f"b{i}", "user_id": "alice", "priority": i} for i in range(3)]
    tasks.append({"flow": "three", "task_id": "old", "user_id": "alice"})  # a replay
    tasks.append({"flow": "noop", "parameters": {"n": 1}})  # an id of the service's choosing
    r = api.client.post("/api/batches", json={"tasks": tasks})
    assert r.status_code == 200, r.text
    answer = r.json()["tasks"]
    assert [(t["task_id"], t["created"]) for t in answer[:4]] == [("b0", True), ("b1", True), ("b2", True), ("old", False)]
    assert answer[4]["created"] and len(answer[4]["task_id"]) == 32
    assert sorted(api.stored()) == sorted(["old", "b0", "b1", "b2", answer[4]["task_id"]])
    assert api.store.get("b2").priority == 2  # type: ignore[union-attr]
    assert api.store.get(answer[4]["task_id"]).parameters == {"n": 1}  # type: ignore[union-attr]
    # Answered once stored: each new task's first step waits, due at once, for the scheduler.
    assert [(task_id, cursor) for task_id, cursor, *_ in api.published()] == [("old", 0)]
    first = api.store.get("b0").active  # type: ignore[union-attr]
    assert (first.seq, first.cursor, first.phase, first.due_at) == (1, 0, Phase.WAITING, api.clock())
    assert api.sweep() == 4
    published = [(task_id, cursor) for task_id, cursor, *_ in api.published()]
    assert published[0] == ("old", 0)
    assert sorted(published[1:]) == sorted([("b0", 0), ("b1", 0), ("b2", 0), (answer[4]["task_id"], 0)])
    assert api.store.get("b0").active.phase is Phase.QUEUED  # type: ignore[union-attr]


def test_a_batch_runs_to_the_end_like_single_submits(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    r = api.client.post("/api/batches", json={"tasks": [{"flow": "three", "task_id": f"r{i}"} for i in range(4)]})
    assert r.status_code == 200, r.text
    api.drain(monkeypatch)
    assert {api.store.get(f"r{i}").status for i in range(4)} == {TaskStatus.SUCCESS}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("bad", "status", "message"),
    [
        ({"flow": "thre"}, 404, "tasks[2]: unknown flow 'thre'"),
        ({"flow": "three", "task_id": "a0"}, 422, "tasks[2]: task_id 'a0' is also that of tasks[0]"),
        ({"flow": "three", "task_id": "taken", "user_id": "bob"}, 409, "task id 'taken' is already used"),
        ({"flow": "three", "parameters": {"big": "x" * PARAMETERS_LIMIT}}, 413, "tasks[2]: parameters are"),
    ],
)
def test_one_refused_submission_stores_none_of_the_batch(api: Api, bad: dict[str, Any], status: int, message: str) -> None:
    assert api.submit({"flow": "three", "task_id": "taken", "user_id": "alice"}).status_code == 201
    before = len(api.publisher.messages)
    tasks = [{"flow": "three", "task_id": "a0"}, {"flow": "noop", "task_id": "a1"}, bad, {"flow": "noop"}]
    r = api.client.post("/api/batches", json={"tasks": tasks})
    assert r.status_code == status, r.text
    assert error_of(r).startswith(message), error_of(r)
    assert api.stored() == ["taken"]
    assert len(api.publisher.messages) == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tasks": []}, "tasks"),
        ({"tasks": [{"flow": "three"}] * 1001}, "tasks"),
        ({"tasks": [{"flow": "three"}, {"flow": "three", "priority": "high"}]}, "tasks.1.priority"),
        ({"tasks": [{"flow": "three", "colour": "red"}]}, "tasks.0.colour"),
    ],
)
def test_an_invalid_batch_is_422_naming_the_field(api: Api, body: dict[str, Any], field: str) -> None:
    r = api.client.post("/api/batches", json=body)
    assert r.status_code == 422, r.text
    assert field in [d["field"] for d in r.json()["detail"]], r.json()
    assert api.stored() == []


def test_get_an_unknown_task_is_404(api: Api) -> None:
    r = api.client.get("/api/tasks/nope")
    assert r.status_code == 404
    assert error_of(r) == "no task 'nope'"


def test_get_shows_the_attempts_of_a_task_that_ran(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    api.submit({"flow": "three", "task_id": "ran", "parameters": {"fail_at": [2]}})
    api.drain(monkeypatch)
    doc = api.client.get("/api/tasks/ran").json()
    assert doc["task_status"] == 4 and doc["status_name"] == "failed"
    assert doc["task_cursor"] == 2
    assert doc["task_message"] == "step 2 (alpha.step) failed: RuntimeError: forced failure at step 2"
    assert doc["current"] is None
    assert [(a["cursor"], a["type"], a["outcome"]) for a in doc["attempts"]] == [
        (0, 0, "succeeded"), (1, 0, "succeeded"), (2, 0, "failed"), (2, 1, "succeeded"), (1, 1, "succeeded"),
        (0, 1, "succeeded"),
    ]
    assert [(s["state"], s["rollback_state"]) for s in doc["steps"]] == [("succeeded", "succeeded")] * 2 + [
        ("failed", "succeeded")
    ]
    assert doc["steps"][2]["message"] == "RuntimeError: forced failure at step 2"


def test_list_filters_newest_first(api: Api) -> None:
    for task_id, flow, user in [("a", "three", "alice"), ("b", "noop", "bob"), ("c", "three", "bob"),
                                ("d", "noop", "alice"), ("e", "three", None)]:
        assert api.submit({"flow": flow, "task_id": task_id, "user_id": user}).status_code == 201
    assert api.client.post("/api/tasks/c/cancel").status_code == 200

    def ids(**params: Any) -> list[str]:
        r = api.client.get("/api/tasks", params=params)
        assert r.status_code == 200, r.text
        return [doc["task_id"] for doc in r.json()["tasks"]]

    assert ids() == ["e", "d", "c", "b", "a"]
    assert ids(flow="three") == ["e", "c", "a"]
    assert ids(flow="other") == []
    assert ids(status=1) == ["e", "d", "b", "a"]
    assert ids(status=6) == ["c"]
    assert ids(user_id="alice") == ["d", "a"]
    assert ids(user_id="bob", flow="noop") == ["b"]
    assert ids(limit=2) == ["e", "d"]
    assert ids(limit=1000) == ["e", "d", "c", "b", "a"]
    full = api.client.get("/api/tasks", params={"limit": 1}).json()["tasks"][0]
    assert set(full) == TASK_FIELDS


@pytest.mark.parametrize(
    "params, field",
    [({"limit": 0}, "limit"), ({"limit": 1001}, "limit"), ({"limit": "ten"}, "limit"),
     ({"status": 7}, "status"), ({"status": -1}, "status"), ({"status": "failed"}, "status")],
)
def test_list_rejects_out_of_range_parameters(api: Api, params: dict[str, Any], field: str) -> None:
    r = api.client.get("/api/tasks", params=params)
    assert r.status_code == 422, r.text
    assert error_of(r).startswith(f"invalid request: query.{field}: ")


# --- operator actions -----------------------------------------------------------------------------


def test_actions_in_the_wrong_state_are_409_with_a_reason(api: Api) -> None:
    api.submit({"flow": "three", "task_id": "p"})
    r = api.client.post("/api/tasks/p/retry")
    assert r.status_code == 409
    assert error_of(r) == "task p is pending; only failed or cancelled tasks can be retried"
    r = api.client.post("/api/tasks/p/resume")
    assert r.status_code == 409
    assert error_of(r) == "task p is pending; only a failed rollback can be resumed"
    assert api.client.post("/api/tasks/p/cancel").status_code == 200
    r = api.client.post("/api/tasks/p/cancel")
    assert r.status_code == 409
    assert error_of(r) == "task p is cancelled; only pending or running tasks can be cancelled"


@pytest.mark.parametrize("action", ["cancel", "retry", "resume"])
def test_actions_on_an_unknown_task_are_404(api: Api, action: str) -> None:
    r = api.client.post(f"/api/tasks/nope/{action}")
    assert r.status_code == 404
    assert error_of(r) == "no task 'nope'"


def test_cancel_of_a_pending_task_ends_it_as_cancelled(api: Api) -> None:
    api.submit({"flow": "three", "task_id": "p"})
    r = api.client.post("/api/tasks/p/cancel")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert (doc["task_status"], doc["status_name"], doc["cancel_requested"]) == (6, "cancelled", True)
    assert doc["current"] is None
    assert doc["time_end"] == api.clock.now
    assert api.store.get("p").status is TaskStatus.CANCELLED  # type: ignore[union-attr]
    assert len(api.publisher.messages) == 1  # step 0 never ran: nothing to compensate


def test_retry_of_a_cancelled_task_dispatches_step_0_again(api: Api) -> None:
    api.submit({"flow": "three", "task_id": "p"})
    api.client.post("/api/tasks/p/cancel")
    r = api.client.post("/api/tasks/p/retry")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert (doc["task_status"], doc["task_cursor"], doc["cancel_requested"]) == (2, 0, False)
    assert doc["current"]["seq"] == 2 and doc["current"]["phase"] == "queued"
    assert [m.seq for m in api.publisher.messages] == [1, 2]


def test_resume_of_a_failed_rollback(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    api.submit({"flow": "three", "task_id": "rb", "parameters": {"fail_at": [2], "fail_rollback_at": [2]}})
    api.drain(monkeypatch)
    doc = api.client.get("/api/tasks/rb").json()
    assert (doc["task_status"], doc["status_name"]) == (5, "rollback_failed")
    assert len(api.publisher.alarms) == 1
    r = api.client.post("/api/tasks/rb/resume")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["task_status"] == 3
    assert (doc["current"]["cursor"], doc["current"]["type"]) == (2, 1)
    assert api.published() == [("rb", 2, StepType.ROLLBACK, "alpha", "undo")]


# --- flows, health, metrics, docs -----------------------------------------------------------------


def test_get_flows_lists_the_loaded_definitions(api: Api) -> None:
    r = api.client.get("/api/flows")
    assert r.status_code == 200
    flows = {f["name"]: f for f in r.json()["flows"]}
    assert set(flows) == set(api.runtime.flows.flows) >= {"three", "noop"}
    step0 = flows["three"]["steps"][0]
    assert step0["normal"] == {"module": "alpha", "command": "step", "timeout": 20.0, "retry": 0,
                               "max_retry_interval": -1.0}
    assert step0["rollback"]["max_retry_interval"] == -0.2
    assert [s["rollback"] for s in flows["noop"]["steps"]] == [None, None, None]


def test_healthz(api: Api) -> None:
    r = api.client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_healthz_is_503_when_the_store_is_down(tmp_path: Path) -> None:
    class DownStore(InMemoryStore):
        def ping(self) -> None:
            raise StorageUnavailable("connection refused")

    app = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path, DownStore())
    with open_client(app.runtime) as client:
        r = client.get("/healthz")
    assert r.status_code == 503
    assert "unavailable" in error_of(r)


def test_metrics_count_submissions(api: Api) -> None:
    api.submit({"flow": "noop"})
    r = api.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE asyncflow_tasks_submitted_total counter" in r.text
    assert 'asyncflow_tasks_submitted_total{flow="noop"}' in r.text


def test_docs_and_openapi_are_served(api: Api) -> None:
    docs = api.client.get("/docs")
    assert docs.status_code == 200
    assert "swagger" in docs.text.lower()
    spec = api.client.get("/openapi.json")
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    for path in ["/api/tasks", "/api/tasks/{task_id}", "/api/tasks/{task_id}/cancel",
                 "/api/tasks/{task_id}/retry", "/api/tasks/{task_id}/resume", "/api/flows", "/healthz"]:
        assert path in paths, path
