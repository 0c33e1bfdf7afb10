"""Runs one step message: fence it, call the module's handler, report the outcome.

Broker-agnostic: the Celery task in :mod:`shared.messaging` and the in-process
drain of :mod:`shared.testing` both call :meth:`StepConsumer.handle`. A broker
that interrupts handlers at their time limit passes ``invoke``, which turns its
own interruption into :class:`AttemptTimedOut`.
"""

from __future__ import annotations

import contextvars
import functools
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Generator, Mapping
from typing import Any, NamedTuple, Protocol

from shared import metrics
from shared.config import Settings
from shared.logs import AttemptFields, attempt_context
from shared.module import Handler, Module, ModuleError, PermanentError, PollLater, StepContext
from shared.records import evolve
from shared.saga import Decision, Failed, Heartbeat, Started, Succeeded, stale
from shared.saga import PollLater as PollLaterEvent
from shared.service import Change, TaskNotFound, TaskService
from shared.states import Phase, StepType
from shared.storage import StorageUnavailable, patiently
from shared.storage.codec import task_from_row
from shared.task import Alarm, StepMessage, Task

log = logging.getLogger(__name__)

Outcome = Mapping[str, Any] | PollLater | None
OutcomeEvent = Succeeded | Failed | PollLaterEvent


class Store(NamedTuple):
    """A transition an attempt needs stored before it goes on (:meth:`StepConsumer.steps`).

    ``patient``: an outcome, worth waiting for through a database outage of up
    to ``outcome_patience`` (the work is done); otherwise a start, which fails at once.
    """

    change: Change
    patient: bool = False


class AttemptTimedOut(Exception):
    """The attempt's time limit interrupted its handler."""


def call(handler: Handler, ctx: StepContext, timeout: float) -> Outcome:
    """Run a handler with nothing to interrupt it at ``timeout`` (in-process tests)."""
    return handler(ctx)


def worker_name() -> str:
    """Names the process running an attempt in the attempt log: host and pid."""
    return _name_of(os.getpid())


@functools.lru_cache(maxsize=1)
def _name_of(pid: int) -> str:
    # Asked on every write of a step: the host's name once per process (a pool process has its own pid).
    return f"{socket.gethostname()}:{pid}"


class Beating(Protocol):
    """What the pulse thread beats for: a :class:`Pulse`, or anything due once or every so often."""

    stopped: bool  # dropped, unbeaten, when it comes due
    interval: float  # after a beat that raised, the next comes this much later

    @property
    def task_id(self) -> str | None:
        """For the log of a beat that raised."""
        ...

    def beat(self) -> float | None:
        """Do what is due; when to beat next (monotonic), or None."""
        ...


class Pulse:
    """Keeps one running attempt alive while its handler works.

    Beaten by the process's :class:`Pulses` thread: records the start if the
    attempt outlives ``start_after`` (None: the start is recorded already), then
    a Heartbeat every ``interval`` seconds with the handler's latest progress.
    If the process dies, so does its pulse, and the sweep fails the attempt
    after three missed heartbeats instead of at the end of its timeout.
    """

    def __init__(self, service: TaskService, message: StepMessage, start_after: float | None, interval: float) -> None:
        self.service = service
        self.message = message
        self.start_after = start_after
        self.interval = interval
        self.progress: Mapping[str, Any] | None = None
        self.stopped = False
        self._started = start_after is None
        # The attempt's logging context (shared.logs) goes with it onto the pulse thread.
        self._context = contextvars.copy_context()

    @property
    def task_id(self) -> str:
        return self.message.task_id

    def start(self) -> None:
        first = self.interval if self.start_after is None else self.start_after
        PULSES.add(self, time.monotonic() + first)

    def stop(self) -> None:
        self.stopped = True

    def report(self, progress: Mapping[str, Any]) -> None:
        self.progress = dict(progress)

    def beat(self) -> float | None:
        """Record what is due now; when to beat next (monotonic), None once the attempt is over."""
        return self._context.run(self._beat)

    def _beat(self) -> float | None:
        if self._started:
            alive = self._apply(Heartbeat(self.message.seq, self.progress), "a heartbeat")
        else:
            alive = self._started = self._apply(Started(self.message.seq, heartbeats=True), "its start")
        return time.monotonic() + self.interval if alive and not self.stopped else None

    def _apply(self, event: Started | Heartbeat, what: str) -> bool:
        """Store ``event``; False once the attempt is no longer the task's running one."""
        try:
            decision = self.service.apply(self.message.task_id, event, worker=worker_name())
        except Exception:  # the next heartbeat tries again; the outcome is recorded anyway
            log.exception("recording %s failed", what, extra={"task_id": self.message.task_id})
            return True
        if decision.ignored:
            return False
        if isinstance(event, Heartbeat):
            metrics.HEARTBEATS.labels(self.message.module).inc()
        return True


class Once:
    """A pulse due once: ``due`` runs on the pulse thread unless :meth:`stop` came first.

    ``due`` answers when to run again (monotonic), or None. ``interval``: how
    much later it runs again if it raised.
    """

    task_id: str | None = None

    def __init__(self, due: Callable[[Once], float | None], interval: float) -> None:
        self.due = due
        self.interval = interval
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def beat(self) -> float | None:
        return None if self.stopped else self.due(self)


class Pulses:
    """One thread per process beats for every pulse of that process, each when it is due.

    A thread per attempt cost more CPU than a no-op step (its start waits for the
    new thread to be scheduled), and nearly every attempt ends long before its
    first heartbeat. A stopped pulse stays on the heap until it comes due: the
    thread then drops it with the others due, instead of being woken for it. So
    short attempts wake the thread only when the heap runs empty, not one switch
    of threads each.

    Left alone, the heap would hold every attempt of the last heartbeat interval,
    each with its message: memory growing with the step rate (benchmarks/README.md,
    "A worker's memory is its stopped pulses"). So when it has doubled since it was
    last swept, the stopped pulses are swept off it: it holds at most twice the
    live ones of the last sweep (or SWEEP_FROM), for one pass over the heap per as
    many additions.
    """

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Beating]] = []
        self._sweep_at = SWEEP_FROM  # the heap's length that has the stopped pulses swept off it
        self._order = itertools.count()  # ties in time go first come, first served
        self._pid: int | None = None  # the process the thread runs in
        self._cond = threading.Condition()
        # A forked child (a Celery pool process) has no thread and may have a lock
        # held by the parent's thread at the fork: it starts afresh.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._due, self._pid, self._cond = [], None, threading.Condition()
        self._sweep_at = SWEEP_FROM

    def __len__(self) -> int:
        """Pulses on the heap, the stopped ones not yet dropped included."""
        return len(self._due)

    def add(self, pulse: Beating, at: float) -> None:
        with self._cond:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="pulses", daemon=True).start()
            if len(self._due) >= self._sweep_at:
                self._due = [entry for entry in self._due if not entry[2].stopped]
                heapq.heapify(self._due)
                self._sweep_at = max(SWEEP_FROM, 2 * len(self._due))
            heapq.heappush(self._due, (at, next(self._order), pulse))
            if self._due[0][2] is pulse:  # sooner than the thread means to wake
                self._cond.notify()

    def _run(self) -> None:
        while True:
            pulse = self._next()
            try:
                again = pulse.beat()
            except Exception:  # this thread beats for every attempt of the process: it goes on
                log.exception("a pulse failed", extra={"task_id": pulse.task_id})
                again = time.monotonic() + pulse.interval
            if again is not None:
                self.add(pulse, again)

    def _next(self) -> Beating:
        """Waits for the first pulse due that is not stopped, and takes it off the heap."""
        with self._cond:
            while True:
                wait = self._due[0][0] - time.monotonic() if self._due else None
                if wait is not None and wait <= 0:
                    pulse = heapq.heappop(self._due)[2]
                    if not pulse.stopped:
                        return pulse
                    continue
                # Heartbeats need no precision: waking a little late lets one wake-up
                # drop the many pulses of short attempts that came due meanwhile.
                self._cond.wait(None if wait is None else max(wait, PULSE_SLACK))


PULSE_SLACK = 0.05
# The heap's length below which stopped pulses wait to come due: a sweep is not
# worth its pass over fewer (about a megabyte of messages at most, at 3-4 kB a pulse).
SWEEP_FROM = 256
PULSES = Pulses()


class StepConsumer:
    def __init__(
        self,
        service: TaskService,
        modules: Mapping[str, Module],
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        invoke: Callable[[Handler, StepContext, float], Outcome] = call,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.service = service
        self.modules = dict(modules)
        self.settings = settings
        self.clock = clock
        self.invoke = invoke
        self.sleep = sleep

    def handle(
        self,
        message: StepMessage,
        continue_until: float | None = None,
        on_next: Callable[[StepMessage], None] | None = None,
    ) -> None:
        """Run one attempt, then the flow's next steps this worker serves while they fit.

        A delivered attempt costs a read, the write of its start and the write of
        its outcome; the first step of a task just submitted carries the task as
        stored and needs no read. With ``settings.record_start_after`` > 0 the
        start is written with the outcome instead, unless the attempt outlives that
        threshold: from then on the scheduler expires it at its deadline instead of
        publishing the message again, and the task shows it running.

        A next step whose module this worker serves, and whose timeout ends
        before ``continue_until`` (on ``clock``), runs here at once instead of
        going through its queue: its start is stored in the write of the outcome
        before it, so the task shows it running, and if this process dies its
        missed heartbeats fail it as any running attempt (with starts written
        with their outcomes, it stays queued until its own, as a delivered one
        would). What is saved is a publish, a delivery, a read and a commit per step. None: every next step
        is published. ``on_next`` hears of each step run on to, before it starts
        (who reports the process lost must know).

        Each transition is stored as it comes (:meth:`TaskService.apply`); a
        consumer with several deliveries in flight drives :meth:`steps` instead.
        """
        steps = self.steps(message, continue_until, on_next)
        try:
            store = next(steps)
            while True:
                try:
                    decision = self.store_now(store)
                except Exception as exc:
                    store = steps.throw(exc)
                else:
                    store = steps.send(decision)
        except StopIteration:
            return

    def store_now(self, store: Store) -> Decision:
        """Store one transition at once; an outcome waits out a database outage within bounds."""
        if not store.patient:
            return self.service.apply(*store.change)
        return patiently(
            lambda: self.service.apply(*store.change),
            self.settings.outcome_patience,
            "storing the outcome",
            self.clock,
            self.sleep,
        )

    def steps(
        self,
        message: StepMessage,
        continue_until: float | None = None,
        on_next: Callable[[StepMessage], None] | None = None,
    ) -> Generator[Store, Decision, None]:
        """:meth:`handle`'s work, as a generator of the transitions it needs stored.

        Each :class:`Store` yielded is answered with its stored decision, sent in,
        or with what storing it raised, thrown in; the handlers run inside. A
        :class:`StorageUnavailable` from the start's write comes out of it: nothing
        ran, and the message is to be tried again.
        """
        step: tuple[StepMessage, Task | None] | None = (message, None)
        while step is not None:
            message, known = step
            if known is not None and on_next is not None:
                on_next(message)
            with attempt_context(AttemptFields.of(message) if known is not None else None):
                step = yield from self._run(message, known, continue_until)

    def _run(
        self, message: StepMessage, known: Task | None, continue_until: float | None
    ) -> Generator[Store, Decision, tuple[StepMessage, Task] | None]:
        """One attempt of ``message``, on ``known`` if the task was just stored here.

        Returns the next step to run here, with the task as stored, or None.
        """
        log_extra = {"task_id": message.task_id, "step": message.cursor, "seq": message.seq}
        metrics.observe_queue_wait(message.module, message.sent_at)
        start_after: float | None = None  # the start is recorded already
        if known is not None:
            task = known  # stored with the outcome of the step before: started, or queued for its outcome to start
            assert task.active is not None
            if task.active.phase is Phase.QUEUED:
                start_after = self.settings.record_start_after
        else:
            try:
                task = self._task(message)
                reason = stale(task, Started(message.seq), self.service.clock())
                if reason is None and self.settings.record_start_after <= 0:
                    start = Started(message.seq, heartbeats=True)
                    decision = yield Store(Change(message.task_id, start, known=task, worker=worker_name()))
                    reason, task = decision.ignored, decision.task  # ignored: another delivery started it first
                elif reason is None:
                    start_after = self.settings.record_start_after
            except TaskNotFound:  # never stored, or deleted since (a purged task, the copy's write finds no row)
                log.warning("step message for an unknown task dropped", extra=log_extra)
                return None
            if reason:
                metrics.STALE.labels(message.module).inc()
                log.info("stale step message ignored: %s", reason, extra=log_extra)
                return None
        assert task.active is not None
        if task.cancel_requested and message.type is StepType.NORMAL and task.active.phase is Phase.QUEUED:
            # Cancelled before it started: the requeue sweep compensates what ran before it.
            log.info("step not started: its task is being cancelled", extra=log_extra)
            return None
        started_at = self.service.clock()
        pulse = Pulse(self.service, message, start_after, self.settings.heartbeat_interval)
        pulse.start()
        try:
            event = self._attempt(message, task, pulse.report)
        finally:
            pulse.stop()

        def runs_here(next_message: StepMessage) -> bool:
            return (
                continue_until is not None
                and next_message.module in self.modules
                and self.clock() + next_message.timeout <= continue_until
            )

        outcome = Change(message.task_id, evolve(event, started_at=started_at), task, worker_name(), runs_here)
        try:
            stored: Decision | None = yield Store(outcome, patient=True)
        except StorageUnavailable as exc:
            # Giving up is safe: the attempt then expires at its deadline and runs again
            # (handlers are idempotent), but waiting kept the work that was done.
            log.error(
                "outcome not stored, database still unavailable; the attempt will expire and run again: %s",
                exc,
                extra={"task_id": message.task_id, "seq": message.seq},
            )
            stored = None
        following = stored.kept if stored is not None else None
        if stored is None or following is None:
            return None
        metrics.CONTINUED.labels(following.module).inc()
        return evolve(following, sent_at=time.time()), stored.task

    def _task(self, message: StepMessage) -> Task:
        """The task ``message`` is about, to decide the attempt's start on.

        The copy the message carries if its start is to be written before the
        handler runs: that write's compare-and-set proves the copy current, or
        fails and decides again on the task read then. Otherwise the task is read.
        """
        if message.known is not None and self.settings.record_start_after <= 0:
            try:
                copy = task_from_row(message.known)
            except (KeyError, TypeError, ValueError) as exc:  # not a copy this release can read: read instead
                log.warning(
                    "the task copy in a step message is unreadable (%r): reading the task",
                    exc,
                    extra={"task_id": message.task_id},
                )
            else:
                if copy.task_id == message.task_id:  # its write is fenced by the copy's own id
                    return copy
        return self.service.get(message.task_id)

    def _attempt(
        self, message: StepMessage, task: Task, progress_sink: Callable[[Mapping[str, Any]], None] | None = None
    ) -> OutcomeEvent:
        """Run the handler of ``message`` on the stored task; what happened, as a saga event."""
        ctx = StepContext(
            task_id=task.task_id,
            flow=task.flow,
            cursor=message.cursor,
            step_type=int(message.type),
            attempt=message.attempt,
            # The stored Parameters, not the message copy: the database is the truth.
            parameters=dict(task.parameters),
            settings=self.settings,
            progress_sink=progress_sink,
        )
        try:
            handler = self._handler(message)
        except ModuleError as exc:
            # A message for a module or command this worker does not serve: retrying
            # elsewhere would not help, compensate.
            return Failed(message.seq, str(exc), permanent=True)
        started = self.clock()
        event: OutcomeEvent
        try:
            outcome = self.invoke(handler, ctx, message.timeout)
        except AttemptTimedOut:
            event = Failed(message.seq, f"timed out after {message.timeout:g}s", timed_out=True)
        except PermanentError as exc:
            event = Failed(message.seq, str(exc) or type(exc).__name__, permanent=True)
        except Exception as exc:  # any handler error fails the attempt
            event = Failed(message.seq, f"{type(exc).__name__}: {exc}")
        else:
            elapsed = self.clock() - started
            if elapsed > message.timeout:
                # The handler swallowed the interrupt; its result came too late to count.
                event = Failed(message.seq, f"timed out after {message.timeout:g}s", timed_out=True)
            elif isinstance(outcome, PollLater):
                event = PollLaterEvent(message.seq, outcome.after, dict(outcome.parameters))
            elif outcome is None or isinstance(outcome, Mapping):
                event = Succeeded(message.seq, dict(outcome or {}))
            else:
                event = Failed(
                    message.seq,
                    f"handler returned {type(outcome).__name__}; expected a dict, None or PollLater",
                    permanent=True,
                )
        elapsed, label = self.clock() - started, metrics.outcome_of(event)
        metrics.STEP_SECONDS.labels(message.module, message.command, label).observe(elapsed)
        metrics.STEP_ATTEMPTS.labels(message.module, message.command, label).inc()
        why = f": {event.error}" if isinstance(event, Failed) else ""
        log.info("step attempt %s in %.3fs%s", label.replace("_", " "), elapsed, why, extra={"task_id": message.task_id})
        return event

    def _handler(self, message: StepMessage) -> Handler:
        module = self.modules.get(message.module)
        if module is None:
            raise ModuleError(f"this worker does not serve module {message.module!r}")
        module.start(self.settings)
        return module.handler(message.command)

    def lost(self, message: StepMessage, reason: str, timed_out: bool = False) -> None:
        """The process running ``message`` died or was killed: a failed attempt.

        Its start may not have been recorded: the failure records it, as now.
        """
        log.warning("step attempt lost: %s", reason, extra={"task_id": message.task_id})
        failed = Failed(message.seq, reason, timed_out=timed_out, started_at=self.service.clock())
        metrics.STEP_ATTEMPTS.labels(message.module, message.command, "timed_out" if timed_out else "lost").inc()
        self.service.apply(message.task_id, failed)

    def alarm(self, alarm: Alarm, command: str) -> None:
        """Deliver an alarm to the configured ``module.command`` (e.g. monitor.report_event)."""
        module_name, _, command_name = command.partition(".")
        module = self.modules[module_name]
        module.start(self.settings)
        ctx = StepContext(
            task_id=alarm.task_id,
            flow=alarm.flow,
            cursor=alarm.cursor,
            step_type=1,
            attempt=1,
            parameters=alarm.to_parameters(),
            settings=self.settings,
            key=f"{alarm.task_id}:alarm:{alarm.seq}",
        )
        module.handler(command_name)(ctx)
