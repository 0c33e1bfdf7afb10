"""Fault injection: killed consumers, lost and duplicated messages, broker and
database outages, shutdowns. Each test injects one fault into a running stack
and checks that every accepted task still ends, with each step's effect once.

These tests stop RabbitMQ and PostgreSQL for a few seconds; run them alone
(`pytest -m faults`), as CI does at the end of the suite.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.config import Settings
from shared.messaging import STEP_TASK, make_celery, queue_name
from shared.messaging.depth import QueueDepths
from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import Stack, free_port, tries
from tests.e2e.test_up_supervision import alive, children_of

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

TIMING = {
    "ASYNCFLOW_REQUEUE_AFTER": "2",
    "ASYNCFLOW_EXPIRE_GRACE": "2",
    "ASYNCFLOW_PUBLISH_RETRY": "0.5",
    "ASYNCFLOW_SHUTDOWN_GRACE": "3",
    "ASYNCFLOW_OUTCOME_PATIENCE": "60",
}
BETA = "worker-beta+monitor"


# The last stack records a quick step's start with its outcome (one commit per step).
ONE_COMMIT = {"ASYNCFLOW_RECORD_START_AFTER": "1"}
STACKS = {
    "embedded": ("embedded", {}),
    "postgres-rabbitmq": ("postgres-rabbitmq", {}),
    "postgres-rabbitmq-one-commit": ("postgres-rabbitmq", ONE_COMMIT),
}


@pytest.fixture(scope="module", params=list(STACKS))
def faulty(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    backend, env = STACKS[request.param]
    home = tmp_path_factory.mktemp("faults-" + request.param)
    with open_stack(backend, home, TIMING | env, [["alpha"], ["beta", "monitor"]]) as stack:
        yield stack


def started(stack: Stack, task_id: str, cursor: int, attempt: int = 1) -> dict:
    return wait_for(
        lambda: next(
            (e for e in stack.executions(task_id) if e["cursor"] == cursor and e["attempt"] == attempt),
            None,
        ),
        30,
        f"step {cursor} attempt {attempt} of {task_id} to start",
    )


def runs_of(stack: Stack, task_id: str) -> list[tuple[int, int, int]]:
    return [(e["cursor"], e["type"], e["attempt"]) for e in stack.executions(task_id)]


def test_consumer_killed_mid_step_is_recovered_by_the_expiry_sweep(faulty: Stack, tmp_path: Path) -> None:
    gate = tmp_path / "go"
    task = faulty.submit("short", {"wait_for_file": {"1": str(gate)}})
    started(faulty, task["task_id"], 1)
    # With one commit per step, the start is recorded once the attempt outlives a second.
    wait_for(lambda: (faulty.get(task["task_id"])["current"] or {}).get("phase") == "running", 30, "the start")
    faulty.kill(BETA)  # kill -9 of the worker and its pool, mid-step
    killed_at = time.monotonic()
    gate.touch()
    faulty.respawn(BETA)
    doc = faulty.wait_stopped(task["task_id"], timeout=60)
    recovery = time.monotonic() - killed_at
    assert doc["task_status"] == 0, doc
    step1 = [a for a in doc["attempts"] if a["cursor"] == 1]
    assert [a["outcome"] for a in step1] == ["expired", "succeeded"]
    # timeout 3 s + grace 2 s, plus a sweep tick and a restart.
    assert recovery < 3 + 2 + 15, recovery


def test_message_lost_after_commit_is_published_again(faulty: Stack) -> None:
    faulty.kill(BETA)
    task = faulty.submit("short", {})
    wait_for(lambda: faulty.get(task["task_id"])["task_cursor"] == 1, 30, "step 1 to be queued")
    app = make_celery(Settings(broker_url=faulty.env.get("ASYNCFLOW_BROKER_URL"), home=faulty.home))

    def purged() -> int:
        # The publish follows the commit that moved the cursor: wait for it to land.
        with app.connection_for_write() as conn:
            return conn.default_channel.queue_purge(queue_name("beta"))

    # The step message is gone; only the database knows about it.
    wait_for(lambda: purged() >= 1, 30, "the step message to reach the queue and be purged")
    faulty.respawn(BETA)
    doc = faulty.wait_stopped(task["task_id"], timeout=60)
    assert doc["task_status"] == 0, doc
    assert runs_of(faulty, task["task_id"]) == [(0, 0, 1), (1, 0, 1)]


def test_a_queue_behind_by_more_than_requeue_after_gets_no_copies(faulty: Stack) -> None:
    # Its worker down, beta's queue holds step 1 of each task past REQUEUE_AFTER (2 s):
    # the sweep leaves them there, where a copy each would only lengthen the backlog.
    faulty.kill(BETA)
    settings = Settings(broker_url=faulty.env.get("ASYNCFLOW_BROKER_URL"), home=faulty.home)
    app = make_celery(settings)
    with app.connection_for_write() as conn:  # stale copies from earlier tests
        # Declared as a publisher declares it: run first, the worker may have died before it did.
        queue = app.amqp.queues[queue_name("beta")](conn.default_channel)
        queue.declare()
        queue.purge()
    ids = [faulty.submit("short", {})["task_id"] for _ in range(8)]
    queued = {i: wait_for(lambda i=i: queued_due(faulty, i), 30, "step 1 to be queued") for i in ids}
    # Each looked at by the sweep twice (its due time moved on by REQUEUE_AFTER each time).
    for task_id, due in queued.items():
        wait_for(lambda t=task_id, d=due: (queued_due(faulty, t) or 0) >= d + 4, 30, "two requeue passes")
    depths = QueueDepths(settings, 10)
    assert depths([queue_name("beta")]) == {queue_name("beta"): len(ids)}
    depths.close()
    faulty.respawn(BETA)
    for task_id in ids:
        assert faulty.wait_stopped(task_id, timeout=60)["task_status"] == 0
        runs = runs_of(faulty, task_id)
        if faulty.env.get("ASYNCFLOW_RECORD_START_AFTER"):
            # Once the restarted worker has taken the backlog into its prefetch, the
            # queue is empty and a step not yet started there still looks queued: its
            # start is recorded with its outcome. A copy the sweep then publishes may
            # run as well, the same attempt (as in the restart test below).
            assert runs[0] == (0, 0, 1) and set(runs[1:]) == {(1, 0, 1)}, runs
        else:
            assert runs == [(0, 0, 1), (1, 0, 1)]


def queued_due(stack: Stack, task_id: str) -> float | None:
    """When the sweep looks next at step 1 of ``task_id``, while it is queued."""
    current = stack.get(task_id)["current"] or {}
    return current["due_at"] if current.get("cursor") == 1 and current.get("phase") == "queued" else None


def test_worker_killed_between_the_handlers_end_and_the_commit_runs_the_step_again(
    faulty: Stack, tmp_path: Path
) -> None:
    marker = tmp_path / f"killed-{time.time_ns()}"
    task = faulty.submit("short", {"kill_worker_after": {"1": str(marker)}})
    # Step 1 did its work, then its worker died before storing the outcome.
    wait_for(lambda: marker.exists() and faulty.procs[BETA].poll() is not None, 30, "the worker to die")
    faulty.respawn(BETA)
    doc = faulty.wait_stopped(task["task_id"], timeout=60)
    assert doc["task_status"] == 0, doc
    attempts = tries(doc)
    if faulty.env.get("ASYNCFLOW_RECORD_START_AFTER"):
        # Its start was never recorded and its message never acknowledged: the broker
        # delivered it again, the same attempt ran again (same idempotency key), and
        # only one run was recorded. A copy the requeue sweep published while the
        # worker restarted (REQUEUE_AFTER is 2 s here) may have run as well.
        runs = runs_of(faulty, task["task_id"])
        assert runs[0] == (0, 0, 1) and len(runs) >= 3 and set(runs[1:]) == {(1, 0, 1)}, runs
        assert attempts == [(0, 1, "succeeded"), (1, 1, "succeeded")]
    else:
        # Its start was recorded: the attempt expired at its deadline and ran again.
        assert runs_of(faulty, task["task_id"]) == [(0, 0, 1), (1, 0, 1), (1, 0, 2)]
        assert attempts == [(0, 1, "succeeded"), (1, 1, "expired"), (1, 2, "succeeded")]


def test_replayed_message_is_acknowledged_and_ignored(faulty: Stack) -> None:
    port = free_port()
    faulty.kill(BETA, signal.SIGTERM, group=False)
    faulty.respawn(BETA, "--metrics-port", str(port))
    task = faulty.submit("short", {})
    doc = faulty.wait_stopped(task["task_id"])
    assert doc["task_status"] == 0
    # One commit per step: a copy the requeue sweep published while the respawned worker
    # was starting may have run too (at least once); the replays below must add nothing.
    runs = runs_of(faulty, task["task_id"])
    assert set(runs) == {(0, 0, 1), (1, 0, 1)}
    if "ASYNCFLOW_RECORD_START_AFTER" not in faulty.env:
        assert runs == [(0, 0, 1), (1, 0, 1)]  # a recorded start makes any second copy stale
    step1 = next(a for a in doc["attempts"] if a["cursor"] == 1)
    payload = {
        "task_id": task["task_id"], "flow": "short", "seq": step1["seq"], "cursor": 1, "type": 0,
        "attempt": 1, "module": "beta", "command": "step", "timeout": 3, "retry": 2, "parameters": {},
    }
    app = make_celery(Settings(broker_url=faulty.env.get("ASYNCFLOW_BROKER_URL"), home=faulty.home))
    for _ in range(3):
        app.send_task(STEP_TASK, args=[payload], queue=queue_name("beta"))
    wait_for(lambda: _stale_count(port) >= 3, 30, "the worker to count 3 stale messages")
    assert runs_of(faulty, task["task_id"]) == runs
    assert faulty.get(task["task_id"])["attempts"] == doc["attempts"]


def _stale_count(port: int) -> float:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.TransportError:
        return 0.0  # the respawned worker does not listen yet
    lines = [line for line in text.splitlines() if line.startswith('asyncflow_stale_messages_total{module="beta"}')]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_sigterm_lets_the_running_attempt_finish(faulty: Stack, tmp_path: Path) -> None:
    gate = tmp_path / "go"
    task = faulty.submit("short", {"wait_for_file": {"1": str(gate)}})
    started(faulty, task["task_id"], 1)
    faulty.kill(BETA, signal.SIGTERM, group=False)
    gate.touch()
    assert faulty.procs[BETA].wait(timeout=20) == 0
    doc = faulty.wait_stopped(task["task_id"])
    assert doc["task_status"] == 0, doc
    assert [a["outcome"] for a in doc["attempts"] if a["cursor"] == 1] == ["succeeded"]
    faulty.respawn(BETA)


def test_sigterm_gives_up_on_a_stuck_attempt_after_the_grace(faulty: Stack) -> None:
    # Step 1 of "three" has a 20 s timeout: only the 3 s shutdown grace can end the stuck attempt
    # (with "short", its 3 s timeout raced the grace and sometimes won under load).
    task = faulty.submit("three", {"hang_first": [1]})
    started(faulty, task["task_id"], 1)
    stopping = time.monotonic()
    faulty.kill(BETA, signal.SIGTERM, group=False)
    faulty.procs[BETA].wait(timeout=30)
    assert time.monotonic() - stopping < 3 + 10  # shutdown_grace 3 s
    faulty.respawn(BETA)
    doc = faulty.wait_stopped(task["task_id"], timeout=60)
    assert doc["task_status"] == 0, doc
    step1 = [a for a in doc["attempts"] if a["cursor"] == 1]
    assert step1[0]["outcome"] == "failed" and "worker stopped" in step1[0]["error"]
    assert step1[-1]["outcome"] == "succeeded"


def test_scheduler_killed_as_it_publishes_a_batch_loses_no_flow_and_runs_none_twice(faulty: Stack) -> None:
    """Where the kill lands is not chosen here (before the first group's commit, between
    it and its publish, or after); tests/integration/test_sweeps.py loses a group's
    messages after its commit on purpose."""
    faulty.kill("scheduler")
    body = {"tasks": [{"flow": "short", "parameters": {}} for _ in range(520)]}  # two sweep groups: 500, 20
    answer = faulty.http.post(faulty.url + "/api/batches", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    ids = [t["task_id"] for t in answer.json()["tasks"]]
    assert {faulty.get(i)["current"]["phase"] for i in ids[:20]} == {"waiting"}  # stored, nothing published
    faulty.respawn("scheduler")
    # The batch's first 500 are the first group (due in the order they were made): killed once it is stored.
    wait_for(lambda: (faulty.get(ids[0])["current"] or {}).get("phase") != "waiting", 30, "the release to begin")
    faulty.kill("scheduler")
    faulty.respawn("scheduler")
    for task_id in ids:
        doc = faulty.wait_stopped(task_id, timeout=120)
        assert doc["task_status"] == 0, doc
        attempts = tries(doc)  # a start given back is not a try: the journal below says so
        assert attempts == [(0, 1, "succeeded"), (1, 1, "succeeded")], doc["attempts"]
    ran: dict[str, list[tuple[int, int, int]]] = {}
    for line in faulty.journal.read_text().splitlines():
        entry = json.loads(line)
        ran.setdefault(entry["task"], []).append((entry["cursor"], entry["type"], entry["attempt"]))
    for task_id in ids:
        if faulty.env.get("ASYNCFLOW_RECORD_START_AFTER"):
            # A start recorded only with its outcome: a copy the requeue sweep published
            # while the first waited in a worker's prefetch may run as well, the same attempt.
            assert set(ran[task_id]) == {(0, 0, 1), (1, 0, 1)}, ran[task_id]
        else:
            assert ran[task_id] == [(0, 0, 1), (1, 0, 1)]


def test_api_killed_between_requests_loses_nothing(faulty: Stack) -> None:
    task_id = "api-kill-" + str(time.time_ns())
    first = faulty.submit("short", {}, task_id=task_id)
    faulty.kill("api")
    faulty.respawn("api")
    wait_for(lambda: _answers(faulty), 30, "the API to come back")
    again = faulty.submit("short", {}, task_id=task_id)
    assert again["time_create"] == first["time_create"]
    assert faulty.wait_stopped(task_id)["task_status"] == 0


def _answers(stack: Stack) -> bool:
    try:
        return stack.http.get(stack.url + "/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_consumer_processes_stop_when_the_main_process_dies(faulty: Stack) -> None:
    consumers = wait_for(lambda: children_of(faulty.procs[BETA].pid) or None, 30, "the consumer processes")
    faulty.kill(BETA, group=False)  # SIGKILL to the main process alone
    wait_for(lambda: not any(alive(pid) for pid in consumers), 30, "its consumer processes to stop")
    faulty.respawn(BETA)
    assert faulty.wait_stopped(faulty.submit("short", {})["task_id"])["task_status"] == 0
