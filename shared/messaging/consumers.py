"""A worker of our own: consumer processes on kombu under a supervising process.

`asyncflow worker` (`--pool kombu`, the default). Celery's worker (`--pool
celery`) receives each message in its main process and hands it to a pool
process and the result back, which costs about 1.4 times the CPU per flow of
this pool (benchmarks/README.md, "The kombu pool"). Here each consumer
process takes its messages from the broker itself and runs their steps; the
main process only supervises:

- it forks ``concurrency`` consumer processes and starts another when one dies;
- a consumer process notes each step it runs (:class:`RunningSteps`), so when
  one dies the main process records that attempt as lost at once, as Celery's
  does for a pool process; and it kills one whose handler runs past its hard
  time limit (stuck where no signal reaches), or whose delivery does;
- on SIGTERM the consumer processes stop taking messages and finish what they
  run; after the shutdown grace the main process kills those still running and
  records their attempts as lost, so they run again elsewhere at once.

The messages are Celery's (protocol 2, as :class:`CeleryPublisher` sends them):
a Celery worker can consume the same queues. A consumer process holds up to
``worker_prefetch`` deliveries (8 by default), their transitions committed
together (:class:`GroupedStepMessages`), and hands them on behind a long step;
at 1 it takes one message at a time (:class:`StepMessages`), delivery
priorities honoured at each take. When a consumer process dies,
RabbitMQ and Redis deliver its message again (dropped as stale if its attempt
was recorded); the embedded broker keeps it hidden, and the scheduler's sweep
publishes the step again.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from queue import Empty
from typing import Any

import billiard
import orjson
from celery.utils.log import LoggingProxy
from kombu.connection import Connection
from kombu.entity import Queue
from kombu.mixins import ConsumerMixin

from shared.consumer import PULSES, Once, StepConsumer
from shared.group_commit import RELEASE_AFTER, Flight, GroupCommit
from shared.logs import AttemptFields, attempt_context
from shared.messaging import ALARM_TASK, JSON, LIMIT_MARGIN, STEP_TASK
from shared.messaging.embedded import wake_for_stop
from shared.messaging.running import RunningSteps
from shared.presence import attempt_in_flight, oldest_first
from shared.records import evolve
from shared.retry import reconnect_delay
from shared.storage import StorageUnavailable
from shared.storage.codec import orjson_reads_as_json_does
from shared.task import Alarm, StepMessage

log = logging.getLogger(__name__)
# What a handler prints, as log lines (Celery's pool processes do the same).
printed = logging.getLogger("printed")

# How often the main process looks for dead and overdue consumer processes.
SUPERVISE_EVERY = 0.2
# An alarm the command could not deliver is tried this many times more.
ALARM_RETRIES = 5
# A consumer process that dies sooner than this after its start is started again
# only after a pause, doubling up to RESTART_AT_MOST: a module that crashes every
# process at once does not make the worker fork in a loop.
STARTED_WELL_AFTER, RESTART_AT_MOST = 5.0, 30.0


class StepMessages(ConsumerMixin):
    """One consumer process: takes a message at a time and runs it (kombu's consume loop, reconnecting)."""

    def __init__(
        self,
        connection: Connection,  # not connected yet: kombu connects in the consumer process
        queues: list[Queue],
        consumer: StepConsumer,
        running: RunningSteps,
    ) -> None:
        self.connection = connection
        self.queues = queues
        self.consumer = consumer
        self.running = running
        self.continues = consumer.settings.continue_within > 0
        self.stopping = threading.Event()
        self.parent = os.getppid()  # made in the consumer process

    def on_iteration(self) -> None:  # kombu's loop, before each wait of at most a second
        self._orphaned()

    def _orphaned(self) -> bool:
        if os.getppid() == self.parent:
            return False
        # The main process died (SIGKILL, the out-of-memory killer): nobody would report
        # this process's attempts, and the worker started again has consumers of its own.
        if not self.should_stop:
            log.warning("the worker's main process is gone: this consumer process stops")
            self.stop()
        return True

    def stop(self) -> None:
        """Take no more messages; the one running ends first (safe in a signal handler)."""
        self.should_stop = True  # kombu's loop checks it between messages
        self.stopping.set()  # cuts a retry's pause short
        wake_for_stop()

    prefetch = 1

    def get_consumers(self, consumer: Callable[..., Any], channel: Any) -> list[Any]:
        made = consumer(self.queues, on_message=self.on_delivery, accept=["json"])
        # For the channel, not for each queue: RabbitMQ gives each consumer its own window, and
        # kombu makes one per queue, so a process serving two modules held a message of each
        # (the second waiting behind a long step of the first).
        made.qos(prefetch_count=self.prefetch, apply_global=True)
        version = (getattr(getattr(channel, "connection", None), "server_properties", None) or {}).get("version")
        if isinstance(version, str) and _release(version) >= (4, 3):
            log.warning(
                "RabbitMQ %s makes a channel's prefetch each consumer's unless deprecated_features.permit.global_qos"
                " is true: a consumer process serving several queues may hold a message of each",
                version,
            )
        return [made]

    def on_delivery(self, message: Any) -> None:
        """A message as kombu receives it, its body not decoded yet."""
        try:
            body = decoded(message)
        except Exception as exc:
            log.error("unreadable message dropped: %s", exc)  # as kombu drops one it cannot decode
            message.ack()
            return
        self.on_message(body, message)

    def on_message(self, body: Any, message: Any) -> None:
        if self._orphaned():
            message.requeue()  # for a consumer with a main process
            return
        task = message.headers.get("task")
        try:
            args, _kwargs, _embed = body  # Celery's message protocol 2
            if task == STEP_TASK:
                step: StepMessage | Alarm = StepMessage.from_payload(args[0])
            elif task == ALARM_TASK:
                step = Alarm(**args[0])
            else:
                raise ValueError(f"task {task!r} is neither a step nor an alarm")
        except Exception as exc:
            # Taken again, it would fail again (and a raise here would end the process, which
            # the next one would repeat): a message no worker can read is dropped.
            log.error("unreadable message dropped: %s", exc)
            message.ack()
            return
        if isinstance(step, Alarm):
            self._alarm(step, message)
        else:
            self._step(step, message)

    def _step(self, step: StepMessage, message: Any) -> None:
        hard, soft = message.headers.get("timelimit") or (None, None)
        delivery = str(message.headers.get("id") or message.delivery_tag)
        tries = 0
        with attempt_context(AttemptFields.of(step)):
            while True:
                # Next steps may run in this delivery while they end before its soft limit.
                until = time.monotonic() + soft - LIMIT_MARGIN if self.continues and soft else None
                self.running.deliver(delivery, step, hard)
                try:
                    self.consumer.handle(
                        step,
                        continue_until=until,
                        on_next=lambda later: self.running.begin(delivery, later, ran_on=True),
                    )
                    break
                except StorageUnavailable as exc:
                    # Nothing ran (the start could not be recorded): the message is kept and tried again.
                    delay = reconnect_delay(tries)
                    tries += 1
                    log.warning("database unavailable, step message retried in %gs: %s", delay, exc)
                    if self.stopping.wait(delay):
                        return  # unacknowledged: the broker delivers it again once this process is gone
                except Exception:
                    # What a step raises is recorded by the consumer; this is its store failing past its
                    # patience: the sweeps take the attempt over, as after a Celery task that raised.
                    log.exception("step message failed")
                    break
                finally:
                    self.running.finish()
        message.ack()

    def _alarm(self, alarm: Alarm, message: Any) -> None:
        command = self.consumer.settings.alert_command
        for tries in range(ALARM_RETRIES + 1):
            try:
                self.consumer.alarm(alarm, command)
                break
            except Exception:
                if tries == ALARM_RETRIES:
                    log.exception("alarm not delivered after %d tries", tries + 1)
                elif self.stopping.wait(reconnect_delay(tries)):
                    return
        self._ack(message)

    def _ack(self, message: Any) -> None:
        message.ack()


class GroupedStepMessages(StepMessages):
    """A consumer process holding up to ``prefetch`` deliveries, their transitions committed together.

    ``worker_prefetch`` above 1 (:mod:`shared.group_commit`). Their handlers run
    one at a time on this thread, so a step that runs long would hold back what
    this process holds. Once a round has run for GIVE_BACK_AFTER, the pulse
    thread takes the broker's connection, which this thread uses only between
    rounds (every read, acknowledgement and rejection is under ``_io``), and
    gives back what nothing is stored of: the deliveries read but not started
    yet, and those the broker sends meanwhile (RabbitMQ's, as the consumer is
    cancelled until the round ends; on Redis, the message a BRPOP left in flight
    pops). Other consumers take them at once. What the long round has started
    is handed on by :meth:`GroupCommit.flush`: outcomes waiting are committed and
    their next steps published, and once the round has run RELEASE_AFTER the
    starts held in it are given back as new messages; their deliveries end unrun
    once the long step has. After a round that long, the process takes one
    message at a time until ``prefetch`` rounds in a row are quick.
    """

    def __init__(
        self, connection: Connection, queues: list[Queue], consumer: StepConsumer, running: RunningSteps, prefetch: int
    ) -> None:
        super().__init__(connection, queues, consumer, running)
        self.prefetch = prefetch
        self.group = GroupCommit(consumer, self._finished, self._held)
        self._later: list[tuple[float, Delivery]] = []  # deliveries whose start could not be stored, and when to retry
        self._io = threading.Lock()  # the broker's connection: this thread between rounds, the pulse thread in one
        # Read from the broker, not started yet, each with what starts it; under _io.
        self._taken: list[tuple[Any, Callable[[], None]]] = []
        self._consumers: list[Any] = []
        self._cancelled = False  # the consumers were cancelled behind a long round: consume again after it
        self._broken: BaseException | None = None  # giving back failed on the connection: it is made again
        # After a round as long as RELEASE_AFTER the window is one message until ``prefetch`` rounds
        # in a row are quick: steps that run for seconds gain nothing from being held together,
        # and would otherwise be taken, started and given back round after round (a long step's
        # flow may go on quickly in the round after it, so one quick round is not enough).
        self._quick_rounds = prefetch
        self._window = prefetch

    def consume(self, limit: Any = None, timeout: Any = None, safety_interval: float = 1, **kwargs: Any) -> Any:
        """kombu's loop, in rounds: the deliveries held go on, then the broker is read, without waiting while any is held."""
        # What was read on a connection lost since is delivered again; the consumers made
        # next may be sent messages before they are handed over.
        self._taken, self._cancelled, self._broken = [], False, None
        self._window = self.prefetch  # as get_consumers sets it
        with self.consumer_context(**kwargs) as (conn, _channel, consumers):
            self._consumers = consumers
            while not self.should_stop or len(self.group):
                self.on_iteration()
                self._round()
                if self.should_stop:
                    continue  # finishing what is held; what the broker sends now is handed back
                wait = 0.0 if len(self.group) else self._idle_wait(safety_interval)
                if self._broken is not None:
                    raise self._broken  # one of the transport's connection errors: kombu's loop connects again
                with self._io:
                    try:
                        window = self.prefetch if self._quick_rounds >= self.prefetch else 1
                        if window != self._window:
                            self._window = window
                            for each in consumers:
                                each.qos(prefetch_count=window, apply_global=True)
                        if self._cancelled:
                            self._cancelled = False
                            for each in consumers:
                                each.consume()
                        conn.drain_events(timeout=wait)
                        for _ in range(self.prefetch - 1):  # what else has come, into the same round
                            conn.drain_events(timeout=0)
                    except TimeoutError:
                        pass
                    except OSError:
                        if not self.should_stop:
                            raise
                    conn.heartbeat_check()  # the broker's heartbeats, busy or not (a clock read when none is due)
                yield

    def _round(self) -> None:
        """Start what was read, and let the deliveries held go on: their handlers run here."""
        if not (len(self.group) or self._taken or self._later):
            return
        began = time.monotonic()
        behind = Once(self.give_back, GIVE_BACK_AFTER)
        PULSES.add(behind, began + GIVE_BACK_AFTER)
        try:
            self._retry_due()
            while True:
                with self._io:
                    if not self._taken or self._broken is not None:
                        break  # on a connection to be dropped, what it delivered goes back to the queue
                    message, start = self._taken.pop(0)
                    if self.should_stop:
                        self._requeue(message)
                        continue
                start()
            self.group.work()
        finally:
            behind.stop()
            long_round = time.monotonic() - began >= RELEASE_AFTER
            self._quick_rounds = 0 if long_round else min(self._quick_rounds + 1, self.prefetch)

    def give_back(self, behind: Once) -> float | None:
        """The pulse thread, a round having run long: what nothing is stored of goes back to the broker.

        None once done; else when to look again (monotonic): this thread was
        using the connection (the round may be just over), or Redis's BRPOP in
        flight has not answered yet. Outcomes waiting behind a long handler are
        :meth:`GroupCommit.flush`'s.
        """
        if not self._io.acquire(blocking=False):
            return time.monotonic() + GIVE_BACK_AGAIN
        try:
            if behind.stopped:
                return None
            done = self._hold_back()
            taken, self._taken = self._taken, []
            for message, _start in taken:
                message.reject(requeue=True)
            if taken:
                log.info("%d step message(s) given back behind a long step", len(taken))
            return None if done else time.monotonic() + GIVE_BACK_AFTER
        except (*self.connection.connection_errors, *self.connection.channel_errors) as lost:
            # A cancel unanswered may leave the consumer neither cancelled nor consuming: the
            # connection is dropped and made again, and what it delivered goes back to the queue.
            log.warning("could not give back the step messages held behind a long step: %s", lost)
            self._broken = lost
            return None
        finally:
            self._io.release()

    def _hold_back(self) -> bool:
        """What the broker sends this process until the round ends comes into ``_taken`` now (under ``_io``).

        False while Redis's BRPOP in flight has not answered: not waited for here.
        """
        driver = self.connection.transport.driver_type
        if driver == "amqp" and not self._cancelled:
            self._cancelled = True  # consuming again after the round
            # Within a bound: a broker gone silent must not hold the pulse thread, which beats for every attempt here.
            with self.connection.connection.transport.having_timeout(CANCEL_WITHIN):
                for each in self._consumers:
                    each.cancel()  # what was sent before the cancel's answer is read on the way
        elif driver == "redis":
            # kombu's Redis channel leaves a BRPOP in flight between reads; a message it pops is
            # this process's. It answers within its timeout (a second), and no other is sent
            # until the next read: its answer is read once it has come.
            channel = self._consumers[0].channel if self._consumers else None
            if channel is not None and getattr(channel, "_in_poll", None):
                if not channel.client.connection.can_read(timeout=0):
                    return False
                try:
                    channel._brpop_read()
                except Empty:
                    pass
        return True

    def _step(self, step: StepMessage, message: Any) -> None:
        """Read from the broker (under ``_io``): started in the next round."""
        hard, _soft = message.headers.get("timelimit") or (None, None)
        delivery = Delivery(message, step, str(message.headers.get("id") or message.delivery_tag), hard)
        self._taken.append((message, functools.partial(self._start, delivery)))

    def _alarm(self, alarm: Alarm, message: Any) -> None:
        """Read from the broker (under ``_io``): delivered in the next round, on this thread."""
        # Its command runs on this thread, beside the deliveries held: what waits for a commit is
        # handed on should it run long (a monitor that does not answer, tried again with pauses).
        deliver = functools.partial(super()._alarm, alarm, message)
        self._taken.append((message, functools.partial(self.group.beside, deliver)))

    def _ack(self, message: Any) -> None:
        with self._io:
            message.ack()

    def _requeue(self, message: Any) -> None:
        """For another consumer, as this process stops (under ``_io``)."""
        try:
            message.requeue()
        except (*self.connection.connection_errors, *self.connection.channel_errors) as lost:
            log.warning("step message not handed back, its connection is gone: %s", lost)

    def _start(self, delivery: Delivery) -> None:
        soft = (delivery.message.headers.get("timelimit") or (None, None))[1]
        # Next steps may run in this delivery while they end before its soft limit.
        until = time.monotonic() + soft - LIMIT_MARGIN if self.continues and soft else None
        with attempt_context(AttemptFields.of(delivery.step)):  # copied into the delivery's own context
            self.group.start(delivery, delivery.step, continue_until=until)

    def _finished(self, flight: Flight, exc: BaseException | None) -> None:
        delivery: Delivery = flight.key
        if isinstance(exc, StorageUnavailable):
            # Nothing ran (the start could not be recorded): the message is kept and tried again.
            delay = reconnect_delay(delivery.tries)
            log.warning("database unavailable, step message retried in %gs: %s", delay, exc)
            self._later.append((time.monotonic() + delay, evolve(delivery, tries=delivery.tries + 1)))
            return
        if exc is not None:
            # What a step raises is recorded by the consumer; this is its store failing past its
            # patience: the sweeps take the attempt over, as after a Celery task that raised.
            log.error("step message failed", exc_info=exc, extra={"task_id": flight.message.task_id})
        try:
            self._ack(delivery.message)
        except (*self.connection.connection_errors, *self.connection.channel_errors) as lost:
            # Taken on a connection since lost: the broker delivers it again, and it is dropped as stale.
            log.warning("step message not acknowledged, its connection is gone: %s", lost)

    def _held(self, flights: list[Flight]) -> None:
        if not flights:
            self.running.finish()
            return
        first = flights[0]
        limits = [f.key.hard for f in flights if f.key.hard]
        self.running.hold(first.key.delivery, first.message, [f.message for f in flights[1:]], max(limits, default=None))

    def _retry_due(self) -> None:
        if self.should_stop:
            self._later = []  # unacknowledged: the broker delivers them again once this process is gone
            return
        now = time.monotonic()
        due = [delivery for at, delivery in self._later if at <= now]
        if due:
            self._later = [(at, delivery) for at, delivery in self._later if at > now]
            for delivery in due:
                self._start(delivery)

    def _idle_wait(self, longest: float) -> float:
        if not self._later:
            return longest
        return max(0.0, min(longest, min(at for at, _ in self._later) - time.monotonic()))


# A round of a consumer process holding several deliveries gives back what it has not
# started once it has run this long: about the wait of an outcome behind a long handler
# (shared.group_commit.FLUSH_AFTER).
GIVE_BACK_AFTER = 0.05
# The pulse thread found the connection in use (a round just ended, say): it looks again this soon.
GIVE_BACK_AGAIN = 0.005
# RabbitMQ answers a consumer's cancel within this, or its connection counts as lost.
CANCEL_WITHIN = 5.0


def _release(version: str) -> tuple[int, ...]:
    """``"4.3.1"`` as (4, 3, 1); what is not a number ends it."""
    numbers = []
    for part in version.split("."):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)


@dataclass(frozen=True)
class Delivery:
    """A message a consumer process holds, and how often its start could not be stored."""

    message: Any  # kombu's
    step: StepMessage
    delivery: str  # its id, as the worker's note names it
    hard: float | None  # its hard time limit, in seconds (the message's header)
    tries: int = 0


def decoded(message: Any) -> Any:
    """The body of ``message``: JSON in UTF-8, as every publisher of these queues sends it, by orjson.

    kombu's json serializer takes five times the CPU, and the first step's message
    carries the task's row. Anything else goes to kombu, which refuses what the
    consumer does not accept: another content type or encoding, a compressed body,
    and a body with a run of 19 digits or more, which may be an integer past 64 bits
    (a parameter may hold one): orjson would read it as a float, json reads it whole.
    """
    body = message.body
    if (
        message.content_type == JSON
        and message.content_encoding in ("utf-8", None)
        and "compression" not in message.headers
        and orjson_reads_as_json_does(body if isinstance(body, bytes) else body.encode())
    ):
        return orjson.loads(body)
    return message.decode()


class ConsumerPool:
    """The worker's main process: forks the consumer processes and answers for them."""

    def __init__(
        self,
        make: Callable[[], StepMessages],
        consumer: StepConsumer,
        running: RunningSteps,
        concurrency: int,
        grace: float,
        stopping: threading.Event,
    ) -> None:
        self.make = make
        self.consumer = consumer
        self.running = running
        self.concurrency = concurrency
        self.grace = grace
        self.stopping = stopping  # set by the worker's SIGTERM and SIGINT handlers
        self.children: dict[int, Child] = {}  # by pid
        # Why the main process killed a consumer process, and whether that is a timeout.
        self._killed: dict[int, tuple[str, bool]] = {}
        self._pause = 1.0
        self._next_start = 0.0

    def run(self) -> None:
        """Until ``stopping`` is set, then the bounded stop."""
        while not self.stopping.is_set():
            self._reap()
            self._kill_overdue()
            self._start_missing()
            self.stopping.wait(SUPERVISE_EVERY)
        self._stop()

    def in_flight(self) -> list[dict[str, Any]]:
        """The attempts the consumer processes run now, for the worker's registry row."""
        notes = {pid: self.running.note_of(pid) for pid in list(self.children)}
        return oldest_first(
            [
                attempt_in_flight(payload, n.get("started"), pid)
                for pid, n in notes.items()
                if "message" in n
                for payload in [n["message"], *n.get("others", [])]
            ]
        )

    # --- consumer processes ----------------------------------------------------------

    def _start_missing(self) -> None:
        now = time.monotonic()
        while len(self.children) < self.concurrency and now >= self._next_start:
            # billiard's process, as Celery's pool forks them: in the child it runs the
            # after-fork hooks that drop Celery's and kombu's broker connections of this
            # process (a plain os.fork would share their sockets).
            process = billiard.Process(target=self._serve, name="asyncflow-consumer")
            process.start()
            self.children[process.pid] = Child(process, now)

    def _serve(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the main process stops us
        sys.stdout = sys.stderr = LoggingProxy(printed, logging.WARNING)
        stop = threading.Event()  # a SIGTERM before the consumer exists
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        if self.stopping.is_set():
            # A SIGTERM between the fork and the line above went to the handler this process
            # inherited, which set only its own copy of the main process's event.
            stop.set()
        try:
            messages = self.make()
            signal.signal(signal.SIGTERM, lambda *_: messages.stop())
            if not stop.is_set():
                with messages.connection:
                    messages.run()  # type: ignore[no-untyped-call]  # kombu is untyped
        except Exception:
            log.exception("consumer process failed")
            sys.exit(1)

    def _reap(self) -> None:
        for pid, child in list(self.children.items()):
            code = child.process.exitcode
            if code is None:
                continue
            del self.children[pid]
            killed = self._killed.pop(pid, None)
            if killed is not None or code != 0 or not self.stopping.is_set():
                self._report(pid, *(killed or (f"worker process lost: {_died(code)}", False)))
                if time.monotonic() - child.started < STARTED_WELL_AFTER:
                    self._next_start = time.monotonic() + self._pause
                    self._pause = min(self._pause * 2, RESTART_AT_MOST)
                else:
                    self._pause = 1.0
            self.running.forget(pid)

    def _report(self, pid: int, reason: str, timed_out: bool) -> None:
        """Record the attempts a dead consumer process held as lost; nothing if it held none."""
        note = self.running.note_of(pid)
        if "message" not in note:
            log.warning("consumer process %d ended between steps: %s", pid, reason)
            return
        if note.get("killed"):  # by its own hard time limit (RunningSteps.call)
            reason, timed_out = note["killed"], True
        running = note.get("running")  # in a process holding several: the task whose handler ran
        for payload in [note["message"], *note.get("others", [])]:
            step = StepMessage.from_payload(payload)
            why, timeout = reason, timed_out
            if running is not None and running != step.task_id:  # it waited for its turn, or a commit
                why, timeout = f"worker process lost while it ran another step: {reason}", False
            with attempt_context(AttemptFields.of(step)):
                log.error("consumer process %d ended during a step: %s", pid, why)
                try:
                    self.consumer.lost(step, why, timed_out=timeout)
                except Exception:  # the sweep (not this hook) is the safety net
                    log.exception("could not record a lost step attempt")

    def _kill_overdue(self) -> None:
        now = time.time()
        for pid in list(self.children):
            if pid in self._killed:
                continue
            note = self.running.note_of(pid)
            deadline = note.get("deadline")
            if deadline is not None and now > deadline:
                self._killed[pid] = (f"killed after the hard time limit of {note['limit']:g}s", True)
                _signal(pid, signal.SIGKILL)

    def _stop(self) -> None:
        """Let running attempts end for ``grace`` seconds, then give up on those still running."""
        for pid in self.children:
            _signal(pid, signal.SIGTERM)
        busy = sum("message" in self.running.note_of(pid) for pid in self.children)
        log.info("stopping: waiting up to %gs for %d attempt(s)", self.grace, busy)
        deadline = time.monotonic() + self.grace
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        stuck = list(self.children)
        if not stuck:
            return
        for pid in stuck:
            self._killed[pid] = (f"worker stopped; attempt unfinished after {self.grace:g}s", False)
            _signal(pid, signal.SIGKILL)
        for child in self.children.values():
            child.process.join()  # killed: ends at once
        self._reap()
        log.warning("shutdown grace over: %d attempt(s) given up, stopping now", len(stuck))


@dataclass(frozen=True)
class Child:
    process: Any  # billiard.Process
    started: float  # monotonic


def _died(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it ended meanwhile
