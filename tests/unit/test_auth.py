"""API keys and tenancy: who may call, and which tasks each caller sees and acts on.

Through the real app (TestClient) over a real TaskService on a SQLite file and on
the in-memory store, like tests/unit/test_api.py. "Nothing changed" is checked on
the store itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import httpx
import pytest
from click.testing import CliRunner

from asyncflow import cli
from asyncflow.client import ApiClient
from oss_api.auth import AuthConfigError, load_keys
from oss_api.testing import TestClient, open_client
from shared.config import Settings
from shared.flows import load_flows
from shared.states import TaskStatus
from shared.storage import InMemoryStore, TaskFilter, TaskStore
from shared.testing import InProcess, ManualClock, QueuePublisher

SUPPORT = Path(__file__).resolve().parents[1] / "support"
ALICE, BOB, ROOT = "alice-key-0001", "bob-key-00002", "root-key-00003"
KEYS = f"{ALICE}=alice, {BOB}=bob, {ROOT}=ops:admin"
OFF_WARNING = (
    "API authentication is OFF: anyone who can reach this port can read and act on every task; "
    "set ASYNCFLOW_API_KEYS to enable it"
)
MISSING = "missing API key: send 'Authorization: Bearer <key>'"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Api:
    client: TestClient
    store: TaskStore
    publisher: QueuePublisher
    clock: ManualClock

    def submit(self, key: str, body: dict[str, Any], **headers: str) -> httpx.Response:
        self.clock.advance(1.0)  # distinct creation times: "newest first" is exact
        return self.client.post("/api/tasks", json=body, headers={**bearer(key), **headers})

    def get(self, key: str, path: str, **params: Any) -> httpx.Response:
        return self.client.get(path, params=params, headers=bearer(key))

    def post(self, key: str, path: str) -> httpx.Response:
        return self.client.post(path, headers=bearer(key))

    def ids(self, key: str, **params: Any) -> list[str]:
        r = self.get(key, "/api/tasks", **params)
        assert r.status_code == 200, r.text
        return [doc["task_id"] for doc in r.json()["tasks"]]

    def stored(self) -> dict[str, tuple[str | None, TaskStatus]]:
        return {t.task_id: (t.user_id, t.status) for t in self.store.list(TaskFilter(limit=1000))}


@contextmanager
def serving(settings: Settings, store: TaskStore | None = None) -> Iterator[tuple[TestClient, InProcess]]:
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), settings.home, store or InMemoryStore(), settings=settings)
    with open_client(app.runtime) as client:
        yield client, app


@pytest.fixture
def api(tmp_path: Path, store: TaskStore) -> Iterator[Api]:
    with serving(Settings(home=tmp_path, api_keys=KEYS), store) as (client, app):
        yield Api(client, store, app.publisher, app.clock)


def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


ROUTES = [
    ("GET", "/api/tasks"),
    ("POST", "/api/tasks"),
    ("GET", "/api/tasks/t1"),
    ("POST", "/api/tasks/t1/cancel"),
    ("POST", "/api/tasks/t1/retry"),
    ("POST", "/api/tasks/t1/resume"),
    ("GET", "/api/flows"),
]


# --- who is calling ----------------------------------------------------------------------------


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_api_route_needs_a_key(api: Api, method: str, path: str) -> None:
    body = {"flow": "three", "task_id": "t1"} if path == "/api/tasks" and method == "POST" else None
    r = api.client.request(method, path, json=body)
    assert r.status_code == 401, r.text
    assert error_of(r) == MISSING
    assert r.headers["WWW-Authenticate"] == "Bearer"
    r = api.client.request(method, path, json=body, headers=bearer("not-a-known-key"))
    assert r.status_code == 401
    assert error_of(r) == "invalid API key"
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert api.stored() == {}
    assert not api.publisher.messages


WRONG_CREDENTIALS = pytest.mark.parametrize(
    "headers, error",
    [
        ({"Authorization": f"Basic {ALICE}"}, "the Authorization header must be 'Bearer <key>'"),
        ({"Authorization": "Bearer"}, "the Authorization header must be 'Bearer <key>'"),
        ({"Authorization": "Bearer   "}, "the Authorization header must be 'Bearer <key>'"),
        ({"Authorization": f"Bearer {ALICE}x"}, "invalid API key"),
        ({"Authorization": f"Bearer {ALICE.upper()}"}, "invalid API key"),
        ({"X-API-Key": "nope-nope-nope"}, "invalid API key"),
        ({"X-API-Key": ""}, MISSING),
    ],
)


@WRONG_CREDENTIALS
def test_malformed_or_wrong_credentials_are_401(api: Api, headers: dict[str, str], error: str) -> None:
    r = api.client.get("/api/tasks", headers=headers)
    assert r.status_code == 401
    assert error_of(r) == error


@WRONG_CREDENTIALS
def test_a_submit_s_credentials_are_checked_before_its_body(api: Api, headers: dict[str, str], error: str) -> None:
    """POST /api/tasks finds its caller without the schemes' dependencies (oss_api.auth), as before the body."""
    r = api.client.post("/api/tasks", json={"flow": 5, "priority": "high"}, headers=headers)
    assert r.status_code == 401, r.text
    assert error_of(r) == error
    assert r.headers["WWW-Authenticate"] == "Bearer"


KNOWN_KEY = pytest.mark.parametrize(
    "headers",
    [
        bearer(ALICE),
        {"Authorization": f"bearer  {ALICE} "},
        {"X-API-Key": ALICE},
        {"Authorization": "Bearer \t ", "X-API-Key": ALICE},  # a blank bearer token: the other header counts
    ],
)


@KNOWN_KEY
def test_a_known_key_in_either_header_is_accepted(api: Api, headers: dict[str, str]) -> None:
    r = api.client.post("/api/tasks", json={"flow": "noop", "task_id": "t1"}, headers=headers)
    assert r.status_code == 201, r.text
    assert r.json()["user_id"] == "alice"


@KNOWN_KEY
def test_a_known_key_reads_the_same_on_every_route(api: Api, headers: dict[str, str]) -> None:
    """Submits and the v1 routes read the headers themselves (request_caller), the others through CallerDep."""
    assert api.client.get("/api/tasks", headers=headers).status_code == 200
    assert api.client.get("/v1/get_task_schedule_cfg_list", headers=headers).json()["code"] == 0


def test_health_metrics_and_docs_stay_open(api: Api) -> None:
    for path in ["/healthz", "/metrics", "/docs", "/openapi.json"]:
        assert api.client.get(path).status_code == 200, path
    schemes = api.client.get("/openapi.json").json()["components"]["securitySchemes"]
    assert schemes["HTTPBearer"]["scheme"] == "bearer"
    assert schemes["APIKeyHeader"]["name"] == "X-API-Key"


# --- tenancy ---------------------------------------------------------------------------------


def two_tenants(api: Api) -> None:
    for key, task_id in [(ALICE, "a1"), (BOB, "b1"), (ALICE, "a2"), (BOB, "b2")]:
        r = api.submit(key, {"flow": "three", "task_id": task_id, "parameters": {"secret": task_id}})
        assert r.status_code == 201, r.text


def test_a_task_belongs_to_the_caller_who_submitted_it(api: Api) -> None:
    two_tenants(api)
    assert api.stored() == {
        "a1": ("alice", TaskStatus.PENDING), "a2": ("alice", TaskStatus.PENDING),
        "b1": ("bob", TaskStatus.PENDING), "b2": ("bob", TaskStatus.PENDING),
    }
    r = api.submit(ALICE, {"flow": "noop", "task_id": "a3", "user_id": "alice"})  # naming oneself is fine
    assert r.status_code == 201 and r.json()["user_id"] == "alice"


def test_submitting_for_another_user_is_403_and_stores_nothing(api: Api) -> None:
    r = api.submit(ALICE, {"flow": "three", "task_id": "x", "user_id": "bob"})
    assert r.status_code == 403
    assert error_of(r) == "cannot submit tasks for another user (this key belongs to 'alice')"
    assert api.stored() == {}
    assert not api.publisher.messages


def test_each_tenant_lists_only_its_own_tasks(api: Api) -> None:
    two_tenants(api)
    assert api.ids(ALICE) == ["a2", "a1"]
    assert api.ids(BOB) == ["b2", "b1"]
    assert api.ids(ALICE, user_id="alice", flow="three", limit=1) == ["a2"]
    assert api.ids(BOB, status=1) == ["b2", "b1"]
    r = api.get(ALICE, "/api/tasks", user_id="bob")
    assert r.status_code == 403
    assert error_of(r) == "cannot list the tasks of another user (this key belongs to 'alice')"


def test_another_tenants_task_is_404_exactly_like_a_missing_one(api: Api) -> None:
    two_tenants(api)
    assert api.post(BOB, "/api/tasks/b2/cancel").status_code == 200  # retry is now allowed on b2
    before = api.stored()
    published = len(api.publisher.messages)
    for path in ["/api/tasks/{}", "/api/tasks/{}/cancel", "/api/tasks/{}/retry", "/api/tasks/{}/resume"]:
        method = api.get if path == "/api/tasks/{}" else api.post
        for theirs in ["b1", "b2"]:
            hidden = method(ALICE, path.format(theirs))
            missing = method(ALICE, path.format("zz"))
            assert (hidden.status_code, missing.status_code) == (404, 404), (path, hidden.text)
            assert error_of(hidden) == f"no task '{theirs}'"
            assert error_of(missing) == "no task 'zz'"
            assert set(hidden.headers) == set(missing.headers)
    assert api.stored() == before
    assert len(api.publisher.messages) == published


def test_each_tenant_acts_on_its_own_tasks(api: Api) -> None:
    two_tenants(api)
    doc = api.get(ALICE, "/api/tasks/a1").json()
    assert (doc["task_id"], doc["user_id"], doc["parameters"]) == ("a1", "alice", {"secret": "a1"})
    assert api.post(ALICE, "/api/tasks/a1/cancel").json()["task_status"] == 6
    assert api.post(ALICE, "/api/tasks/a1/retry").json()["task_status"] == 2
    r = api.post(ALICE, "/api/tasks/a1/resume")  # her own task: the real reason, not a 404
    assert r.status_code == 409
    assert "only a failed rollback can be resumed" in error_of(r)


def test_the_admin_sees_and_acts_on_every_task(api: Api) -> None:
    two_tenants(api)
    assert api.ids(ROOT) == ["b2", "a2", "b1", "a1"]
    assert api.ids(ROOT, user_id="bob") == ["b2", "b1"]
    assert api.get(ROOT, "/api/tasks/a1").json()["user_id"] == "alice"
    assert api.post(ROOT, "/api/tasks/b1/cancel").json()["task_status"] == 6
    r = api.submit(ROOT, {"flow": "noop", "task_id": "for-bob", "user_id": "bob"})
    assert r.status_code == 201 and r.json()["user_id"] == "bob"
    assert api.ids(BOB) == ["for-bob", "b2", "b1"]
    r = api.submit(ROOT, {"flow": "noop", "task_id": "own"})
    assert r.json()["user_id"] == "ops"  # no user_id: the admin's own


@pytest.mark.parametrize("how", ["task_id", "Idempotency-Key"])
def test_replaying_another_tenants_task_id_is_409_without_its_document(api: Api, how: str) -> None:
    def submit(key: str) -> httpx.Response:
        if how == "task_id":
            return api.submit(key, {"flow": "three", "task_id": "shared-id", "parameters": {"secret": 42}})
        return api.submit(key, {"flow": "three", "parameters": {"secret": 42}}, **{"Idempotency-Key": "shared-id"})

    first = submit(ALICE)
    assert first.status_code == 201
    r = submit(BOB)
    assert r.status_code == 409
    assert error_of(r) == "task id 'shared-id' is already used"
    assert "alice" not in r.text and "secret" not in r.text
    again = submit(ALICE)
    assert again.status_code == 200
    assert again.json() == first.json()
    assert api.stored() == {"shared-id": ("alice", TaskStatus.PENDING)}
    assert len(api.publisher.messages) == 1


# --- configuration -----------------------------------------------------------------------------


def callers(settings: Settings) -> dict[str, tuple[str | None, bool]]:
    table = load_keys(settings)
    found = {}
    for key in [ALICE, BOB, ROOT, "other-key-0004"]:
        who = table.lookup(key)
        if who is not None:
            found[key] = (who.user, who.admin)
    return found


def test_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCFLOW_API_KEYS", f"{ALICE}=alice,{ROOT}=ops:admin,")
    settings = Settings()
    assert callers(settings) == {ALICE: ("alice", False), ROOT: ("ops", True)}
    assert ALICE not in repr(settings)  # a secret: never printed with the settings


def test_a_key_may_contain_equals_signs(tmp_path: Path) -> None:
    table = load_keys(Settings(home=tmp_path, api_keys="abc+/def==ghi==team-a:admin"))
    who = table.lookup("abc+/def==ghi=")
    assert who is not None and (who.user, who.admin) == ("team-a", True)


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json", ".keys"])
def test_keys_from_a_yaml_or_json_file(tmp_path: Path, suffix: str) -> None:
    data = {ALICE: {"user": "alice"}, BOB: {"user": "bob", "admin": False}, ROOT: {"user": "ops", "admin": True}}
    path = tmp_path / f"keys{suffix}"
    path.write_text(json.dumps(data) if suffix == ".json" else _yaml(data))
    assert callers(Settings(home=tmp_path, api_keys_file=path)) == {
        ALICE: ("alice", False), BOB: ("bob", False), ROOT: ("ops", True)
    }


def _yaml(data: dict[str, dict[str, Any]]) -> str:
    lines = ["# API keys"]
    for key, value in data.items():
        fields = ", ".join(f"{k}: {json.dumps(v)}" for k, v in value.items())
        lines.append(f"{key}: {{{fields}}}")
    return "\n".join(lines) + "\n"


def test_keys_from_the_environment_and_a_file_together(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"{BOB}: {{user: bob}}\n")
    assert callers(Settings(home=tmp_path, api_keys=f"{ALICE}=alice", api_keys_file=path)) == {
        ALICE: ("alice", False), BOB: ("bob", False)
    }


def test_an_empty_keys_file_variable_means_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCFLOW_API_KEYS_FILE", "")
    assert not load_keys(Settings()).enabled


@pytest.mark.parametrize(
    "text, error",
    [
        ("ops", "ASYNCFLOW_API_KEYS: entry 1: expected KEY=user or KEY=user:admin"),
        (f"{ALICE}=alice,{BOB}", "ASYNCFLOW_API_KEYS: entry 2: expected KEY=user or KEY=user:admin"),
        (f"{ALICE}=", "ASYNCFLOW_API_KEYS: entry 1: expected KEY=user or KEY=user:admin"),
        (" , ,", "ASYNCFLOW_API_KEYS is set but holds no keys"),
        ("short=ops", "ASYNCFLOW_API_KEYS: entry 1: invalid key (a key is 8-256 visible ASCII"),
        (f"{ALICE}=alice:root", "ASYNCFLOW_API_KEYS: entry 1: unknown scope 'root' after the user"),
        (f"{ALICE}=al ice", "ASYNCFLOW_API_KEYS: entry 1: invalid user 'al ice' (a user is 1-128 characters"),
        (f"{ALICE}=alice,{ALICE}=bob", "ASYNCFLOW_API_KEYS: entry 2 (user 'bob'): the same key is already "
                                       "configured by ASYNCFLOW_API_KEYS: entry 1 (user 'alice')"),
    ],
)
def test_a_bad_key_list_fails_naming_the_entry_but_not_the_key(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(AuthConfigError) as caught:
        load_keys(Settings(home=tmp_path, api_keys=text))
    assert str(caught.value).startswith(error), caught.value
    for key in (ALICE, BOB, "short"):
        assert key not in str(caught.value)


@pytest.mark.parametrize(
    "name, text, error",
    [
        ("keys.yaml", "", "expected a mapping of API key to {user: NAME, admin: false}"),
        ("keys.yaml", "{}", "the file holds no keys"),
        ("keys.yaml", "- alice\n", "expected a mapping"),
        ("keys.yaml", f"{ALICE}: alice\n", "entry 1: expected {user: NAME, admin: false}"),
        ("keys.yaml", f"{ALICE}: {{user: alice}}\n{BOB}: {{user: bob, admin: maybe}}\n",
         "entry 2 (user 'bob'): admin must be true or false"),
        ("keys.yaml", f"{ALICE}: {{user: alice, role: admin}}\n", "entry 1 (user 'alice'): unknown field(s) role"),
        ("keys.yaml", f"{ALICE}: {{admin: true}}\n", "entry 1: invalid user 'None'"),
        ("keys.yaml", "12345678: {user: alice}\n", "entry 1: the key must be a string (quote it)"),
        ("keys.yaml", f"{ALICE}: {{user: alice}}\n{ALICE}: {{user: bob}}\n",
         "not valid YAML: a key appears twice at line 2, column 1"),
        ("keys.yaml", f"{ALICE}: {{user: alice\n", "not valid YAML: "),
        ("keys.json", f'{{"{ALICE}": {{"user": "alice"}}, "{ALICE}": {{"user": "bob"}}}}', "a key appears twice (entry 2)"),
        ("keys.json", f'{{"{ALICE}": {{"user": "alice"}},}}', "not valid JSON: "),
        ("keys.json", f'{{"{ALICE}": {{"user": "alice", "admin": "yes"}}}}', "entry 1 (user 'alice'): admin must be true or false"),
    ],
)
def test_a_bad_keys_file_fails_naming_the_file_and_entry(tmp_path: Path, name: str, text: str, error: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(AuthConfigError) as caught:
        load_keys(Settings(home=tmp_path, api_keys_file=path))
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    assert error in message
    assert ALICE not in message and BOB not in message


def test_an_unreadable_or_binary_keys_file_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match=r"keys\.yaml: cannot read the API keys file: No such file"):
        load_keys(Settings(home=tmp_path, api_keys_file=tmp_path / "keys.yaml"))
    binary = tmp_path / "keys.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(AuthConfigError, match=r"keys\.bin: not UTF-8 text"):
        load_keys(Settings(home=tmp_path, api_keys_file=binary))


def test_the_app_refuses_to_start_with_bad_keys(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match="ASYNCFLOW_API_KEYS: entry 1"), serving(
        Settings(home=tmp_path, api_keys="nonsense")
    ):
        pass


def test_asyncflow_api_fails_at_start_up_on_bad_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncflow.serve

    def must_not_run(*args: Any) -> None:
        raise AssertionError("the API started")

    monkeypatch.setattr(asyncflow.serve, "run_api", must_not_run)
    path = tmp_path / "keys.yaml"
    path.write_text(f"{ALICE}: {{user: alice, admin: perhaps}}\n")
    monkeypatch.setenv("ASYNCFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ASYNCFLOW_FLOWS", str(SUPPORT / "flows.yaml"))
    monkeypatch.setenv("ASYNCFLOW_API_KEYS_FILE", str(path))
    result = CliRunner().invoke(cli.main, ["api"])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"{path}: entry 1 (user 'alice'): admin must be true or false\n"


# --- logs -----------------------------------------------------------------------------------------


def test_without_keys_the_api_is_open_and_says_so_loudly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="oss_api")
    with serving(Settings(home=tmp_path)) as (client, _):
        warnings_logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "oss_api.auth"]
        assert warnings_logged == [(logging.WARNING, OFF_WARNING)]
        r = client.post("/api/tasks", json={"flow": "noop", "user_id": "anyone"})
        assert r.status_code == 201 and r.json()["user_id"] == "anyone"
        assert client.get("/api/tasks", params={"user_id": "anyone"}).json()["tasks"]


def test_with_keys_the_start_up_log_counts_them_and_never_shows_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with serving(Settings(home=tmp_path, api_keys=KEYS + ",change-me-admin=ops2:admin")) as (client, _):
        client.get("/api/tasks", headers=bearer("wrong-key-0005"))
        client.get("/api/tasks", headers=bearer(ALICE))
    messages = [r.getMessage() for r in caplog.records if r.name == "oss_api.auth"]
    assert messages[:2] == [
        "API authentication is on: 4 key(s), 2 with the admin scope",
        "the API key of 'ops2' is still a 'change-me' placeholder: set real keys in ASYNCFLOW_API_KEYS",
    ]
    assert OFF_WARNING not in messages
    text = "\n".join(r.getMessage() + repr(r.__dict__) for r in caplog.records)
    for key in (ALICE, BOB, ROOT, "change-me-admin", "wrong-key-0005"):
        assert key not in text


# --- the CLI client ------------------------------------------------------------------------------


def test_the_cli_sends_asyncflow_api_key(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    assert api.submit(ALICE, {"flow": "noop", "task_id": "mine"}).status_code == 201
    assert api.submit(BOB, {"flow": "noop", "task_id": "theirs"}).status_code == 201
    seen: list[str | None] = []

    def forward(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization"))
        return api.client.request(request.method, request.url.path, params=request.url.params,
                                  headers=request.headers, content=request.content)

    real = ApiClient
    monkeypatch.setattr(cli, "ApiClient", lambda url, api_key: real(url, api_key, httpx.MockTransport(forward)))
    monkeypatch.setenv("ASYNCFLOW_API_KEY", ALICE)
    result = CliRunner().invoke(cli.main, ["list"])
    assert result.exit_code == 0, result.output
    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == ["mine"]  # under the header
    assert seen == [f"Bearer {ALICE}"]

    result = CliRunner().invoke(cli.main, ["status", "theirs"])
    assert result.exit_code == 1
    assert "Error: 404: no task 'theirs'" in result.output

    monkeypatch.setenv("ASYNCFLOW_API_KEY", "wrong-key-0005")
    result = CliRunner().invoke(cli.main, ["cancel", "mine"])
    assert result.exit_code == 1
    assert "Error: 401: invalid API key (set ASYNCFLOW_API_KEY to a key the API accepts)" in result.output

    monkeypatch.delenv("ASYNCFLOW_API_KEY")
    result = CliRunner().invoke(cli.main, ["list"])
    assert "Error: 401: missing API key: send 'Authorization: Bearer <key>'" in result.output
    assert seen[-1] is None


def test_the_api_client_sends_no_header_without_a_key() -> None:
    assert "Authorization" not in ApiClient("http://127.0.0.1:1").http.headers
    assert ApiClient("http://127.0.0.1:1", api_key="k-123456").http.headers["Authorization"] == "Bearer k-123456"
    refused = httpx.MockTransport(lambda r: httpx.Response(403, json={"error": "cannot list the tasks of another user"}))
    with pytest.raises(click.ClickException) as caught:
        ApiClient("http://127.0.0.1:1", transport=refused).call("GET", "/api/tasks")
    assert caught.value.message == "403: cannot list the tasks of another user"
