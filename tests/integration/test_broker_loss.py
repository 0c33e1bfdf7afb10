"""Step messages kept in the broker's memory, and what the scheduler does once the broker lost them.

The database holds every step; RabbitMQ keeps step messages transient unless
``persistent_messages`` is set. A restart empties its queues: the canary
(shared.messaging.depth.CANARY) tells the scheduler, which then publishes again
the queued messages that come due instead of holding them behind the depth of a
queue refilled since.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection

from shared.config import Settings
from shared.flows import parse_flows
from shared.messaging import queue_name
from shared.messaging.depth import CANARY, QueueDepths
from shared.runtime import Runtime
from shared.storage import InMemoryStore
from shared.task import Alarm
from shared.testing import ManualClock
from tests.conftest import redis_db, require_service, unreachable

FLOWS = parse_flows({"flows": {"one": {"steps": [{"normal": {"module": "m", "command": "c", "timeout": 10}}]}}})
QUEUE = queue_name("m")
REQUEUE_AFTER = 5.0


def _runtime(settings: Settings, clock: ManualClock) -> Runtime:
    return Runtime(settings, flows=FLOWS, store=InMemoryStore(), clock=clock)


def _lose_everything(url: str, *queues: str) -> None:
    """What a RabbitMQ restart does to transient messages: every queue emptied, the canary's too."""
    with Connection(url) as conn:
        channel = conn.default_channel
        for queue in (*queues, CANARY):
            channel.queue_purge(queue)


def _delivery_modes(url: str, queue: str) -> list[int]:
    modes = []
    with Connection(url) as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            modes.append(message.properties["delivery_mode"])
    return modes


@pytest.mark.rabbitmq
def test_the_canary_tells_a_lost_broker_once_to_whoever_asks_first(broker_url: str, tmp_path: Path) -> None:
    depths = QueueDepths(Settings(home=tmp_path, broker_url=broker_url), 5.0)
    others = QueueDepths(Settings(home=tmp_path, broker_url=broker_url), 5.0)
    try:
        assert depths.lost()  # a broker never asked: nothing says it kept anything
        assert not depths.lost() and not others.lost()
        _lose_everything(broker_url)
        assert others.lost()
        assert not depths.lost() and not others.lost()
        # The canary is not a queue of the modules' and goes as step messages go: transient.
        assert depths([CANARY]) == {CANARY: 1}
        assert _delivery_modes(broker_url, CANARY) == [1]
    finally:
        depths.close()
        others.close()


@pytest.mark.rabbitmq
def test_a_loss_is_told_though_the_canary_put_in_its_place_was_not_confirmed(
    broker_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from amqp.channel import Channel

    depths = QueueDepths(Settings(home=tmp_path, broker_url=broker_url), 5.0)
    try:
        assert depths.lost()
        _lose_everything(broker_url)
        sent = Channel.basic_publish_confirm

        def unconfirmed(self: Channel, *args: Any, **kwargs: Any) -> None:
            sent(self, *args, **kwargs)
            raise TimeoutError("no confirm")  # it landed all the same

        monkeypatch.setattr(Channel, "basic_publish_confirm", unconfirmed)
        # Asked again on a new connection, the new canary is there: the loss is told anyway.
        assert depths.lost()
        monkeypatch.undo()
        assert not depths.lost()
    finally:
        depths.close()


@pytest.mark.redis
def test_on_redis_the_canary_is_a_key_a_restart_without_its_data_loses() -> None:
    require_service("Redis", unreachable(6379))
    import redis

    url = f"redis://127.0.0.1:6379/{redis_db()}"
    client = redis.Redis.from_url(url)
    client.delete(CANARY)
    depths = QueueDepths(Settings(broker_url=url), 5.0)
    try:
        assert depths.lost()
        assert not depths.lost()
        client.flushdb()  # what a restart without persistence leaves
        assert depths.lost()
        assert not depths.lost()
    finally:
        client.delete(CANARY)
        client.close()


def test_the_embedded_broker_keeps_its_messages_in_a_file(tmp_path: Path) -> None:
    assert not QueueDepths(Settings(home=tmp_path), 5.0).lost()


@pytest.fixture
def rabbitmq_runtime(broker_url: str, tmp_path: Path) -> Iterator[tuple[Runtime, ManualClock, QueueDepths]]:
    clock = ManualClock()
    # A lease the manual clock's jumps never outlast, and a sweep pass never cut short by it.
    settings = Settings(home=tmp_path, broker_url=broker_url, requeue_after=REQUEUE_AFTER, scheduler_lease_ttl=600)
    runtime = _runtime(settings, clock)
    depths = QueueDepths(runtime.settings, 5.0)
    try:
        yield runtime, clock, depths
    finally:
        depths.close()
        runtime.close()


@pytest.mark.rabbitmq
def test_queued_steps_the_broker_lost_are_published_again_when_due_however_deep_their_queue(
    rabbitmq_runtime: tuple[Runtime, ManualClock, QueueDepths], broker_url: str
) -> None:
    runtime, clock, depths = rabbitmq_runtime
    service, scheduler = runtime.service, runtime.scheduler
    scheduler.step()  # leads, and plants the canary: a broker never asked
    clock.advance(1)
    for _ in range(3):
        service.submit("one", {})
    clock.advance(REQUEUE_AFTER)

    # Not started in time, but their queue holds three messages: most likely theirs, left there.
    scheduler.step()
    assert depths([QUEUE]) == {QUEUE: 3}

    _lose_everything(broker_url, QUEUE)  # the broker restarts
    for _ in range(2):
        service.submit("one", {})  # the queue holds messages again, none of the three
    clock.advance(REQUEUE_AFTER)

    scheduler.step()
    # All five due were published again: the three lost, and the two new ones once more.
    assert depths([QUEUE]) == {QUEUE: 7}

    # Once requeue_after has passed since the loss was seen, a backlog holds them back again.
    clock.advance(REQUEUE_AFTER)
    scheduler.step()
    assert depths([QUEUE]) == {QUEUE: 7}


@pytest.mark.rabbitmq
@pytest.mark.parametrize(("persistent", "mode"), [(False, 1), (True, 2)])
def test_step_messages_are_transient_unless_set_persistent(
    broker_url: str, tmp_path: Path, persistent: bool, mode: int
) -> None:
    settings = Settings(home=tmp_path, broker_url=broker_url, persistent_messages=persistent)
    runtime = _runtime(settings, ManualClock())
    try:
        runtime.service.submit("one", {})
        assert _delivery_modes(broker_url, QUEUE) == [mode]
        # An alarm is not in the database to be published again: persistent either way.
        runtime.broker_publisher.alarm(Alarm("t", "one", 3, 0, "m", "c", "failed"))
        assert _delivery_modes(broker_url, queue_name("monitor")) == [2]
    finally:
        runtime.close()
