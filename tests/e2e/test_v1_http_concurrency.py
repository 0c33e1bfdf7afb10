"""8 worker processes drain 2,000 v1 tasks through a real API process: each task leased once.

The integration test ``test_concurrent_holders_never_share_a_task`` races threads
on one store in-process; this one goes through HTTP, so claims come from separate
processes and connections, and the API's thread pool interleaves them as in production.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import open_stack
from tests.e2e.stack import Stack

pytestmark = pytest.mark.e2e

TASKS = 2000
WORKERS = 8
# The API process is the bottleneck (one core); more client threads only add GIL contention.
CREATORS = 4
TASK_TYPE = "concurrency"
# Small batches mean many more claims racing for the same rows than the default 100.
SCHEDULE_LIMIT = 50
# Far beyond the test's run time: an expired lease would be re-leased legitimately
# and look like a duplicate.
LEASE_SECONDS = 600
WORKER_TIMEOUT = 240

# Runs in each worker process. It writes one JSON line per leased task, flushed at
# once, so a worker that dies still leaves evidence of what it held.
WORKER_CODE = r'''
import json, os, sys, time
import httpx

url, task_type, out_path, limit = sys.argv[1:5]
pid = os.getpid()
empty = 0
with httpx.Client(base_url=url, timeout=30) as client, open(out_path, "w") as out:
    def post(path, body):
        response = client.post("/v1/" + path, json=body)
        if response.status_code != 200:
            return {"code": -response.status_code, "msg": response.text}
        return response.json()

    while True:
        answer = post("hold_tasks", {"task_type": task_type})
        if answer.get("code") != 0:
            out.write(json.dumps({"hold_error": answer}) + "\n")
            out.flush()
            sys.exit(3)
        batch = answer["task_list"]
        if len(batch) > int(limit):
            out.write(json.dumps({"hold_error": "%d tasks in one hold, over schedule_limit" % len(batch)}) + "\n")
            out.flush()
            sys.exit(4)
        if batch:
            empty = 0
        for task in batch:
            done = post("set_task", {"task_data": {
                "task_id": task["task_id"], "status": 3,
                "task_content": "done-by-%d:%s" % (pid, task["task_content"]),
            }})
            out.write(json.dumps({
                "task_id": task["task_id"], "status": task["status"], "set": done,
            }) + "\n")
            out.flush()
        if batch:
            continue
        # An empty hold can mean the others hold the rest; stop only once nothing
        # is pending for several polls in a row.
        counts = client.get("/v1/get_task_counts_by_type", params={"task_type": task_type}).json()
        if counts.get("code") == 0 and counts["task_count_by_status"]["1"] == 0:
            empty += 1
            if empty >= 3:
                break
        time.sleep(0.05)
'''


@pytest.fixture(scope="module", params=["embedded", "postgres-rabbitmq"])
def v1_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("v1-concurrency-" + request.param)
    started = time.monotonic()
    with open_stack(request.param, home, groups=[["alpha"]]) as s:
        print(f"\n[{request.param}] stack up in {time.monotonic() - started:.1f}s")
        yield s


def create_all(url: str, count: int) -> list[str]:
    """Create ``count`` tasks from several keep-alive clients; their ids in creation order."""

    def create_slice(start: int) -> list[str]:
        ids = []
        with httpx.Client(base_url=url, timeout=30) as client:
            for i in range(start, count, CREATORS):
                body = {"task_data": {"task_type": TASK_TYPE, "task_content": json.dumps({"n": i})}}
                response = client.post("/v1/create_task", json=body)
                assert response.status_code == 200, response.text
                answer = response.json()
                assert answer["code"] == 0, answer
                ids.append(answer["task_id"])
        return ids

    with ThreadPoolExecutor(CREATORS) as pool:
        return [task_id for ids in pool.map(create_slice, range(CREATORS)) for task_id in ids]


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_eight_worker_processes_lease_each_task_exactly_once(v1_stack: Stack, tmp_path: Path) -> None:
    url = v1_stack.url
    registered = httpx.post(
        f"{url}/v1/register_task_type",
        json={"task_type_data": {
            "task_type": TASK_TYPE, "schedule_limit": SCHEDULE_LIMIT, "max_processing_time": LEASE_SECONDS,
        }},
        timeout=10,
    )
    assert registered.status_code == 200 and registered.json()["code"] == 0, registered.text

    started = time.monotonic()
    ids = create_all(url, TASKS)
    create_seconds = time.monotonic() - started
    assert len(ids) == TASKS and len(set(ids)) == TASKS
    print(f"[{v1_stack.name}] created {TASKS} tasks in {create_seconds:.1f}s ({TASKS / create_seconds:.0f}/s)")

    outputs = [tmp_path / f"worker-{n}.jsonl" for n in range(WORKERS)]
    started = time.monotonic()
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER_CODE, url, TASK_TYPE, str(out), str(SCHEDULE_LIMIT)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for out in outputs
    ]
    try:
        logs = [w.communicate(timeout=WORKER_TIMEOUT)[0] for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    drain_seconds = time.monotonic() - started
    print(f"[{v1_stack.name}] {WORKERS} workers drained {TASKS} tasks in {drain_seconds:.1f}s "
          f"({TASKS / drain_seconds:.0f}/s)")

    records = [read_output(out) for out in outputs]
    failures = [
        f"worker {n} exited {w.returncode}: {log[-2000:]} {[r for r in rec if 'hold_error' in r]}"
        for n, (w, log, rec) in enumerate(zip(workers, logs, records, strict=True))
        if w.returncode != 0
    ]
    assert not failures, "\n".join(failures)

    held = [[r for r in rec if "task_id" in r] for rec in records]
    leases = Counter(r["task_id"] for batch in held for r in batch)
    duplicates = {task_id: n for task_id, n in leases.items() if n > 1}
    assert not duplicates, f"{len(duplicates)} tasks leased more than once, e.g. {list(duplicates.items())[:5]}"
    assert set(leases) == set(ids) and max(leases.values()) == 1
    assert all(r["status"] == 2 for batch in held for r in batch)
    bad_sets = [r for batch in held for r in batch if r["set"].get("code") != 0]
    assert not bad_sets, f"{len(bad_sets)} set_task calls failed, e.g. {bad_sets[:3]}"

    per_worker = [len(batch) for batch in held]
    print(f"[{v1_stack.name}] tasks per worker: {per_worker}")
    # How the work spreads depends on scheduling; only require that it really was shared.
    assert sum(1 for n in per_worker if n) >= 2, per_worker

    counts = httpx.get(f"{url}/v1/get_task_counts_by_type", params={"task_type": TASK_TYPE}, timeout=10).json()
    assert counts["code"] == 0, counts
    assert counts["task_count"] == TASKS
    assert {k: v for k, v in counts["task_count_by_status"].items() if v} == {"3": TASKS}, counts

    # The reported content was stored for the task it was reported for.
    sample = httpx.get(f"{url}/v1/get_task", params={"task_id": ids[0]}, timeout=10).json()
    assert sample["code"] == 0 and sample["task_data"]["status"] == 3, sample
    assert sample["task_data"]["task_content"].startswith("done-by-"), sample
    assert sample["task_data"]["task_content"].endswith(':{"n": 0}'), sample
