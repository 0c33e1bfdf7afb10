"""A whole runtime in one process: the real services over fakes at the edges."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shared.config import Settings
from shared.flows import FlowSet
from shared.runtime import Runtime
from shared.storage import InMemoryStore, PullStore, TaskStore
from shared.testing.clock import ManualClock
from shared.testing.fakes import QueuePublisher


@dataclass
class InProcess:
    """A :class:`Runtime` whose broker is a :class:`QueuePublisher` and whose time is a :class:`ManualClock`.

    The stores are in memory unless given (a SQL store for tests of the real database).
    Hand ``runtime`` to ``oss_api.testing.open_client`` to drive the HTTP API as well.
    """

    flows: FlowSet
    home: Path
    store: TaskStore = field(default_factory=InMemoryStore)
    pull_store: PullStore | None = None
    settings: Settings | None = None
    clock: ManualClock = field(default_factory=ManualClock)
    publisher: QueuePublisher = field(default_factory=QueuePublisher)

    def __post_init__(self) -> None:
        self.runtime = Runtime(
            self.settings or Settings(home=self.home),
            flows=self.flows,
            store=self.store,
            publisher=self.publisher,
            clock=self.clock,
            pull_store=self.pull_store,
        )
