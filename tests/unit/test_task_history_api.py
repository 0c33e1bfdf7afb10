"""POST /api/tasks/{id}/retry|resume with corrected parameters, and the history in GET /api/tasks/{id}.

Through the real app with API keys on, over the in-memory store: the actor is
the caller's user, and a refused body leaves the task as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from oss_api.testing import TestClient, open_client
from shared.config import Settings
from shared.flows import load_flows
from shared.saga import Failed, Started
from shared.testing import InProcess

SUPPORT = Path(__file__).resolve().parents[1] / "support"
ALICE, BOB = "alice-key-0001", "bob-key-00002"


class Api:
    def __init__(self, client: TestClient, app: InProcess) -> None:
        self.client = client
        self.app = app

    def post(self, key: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.client.post(path, headers={"Authorization": f"Bearer {key}"}, **kwargs)

    def doc(self, task_id: str) -> dict[str, Any]:
        r = self.client.get(f"/api/tasks/{task_id}", headers={"Authorization": f"Bearer {ALICE}"})
        assert r.status_code == 200, r.text
        return dict(r.json())

    def failed_task(self) -> str:
        """Alice's task of flow noop, whose step 0 failed (noop has no rollbacks)."""
        r = self.post(ALICE, "/api/tasks", json={"flow": "noop", "parameters": {"Cpu": 4}})
        assert r.status_code == 201, r.text
        task_id = str(r.json()["task_id"])
        seq = r.json()["current"]["seq"]
        self.app.runtime.service.apply(task_id, Started(seq))
        self.app.runtime.service.apply(task_id, Failed(seq, "Cpu too small", permanent=True))
        assert self.doc(task_id)["status_name"] == "failed"
        return task_id


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    settings = Settings(home=tmp_path, api_keys=f"{ALICE}=alice, {BOB}=bob", max_parameters_bytes=200)
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path, settings=settings)
    with open_client(app.runtime) as client:
        yield Api(client, app)


def test_retry_with_parameters_records_the_caller_and_the_change(api: Api) -> None:
    task_id = api.failed_task()
    r = api.post(ALICE, f"/api/tasks/{task_id}/retry", json={"parameters": {"Cpu": 8}})
    assert r.status_code == 200, r.text
    assert (r.json()["task_status"], r.json()["parameters"]) == (2, {"Cpu": 8})
    (event,) = api.doc(task_id)["events"]
    assert event == {"at": api.app.clock.now, "kind": "retry", "actor": "alice",
                     "detail": {"step": 0, "parameters": {"Cpu": {"old": 4, "new": 8}}}}
    (message,) = [m for m in api.app.publisher.messages if m.task_id == task_id][-1:]
    assert message.parameters == {"Cpu": 8}


def test_no_body_retries_as_before_and_is_recorded_too(api: Api) -> None:
    task_id = api.failed_task()
    assert api.post(ALICE, f"/api/tasks/{task_id}/retry").status_code == 200
    assert [(e["kind"], e["actor"], e["detail"]) for e in api.doc(task_id)["events"]] == [
        ("retry", "alice", {"step": 0})]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"parameters": {"Cpu": 8}, "priority": 3}, 422, "priority: Extra inputs are not permitted"),
        ({"parameters": [1]}, 422, "parameters: Input should be a valid dictionary"),
        ({"parameters": {"a\u0000": 1}}, 422, "NUL character"),
        ({"parameters": {"big": "x" * 300}}, 413, "the limit is 200"),
    ],
)
def test_a_refused_body_changes_nothing(api: Api, body: dict[str, Any], status: int, words: str) -> None:
    task_id = api.failed_task()
    before = api.doc(task_id)
    r = api.post(ALICE, f"/api/tasks/{task_id}/retry", json=body)
    assert r.status_code == status and words in r.json()["error"], r.text
    assert api.doc(task_id) == before


def test_nan_in_corrections_is_a_malformed_body(api: Api) -> None:
    task_id = api.failed_task()
    r = api.client.post(f"/api/tasks/{task_id}/retry", content=b'{"parameters": {"x": NaN}}',
                        headers={"Content-Type": "application/json", "Authorization": f"Bearer {ALICE}"})
    assert r.status_code == 400 and "NaN" in r.json()["error"]


def test_another_users_task_cannot_be_retried_nor_its_history_read(api: Api) -> None:
    task_id = api.failed_task()
    r = api.post(BOB, f"/api/tasks/{task_id}/retry", json={"parameters": {"Cpu": 1}})
    assert r.status_code == 404
    assert api.doc(task_id)["events"] == [] and api.doc(task_id)["parameters"] == {"Cpu": 4}
    r = api.client.get(f"/api/tasks/{task_id}", headers={"Authorization": f"Bearer {BOB}"})
    assert r.status_code == 404


def test_the_openapi_document_declares_the_optional_body_and_the_history(api: Api) -> None:
    doc = api.client.get("/openapi.json").json()
    for action in ("retry", "resume"):
        operation = doc["paths"][f"/api/tasks/{{task_id}}/{action}"]["post"]
        body = operation["requestBody"]
        assert body.get("required", False) is False
        schema = body["content"]["application/json"]["schema"]
        refs = [s.get("$ref") for s in schema.get("anyOf", [schema])]
        assert "#/components/schemas/OperationRequest" in refs
        assert {"404", "409", "422"} <= set(operation["responses"])
    assert "requestBody" not in doc["paths"]["/api/tasks/{task_id}/cancel"]["post"]
    events = doc["components"]["schemas"]["TaskDocument"]["properties"]["events"]
    assert "TaskEventDocument" in str(events)
