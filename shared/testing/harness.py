"""Run flows and modules in one process: no broker, no server, a manual clock.

    harness = Harness(flows, {"resource": resource.module})
    task, _ = harness.service.submit("create_mysql_instance", {"Cpu": 1})
    harness.run()              # drains queues; advances the clock over backoffs
    assert harness.service.get(task.task_id).status is TaskStatus.SUCCESS
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from shared.config import Settings
from shared.consumer import StepConsumer
from shared.flows import FlowSet
from shared.module import Module
from shared.scheduler import sweep_tasks
from shared.service import TaskService, timing_of
from shared.storage import InMemoryStore, Outstanding, TaskStore
from shared.task import StepMessage
from shared.testing.clock import ManualClock
from shared.testing.fakes import QueuePublisher


class Harness:
    def __init__(
        self,
        flows: FlowSet,
        modules: Mapping[str, Module],
        store: TaskStore | None = None,
        settings: Settings | None = None,
    ) -> None:
        settings = settings or Settings(home=Path(".asyncflow-test"))
        self.clock = ManualClock()
        self.store = store or InMemoryStore()
        self.publisher = QueuePublisher()
        self.service = TaskService(self.store, self.publisher, flows, clock=self.clock, timing=timing_of(settings))
        self.consumer = StepConsumer(self.service, modules, settings, clock=self.clock)
        self.delivered: list[StepMessage] = []

    def run(self, max_messages: int = 10_000) -> None:
        """Deliver every message, jumping the clock to each waiting message's due time."""
        for _ in range(max_messages):
            if self.publisher.messages:
                message = self.publisher.messages.popleft()
                self.delivered.append(message)
                self.consumer.handle(message)
                continue
            if not self._release_due():
                return
        raise RuntimeError("flow did not settle")

    def _release_due(self) -> bool:
        due = [entry for kind in Outstanding for entry in self.store.due(float("inf"), 1, kind)]
        if not due:
            return False
        due_at = []
        for task_id, _, _ in due:
            task = self.store.get(task_id)
            assert task is not None and task.active is not None and task.active.due_at is not None
            due_at.append(task.active.due_at)
        self.clock.now = max(self.clock.now, min(due_at))
        sweep_tasks(self.service, self.clock.now)
        return True
