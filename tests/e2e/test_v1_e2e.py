"""The v1 API through a real API process, worked by plain-HTTP workers (curl + jq)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.conftest import require_service
from tests.e2e.conftest import open_stack
from tests.e2e.stack import REPO, Stack

pytestmark = pytest.mark.e2e

WORKER = REPO / "examples" / "curl_worker.sh"
TASKS = 30


@pytest.fixture(scope="module", params=["embedded", "postgres-rabbitmq"])
def v1_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    missing = [tool for tool in ("curl", "jq", "sha256sum") if shutil.which(tool) is None]
    require_service("curl/jq", f"missing {', '.join(missing)}" if missing else None)
    with open_stack(request.param, tmp_path_factory.mktemp("v1-" + request.param), groups=[["alpha"]]) as s:
        yield s


def v1(stack: Stack, path: str, body: dict | None = None) -> dict:
    if body is None:
        response = stack.http.get(f"{stack.url}/v1/{path}", timeout=10)
    else:
        response = stack.http.post(f"{stack.url}/v1/{path}", json=body, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def test_two_curl_workers_drain_the_tasks_each_exactly_once(v1_stack: Stack) -> None:
    assert v1(v1_stack, "register_task_type", {"task_type_data": {"task_type": "checksum", "schedule_limit": 5}})["code"] == 0
    contents = {f"payload {i} " + "x" * i: None for i in range(TASKS)}
    ids = {}
    for content in contents:
        answer = v1(v1_stack, "create_task", {"task_data": {"task_type": "checksum", "task_content": content}})
        assert answer["code"] == 0, answer
        ids[answer["task_id"]] = content
    assert len(ids) == TASKS  # a distinct id for each
    workers = [
        subprocess.Popen([str(WORKER), v1_stack.url, "checksum", "5"], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [w.communicate(timeout=120)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0]
    done = Counter(line.split()[1] for out in outputs for line in out.splitlines() if line.startswith("done "))
    assert set(done) == set(ids) and max(done.values()) == 1  # each task leased once
    for task_id, content in ids.items():
        data = v1(v1_stack, f"get_task?task_id={task_id}")["task_data"]
        assert data["status"] == 3
        assert data["task_content"] == hashlib.sha256(content.encode()).hexdigest()
    counts = v1(v1_stack, "get_task_counts_by_type?task_type=checksum")
    assert counts["task_count"] == TASKS and counts["task_count_by_status"]["3"] == TASKS
