"""On RabbitMQ, a flow under way is delivered before flows not yet started, then by task priority.

The queue is declared by the publisher with x-max-priority; the messages wait in
it (no consumer) and are then read in the order RabbitMQ hands them out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Queue

from shared.config import Settings
from shared.messaging import MAX_PRIORITY, CeleryPublisher, make_celery, queue_name
from shared.task import StepMessage
from tests.unit.redis.support import PRIORITY_ORDER, priority_examples

pytestmark = pytest.mark.rabbitmq


def test_started_flows_first_then_task_priority(broker_url: str, tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, broker_url=broker_url)
    app = make_celery(settings)
    publisher = CeleryPublisher(app, settings)
    sent = priority_examples()
    for message in sent:
        publisher.publish(message)

    queue = Queue(queue_name("alpha"), routing_key=queue_name("alpha"), queue_arguments={"x-max-priority": MAX_PRIORITY})
    delivered = []
    with Connection(broker_url) as conn, conn.SimpleQueue(queue) as simple:
        for _ in sent:
            message = simple.get(timeout=10)
            delivered.append(StepMessage.from_payload(task_args_of(message.body)[0]).task_id)
            message.ack()
    assert delivered == PRIORITY_ORDER
    app.close()


def task_args_of(body: str | bytes) -> list[Any]:
    """The positional arguments in Celery's protocol 2 body: [args, kwargs, embed]."""
    args, _kwargs, _embed = json.loads(body)
    return list(args)
