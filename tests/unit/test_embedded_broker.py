"""The embedded broker's wake-up: a consumer waiting on an empty queue is woken by
a publish (a write to the broker file), not by its poll interval."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from kombu import Connection

from shared.messaging.embedded import BrokerFileWatch, kombu_url, wake_for_stop, watch_for

pytest.importorskip("inotify_simple", reason="inotify wake-ups are Linux-only; elsewhere the broker polls")


def test_a_write_to_the_broker_file_wakes_the_wait_and_other_files_do_not(tmp_path: Path) -> None:
    broker = tmp_path / "broker.sqlite"
    broker.touch()
    watch = BrokerFileWatch(broker)
    try:
        started = time.monotonic()
        (tmp_path / "asyncflow.sqlite-wal").write_bytes(b"x")  # the task database: not ours
        watch.wait(0.3)
        assert time.monotonic() - started >= 0.3

        threading.Timer(0.05, lambda: (tmp_path / "broker.sqlite-wal").write_bytes(b"x")).start()
        started = time.monotonic()
        watch.wait(10)
        assert time.monotonic() - started < 5
    finally:
        watch.close()


def test_a_consumer_on_an_empty_queue_takes_a_published_message_without_waiting_for_a_poll(tmp_path: Path) -> None:
    url = kombu_url(f"sqla+sqlite:///{tmp_path / 'broker.sqlite'}")
    received: list[float] = []
    with Connection(url, transport_options={"polling_interval": 30}) as consumer_conn:
        queue = consumer_conn.SimpleQueue("wake")
        queue.put({"warm": True})  # creates the tables and the queue
        queue.get(timeout=5).ack()

        def consume() -> None:
            message = queue.get(timeout=20)  # an empty poll, then a wait on the file
            received.append(time.monotonic())
            message.ack()

        thread = threading.Thread(target=consume)
        thread.start()
        time.sleep(0.3)  # let it find the queue empty and start waiting
        with Connection(url) as producer_conn:
            sent = time.monotonic()
            producer_conn.SimpleQueue("wake").put({"n": 1})
        thread.join(25)
        queue.close()
    # The poll interval is 30 s: only the wake-up explains a delivery within seconds.
    assert received and received[0] - sent < 5


def test_no_watch_for_a_database_in_memory() -> None:
    assert watch_for("sqlite://") is None


def test_a_stopping_process_ends_the_wait_at_once_and_every_wait_after(tmp_path: Path) -> None:
    # A worker told to stop (SIGTERM) must not wait out the transport's timeout first.
    broker = tmp_path / "broker.sqlite"
    broker.touch()
    watch = BrokerFileWatch(broker)
    try:
        threading.Timer(0.05, wake_for_stop).start()
        started = time.monotonic()
        assert watch.wait(30) is True
        assert watch.wait(30) is True
        assert time.monotonic() - started < 5
    finally:
        watch.close()
