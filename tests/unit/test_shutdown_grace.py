"""A worker told to stop gives up on its stuck attempts after the grace, even on ones it learns of late."""

from __future__ import annotations

import threading
from typing import Any

from shared.messaging import StepRequest, grace_then_stop
from shared.task import StepMessage, StepType

STEP = StepMessage("t1", "three", 1, 0, StepType.NORMAL, 1, "beta", "step", 20.0, 0)


class Stuck(StepRequest):
    def __init__(self, step: StepMessage) -> None:  # no Celery message behind it
        self.step = step

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
    handler = grace_then_stop(consumer, 0.05, lambda: list(active), stopped.set)  # type: ignore[arg-type]
    handler(sig="SIGTERM")
    active.append(Stuck(STEP))
    assert stopped.wait(5), "the worker was never stopped"
    assert consumer.given_up == [("t1", "worker stopped; attempt unfinished after 0.05s")]
