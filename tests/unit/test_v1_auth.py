"""API keys on the v1 API: who may call which endpoint, and which tasks each caller sees.

With keys configured, every /v1 call but ping needs a known key (HTTP 401
otherwise, as on /api); task types, leases (hold_tasks, set_task) and counts
need an admin key (code 4, FORBIDDEN); a tenant creates tasks as itself and sees
only its own. Through the real app on the in-memory stores; "nothing stored" is
checked on the store.
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
from shared.storage import PullStore
from shared.testing import InProcess
from tests.unit.test_auth import ALICE, BOB, KEYS, MISSING, ROOT, bearer

SUPPORT = Path(__file__).resolve().parents[1] / "support"

# Every v1 endpoint but ping, with a body or query that is valid once authorized.
CALLS: list[tuple[str, str, Any]] = [
    ("POST", "create_task", {"task_data": {"task_type": "video"}}),
    ("POST", "register_task_type", {"task_type_data": {"task_type": "audio"}}),
    ("POST", "register_task", {"task_config_data": {"task_type": "video", "schedule_limit": 5}}),
    ("POST", "hold_tasks", {"task_type": "video"}),
    ("POST", "set_task", {"task_data": {"task_id": "t1", "status": 3}}),
    ("GET", "get_task", {"task_id": "t1"}),
    ("GET", "get_task_schedule_cfg_list", {}),
    ("GET", "get_task_list", {"limit": 10}),
    ("GET", "get_task_counts_by_type", {"task_type": "video"}),
]
ADMIN_ONLY = ["register_task_type", "register_task", "hold_tasks", "set_task", "get_task_counts_by_type"]


class V1:
    def __init__(self, client: TestClient, store: PullStore) -> None:
        self.client = client
        self.store = store

    def call(self, method: str, path: str, data: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        if method == "GET":
            return self.client.get("/v1/" + path, params=data, headers=headers)
        return self.client.post("/v1/" + path, json=data, headers=headers)

    def ok(self, key: str, method: str, path: str, data: Any) -> dict[str, Any]:
        response = self.call(method, path, data, bearer(key))
        assert response.status_code == 200, response.text
        return response.json()

    def rows(self) -> tuple[int, int]:
        return len(self.store.list(None, None, None, 1_000_000)), len(self.store.types())


@pytest.fixture
def v1(tmp_path: Path) -> Iterator[V1]:
    settings = Settings(home=tmp_path, api_keys=KEYS)
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path, settings=settings)
    app.runtime.pull_service.register_type({"task_type": "video"})
    with open_client(app.runtime) as client:
        yield V1(client, app.runtime.pull_store)


@pytest.mark.parametrize(("method", "path", "data"), CALLS, ids=[c[1] for c in CALLS])
def test_every_v1_call_but_ping_needs_a_known_key(v1: V1, method: str, path: str, data: Any) -> None:
    before = v1.rows()
    for headers, error in [(None, MISSING), (bearer("not-a-known-key"), "invalid API key")]:
        response = v1.call(method, path, data, headers)
        assert response.status_code == 401, response.text
        assert response.json() == {"error": error}
        assert response.headers["WWW-Authenticate"] == "Bearer"
    assert v1.rows() == before
    assert v1.client.get("/v1/ping").json() == {"code": 0, "msg": "SUCCESS"}


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Authorization": f"Basic {ROOT}"}, 401),
        ({"Authorization": "Bearer   "}, 401),
        ({"Authorization": f"Bearer {ROOT}x"}, 401),
        ({"X-API-Key": ""}, 401),
        ({"Authorization": f"bearer  {ROOT} "}, 200),
        ({"X-API-Key": ROOT}, 200),
    ],
)
def test_the_key_is_read_as_on_the_native_api(v1: V1, headers: dict[str, str], status: int) -> None:
    v1_answer = v1.call("GET", "get_task_schedule_cfg_list", {}, headers)
    api_answer = v1.client.get("/api/flows", headers=headers)
    assert (v1_answer.status_code, api_answer.status_code) == (status, status)
    if status == 401:
        assert v1_answer.json() == api_answer.json()


@pytest.mark.parametrize("path", ADMIN_ONLY)
def test_task_types_leases_and_counts_need_an_admin_key(v1: V1, path: str) -> None:
    method, _, data = next(c for c in CALLS if c[1] == path)
    before = v1.rows()
    answer = v1.ok(ALICE, method, path, data)
    assert answer == {"code": 4, "msg": "FORBIDDEN::this call needs an admin key"}
    assert v1.rows() == before


def test_each_tenant_creates_as_itself_and_sees_only_its_own_tasks(v1: V1) -> None:
    mine = v1.ok(ALICE, "POST", "create_task", {"task_data": {"task_type": "video"}})["task_id"]
    theirs = v1.ok(BOB, "POST", "create_task", {"task_data": {"task_type": "video", "user_id": "bob"}})["task_id"]
    before = v1.rows()
    refused = v1.ok(ALICE, "POST", "create_task", {"task_data": {"task_type": "video", "user_id": "bob"}})
    assert refused["code"] == 4 and refused["msg"].startswith("FORBIDDEN::"), refused
    assert v1.rows() == before

    assert v1.ok(ALICE, "GET", "get_task", {"task_id": mine})["task_data"]["user_id"] == "alice"
    hidden = v1.ok(ALICE, "GET", "get_task", {"task_id": theirs})
    missing = v1.ok(ALICE, "GET", "get_task", {"task_id": "no-such-task"})
    assert (hidden["code"], missing["code"]) == (2, 2)
    assert hidden["msg"].replace(theirs, "?") == missing["msg"].replace("no-such-task", "?")
    assert [t["task_id"] for t in v1.ok(ALICE, "GET", "get_task_list", {})["task_list"]] == [mine]
    every = {t["task_id"] for t in v1.ok(ROOT, "GET", "get_task_list", {})["task_list"]}
    assert every == {mine, theirs}


def test_the_admin_works_the_tasks(v1: V1) -> None:
    task_id = v1.ok(ALICE, "POST", "create_task", {"task_data": {"task_type": "video"}})["task_id"]
    (held,) = v1.ok(ROOT, "POST", "hold_tasks", {"task_type": "video"})["task_list"]
    assert held["task_id"] == task_id
    assert v1.ok(ROOT, "POST", "set_task", {"task_data": {"task_id": task_id, "status": 3}})["code"] == 0
    assert v1.ok(ALICE, "GET", "get_task", {"task_id": task_id})["task_data"]["status"] == 3
    counts = v1.ok(ROOT, "GET", "get_task_counts_by_type", {"task_type": "video"})
    assert (counts["task_count"], counts["task_count_by_status"]["3"]) == (1, 1)
