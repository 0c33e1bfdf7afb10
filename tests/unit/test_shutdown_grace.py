"""A worker told to stop gives up on its stuck attempts after the grace, even on ones it learns of late."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery.worker.request import Request

from shared.messaging import StepRequest, grace_then_stop
from shared.task import StepMessage, StepType

STEP = StepMessage("t1", "three", 1, 0, StepType.NORMAL, 1, "beta", "step", 20.0, 0)


class Stuck(StepRequest):
    def __init__(self, step: StepMessage, pid: int | None = None) -> None:  # no Celery message behind it
        self.step = step
        self.worker_pid = pid

    def running_step(self) -> tuple[StepMessage, str | None]:
        return self.step, None


class Consumer:
    def __init__(self) -> None:
        self.given_up: list[tuple[str, str]] = []

    def lost(self, step: StepMessage, why: str) -> None:
        self.given_up.append((step.task_id, why))


class Worker:
    """What the grace does to the worker: the processes it kills and its stop, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []
        self.stopped = threading.Event()

    def kill(self, pids: Iterable[int | None]) -> None:
        self.calls.append(("kill", [pid for pid in pids if pid is not None]))

    def stop(self) -> None:
        self.calls.append(("stop", []))
        self.stopped.set()


def test_an_attempt_accepted_after_the_signal_is_given_up_at_the_grace() -> None:
    # The pool process runs the attempt, but its acknowledgement reaches the main
    # process only after SIGTERM: at the signal, Celery lists no active request.
    active: list[Any] = []
    worker, consumer = Worker(), Consumer()
    handler = grace_then_stop(consumer, 0.05, lambda: list(active), worker.kill, worker.stop)  # type: ignore[arg-type]
    handler(sig="SIGTERM")
    active.append(Stuck(STEP))
    assert worker.stopped.wait(5), "the worker was never stopped"
    assert consumer.given_up == [("t1", "worker stopped; attempt unfinished after 0.05s")]


def test_the_processes_are_killed_before_their_attempts_are_reported_and_only_once() -> None:
    # Celery's cold shutdown only sends them SIGTERM, which a handler may ignore; their
    # death, seen later by the main process, must not count a second loss (given_up);
    # and the shutdown signal Celery sends again for the cold shutdown starts nothing.
    running, queued = Stuck(STEP, pid=4242), Stuck(STEP)
    worker = Worker()
    order: list[str] = []

    class Recording(Consumer):
        def lost(self, step: StepMessage, why: str) -> None:
            order.append("lost after " + ",".join(call for call, _ in worker.calls))
            super().lost(step, why)

    consumer = Recording()
    handler = grace_then_stop(consumer, 0.01, lambda: [running, queued], worker.kill, worker.stop)  # type: ignore[arg-type]
    handler(sig="SIGTERM")
    assert worker.stopped.wait(5), "the worker was never stopped"
    handler(sig="SIGQUIT")
    time.sleep(0.1)
    assert worker.calls == [("kill", [4242]), ("stop", [])]
    assert order == ["lost after kill", "lost after kill"]
    assert running.given_up and queued.given_up


def test_a_report_that_fails_still_stops_the_worker() -> None:
    class Down(Consumer):
        def lost(self, step: StepMessage, why: str) -> None:
            raise ConnectionError("database unavailable")

    worker = Worker()
    handler = grace_then_stop(Down(), 0.01, lambda: [Stuck(STEP, pid=4242)], worker.kill, worker.stop)  # type: ignore[arg-type]
    handler(sig="SIGTERM")
    assert worker.stopped.wait(5), "the worker was never stopped"


def test_killed_processes_die_and_a_cold_shutdown_that_hangs_ends_in_an_exit() -> None:
    # A SIGQUIT handler that returns stands for a cold shutdown that never ends.
    script = (
        "import signal, subprocess, sys, time\n"
        "import shared.messaging as m\n"
        "m.COLD_STOP_DEADLINE = 0.3\n"
        "signal.signal(signal.SIGQUIT, lambda *_: None)\n"
        "stuck = subprocess.Popen(['sleep', '60'])\n"
        "m.kill_processes([stuck.pid])\n"
        "m.stop_cold()\n"
        "print(stuck.wait(timeout=5), flush=True)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == str(-signal.SIGKILL), done.stderr
    assert done.returncode == 1, done.stderr
    assert "exiting now" in done.stderr
    assert time.monotonic() - started < 20


class Ended(StepRequest):
    """A request whose pool process ended, with what the process's note said; no Celery message behind it."""

    def __init__(self, killed: str | None = None) -> None:
        self.killed = killed
        self.log_fields = None
        self.consumer = Reports()  # type: ignore[assignment]

    def running_step(self) -> tuple[StepMessage, str | None]:
        return STEP, self.killed


class Reports:
    def __init__(self) -> None:
        self.reports: list[tuple[str, bool]] = []

    def lost(self, step: StepMessage, why: str, timed_out: bool = False) -> None:
        self.reports.append((why, timed_out))


def failure(exc: BaseException) -> Any:
    return type("ExceptionInfo", (), {"exception": exc})()


@pytest.mark.parametrize(
    ("given_up", "killed", "exc", "reported"),
    [
        (False, None, WorkerLostError("signal 9 (SIGKILL)"), [("worker process lost: signal 9 (SIGKILL)", False)]),
        (False, "killed after the hard time limit of 2s", WorkerLostError("x"), [("killed after the hard time limit of 2s", True)]),
        (True, None, WorkerLostError("signal 9 (SIGKILL)"), []),  # the shutdown grace reports it
        (False, None, RuntimeError("a task error, not a lost process"), []),
    ],
)
def test_a_lost_pool_process_is_reported_once_and_a_given_up_one_not_again(
    monkeypatch: pytest.MonkeyPatch, given_up: bool, killed: str | None, exc: BaseException, reported: list[Any]
) -> None:
    celery_failures: list[BaseException] = []
    monkeypatch.setattr(Request, "on_failure", lambda self, exc_info, **_: celery_failures.append(exc_info.exception))
    request = Ended(killed)
    request.given_up = given_up
    request.on_failure(failure(exc))
    assert request.consumer.reports == reported  # type: ignore[attr-defined]
    assert celery_failures == [exc]  # Celery's own handling (the acknowledgement) runs in every case
