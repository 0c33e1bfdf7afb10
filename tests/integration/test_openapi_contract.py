"""The OpenAPI document against the server: a third-party fuzzer, and the pages that show it.

Schemathesis reads the app's OpenAPI document, generates valid and invalid requests
for every operation (examples, coverage and fuzzing phases, a bounded number of
examples, derandomized) and runs all its checks on each answer, with the admin key
so the authenticated routes are reached. The requests go in-process to an app over
a fresh SQLite database holding a few tasks, a schedule and a v1 task, so the list
answers carry real documents.

The fuzzer's tests are made when this module is collected, from the document of an
app over in-memory stores (the same code, so the same document: checked below); the
``served`` fixture then points them at the seeded app.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from oss_api.app import create_app
from oss_api.testing import TestClient, open_client
from shared.config import Settings
from shared.flows import load_flows
from shared.migrate import upgrade
from shared.runtime import Runtime
from shared.storage import TaskStore, open_store
from shared.testing import InProcess

SUPPORT = Path(__file__).resolve().parents[1] / "support"
ADMIN_KEY = "contract-admin-key"
USER_KEY = "contract-user-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class Target:
    """The app the fuzzer's requests go to (set by ``served``), without its lifespan.

    Schemathesis starts an app's lifespan on first use and ends it only at exit; the
    fixture runs the real app's lifespan itself, and ends it.
    """

    app: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            assert self.app is not None, "requests before the served fixture"
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


# Bodies valid only against what the server holds: a schedule definition names a flow of
# flows.yaml, a cron expression and a time zone the server checks (422 otherwise), which
# no JSON Schema can list. Every other operation must accept what its schema allows.
STATEFUL_VALIDITY = {("POST", "/api/schedules"), ("PATCH", "/api/schedules/{schedule_id}")}


@contextmanager
def _default_settings() -> Iterator[None]:
    """No ASYNCFLOW_* variable (tests/conftest.py clears them per test; these apps outlive one)."""
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("ASYNCFLOW_")]:
            patch.delenv(key)
        yield


def _document() -> dict[str, Any]:
    with _default_settings():
        runtime = InProcess(load_flows(SUPPORT / "flows.yaml"), Path(tempfile.gettempdir())).runtime
        return create_app(runtime).openapi()


DOCUMENT = _document()
TARGET = Target()
schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.app = TARGET  # in-process, as schemathesis.openapi.from_asgi would set it


def _seed(client: TestClient) -> None:
    """A few stored things of each kind, so that list answers are not empty."""
    for n in range(3):
        answer = client.post(
            "/api/tasks", json={"flow": "three", "task_id": f"seed-{n}", "parameters": {"n": n}}, headers=ADMIN
        )
        assert answer.status_code == 201, answer.text
    assert client.post("/api/tasks/seed-0/cancel", headers=ADMIN).status_code == 200
    schedule = {"schedule_id": "nightly", "flow": "noop", "cron": "0 3 * * *", "parameters": {"a": 1}}
    assert client.post("/api/schedules", json=schedule, headers=ADMIN).status_code == 201, "schedule"
    assert client.post("/api/schedules/nightly/trigger", headers=ADMIN).status_code == 200
    v1 = [
        ("/v1/register_task_type", {"task_type_data": {"task_type": "convert"}}),
        ("/v1/create_task", {"task_data": {"task_type": "convert", "task_id": "v1-seed", "task_content": "{}"}}),
    ]
    for path, body in v1:
        assert client.post(path, json=body, headers=ADMIN).json()["code"] == 0, path


def _runtime(home: Path, store: TaskStore) -> Runtime:
    settings = Settings(home=home, api_keys=f"{ADMIN_KEY}=root:admin,{USER_KEY}=alice")
    return InProcess(load_flows(SUPPORT / "flows.yaml"), home, store, settings=settings).runtime


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The app over a fresh SQLite database, seeded, as the fuzzer's target; a client of it."""
    home = tmp_path_factory.mktemp("contract")
    url = f"sqlite:///{home / 'tasks.sqlite'}"
    upgrade(url)
    store = open_store(url)
    try:
        with _default_settings(), open_client(_runtime(home, store)) as client:
            _seed(client)
            TARGET.app = client.app
            yield client
    finally:
        TARGET.app = None
        store.close()
        shutil.rmtree(home, ignore_errors=True)


def test_the_fuzzed_document_is_the_served_one(served: TestClient) -> None:
    assert served.get("/openapi.json").json() == DOCUMENT


@schema.parametrize()
@hypothesis.settings(
    max_examples=20,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_the_server_answers_as_its_document_says(served: TestClient, case: schemathesis.Case) -> None:
    excluded = []
    if case.path.startswith("/v1/"):
        # The v1 API answers HTTP 200 to every request, invalid ones included, with code 1
        # (seed compatibility): invalid data is refused in the body, not by the status.
        excluded.append(negative_data_rejection)
    if (case.method, case.path) in STATEFUL_VALIDITY:
        excluded.append(positive_data_acceptance)
    case.call_and_validate(headers=ADMIN, excluded_checks=excluded)


@pytest.mark.parametrize(
    ("method", "path", "template"),
    [
        ("GET", "/api/tasks/seed-0", "/api/tasks/{task_id}"),
        ("GET", "/api/tasks/seed-1", "/api/tasks/{task_id}"),
        ("POST", "/api/tasks/seed-0/retry", "/api/tasks/{task_id}/retry"),
        ("GET", "/api/schedules/nightly", "/api/schedules/{schedule_id}"),
        ("GET", "/api/schedules/nightly/runs", "/api/schedules/{schedule_id}/runs"),
        ("GET", "/v1/get_task?task_id=v1-seed", "/v1/get_task"),
        ("GET", "/v1/get_task_counts_by_type?task_type=convert", "/v1/get_task_counts_by_type"),
    ],
)
def test_stored_documents_match_their_schema(
    served: TestClient, method: str, path: str, template: str
) -> None:
    """The fuzzer's ids are random: documents of stored things are checked here by name."""
    answer = served.request(method, path, headers=ADMIN)
    assert answer.status_code == 200, answer.text
    schema[template][method].validate_response(answer)


REFUSALS = [
    # (what, key, method, path, body or raw bytes, status)
    ("no key", None, "GET", "/api/tasks", None, 401),
    ("unknown key", "not-a-key-at-all", "GET", "/api/tasks/seed-1", None, 401),
    ("another user's task", USER_KEY, "GET", "/api/tasks/seed-1", None, 404),
    ("for another user", USER_KEY, "POST", "/api/tasks", {"flow": "three", "user_id": "bob"}, 403),
    ("list another user's", USER_KEY, "GET", "/api/tasks?user_id=bob", None, 403),
    ("unknown flow", ADMIN_KEY, "POST", "/api/tasks", {"flow": "nope"}, 404),
    ("task id taken", ADMIN_KEY, "POST", "/api/tasks", {"flow": "noop", "task_id": "seed-1"}, 409),
    ("not JSON", ADMIN_KEY, "POST", "/api/tasks", b"{", 400),
    ("NaN", ADMIN_KEY, "POST", "/api/tasks", b'{"flow": "three", "parameters": {"x": NaN}}', 400),
    ("too large", ADMIN_KEY, "POST", "/api/tasks", b" " * (1024 * 1024 + 1), 413),
    ("NUL in a key", ADMIN_KEY, "POST", "/api/tasks", {"flow": "three", "parameters": {"a\u0000": 1}}, 422),
    ("nothing to resume", ADMIN_KEY, "POST", "/api/tasks/seed-2/resume", None, 409),
    ("no such id", ADMIN_KEY, "GET", "/api/tasks/no%00such", None, 404),
    ("no such schedule", ADMIN_KEY, "DELETE", "/api/schedules/no%00such", None, 404),
    ("bad range", ADMIN_KEY, "POST", "/api/schedules/nightly/backfill", {"start": 10, "end": 1}, 422),
    ("v1 no key", None, "POST", "/v1/create_task", {"task_data": {"task_type": "convert"}}, 401),
]


@pytest.mark.parametrize(("key", "method", "path", "body", "status"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_are_documented(
    served: TestClient, key: str | None, method: str, path: str, body: Any, status: int
) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        answer = served.request(method, path, content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        answer = served.request(method, path, json=body, headers=headers)
    assert answer.status_code == status, answer.text
    template = next(t for t in DOCUMENT["paths"] if re.fullmatch(re.sub(r"\{\w+\}", "[^/]+", t), path.split("?")[0]))
    schema[template][method].validate_response(answer)


def test_options_and_other_methods_name_every_method_of_the_path(
    served: TestClient,
) -> None:
    client = served
    for path, allowed in [
        ("/api/tasks", {"GET", "POST"}),
        ("/api/schedules/nightly", {"DELETE", "GET", "PATCH"}),
        ("/v1/create_task", {"POST"}),
    ]:
        for method in ("OPTIONS", "PUT", "HEAD"):
            answer = client.request(method, path, headers=ADMIN)
            assert answer.status_code == 405, (method, path)
            assert set(answer.headers["allow"].split(", ")) == allowed, (method, path)
            if method != "HEAD":  # no body in an answer to HEAD
                assert answer.json()["error"].startswith(f"method {method} is not allowed")
    # The documentation's assets (a mount of static files).
    answer = client.post("/static/docs/swagger-ui.css")
    assert (answer.status_code, answer.headers["allow"]) == (405, "GET, HEAD")


def test_errors_are_documented_as_sent(served: TestClient) -> None:
    """The 422 body is {error, detail: [{field, problem}]}, and the document says exactly that."""
    client = served
    document = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in str(document)
    answer = client.post("/api/tasks", json={"flow": "three", "user_id": "a\x01b"}, headers=ADMIN)
    assert answer.status_code == 422
    assert answer.json()["detail"] == [{"field": "user_id", "problem": "must not contain control characters"}]
    invalid = document["paths"]["/api/tasks"]["post"]["responses"]["422"]["content"]["application/json"]["schema"]
    assert invalid == {"$ref": "#/components/schemas/Invalid"}
    submit = document["components"]["schemas"]["SubmitRequest"]["properties"]
    pattern = submit["user_id"]["pattern"]  # beside anyOf [string, null]: it applies to the string
    assert re.fullmatch(pattern, "alice") and not re.search(pattern, "a\x01b")
    assert submit["parameters"]["propertyNames"] == {"pattern": "^[^\\x00]*$"}


def test_v1_posts_declare_their_bodies(served: TestClient) -> None:
    client = served
    paths = client.get("/openapi.json").json()["paths"]
    for name, wrapper in [
        ("create_task", "task_data"),
        ("create_tasks", "task_list"),
        ("register_task_type", "task_type_data"),
        ("register_task", "task_config_data"),
        ("hold_tasks", "task_type"),
        ("set_task", "task_data"),
    ]:
        body = paths[f"/v1/{name}"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert wrapper in body["required"], name
        assert "$ref" not in str(body), name  # inlined: the document has no $defs to point to


# --- /docs and /redoc --------------------------------------------------------------------

ASSET_TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png"}


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_documentation_pages_load_nothing_from_another_origin(
    served: TestClient, page: str
) -> None:
    client = served
    answer = client.get(page)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/html")
    html = answer.text
    assert "//" not in re.sub(r"<!--.*?-->", "", html, flags=re.S).replace("http://www.w3.org", ""), html
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
    assert assets, html
    for asset in assets:
        assert asset.startswith("/static/docs/"), asset
        served_asset = client.get(asset)
        assert served_asset.status_code == 200, asset
        assert ASSET_TYPES[Path(asset).suffix] in served_asset.headers["content-type"], asset
        assert len(served_asset.content) > 500, asset
    assert "'/openapi.json'" in html or '"/openapi.json"' in html
