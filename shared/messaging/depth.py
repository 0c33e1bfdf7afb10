"""How many step messages wait in each module queue, asked of the broker itself.

One cheap question per broker: RabbitMQ's passive queue_declare (its message
count), Redis's list lengths over the priority lists of a queue, the embedded
broker's count of visible rows (through kombu's index on ``visible``). Every
connection has a short timeout; callers bound the whole call too.

And whether the broker lost the messages it held (:meth:`QueueDepths.lost`): step
messages are transient by default, so a restart empties the queues, and a depth
no longer says that a queued step's message is among those waiting.

The scheduler asks at every pass while a batch's first steps wait (every 0.2 s),
so :class:`QueueDepths` keeps its RabbitMQ connection between questions: opening
one costs more than the question, and the broker logs each connection opened and
closed.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import make_url

from shared.config import Settings
from shared.messaging import step_delivery_mode
from shared.messaging.kept import KeptConnection

T = TypeVar("T")

# A message of the broker's own, kept where no consumer reads it: gone, the broker
# lost what it held. Not under the modules' queue prefix, so no module's queue has its name.
CANARY = "asyncflow-canary"


class QueueDepths:
    """Asks the broker how many messages are ready in queues, over a connection kept between questions.

    Thread-safe. The connection is opened again after a failure (a question on a
    kept connection that fails is asked once more on a new one), after an idle
    spell long enough for the broker or a firewall to have dropped it, and in a
    forked process (:class:`KeptConnection`).
    """

    def __init__(self, settings: Settings, timeout: float) -> None:
        self.settings = settings
        self.timeout = timeout
        self._lock = threading.Lock()
        self._kept = KeptConnection("queue depth")
        self._channel: Any = None
        self._closed = False
        self._canary_missing = False  # by the question under way (lost)
        ref = weakref.ref(self)

        def unlocked_in_child() -> None:  # a question under way in another thread stays in the parent
            depths = ref()
            if depths is not None:
                depths._lock = threading.Lock()

        os.register_at_fork(after_in_child=unlocked_in_child)

    def __call__(self, queues: Sequence[str]) -> dict[str, int]:
        """Messages ready in each of ``queues`` (a queue never declared has none)."""
        url, kind = self.settings.resolved_broker_url(), self.settings.broker_kind()
        if kind == "embedded":
            return _embedded(url, queues, self.timeout)
        if kind == "redis":
            return _redis(url, queues, self.timeout)
        if kind != "rabbitmq":
            raise NotImplementedError(f"no queue depth for broker {url.split(':', 1)[0]}")
        return self._asked(url, lambda: {queue: self._ready(queue) for queue in queues})

    def lost(self) -> bool:
        """Whether the broker lost the messages it held since anyone last asked this.

        Told by the canary (``CANARY``), published as step messages are: found
        missing, the broker restarted (or the canary's queue was purged) since it was
        put there, and a new one takes its place. So True the first time a broker is
        asked, and a loss is told once, to whoever asks first: the leading scheduler
        alone asks. The embedded broker keeps its messages in a file: never.
        """
        url, kind = self.settings.resolved_broker_url(), self.settings.broker_kind()
        if kind == "embedded":
            return False
        if kind == "redis":
            return _redis_lost(url, self.timeout)
        if kind != "rabbitmq":
            raise NotImplementedError(f"no canary on broker {url.split(':', 1)[0]}")
        self._canary_missing = False
        try:
            return self._asked(url, self._canary_lost) or self._canary_missing
        except Exception:
            # Found missing, then its successor not confirmed: the loss is told now, or
            # never (the next question may find that successor there after all).
            if self._canary_missing:
                return True
            raise

    def _asked(self, url: str, question: Callable[[], T]) -> T:
        with self._lock:
            try:
                kept = self._kept.fit()
                try:
                    return self._on_channel(url, question)
                except Exception:
                    self._drop()
                    if not kept:
                        raise
                # Most likely the broker restarted while the connection sat here: once more, on a new one.
                try:
                    return self._on_channel(url, question)
                except Exception:
                    self._drop()
                    raise
            finally:
                if self._closed:  # closed while this question was under way
                    self._drop()

    def _on_channel(self, url: str, question: Callable[[], T]) -> T:
        from kombu.connection import Connection

        if self._channel is None or not self._kept.owned():  # none yet, or the parent's, inherited at a fork
            options = {"read_timeout": self.timeout, "write_timeout": self.timeout}
            conn = self._kept.open(lambda: Connection(url, connect_timeout=self.timeout, transport_options=options))  # type: ignore[no-untyped-call]
            # One try: kombu's own second one would come 2 s later, and the caller asks again anyway.
            conn.ensure_connection(max_retries=0, reraise_as_library_errors=False)
            self._channel = conn.channel()
        answer = question()
        self._kept.used()
        return answer

    def _ready(self, queue: str) -> int:
        conn = self._kept.conn
        try:
            return int(self._channel.queue_declare(queue=queue, passive=True).message_count)
        except conn.channel_errors:  # 404: never declared, so empty
            if not self._channel.is_open:  # the broker closed it; py-amqp opens it again itself
                self._channel = conn.channel()
            return 0

    def _canary_lost(self) -> bool:
        if self._ready(CANARY):
            return False
        self._canary_missing = True
        self._channel.queue_declare(queue=CANARY, durable=True, auto_delete=False)
        canary = self._channel.prepare_message(b"", properties={"delivery_mode": step_delivery_mode(self.settings)})
        # Confirmed: in its queue by the time the loss is told, for whoever asks next.
        self._channel.basic_publish_confirm(canary, exchange="", routing_key=CANARY, confirm_timeout=self.timeout)
        return True

    def _drop(self) -> None:
        self._kept.drop()
        self._channel = None

    def close(self) -> None:
        """Close the connection; one held by a question under way closes when it ends."""
        self._closed = True
        if self._lock.acquire(timeout=self.timeout):
            try:
                self._drop()
            finally:
                self._lock.release()


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


def _redis_lost(url: str, timeout: float) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        # Set only where missing: the key is the canary, and a Redis that restarted without its data lost it.
        return bool(client.set(CANARY, b"", nx=True))
    finally:
        client.close()
