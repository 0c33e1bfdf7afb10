"""create_task, hold_tasks and set_task served in front of the router (oss_api.direct).

They must answer exactly as through the router: a 401 for an unknown key, a 413
for a body over the limit, and the router's own answer to any other method on
their paths. That they are served without the router is shown by taking their
routes out of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import Request, Response
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from oss_api.app import create_app
from oss_api.direct import DirectPosts
from oss_api.testing import TestClient
from shared.config import Settings
from shared.flows import load_flows
from shared.testing import InProcess
from tests.unit.test_auth import KEYS, ROOT, bearer

SUPPORT = Path(__file__).resolve().parents[1] / "support"
DIRECT = ("/v1/create_task", "/v1/hold_tasks", "/v1/set_task")
MAX_BODY = 4096


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(home=tmp_path, api_keys=KEYS, max_body_bytes=MAX_BODY)
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path, settings=settings)
    app.runtime.pull_service.register_type({"task_type": "video"})
    with TestClient(create_app(app.runtime)) as http:
        yield http


def test_the_calls_are_served_with_the_v1_routes_gone_from_the_router(client: TestClient) -> None:
    router = client.app.router  # type: ignore[attr-defined]
    scope = {"type": "http", "path": "/v1/ping", "method": "GET", "root_path": ""}
    router.routes = [r for r in router.routes if r.matches(scope)[0] is not Match.FULL]
    headers = bearer(ROOT)
    # Every v1 route is gone, the three included: another method on their paths is a 404 now, not a 405.
    assert [client.get(path).status_code for path in ("/v1/ping", *DIRECT)] == [404] * 4
    created = client.post("/v1/create_task", json={"task_data": {"task_type": "video"}}, headers=headers).json()
    assert created["code"] == 0, created
    held = client.post("/v1/hold_tasks", json={"task_type": "video"}, headers=headers).json()
    assert [t["task_id"] for t in held["task_list"]] == [created["task_id"]]
    done = {"task_data": {"task_id": created["task_id"], "status": 3}}
    assert client.post("/v1/set_task", json=done, headers=headers).json() == {"code": 0, "msg": "SUCCESS"}
    again = {"task_data": {"task_id": created["task_id"], "status": 2}}
    assert client.post("/v1/set_task", json=again, headers=headers).json()["code"] != 0  # it has ended


@pytest.mark.parametrize("path", DIRECT)
def test_an_unknown_key_is_answered_as_on_every_route(client: TestClient, path: str) -> None:
    direct = client.post(path, json={}, headers=bearer("not-a-key"))
    routed = client.post("/v1/register_task", json={}, headers=bearer("not-a-key"))
    assert (direct.status_code, direct.json()) == (routed.status_code, routed.json()) == (401, {"error": "invalid API key"})
    assert direct.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("path", DIRECT)
@pytest.mark.parametrize("declared", [True, False])
def test_a_body_over_the_limit_is_a_413(
    client: TestClient, path: str, declared: bool, caplog: pytest.LogCaptureFixture
) -> None:
    body = b'{"task_data": {"task_type": "video", "task_content": "' + b"a" * MAX_BODY + b'"}}'
    # Without a length declared, the limit is found while the body is read.
    content = body if declared else iter([body[:100], body[100:]])
    response = client.post(path, content=content, headers={**bearer(ROOT), "Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json() == {"error": f"request body over {MAX_BODY} bytes"}
    assert client.get("/v1/get_task_list", headers=bearer(ROOT)).json()["task_list"] == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []  # not a failure of ours


@pytest.mark.parametrize("path", DIRECT)
def test_another_method_is_the_router_s_to_answer(client: TestClient, path: str) -> None:
    response = client.get(path, headers=bearer(ROOT))
    assert response.status_code == 405
    assert response.headers["Allow"] == "POST"


def test_the_calls_stay_in_the_openapi_document(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert all("post" in paths[path] for path in DIRECT)


@pytest.mark.parametrize(("telemetry", "served_by"), [(None, "endpoint"), (object(), "router")])
def test_with_fastapi_s_telemetry_on_the_router_serves_them(telemetry: object, served_by: str) -> None:
    """FastAPI's OpenTelemetry spans learn a request's route from the router."""
    served: list[str] = []

    async def router(scope: Scope, receive: Receive, send: Send) -> None:
        served.append("router")

    async def endpoint(request: Request) -> Response:
        served.append("endpoint")
        return Response()

    async def send(message: Message) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/create_task", "headers": [], "fastapi.telemetry": telemetry}
    asyncio.run(DirectPosts(router, {"/v1/create_task": endpoint})(scope, receive=None, send=send))  # type: ignore[arg-type]
    assert served == [served_by]
