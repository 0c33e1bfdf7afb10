"""A consumer process of the kombu pool (shared.messaging.consumers.StepMessages), message by message.

The broker and the step consumer are stand-ins: what is checked is what the
process does with each message (runs it, notes it, acknowledges it or keeps it).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kombu.compression import compress
from kombu.message import Message as KombuMessage
from kombu.serialization import prepare_accept_content

from shared.messaging import ALARM_TASK, JSON, LIMIT_MARGIN, STEP_TASK
from shared.messaging import consumers as module
from shared.messaging import running as module_running
from shared.messaging.consumers import GroupedStepMessages, StepMessages, _release
from shared.messaging.running import RunningSteps
from shared.storage import StorageUnavailable
from shared.storage.codec import json_text
from shared.task import Alarm, StepMessage, StepType

STEP = StepMessage("t1", "three", 1, 0, StepType.NORMAL, 1, "alpha", "step", 20.0, 0)


class Message:
    def __init__(self, task: str, timelimit: tuple[float, float] | None = (26.0, 25.0)) -> None:
        self.headers = {"task": task, "id": "delivery-1", "timelimit": timelimit}
        self.delivery_tag = 1
        self.acks = self.requeues = 0

    def ack(self) -> None:
        self.acks += 1

    def requeue(self) -> None:
        self.requeues += 1


class Settings:
    continue_within = 5.0
    alert_command = "monitor.alert"


class Consumer:
    """Records each call; ``failures`` are raised first, one per call."""

    settings = Settings()

    def __init__(self, running: RunningSteps, *failures: Exception) -> None:
        self.running = running
        self.failures = list(failures)
        self.handled: list[tuple[StepMessage, float | None, dict[str, Any]]] = []
        self.alarms: list[tuple[Alarm, str]] = []

    def handle(self, message: StepMessage, continue_until: float | None = None, on_next: Any = None) -> None:
        self.handled.append((message, continue_until, self.running.note_of(_pid())))
        if self.failures:
            raise self.failures.pop(0)

    def alarm(self, alarm: Alarm, command: str) -> None:
        self.alarms.append((alarm, command))
        if self.failures:
            raise self.failures.pop(0)


def _pid() -> int:
    return os.getpid()


@pytest.fixture
def running(tmp_path: Path) -> RunningSteps:
    return RunningSteps(1.0, root=tmp_path)


@pytest.fixture(autouse=True)
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "reconnect_delay", lambda tries: 0.0)


def process(consumer: Consumer, running: RunningSteps) -> StepMessages:
    return StepMessages(None, [], consumer, running)  # type: ignore[arg-type]


def body(payload: dict[str, Any]) -> list[Any]:
    return [[payload], {}, {}]  # Celery's message protocol 2


def test_a_step_runs_noted_within_its_soft_limit_and_is_acknowledged_after(running: RunningSteps) -> None:
    consumer = Consumer(running)
    message = Message(STEP_TASK)
    before = time.monotonic()
    process(consumer, running).on_message(body(STEP.to_payload()), message)
    ((step, until, note),) = consumer.handled
    assert step == STEP
    assert until is not None and before + 25.0 - LIMIT_MARGIN <= until <= time.monotonic() + 25.0 - LIMIT_MARGIN
    # Noted while it ran, with the delivery's hard limit; nothing once it is over.
    assert note["delivery"] == "delivery-1" and note["message"]["task_id"] == "t1"
    assert 25.9 <= note["deadline"] - note["started"] <= 26.1
    assert running.note_of(_pid()) == {}
    assert message.acks == 1


def test_a_step_the_database_refused_is_kept_and_run_again(running: RunningSteps) -> None:
    consumer = Consumer(running, StorageUnavailable("down"), StorageUnavailable("still down"))
    message = Message(STEP_TASK)
    process(consumer, running).on_message(body(STEP.to_payload()), message)
    assert len(consumer.handled) == 3 and message.acks == 1


def test_a_stop_during_the_pause_leaves_the_message_unacknowledged(running: RunningSteps) -> None:
    consumer = Consumer(running, StorageUnavailable("down"))
    messages = process(consumer, running)
    messages.stop()
    message = Message(STEP_TASK)
    messages.on_message(body(STEP.to_payload()), message)
    assert len(consumer.handled) == 1 and message.acks == 0  # the broker delivers it again
    assert messages.should_stop and running.note_of(_pid()) == {}


def test_a_step_whose_store_gave_up_is_acknowledged(running: RunningSteps) -> None:
    consumer = Consumer(running, RuntimeError("outcome not stored after its patience"))
    message = Message(STEP_TASK)
    process(consumer, running).on_message(body(STEP.to_payload()), message)
    assert message.acks == 1  # the sweeps take the attempt over


@pytest.mark.parametrize(
    "task, payload",
    [
        (STEP_TASK, {"task_id": "t1"}),  # not a whole step
        (STEP_TASK, "not a payload"),
        (STEP_TASK, [1, 2]),
        ("someone.else", STEP.to_payload()),
        (ALARM_TASK, {"unknown": 1}),
    ],
)
def test_an_unreadable_message_is_dropped(running: RunningSteps, task: str, payload: Any) -> None:
    consumer = Consumer(running)
    message = Message(task)
    process(consumer, running).on_message(body(payload), message)
    assert consumer.handled == [] and consumer.alarms == [] and message.acks == 1


class Delivery(KombuMessage):
    """A message as kombu hands it over (decompressed, not decoded), that counts its acknowledgements
    and the decodes it was left to (kombu's json, where orjson is not exact or not meant for it)."""

    def __init__(self, body: bytes | str, content_type: str, **headers: Any) -> None:
        super().__init__(
            body=body, content_type=content_type, content_encoding="utf-8", accept=prepare_accept_content(["json"]),
            headers={"task": STEP_TASK, "id": "delivery-1", "timelimit": (26.0, 25.0), **headers},
        )
        self.acks = self.kombu_decodes = 0

    def ack(self, multiple: bool = False) -> None:
        self.acks += 1

    def decode(self) -> Any:
        self.kombu_decodes += 1
        return super().decode()


def decoded_step(running: RunningSteps, delivery: Delivery) -> StepMessage:
    consumer = Consumer(running)
    process(consumer, running).on_delivery(delivery)
    assert delivery.acks == 1
    ((step, _, _),) = consumer.handled
    return step


# Integers past 64 bits, which orjson would read as floats, at both ends; one within.
EXACT = {"name": "ä", "big": 2**70 + 1, "u64": 2**64 + 1, "low": -(2**63) - 1, "i64": 2**63 - 1, "x": [1.5, None]}


@pytest.mark.parametrize("parameters", [{"name": "ä", "n": 2**40, "x": [1.5, None]}, EXACT])
def test_a_delivery_s_json_body_is_decoded_exactly_and_its_step_run(
    running: RunningSteps, parameters: dict[str, Any]
) -> None:
    payload = STEP.to_payload() | {"parameters": parameters}
    for data in (json_text(body(payload)), json_text(body(payload)).decode()):
        delivery = Delivery(data, JSON)
        step = decoded_step(running, delivery)
        assert step == StepMessage.from_payload(payload) and step.parameters == parameters
        assert delivery.kombu_decodes == (parameters is EXACT)  # orjson for the rest


def test_a_compressed_body_is_kombu_s_to_decode(running: RunningSteps) -> None:
    parameters = {"name": "ä", "n": 2**40}
    text = json.dumps(body(STEP.to_payload() | {"parameters": parameters})).encode()
    _, compression = compress(text, "zlib")
    # As kombu hands it over: the body decompressed, its header kept.
    delivery = Delivery(text, JSON, compression=compression)
    assert decoded_step(running, delivery).parameters == parameters
    assert delivery.kombu_decodes == 1


@pytest.mark.parametrize(
    "data, content_type",
    [
        (b"{not json", JSON),
        (pickle.dumps(body(STEP.to_payload())), "application/x-python-serialize"),  # not accepted
    ],
)
def test_a_delivery_that_cannot_be_decoded_is_dropped(running: RunningSteps, data: bytes, content_type: str) -> None:
    consumer = Consumer(running)
    delivery = Delivery(data, content_type)
    process(consumer, running).on_delivery(delivery)
    assert consumer.handled == [] and delivery.acks == 1


def test_an_alarm_is_tried_again_then_given_up(running: RunningSteps) -> None:
    alarm = Alarm("t1", "three", 7, 1, "beta", "undo", "rollback failed")
    failing = [RuntimeError("no route")] * (module.ALARM_RETRIES + 1)
    consumer = Consumer(running, *failing)
    message = Message(ALARM_TASK)
    process(consumer, running).on_message(body(alarm.__dict__), message)
    assert [a for a, _ in consumer.alarms] == [alarm] * (module.ALARM_RETRIES + 1)
    assert message.acks == 1

    consumer = Consumer(running, RuntimeError("once"))
    process(consumer, running).on_message(body(alarm.__dict__), Message(ALARM_TASK))
    assert consumer.alarms == [(alarm, "monitor.alert")] * 2


def test_a_process_holding_several_deliveries_runs_an_alarm_beside_them(running: RunningSteps) -> None:
    """Its command runs on the rounds' thread: through GroupCommit.beside, which hands on what is
    held should the command run long (tests/unit/test_group_commit.py)."""
    alarm = Alarm("t1", "three", 7, 1, "beta", "undo", "rollback failed")
    consumer = Consumer(running)
    grouped = GroupedStepMessages(None, [], consumer, running, prefetch=8)  # type: ignore[arg-type]
    beside: list[bool] = []

    def recorded(work: Any) -> None:
        beside.append(True)
        work()

    grouped.group.beside = recorded  # type: ignore[method-assign]
    message = Message(ALARM_TASK)
    grouped.on_message(body(alarm.__dict__), message)
    assert consumer.alarms == [] and message.acks == 0  # taken: delivered in the next round
    [(_, start)] = grouped._taken
    start()
    assert beside == [True] and consumer.alarms == [(alarm, "monitor.alert")] and message.acks == 1


def test_a_process_whose_main_process_died_hands_its_message_back_and_stops(running: RunningSteps) -> None:
    consumer = Consumer(running)
    messages = process(consumer, running)
    messages.parent = -1  # as if its parent were gone: another process adopted it
    message = Message(STEP_TASK)
    messages.on_message(body(STEP.to_payload()), message)
    assert consumer.handled == [] and (message.acks, message.requeues) == (0, 1)
    assert messages.should_stop


def test_while_a_handler_runs_the_note_holds_its_own_hard_limit(running: RunningSteps) -> None:
    # The main process kills at the note's deadline: for a handler no signal reaches, its
    # attempt's limit (timeout + grace), not its delivery's, which may cover steps run on.
    running.deliver("delivery-1", STEP, 26.0)
    delivered = running.note_of(_pid())
    seen = {}

    def handler(ctx: object) -> None:
        seen.update(running.note_of(_pid()))

    before = time.time()
    running.call(handler, None, 2.0)  # type: ignore[arg-type]
    assert seen["limit"] == 2.0 + running.grace
    assert before + 2.0 + running.grace + module_running.KILL_MARGIN <= seen["deadline"] <= time.time() + 4.0
    assert running.note_of(_pid())["deadline"] == delivered["deadline"] and running.note_of(_pid())["limit"] == 26.0
    # A step run on: the attempt in flight starts then.
    later = StepMessage("t1", "three", 2, 1, StepType.NORMAL, 1, "alpha", "step", 20.0, 0)
    running.begin("delivery-1", later, ran_on=True)
    assert running.note_of(_pid())["started"] > delivered["started"]
    assert running.note_of(_pid())["message"]["cursor"] == 1
    # A handler whose limit lies past its delivery's: the delivery's stays.
    running.call(lambda ctx: seen.update(running.note_of(_pid())), None, 60.0)  # type: ignore[arg-type]
    assert seen["limit"] == 26.0


def test_a_process_holding_several_deliveries_notes_each_and_its_death_reports_each(running: RunningSteps) -> None:
    """Group commit (shared.group_commit): every attempt held is noted; when the process
    dies, the attempt whose handler ran gets the reason, the others a loss of their own."""
    first = StepMessage("t1", "noop", 1, 0, StepType.NORMAL, 1, "alpha", "step", 20.0, 0)
    second = StepMessage("t2", "noop", 1, 0, StepType.NORMAL, 1, "alpha", "step", 20.0, 0)
    third = StepMessage("t3", "noop", 2, 1, StepType.NORMAL, 1, "beta", "step", 20.0, 0)
    before = time.time()
    running.hold("delivery-1", first, [second, third], 30.0)
    note = running.note_of(_pid())
    assert note["message"]["task_id"] == "t1" and note["running"] is None
    assert [o["task_id"] for o in note["others"]] == ["t2", "t3"]
    # Between handlers, the longest hard limit of the deliveries held, from when they last moved on.
    assert before + 30.0 <= note["deadline"] <= time.time() + 30.0 and note["limit"] == 30.0

    class Ctx:
        task_id = "t2"

    seen: dict[str, Any] = {}
    running.call(lambda ctx: seen.update(running.note_of(_pid())), Ctx(), 2.0)  # type: ignore[arg-type]
    assert seen["running"] == "t2" and seen["limit"] == 2.0 + running.grace
    after = running.note_of(_pid())
    assert after["running"] is None and after["limit"] == 30.0 and after["deadline"] >= note["deadline"]
    # A handler whose own limit lies past the deliveries': its own stands while it runs.
    running.call(lambda ctx: seen.update(running.note_of(_pid())), Ctx(), 600.0)  # type: ignore[arg-type]
    assert seen["limit"] == 600.0 + running.grace

    lost: list[tuple[str, str, bool]] = []

    class Lost:
        def lost(self, step: StepMessage, reason: str, timed_out: bool = False) -> None:
            lost.append((step.task_id, reason, timed_out))

    pool = module.ConsumerPool(lambda: None, Lost(), running, 1, 1.0, None)  # type: ignore[arg-type]
    # Read while t2's handler runs, as the main process reads it once the process is dead.
    running.call(lambda ctx: pool._report(_pid(), "killed after the hard time limit of 3s", True), Ctx(), 2.0)  # type: ignore[arg-type]
    assert lost == [
        ("t1", "worker process lost while it ran another step: killed after the hard time limit of 3s", False),
        ("t2", "killed after the hard time limit of 3s", True),
        ("t3", "worker process lost while it ran another step: killed after the hard time limit of 3s", False),
    ]
    assert [a["task_id"] for a in pool.in_flight()] == []  # no consumer process of its own: none listed
    running.finish()
    assert "message" not in running.note_of(_pid()) and "others" not in running.note_of(_pid())


def test_a_rabbitmq_release_is_read_as_numbers_up_to_what_is_not_one() -> None:
    assert _release("3.10.8") < (4, 3) <= _release("4.3.0") < _release("4.10")
    assert _release("4.3.0-rc.1") == (4, 3)
    assert _release("unknown") == ()


def test_a_stop_taken_by_the_inherited_handler_before_the_process_s_own_keeps_it_from_consuming(
    running: RunningSteps,
) -> None:
    """A SIGTERM that reaches a consumer process right after its fork, before it installs
    its own handler, runs the worker's handler it inherited: that sets the process's copy
    of ``stopping`` and nothing else. The process must not go on to consume."""
    made: list[str] = []

    class Messages:
        connection = contextlib.nullcontext()

        def run(self) -> None:
            made.append("consumed")  # a real one would consume until a SIGTERM that has come already

    stopping = threading.Event()
    stopping.set()  # as the inherited handler left it
    pool = module.ConsumerPool(lambda: Messages(), None, running, 1, 1.0, stopping)  # type: ignore[arg-type]
    previous = signal.getsignal(signal.SIGTERM)
    saved = sys.stdout, sys.stderr
    try:
        pool._serve()
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.stdout, sys.stderr = saved
    assert made == []
