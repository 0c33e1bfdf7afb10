"""A publisher that keeps messages in memory: the broker of in-process tests."""

from __future__ import annotations

from collections import deque

from shared.task import Alarm, StepMessage


class QueuePublisher:
    """Keeps published messages in memory, in order."""

    def __init__(self) -> None:
        self.messages: deque[StepMessage] = deque()
        self.alarms: list[Alarm] = []

    def publish(self, message: StepMessage) -> None:
        self.messages.append(message)

    def alarm(self, alarm: Alarm) -> None:
        self.alarms.append(alarm)

    def healthy(self) -> bool:
        return True
