"""The harness and the input strategies of test_v1_hostile_input.

``open_api`` serves the v1 API of a fresh Runtime on SQLite or PostgreSQL; ``Api``
sends one call and checks its answer and what it did to the tables. The
Hypothesis strategies below generate hostile bodies and query strings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote_from_bytes

import httpx
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from sqlalchemy import select

from oss_api.app import create_app
from oss_api.testing import TestClient
from oss_api.v1 import CODES, TASK_ID
from shared.flows import load_flows
from shared.names import NAME
from shared.pull.rules import MAX_CONTENT_BYTES, PullStatus
from shared.runtime import Runtime
from shared.storage.schema import pull_tasks, task_types
from shared.storage.sql import SqlStore, open_store
from shared.testing import InProcess
from tests.integration.conftest import empty_tables, migrated_url

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


def open_api(backend: str, request: pytest.FixtureRequest, tmp: Path) -> Iterator[Api]:
    url = migrated_url(request, backend, tmp / "v1.sqlite")
    store = open_store(url)
    runtime = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp, store).runtime
    # A crash must come back as the 500 a client would see, not as an exception here.
    client = TestClient(create_app(runtime), raise_server_exceptions=False)
    api = Api(backend, client, store, runtime, runtime.settings.max_body_bytes)
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
