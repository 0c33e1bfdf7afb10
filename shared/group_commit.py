"""Several deliveries in flight in one consumer process, their transitions committed together.

A consumer process that holds one delivery at a time commits each of its
transitions alone: the attempt's start, then each outcome (with the next step's
start). Holding several (``worker_prefetch``), it drives each delivery's work as
the generator :meth:`StepConsumer.steps`, which stops at every transition it
needs stored, in rounds: every delivery whose transition was stored goes on, on
this thread, up to its next transition or its end (running its next handler on
the way); then every transition waiting is stored, all in one commit
(:meth:`TaskService.apply_many`: one transaction and one round trip on
PostgreSQL, the next messages published together). Handlers still run one at a
time on the thread that drives the rounds, so an attempt's time limit (SIGALRM)
interrupts its handler as before.

No round waits to fill: a transition alone is committed at once. A transition
waits only while the handlers of the deliveries resumed before its round's
commit run; should one of them run past FLUSH_AFTER, the process's pulse thread
(:data:`shared.consumer.PULSES`) hands on what is held here for its turn
(:meth:`GroupCommit.flush`): the outcomes waiting are committed and their next
steps published for other consumers, and next steps kept here without a stored
start are published; once the round has run RELEASE_AFTER, the starts, committed
or not, are given back as well (:class:`shared.saga.Released`: the same attempt,
published as a new message). What the consumer process read but did not start
goes back to the broker
(:class:`shared.messaging.consumers.GroupedStepMessages`). Only the long step
itself stays. One held whose attempt's start a commit stored is running as far
as the task shows, so from that commit until it is resumed or given back the
pulse thread sends its heartbeats, as it would while its handler runs:
otherwise, held past three heartbeat intervals (a wait for the database, say),
it would be taken for lost and run again elsewhere.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from shared.consumer import PULSES, Once, Pulse, StepConsumer, Store, worker_name
from shared.records import evolve
from shared.retry import reconnect_delay
from shared.saga import Decision, Released, Started
from shared.service import Change
from shared.states import Phase
from shared.storage import StorageUnavailable
from shared.task import StepMessage, Task

log = logging.getLogger(__name__)

# Outcomes wait about this long behind the handler of another delivery (the pulse
# thread wakes a little late, up to shared.consumer.PULSE_SLACK).
FLUSH_AFTER = 0.05
# The starts held in a round that has run this long are given back. Each costs a commit
# and a delivery more: a step of a few hundred milliseconds does not send the others
# round again, steps of seconds do not hold them.
RELEASE_AFTER = 1.0


@dataclass(eq=False)
class Flight:
    """One delivery in flight: its work, paused at the transition it waits for."""

    key: Any  # the caller's own: what it acknowledges once the delivery is over
    message: StepMessage  # the step it runs now (a delivery may run on to the flow's next steps)
    steps: Generator[Store, Decision, None] = field(repr=False)
    # Each delivery's logging context (shared.logs) is its own, across its pauses.
    context: contextvars.Context = field(default_factory=contextvars.copy_context, repr=False)


@dataclass(eq=False)
class _Waiting:
    flight: Flight
    store: Store
    failing_since: float | None = None  # when storing it first failed: an outcome waits within its patience
    pulse: Pulse | None = None  # stored, its attempt running: beats until the delivery is resumed or given back


class GroupCommit:
    """Drives the deliveries a consumer process holds, and commits their transitions together.

    Not thread-safe but for :meth:`flush`, which the pulse thread calls: every
    other method runs on the thread that drives the rounds. ``finished`` hears of
    each delivery whose work is over (None) or failed (what it raised: a
    :class:`StorageUnavailable` means the start could not be stored and nothing
    ran, so the message is to be tried again), on that thread.
    """

    def __init__(
        self,
        consumer: StepConsumer,
        finished: Callable[[Flight, BaseException | None], None],
        noted: Callable[[list[Flight]], None] | None = None,
    ) -> None:
        self.consumer = consumer
        self.finished = finished
        self.noted = noted  # hears of the deliveries held whenever they change
        self._flights: list[Flight] = []
        self._waiting: list[_Waiting] = []
        self._stored: deque[tuple[_Waiting, Decision | Exception]] = deque()
        self._lock = threading.Lock()  # _waiting and _stored: the pulse thread's flush takes them too
        self._began = time.monotonic()  # when the last round began (work)
        self._failures = 0

    def __len__(self) -> int:
        """Deliveries held."""
        return len(self._flights)

    def start(
        self,
        key: Any,
        message: StepMessage,
        continue_until: float | None = None,
        on_next: Callable[[StepMessage], None] | None = None,
    ) -> None:
        """Take a delivery: its work runs up to its first transition, which waits for the next commit."""
        made: list[Flight] = []  # the flight, once made: its work tells it of each step it runs on to

        def ran_on(following: StepMessage) -> None:
            made[0].message = following
            self._note()
            if on_next is not None:
                on_next(following)

        flight = Flight(key, message, self.consumer.steps(message, continue_until, ran_on))
        made.append(flight)
        self._began = time.monotonic()  # its handler may run now (starts written with outcomes): timed from here
        self._flights.append(flight)
        self._note()
        self._resume(flight, None)

    def work(self) -> bool:
        """One round: resume each delivery whose transition is stored, then commit those waiting.

        False when there was nothing to do.
        """
        resumed = False
        self._began = time.monotonic()
        while True:
            with self._lock:  # one at a time: behind a long handler, the pulse thread hands on what is left
                if not self._stored:
                    break
                waiting, answer = self._stored.popleft()
            resumed = True
            if waiting.pulse is not None:
                waiting.pulse.stop()  # its attempt's own pulse beats from now on
            if answer is _HANDED_ON:
                waiting.flight.context.run(waiting.flight.steps.close)  # its logging context, as it was made in
                self._end(waiting.flight, None)
            else:
                self._resume(waiting.flight, answer)
        with self._lock:
            group, self._waiting = self._waiting, []
        if group and not self._commit(group):
            self.consumer.sleep(reconnect_delay(self._failures - 1))
        return bool(resumed or group)

    def flush(self, give_back: bool = False) -> None:
        """Commit the outcomes waiting now, and hand on what waits here for its turn (the pulse
        thread, while a handler runs long, which would hold it as long as it runs).

        - An outcome's next step is published rather than run here.
        - A next step a commit kept here without storing its start (starts written
          with their outcomes) is published.
        - With ``give_back``, a start, committed (a delivery's, or a next step's
          with the outcome before it) or not yet (a delivery just taken), is given
          back (:class:`~shared.saga.Released`): the same attempt goes out as a new
          message, and the one held here is stale, as is a report of its loss
          should this process die.

        Their deliveries then end here without running them. A failure is left to
        the rounds: what could not be handed on runs here after the long handler.
        All of it goes in one ``apply_many``.
        """
        with self._lock:
            self._publish_kept()
            outcomes = [w for w in self._waiting if w.store.patient]
            held = [w for w in self._waiting if not w.store.patient]  # starts not committed yet
            starts, started = [], []
            if give_back:
                starts, held = held, []
                started = [(w, a, m) for w, a in self._stored if isinstance(a, Decision) and (m := _running(w, a))]
            if not (outcomes or starts or started):
                return
            self._waiting = held
            given = {id(w) for w, _, _ in started}
            self._stored = deque(entry for entry in self._stored if id(entry[0]) not in given)
            changes = [w.store.change._replace(keep=None) for w in outcomes]
            changes += [_given_back(w.flight.message, w.store.change.known, running=False) for w in starts]
            changes += [_given_back(m, a.task, running=True) for _, a, m in started]
            try:
                answers = self.consumer.service.apply_many(changes)
            except Exception:  # apply_many answers for each change: a defect, left to the rounds
                log.exception("committing the outcomes behind a long handler failed")
                self._waiting[:0] = outcomes + starts
                self._stored.extendleft((w, a) for w, a, _ in reversed(started))
                return
            ended, began = len(outcomes), len(outcomes) + len(starts)
            for waiting, answer in zip(outcomes, answers[:ended], strict=True):
                if isinstance(answer, StorageUnavailable):
                    self._waiting.append(waiting)
                else:
                    self._answered(waiting, answer)
            handed = 0
            for waiting, answer in zip(starts, answers[ended:began], strict=True):
                if isinstance(answer, Exception):  # not given back: its start is committed next round
                    self._waiting.append(waiting)
                    continue
                self._stored.append((waiting, _HANDED_ON))
                handed += 1
            staying: list[tuple[_Waiting, Decision | Exception]] = []
            for (waiting, before, _), answer in zip(started, answers[began:], strict=True):
                if isinstance(answer, Exception):  # not given back: it runs here after all
                    staying.append((waiting, before))
                    continue
                if waiting.pulse is not None:
                    waiting.pulse.stop()
                self._stored.append((waiting, _HANDED_ON))
                handed += 1
            self._stored.extendleft(reversed(staying))
            if handed:
                log.info("%d step(s) given back behind a long step", handed)

    def _publish_kept(self) -> None:
        """Publish the next steps kept here, their starts not stored, that wait for their turn (under the lock)."""
        handed: list[tuple[_Waiting, StepMessage]] = []
        staying: deque[tuple[_Waiting, Decision | Exception]] = deque()
        for waiting, answer in self._stored:
            message = _kept_queued(answer)
            if message is None:
                staying.append((waiting, answer))
            else:
                handed.append((waiting, message))
        if not handed:
            return
        self._stored = staying
        try:
            self.consumer.service.publish([evolve(message, sent_at=time.time()) for _, message in handed])
            log.info("%d next step(s) kept here published instead, behind a long step", len(handed))
        finally:  # ended here whatever happened: the requeue sweep publishes what did not go out
            self._stored.extend((waiting, _HANDED_ON) for waiting, _ in handed)

    def _commit(self, group: list[_Waiting]) -> bool:
        """Store ``group`` in one commit; False when the database was unavailable to some of it."""
        try:
            answers: list[Decision | Exception] = self.consumer.service.apply_many([w.store.change for w in group])
        except Exception as defect:  # apply_many answers for each change: a defect, which ends the deliveries
            log.exception("committing a group of transitions failed")
            answers = [defect] * len(group)
        unavailable: list[_Waiting] = []
        exc: StorageUnavailable | None = None
        with self._lock:
            for waiting, answer in zip(group, answers, strict=True):
                if isinstance(answer, StorageUnavailable):
                    unavailable.append(waiting)
                    exc = answer
                else:
                    self._answered(waiting, answer)
        if exc is None:
            self._failures = 0
            return True
        self._failures += 1
        self._unstored(unavailable, exc)
        return False

    def _answered(self, waiting: _Waiting, answer: Decision | Exception) -> None:
        """``waiting``'s transition was stored (or refused): it goes on at the next round. Under the lock.

        If ``answer`` started an attempt for it to run, that attempt's heartbeats
        start now: what runs before its turn may take long.
        """
        following = _running(waiting, answer)
        if following is not None:  # made in the delivery's logging context, which the pulse keeps
            interval = self.consumer.settings.heartbeat_interval
            waiting.pulse = waiting.flight.context.run(Pulse, self.consumer.service, following, None, interval)
            waiting.pulse.start()
        self._stored.append((waiting, answer))

    def _unstored(self, group: list[_Waiting], exc: StorageUnavailable) -> None:
        """A start fails at once (nothing ran); an outcome is tried again while within its patience."""
        now = self.consumer.clock()
        again, failed = [], []
        for waiting in group:
            if waiting.store.patient:
                if waiting.failing_since is None:
                    waiting.failing_since = now
                    # In the words of a lone consumer's wait (shared.storage.patiently).
                    pause = reconnect_delay(self._failures - 1)
                    log.warning("database unavailable, storing the outcome again in %.1fs: %s", pause, exc)
                if now - waiting.failing_since < self.consumer.settings.outcome_patience:
                    again.append(waiting)
                    continue
            failed.append((waiting, exc))
        with self._lock:
            self._waiting[:0] = again
            self._stored.extend(failed)

    def beside(self, work: Callable[[], None]) -> None:
        """Run ``work`` on this thread between deliveries (an alarm's command, say): should it run
        long, what waits here is handed on, as behind a handler."""
        self._began = time.monotonic()  # timed from here, as a delivery's start is: not from the round before
        flush = self._flush_behind()
        try:
            work()
        finally:
            if flush is not None:
                flush.stop()

    def _flush_behind(self) -> Once | None:
        """What the pulse thread does should what runs on this thread from now on run long (None: nothing waits)."""
        if not (self._waiting or self._stored):
            return None
        flush = Once(self._behind(self._began), FLUSH_AFTER)
        PULSES.add(flush, time.monotonic() + FLUSH_AFTER)
        return flush

    def _resume(self, flight: Flight, answer: Decision | Exception | None) -> None:
        """Run ``flight`` on with ``answer`` up to its next transition, or to its end."""
        flush = self._flush_behind()  # this delivery's next handler may run long: what waits must not
        try:
            store = flight.context.run(_send, flight.steps, answer)
        except StopIteration:
            self._end(flight, None)
            return
        except Exception as exc:
            self._end(flight, exc)
            return
        finally:
            if flush is not None:
                flush.stop()
        with self._lock:
            self._waiting.append(_Waiting(flight, store))

    def _behind(self, began: float) -> Callable[[Once], float | None]:
        """What the pulse thread does behind a handler that runs on: flush at FLUSH_AFTER, then give
        back the starts held once the round, begun at ``began`` (monotonic), has run RELEASE_AFTER.

        The round's time, not the handler's: a start held behind several handlers of most
        of a second each waits for no more than that either."""

        def due(_: Once) -> float | None:
            if time.monotonic() - began < RELEASE_AFTER:
                self.flush()
                return began + RELEASE_AFTER if self._stored or self._waiting else None
            self.flush(give_back=True)
            return None

        return due

    def _end(self, flight: Flight, exc: BaseException | None) -> None:
        self._flights.remove(flight)
        self._note()
        self.finished(flight, exc)

    def _note(self) -> None:
        if self.noted is not None:
            self.noted(list(self._flights))


def _running(waiting: _Waiting, answer: Decision | Exception) -> StepMessage | None:
    """The step whose start ``answer`` stored for ``waiting``'s delivery to run, if it stored one."""
    if not isinstance(answer, Decision) or answer.ignored:
        return None
    active = answer.task.active
    if active is None or active.phase is not Phase.RUNNING:
        return None  # a next step kept here with its start to be written with its outcome, say
    if isinstance(waiting.store.change.event, Started):
        return waiting.flight.message
    return answer.kept  # an outcome that started the flow's next step here


def _given_back(message: StepMessage, known: Task | None, running: bool) -> Change:
    return Change(message.task_id, Released(message.seq, running=running), known=known, worker=worker_name())


def _kept_queued(answer: Decision | Exception | None) -> StepMessage | None:
    """The next step ``answer`` kept here without storing its start: nothing of it is stored as running."""
    if not isinstance(answer, Decision) or answer.kept is None:
        return None
    active = answer.task.active
    return answer.kept if active is not None and active.phase is Phase.QUEUED else None


class _HandedOn(Exception):
    """In place of a delivery's answer: its next step was handed on (:meth:`GroupCommit.flush`), it ends here."""


_HANDED_ON = _HandedOn()


def _send(steps: Generator[Store, Decision, None], answer: Decision | Exception | None) -> Store:
    if answer is None:
        return next(steps)
    if isinstance(answer, Exception):
        return steps.throw(answer)
    return steps.send(answer)
