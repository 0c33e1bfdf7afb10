"""One thread per process keeps running attempts alive: it beats the live ones, drops the ended ones."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from shared.consumer import Pulse, Pulses
from shared.saga import Heartbeat, Started
from shared.states import StepType
from shared.task import StepMessage
from shared.testing import wait_for


@dataclass
class Decided:
    ignored: str | None = None


class Recording:
    """The part of TaskService a pulse uses: records each event, per task."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.over: set[str] = set()  # tasks whose attempt has ended: their events are ignored
        self.lock = threading.Lock()

    def apply(self, task_id: str, event: Any, worker: str | None = None) -> Decided:
        with self.lock:
            self.events.append((task_id, event))
        return Decided("not running" if task_id in self.over else None)

    def of(self, task_id: str) -> list[Any]:
        with self.lock:
            return [e for t, e in self.events if t == task_id]


def message(task_id: str) -> StepMessage:
    return StepMessage(task_id, "f", 3, 0, StepType.NORMAL, 1, "alpha", "step", 60.0, 0)


def pulse_threads() -> int:
    return sum(t.name == "pulses" for t in threading.enumerate())


def test_live_attempts_beat_at_their_interval_and_short_ones_never_write() -> None:
    service = Recording()
    short = [Pulse(service, message(f"short-{i}"), None, 0.1) for i in range(200)]  # type: ignore[arg-type]
    for p in short:
        p.start()
        p.stop()  # the attempt ended at once, as most do
    live = Pulse(service, message("live"), None, 0.1)  # type: ignore[arg-type]
    late = Pulse(service, message("late"), 0.1, 0.1)  # type: ignore[arg-type]  # its start not yet recorded
    live.start()
    late.start()
    live.report({"done": 1})
    wait_for(lambda: len(service.of("live")) >= 3 and len(service.of("late")) >= 3, 5, "three beats each")
    assert pulse_threads() == 1
    assert all(isinstance(e, Heartbeat) and e.seq == 3 for e in service.of("live"))
    assert service.of("live")[-1].progress == {"done": 1}
    first, *rest = service.of("late")
    assert isinstance(first, Started) and first.heartbeats
    assert rest and all(isinstance(e, Heartbeat) for e in rest)
    assert not [t for t, _ in service.events if t.startswith("short-")]

    live.stop()
    service.over.add("late")  # the sweep failed it, say: the next beat is ignored and the pulse ends
    time.sleep(0.3)
    beats = len(service.events)
    time.sleep(0.3)
    assert len(service.events) == beats


def test_a_beat_that_raises_does_not_stop_the_others() -> None:
    class Escaping(Recording):
        def apply(self, task_id: str, event: Any, worker: str | None = None) -> Decided:
            super().apply(task_id, event, worker)
            return None  # type: ignore[return-value]  # no decision: the pulse raises past its own net

    escaping, healthy = Escaping(), Recording()
    pulses = [
        Pulse(escaping, message("escaping"), None, 0.05),  # type: ignore[arg-type]
        Pulse(healthy, message("healthy"), None, 0.05),  # type: ignore[arg-type]
    ]
    for p in pulses:
        p.start()
    try:
        wait_for(
            lambda: len(escaping.of("escaping")) >= 3 and len(healthy.of("healthy")) >= 3,
            5,
            "three beats each, one of them failing every time",
        )
    finally:
        for p in pulses:
            p.stop()


def test_short_attempts_do_not_wake_the_pulse_thread() -> None:
    """Only a pulse due sooner than the thread means to wake wakes it: a short attempt,
    stopped long before its first beat, costs no switch of threads."""
    wakes = 0

    class Counting(threading.Condition):
        def notify(self, n: int = 1) -> None:
            nonlocal wakes
            wakes += 1
            super().notify(n)

    pulses = Pulses()
    pulses._cond = Counting()
    service = Recording()
    for i in range(100):
        p = Pulse(service, message(f"short-{i}"), None, 30.0)  # type: ignore[arg-type]
        pulses.add(p, time.monotonic() + 30.0)
        p.stop()
        time.sleep(0.002)  # the next delivery comes later: the thread has had its chance to run
    assert wakes == 1  # the first pulse, onto an empty heap
    assert not service.events


def test_stopped_pulses_are_swept_off_the_heap_before_they_come_due() -> None:
    """The heap holds a bounded multiple of the live pulses, not every attempt of the last
    heartbeat interval: its memory does not grow with the step rate."""
    pulses = Pulses()
    service = Recording()
    live = [Pulse(service, message(f"live-{i}"), None, 0.2) for i in range(300)]  # type: ignore[arg-type]
    for i in range(20_000):
        p = Pulse(service, message(f"short-{i}"), None, 30.0)  # type: ignore[arg-type]
        pulses.add(p, time.monotonic() + 30.0)
        p.stop()
        if i % 50 == 0 and i // 50 < len(live):
            pulses.add(live[i // 50], time.monotonic() + 0.2)
        assert len(pulses) <= 2 * len(live) + 1  # twice the live ones at most, not the 20,000 stopped
    wait_for(lambda: all(len(service.of(p.message.task_id)) >= 2 for p in live), 5, "every live pulse beats on")
    for p in live:
        p.stop()
