"""What CeleryPublisher puts on Redis: one list per module, Celery's message format, kombu's acks."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

import fakeredis
import pytest
from kombu import Queue

from shared.messaging import ALARM_TASK, STEP_TASK, CeleryPublisher, queue_name
from shared.states import StepType
from shared.task import Alarm, StepMessage
from tests.unit.redis.support import (
    PRIORITY_ORDER,
    envelopes,
    message_keys,
    priority_examples,
    step_message,
    task_args,
)

MakePublisher = Callable[..., CeleryPublisher]


def alarm_of(seq: int = 7) -> Alarm:
    return Alarm("t-1", "attach_beta", seq, 1, "beta", "detach", "RuntimeError: still attached")


def test_a_step_message_lands_on_its_module_list_as_a_celery_step_task(
    make_publisher: MakePublisher, redis_client: fakeredis.FakeRedis
) -> None:
    parameters = {"Size": 2, "Tags": ["a", "b"], "Name": "café", "Deep": {"x": 1.5, "y": None}}
    message = step_message("alpha", parameters=parameters)

    make_publisher().publish(message)

    assert message_keys(redis_client) == {"asyncflow.alpha"}
    (envelope,) = envelopes(redis_client, "asyncflow.alpha")
    assert envelope["headers"]["task"] == STEP_TASK
    assert envelope["content-type"] == "application/json"
    assert envelope["properties"]["delivery_info"]["routing_key"] == "asyncflow.alpha"
    (payload,) = task_args(envelope)
    assert StepMessage.from_payload(payload) == message


def test_each_message_is_the_one_celery_would_build_for_it(
    make_publisher: MakePublisher, redis_client: fakeredis.FakeRedis
) -> None:
    # Built from a template Celery made once (CeleryPublisher._template): every header,
    # property and embedded option as Celery's own message for the same id has them.
    publisher = make_publisher()
    sent = [step_message("alpha", seq=seq) for seq in (1, 2)]
    for message in sent:
        publisher.publish(message)

    stored = envelopes(redis_client, "asyncflow.alpha")
    assert len({e["headers"]["id"] for e in stored}) == 2
    for envelope, message in zip(stored, sent, strict=True):
        task_id, (limit, soft) = envelope["headers"]["id"], envelope["headers"]["timelimit"]
        (payload,) = task_args(envelope)
        assert StepMessage.from_payload(payload) == message
        headers, properties, body, _ = publisher.app.amqp.create_task_message(
            task_id,
            STEP_TASK,
            [payload],
            None,
            time_limit=limit,
            soft_time_limit=soft,
            argsrepr=f"{message.task_id} step {message.cursor} seq {message.seq}",
            kwargsrepr="",
        )
        assert envelope["headers"] == headers
        assert {k: envelope["properties"][k] for k in properties} == properties
        assert json.loads(base64.b64decode(envelope["body"])) == json.loads(json.dumps(body))


@pytest.mark.parametrize(
    ("timeout", "within", "grace"), [(10.0, 5.0, 5.0), (300.0, 0.0, 2.5), (0.5, 1.0, 0.0), (3600.0, 5.0, 60.0)]
)
def test_the_time_limits_are_the_step_timeout_plus_continue_within_and_then_the_grace(
    make_publisher: MakePublisher, redis_client: fakeredis.FakeRedis, timeout: float, within: float, grace: float
) -> None:
    # The delivery may go on with the flow's next steps for continue_within seconds
    # past its own step's timeout; the hard limit comes the grace after that.
    make_publisher(hard_timeout_grace=grace, continue_within=within).publish(step_message("beta", timeout=timeout))

    (envelope,) = envelopes(redis_client, "asyncflow.beta")
    assert envelope["headers"]["timelimit"] == [timeout + within + grace, timeout + within]


def test_messages_keep_their_order_on_each_module_list(
    make_publisher: MakePublisher, redis_client: fakeredis.FakeRedis
) -> None:
    publisher = make_publisher()
    sent = [step_message("alpha" if seq % 3 else "beta", seq=seq) for seq in range(1, 10)]
    for message in sent:
        publisher.publish(message)

    assert message_keys(redis_client) == {"asyncflow.alpha", "asyncflow.beta"}
    for module in ("alpha", "beta"):
        stored = envelopes(redis_client, queue_name(module))
        assert [StepMessage.from_payload(task_args(e)[0]) for e in stored] == [
            m for m in sent if m.module == module
        ]


def test_a_message_taken_but_not_acknowledged_goes_back_when_the_consumer_connection_closes(
    make_publisher: MakePublisher, redis_client: fakeredis.FakeRedis
) -> None:
    publisher = make_publisher()
    message = step_message("alpha", type=StepType.ROLLBACK, command="delete")
    publisher.publish(message)

    consumer = publisher.app.connection_for_read()
    try:
        taken = Queue("asyncflow.alpha", channel=consumer.default_channel).get(no_ack=False)
        assert taken is not None
        assert StepMessage.from_payload(taken.decode()[0][0]) == message
        assert envelopes(redis_client, "asyncflow.alpha") == []
        assert redis_client.hlen("unacked") == 1
    finally:
        consumer.close()

    assert redis_client.hlen("unacked") == 0
    (envelope,) = envelopes(redis_client, "asyncflow.alpha")
    assert StepMessage.from_payload(task_args(envelope)[0]) == message

    again = publisher.app.connection_for_read()
    try:
        retaken = Queue("asyncflow.alpha", channel=again.default_channel).get(no_ack=False)
        assert retaken is not None
        retaken.ack()
    finally:
        again.close()
    assert message_keys(redis_client) == set()


def test_an_alarm_goes_to_the_monitor_list_as_an_alarm_task(
    make_publisher: MakePublisher, redis_client: fakeredis.FakeRedis
) -> None:
    alarm = alarm_of()

    make_publisher().alarm(alarm)

    assert message_keys(redis_client) == {"asyncflow.monitor"}
    (envelope,) = envelopes(redis_client, "asyncflow.monitor")
    assert envelope["headers"]["task"] == ALARM_TASK
    assert envelope["content-type"] == "application/json"
    (payload,) = task_args(envelope)
    assert Alarm(**payload) == alarm


def test_the_alarm_queue_follows_the_alert_command(
    make_publisher: MakePublisher, redis_client: fakeredis.FakeRedis
) -> None:
    make_publisher(alert_command="pager.page").alarm(alarm_of())

    assert message_keys(redis_client) == {"asyncflow.pager"}
    (envelope,) = envelopes(redis_client, "asyncflow.pager")
    assert envelope["headers"]["task"] == ALARM_TASK
    assert Alarm(**task_args(envelope)[0]) == alarm_of()


def test_an_empty_alert_command_publishes_no_alarm(
    make_publisher: MakePublisher, redis_client: fakeredis.FakeRedis
) -> None:
    make_publisher(alert_command="").alarm(alarm_of())

    assert redis_client.keys("*") == []


def test_a_flow_under_way_is_delivered_before_new_ones_then_by_task_priority(
    make_publisher: MakePublisher, redis_client: fakeredis.FakeRedis
) -> None:
    publisher = make_publisher()
    for message in priority_examples():
        publisher.publish(message)
    delivered = [StepMessage.from_payload(task_args(e)[0]).task_id for e in envelopes(redis_client, "asyncflow.alpha")]
    assert delivered == PRIORITY_ORDER


def test_publish_many_puts_each_message_as_publish_would(
    make_publisher: MakePublisher, redis_client: fakeredis.FakeRedis
) -> None:
    sent = priority_examples()
    assert make_publisher().publish_many(sent) == []
    payloads = [StepMessage.from_payload(task_args(e)[0]) for e in envelopes(redis_client, "asyncflow.alpha")]
    assert sorted(p.task_id for p in payloads) == sorted(m.task_id for m in sent)
