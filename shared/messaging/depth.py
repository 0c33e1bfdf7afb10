"""How many step messages wait in each module queue, asked of the broker itself.

One cheap question per broker: RabbitMQ's passive queue_declare (its message
count), Redis's list lengths over the priority lists of a queue, the embedded
broker's count of visible rows (through kombu's index on ``visible``). Every
connection has a short timeout; callers bound the whole call too.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from sqlalchemy.engine import make_url

from shared.config import Settings


def queue_depths(settings: Settings, queues: Sequence[str], timeout: float) -> dict[str, int]:
    """Messages ready in each of ``queues`` (a queue never declared has none)."""
    url = settings.resolved_broker_url()
    if settings.is_embedded_broker():
        return _embedded(url, queues, timeout)
    if url.startswith(("amqp", "pyamqp")):
        return _rabbitmq(url, queues, timeout)
    if url.startswith(("redis", "rediss")):
        return _redis(url, queues, timeout)
    raise NotImplementedError(f"no queue depth for broker {url.split(':', 1)[0]}")


def _embedded(url: str, queues: Sequence[str], timeout: float) -> dict[str, int]:
    database = make_url(url[len("sqla+") :]).database
    depths = dict.fromkeys(queues, 0)
    if not database or not queues:
        return depths
    marks = ",".join("?" * len(queues))
    query = (
        "SELECT q.name, count(*) FROM kombu_message m JOIN kombu_queue q ON q.id = m.queue_id "
        f"WHERE m.visible = 1 AND q.name IN ({marks}) GROUP BY q.name"
    )
    try:
        conn = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=timeout)
    except sqlite3.OperationalError:
        return depths  # no broker file yet: nothing was ever published
    try:
        rows = conn.execute(query, list(queues)).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return depths  # no consumer or publisher created kombu's tables yet
        raise
    finally:
        conn.close()
    depths.update({str(name): int(n) for name, n in rows})
    return depths


def _rabbitmq(url: str, queues: Sequence[str], timeout: float) -> dict[str, int]:
    from kombu.connection import Connection

    depths: dict[str, int] = {}
    options = {"read_timeout": timeout, "write_timeout": timeout}
    with Connection(url, connect_timeout=timeout, transport_options=options) as conn:  # type: ignore[no-untyped-call]
        channel = conn.channel()
        for queue in queues:
            try:
                depths[queue] = int(channel.queue_declare(queue=queue, passive=True).message_count)
            except conn.channel_errors:  # 404: never declared, so empty
                depths[queue] = 0
                channel = conn.channel()  # the broker closed the channel that asked
        channel.close()
    return depths


def _redis(url: str, queues: Sequence[str], timeout: float) -> dict[str, int]:
    import redis

    from shared.messaging import MAX_PRIORITY

    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        pipe = client.pipeline(transaction=False)
        for queue in queues:
            # kombu keeps a queue as one list per priority level: "q", "q:1" … (sep ":").
            for name in [queue, *(f"{queue}:{level}" for level in range(1, MAX_PRIORITY + 1))]:
                pipe.llen(name)
        lengths = [int(n) for n in pipe.execute()]
    finally:
        client.close()
    per_queue = MAX_PRIORITY + 1
    return {queue: sum(lengths[i * per_queue : (i + 1) * per_queue]) for i, queue in enumerate(queues)}
