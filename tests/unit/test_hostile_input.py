"""Hostile input, generated: the intake API and the flows.yaml loader never crash.

For any body, query, path or header: the API answers below 500, every error is
``{"error": ...}``, and the store holds exactly the tasks whose submit was
answered 201 (nothing half-stored). The limits hold: body size, parameters size
and depth, string lengths, list limits. For any document, ``parse_flows`` and
``load_flows`` raise nothing but FlowsError, whose lines name the file.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from oss_api.testing import TestClient, open_client
from shared.config import Settings
from shared.flows import FlowsError, FlowSet, load_flows, parse_flows
from shared.storable import MAX_PARAMETERS_DEPTH
from shared.storage import TaskFilter
from shared.storage.sql import SqliteStore
from shared.testing import InProcess

SUPPORT = Path(__file__).resolve().parents[1] / "support"
MAX_BODY = 1_048_576
MAX_PARAMETERS = 65_536
KEY = "fuzz-admin-key-0001"
FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Target:
    client: TestClient
    store: SqliteStore
    headers: dict[str, str]
    accepted: set[str] = field(default_factory=set)

    def check(self, response: httpx.Response) -> httpx.Response:
        """Every answer is below 500; errors are {"error": text}; the store holds the accepted tasks."""
        assert response.status_code < 500, response.text
        body = response.json()
        if response.status_code >= 400:
            assert isinstance(body, dict) and isinstance(body.get("error"), str), body
            assert set(body) <= {"error", "detail"}, body
        if response.request.method == "POST" and response.request.url.path == "/api/tasks":
            if response.status_code == 201:
                assert body["task_id"] not in self.accepted
                self.accepted.add(body["task_id"])
                assert_storable_on_postgresql(body)
            elif response.status_code == 200:
                assert body["task_id"] in self.accepted  # a replay
            else:
                assert response.status_code in (400, 401, 403, 404, 409, 413, 422), response.text
        stored = self.stored()
        half_stored, lost = stored - self.accepted, self.accepted - stored
        self.accepted = stored  # one failure must not fail every later example too
        assert not half_stored and not lost, f"stored without a 201: {half_stored}; lost: {lost}"
        return response

    def stored(self) -> set[str]:
        return {t.task_id for t in self.store.list(TaskFilter(limit=100_000))}

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.client.request(method, path, **kwargs)
        except Exception:  # a crash in the app (TestClient re-raises it): start the next example clean
            self.accepted = self.stored()
            raise
        return self.check(response)

    def post(self, path: str, content: bytes, **headers: str) -> httpx.Response:
        headers = {"content-type": "application/json", **self.headers, **headers}
        return self.request("POST", path, content=content, headers=headers)


def assert_storable_on_postgresql(value: Any) -> None:
    """SQLite stores anything; PostgreSQL's text and jsonb refuse NUL and lone surrogates."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            assert "\x00" not in item, item
            item.encode("utf-8")  # raises on a lone surrogate


def _target(tmp: Path, api_keys: str) -> Iterator[Target]:
    store = SqliteStore(f"sqlite:///{tmp / 'tasks.sqlite'}")
    store.create_schema()
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp, store, settings=Settings(home=tmp, api_keys=api_keys))
    try:
        with open_client(app.runtime) as client:
            yield Target(client, store, {"Authorization": f"Bearer {KEY}"} if api_keys else {})
    finally:
        store.close()


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """Authentication on, as the admin: every route is reachable."""
    yield from _target(tmp_path_factory.mktemp("hostile"), f"{KEY}=fuzz:admin,fuzz-user-key-0002=someone")


@pytest.fixture(scope="module")
def open_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """The embedded default: no keys."""
    yield from _target(tmp_path_factory.mktemp("hostile-open"), "")


# --- strategies ------------------------------------------------------------------------------------

texts = st.text(max_size=80)
url_texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=80)  # what httpx can encode
scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | texts
    | st.sampled_from(["", "\x00", "\ud800", "é\u202e", "a" * 300, "../../etc/passwd", "NaN", "{}"])
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=24
)
FIELDS = ["flow", "parameters", "priority", "user_id", "task_id"]
submit_bodies = st.fixed_dictionaries(
    {},
    optional={
        "flow": st.sampled_from(["three", "noop", "nope", "", "three\x00", "x" * 65]) | json_values,
        "parameters": st.dictionaries(texts, json_values, max_size=6) | json_values,
        "priority": st.integers(-(10**30), 10**30) | json_values,
        "user_id": st.sampled_from(["fuzz", "someone", "u" * 128, "u" * 129, "a\x00b", "tab\there"]) | json_values,
        "task_id": st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,70}", fullmatch=True) | json_values,
        "extra": json_values,
    },
)


def nested(depth: int, kind: str) -> bytes:
    inner = "[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth
    return b'{"flow":"three","parameters":{"x":' + inner.encode() + b"}}"


# --- POST /api/tasks ---------------------------------------------------------------------------------


@settings(FUZZ, max_examples=150)
@given(body=submit_bodies, flow=st.sampled_from(["three", "noop"]))
def test_any_submit_body_is_answered_below_500_and_stores_only_what_it_accepts(
    api: Target, body: dict[str, Any], flow: str
) -> None:
    body.setdefault("flow", flow)  # mostly get past "flow: Field required"
    r = api.post("/api/tasks", json.dumps(body).encode())
    if r.status_code == 201:  # (200 is a replay of an earlier task_id: the stored task's document)
        doc = r.json()
        assert doc["parameters"] == body.get("parameters", {})
        assert len(json.dumps(doc["parameters"], separators=(",", ":"), ensure_ascii=False).encode()) <= MAX_PARAMETERS


@settings(FUZZ, max_examples=100)
@given(value=json_values)
def test_any_json_value_as_the_body(api: Target, value: Any) -> None:
    api.post("/api/tasks", json.dumps(value).encode())


@settings(FUZZ, max_examples=100)
@given(content=st.binary(max_size=2000) | st.text(max_size=500).map(lambda t: t.encode("utf-8", "surrogatepass")))
@example(content=b"")
@example(content=b'{"flow": "three", "parameters": {"x": "\xff"}}')
@example(content=b'{"flow": "three", "priority": ' + b"9" * 5000 + b"}")
@example(content=b'{"flow": "three", "parameters": {"x": 1e400}}')
@example(content=b'{"flow": "three", "parameters": {"x": "\\ud800"}}')
@example(content=b'{"flow": "three", "parameters": {"x\\u0000": 1}}')
def test_any_bytes_as_the_body(api: Target, content: bytes) -> None:
    api.post("/api/tasks", content)


@settings(FUZZ, max_examples=30)
@given(depth=st.integers(1, 5000), kind=st.sampled_from(["list", "dict"]))
@example(depth=MAX_PARAMETERS_DEPTH - 1, kind="list")  # parameters + these: 32 levels, the limit
@example(depth=MAX_PARAMETERS_DEPTH, kind="list")  # one level over
@example(depth=MAX_PARAMETERS_DEPTH - 1, kind="dict")
@example(depth=MAX_PARAMETERS_DEPTH, kind="dict")
@example(depth=300, kind="list")  # past the response serializer's depth limit
@example(depth=5000, kind="dict")  # past the parser's recursion limit
def test_deeply_nested_parameters_are_refused_before_anything_is_stored(api: Target, depth: int, kind: str) -> None:
    r = api.post("/api/tasks", nested(depth, kind))
    # The containers are `parameters` itself plus `depth` nested lists or objects.
    if depth + 1 <= MAX_PARAMETERS_DEPTH:
        assert r.status_code == 201, r.text
    else:
        assert r.status_code in (400, 422), r.text


@settings(FUZZ, max_examples=20)
@given(size=st.integers(0, MAX_BODY + 1000), where=st.sampled_from(["parameters", "flow", "user_id", "task_id"]))
@example(size=MAX_PARAMETERS - 8, where="parameters")
@example(size=MAX_PARAMETERS - 7, where="parameters")
@example(size=MAX_BODY, where="parameters")
def test_huge_strings_hit_the_limits(api: Target, size: int, where: str) -> None:
    body: dict[str, Any] = {"flow": "noop", "parameters": {}}
    if where == "parameters":
        body["parameters"] = {"x": "a" * size}
    else:
        body[where] = "a" * size
    content = json.dumps(body).encode()
    r = api.post("/api/tasks", content)
    if len(content) > MAX_BODY:
        assert r.status_code == 413
    elif where == "parameters":
        assert r.status_code == (201 if size + 8 <= MAX_PARAMETERS else 413), r.text
    elif size > {"flow": 64, "user_id": 128, "task_id": 64}[where] or (where == "task_id" and size == 0):
        assert r.status_code == 422, r.text
    else:
        assert r.status_code in {"flow": (404,), "user_id": (201,), "task_id": (201, 200)}[where], r.text


# --- reads and actions -------------------------------------------------------------------------------

query_keys = st.sampled_from(["flow", "status", "user_id", "limit"]) | url_texts
query_values = url_texts | st.integers(-(10**20), 10**20).map(str) | st.sampled_from(["0", "1000", "1001", "", "\x00"])


@settings(FUZZ, max_examples=150)
@given(params=st.dictionaries(query_keys, query_values, max_size=5))
@example(params={"limit": "9" * 5000})
@example(params={"flow": "a" * 10_000, "user_id": "u" * 10_000})
@example(params={"user_id": "\x00", "flow": "\x00"})
def test_any_list_query_is_answered_below_500(api: Target, params: dict[str, str]) -> None:
    r = api.request("GET", "/api/tasks", params=params, headers=api.headers)
    if r.status_code == 200:
        tasks = r.json()["tasks"]
        assert len(tasks) <= min(int(params.get("limit", 50)), 1000)


RAW_SAFE = "/%:@.-_~!$&'()*+,;="
task_ids = (
    url_texts
    | st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True)
    | st.sampled_from(["..", "../..", "..%2F..%2Fetc%2Fpasswd", "%00", "%2e%2e", "a/b", " ", "x" * 10_000, "é"])
)


@settings(FUZZ, max_examples=150)
@given(
    task_id=task_ids,
    action=st.sampled_from(["", "/cancel", "/retry", "/resume", "/other", "/cancel/x"]),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    encode=st.booleans(),
)
def test_any_path_under_api_tasks_is_answered_below_500(
    api: Target, task_id: str, action: str, method: str, encode: bool
) -> None:
    # Encoded: one path segment whatever it holds. Raw: slashes, dots and percent signs act
    # as themselves (traversal, double encoding); only what a URL cannot carry is escaped.
    path = f"/api/tasks/{quote(task_id, safe='' if encode else RAW_SAFE)}{action}"
    api.request(method, path, headers=api.headers)


@pytest.fixture(scope="module")
def known(api: Target) -> str:
    r = api.post("/api/tasks", json.dumps({"flow": "three", "task_id": "known-task"}).encode())
    assert r.status_code == 201
    return "known-task"


@settings(FUZZ, max_examples=40)
@given(action=st.sampled_from(["cancel", "retry", "resume"]), repeat=st.integers(1, 3))
def test_actions_on_a_real_task_in_any_order_are_answered_below_500(
    api: Target, known: str, action: str, repeat: int
) -> None:
    for _ in range(repeat):
        r = api.request("POST", f"/api/tasks/{known}/{action}", headers=api.headers)
        assert r.status_code in (200, 409), r.text


# --- credentials ------------------------------------------------------------------------------------

header_texts = st.text(st.sampled_from(string.printable.strip() + " "), max_size=300)


@settings(FUZZ, max_examples=100)
@given(
    name=st.sampled_from(["Authorization", "X-API-Key"]),
    prefix=st.sampled_from(["", "Bearer ", "bearer ", "Basic ", "Bearer  "]),
    value=header_texts,
)
def test_any_credentials_other_than_a_key_are_401(api: Target, name: str, prefix: str, value: str) -> None:
    r = api.request("GET", "/api/tasks", headers={name: prefix + value})
    assert r.status_code == 401, r.text
    assert r.headers["WWW-Authenticate"] == "Bearer"


@settings(FUZZ, max_examples=60)
@given(user_id=url_texts, body=submit_bodies)
def test_a_tenant_never_reaches_another_users_tasks(api: Target, user_id: str, body: dict[str, Any]) -> None:
    tenant = {"Authorization": "Bearer fuzz-user-key-0002"}
    r = api.request("GET", "/api/tasks", params={"user_id": user_id}, headers=tenant)
    if r.status_code == 200:
        assert {doc["user_id"] for doc in r.json()["tasks"]} <= {"someone"}
    body.setdefault("flow", "noop")
    r = api.request("POST", "/api/tasks", content=json.dumps(body).encode(),
                    headers={**tenant, "content-type": "application/json"})
    if r.status_code in (200, 201):
        assert r.json()["user_id"] == "someone"


# --- the embedded default (no keys) -----------------------------------------------------------------


@settings(FUZZ, max_examples=60)
@given(body=submit_bodies, flow=st.sampled_from(["three", "noop"]))
def test_without_keys_too(open_api: Target, body: dict[str, Any], flow: str) -> None:
    body.setdefault("flow", flow)
    open_api.post("/api/tasks", json.dumps(body).encode())


# --- flows.yaml ------------------------------------------------------------------------------------

FLOW_WORDS = [
    "flows", "modules", "steps", "normal", "rollback", "module", "command", "timeout", "retry",
    "retry_interval", "max_retry_interval", "description", "import", "mode", "push", "f", "alpha",
]
flow_keys = st.sampled_from(FLOW_WORDS) | texts | st.integers() | st.none() | st.booleans() | st.floats()
flow_scalars = scalars | st.sampled_from(FLOW_WORDS) | st.sampled_from([0, 1, 300, -1, 10**9, 0.5])
flow_documents = st.recursive(
    flow_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(flow_keys, inner, max_size=5),
    max_leaves=30,
)
ACTION = {"module": "alpha", "command": "step", "timeout": 20}


def assert_names_the_source(exc: FlowsError, source: str) -> None:
    assert exc.problems
    for problem in exc.problems:
        assert problem.startswith(f"{source}: "), problem


@settings(FUZZ, max_examples=300)
@given(data=flow_documents | st.fixed_dictionaries({"flows": st.dictionaries(flow_keys, flow_documents, max_size=3)}))
@example(data={"flows": {"f": {"steps": [{"normal": ACTION}]}}})
@example(data={"flows": {"f": {"steps": [{"normal": {**ACTION, "timeout": float("nan")}}]}}})
@example(data={"flows": {"f": {"steps": [{"normal": {**ACTION, "retry": 10**400}}]}}})
@example(data={"flows": {("a",): 1}})
def test_parse_flows_raises_only_flows_error(data: Any) -> None:
    try:
        result = parse_flows(data, "fuzz.yaml")
    except FlowsError as exc:
        assert_names_the_source(exc, "fuzz.yaml")
        return
    assert isinstance(result, FlowSet)


@pytest.fixture(scope="module")
def flows_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("flows") / "flows.yaml"


def yaml_dump(data: Any) -> str:
    try:
        return yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, UnicodeEncodeError):
        return repr(data)


yaml_texts = (
    st.text(max_size=400)
    | st.lists(st.sampled_from(["flows:", "modules:", "  f:", "    steps:", "      - normal: {module: alpha, command: step}",
                                "- ", "? ", "[", "]", "{", "}", "&a", "*a", "!!binary", "!!python/object:os.system",
                                "\t", ":", "'", '"', "\x00", "\ufeff", "---", "...", "%YAML 1.1"]),
               max_size=20).map("\n".join)
    | flow_documents.map(yaml_dump)
)


@settings(FUZZ, max_examples=300)
@given(content=yaml_texts.map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(max_size=300))
@example(content=b"[" * 5000)
@example(content=b"flows: " + b"{a: " * 3000 + b"}" * 3000)
@example(content=b"{[a]: 1}")
@example(content=b"? {a: 1}\n: 2\n")
@example(content=b"\xff\xfe flows:")
@example(content=b"&a [*a]")
def test_load_flows_raises_only_flows_error_naming_the_file(flows_file: Path, content: bytes) -> None:
    flows_file.write_bytes(content)
    try:
        result = load_flows(flows_file)
    except FlowsError as exc:
        assert_names_the_source(exc, str(flows_file))
        return
    assert isinstance(result, FlowSet)
