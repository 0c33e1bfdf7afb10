"""The task service: load, decide, compare-and-set, then publish.

Every caller that changes a task (API, consumers, scheduler, CLI) goes through
:meth:`TaskService.apply`; the decision itself is :func:`shared.saga.decide`, the
write a compare-and-set (:func:`shared.transition.compare_and_set`).
"""

from __future__ import annotations

import builtins
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from shared import metrics
from shared.config import Settings
from shared.errors import ServiceError as ServiceError  # re-exported: callers import it from here
from shared.flows import FlowSet
from shared.logs import AttemptFields, attempt_context, current_attempt
from shared.records import evolve
from shared.saga import (
    DEFAULT_TIMING,
    Cancel,
    Decision,
    Due,
    Event,
    Expire,
    Failed,
    Heartbeat,
    Operation,
    PollLater,
    PublishFailed,
    Released,
    Resume,
    Retry,
    Started,
    Submit,
    Succeeded,
    Timing,
    decide,
    expiry,
    unrecorded_start,
)
from shared.states import Phase, StepType
from shared.storage import AttemptRecord, Outstanding, StorageUnavailable, TaskEvent, TaskFilter, TaskStore
from shared.storage.base import CREATED_VERSION, Save, all_stored, create_each
from shared.storage.codec import task_fields
from shared.task import Alarm, StepMessage, Task, new_task
from shared.transition import compare_and_set

log = logging.getLogger(__name__)


def timing_of(settings: Settings) -> Timing:
    """The saga's time bounds from the settings; every process must agree on them."""
    s = settings
    start_recorded_within = s.record_start_after + s.expire_grace if s.record_start_after > 0 else 0.0
    return Timing(
        requeue_after=s.requeue_after,
        expire_grace=s.expire_grace,
        publish_retry=s.publish_retry,
        heartbeat_timeout=HEARTBEATS_MISSED * s.heartbeat_interval,
        start_recorded_within=start_recorded_within,
    )


# A running attempt is lost once this many heartbeats in a row have not come.
HEARTBEATS_MISSED = 3


class UnknownFlow(ServiceError):
    status_code = 404


class TaskNotFound(ServiceError):
    status_code = 404


class DuplicateTaskId(ServiceError):
    status_code = 422


@dataclass(frozen=True)
class Submission:
    """One task of a batch: what a single submit takes."""

    flow: str
    parameters: Mapping[str, Any]
    priority: int = 0
    user_id: str | None = None
    task_id: str | None = None


def at_index(exc: ServiceError, index: int) -> ServiceError:
    """``exc`` naming the submission of a batch it is about, ``tasks[index]``, in its message and fields."""
    exc.args = (f"tasks[{index}]: {exc}",)
    if exc.detail is not None:
        exc.detail = [
            {**d, "field": f"tasks[{index}].{d['field']}" if d.get("field") else f"tasks[{index}]"}
            for d in exc.detail
        ]
    return exc


class Publisher(Protocol):
    def publish(self, message: StepMessage) -> None: ...

    def publish_many(self, messages: Sequence[StepMessage]) -> builtins.list[tuple[StepMessage, Exception]]:
        """Publish each of ``messages``; those not known to be published are returned, with why."""
        ...

    def alarm(self, alarm: Alarm) -> None: ...

    def healthy(self) -> bool:
        """False while the broker is known to be down (publishing is pointless)."""
        ...


class SinglePublisher(Protocol):
    def publish(self, message: StepMessage) -> None: ...


def publish_each(publisher: SinglePublisher, messages: Sequence[StepMessage]) -> builtins.list[tuple[StepMessage, Exception]]:
    """``publish_many`` for a publisher with nothing to share between messages: one at a time."""
    failed = []
    for message in messages:
        try:
            publisher.publish(message)
        except Exception as exc:
            failed.append((message, exc))
    return failed


class TaskService:
    def __init__(
        self,
        store: TaskStore,
        publisher: Publisher,
        flows: FlowSet,
        clock: Callable[[], float] = time.time,
        timing: Timing = DEFAULT_TIMING,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.flows = flows
        self.clock = clock
        self.timing = timing

    # --- intake ------------------------------------------------------------

    def submit(
        self,
        flow_name: str,
        parameters: Mapping[str, Any],
        priority: int = 0,
        user_id: str | None = None,
        task_id: str | None = None,
    ) -> tuple[Task, bool]:
        """Store a new task and dispatch its first step; a known task_id returns the stored task."""
        decision = self.prepare(flow_name, parameters, priority, user_id, task_id or uuid.uuid4().hex)
        stored, created = self.store.create(decision.task, self.clock())
        if created:
            self.dispatch([decision])
        return stored, created

    def submit_many(self, batch: Sequence[Submission]) -> builtins.list[tuple[Task, bool]]:
        """Store every task of ``batch`` at once; the scheduler publishes their first steps.

        The first steps are stored waiting, due at once (``Submit(deferred=True)``),
        and the scheduler's sweeps publish them: a batch is answered once it is
        stored, without a message per task on its way. All or nothing: a refused
        submission (unknown flow, invalid parameters, an id given twice, an id
        taken by another flow or user) stores none of them; the error names the
        submission by its index, ``tasks[i]``.
        """
        decisions: builtins.list[Decision] = []
        first_at: dict[str, int] = {}
        for i, sub in enumerate(batch):
            task_id = sub.task_id or uuid.uuid4().hex
            if task_id in first_at:
                raise DuplicateTaskId(
                    f"tasks[{i}]: task_id {task_id!r} is also that of tasks[{first_at[task_id]}]"
                )
            first_at[task_id] = i
            try:
                decisions.append(
                    self.prepare(sub.flow, sub.parameters, sub.priority, sub.user_id, task_id, deferred=True)
                )
            except ServiceError as exc:
                raise at_index(exc, i) from None
        stored = all_stored(self.store.create_many([d.task for d in decisions], self.clock()))
        self.dispatch([decision for decision, (_, created) in zip(decisions, stored, strict=True) if created])
        return stored

    def submit_each(self, batch: Sequence[Submission]) -> builtins.list[tuple[Task, bool] | Exception]:
        """Concurrent single submits (the API's, coalesced), stored together, in one commit.

        Each is answered as :meth:`submit` would answer it alone: the task as
        stored and whether it is new, or the error that refused it (unknown flow,
        invalid parameters, an id taken by another flow or user), which takes
        nothing from the others. A database error is raised for all of them.
        """
        prepared: builtins.list[Decision | ServiceError] = []
        for sub in batch:
            try:
                task_id = sub.task_id or uuid.uuid4().hex
                prepared.append(self.prepare(sub.flow, sub.parameters, sub.priority, sub.user_id, task_id))
            except ServiceError as exc:
                prepared.append(exc)
        decisions = [d for d in prepared if isinstance(d, Decision)]
        now = self.clock()
        stored = create_each([d.task for d in decisions], lambda tasks: self.store.create_many(tasks, now, each=True))
        self.dispatch([d for d, answer in zip(decisions, stored, strict=True) if isinstance(answer, tuple) and answer[1]])
        answers = iter(stored)
        return [d if isinstance(d, ServiceError) else next(answers) for d in prepared]

    def prepare(
        self,
        flow_name: str,
        parameters: Mapping[str, Any],
        priority: int,
        user_id: str | None,
        task_id: str,
        deferred: bool = False,
    ) -> Decision:
        """A new task and its first message, not stored: the caller stores it, then calls :meth:`dispatch`.

        The parameters are checked against the flow's declaration, its defaults
        filled in (:meth:`shared.flows.Flow.check_parameters`). ``deferred``: the
        first step is left for the scheduler to publish (:class:`Submit`).
        """
        flows = self.flows  # one version of flows.yaml, though a reload may replace it meanwhile
        flow = flows.get(flow_name)
        if flow is None:
            known = ", ".join(sorted(flows.flows)) or "none"
            raise UnknownFlow(f"unknown flow {flow_name!r} (known flows: {known})")
        parameters = flow.check_parameters(parameters)
        now = self.clock()
        task = new_task(task_id, flow, parameters, now, priority, user_id)
        return decide(task, Submit(deferred), now, self.timing)

    def dispatch(self, decisions: Sequence[Decision]) -> None:
        """Publish the first messages of tasks :meth:`prepare` made, once they are stored (none if deferred).

        Each carries the task as stored (``StepMessage.known``): its consumer needs
        no read before the step's start. Published together
        (:meth:`Publisher.publish_many`): on RabbitMQ a large batch waits once for
        the broker's confirms, not once per message.
        """
        messages = []
        for flow, count in Counter(decision.task.flow for decision in decisions).items():
            metrics.SUBMITTED.labels(flow).inc(count)
        for decision in decisions:
            log.info("task submitted", extra={"task_id": decision.task.task_id, "flow": decision.task.flow})
            messages += [with_copy(m, decision.task, CREATED_VERSION) for m in decision.messages]
        if not messages:
            return  # a batch's: the sweep publishes them (on RabbitMQ, even none would open a channel)
        for message, exc in self.publisher.publish_many(messages):
            self._publish_failed(message, exc)

    # --- transitions ---------------------------------------------------------

    def apply(
        self,
        task_id: str,
        event: Event,
        known: Task | None = None,
        worker: str | None = None,
        keep: Callable[[StepMessage], bool] | None = None,
    ) -> Decision:
        """Decide ``event`` against the stored task and persist the result atomically.

        ``known`` is a copy the caller just stored (a consumer between the start
        and the outcome of an attempt): it saves a read, and if it is out of date
        the compare-and-set fails and the task is read again. ``worker`` names the
        process reporting a step event, for the attempt log.

        ``keep`` lets the caller run a message of the decision itself (a consumer
        running the next step at once): the first one it answers True for is not
        published, and its start is stored with this transition, in the same
        write, so the task shows it running from the moment it is committed;
        unless starts are written with their outcomes (``start_recorded_within``):
        it then stays queued, as a delivered message would until its outcome, and
        the caller may still hand it on (:meth:`publish`). ``Decision.kept`` names
        it in the returned decision.
        """
        step = _Step(self, Change(task_id, event, known, worker, keep), self.clock())

        def write(task: Task, decision: Decision) -> bool | None:
            save = step.save(task, decision)
            if save is None:
                return None
            return self.store.save(save.task, save.now, save.attempt, next_attempt=save.next_attempt)

        before, decision = compare_and_set(
            f"task {task_id}",
            lambda: self.get(task_id),
            step.decided,
            write,
            known=known,
            effects=lambda before, decision: self._after([(before, decision)]),
        )
        return step.stored(before, decision)

    def publish_due(self, due: Sequence[tuple[str, int]]) -> int:
        """Publish the waiting messages ``due`` (task id, seq), due by now; returns how many were.

        A batch's first steps come due together (:meth:`submit_many`): their
        tasks are read in one query, their transitions committed together and
        their messages published together (:meth:`apply_many`). Raises
        :class:`StorageUnavailable` if the database was, as :meth:`apply` would
        (after publishing what was stored): the scheduler then waits for it.
        """
        due = sorted(due)  # rows locked in one order: two schedulers' groups wait, never deadlock
        try:
            known = {task.task_id: task for task in self.store.get_many([task_id for task_id, _ in due])}
        except StorageUnavailable:
            raise
        except Exception as exc:
            # One row it cannot read (written by another release, say) would hold back the
            # whole group at every pass: each is read alone, the group goes on without it.
            log.warning("%d waiting tasks could not be read together, so each alone: %s", len(due), exc)
            known = self._readable([task_id for task_id, _ in due])
        answers = self.apply_many([Change(task_id, Due(seq), known.get(task_id)) for task_id, seq in due])
        errors = [answer for answer in answers if isinstance(answer, Exception) and not isinstance(answer, TaskNotFound)]
        unavailable = next((error for error in errors if isinstance(error, StorageUnavailable)), None)
        if unavailable is not None:
            raise unavailable
        if errors:  # left waiting, due: the next pass tries them again
            log.warning("%d waiting message(s) not published: %s", len(errors), errors[0], exc_info=errors[0])
        return sum(isinstance(answer, Decision) and not answer.ignored for answer in answers)

    def _readable(self, task_ids: Sequence[str]) -> dict[str, Task]:
        """Those of ``task_ids`` the store can read, each read alone; the others are left out."""
        readable = {}
        for task_id in task_ids:
            try:
                task = self.store.get(task_id)
            except StorageUnavailable:
                raise
            except Exception:
                continue  # its change goes on alone, and fails there, where it is logged
            if task is not None:
                readable[task_id] = task
        return readable

    def apply_many(self, changes: Sequence[Change]) -> builtins.list[Decision | Exception]:
        """:meth:`apply` each of ``changes``, their writes committed together.

        Group commit, for a consumer with several attempts in flight: each change
        with a ``known`` copy is decided on it and the writes go to the store
        together (:meth:`TaskStore.save_many`: one transaction and one round trip
        on PostgreSQL), then the next messages of all are published together. A
        change without a copy, one whose compare-and-set lost, or one decided to
        change nothing (the copy may be out of date), goes on alone as
        :meth:`apply` would; so does every change when the group's write fails
        (refused, or the database unavailable: nothing of it is written). Never
        raises: returns each change's decision, or what its :meth:`apply` raised;
        once one alone finds the database unavailable, the rest are answered
        :class:`StorageUnavailable` without a try. Two changes of one task (a
        message and its copy, both delivered) are both decided on its copy: the
        second's compare-and-set then fails, and it goes on alone.
        """
        now = self.clock()
        answers: list[Decision | Exception | None] = [None] * len(changes)
        group: list[tuple[int, _Step, Task, Decision, Save]] = []
        for i, change in enumerate(changes):
            if change.known is None:
                continue
            step = _Step(self, change, now)
            decision = step.decided(change.known)
            save = step.save(change.known, decision)
            if save is not None:
                group.append((i, step, change.known, decision, save))
        written = [False] * len(group)
        if group:
            try:
                written = self.store.save_many([save for *_, save in group])
            except StorageUnavailable:
                pass  # each alone finds it unavailable too, and answers so
            except Exception:
                log.warning("a group of %d transitions was refused: each goes on alone", len(group), exc_info=True)
        done = [(i, step, known, decision) for (i, step, known, decision, _), ok in zip(group, written, strict=True) if ok]
        self._after([(known, decision) for _, _, known, decision in done])
        for i, step, known, decision in done:
            answers[i] = step.stored(known, decision)
        unavailable: StorageUnavailable | None = None
        for i, change in enumerate(changes):
            if answers[i] is not None:
                continue
            if unavailable is not None:
                answers[i] = unavailable  # the others would find it so too, each after its own wait
                continue
            try:
                answers[i] = self.apply(change.task_id, change.event, worker=change.worker, keep=change.keep)
            except StorageUnavailable as exc:
                answers[i] = unavailable = exc
            except Exception as exc:  # this change's alone; the others stand
                answers[i] = exc
        return answers  # type: ignore[return-value]  # every None was filled

    def _after(self, changed: Sequence[tuple[Task, Decision]]) -> None:
        """What follows stored transitions: counts, logs, and their messages published together."""
        messages: list[StepMessage] = []
        for before, decision in changed:
            task = decision.task
            if task.status is not before.status and task.status.is_terminal:
                metrics.FINISHED.labels(task.flow, task.status.label).inc()
                # Committed outside any attempt's logging context (a group commit, a sweep, an operator):
                # the line carries the attempt the task had outstanding.
                fields = AttemptFields.of_active(before) if current_attempt() is None else None
                with attempt_context(fields):
                    log.info(
                        "task finished",
                        extra={"task_id": task.task_id, "flow": task.flow, "status": task.status.label},
                    )
            _count_try(before, task)
            carried = decision.kept
            for message in decision.messages:
                if message is not carried:
                    # A first step published by the sweep (a batch's) carries its task as a submit's does.
                    messages.append(with_copy(message, task, before.version + 1) if message.seq == 1 else message)
        self.publish(messages)
        for _, decision in changed:
            for alarm in decision.alarms:
                metrics.ALARMS.labels(alarm.flow, alarm.module).inc()
                log.error(
                    "ALARM: rollback failed, operator action needed (asyncflow resume %s): %s.%s: %s",
                    alarm.task_id,
                    alarm.module,
                    alarm.command,
                    alarm.error,
                    extra={"task_id": alarm.task_id, "flow": alarm.flow, "step": alarm.cursor},
                )
                try:
                    self.publisher.alarm(alarm)
                except Exception:
                    log.exception("delivering the alarm failed", extra={"task_id": alarm.task_id})

    def publish(self, messages: Sequence[StepMessage]) -> None:
        """Publish ``messages``, whose transitions are stored; one the broker refuses is published again soon."""
        if len(messages) == 1:
            try:
                self.publisher.publish(messages[0])
            except Exception as exc:
                self._publish_failed(messages[0], exc)
        elif messages:  # on RabbitMQ their confirms are waited for once
            for message, error in self.publisher.publish_many(messages):
                self._publish_failed(message, error)

    def _publish_failed(self, message: StepMessage, exc: Exception) -> None:
        """The transition is committed, the message is not: the sweep publishes it again."""
        extra = {"task_id": message.task_id, "step": message.cursor, "seq": message.seq}
        log.warning("publishing failed, the scheduler will publish it again: %s", exc, extra=extra)
        try:
            self.apply(message.task_id, PublishFailed(message.seq))
        except Exception:
            # Then the requeue sweep finds it after requeue_after instead.
            log.exception("could not mark the message for an early re-publish", extra=extra)

    # --- operator actions ---------------------------------------------------------

    def operate(self, task_id: str, event: Operation, actor: str | None = None) -> Task:
        """Cancel, Retry or Resume, recorded in the task's history as done by ``actor``.

        Raises :class:`shared.saga.InvalidAction` when the state forbids it, and
        :class:`shared.parameters.InvalidParameters` when corrected parameters do
        not pass the flow's declaration; either way nothing is stored. An action
        that changes nothing (a second cancel) is not recorded.
        """
        now = self.clock()

        def write(task: Task, decision: Decision) -> bool | None:
            if decision.task is task:
                return None
            return self.store.save(decision.task, now, event=operator_event(task, decision.task, event, now, actor))

        before, decision = compare_and_set(
            f"task {task_id}",
            lambda: self.get(task_id),
            lambda task: self._decide_operation(task, event, now),
            write,
            effects=lambda before, decision: self._after([(before, decision)]),
        )
        if decision.task is before:
            return before
        return evolve(decision.task, version=before.version + 1)

    def _decide_operation(self, task: Task, event: Operation, now: float) -> Decision:
        # Decided first as given, so an action the state forbids is refused as such
        # (409) before its parameters are looked at.
        decision = decide(task, event, now, self.timing)
        flow = self.flows.get(task.flow)  # a flow since removed from flows.yaml has no declaration to check
        if isinstance(event, Cancel) or not event.parameters or flow is None:
            return decision
        checked = flow.check_parameters(decision.task.parameters)
        if checked != decision.task.parameters:  # declared defaults filled in
            decision = decide(task, evolve(event, parameters=checked), now, self.timing)
        return decision

    # --- reads ------------------------------------------------------------------

    def get(self, task_id: str) -> Task:
        task = self.store.get(task_id)
        if task is None:
            raise TaskNotFound(f"no task {task_id!r}")
        return task

    def due(
        self, now: float, limit: int, kind: Outstanding, flow: str | None = None
    ) -> list[tuple[str, int, Phase]]:
        """(task_id, seq, phase) of outstanding messages due by ``now``: the scheduler's work
        (:meth:`TaskStore.due`)."""
        return self.store.due(now, limit, kind, flow)

    def waiting_flows(self) -> list[tuple[str, str | None]]:
        """Each flow with a batch's first steps waiting, and the module of its first step
        (None for a flow flows.yaml no longer declares)."""
        flows = self.flows
        declared = {name: flow.steps[0].normal.module for name, flow in flows.flows.items()}
        return [(name, declared.get(name)) for name in self.store.waiting_flows()]

    def list(self, where: TaskFilter) -> list[Task]:
        return self.store.list(where)

    def attempts(self, task_id: str) -> builtins.list[AttemptRecord]:
        return self.store.attempts(task_id)

    def events(self, task_id: str) -> builtins.list[TaskEvent]:
        """The task's history: operators' cancels, retries and resumes, oldest first."""
        return self.store.events(task_id)


class Change(NamedTuple):
    """One transition for :meth:`TaskService.apply_many`: :meth:`TaskService.apply`'s arguments."""

    task_id: str
    event: Event
    known: Task | None = None
    worker: str | None = None
    keep: Callable[[StepMessage], bool] | None = None


class _Step:
    """The decision and the write of one change, on whichever copy of its task it is tried."""

    __slots__ = ("service", "change", "now", "_carried")

    def __init__(self, service: TaskService, change: Change, now: float) -> None:
        self.service = service
        self.change = change
        self.now = now
        self._carried: AttemptRecord | None = None  # the start of the message ``keep`` took, if it took one

    def decided(self, task: Task) -> Decision:
        change, now, timing = self.change, self.now, self.service.timing
        self._carried = None
        decision = decide(task, change.event, now, timing)
        kept = next((m for m in decision.messages if change.keep is not None and change.keep(m)), None)
        if decision.ignored or kept is None:
            return decision
        if timing.start_recorded_within > 0:
            return evolve(decision, kept=kept)  # its start is written with its outcome, as a delivered one's
        start = Started(kept.seq, heartbeats=True)
        self._carried = _attempt_record(decision.task, start, now, timing, change.worker)
        assert self._carried is not None, "a start always has an attempt record"
        return evolve(decision, task=decide(decision.task, start, now, timing).task, kept=kept)

    def save(self, task: Task, decision: Decision) -> Save | None:
        """What to store for ``decision`` made on ``task``; None when it changes nothing."""
        if decision.ignored or decision.task is task:
            return None
        attempt = _attempt_record(task, self.change.event, self.now, self.service.timing, self.change.worker)
        return Save(decision.task, self.now, attempt, self._carried)

    def stored(self, before: Task, decision: Decision) -> Decision:
        """The decision as the caller gets it: its task as stored now, version included, for its next ``known``."""
        if decision.ignored or decision.task is before:
            return decision
        if isinstance(self.change.event, Expire):
            timed_out = expiry(before, self.now, self.service.timing).timed_out
            metrics.EXPIRED.labels("deadline" if timed_out else "heartbeat").inc()
        return evolve(decision, task=evolve(decision.task, version=before.version + 1))


def _count_try(before: Task, after: Task) -> None:
    """Counts the try ``after`` has outstanding if it is a new one: a retry or a rollback's first.

    Not a try published again (requeued, due after its backoff, given back) or asked again to poll.
    """
    active, prior = after.active, before.active
    if active is None or active.attempt == 1 and active.type is StepType.NORMAL:
        return
    if prior is not None and (prior.cursor, prior.type, prior.attempt) == (active.cursor, active.type, active.attempt):
        return
    action = after.steps[active.cursor].action(active.type)
    if active.attempt > 1:
        metrics.RETRIES.labels(action.module, action.command).inc()
    elif active.type is StepType.ROLLBACK:
        metrics.ROLLBACKS.labels(after.flow, action.module).inc()


def with_copy(message: StepMessage, task: Task, version: int) -> StepMessage:
    """``message`` carrying ``task`` as stored at ``version`` (``StepMessage.known``): its
    consumer starts the step on that copy, without a read."""
    return evolve(message, known=task_fields(task) | {"version": version})


def _attempt_record(
    task: Task, event: Event, now: float, timing: Timing, worker: str | None = None
) -> AttemptRecord | None:
    """The attempt-log write that goes with an accepted step event."""
    active = task.active
    if active is None or not isinstance(event, Started | Heartbeat | Released | Succeeded | Failed | PollLater | Expire):
        return None
    action = task.steps[active.cursor].action(active.type)
    base = AttemptRecord(
        task_id=task.task_id,
        seq=active.seq,
        cursor=active.cursor,
        type=active.type,
        attempt=active.attempt,
        module=action.module,
        command=action.command,
        # An outcome of an attempt whose start was not recorded writes the whole attempt at once.
        started_at=unrecorded_start(event) if active.phase is Phase.QUEUED else None,
        worker=worker,
    )
    if isinstance(event, Started):
        return evolve(base, started_at=now)
    if isinstance(event, Heartbeat):
        return evolve(base, heartbeat_at=now, progress=event.progress)
    if isinstance(event, Succeeded):
        return evolve(base, ended_at=now, outcome="succeeded", result=dict(event.result))
    if isinstance(event, PollLater):
        return evolve(base, ended_at=now, outcome="poll_later", result=dict(event.parameters))
    if isinstance(event, Released):  # its handler did not run; one not started has no record
        return evolve(base, ended_at=now, outcome="released") if event.running else None
    if isinstance(event, Expire):
        return evolve(base, ended_at=now, outcome="expired", error=expiry(task, now, timing).error)
    outcome = "timed_out" if event.timed_out else "failed"
    return evolve(base, ended_at=now, outcome=outcome, error=event.error)


_ACTION_KINDS: dict[type, str] = {Cancel: "cancel", Retry: "retry", Resume: "resume"}
# Stands for a parameter the task did not have, in a correction's "old" value.
_ABSENT = object()


def operator_event(before: Task, after: Task, event: Operation, now: float, actor: str | None) -> TaskEvent:
    """The history entry of an operator's action: who, and what it changed."""
    detail: dict[str, Any] = {}
    if not isinstance(event, Cancel) and after.active is not None:
        detail["step"] = after.active.cursor  # where the run (or the compensation) starts again
    changes: dict[str, dict[str, Any]] = {}
    for key, new in after.parameters.items():
        old = before.parameters.get(key, _ABSENT)
        if old is _ABSENT:
            changes[key] = {"new": new}
        elif json.dumps(old, sort_keys=True) != json.dumps(new, sort_keys=True):  # 1 == True, yet a change
            changes[key] = {"old": old, "new": new}
    if changes:
        detail["parameters"] = changes
    return TaskEvent(before.task_id, now, _ACTION_KINDS[type(event)], actor, detail)
