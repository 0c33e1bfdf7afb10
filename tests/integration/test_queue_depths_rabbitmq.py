"""Queue depths asked of RabbitMQ over a kept connection (shared.messaging.depth.QueueDepths)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Queue

from shared.config import Settings
from shared.messaging import MAX_PRIORITY, queue_name
from shared.messaging.depth import QueueDepths


def _fill(url: str, module: str, n: int) -> None:
    queue = Queue(queue_name(module), routing_key=queue_name(module), queue_arguments={"x-max-priority": MAX_PRIORITY})
    with Connection(url) as conn, conn.SimpleQueue(queue) as simple:
        for i in range(n):
            simple.put({"n": i})


@pytest.mark.rabbitmq
def test_depths_go_on_one_kept_connection_opened_again_when_it_broke_or_sat_idle(
    broker_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scheduler asks at every pass while a batch's first steps wait: a connection per
    # question cost more than the question, and RabbitMQ logs each one opened and closed.
    _fill(broker_url, "alpha", 3)
    depths = QueueDepths(Settings(home=tmp_path, broker_url=broker_url), 5.0)
    opened: list[Any] = []
    real = Connection.__init__
    monkeypatch.setattr(Connection, "__init__", lambda self, *a, **kw: opened.append(1) or real(self, *a, **kw))
    queues = [queue_name("alpha"), queue_name("never-declared"), queue_name("alpha")]
    for _ in range(5):
        # A queue never declared is empty; the channel the broker closed for it is open again.
        assert depths(queues) == {queue_name("alpha"): 3, queue_name("never-declared"): 0}
    assert len(opened) == 1
    assert len(depths._kept.conn.connection.channels) <= 2  # no channel left behind by each 404
    # The broker dropped it meanwhile: asked again on a new one, without an error.
    depths._kept.conn.connection.transport.sock.shutdown(socket.SHUT_RDWR)
    assert depths([queue_name("alpha")]) == {queue_name("alpha"): 3}
    assert len(opened) == 2
    # Idle longer than the broker may keep it: opened again before use.
    monkeypatch.setattr(depths._kept, "IDLE_AT_MOST", 0.0)
    assert depths([queue_name("alpha")]) == {queue_name("alpha"): 3}
    assert len(opened) == 3
    depths.close()


def test_an_unreachable_broker_is_an_error_and_the_next_question_connects_again(tmp_path: Path) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    depths = QueueDepths(Settings(home=tmp_path, broker_url=f"amqp://guest:guest@127.0.0.1:{port}//"), 0.5)
    for _ in range(2):
        with pytest.raises(OSError):  # refused: the caller waits and asks again
            depths([queue_name("alpha")])
    assert depths._kept.conn is None


@pytest.mark.rabbitmq
def test_closed_it_keeps_no_connection(broker_url: str, tmp_path: Path) -> None:
    depths = QueueDepths(Settings(home=tmp_path, broker_url=broker_url), 5.0)
    assert depths([queue_name("alpha")]) == {queue_name("alpha"): 0}
    depths.close()
    assert depths._kept.conn is None
    assert depths([queue_name("alpha")]) == {queue_name("alpha"): 0}  # asked after the close: answered,
    assert depths._kept.conn is None  # and not kept
