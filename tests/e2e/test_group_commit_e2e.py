"""A worker whose consumer process holds several deliveries (``ASYNCFLOW_WORKER_PREFETCH``),
their transitions committed together, killed while it holds them. Real processes.

- The consumer process alone killed (SIGKILL) while one of the held deliveries runs its
  handler and the others, given back, wait for it to end: the worker's main process
  reports every held attempt lost at once; the one that ran runs again, the reports of
  the others are stale.
- The whole worker killed between a handler's end and the commit of its outcome, with
  other deliveries held: the broker delivers what was not acknowledged again, the
  attempts whose start was stored expire when their heartbeats stop, and every flow ends
  as it would have.
- With starts written with their outcomes, the worker killed in a step run on to: the
  next steps kept, never published, are published by the requeue sweep; the cut-off one
  runs again as the same attempt.
- A held delivery behind a long handler: handed on (given back as a new message if its
  start was stored), and run by another process meanwhile, once.
- Deliveries sent to a process whose handler runs long, or read or started with that
  step: given back, other processes run them meanwhile.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.states import STOPPED
from shared.testing import wait_for
from tests.e2e.conftest import open_stack
from tests.e2e.stack import Stack, tries
from tests.e2e.test_up_supervision import children_of

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

WORKER = "worker-held"
ENV = {"ASYNCFLOW_WORKER_PREFETCH": "4", "ASYNCFLOW_REQUEUE_AFTER": "2", "ASYNCFLOW_EXPIRE_GRACE": "2"}


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with open_stack("postgres-rabbitmq", tmp_path_factory.mktemp("held"), ENV, []) as stack:
        yield stack


@pytest.fixture(scope="module")
def beating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Heartbeats every 0.5 s: an attempt that sends none for 1.5 s is taken for lost."""
    env = ENV | {"ASYNCFLOW_HEARTBEAT_INTERVAL": "0.5"}
    with open_stack("postgres-rabbitmq", tmp_path_factory.mktemp("beating"), env, []) as stack:
        yield stack


def start_worker(stack: Stack) -> subprocess.Popen[bytes]:
    """One consumer process: every delivery goes to it, up to the prefetch."""
    return stack.spawn(WORKER, "worker", "alpha", "beta", "-c", "1")


def stop_worker(stack: Stack, name: str = WORKER) -> None:
    proc = stack.procs.pop(name, None)
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the worker and its consumer process
        proc.wait(timeout=10)


def submit_together(stack: Stack, flow: str, parameters: list[dict[str, Any]]) -> list[str]:
    """Published together, while no worker runs: the worker started next is sent them at once."""
    return submit_batch(stack, [(flow, p) for p in parameters])


def submit_batch(stack: Stack, tasks: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Tasks of several flows, published together (flow, parameters)."""
    body = {"tasks": [{"flow": flow, "parameters": p} for flow, p in tasks]}
    response = stack.http.post(stack.url + "/api/batches", json=body)
    assert response.status_code in (200, 201), response.text
    return [t["task_id"] for t in response.json()["tasks"]]


# The worker's lines that count what a consumer process handed on behind a long step.
HANDED_ON = re.compile(r"(\d+) (?:step message\(s\)|step\(s\)) given back behind a long step")


def handed_on_count(stack: Stack, since: int) -> int:
    """How many deliveries the worker's log says were handed on behind a long step, after offset ``since``."""
    return sum(int(n) for n in HANDED_ON.findall(worker_lines(stack, since)))


def worker_lines(stack: Stack, since: int) -> str:
    """The worker's log after offset ``since``: what a failed check about its rounds is read against."""
    path = worker_log(stack)
    return path.read_bytes()[since:].decode(errors="replace") if path.exists() else ""


def log_size(stack: Stack) -> int:
    path = worker_log(stack)
    return path.stat().st_size if path.exists() else 0


def worker_log(stack: Stack) -> Path:
    return stack.home / f"{WORKER}.log"


def test_a_consumer_process_killed_holding_several_deliveries_has_each_reported_lost(
    held: Stack, tmp_path: Path
) -> None:
    """Three long steps taken together; the first's handler runs, the other two are handed on
    behind it: given back as new messages if their starts were stored in its round (their
    deliveries held until it ends, then ended unrun), or back to the queue if only read. The
    consumer process killed: its worker reports every attempt it held lost at once, which
    fails the running one (it runs again) and is stale for the others, which run once."""
    gate = tmp_path / "go"
    task_ids = submit_together(held, "long", [{"wait_for_file": {"0": str(gate)}}] * 3)
    since = log_size(held)
    worker = start_worker(held)
    try:
        (first,) = wait_for(lambda: [e for t in task_ids for e in held.executions(t)] or None, 30, "a long step")
        wait_for(lambda: handed_on_count(held, since) >= 2, 30, "the other two handed on")
        (consumer,) = wait_for(lambda: children_of(worker.pid) or None, 10, "the consumer process")
        killed_at = time.time()
        os.kill(consumer, signal.SIGKILL)  # the consumer process alone: its worker reports what it held
        gate.touch()
        docs = [held.wait_stopped(t, timeout=60) for t in task_ids]
    finally:
        gate.touch()  # nothing left running into the next test
        stop_worker(held)

    assert [doc["task_status"] for doc in docs] == [0] * 3, docs
    (ran,) = [doc for doc in docs if doc["task_id"] == first["task"]]
    first_try, again = ran["attempts"]
    assert again["outcome"] == "succeeded" and "worker process lost" in first_try["error"], ran["attempts"]
    # Reported by the worker's main process at once, not found by a sweep seconds later.
    assert first_try["ended_at"] - killed_at < 3.0, (first_try, killed_at)
    for doc in docs:
        if doc is not ran:
            attempts = tries(doc)
            assert attempts == [(0, 1, "succeeded")], doc["attempts"]
            assert [(e["cursor"], e["attempt"]) for e in held.executions(doc["task_id"])] == [(0, 1)]


def killed_after_step_1_of_the_second(stack: Stack, tmp_path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """Four ``short`` flows held together; the second's step 1 does its work, then kills the whole
    worker before its outcome is stored. A worker started again ends them all (checked): their
    ids and documents."""
    marker = tmp_path / "killed"
    parameters: list[dict[str, Any]] = [{}, {"kill_worker_after": {"1": str(marker)}}, {}, {}]
    task_ids = submit_together(stack, "short", parameters)
    worker = start_worker(stack)
    try:
        wait_for(lambda: marker.exists() and worker.poll() is not None, 30, "the worker to die")
        start_worker(stack)
        docs = [stack.wait_stopped(t, timeout=60) for t in task_ids]
    finally:
        stop_worker(stack)
    assert [doc["task_status"] for doc in docs] == [0] * 4, docs
    return task_ids, docs


def test_a_worker_killed_between_a_handlers_end_and_the_commit_loses_no_flow_it_held(
    held: Stack, tmp_path: Path
) -> None:
    task_ids, docs = killed_after_step_1_of_the_second(held, tmp_path)
    runs = [(e["cursor"], e["attempt"]) for e in held.executions(task_ids[1])]
    assert runs == [(0, 1), (1, 1), (1, 2)], runs
    attempts = tries(docs[1])
    # Its handler did the work; the outcome was never committed: the attempt expired and ran again.
    assert attempts == [(0, 1, "succeeded"), (1, 1, "expired"), (1, 2, "succeeded")], attempts


@pytest.fixture(scope="module")
def held_deferred(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """As ``held``, each start written with its outcome (or after a second)."""
    env = ENV | {"ASYNCFLOW_RECORD_START_AFTER": "1"}
    with open_stack("postgres-rabbitmq", tmp_path_factory.mktemp("held-deferred"), env, []) as stack:
        yield stack


def test_a_worker_killed_in_a_step_run_on_with_starts_unstored_loses_no_flow_it_held(
    held_deferred: Stack, tmp_path: Path
) -> None:
    """Starts written with their outcomes: the next steps a commit kept here stay queued and are
    never published. Once the worker is gone the requeue sweep publishes them; the one whose
    handler did its work and was killed before its outcome runs again as the same attempt."""
    task_ids, docs = killed_after_step_1_of_the_second(held_deferred, tmp_path)
    runs = [(e["cursor"], e["attempt"]) for e in held_deferred.executions(task_ids[1])]
    assert runs == [(0, 1), (1, 1), (1, 1)], runs
    for doc in docs:
        attempts = tries(doc)
        assert attempts == [(0, 1, "succeeded"), (1, 1, "succeeded")], attempts


def test_a_held_delivery_is_handed_on_behind_a_long_handler(beating: Stack, tmp_path: Path) -> None:
    """Two long steps taken by one consumer process: once the first's handler runs, the second
    is handed on (given back as a new message if its start was stored in that round, else back
    to the queue), and a worker started next runs it, once, while the first still runs."""
    gates = {0: tmp_path / "first", 1: tmp_path / "second"}
    task_ids = submit_batch(beating, [("long", {"wait_for_file": {"0": str(gates[i])}}) for i in (0, 1)])
    since = log_size(beating)
    start_worker(beating)
    other = f"{WORKER}-2"
    try:
        (first,) = wait_for(lambda: [e for t in task_ids for e in beating.executions(t)] or None, 30, "a long step")
        running = task_ids.index(first["task"])
        given = task_ids[1 - running]
        wait_for(lambda: handed_on_count(beating, since) >= 1, 30, "the other handed on")
        beating.spawn(other, "worker", "alpha", "beta", "-c", "1")
        (taken,) = wait_for(lambda: beating.executions(given) or None, 30, "the other to run elsewhere")
        gates[1 - running].touch()
        given_doc = beating.wait_stopped(given, timeout=60)
        assert beating.get(task_ids[running])["task_status"] not in STOPPED  # its step still runs
        gates[running].touch()
        running_doc = beating.wait_stopped(task_ids[running], timeout=60)
    finally:
        for gate in gates.values():
            gate.touch()
        stop_worker(beating)
        stop_worker(beating, other)

    assert given_doc["task_status"] == 0 and running_doc["task_status"] == 0, (given_doc, running_doc)
    attempts = [(a["cursor"], a["attempt"], a["outcome"]) for a in given_doc["attempts"]]
    assert attempts in ([(0, 1, "released"), (0, 1, "succeeded")], [(0, 1, "succeeded")]), attempts
    assert taken["pid"] != first["pid"]
    assert [(a["cursor"], a["attempt"], a["outcome"]) for a in running_doc["attempts"]] == [(0, 1, "succeeded")]


@pytest.fixture(scope="module", params=["postgres-rabbitmq", "postgres-redis", "embedded"])
def two_held(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two consumer processes holding up to eight deliveries each (the default); the requeue
    sweep's copies come after 30 s, so they do not run what a process holds meanwhile."""
    env: dict[str, str] = {}
    with open_stack(request.param, tmp_path_factory.mktemp("two-held"), env, []) as stack:
        yield stack


@pytest.fixture(scope="module", params=["postgres-rabbitmq", "postgres-redis"])
def two_held_deferred(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """As ``two_held``, each start written with its outcome (or after a second)."""
    env = {"ASYNCFLOW_WORKER_PREFETCH": "8", "ASYNCFLOW_RECORD_START_AFTER": "1"}
    with open_stack(request.param, tmp_path_factory.mktemp("two-held-deferred"), env, []) as stack:
        yield stack


@pytest.fixture(scope="module", params=["postgres-rabbitmq", "postgres-redis"])
def two_single(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two consumer processes taking one delivery at a time, each step through its queue."""
    env = {"ASYNCFLOW_WORKER_PREFETCH": "1", "ASYNCFLOW_CONTINUE_WITHIN": "0"}
    with open_stack(request.param, tmp_path_factory.mktemp("two-single"), env, []) as stack:
        yield stack


def run_beside_a_long_step(stack: Stack, gate: Path, submitted_after: bool) -> tuple[str, list[str], int]:
    """A long step runs on one of two consumer processes; short flows come in before its gate opens.

    Each short flow must end while the long step still runs. The long task's id, the
    short ones', and the pid of the process that ran the long step.
    """
    long_step = ("long", {"wait_for_file": {"0": str(gate)}})
    if submitted_after:
        (long_id,) = submit_batch(stack, [long_step])
    else:
        long_id, *short_ids = submit_batch(stack, [long_step] + [("short", {})] * 12)
    stack.spawn(WORKER, "worker", "alpha", "beta", "-c", "2")
    try:
        (first,) = wait_for(lambda: stack.executions(long_id) or None, 30, "the long step to start")
        if submitted_after:
            short_ids = submit_together(stack, "short", [{}] * 12)
        # Held behind the long step, a short flow would wait for the gate (or the requeue sweep).
        deadline = time.monotonic() + 15
        docs = [stack.wait_stopped(t, timeout=max(0.1, deadline - time.monotonic())) for t in short_ids]
        assert stack.get(long_id)["task_status"] not in STOPPED
        gate.touch()
        long_doc = stack.wait_stopped(long_id, timeout=60)
    finally:
        stop_worker(stack)
    assert long_doc["task_status"] == 0, long_doc
    for doc in docs:
        assert doc["task_status"] == 0, doc
        # Given back before it ran (a start stored in the long step's round), an attempt goes out again.
        attempts = tries(doc)
        assert attempts == [(0, 1, "succeeded"), (1, 1, "succeeded")], attempts
    return long_id, short_ids, first["pid"]


def test_deliveries_sent_to_a_process_in_a_long_step_are_given_back_to_another(
    two_held: Stack, tmp_path: Path
) -> None:
    """The broker keeps sending into the window of the process whose handler runs long:
    its consumer is cancelled and what came is rejected back to the queue."""
    _long_id, short_ids, long_pid = run_beside_a_long_step(two_held, tmp_path / "go", submitted_after=True)
    runs = [e for t in short_ids for e in two_held.executions(t)]
    assert [(e["cursor"], e["attempt"]) for e in runs].count((0, 1)) == len(short_ids), runs  # each ran once
    assert long_pid not in {e["pid"] for e in runs}, runs


def test_deliveries_read_with_a_long_step_are_given_back_to_another(
    two_held_deferred: Stack, tmp_path: Path
) -> None:
    """Read in the same round as the long step, nothing stored of them yet (starts written
    with their outcomes): given back while it runs."""
    _long_id, short_ids, _long_pid = run_beside_a_long_step(two_held_deferred, tmp_path / "go", submitted_after=False)
    for task_id in short_ids:
        runs = [(e["cursor"], e["attempt"]) for e in two_held_deferred.executions(task_id)]
        assert runs == [(0, 1), (1, 1)], runs


def test_deliveries_started_with_a_long_step_are_given_back_to_another(two_held: Stack, tmp_path: Path) -> None:
    """Read in the same round as the long step, their starts stored before their handlers
    run (the default): given back as new messages while it runs, each run once."""
    _long_id, short_ids, _long_pid = run_beside_a_long_step(two_held, tmp_path / "go", submitted_after=False)
    for task_id in short_ids:
        runs = [(e["cursor"], e["attempt"]) for e in two_held.executions(task_id)]
        assert runs == [(0, 1), (1, 1)], runs


def test_a_process_in_a_long_step_of_one_module_holds_no_message_of_another(two_single: Stack, tmp_path: Path) -> None:
    """One delivery at a time is one for the process: the broker sends a process consuming two
    modules' queues nothing more while its step of one of them runs."""
    _long_id, short_ids, long_pid = run_beside_a_long_step(two_single, tmp_path / "go", submitted_after=True)
    runs = [e for t in short_ids for e in two_single.executions(t)]
    assert long_pid not in {e["pid"] for e in runs}, runs


def test_after_a_long_round_a_process_takes_one_message_at_a_time(held: Stack, tmp_path: Path) -> None:
    """Three long steps held by one consumer process: behind the first, the others are handed on
    once; the rounds after it take one message at a time, so no step is started and given back
    again while the one before it runs."""
    gates = [tmp_path / f"gate{i}" for i in range(3)]
    task_ids = submit_batch(held, [("long", {"wait_for_file": {"0": str(gate)}}) for gate in gates])
    since = log_size(held)
    start_worker(held)
    try:
        for turn in range(3):
            (running,) = wait_for(
                lambda: [t for t in task_ids if running_now(held, t)] or None, 30, f"long step {turn + 1} to run"
            )
            if turn == 0:
                wait_for(lambda: handed_on_count(held, since) >= 2, 30, "the other two handed on")
            time.sleep(1.5)  # past RELEASE_AFTER: anything started behind this step would be given back
            gates[task_ids.index(running)].touch()
            held.wait_stopped(running, timeout=60)
            if turn == 0:
                after_first = log_size(held)
        docs = [held.wait_stopped(t, timeout=60) for t in task_ids]
    finally:
        for gate in gates:
            gate.touch()
        stop_worker(held)

    assert [doc["task_status"] for doc in docs] == [0] * 3, docs
    for doc in docs:
        outcomes = [a["outcome"] for a in doc["attempts"]]
        assert outcomes in (["succeeded"], ["released", "succeeded"]), outcomes  # handed on once at most
    # How many went back at first depends on how the deliveries arrived (read with the long
    # step, or sent while it ran); after its round, none may go back again.
    assert handed_on_count(held, after_first) == 0, worker_lines(held, since)


def running_now(stack: Stack, task_id: str) -> bool:
    attempts = stack.get(task_id)["attempts"]
    return bool(attempts) and attempts[-1]["outcome"] is None and stack.executions(task_id) != []
