"""A worker runs the flow's next step itself when it serves that step's module and the
step fits in what is left of the delivery (``StepConsumer.handle(continue_until=...)``).

Through the in-process harness: what is stored must be what the same flow stores
when every step goes through its queue; only the publishes are saved.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shared.config import Settings
from shared.consumer import AttemptTimedOut
from shared.flows import load_flows
from shared.messaging.running import RunningSteps
from shared.module import Module, StepContext
from shared.saga import Cancel
from shared.states import Phase, StepState, StepType, TaskStatus
from shared.storage import InMemoryStore
from shared.task import StepMessage
from shared.testing import Harness
from tests.support import testmod

FLOWS = load_flows(Path(__file__).resolve().parents[1] / "support" / "flows.yaml")
N, R = StepType.NORMAL, StepType.ROLLBACK
FAR = 1e9  # seconds: every step fits


def harness(modules: dict[str, Module], **settings: Any) -> Harness:
    return Harness(FLOWS, modules, store=InMemoryStore(), settings=Settings(home=Path(".t"), **settings))


def both() -> dict[str, Module]:
    return {"alpha": testmod.alpha, "beta": testmod.beta}


def deliver_first(h: Harness, flow: str, parameters: dict[str, Any], within: float = FAR) -> str:
    """Submit, then hand the first message to the consumer as the broker would, once."""
    task, _ = h.service.submit(flow, parameters)
    first = h.publisher.messages.popleft()
    h.consumer.handle(first, continue_until=h.clock() + within)
    return task.task_id


def stored_story(h: Harness, task_id: str) -> list[tuple[int, int, int, str | None]]:
    return [(a.cursor, int(a.type), a.attempt, a.outcome) for a in h.service.attempts(task_id)]


@pytest.mark.parametrize("record_start_after", [0.0, 1.0])
def test_one_delivery_runs_every_step_its_worker_serves_and_stores_what_the_queue_would(
    record_start_after: float,
) -> None:
    here = harness(both(), record_start_after=record_start_after)
    task_id = deliver_first(here, "noop", {})

    assert not here.publisher.messages  # steps 2 and 3 never went through a queue
    assert here.service.get(task_id).status is TaskStatus.SUCCESS

    queued = harness(both(), record_start_after=record_start_after)
    other, _ = queued.service.submit("noop", {})
    queued.run()
    assert len(queued.delivered) == 3
    assert stored_story(here, task_id) == stored_story(queued, other.task_id)
    assert [s.state for s in here.service.get(task_id).steps] == [StepState.SUCCEEDED] * 3


@pytest.mark.parametrize("record_start_after", [0.0, 1.0])
def test_a_step_run_on_to_is_running_from_the_write_of_the_outcome_before_it(record_start_after: float) -> None:
    """No write of its own for its start: the outcome before it carries it, in one save; with
    starts written with their outcomes, it stays queued until its own, as a delivered step."""
    beta = Module("beta")
    h = harness({"alpha": testmod.alpha, "beta": beta}, record_start_after=record_start_after)
    seen: list[Any] = []

    @beta.command("step")
    def step(ctx: StepContext) -> None:
        task = h.service.get(ctx.task_id)
        assert task.active is not None
        seen.append((task.active.cursor, task.active.phase))
        seen.append([(a.cursor, a.started_at is not None, a.outcome) for a in h.service.attempts(ctx.task_id)])

    saves: list[bool] = []
    save = h.service.store.save

    def counted(*args: Any, **kwargs: Any) -> bool:
        saves.append(kwargs.get("next_attempt") is not None)
        return save(*args, **kwargs)

    h.service.store.save = counted  # type: ignore[method-assign]
    task_id = deliver_first(h, "noop", {})

    assert h.service.get(task_id).status is TaskStatus.SUCCESS
    if record_start_after == 0:
        assert seen == [(1, Phase.RUNNING), [(0, True, "succeeded"), (1, True, None)]]
        # Step 0's start, then each outcome, the first two carrying the next start.
        assert saves == [False, True, True, False]
    else:
        assert seen == [(1, Phase.QUEUED), [(0, True, "succeeded")]]
        assert saves == [False, False, False]  # each outcome, its attempt's start with it
    workers = {a.worker for a in h.service.attempts(task_id)}
    assert len(workers) == 1 and None not in workers


def test_a_step_of_a_module_the_worker_does_not_serve_goes_to_its_queue() -> None:
    h = harness({"alpha": testmod.alpha})
    task_id = deliver_first(h, "noop", {})

    (published,) = h.publisher.messages
    assert (published.module, published.cursor, published.seq) == ("beta", 1, 2)
    task = h.service.get(task_id)
    assert task.status is TaskStatus.RUNNING and task.steps[0].state is StepState.SUCCEEDED


def test_a_step_whose_timeout_would_outlast_the_delivery_goes_to_its_queue() -> None:
    h = harness(both())
    task_id = deliver_first(h, "noop", {}, within=19.0)  # noop's steps have a 20 s timeout

    (published,) = h.publisher.messages
    assert published.cursor == 1
    assert h.service.get(task_id).steps[0].state is StepState.SUCCEEDED


def test_without_a_deadline_every_next_step_is_published() -> None:
    h = harness(both())
    task, _ = h.service.submit("noop", {})
    h.consumer.handle(h.publisher.messages.popleft())
    assert [m.cursor for m in h.publisher.messages] == [1]


def test_compensation_runs_on_in_the_same_delivery() -> None:
    h = harness(both())
    task_id = deliver_first(h, "three", {"fail_at": [2]})  # step 2 has no retries

    assert h.service.get(task_id).status is TaskStatus.FAILED
    assert not h.publisher.messages
    assert stored_story(h, task_id) == [
        (0, N, 1, "succeeded"),
        (1, N, 1, "succeeded"),
        (2, N, 1, "failed"),
        (2, R, 1, "succeeded"),
        (1, R, 1, "succeeded"),
        (0, R, 1, "succeeded"),
    ]


def test_a_retry_waits_for_its_backoff_and_is_not_run_at_once() -> None:
    h = harness(both())
    task_id = deliver_first(h, "three", {"flaky": {"1": 1}})

    # Step 1 failed once; its retry waits (backoff), so nothing is published or run yet.
    assert not h.publisher.messages
    task = h.service.get(task_id)
    assert task.status is TaskStatus.RUNNING and task.steps[1].attempts == 1
    h.run()  # the scheduler releases the retry; the queue delivers it
    assert h.service.get(task_id).status is TaskStatus.SUCCESS


def test_a_cancel_stored_while_a_continued_step_runs_is_not_lost() -> None:
    """The consumer goes on from the copy it stored; a change made meanwhile must win."""
    beta = Module("beta")
    h = harness({"alpha": testmod.alpha, "beta": beta})
    cancelled = threading.Event()

    @beta.command("step")
    def step(ctx: StepContext) -> None:
        h.service.operate(ctx.task_id, Cancel(), actor="operator")  # lands between start and outcome
        cancelled.set()

    @beta.command("undo")
    def undo(ctx: StepContext) -> None:
        pass

    task_id = deliver_first(h, "noop", {})
    assert cancelled.is_set()
    h.run()
    task = h.service.get(task_id)
    assert task.status is TaskStatus.CANCELLED, task
    # Step 2 (alpha) never ran: the cancel stopped the flow after step 1.
    assert [(c, t) for c, t, _, _ in stored_story(h, task_id)][:2] == [(0, N), (1, N)]
    assert all(c != 2 for c, _, _, _ in stored_story(h, task_id))


CTX = StepContext(task_id="t", flow="f", cursor=1, step_type=0, attempt=1, parameters={}, settings=Settings())


def test_each_attempt_of_a_delivery_is_interrupted_at_its_own_timeout() -> None:
    """Celery's soft limit covers the whole delivery; the attempt's own timer stops it first."""
    running = RunningSteps(grace=5.0)
    began = time.monotonic()
    with pytest.raises(AttemptTimedOut):
        running.call(lambda _: threading.Event().wait(5) and None, CTX, 0.2)
    assert 0.15 < time.monotonic() - began < 1.5
    assert running.call(lambda _: {"ok": 1}, CTX, 0.2) == {"ok": 1}
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the timers of finished attempts were disarmed


def test_an_attempt_after_a_handler_that_took_the_alarm_signal_for_itself_is_still_interrupted() -> None:
    """The process's alarm handler is installed once; one a handler left in its place is replaced."""
    running = RunningSteps(grace=5.0)
    previous = signal.getsignal(signal.SIGALRM)
    try:
        running.call(lambda _: signal.signal(signal.SIGALRM, signal.SIG_IGN) and None, CTX, 5.0)
        began = time.monotonic()
        with pytest.raises(AttemptTimedOut):
            running.call(lambda _: threading.Event().wait(5) and None, CTX, 0.2)
        assert time.monotonic() - began < 1.5
    finally:
        signal.signal(signal.SIGALRM, previous)


def swallow(_: StepContext) -> None:
    while True:
        try:
            threading.Event().wait()
        except BaseException:  # a handler that ignores the interrupt
            continue


def test_a_handler_that_ignores_the_interrupt_kills_its_process_and_says_why() -> None:
    """The pool process kills itself at timeout + grace; its worker reads which step and why."""
    running = RunningSteps(grace=0.3)
    delivered = step_message(cursor=0, seq=1)
    ran_on = step_message(cursor=1, seq=2)
    pid = os.fork()
    if pid == 0:  # the pool process: a delivery that ran on to step 1, whose handler hangs
        try:
            running.begin("delivery-1", delivered, ran_on=False)
            running.begin("delivery-1", ran_on, ran_on=True)
            running.call(swallow, CTX, 0.2)
        finally:
            os._exit(3)  # not reached: killed
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    step, killed = running.step_of("delivery-1", pid, delivered)
    assert (step.cursor, step.seq) == (1, 2) and killed == "killed after the hard time limit of 0.5s"
    # Another delivery of that process, or a process that left no note: the delivered step.
    assert running.step_of("delivery-2", pid, delivered) == (delivered, None)
    assert running.step_of("delivery-1", pid + 100_000, delivered) == (delivered, None)


def step_message(cursor: int, seq: int) -> StepMessage:
    return StepMessage(
        task_id="t", flow="noop", seq=seq, cursor=cursor, type=StepType.NORMAL, attempt=1,
        module="alpha", command="step", timeout=0.2, retry=0, parameters={"big": "x" * 100},
    )


def test_a_note_reads_back_whole_after_a_longer_one_and_a_cut_off_one_reads_as_none() -> None:
    running = RunningSteps(grace=1.0)
    delivered = step_message(cursor=0, seq=1)
    long_task = replace(step_message(cursor=1, seq=2), task_id="t" * 5000)  # past a page
    running.begin("delivery-1", long_task, ran_on=True)
    running.begin("delivery-1", step_message(cursor=2, seq=3), ran_on=True)  # shorter: the old tail stays behind it
    step, killed = running.step_of("delivery-1", os.getpid(), delivered)
    assert (step.cursor, step.seq, killed) == (2, 3, None)
    note = running.directory / str(os.getpid())
    head, _, rest = note.read_bytes().partition(b"\n")
    record = head + b"\n" + rest[: int(head.split()[0])]  # the longer note's tail stays behind it
    for cut in (len(record) - 1, len(record) // 2, 3, 0):  # the process killed while the kernel wrote
        note.write_bytes(record[:cut])
        assert running.step_of("delivery-1", os.getpid(), delivered) == (delivered, None)
    note.write_bytes(record.replace(b'"seq":3', b'"seq":4'))  # new bytes ahead, old ones behind
    assert running.step_of("delivery-1", os.getpid(), delivered) == (delivered, None)


def test_a_worker_removes_the_note_directories_its_hosts_dead_workers_left(tmp_path: Path) -> None:
    """Killed or ended by os._exit, a worker leaves its directory; the next one started removes it."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    host = socket.gethostname()
    dead = tmp_path / f"asyncflow-worker-{host}-{ended.pid}-a1"
    alive = tmp_path / f"asyncflow-worker-{host}-{os.getpid()}-b2"
    elsewhere = tmp_path / f"asyncflow-worker-another-host-{ended.pid}-c3"  # its pid means nothing here
    for path in (dead, alive, elsewhere):
        path.mkdir()
        (path / "123").write_text("a note")
    running = RunningSteps(grace=1.0, root=tmp_path)
    assert not dead.exists()
    assert alive.exists() and elsewhere.exists() and running.directory.parent == tmp_path
    assert running.directory.name.startswith(f"asyncflow-worker-{host}-{os.getpid()}-")
