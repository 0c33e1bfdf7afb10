"""A publisher that keeps messages in memory: the broker of in-process tests."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from shared.service import publish_each
from shared.task import Alarm, StepMessage


class QueuePublisher:
    """Keeps published messages in memory, in order."""

    def __init__(self) -> None:
        self.messages: deque[StepMessage] = deque()
        self.alarms: list[Alarm] = []

    def publish(self, message: StepMessage) -> None:
        self.messages.append(message)

    def publish_many(self, messages: Sequence[StepMessage]) -> list[tuple[StepMessage, Exception]]:
        return publish_each(self, messages)

    def alarm(self, alarm: Alarm) -> None:
        self.alarms.append(alarm)

    def healthy(self) -> bool:
        return True
