"""Builds the parts one process needs from Settings, lazily, without globals."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import cached_property

from celery import Celery

from shared.config import Settings
from shared.consumer import StepConsumer
from shared.flows import FlowsError, FlowSet, ModuleDecl, load_flows
from shared.messaging import CeleryPublisher, make_celery, queue_name, serve_steps
from shared.messaging.depth import QueueDepths
from shared.messaging.running import RunningSteps
from shared.module import Module
from shared.pull.rules import TaskType
from shared.pull.service import PullService
from shared.pull.steps import RoutingPublisher, StepLeases, StepQueue, module_task_type
from shared.scheduler import Cadence, Scheduler
from shared.schedules.service import ScheduleService
from shared.service import Publisher, TaskService, timing_of
from shared.storage import InMemoryPullStore, InMemoryStore, PullStore, SqlStore, TaskStore, open_store
from shared.storage.base import ProcessStore, ScheduleStore
from shared.storage.memory import InMemoryProcessStore, InMemoryScheduleStore
from shared.storage.sql_processes import SqlProcessStore
from shared.storage.sql_pull import SqlPullStore
from shared.storage.sql_schedules import SqlScheduleStore

log = logging.getLogger(__name__)

# How long the requeue sweep waits for each of the broker's answers about queue depths
# before publishing again anyway: within the sweep pass's own budget (a tenth of the lease).
DEPTH_TIMEOUT = 0.5


def _pull_setup(module: str, flows: FlowSet, grace: float) -> tuple[ModuleDecl, TaskType] | None:
    """A pull-mode module's declaration and v1 task type under ``flows``; None if it is not pull-mode there."""
    decl = flows.pull_modules().get(module)
    return (decl, module_task_type(module, decl, flows, grace)) if decl is not None else None


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

    @property
    def flows(self) -> FlowSet:
        """flows.yaml as last loaded; :meth:`reload_flows` replaces it."""
        if self._flows is None:
            self._flows = load_flows(self.settings.flows)
        return self._flows

    def reload_flows(self, fresh: FlowSet | None = None) -> FlowSet:
        """Put ``fresh`` (default: flows.yaml read again) in place of the flows in use, for the tasks submitted from now on.

        Raises :class:`FlowsError` and keeps the flows in use when the file is
        invalid, or when it changes what this process set up from it at start:
        the pull-mode modules and the lease settings of their task types.
        """
        fresh = fresh or load_flows(self.settings.flows)
        before = self.flows
        grace = self.settings.expire_grace
        changed = sorted(
            name
            for name in set(before.pull_modules()) | set(fresh.pull_modules())
            if _pull_setup(name, before, grace) != _pull_setup(name, fresh, grace)
        )
        if changed:
            raise FlowsError(
                [
                    f"{fresh.source}: modules: pull-mode module(s) {', '.join(changed)} changed; "
                    "their queues and leases are set up at start: restart to apply this file"
                ]
            )
        self._flows = fresh
        if "service" in self.__dict__:
            self.service.flows = fresh
        return fresh

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
    def broker_publisher(self) -> CeleryPublisher:
        return CeleryPublisher(self.celery, self.settings)

    @cached_property
    def service(self) -> TaskService:
        s = self.settings
        publisher = self._publisher or self.broker_publisher
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
        heartbeat_timeout = timing_of(self.settings).heartbeat_timeout
        return PullService(self.pull_store, clock=self.clock, steps=steps, heartbeat_timeout=heartbeat_timeout)

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
    def schedule_store(self) -> ScheduleStore:
        """Schedules live in the same database as the tasks they create."""
        if isinstance(self.store, SqlStore):
            return SqlScheduleStore(self.store)
        pull = self.pull_store
        if isinstance(self.store, InMemoryStore) and isinstance(pull, InMemoryPullStore):
            return InMemoryScheduleStore(self.store, pull)
        raise RuntimeError(f"no schedule storage goes with {type(self.store).__name__}")

    @cached_property
    def process_store(self) -> ProcessStore:
        """The process registry (shared.presence) lives in the same database."""
        if isinstance(self.store, SqlStore):
            return SqlProcessStore(self.store)
        if isinstance(self.store, InMemoryStore):
            return InMemoryProcessStore()
        raise RuntimeError(f"no process registry goes with {type(self.store).__name__}")

    @cached_property
    def schedules(self) -> ScheduleService:
        return ScheduleService(self.schedule_store, self.service, self.pull_service, self.clock)

    @cached_property
    def scheduler(self) -> Scheduler:
        s = self.settings
        cadence = Cadence(
            sweep=s.scheduler_tick,
            lease_ttl=s.scheduler_lease_ttl,
            load_ahead=s.schedule_load_ahead,
            retention=s.schedule_runs_keep_days * 86400.0,
            retention_tasks=s.schedule_runs_delete_tasks,
            process_retention=s.process_retention,
        )
        return Scheduler(
            self.service,
            self.pull_service,
            self.schedules,
            cadence,
            self.clock,
            processes=self.process_store,
            # A publisher given in place of the configured one has no broker to ask.
            backlogged=self.backlogged_modules if self._publisher is None else None,
            room=self.queue_room if self._publisher is None else None,
            # The embedded broker keeps its messages in a file.
            broker_lost=self.queue_depths.lost if self._publisher is None and not s.is_embedded_broker() else None,
        )

    def backlogged_modules(self) -> frozenset[str]:
        """The push modules whose queues hold messages waiting now, as the broker counts them."""
        return frozenset(m for m, depth in self._depths().items() if depth > 0)

    def queue_room(self) -> dict[str, int]:
        """How many more of a batch's first steps each push module's queue may be given now.

        Nothing until half of the module's ``release_ahead`` (flows.yaml, else the
        setting's) is free: the steps then go in groups of a useful size, not a few
        at every pass as the queue drains.
        """
        room = {}
        for module, depth in self._depths().items():
            decl = self.flows.modules.get(module)
            ahead = decl.release_ahead if decl and decl.release_ahead else self.settings.release_ahead
            free = max(0, ahead - depth)
            room[module] = free if free * 2 >= ahead else 0
        return room

    @cached_property
    def queue_depths(self) -> QueueDepths:
        return QueueDepths(self.settings, DEPTH_TIMEOUT)

    def _depths(self) -> dict[str, int]:
        queues = {queue_name(m): m for m in sorted(self.flows.push_module_names())}
        depths = self.queue_depths(list(queues))
        return {m: depths.get(q, 0) for q, m in queues.items()}

    def consumer(self, names: list[str]) -> StepConsumer:
        """The step consumer of a worker serving ``names``, with its Celery tasks registered."""
        consumer, running = self.timed_consumer(names)
        serve_steps(self.celery, consumer, running)
        return consumer

    def timed_consumer(self, names: list[str]) -> tuple[StepConsumer, RunningSteps]:
        """The step consumer of a worker serving ``names``, each attempt under its own time limits."""
        running = RunningSteps(self.settings.hard_timeout_grace)
        return StepConsumer(self.service, self.load_modules(names), self.settings, invoke=running.call), running

    def close(self) -> None:
        if "queue_depths" in self.__dict__:
            self.queue_depths.close()
        if "broker_publisher" in self.__dict__:
            self.broker_publisher.close()
        if "store" in self.__dict__:
            self.store.close()
