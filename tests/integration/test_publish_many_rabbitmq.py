"""A batch published on RabbitMQ: sent back to back, RabbitMQ's confirms waited for once."""

from __future__ import annotations

import socket
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Queue

from shared.config import Settings
from shared.messaging import (
    MAX_PRIORITY,
    BrokerUnavailable,
    CeleryPublisher,
    Confirms,
    make_celery,
    queue_name,
)
from shared.task import StepMessage
from tests.e2e.stack import free_port
from tests.integration.test_priority_rabbitmq import task_args_of
from tests.unit.redis.support import PRIORITY_ORDER, priority_examples, step_message


@pytest.mark.rabbitmq
def test_a_batch_lands_whole_and_keeps_the_delivery_order(broker_url: str, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, broker_url=broker_url)
    app = make_celery(settings)
    publisher = CeleryPublisher(app, settings)
    bulk = [step_message("alpha", seq=1, task_id=f"bulk-{i}", cursor=0, priority=-10) for i in range(300)]
    assert publisher.publish_many(priority_examples() + bulk) == []

    queue = Queue(queue_name("alpha"), routing_key=queue_name("alpha"), queue_arguments={"x-max-priority": MAX_PRIORITY})
    delivered = []
    with Connection(broker_url) as conn, conn.SimpleQueue(queue) as simple:
        for _ in range(len(PRIORITY_ORDER) + len(bulk)):
            message = simple.get(timeout=10)
            delivered.append(StepMessage.from_payload(task_args_of(message.body)[0]).task_id)
            message.ack()
        assert simple.qsize() == 0
    assert delivered[: len(PRIORITY_ORDER)] == PRIORITY_ORDER
    assert sorted(delivered[len(PRIORITY_ORDER) :]) == sorted(m.task_id for m in bulk)
    app.close()


@pytest.mark.rabbitmq
def test_batches_go_on_one_kept_connection_opened_again_when_it_broke_or_sat_idle(
    broker_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A connection opened per batch cost the API and RabbitMQ more CPU than the rest of
    # a submit; a confirm waited for per message, 0.45-0.85 ms each.
    settings = Settings(home=tmp_path, broker_url=broker_url)
    app = make_celery(settings)
    publisher = CeleryPublisher(app, settings)
    opened: list[object] = []
    connection_for_write = app.connection_for_write
    monkeypatch.setattr(app, "connection_for_write", lambda *a, **kw: opened.append(kw) or connection_for_write(*a, **kw))
    sizes = [1, 2, 5, 1, 19, 3, 40, 1]
    for i, size in enumerate(sizes):
        batch = [step_message("alpha", seq=1, task_id=f"kept-{i}-{n}", cursor=0) for n in range(size)]
        assert publisher.publish_many(batch) == []
    assert len(opened) == 1
    # The broker dropped it meanwhile: the batch goes on a new one, nothing failed, no pause.
    publisher._line._kept.conn.connection.transport.sock.shutdown(socket.SHUT_RDWR)
    assert publisher.publish_many([step_message("alpha", seq=1, task_id=f"broken-{n}", cursor=0) for n in range(3)]) == []
    assert len(opened) == 2 and publisher.healthy()
    # Idle longer than the broker may keep it: opened again before use.
    monkeypatch.setattr(publisher._line._kept, "IDLE_AT_MOST", 0.0)
    assert publisher.publish_many([step_message("alpha", seq=1, task_id="idle", cursor=0)]) == []
    assert len(opened) == 3
    queue = Queue(queue_name("alpha"), routing_key=queue_name("alpha"), queue_arguments={"x-max-priority": MAX_PRIORITY})
    with Connection(broker_url) as conn, conn.SimpleQueue(queue) as simple:
        assert simple.qsize() == sum(sizes) + 3 + 1
    publisher.close()
    app.close()


@pytest.mark.rabbitmq
def test_a_queue_is_declared_once_per_connection_and_again_after_a_reconnect(
    broker_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # send_task had kombu bind a copy of the queue per message just to find it declared.
    settings = Settings(home=tmp_path, broker_url=broker_url, continue_within=5, hard_timeout_grace=2)
    app = make_celery(settings)
    publisher = CeleryPublisher(app, settings)
    declared: list[str] = []
    declare = Queue.declare
    monkeypatch.setattr(Queue, "declare", lambda self, *a, **kw: declared.append(self.name) or declare(self, *a, **kw))
    messages = [step_message("alpha", seq=3, task_id=f"t-{i}", cursor=1) for i in range(6)]
    for message in messages[:5]:
        publisher.publish(message)
    assert declared == [queue_name("alpha")]
    with app.producer_or_acquire() as producer:
        producer.connection.close()  # kombu forgets what a closed connection declared
    publisher.publish(messages[5])
    assert declared == [queue_name("alpha")] * 2
    queue = Queue(queue_name("alpha"), routing_key=queue_name("alpha"), queue_arguments={"x-max-priority": MAX_PRIORITY})
    with Connection(broker_url) as conn, conn.SimpleQueue(queue) as simple:
        assert simple.qsize() == 6
        got = simple.get(timeout=5)
        # What a Celery worker reads: the task, its limits (timeout + continue_within, + grace) and the log text.
        assert got.headers["task"] == "asyncflow.step"
        assert got.headers["timelimit"] == [messages[0].timeout + 7, messages[0].timeout + 5]
        assert got.headers["argsrepr"] == "t-0 step 1 seq 3"
        args, kwargs, _ = got.decode()
        assert args[0]["task_id"] == "t-0" and kwargs == {}
        got.ack()
    app.close()


def test_a_batch_with_the_broker_unreachable_comes_back_whole_as_failed(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, broker_url=f"amqp://guest:guest@127.0.0.1:{free_port()}//")
    app = make_celery(settings)
    app.conf.broker_connection_timeout = 1
    app.conf.broker_connection_retry = False
    publisher = CeleryPublisher(app, settings)
    batch = priority_examples()
    failed = publisher.publish_many(batch)
    assert [m for m, _ in failed] == batch
    assert not publisher.healthy()
    # While paused, a batch fails at once without trying the broker.
    assert all(isinstance(exc, BrokerUnavailable) for _, exc in publisher.publish_many(batch))
    app.close()


class Channel:
    def __init__(self) -> None:
        self.events: defaultdict[str, set[Any]] = defaultdict(set)

    def confirm_select(self) -> None:
        pass

    def answer(self, kind: str, tag: int, multiple: bool = False) -> None:
        for callback in self.events[kind]:
            callback(tag, multiple)


def test_confirms_count_single_and_multiple_answers_and_nacks() -> None:
    channel = Channel()
    confirms = Confirms(channel)
    channel.answer("basic_ack", 3, multiple=True)  # 1 to 3
    channel.answer("basic_nack", 5)  # 4 still unanswered
    channel.answer("basic_ack", 7, multiple=True)  # 4 and 6, 7; 5 stays nacked
    assert confirms.settle(1, 8) == [True, True, True, True, False, True, True, False]
    # Once settled, a batch's answers are forgotten: a kept channel's grow no further.
    assert confirms.settle(1, 8) == [False] * 8
