"""A worker told to stop gives up on its stuck attempts after the grace, even on ones it learns of late."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import Any

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


def test_an_attempt_accepted_after_the_signal_is_given_up_at_the_grace() -> None:
    # The pool process runs the attempt, but its acknowledgement reaches the main
    # process only after SIGTERM: at the signal, Celery lists no active request.
    active: list[Any] = []
    stopped = threading.Event()
    consumer = Consumer()
    handler = grace_then_stop(consumer, 0.05, lambda: list(active), lambda stuck: stopped.set())  # type: ignore[arg-type]
    handler(sig="SIGTERM")
    active.append(Stuck(STEP))
    assert stopped.wait(5), "the worker was never stopped"
    assert consumer.given_up == [("t1", "worker stopped; attempt unfinished after 0.05s")]


def test_the_pool_processes_of_given_up_attempts_are_handed_to_stop_and_not_reported_again() -> None:
    # Celery's cold shutdown only sends them SIGTERM, which a handler may ignore;
    # their death, seen later by the main process, must not count a second loss.
    running, queued = Stuck(STEP, pid=4242), Stuck(STEP)
    stopped: list[list[int]] = []
    done = threading.Event()
    consumer = Consumer()

    def stop(stuck: list[int]) -> None:
        stopped.append(list(stuck))
        done.set()

    handler = grace_then_stop(consumer, 0.01, lambda: [running, queued], stop)  # type: ignore[arg-type]
    handler(sig="SIGTERM")
    assert done.wait(5), "the worker was never stopped"
    assert stopped == [[4242]]
    assert running.given_up and queued.given_up
    assert len(consumer.given_up) == 2


def test_stop_cold_kills_the_stuck_processes_and_exits_if_the_cold_shutdown_hangs() -> None:
    # A SIGQUIT handler that returns stands for a cold shutdown that never ends.
    script = (
        "import signal, subprocess, sys, time\n"
        "import shared.messaging as m\n"
        "m.COLD_STOP_DEADLINE = 0.3\n"
        "signal.signal(signal.SIGQUIT, lambda *_: None)\n"
        "stuck = subprocess.Popen(['sleep', '60'])\n"
        "m.stop_cold([stuck.pid])\n"
        "print(stuck.wait(timeout=5), flush=True)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == str(-signal.SIGKILL), done.stderr
    assert done.returncode == 1, done.stderr
    assert "exiting now" in done.stderr
    assert time.monotonic() - started < 20
