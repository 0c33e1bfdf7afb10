"""Hostile input, generated, against the v1 API (/v1/*) on SQLite and PostgreSQL.

For any body or query string, every answer is HTTP 200 with ``code`` 0..5 and a
``msg`` (``SUCCESS``, or ``REASON::message`` naming the reason of the code),
except the 413 of the body limit (oss_api.limits.BodyLimit) for a body over it.
Never code 6 (INTERNAL), never a 5xx. Nothing is half-written: a refused call
leaves the task and task type tables exactly as they were, and a successful one
changes only the rows it names (its task, its type, the tasks it leased).

The tests at the end pin the smallest reproducers of what these fuzzers found.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote_from_bytes

import httpx
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from oss_api.v1 import CODES, TASK_ID
from shared.config import Settings
from shared.flows import load_flows
from shared.pull import MAX_CONTENT_BYTES, NAME, PullStatus
from shared.runtime import Runtime
from shared.storage.schema import pull_tasks, task_types
from shared.storage.sql import SqlStore, open_store
from shared.testing import ManualClock, QueuePublisher
from tests.integration.conftest import empty_tables, migrated_url

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette's test client warns about its httpx import
    from fastapi.testclient import TestClient

from oss_api.app import create_app

SUPPORT = Path(__file__).resolve().parents[1] / "support"
POSTS = ["create_task", "register_task_type", "register_task", "hold_tasks", "set_task"]
GETS = ["get_task", "get_task_list", "get_task_counts_by_type", "get_task_schedule_cfg_list", "ping"]
FAILURE = re.compile(r"([A-Z_]+)::(.+)", re.DOTALL)
# A type registered up front, so that creates, holds and counts get past "unknown task_type".
KNOWN_TYPE = "video"
# set_task's own type: one task per hold, so each example leases the task it reports on.
WORKER_TYPE = "worker"
DOOMED_TYPE = "doomed"
# Never registered: the fuzzers register names of their own, so a short one such as "nope" may exist.
UNKNOWN_TYPE = "unregistered_" + "q" * 40
UNKNOWN = UNKNOWN_TYPE.encode()
FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

Snapshot = dict[str, dict[Any, tuple[Any, ...]]]


# --- the app under test ---------------------------------------------------------------------------


@dataclass
class Api:
    backend: str
    client: TestClient
    store: SqlStore
    runtime: Runtime
    max_body: int

    def snapshot(self) -> Snapshot:
        """Every stored task and task type, by key: what a half-written call would change."""
        with self.store.engine.connect() as conn:
            tasks = {r.task_id: tuple(r) for r in conn.execute(select(pull_tasks))}
            types = {r.task_type: tuple(r) for r in conn.execute(select(task_types))}
        return {"tasks": tasks, "types": types}

    def post(self, path: str, content: bytes) -> dict[str, Any] | None:
        """POST raw bytes; checks the answer and the tables; the v1 answer, or None for a 413."""
        before = self.snapshot()
        response = self.client.post("/v1/" + path, content=content, headers={"content-type": "application/json"})
        return self._check(path, _parsed(content), response, before, len(content))

    def get(self, path: str, query: str) -> dict[str, Any] | None:
        # The GET routes run read-only transactions: no snapshots (they are most of the cost).
        response = self.client.get(f"/v1/{path}?{query}" if query else f"/v1/{path}")
        return self._check(path, parse_qsl(query, keep_blank_values=True), response, None, 0)

    def _check(
        self, path: str, payload: Any, response: httpx.Response, before: Snapshot | None, size: int
    ) -> dict[str, Any] | None:
        after = self.snapshot() if before is not None else None
        changed = {t: _changed(before[t], after[t]) for t in before} if before is not None and after else {}
        # Shown by --hypothesis-show-statistics: how far into each endpoint the examples get.
        if currently_in_test_context():
            outcome = response.json().get("code") if response.status_code == 200 else response.status_code
            event(f"{path}: {outcome}")
        if response.status_code == 413 and size > self.max_body:
            assert response.json() == {"error": f"request body over {self.max_body} bytes"}
            assert not any(changed.values()), changed
            return None
        assert response.status_code == 200, f"HTTP {response.status_code}: {response.text[:500]}"
        answer = response.json()
        code, msg = answer.get("code"), answer.get("msg")
        assert isinstance(msg, str), answer
        assert code in range(6), f"code {code}: {answer}"
        if code == 0:
            assert msg == "SUCCESS", answer
            allowed = _may_change(path, payload, answer)
            for table, keys in changed.items():
                assert keys <= allowed[table], f"{path} succeeded but changed {table} {keys - allowed[table]}"
            if path == "create_task":
                assert after is not None and answer["task_id"] in after["tasks"], answer
        else:
            match = FAILURE.fullmatch(msg)
            assert match is not None and CODES.get(match[1]) == code, answer
            assert not any(changed.values()), f"refused ({msg[:200]}) but changed {changed}"
        return answer


def _changed(before: dict[Any, tuple[Any, ...]], after: dict[Any, tuple[Any, ...]]) -> set[Any]:
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def _may_change(path: str, payload: Any, answer: dict[str, Any]) -> dict[str, set[Any]]:
    """The rows a successful call may add or change; everything else must stay as it was."""
    tasks: set[Any] = set()
    types: set[Any] = set()
    if path == "create_task":
        tasks = {answer["task_id"]}
    elif path in ("register_task_type", "register_task"):
        wrapper = "task_type_data" if path == "register_task_type" else "task_config_data"
        types = {payload[wrapper]["task_type"]}
    elif path == "hold_tasks":
        tasks = {t["task_id"] for t in answer["task_list"]}
        assert all(t["status"] == int(PullStatus.RUNNING) for t in answer["task_list"]), answer
    elif path == "set_task":
        tasks = {payload["task_data"]["task_id"]}
    return {"tasks": tasks, "types": types}


def _parsed(content: bytes) -> Any:
    try:
        return json.loads(content)
    except (ValueError, RecursionError):
        return None


def _api(backend: str, request: pytest.FixtureRequest, tmp: Path) -> Iterator[Api]:
    url = migrated_url(request, backend, tmp / "v1.sqlite")
    store = open_store(url)
    settings_ = Settings(home=tmp)
    runtime = Runtime(settings_, flows=load_flows(SUPPORT / "flows.yaml"), store=store, publisher=QueuePublisher())
    runtime.pull_service.clock = ManualClock()
    # A crash must come back as the 500 a client would see, not as an exception here.
    client = TestClient(create_app(runtime), raise_server_exceptions=False)
    api = Api(backend, client, store, runtime, settings_.max_body_bytes)
    runtime.pull_service.register_type({"task_type": KNOWN_TYPE, "schedule_limit": 1000})
    runtime.pull_service.register_type({"task_type": WORKER_TYPE, "schedule_limit": 1, "max_retry_num": 1000})
    runtime.pull_service.register_type({"task_type": DOOMED_TYPE, "schedule_limit": 1, "max_retry_num": 0})
    runtime.pull_service.create(KNOWN_TYPE, "{}", task_id="known-task")
    try:
        yield api
    finally:
        client.close()
        store.close()
        if backend == "postgres":
            empty_tables(url)


# A failing example can hold megabytes of text: its repr is slow, not wrong.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(scope="module", params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    yield from _api(request.param, request, tmp_path_factory.mktemp("v1-hostile"))


# --- strategies -----------------------------------------------------------------------------------

def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any], weight: int = 4) -> st.SearchStrategy[Any]:
    """``good`` ``weight`` times in ``weight + 1``: most examples must get past validation to reach the store."""
    # Not one_of(good, good, ..., bad): one_of drops repeated branches and flattens nested ones.
    return st.sampled_from([True] * weight + [False]).flatmap(lambda ok: good if ok else bad)


# Lone surrogates included: json.dumps writes them as "\ud800" escapes, which json.loads reads back.
any_chars = st.characters() | st.characters(categories=["Cs"]) | st.sampled_from(["\x00", "\u202e", "\ufeff"])
# Long ones built, not listed: Hypothesis prints its strategies when an example fails.
long_texts = st.sampled_from([("x", 5000), ("é", MAX_CONTENT_BYTES + 1), ("x", MAX_CONTENT_BYTES)]).map(
    lambda p: p[0] * p[1]
)
special_texts = long_texts | st.sampled_from(
    ["", "\x00", "a\x00b", "\ud800", "\udfff", "é\u202e", "../../etc/passwd", "NaN", "{}", "null", "video",
     " video", "VIDEO"]
)
# Hostile text: NUL and friends (storable by SQLite, not by PostgreSQL), or lone surrogates (refused by parsing).
hostile_texts = (
    st.text(st.characters() | st.sampled_from(["\x00", "\u202e", "\ufeff"]), min_size=1, max_size=40)
    | st.text(any_chars, min_size=1, max_size=40)
    | special_texts
)
texts = mostly(st.text(max_size=40), hostile_texts, weight=2)
huge_ints = st.sampled_from([10**30, -(10**30), 2**63, -(2**63) - 1, 2**31, 2**15, 1_000_001, -1_000_001])
scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | huge_ints | st.floats()
    | texts | special_texts
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=20
)
type_names = mostly(
    st.just(KNOWN_TYPE),
    st.sampled_from([WORKER_TYPE, "nope", "", "1abc", "a-b", "a b", "a" * 64, "a" * 65, "video\x00", "é", "_",
                     "alpha"])
    | st.from_regex(NAME, fullmatch=True),
    weight=2,
)
task_ids = mostly(
    st.from_regex(TASK_ID, fullmatch=True),
    st.sampled_from(["/", "a/b", "..", "../..", " ", "a b", "x" * 64, "x" * 65, "x" * 80, "x" * 81, "é", "任务",
                     "a\x00", "-a", "", "known-task"]),
    weight=2,
)
statuses = mostly(st.integers(1, 4), st.integers(-2, 6) | huge_ints, weight=2)
config_ints = mostly(st.integers(-2, 1001), st.integers(-(10**6), 10**6) | huge_ints, weight=2)


def sometimes(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the field's own kind, sometimes any JSON value at all."""
    return mostly(values, json_values, weight=6)


def fields(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """The fields of a wrapper: mostly with the required ones, sometimes any subset."""
    return mostly(
        st.fixed_dictionaries(required, optional=optional),
        st.fixed_dictionaries({}, optional={**required, **optional}),
        weight=3,
    )


def wrapped(right: str, data: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``{right: data}``, sometimes with extra fields, under a wrong name, bare, or in a list."""
    extra = st.dictionaries(texts, json_values, max_size=2)
    wrong = st.sampled_from(["task_data", "task_type_data", "task_config_data", "data", "", right.upper()])
    return mostly(
        st.builds(lambda v: {right: v}, data),
        st.builds(lambda v, e: {**e, right: v}, data, extra)
        | st.builds(lambda k, v: {k: v}, wrong, data)
        | data
        | st.builds(lambda v: [v], data)
        | st.builds(lambda v: {right: [v]}, data),
        weight=5,
    )


contents = mostly(st.text(max_size=200), hostile_texts, weight=2)
create_data = fields(
    {"task_type": sometimes(type_names)},
    {
        "task_content": sometimes(contents),
        "task_priority": sometimes(mostly(st.integers(-(10**6), 10**6), huge_ints)),
        "user_id": sometimes(texts | st.sampled_from(["u" * 128, "u" * 129])),
        "task_stage": sometimes(texts | st.sampled_from(["s" * 64, "s" * 65])),
        "task_id": sometimes(task_ids),
        "taskType": json_values,
    },
)
type_data = fields(
    {"task_type": sometimes(type_names)},
    {
        **{
            name: sometimes(config_ints)
            for name in ["schedule_limit", "schedule_interval", "max_processing_time", "max_retry_num",
                         "max_retry_interval"]
        },
        "schedule_limits": json_values,
    },
)
hold_bodies = fields({"task_type": sometimes(type_names)}, {"task_data": json_values})
RUNNING = object()  # set_task's task_id placeholder: the task this example has just leased
set_data = fields(
    {"task_id": mostly(st.just(RUNNING), sometimes(task_ids), weight=3), "status": sometimes(statuses)},
    {
        "task_type": sometimes(type_names | st.none()),  # read, and ignored
        "schedule_log": sometimes(contents),
        "crt_retry_num": sometimes(mostly(st.integers(-2, 5), huge_ints)),
        "task_stage": sometimes(texts | st.sampled_from(["s" * 65])),
        "task_content": sometimes(contents),
    },
)
BODIES: dict[str, st.SearchStrategy[Any]] = {
    "create_task": wrapped("task_data", create_data),
    "register_task_type": wrapped("task_type_data", type_data),
    "register_task": wrapped("task_config_data", type_data),
    "hold_tasks": mostly(hold_bodies, json_values),
    "set_task": wrapped("task_data", set_data),
}


def encode(value: Any, ascii_only: bool) -> bytes:
    """JSON bytes; with ``ascii_only`` False a lone surrogate becomes invalid UTF-8 on the wire."""
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def substitute(value: Any, old: object, new: Any) -> Any:
    if value is old:
        return new
    if isinstance(value, dict):
        return {k: substitute(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, old, new) for v in value]
    return value


def lease_one(api: Api, task_type: str = WORKER_TYPE) -> str:
    """A running task, leased through the service (not what is under test)."""
    service = api.runtime.pull_service
    created, _ = service.create(task_type, "{}")
    held = service.hold(task_type)
    return held[0].task_id if held else created.task_id


# --- POST: any JSON, the whole body or inside the right wrapper ------------------------------------


@settings(FUZZ, max_examples=150)
@given(path=st.sampled_from(POSTS), value=json_values, ascii_only=st.booleans())
@example(path="create_task", value={"task_data": {"task_type": "video", "task_content": "\ud800"}}, ascii_only=True)
@example(path="create_task", value={"task_data": {"task_type": "video", "task_content": "\ud800"}}, ascii_only=False)
@example(path="create_task", value={"task_data": {"task_type": "video", "task_priority": float("nan")}},
         ascii_only=True)
@example(path="register_task_type", value={"task_type_data": {"task_type": "t", "schedule_limit": float("inf")}},
         ascii_only=True)
def test_any_json_value_as_the_whole_body(api: Api, path: str, value: Any, ascii_only: bool) -> None:
    api.post(path, encode(value, ascii_only))


def _post_fields(api: Api, path: str, body: Any, ascii_only: bool) -> None:
    if path == "set_task":
        body = substitute(body, RUNNING, lease_one(api))
    answer = api.post(path, encode(body, ascii_only))
    if answer is not None and answer["code"] == 0 and path == "create_task":
        given_id = body["task_data"].get("task_id")
        if given_id is not None:
            assert answer["task_id"] == given_id  # a chosen id is kept, never replaced


@pytest.mark.parametrize("path", POSTS)
@settings(FUZZ, max_examples=150)
@given(data=st.data(), ascii_only=st.booleans())
def test_any_fields_in_the_wrapper(api: Api, path: str, data: st.DataObject, ascii_only: bool) -> None:
    _post_fields(api, path, data.draw(BODIES[path], label="body"), ascii_only)


# --- POST: bytes that are not (quite) JSON ---------------------------------------------------------

valid_bodies = st.sampled_from(POSTS).flatmap(BODIES.__getitem__).map(
    lambda v: encode(substitute(v, RUNNING, "some-task"), True)
)
raw_bodies = (
    st.binary(max_size=300)
    | st.text(any_chars, max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass"))
    | valid_bodies.flatmap(lambda b: st.integers(0, max(len(b) - 1, 0)).map(lambda n: b[:n]))  # truncated
    | valid_bodies.flatmap(lambda b: st.sampled_from(["utf-16", "utf-32", "latin-1"]).map(
        lambda enc: b.decode("utf-8").encode(enc, "surrogatepass")))
)


@settings(FUZZ, max_examples=150)
@given(path=st.sampled_from(POSTS), content=raw_bodies)
@example(path="create_task", content=b"")
@example(path="create_task", content=b"\xff\xfe\x00")
@example(path="create_task", content=b'{"task_data": {"task_type": "video", "task_content": "\xff"}}')
@example(path="create_task", content=b'{"task_data": {"task_type": "video", "task_content": "\xed\xa0\x80"}}')
@example(path="create_task", content=b'{"task_data": {"task_type": "video", "task_priority": ' + b"9" * 5000 + b"}}")
@example(path="create_task", content=b'{"task_data": {"task_type": "video", "task_priority": 1e400}}')
@example(path="set_task", content=b'{"task_data": {"task_id": "x", "status": Infinity}}')
@example(path="hold_tasks", content=b'{"task_type": "video"')
@example(path="hold_tasks", content=b"\xef\xbb\xbf" + b'{"task_type": "video"}')
def test_any_bytes_as_the_body(api: Api, path: str, content: bytes) -> None:
    api.post(path, content)


# --- GET: any query string -------------------------------------------------------------------------

# Bounded so that the URL stays under httpx's own length limit (a client-side refusal, not the server's).
query_keys = mostly(st.sampled_from(["task_id", "task_type", "status", "limit", "stage"]), st.text(any_chars, max_size=40))
query_values = mostly(
    st.sampled_from([b"video", b"worker", b"known-task", b"", b"1000", b"1001"]) | st.integers(-2, 6).map(
        lambda n: str(n).encode()
    ),
    st.binary(max_size=30)
    | st.text(any_chars, max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass"))
    | st.integers(-(10**25), 10**25).map(lambda n: str(n).encode())
    | huge_ints.map(lambda n: str(n).encode())
    | st.sampled_from([b"abc", b"1.5", b"NaN", b"\x00", b"a\x00b", b"\xed\xa0\x80", b"\xff", b" 1", b"1_0"])
    | st.builds(lambda c, n: c * n, st.sampled_from([b"x", b"9", b"%"]), st.integers(100, 3000)),
    weight=2,
)
queries = st.lists(st.tuples(query_keys, query_values), max_size=5).map(
    lambda pairs: "&".join(
        f"{quote_from_bytes(k.encode('utf-8', 'surrogatepass'), safe='')}={quote_from_bytes(v, safe='')}"
        for k, v in pairs
    )
)


@settings(FUZZ, max_examples=250)
@given(path=st.sampled_from(GETS[:3] * 3 + GETS[3:]), query=queries)
@example(path="get_task_list", query="limit=" + "9" * 5000)
@example(path="get_task_list", query="status=-1&limit=1000")
@example(path="get_task_list", query="task_type=video&stage=%ED%A0%80")
@example(path="get_task_counts_by_type", query="task_type=video")
@example(path="get_task", query="task_id=..%2F..%2Fetc")
def test_any_query_string(api: Api, path: str, query: str) -> None:
    api.get(path, query)


# --- explicit cases ------------------------------------------------------------------------------

EXPLICIT: list[tuple[str, str, Any, int]] = [
    # (id, path, body, the code it must get)
    ("priority-huge", "create_task", {"task_data": {"task_type": "video", "task_priority": 10**30}}, 1),
    ("priority-huge-negative", "create_task", {"task_data": {"task_type": "video", "task_priority": -(10**30)}}, 1),
    ("priority-over-limit", "create_task", {"task_data": {"task_type": "video", "task_priority": 1_000_001}}, 1),
    ("priority-at-limit", "create_task", {"task_data": {"task_type": "video", "task_priority": -1_000_000}}, 0),
    ("priority-string", "create_task", {"task_data": {"task_type": "video", "task_priority": "high"}}, 1),
    ("schedule-limit-huge", "register_task_type", {"task_type_data": {"task_type": "t_big", "schedule_limit": 10**30}},
     1),
    ("schedule-limit-zero", "register_task", {"task_config_data": {"task_type": "video", "schedule_limit": 0}}, 1),
    ("retry-interval-huge", "register_task", {"task_config_data": {"task_type": "video",
                                                                    "max_retry_interval": -(10**30)}}, 1),
    ("status-huge", "set_task", {"task_data": {"task_id": "x1", "status": 10**30}}, 1),
    ("status-0", "set_task", {"task_data": {"task_id": "x1", "status": 0}}, 1),
    ("status-5", "set_task", {"task_data": {"task_id": "x1", "status": 5}}, 1),
    ("status--1", "set_task", {"task_data": {"task_id": "x1", "status": -1}}, 1),
    ("crt-retry-num-negative", "set_task", {"task_data": {"task_id": "x1", "status": 1, "crt_retry_num": -1}}, 1),
    *[
        (f"task-id-{name}", "create_task", {"task_data": {"task_type": "video", "task_id": task_id}}, 1)
        for name, task_id in [("slash", "a/b"), ("root", "/"), ("dotdot", ".."), ("traversal", "../../etc"),
                              ("space", "a b"), ("blank", " "), ("81-chars", "x" * 81),
                              ("unicode", "tâche"), ("cjk", "任务"), ("nul", "a\x00"), ("newline", "a\n")]
    ],
    # Seed 000: task_id is left empty at creation; "" is how struct-based clients leave it.
    ("task-id-empty-is-generated", "create_task", {"task_data": {"task_type": "video", "task_id": ""}}, 0),
    # Clients that serialize every field send null for the ones they leave out.
    ("null-fields-are-absent", "create_task",
     {"task_data": {"task_type": "video", "task_id": None, "task_priority": None, "task_content": None}}, 0),
    ("null-required-field", "create_task", {"task_data": {"task_type": None}}, 1),
    # Strict JSON types: a string or a boolean where a number belongs is a wrong type.
    ("priority-numeric-string", "create_task", {"task_data": {"task_type": "video", "task_priority": "5"}}, 1),
    ("priority-boolean", "create_task", {"task_data": {"task_type": "video", "task_priority": True}}, 1),
    ("status-numeric-string", "set_task", {"task_data": {"task_id": "x1", "status": "3"}}, 1),
    ("status-float", "set_task", {"task_data": {"task_id": "x1", "status": 3.0}}, 1),
    ("limit-numeric-string", "register_task", {"task_config_data": {"task_type": "video", "schedule_limit": "5"}},
     1),
    # 80, not 64: the id of a pull-mode flow step is "<task id>.<seq>".
    ("task-id-65-chars", "create_task", {"task_data": {"task_type": "video", "task_id": "y" * 65}}, 0),
    ("task-id-80-chars", "create_task", {"task_data": {"task_type": "video", "task_id": "z" * 80}}, 0),
    ("content-over-limit", "create_task",
     {"task_data": {"task_type": "video", "task_content": "x" * (MAX_CONTENT_BYTES + 1)}}, 1),
    ("content-at-limit", "create_task",
     {"task_data": {"task_type": "video", "task_content": "x" * MAX_CONTENT_BYTES}}, 0),
    ("content-object", "create_task", {"task_data": {"task_type": "video", "task_content": {"a": 1}}}, 1),
    ("log-over-limit", "set_task",
     {"task_data": {"task_id": "x1", "status": 3, "schedule_log": "x" * (MAX_CONTENT_BYTES + 1)}}, 1),
    *[
        (f"task-type-{name}", path, body, 1)
        for name, task_type in [("digit-first", "1abc"), ("dash", "a-b"), ("65-chars", "a" * 65), ("empty", ""),
                                ("unicode", "é"), ("space", "a b"), ("nul", "video\x00"), ("number", 7)]
        for path, body in [
            ("create_task", {"task_data": {"task_type": task_type}}),
            ("register_task_type", {"task_type_data": {"task_type": task_type}}),
            ("register_task", {"task_config_data": {"task_type": task_type}}),
            ("hold_tasks", {"task_type": task_type}),
        ]
    ],
    ("task-type-unknown", "create_task", {"task_data": {"task_type": UNKNOWN_TYPE}}, 2),
    ("no-wrapper", "create_task", {"task_type": "video"}, 1),
    ("wrong-wrapper", "register_task_type", {"task_config_data": {"task_type": "video"}}, 1),
    ("set-unknown-task", "set_task", {"task_data": {"task_id": "missing-task", "status": 3}}, 2),
]


@pytest.mark.parametrize(("path", "body", "code"), [pytest.param(*c[1:], id=c[0]) for c in EXPLICIT])
def test_explicit_hostile_bodies(api: Api, path: str, body: Any, code: int) -> None:
    answer = api.post(path, encode(body, True))
    assert answer is not None and answer["code"] == code, answer


@pytest.mark.parametrize(
    ("content", "code", "task_type"),
    [
        # Python's json keeps the last of duplicate keys; so does the answer.
        (b'{"task_data": {"task_type": "%s", "task_type": "video", "task_id": "dup-1"}}' % UNKNOWN, 0, "video"),
        (b'{"task_data": {"task_type": "video", "task_type": "%s", "task_id": "dup-2"}}' % UNKNOWN, 2, None),
        (b'{"task_data": {"task_type": "video", "task_id": "dup-3"}, "task_data": {}}', 1, None),
    ],
)
def test_duplicate_keys_the_last_one_wins(api: Api, content: bytes, code: int, task_type: str | None) -> None:
    answer = api.post("create_task", content)
    assert answer is not None and answer["code"] == code, answer
    if task_type is not None:
        assert api.get("get_task", f"task_id={answer['task_id']}")["task_data"]["task_type"] == task_type


@pytest.mark.parametrize("path", POSTS)
@pytest.mark.parametrize("chunked", [False, True], ids=["sized", "chunked"])
def test_a_2_mb_body_is_413(api: Api, path: str, chunked: bool) -> None:
    content = b'{"task_data": {"task_type": "video", "task_content": "' + b"x" * 2_000_000 + b'"}}'
    before = api.snapshot()
    if chunked:  # no content-length: BodyLimit counts the bytes as they arrive
        response = api.client.post("/v1/" + path, content=iter([content[i:i + 65536]
                                                                 for i in range(0, len(content), 65536)]))
    else:
        response = api.client.post("/v1/" + path, content=content)
    assert response.status_code == 413, response.text[:300]
    assert response.json() == {"error": f"request body over {api.max_body} bytes"}
    assert api.snapshot() == before


def test_a_body_at_the_limit_is_read(api: Api) -> None:
    prefix, suffix = b'{"task_data": {"task_type": "video", "task_content": "', b'"}}'
    content = prefix + b"x" * (api.max_body - len(prefix) - len(suffix)) + suffix
    answer = api.post("create_task", content)
    assert answer is not None and answer["code"] == 1 and "task_content" in answer["msg"], answer


@pytest.mark.parametrize(
    ("state", "status"), [(state, status) for state in ("pending", "success", "failed") for status in (1, 2, 3, 4)]
)
def test_set_task_on_a_task_that_is_not_running_is_a_conflict(api: Api, state: str, status: int) -> None:
    service = api.runtime.pull_service
    if state == "pending":
        task_id = service.create(WORKER_TYPE, "{}")[0].task_id
    else:
        # DOOMED_TYPE has no retries: one failure is final.
        task_id = lease_one(api, DOOMED_TYPE)
        answer = api.post("set_task", encode({"task_data": {"task_id": task_id, "status": 3 if state == "success"
                                                            else 4}}, True))
        assert answer is not None and answer["code"] == 0, answer
    assert service.get(task_id).status.name.lower() == state
    answer = api.post("set_task", encode({"task_data": {"task_id": task_id, "status": status}}, True))
    assert answer is not None and answer["code"] == 3 and answer["msg"].startswith("CONFLICT::"), answer


# --- what the fuzzers found, each as its smallest reproducer ------------------------------------


def _raw_answer(api: Api, call: Callable[[], httpx.Response]) -> tuple[int, Any]:
    response = call()
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text[:200]


@pytest.mark.parametrize("path", POSTS)
@pytest.mark.parametrize("kind", ["list", "object"])
def test_json_nested_10000_deep_is_input_invalid(api: Api, path: str, kind: str) -> None:
    depth = 10_000
    content = b"[" * depth + b"]" * depth if kind == "list" else b'{"a":' * depth + b"1" + b"}" * depth
    status, answer = _raw_answer(api, lambda: api.client.post("/v1/" + path, content=content))
    assert status == 200 and answer["code"] == 1, (status, answer)


NUL_CALLS: list[tuple[str, str, Any]] = [
    ("create-content", "create_task", {"task_data": {"task_type": "video", "task_content": "a\x00b"}}),
    ("create-user", "create_task", {"task_data": {"task_type": "video", "user_id": "a\x00b"}}),
    ("create-stage", "create_task", {"task_data": {"task_type": "video", "task_stage": "a\x00b"}}),
    ("set-log", "set_task", {"task_data": {"task_id": RUNNING, "status": 2, "schedule_log": "a\x00b"}}),
    ("set-stage", "set_task", {"task_data": {"task_id": RUNNING, "status": 1, "task_stage": "a\x00b"}}),
    ("set-content", "set_task", {"task_data": {"task_id": RUNNING, "status": 3, "task_content": "a\x00b"}}),
    ("list-type", "get_task_list", "task_type=a%00b"),
    ("list-stage", "get_task_list", "stage=a%00b"),
    ("counts-type", "get_task_counts_by_type", "task_type=a%00b"),
]


@pytest.mark.parametrize(("path", "request_"), [pytest.param(*c[1:], id=c[0]) for c in NUL_CALLS])
def test_nul_in_a_string_is_input_invalid(api: Api, path: str, request_: Any) -> None:
    # PostgreSQL text cannot hold NUL; refused on every backend, so both answer alike.
    if path in GETS:
        status, answer = _raw_answer(api, lambda: api.client.get(f"/v1/{path}?{request_}"))
    else:
        body = substitute(request_, RUNNING, lease_one(api))
        status, answer = _raw_answer(api, lambda: api.client.post("/v1/" + path, content=encode(body, True)))
    assert status == 200 and answer["code"] == 1, answer


@pytest.mark.parametrize("status", [10**30, -(2**63) - 1, 2**63, 2**15, -(2**15) - 1, 0, 5])
def test_get_task_list_status_out_of_range(api: Api, status: int) -> None:
    status_code, answer = _raw_answer(api, lambda: api.client.get(f"/v1/get_task_list?status={status}"))
    assert status_code == 200 and answer["code"] == 1, answer


@pytest.mark.parametrize("query", ["status=abc", "status=", "limit=abc", "limit=1.5", "status=1&status=x"])
def test_get_task_list_non_integer_query_is_code_1(api: Api, query: str) -> None:
    status, answer = _raw_answer(api, lambda: api.client.get(f"/v1/get_task_list?{query}"))
    assert status == 200 and answer["code"] == 1, (status, answer)


def test_hold_tasks_of_an_unregistered_type_is_not_found(api: Api) -> None:
    status, answer = _raw_answer(api, lambda: api.client.post("/v1/hold_tasks", json={"task_type": UNKNOWN_TYPE}))
    assert status == 200 and answer["code"] == 2 and answer["msg"].startswith("NOT_FOUND::"), answer
