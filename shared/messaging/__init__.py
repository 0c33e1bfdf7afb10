"""Celery on kombu: one queue per module, one generic step task.

:func:`make_celery` builds the app (no global app at import); :class:`CeleryPublisher`
sends step messages and alarms; :class:`StepRequest` turns a hard time limit or
a killed pool process into a failed attempt.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import nullcontext
from typing import Any

from billiard.exceptions import WorkerLostError
from celery import Celery, Task
from celery.worker.request import Request
from kombu.entity import PERSISTENT_DELIVERY_MODE, TRANSIENT_DELIVERY_MODE
from kombu.utils.uuid import uuid

from shared.config import Settings
from shared.consumer import StepConsumer
from shared.logs import AttemptFields, attempt_context, name_message
from shared.messaging.celery_logs import attempt_fields, follow_attempts, keep_process_logging
from shared.messaging.embedded import kombu_url, wake_for_stop
from shared.messaging.kept import KeptConnection
from shared.messaging.running import RunningSteps
from shared.records import evolve
from shared.retry import reconnect_delay
from shared.service import publish_each
from shared.storage import StorageUnavailable
from shared.storage.codec import json_text
from shared.task import Alarm, StepMessage

log = logging.getLogger(__name__)

STEP_TASK = "asyncflow.step"
# Every message's content type, as Celery's json serializer names it.
JSON = "application/json"
ALARM_TASK = "asyncflow.alarm"
QUEUE_PREFIX = "asyncflow."


def queue_name(module: str) -> str:
    return QUEUE_PREFIX + module


class StepRequest(Request):  # type: ignore[misc]  # celery is untyped: Request is Any
    """Reports attempts that never returned: killed by the hard time limit or lost."""

    # Set by serve_steps on the subclass it registers.
    consumer: StepConsumer
    running: RunningSteps
    # Set by the shutdown grace before it kills the process: the grace reports the attempt, not on_failure.
    given_up = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Celery logs "Task ... received" right after building the request: naming
        # the message lets that line carry the attempt's fields (shared.messaging.celery_logs).
        self.log_fields = attempt_fields(self.args)
        if self.log_fields is not None:
            name_message(self.id, self.log_fields)

    def running_step(self) -> tuple[StepMessage, str | None]:
        """The step its pool process ran last, the delivered one or a later one, and why it killed itself."""
        return self.running.step_of(self.id, self.worker_pid, StepMessage.from_payload(self.args[0]))

    def on_timeout(self, soft: bool, timeout: float) -> None:
        step, _ = self.running_step()
        with attempt_context(AttemptFields.of(step)):
            super().on_timeout(soft, timeout)
            if not soft:
                self._report_lost(step, f"killed after the hard time limit of {timeout:g}s", timed_out=True)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = exc_info.exception
        exc = getattr(exc, "exc", exc)  # billiard wraps it in ExceptionWithTraceback
        if not isinstance(exc, WorkerLostError):
            with attempt_context(self.log_fields):
                super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
            return
        step, killed = self.running_step()
        with attempt_context(AttemptFields.of(step)):
            super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
            if self.given_up:  # killed by the shutdown grace, which reports it
                return
            if killed:  # by its own hard time limit (RunningSteps.call)
                self._report_lost(step, killed, timed_out=True)
            else:
                self._report_lost(step, f"worker process lost: {exc}")

    def _report_lost(self, step: StepMessage, reason: str, timed_out: bool = False) -> None:
        try:
            self.consumer.lost(step, reason, timed_out=timed_out)
        except Exception:  # the sweep (not this hook) is the safety net
            log.exception("could not record a lost step attempt")


# Delivery priorities 0-9. RabbitMQ queues are declared with this maximum; the Redis
# transport keeps one list per level. The SQL transport of the embedded default
# has no priorities: its queues stay first in, first out.
MAX_PRIORITY = 9


def delivery_priority(message: StepMessage) -> int:
    """How soon a message is delivered, 0-9 (9 first).

    A flow under way goes before flows not yet started, so in a burst a started
    flow finishes instead of waiting behind the first steps of every later one;
    within each half, the task's priority orders delivery.
    """
    p = message.priority
    band = 0 if p < 0 else 1 if p == 0 else 2 if p < 10 else 3 if p < 100 else 4
    return band + (5 if message.continues else 0)


def make_celery(settings: Settings) -> Celery:
    """The app that publishes; a worker adds its tasks with :func:`serve_steps`."""
    url = settings.resolved_broker_url()
    app = Celery("asyncflow", broker=kombu_url(url), set_as_current=False)
    conf: dict[str, Any] = dict(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        # A killed pool process is reported as a failed attempt by StepRequest,
        # so its message is acknowledged rather than re-queued in a loop.
        task_reject_on_worker_lost=False,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=4,
        # Results are not used, so a killed pool process need not be waited on long.
        worker_lost_wait=1.0,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_default_queue=queue_name("default"),
        worker_send_task_events=False,
        # Fail a publish within seconds when the broker is down: the task is safe
        # in the database and the scheduler publishes it again.
        broker_connection_timeout=2.0,
        task_publish_retry_policy={
            "max_retries": 2, "interval_start": 0, "interval_step": 0.25, "interval_max": 0.5,
        },
        # Consumers wait for the broker forever instead of exiting after 100 tries.
        broker_connection_max_retries=None,
    )
    kind = settings.broker_kind()
    if kind == "embedded":
        conf["broker_transport_options"] = {"polling_interval": settings.embedded_poll_interval}
        # The SQL transport has no fanout: remote control would only poll in vain.
        conf["worker_enable_remote_control"] = False
    elif kind == "rabbitmq":
        # Publisher confirms: a publish returns only once RabbitMQ has the message.
        conf["broker_transport_options"] = {"confirm_publish": True}
        conf["task_queue_max_priority"] = MAX_PRIORITY
    elif kind == "redis":
        # One list per level, the highest level read first.
        conf["broker_transport_options"] = {
            "priority_steps": list(range(MAX_PRIORITY + 1)),
            "sep": ":",
            "queue_order_strategy": "priority",
        }
    app.conf.update(conf)
    return app


def step_delivery_mode(settings: Settings) -> int:
    """How RabbitMQ keeps step messages: in memory unless ``persistent_messages``.

    The database, not the broker, holds each step (SPEC §4), and the requeue sweep
    publishes again what a broker lost. Anything else (an alarm, which nothing
    publishes again) goes persistent, Celery's default.
    """
    return PERSISTENT_DELIVERY_MODE if settings.persistent_messages else TRANSIENT_DELIVERY_MODE


# Seconds a delivery keeps clear of its soft limit when it runs further steps.
LIMIT_MARGIN = 0.5


def serve_steps(app: Celery, consumer: StepConsumer, running: RunningSteps) -> None:
    """Register the step and alarm tasks of a worker process, run by ``consumer``.

    ``running`` is the consumer's ``invoke``: it keeps each attempt's time limits.
    """
    request = type("BoundStepRequest", (StepRequest,), {"consumer": consumer, "running": running})
    alert_command = consumer.settings.alert_command
    keep_process_logging()
    follow_attempts(STEP_TASK)  # run_step's lines and Celery's about it carry the attempt's fields

    continues = consumer.settings.continue_within > 0

    @app.task(name=STEP_TASK, bind=True, Request=request, shared=False)  # type: ignore[untyped-decorator]
    def run_step(self: Task, payload: dict[str, Any]) -> None:
        # Next steps may run in this delivery while they end before its soft limit
        # (CeleryPublisher sets it), a little early: the pool started the clock first.
        soft_limit = (self.request.timelimit or (None, None))[1]
        until = time.monotonic() + soft_limit - LIMIT_MARGIN if continues and soft_limit else None
        message = StepMessage.from_payload(payload)
        running.begin(self.request.id, message, ran_on=False)
        try:
            consumer.handle(
                message,
                continue_until=until,
                on_next=lambda step: running.begin(self.request.id, step, ran_on=True),
            )
        except StorageUnavailable as exc:
            # Nothing ran yet (the start could not be recorded). Keep the message:
            # a delayed copy goes back on the queue before this one is acknowledged.
            countdown = reconnect_delay(self.request.retries)
            log.warning("database unavailable, step message retried in %gs: %s", countdown, exc)
            raise self.retry(exc=exc, countdown=countdown, max_retries=None) from exc

    @app.task(name=ALARM_TASK, bind=True, max_retries=5, shared=False)  # type: ignore[untyped-decorator]
    def deliver_alarm(self: Task, payload: dict[str, Any]) -> None:
        try:
            consumer.alarm(Alarm(**payload), alert_command)
        except Exception as exc:
            raise self.retry(exc=exc, countdown=reconnect_delay(self.request.retries)) from exc


def bound_shutdown(app: Celery, consumer: StepConsumer, grace: float) -> None:
    """On SIGTERM, let in-flight attempts finish for ``grace`` seconds, then give up on them.

    Celery's warm shutdown waits for every running task, which for a step with
    a 30-minute timeout means 30 minutes. After ``grace`` the pool processes still
    running attempts are killed, the attempts recorded as lost, so they run again
    elsewhere at once instead of expiring later, and the worker is stopped cold.
    """
    from celery.signals import worker_shutting_down
    from celery.worker import state

    worker_shutting_down.connect(
        grace_then_stop(consumer, grace, lambda: snapshot(state.active_requests), kill_processes, stop_cold),
        weak=False,
    )


def snapshot(requests: Collection[Any]) -> list[Any]:
    """The members of a collection the main thread changes meanwhile (Celery's active requests)."""
    while True:
        try:
            return list(requests)
        except RuntimeError:  # changed size during the copy: copy again
            continue


def kill_processes(pids: Iterable[int | None]) -> None:
    for pid in pids:
        if pid is None:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended meanwhile


# How long a cold shutdown may take before the worker exits regardless.
COLD_STOP_DEADLINE = 10.0


def stop_cold() -> None:
    """Stop the worker cold (SIGQUIT), and exit should that still hang after ``COLD_STOP_DEADLINE``.

    The given-up attempts' processes are killed before, not left to Celery's cold
    shutdown, which asks them to end (SIGTERM) and then waits for the whole pool:
    with Celery 5.7 that wait has lasted until the stuck attempt's hard time limit.
    The last-resort exit comes after the attempts are recorded. A message left
    unacknowledged is delivered again by RabbitMQ or Redis (as after SIGKILL) and
    dropped as stale; the embedded broker keeps it hidden, and the scheduler's
    sweep publishes the step again.
    """
    import billiard.process

    def exit_now() -> None:
        try:
            # Not through logging: a handler lock held by the stuck thread would hang the exit.
            os.write(2, b"worker still running %gs after its cold shutdown began; exiting now\n" % COLD_STOP_DEADLINE)
            kill_processes(child.pid for child in billiard.process.active_children())
        finally:
            os._exit(1)

    deadline = threading.Timer(COLD_STOP_DEADLINE, exit_now)
    deadline.daemon = True
    deadline.start()
    os.kill(os.getpid(), signal.SIGQUIT)


def grace_then_stop(
    consumer: StepConsumer,
    grace: float,
    running: Callable[[], list[Any]],
    kill: Callable[[Iterable[int | None]], None],
    stop: Callable[[], None],
) -> Callable[..., None]:
    """The shutdown handler of :func:`bound_shutdown`.

    ``running`` lists the active requests, ``kill`` kills pool processes, ``stop``
    ends the worker. The timer starts whatever runs at the signal: a pool process
    may already run an attempt whose start the main process has not heard of yet
    (Celery counts a request active once the pool's acknowledgement is read), and
    a worker with nothing left to wait for exits before the timer, taking it along.
    The handler acts once: Celery sends the shutdown signal again for the cold
    shutdown that ``stop`` begins.
    """
    started = threading.Event()

    def give_up() -> None:
        steps = [r for r in running() if isinstance(r, StepRequest)]  # an alarm is retried by the broker
        try:
            for request in steps:
                request.given_up = True
            # Killed first: a process that ran on to a later step meanwhile has noted it, and
            # the note is final once the process is dead; nor does a copy start elsewhere
            # while the handler still runs.
            kill(request.worker_pid for request in steps)
            for request in steps:
                step, _ = request.running_step()
                with attempt_context(AttemptFields.of(step)):
                    try:
                        consumer.lost(step, f"worker stopped; attempt unfinished after {grace:g}s")
                    except Exception:  # the expiry sweep (not this hook) is the safety net
                        log.exception("could not record a given-up step attempt")
            log.warning("shutdown grace over: %d attempt(s) given up, stopping now", len(steps))
        finally:
            stop()

    def on_shutdown(**_: Any) -> None:
        wake_for_stop()
        if started.is_set():
            return
        started.set()
        log.info("stopping: waiting up to %gs for %d attempt(s)", grace, len(running()))
        timer = threading.Timer(grace, give_up)
        timer.daemon = True
        timer.start()

    return on_shutdown


class BrokerUnavailable(Exception):
    """A publish failed moments ago; not trying again until the pause is over."""


class Confirms:
    """RabbitMQ's answers to the messages published on a channel in confirm mode, by delivery tag.

    The n-th message published on the channel has tag n; an answer may cover every
    tag up to its own (``multiple``).
    """

    def __init__(self, channel: Any) -> None:
        self.sent = 0  # the tag of the last message published
        self._answered = 0  # every tag up to this one is answered
        self._answers: dict[int, bool] = {}
        channel.confirm_select()
        channel.events["basic_ack"].add(lambda tag, multiple: self._answer(tag, multiple, True))
        channel.events["basic_nack"].add(lambda tag, multiple: self._answer(tag, multiple, False))

    def _answer(self, tag: int, multiple: bool, ok: bool) -> None:
        for each in range(self._answered + 1, tag + 1) if multiple else (tag,):
            self._answers.setdefault(each, ok)
        while self._answered + 1 in self._answers:
            self._answered += 1

    def settle(self, first: int, last: int) -> list[bool]:
        """Whether each of the tags ``first`` to ``last`` was acknowledged; forgotten then."""
        return [self._answers.pop(tag, False) for tag in range(first, last + 1)]

    def wait(self, conn: Any, count: int, timeout: float) -> bool:
        """Until the first ``count`` tags are answered (True), or ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._answered < count:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                conn.drain_events(timeout=left)
            except TimeoutError:
                return False
        return True


class ConfirmedLine:
    """A connection to RabbitMQ that a process keeps for its batches, its channel in confirm mode.

    A batch's messages are sent back to back and their confirms waited for once,
    on a connection opened once: a connection costs about 8 ms of CPU, client and
    broker, and a confirm waited for per message 0.45-0.85 ms (benchmarks/README.md,
    "Coalesced intake"). One batch at a time. The connection is opened again after
    a failure, after an idle spell long enough for the broker or a firewall to
    have dropped it, and in a forked process (:class:`KeptConnection`).
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._kept = KeptConnection("publisher")
        self._producer: Any = None
        self._confirms: Confirms | None = None

    def publish(
        self, messages: Sequence[StepMessage], send: Callable[[StepMessage, Any], None], timeout: float
    ) -> tuple[list[tuple[StepMessage, Exception]], Exception | None]:
        """Those of ``messages`` not confirmed, with why; and the error that broke the connection, if one did."""
        with self._lock:
            kept = self._kept.fit()
            failed, error = self._send(messages, send, timeout)
            if error is not None and kept:
                # Most likely the broker restarted while the connection sat here: once more, on a new one.
                failed, error = self._send([m for m, _ in failed], send, timeout)
            return failed, error

    def _send(
        self, messages: Sequence[StepMessage], send: Callable[[StepMessage, Any], None], timeout: float
    ) -> tuple[list[tuple[StepMessage, Exception]], Exception | None]:
        confirms: Confirms | None = None
        sent = 0
        try:
            confirms = self._open()
            first = confirms.sent + 1
            for message in messages:
                send(message, self._producer)
                sent += 1
                confirms.sent += 1
            answered = confirms.wait(self._kept.conn, confirms.sent, timeout)
        except Exception as exc:
            acked = confirms.settle(first, first + sent - 1) if confirms is not None and sent else []
            self._drop()
            acked += [False] * (len(messages) - sent)  # not sent, or sent as the connection broke
            return [(m, exc) for m, ok in zip(messages, acked, strict=True) if not ok], exc
        self._kept.used()
        refused: Exception = BrokerUnavailable("RabbitMQ did not confirm the message")
        failed = [(m, refused) for m, ok in zip(messages, confirms.settle(first, confirms.sent), strict=True) if not ok]
        if not answered:
            self._drop()  # answers still to come would be taken for those of the next batch
        return failed, None

    def _open(self) -> Confirms:
        if self._confirms is None or not self._kept.owned():  # none yet, or the parent's, inherited at a fork
            # Without confirm_publish, a publish does not wait; confirm mode is set on the channel below.
            # No retries of its own: a batch that fails is published later by the sweep.
            options = {"confirm_publish": False, "max_retries": 0}
            conn = self._kept.open(lambda: self.app.connection_for_write(transport_options=options))
            self._producer = self.app.amqp.Producer(conn)
            self._confirms = Confirms(self._producer.channel)
        return self._confirms

    def _drop(self) -> None:
        self._kept.drop()
        self._producer = self._confirms = None

    def close(self) -> None:
        with self._lock:
            self._drop()


class CeleryPublisher:
    # After a failed publish, fail fast for this long: the database holds the
    # message and the scheduler publishes it once the broker answers again.
    PAUSE_AFTER_FAILURE = 2.0
    # How long a batch waits for RabbitMQ's confirms before counting the rest as failed.
    CONFIRM_TIMEOUT = 10.0

    def __init__(self, app: Celery, settings: Settings) -> None:
        self.app = app
        self.grace = settings.hard_timeout_grace
        self.continue_within = settings.continue_within
        self.alert_command = settings.alert_command
        self._paused_until = 0.0
        kind = settings.broker_kind()
        # Redis reads level 0 first, RabbitMQ the highest: the same order either way.
        self._inverted = kind == "redis"
        self._line = ConfirmedLine(app) if kind == "rabbitmq" else None
        # Read once: each lookup in Celery's configuration costs more than the message's own fields.
        self._alarm_delivery_mode = app.conf.task_default_delivery_mode  # Celery's: persistent
        self._step_delivery_mode = step_delivery_mode(settings)
        self._retry_policy = app.conf.task_publish_retry_policy
        self._templates: dict[tuple[int, str], tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {}

    def healthy(self) -> bool:
        return time.monotonic() >= self._paused_until

    def publish(self, message: StepMessage) -> None:
        if not self.healthy():
            raise BrokerUnavailable("the broker failed a publish moments ago")
        try:
            self._send(message)
        except Exception:
            self._paused_until = time.monotonic() + self.PAUSE_AFTER_FAILURE
            raise

    def publish_many(self, messages: Sequence[StepMessage]) -> list[tuple[StepMessage, Exception]]:
        """Publish ``messages``; those not known to be published are returned, with why.

        On RabbitMQ they go on the process's :class:`ConfirmedLine`, sent back to
        back and their confirms waited for once; those RabbitMQ did not confirm
        (nacked, or no answer before the timeout, or the connection lost) are
        returned as failed. Elsewhere they go one by one, as :meth:`publish` sends them.
        """
        if self._line is None:
            return publish_each(self, messages)
        if not self.healthy():
            down = BrokerUnavailable("the broker failed a publish moments ago")
            return [(message, down) for message in messages]
        failed, error = self._line.publish(messages, self._send, self.CONFIRM_TIMEOUT)
        if error is not None:
            self._paused_until = time.monotonic() + self.PAUSE_AFTER_FAILURE
        return failed

    def close(self) -> None:
        if self._line is not None:
            self._line.close()

    def _send(self, message: StepMessage, producer: Any = None) -> None:
        # Limits of the delivery, which may go on with the flow's next steps: each
        # attempt has its own limits (RunningSteps.call); the soft limit is the
        # backstop, the hard one kills the process.
        soft_limit = message.timeout + self.continue_within
        self._publish(
            STEP_TASK,
            evolve(message, sent_at=time.time()).to_payload(),
            queue_name(message.module),
            self._step_delivery_mode,
            priority=self._level(message),
            time_limit=soft_limit + self.grace,
            soft_time_limit=soft_limit,
            # What Celery's logs show for the message: which step of which task. Celery
            # would otherwise render the whole payload, Parameters included, per publish.
            argsrepr=f"{message.task_id} step {message.cursor} seq {message.seq}",
            producer=producer,
        )

    def _publish(
        self,
        task: str,
        payload: dict[str, Any],
        queue: str,
        delivery_mode: int,
        argsrepr: str,
        priority: int | None = None,
        time_limit: float | None = None,
        soft_time_limit: float | None = None,
        producer: Any = None,
    ) -> None:
        """Publish a Celery task message, as Celery builds it, through kombu's producer.

        This is what ``send_task`` does for a named queue, without what it adds per
        message: routing, publish signals, and kombu binding a copy of the queue to
        find it declared already. The queue is declared once per connection: kombu
        forgets its declarations when it connects again. The headers are Celery's
        own, made once per task name and process (:meth:`_template`), with each
        message's id, time limits and description set (benchmarks/README.md, "A
        step's message from a template").
        """
        task_id = uuid()
        headers, properties, embed = self._template(task)
        headers = headers | {
            "id": task_id,
            "root_id": task_id,
            "timelimit": [time_limit, soft_time_limit],
            "argsrepr": argsrepr,
        }
        properties = properties | {"correlation_id": task_id}
        body: tuple[list[Any], dict[str, Any], dict[str, Any]] = ([payload], {}, embed)
        declared = self.app.amqp.queues[queue]
        with nullcontext(producer) if producer is not None else self.app.producer_or_acquire() as sender:
            sender.publish(
                # Encoded here, by orjson, in a tenth of the CPU of kombu's json serializer
                # (the first step's message carries the task's row); the same JSON text.
                json_text(body),
                content_type=JSON,
                content_encoding="utf-8",
                exchange="",
                routing_key=queue,
                headers=headers,
                priority=priority,
                delivery_mode=delivery_mode,
                declare=[] if hash(declared) in sender.connection.declared_entities else [declared],
                # Not on a ConfirmedLine's producer: kombu would reconnect it under the line,
                # on a channel not in confirm mode. The line tries again itself.
                retry=producer is None,
                retry_policy=self._retry_policy,
                # A confirm that never comes (RabbitMQ's resource alarm) fails the publish
                # instead of holding the caller's thread: the sweep publishes it later.
                confirm_timeout=self.CONFIRM_TIMEOUT,
                **properties,
            )

    def _template(self, task: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Celery's headers, properties and embedded options of a ``task`` message without arguments.

        Made by Celery in each process (its ``origin`` header names the process), so
        the messages carry every header Celery's own would, in the form it reads.
        """
        key = (os.getpid(), task)
        made = self._templates.get(key)
        if made is None:
            headers, properties, body, _ = self.app.amqp.create_task_message("", task, [], None, kwargsrepr="")
            made = self._templates[key] = (headers, properties, body[2])
        return made

    def _level(self, message: StepMessage) -> int:
        level = delivery_priority(message)
        return MAX_PRIORITY - level if self._inverted else level

    def alarm(self, alarm: Alarm) -> None:
        if not self.alert_command:
            return
        module = self.alert_command.partition(".")[0]
        argsrepr = f"{alarm.task_id} alarm {alarm.seq}"
        self._publish(ALARM_TASK, alarm.__dict__, queue_name(module), self._alarm_delivery_mode, argsrepr=argsrepr)
