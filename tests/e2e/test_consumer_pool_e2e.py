"""`asyncflow worker --pool kombu`: consumer processes of Asyncflow's own, through real processes.

The saga and crash tests that concern who runs a step (test_saga_e2e,
test_faults) are collected here again, on stacks whose workers run the kombu
pool: the same assertions hold. The tests below them are the pool's own: the
hard-limit kill from the main process, and the attempts in flight in the
worker's registry row.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.config import Settings
from shared.processes import runs
from shared.runtime import Runtime
from shared.testing import wait_for
from tests.e2e.conftest import BACKENDS, open_stack
from tests.e2e.stack import Stack
from tests.e2e.test_faults import (  # noqa: F401 - collected again, on the kombu pool
    BETA,
    TIMING,
    started,
    test_consumer_killed_mid_step_is_recovered_by_the_expiry_sweep,
    test_message_lost_after_commit_is_published_again,
    test_replayed_message_is_acknowledged_and_ignored,
    test_sigterm_gives_up_on_a_stuck_attempt_after_the_grace,
    test_sigterm_lets_the_running_attempt_finish,
    test_worker_killed_between_the_handlers_end_and_the_commit_runs_the_step_again,
)
from tests.e2e.test_saga_e2e import (  # noqa: F401 - collected again, on the kombu pool
    NORMAL,
    test_handler_that_ignores_the_interrupt_is_killed,
    test_hanging_handler_is_stopped_by_its_timeout,
    test_killed_pool_process_counts_as_a_failed_attempt,
    test_rollback_failure_stops_raises_alarm_and_resume_retries_it,
    test_success_runs_every_step_once_and_merges_results,
)
from tests.e2e.test_up_supervision import alive, children_of

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

KOMBU = {"ASYNCFLOW_WORKER_POOL": "kombu"}


@pytest.fixture(scope="module", params=BACKENDS)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("kombu-" + request.param)
    with open_stack(request.param, home, KOMBU, [["alpha"], ["beta", "monitor"]]) as s:
        yield s


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("kombu-faults")
    with open_stack("postgres-rabbitmq", home, TIMING | KOMBU, [["alpha"], ["beta", "monitor"]]) as s:
        yield s


def test_a_handler_no_signal_reaches_is_killed_by_the_main_process(stack: Stack) -> None:
    # Step 2 blocks the time limit's signal: its process can neither interrupt nor kill itself.
    task = stack.submit("three", {"hang_deaf_at": [2]})
    entry = wait_for(
        lambda: next((e for e in stack.executions(task["task_id"]) if e["cursor"] == 2), None), 30, "step 2 to start"
    )
    doc = stack.wait_stopped(task["task_id"], timeout=60)
    assert doc["task_status"] == 4, doc
    (attempt,) = [a for a in doc["attempts"] if a["cursor"] == 2 and a["type"] == NORMAL]
    assert attempt["outcome"] == "timed_out", attempt  # by the expiry sweep or the kill, whichever came first
    # Its delivery's hard limit: the step's 2 s timeout, ASYNCFLOW_CONTINUE_WITHIN (5 s) and the grace (1 s).
    wait_for(lambda: not runs(entry["pid"]), 30, "the stuck process to be killed")
    assert "killed after the hard time limit of 8s" in stack.log("worker-alpha", tail=None)
    assert stack.wait_stopped(stack.submit("three")["task_id"])["task_status"] == 0


def test_the_workers_row_lists_the_attempt_in_flight(stack: Stack, tmp_path: Path) -> None:
    release = tmp_path / "release"
    task = stack.submit("three", {"wait_for_file": {"1": str(release)}})
    settings = Settings(home=stack.home, database_url=stack.env.get("ASYNCFLOW_DATABASE_URL"))
    runtime = Runtime(settings)
    store = runtime.process_store

    def in_flight() -> list[dict] | None:
        for row in store.list(seen_since=time.time() - 30):
            if row.role == "worker" and "beta" in row.detail.get("modules", []):
                attempts = [a for a in row.detail["in_flight"] if a["task_id"] == task["task_id"]]
                if attempts:
                    return attempts
        return None

    try:
        (attempt,) = wait_for(in_flight, 20, "the worker's row to list the attempt")
        assert attempt["module"] == "beta" and attempt["command"] == "step" and attempt["started"] > 0
        assert started(stack, task["task_id"], 1)["pid"] == attempt["pid"]
    finally:
        release.touch()
        runtime.close()
    assert stack.wait_stopped(task["task_id"])["task_status"] == 0


def test_consumer_processes_stop_when_the_main_process_dies(faulty: Stack) -> None:
    consumers = wait_for(lambda: children_of(faulty.procs[BETA].pid) or None, 30, "the consumer processes")
    faulty.kill(BETA, group=False)  # SIGKILL to the main process alone
    wait_for(lambda: not any(alive(pid) for pid in consumers), 30, "its consumer processes to stop")
    faulty.respawn(BETA)
    assert faulty.wait_stopped(faulty.submit("short", {})["task_id"])["task_status"] == 0
