"""Registry rows of processes (shared.presence) and the API's /metrics built from them (oss_api.metrics)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from celery.worker import state
from prometheus_client.parser import text_string_to_metric_families

from oss_api import metrics as api_metrics
from oss_api.metrics import StackMetrics
from oss_api.testing import open_client
from shared import metrics
from shared.flows import load_flows
from shared.presence import Presence, attempts_in_flight
from shared.saga import Failed, PollLater, Succeeded
from shared.states import StepType
from shared.storage.base import ProcessRecord
from shared.storage.memory import InMemoryProcessStore
from shared.task import StepMessage
from shared.testing import InProcess, ManualClock, wait_for
from tests.e2e.stack import SUPPORT

SNAPSHOT = [{"name": "asyncflow_x", "type": "counter", "help": "", "samples": [["asyncflow_x_total", {}, 1.0]]}]


def presence(store: InMemoryProcessStore, clock: ManualClock, count: list[float]) -> Presence:
    def collect() -> list[dict[str, Any]]:
        return [dict(SNAPSHOT[0], samples=[["asyncflow_x_total", {}, count[0]]])]

    return Presence(store, "worker", 5.0, collect=collect, detail=lambda: {"n": count[0]}, clock=clock, process_id="h:1")


def test_a_process_registers_renews_and_stops() -> None:
    store, clock, count = InMemoryProcessStore(), ManualClock(100.0), [1.0]
    p = presence(store, clock, count)
    p.beat()
    [row] = store.list()
    assert (row.role, row.started_at, row.seen_at, row.detail, row.stopped_at) == ("worker", 100.0, 100.0, {"n": 1.0}, None)
    clock.advance(5)
    count[0] = 4.0
    p.beat()
    [row] = store.list()
    assert (row.started_at, row.seen_at, row.metrics[0]["samples"][0][2]) == (100.0, 105.0, 4.0)
    clock.advance(1)
    count[0] = 6.0
    p.stop()
    [row] = store.list()
    # The last counts are kept with the stop, so the stack's totals include them.
    assert (row.stopped_at, row.metrics[0]["samples"][0][2]) == (106.0, 6.0)


def test_a_row_purged_meanwhile_is_registered_again() -> None:
    store, clock = InMemoryProcessStore(), ManualClock(100.0)
    p = presence(store, clock, [1.0])
    p.beat()
    store.purge(200.0)
    clock.advance(5)
    p.beat()
    assert [(r.process_id, r.seen_at) for r in store.list()] == [("h:1", 105.0)]


def test_the_thread_registers_at_once_and_marks_the_stop() -> None:
    store = InMemoryProcessStore()
    p = Presence(store, "scheduler", 60.0, collect=list, process_id="h:2").start()
    try:
        wait_for(store.list, 2, "the first beat: at once, not after an interval of 60 s")
    finally:
        p.stop()
    assert store.list()[0].stopped_at is not None


class FakeRequest:  # what Celery's Request has that is read; Celery holds requests by weak reference
    def __init__(self, args: list[Any], time_start: float | None, worker_pid: int | None) -> None:
        self.args, self.time_start, self.worker_pid = args, time_start, worker_pid


def test_attempts_in_flight_come_from_celerys_active_requests() -> None:
    payload = StepMessage("t1", "three", 4, 1, StepType.NORMAL, 1, "beta", "step", 20.0, 0).to_payload()
    step = FakeRequest(args=[payload], time_start=1234.5, worker_pid=77)
    alarm = FakeRequest(args=[{"flow": "three", "reason": "x"}], time_start=None, worker_pid=None)
    state.active_requests.update([step, alarm])  # type: ignore[arg-type]
    try:
        assert attempts_in_flight() == [
            {"task_id": "t1", "seq": 4, "module": "beta", "command": "step", "started": 1234.5, "pid": 77}
        ]
    finally:
        state.active_requests.difference_update([step, alarm])  # type: ignore[arg-type]


def test_step_messages_carry_their_send_time_without_changing_what_they_are() -> None:
    message = StepMessage("t1", "three", 4, 1, StepType.NORMAL, 1, "beta", "step", 20.0, 0)
    assert "sent_at" not in message.to_payload()
    sent = StepMessage.from_payload({**message.to_payload(), "sent_at": 1700000000.25})
    assert sent.sent_at == 1700000000.25 and sent == message
    assert StepMessage.from_payload(sent.to_payload()).sent_at == 1700000000.25


def test_outcome_labels() -> None:
    assert metrics.outcome_of(Succeeded(1, {})) == "succeeded"
    assert metrics.outcome_of(Failed(1, "x")) == "failed"
    assert metrics.outcome_of(Failed(1, "x", timed_out=True)) == "timed_out"
    assert metrics.outcome_of(PollLater(1, 5.0, {})) == "poll_later"


# --- /metrics --------------------------------------------------------------------------------


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_api_metrics_add_the_other_processes_rows(tmp_path: Path) -> None:
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path)
    rt = app.runtime
    with open_client(rt) as client:
        now = time.time()
        family = {"name": "asyncflow_step_attempts", "type": "counter", "help": "h", "samples": [
            ["asyncflow_step_attempts_total", {"module": "zeta", "command": "c", "outcome": "lost"}, 3.0]]}
        rt.process_store.register(ProcessRecord("w:1", "worker", "w", 1, now, now, {}, [family]))
        rt.process_store.register(ProcessRecord("w:2", "worker", "w", 2, now - 99, now - 99, {}, [family], now - 99))
        r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    found = scrape(r.text)
    assert found[("asyncflow_step_attempts_total", (("command", "c"), ("module", "zeta"), ("outcome", "lost")))] == 6
    assert found[("asyncflow_processes", (("role", "worker"),))] == 1
    assert found[("asyncflow_processes", (("role", "api"),))] == 1  # this one, registered by the app's start-up
    assert found[("asyncflow_queue_depth", (("queue", "asyncflow.alpha"),))] == 0  # no broker file yet: empty


def test_a_part_that_does_not_answer_is_left_out_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release, calls = threading.Event(), []

    def hung_broker(*_: Any) -> dict[str, int]:
        calls.append(1)
        release.wait(10)
        return {}

    monkeypatch.setattr(api_metrics.QueueDepths, "__call__", hung_broker)
    rt = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path).runtime
    stack = StackMetrics(rt, Presence(rt.process_store, "api", 5.0), timeout=0.05)
    errors = metrics.SCRAPE_ERRORS.labels("queue_depth")
    before = errors._value.get()
    try:
        first = scrape(stack.exposition().decode())
        second = scrape(stack.exposition().decode())
    finally:
        release.set()
        stack.close()
    assert not any(name == "asyncflow_queue_depth" for name, _ in first)
    assert ("asyncflow_processes", (("role", "api"),)) in first  # the rest is there
    assert errors._value.get() - before == 2
    assert len(calls) == 1  # the hung probe is not started again while it hangs
    assert second[("asyncflow_scrape_errors_total", (("part", "queue_depth"),))] >= 1


def test_the_leading_scheduler_purges_rows_gone_past_retention_and_says_it_leads(tmp_path: Path) -> None:
    app = InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path)
    rt, now = app.runtime, app.clock()
    retention = rt.settings.process_retention
    rt.process_store.register(ProcessRecord("old:1", "worker", "h", 1, 0.0, now - retention - 1, {}, []))
    rt.process_store.register(ProcessRecord("recent:2", "worker", "h", 2, 0.0, now - retention + 1, {}, [], now - 60))
    rt.scheduler.step()
    assert [r.process_id for r in rt.process_store.list()] == ["recent:2"]
    assert metrics.SCHEDULER_LEADER._value.get() == 1


def test_a_process_forked_while_the_row_is_renewed_does_not_hang(tmp_path: Path) -> None:
    # A worker forks its pool processes while its registry thread renews the row: a
    # child forked mid-renewal inherited the locks it held, and blocked on one for good.
    import os
    import signal

    from shared.config import Settings
    from shared.migrate import upgrade
    from shared.runtime import Runtime

    settings = Settings(home=tmp_path)
    upgrade(settings.resolved_database_url())
    runtime = Runtime(settings)
    store = runtime.process_store
    presence = Presence(store, "worker", 0.0005, detail=lambda: {"modules": ["alpha"]}).start()
    failed: list[str] = []  # each child that did not exit 0: killed by its alarm (hung), or its exit code
    try:
        for _ in range(40):
            pid = os.fork()
            if pid == 0:  # the child: what a pool process does first, or killed by the alarm
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(3)
                code = 1
                try:
                    Presence(store, "worker", 1.0, process_id=f"child-{os.getpid()}").beat()
                    metrics.STALE.labels("alpha").inc()
                    code = 0
                except Exception as exc:  # told apart from a hang in the parent's assertion
                    os.write(2, f"child {os.getpid()}: {exc!r}\n".encode())
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                failed.append(f"hung: killed by signal {os.WTERMSIG(status)}")
            elif os.WEXITSTATUS(status) != 0:
                failed.append(f"exit code {os.WEXITSTATUS(status)}")
    finally:
        presence.stop()
        runtime.close()
    assert failed == []
