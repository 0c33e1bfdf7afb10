"""create_task, hold_tasks, set_task and the flow submit served in front of the router (oss_api.direct).

They must answer exactly as through the router: a 401 for an unknown key, a 413
for a body over the limit, and the router's own answer to any other method on
their paths. A submit is served there only when FastAPI would take it as it is:
any other goes on to the router, and gets the answer an app without the direct
routes gives. That they are served without the router is shown by taking their
routes out of it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
from tests.support.asgi import post_cut_short
from tests.unit.test_auth import KEYS, ROOT, bearer

SUPPORT = Path(__file__).resolve().parents[1] / "support"
DIRECT = ("/v1/create_task", "/v1/hold_tasks", "/v1/set_task")
MAX_BODY = 4096


def take_out_of_the_router(client: TestClient, path: str, method: str) -> None:
    """Every route the app's router serves ``method`` ``path`` by (an included router's: all of its routes)."""
    router = client.app.router  # type: ignore[attr-defined]
    scope = {"type": "http", "path": path, "method": method, "root_path": ""}
    router.routes = [r for r in router.routes if r.matches(scope)[0] is not Match.FULL]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with stack_client(tmp_path, direct=True) as http:
        yield http


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[TestClient]:
    """An app of the same settings without the direct routes: the router serves every call."""
    with stack_client(tmp_path / "routed", direct=False) as http:
        yield http


@contextmanager
def stack_client(home: Path, direct: bool) -> Iterator[TestClient]:
    settings = Settings(home=home, api_keys=KEYS, max_body_bytes=MAX_BODY, max_parameters_bytes=MAX_BODY // 2)
    stack = InProcess(load_flows(SUPPORT / "flows.yaml"), home, settings=settings)
    stack.runtime.pull_service.register_type({"task_type": "video"})
    app = create_app(stack.runtime)
    if not direct:
        app.user_middleware = [m for m in app.user_middleware if m.cls is not DirectPosts]
    with TestClient(app) as http:
        yield http


def test_the_calls_are_served_with_the_v1_routes_gone_from_the_router(client: TestClient) -> None:
    take_out_of_the_router(client, "/v1/ping", "GET")
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


JSON = {"Content-Type": "application/json"}
SUBMIT = b'{"flow": "noop", "parameters": {"n": 1}}'
LONG_KEY = "k" * 65


def test_a_well_formed_submit_is_served_with_its_route_gone_from_the_router(client: TestClient) -> None:
    take_out_of_the_router(client, "/api/tasks", "POST")
    headers = {**bearer(ROOT), **JSON}
    created = client.post("/api/tasks", content=SUBMIT, headers=headers)
    assert created.status_code == 201, created.text
    assert (created.json()["flow"], created.json()["parameters"]) == ("noop", {"n": 1})
    # What the direct route leaves to the router finds no route there now.
    assert client.post("/api/tasks", content=b'{"flow": "noop", "colour": 1}', headers=headers).status_code == 404


# Each left to the router: refused by FastAPI's checks of the route (body, content type,
# header), or taken by them where the direct route would not read it as they do.
LEFT: list[tuple[str, bytes, dict[str, str]]] = [
    ("not JSON", b'{"flow": ', JSON),
    ("empty", b"", JSON),
    ("a list", b"[]", JSON),
    ("an unknown field", b'{"flow": "noop", "colour": 1}', JSON),
    ("a priority not a number", b'{"flow": "noop", "priority": "high"}', JSON),
    ("NaN", b'{"flow": "noop", "parameters": {"x": NaN}}', JSON),
    ("a byte-order mark", b"\xef\xbb\xbf" + SUBMIT, JSON),  # taken
    ("a lone surrogate", b'{"flow": "noop", "parameters": {"x": "\\ud800"}}', JSON),
    ("no content type", SUBMIT, {}),
    ("text", SUBMIT, {"Content-Type": "text/plain"}),
    ("json+ld", SUBMIT, {"Content-Type": "application/ld+json"}),  # taken
    ("a key with a space", SUBMIT, {**JSON, "Idempotency-Key": "a b"}),
    ("a key too long", SUBMIT, {**JSON, "Idempotency-Key": LONG_KEY}),
    ("an empty key", SUBMIT, {**JSON, "Idempotency-Key": ""}),
    ("an integer past 64 bits", b'{"flow": "noop", "parameters": {"n": 123456789012345678901234567890}}', JSON),
]

# Well-formed, each refused or answered by the service: served in front of the router.
ANSWERED: list[tuple[str, bytes, dict[str, str]]] = [
    ("a submit", SUBMIT, JSON),
    ("an unknown flow", b'{"flow": "nope"}', JSON),
    ("a charset", SUBMIT, {"Content-Type": "Application/JSON; charset=utf-8"}),
    ("an idempotency key", SUBMIT, {**JSON, "Idempotency-Key": "order-1"}),
    ("its task_id taken by another flow", b'{"flow": "three", "task_id": "order-1"}', JSON),
    # Within the body's limit, over the parameters'.
    ("parameters over their limit", b'{"flow": "noop", "parameters": {"x": "' + b"a" * (MAX_BODY - 1000) + b'"}}', JSON),
]


@pytest.mark.parametrize("user", [ROOT, "not-a-key"])
def test_every_submit_is_answered_as_the_router_answers_it(
    client: TestClient, routed: TestClient, user: str
) -> None:
    """In one order on both apps (the conflict needs the submit before it)."""
    for case, body, headers in LEFT + ANSWERED:
        direct, router = (
            http.post("/api/tasks", content=body, headers={**bearer(user), **headers}) for http in (client, routed)
        )
        assert direct.status_code == router.status_code, (case, direct.text, router.text)
        assert comparable(direct.json()) == comparable(router.json()), case
        assert direct.headers.get("WWW-Authenticate") == router.headers.get("WWW-Authenticate"), case
    stored = [comparable(t) for t in client.get("/api/tasks", headers=bearer(ROOT)).json()["tasks"]]
    assert stored == [comparable(t) for t in routed.get("/api/tasks", headers=bearer(ROOT)).json()["tasks"]]
    assert len(stored) == (6 if user == ROOT else 0)


def test_a_submit_is_served_in_front_of_the_router_only_when_fastapi_would_take_it_as_it_is(
    client: TestClient,
) -> None:
    """With the route gone from the router, what is left to it finds no route there."""
    take_out_of_the_router(client, "/api/tasks", "POST")
    for case, body, headers in LEFT + ANSWERED:
        answer = client.post("/api/tasks", content=body, headers={**bearer(ROOT), **headers})
        no_route = answer.json() == {"error": "no such endpoint: POST /api/tasks"}
        assert no_route == ((case, body, headers) in LEFT), (case, answer.text)


def test_a_request_left_to_the_router_reaches_it_as_it_came() -> None:
    """Read in several pieces (a chunked body) before it is left to the router, then a disconnect."""
    came: list[Message] = [
        {"type": "http.request", "body": b'{"flow": ', "more_body": True},
        {"type": "http.request", "body": b'"noop", ', "more_body": True},
        {"type": "http.request", "body": b'"colour": 1}', "more_body": False},
        {"type": "http.disconnect"},
    ]
    pending = list(came)
    routed: list[Message] = []

    async def receive() -> Message:
        return pending.pop(0)

    async def router(scope: Scope, receive: Receive, send: Send) -> None:
        for _ in came:
            routed.append(await receive())

    async def endpoint(request: Request) -> None:
        await request.body()  # all three pieces
        return None

    async def send(message: Message) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/api/tasks", "headers": []}
    asyncio.run(DirectPosts(router, {"/api/tasks": endpoint})(scope, receive, send))
    assert routed == came


def test_a_client_gone_before_its_body_ended_is_answered_as_the_router_answers_it(
    client: TestClient, routed: TestClient
) -> None:
    answers = [asyncio.run(gone_mid_body(http.app)) for http in (client, routed)]
    assert answers[0] == answers[1]
    assert answers[0][0] == 400, answers


@pytest.mark.parametrize("path", [*DIRECT, "/v1/register_task_type"])
def test_a_v1_caller_gone_before_its_body_ended_is_refused_and_nothing_is_done(
    client: TestClient, routed: TestClient, path: str
) -> None:
    """Not raised to the server (which logged each as an error with its traceback)."""
    before = [stored_v1(http) for http in (client, routed)]
    answers = [asyncio.run(gone_mid_body(http.app, path, b'{"task_data": {"task_')) for http in (client, routed)]
    assert answers[0] == answers[1]
    status, body = answers[0]
    assert (status, json.loads(body)) == (200, {"code": 1, "msg": "INPUT_INVALID::the body ended early: the client disconnected"})
    assert [stored_v1(http) for http in (client, routed)] == before


def stored_v1(http: TestClient) -> tuple[Any, Any]:
    """The v1 tasks and task types stored, as the v1 calls list them."""
    tasks = http.get("/v1/get_task_list", params={"limit": 100}, headers=bearer(ROOT)).json()
    return tasks, http.get("/v1/get_task_schedule_cfg_list", headers=bearer(ROOT)).json()


async def gone_mid_body(app: Any, path: str = "/api/tasks", part: bytes = b'{"flow": "no') -> tuple[int, bytes]:
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {ROOT}".encode())]
    return await post_cut_short(app, path, headers, part)


def test_an_integer_past_64_bits_is_stored_whole(client: TestClient) -> None:
    body = b'{"flow": "noop", "parameters": {"n": 123456789012345678901234567890}}'
    created = client.post("/api/tasks", content=body, headers={**bearer(ROOT), **JSON}).json()
    assert created["parameters"] == {"n": 123456789012345678901234567890}


def comparable(document: Any) -> Any:
    """A task document without what differs between two stores (the generated id, the clock's readings)."""
    if not isinstance(document, dict) or "task_id" not in document:
        return document
    return {
        k: v for k, v in document.items() if not k.startswith("time") and not k.endswith("_at") and k != "task_id"
    } | {"task_id": document["task_id"] if document["task_id"] == "order-1" else "generated"}
