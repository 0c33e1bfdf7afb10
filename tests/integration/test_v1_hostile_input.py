"""Hostile input, generated, against the v1 API (/v1/*) on SQLite and PostgreSQL.

For any body or query string, every answer is HTTP 200 with ``code`` 0..5 and a
``msg`` (``SUCCESS``, or ``REASON::message`` naming the reason of the code),
except the 413 of the body limit (oss_api.limits.BodyLimit) for a body over it.
Never code 6 (INTERNAL), never a 5xx. Nothing is half-written: a refused call
leaves the task and task type tables exactly as they were, and a successful one
changes only the rows it names (its task, its type, the tasks it leased).

The tests at the end pin the smallest reproducers of what these fuzzers found.
The harness and the strategies are in v1_hostile.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shared.pull.rules import MAX_CONTENT_BYTES
from tests.integration.v1_hostile import (
    BODIES,
    DOOMED_TYPE,
    FUZZ,
    GETS,
    POSTS,
    RUNNING,
    UNKNOWN,
    UNKNOWN_TYPE,
    WORKER_TYPE,
    Api,
    encode,
    json_values,
    lease_one,
    open_api,
    queries,
    raw_bodies,
    substitute,
)

# A failing example can hold megabytes of text: its repr is slow, not wrong.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(scope="module", params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    yield from open_api(request.param, request, tmp_path_factory.mktemp("v1-hostile"))


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
        if given_id:  # "" is "not filled" (seed 000; oss_api.v1): a new id is made, as for none
            assert answer["task_id"] == given_id  # a chosen id is kept, never replaced


@pytest.mark.parametrize("path", POSTS)
@settings(FUZZ, max_examples=150)
@given(data=st.data(), ascii_only=st.booleans())
def test_any_fields_in_the_wrapper(api: Api, path: str, data: st.DataObject, ascii_only: bool) -> None:
    _post_fields(api, path, data.draw(BODIES[path], label="body"), ascii_only)


# --- POST: bytes that are not (quite) JSON ---------------------------------------------------------


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
