"""Builds the parts one process needs from Settings, lazily, without globals."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import cached_property

from celery import Celery

from shared.config import Settings
from shared.consumer import StepConsumer
from shared.flows import FlowsError, FlowSet, load_flows
from shared.messaging import CeleryPublisher, call_with_time_limit, make_celery, serve_steps
from shared.module import Module
from shared.pull.service import PullService
from shared.pull.steps import RoutingPublisher, StepLeases, StepQueue
from shared.scheduler import Scheduler
from shared.service import Publisher, TaskService, timing_of
from shared.storage import InMemoryPullStore, InMemoryStore, PullStore, SqlStore, TaskStore, open_store
from shared.storage.sql_pull import SqlPullStore

log = logging.getLogger(__name__)


class Runtime:
    def __init__(
        self,
        settings: Settings,
        flows: FlowSet | None = None,
        store: TaskStore | None = None,
        publisher: Publisher | None = None,
        clock: Callable[[], float] = time.time,
        pull_store: PullStore | None = None,
    ) -> None:
        """``flows``, the stores, ``publisher`` and ``clock`` replace the configured ones (tests, embedding)."""
        self.settings = settings
        self.clock = clock
        self._flows = flows
        self._store = store
        self._publisher = publisher
        self._pull_store = pull_store

    @cached_property
    def flows(self) -> FlowSet:
        return self._flows or load_flows(self.settings.flows)

    @cached_property
    def store(self) -> TaskStore:
        return self._store or open_store(self.settings.resolved_database_url())

    @cached_property
    def celery(self) -> Celery:
        return make_celery(self.settings)

    @cached_property
    def pull_store(self) -> PullStore:
        """v1 pull-mode tasks live in the same database as the saga's."""
        if self._pull_store is not None:
            return self._pull_store
        if isinstance(self.store, SqlStore):
            return SqlPullStore(self.store)
        if isinstance(self.store, InMemoryStore):
            return InMemoryPullStore()
        raise RuntimeError(f"no v1 task storage goes with {type(self.store).__name__}; pass pull_store")

    @cached_property
    def service(self) -> TaskService:
        s = self.settings
        publisher = self._publisher or CeleryPublisher(self.celery, s)
        pull_modules = self.flows.pull_modules()
        if pull_modules:
            publisher = RoutingPublisher(publisher, StepQueue(self.pull_store, pull_modules, s.expire_grace, self.clock))
        timing = timing_of(s)
        return TaskService(self.store, publisher, self.flows, clock=self.clock, timing=timing)

    @cached_property
    def pull_service(self) -> PullService:
        steps = None
        if self.flows.pull_modules():
            steps = StepLeases(self.service, self.pull_store, self.flows, self.settings.expire_grace)
        return PullService(self.pull_store, clock=self.clock, steps=steps)

    def load_modules(self, names: list[str]) -> dict[str, Module]:
        """Import ``names`` and check they provide every command the flows use."""
        known = self.flows.module_names()
        unknown = [n for n in names if n not in known]
        if unknown:
            raise FlowsError(
                [
                    f"{self.flows.source}: no flow uses module(s) {', '.join(unknown)}; "
                    f"known modules: {', '.join(sorted(known))}"
                ]
            )
        return self.flows.check_commands(only=names)

    @cached_property
    def scheduler(self) -> Scheduler:
        return Scheduler(self.service, self.pull_service, self.settings.scheduler_tick, self.clock)

    def consumer(self, names: list[str]) -> StepConsumer:
        """The step consumer of a worker serving ``names``, with its Celery tasks registered."""
        modules = self.load_modules(names)
        consumer = StepConsumer(self.service, modules, self.settings, invoke=call_with_time_limit)
        serve_steps(self.celery, consumer)
        return consumer

    def close(self) -> None:
        if "store" in self.__dict__:
            self.store.close()
