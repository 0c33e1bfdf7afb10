"""The pieces of the fake-Redis tier: flows, module handlers, a one-message-at-a-time worker.

The broker is kombu's real Redis transport whose redis-py connections talk to a
:class:`fakeredis.FakeServer` instead of a socket. fakeredis has no file
descriptors, so kombu's blocking ``drain_events`` cannot run; :class:`Worker`
takes messages one at a time with ``basic_get`` (a non-blocking pop), runs the
Celery task registered under the message's task name, then acknowledges it.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import fakeredis
from kombu import Queue
from kombu.message import Message

from shared.flows import parse_flows
from shared.messaging import MAX_PRIORITY, queue_name
from shared.module import Module, PermanentError, StepContext
from shared.runtime import Runtime
from shared.scheduler.sweeps import sweep_tasks
from shared.states import StepType
from shared.storage import Outstanding
from shared.task import StepMessage
from shared.testing import ManualClock

DB = 3
FLOW = "attach_beta"
MODULES = ("alpha", "beta", "monitor")
BACKOFF = 3.0  # beta.attach: max_retry_interval -3, a uniform 3 s between attempts

FLOWS = parse_flows(
    {
        "modules": {name: {"import": __name__} for name in MODULES},
        "flows": {
            FLOW: {
                "description": "create an alpha, then attach a beta to it",
                "steps": [
                    {
                        "normal": {"module": "alpha", "command": "create", "timeout": 10},
                        "rollback": {"module": "alpha", "command": "delete", "timeout": 10},
                    },
                    {
                        "normal": {
                            "module": "beta",
                            "command": "attach",
                            "timeout": 10,
                            "retry": 1,
                            "max_retry_interval": -BACKOFF,
                        },
                        "rollback": {"module": "beta", "command": "detach", "timeout": 10},
                    },
                ],
            }
        },
    },
    "redis-unit-flows",
)


# --- what the module handlers do ----------------------------------------------------

Behaviour = Callable[[StepContext], Mapping[str, Any] | None]


@dataclass(frozen=True)
class Call:
    command: str  # "module.command"
    step_type: int
    attempt: int
    parameters: Mapping[str, Any]


class Script:
    """Records every handler call and plays the behaviours a test planned for each command."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.alarms: list[tuple[str | None, dict[str, Any]]] = []
        self._plans: defaultdict[str, deque[Behaviour]] = defaultdict(deque)

    def reset(self) -> None:
        self.calls.clear()
        self.alarms.clear()
        self._plans.clear()

    def plan(self, command: str, *behaviours: Behaviour) -> None:
        """The next calls of ``command`` run these, in turn; later calls run its default."""
        self._plans[command].extend(behaviours)

    def run(self, command: str, ctx: StepContext, default: Behaviour) -> Mapping[str, Any] | None:
        self.calls.append(Call(command, ctx.step_type, ctx.attempt, dict(ctx.parameters)))
        plan = self._plans[command]
        return (plan.popleft() if plan else default)(ctx)

    def commands(self) -> list[tuple[str, int, int]]:
        return [(c.command, c.step_type, c.attempt) for c in self.calls]


SCRIPT = Script()


def flaky(ctx: StepContext) -> None:
    raise RuntimeError(f"flaky on attempt {ctx.attempt}")


def refuse(ctx: StepContext) -> None:
    raise PermanentError("no capacity left")


def done(ctx: StepContext) -> None:
    return None


alpha = Module("alpha")
beta = Module("beta")
monitor = Module("monitor")


@alpha.command("create")
def alpha_create(ctx: StepContext) -> Mapping[str, Any] | None:
    return SCRIPT.run("alpha.create", ctx, lambda c: {"AlphaId": f"alpha-{c.task_id}"})


@alpha.command("delete")
def alpha_delete(ctx: StepContext) -> Mapping[str, Any] | None:
    return SCRIPT.run("alpha.delete", ctx, done)


@beta.command("attach")
def beta_attach(ctx: StepContext) -> Mapping[str, Any] | None:
    return SCRIPT.run("beta.attach", ctx, lambda c: {"BetaOn": c.parameters["AlphaId"]})


@beta.command("detach")
def beta_detach(ctx: StepContext) -> Mapping[str, Any] | None:
    return SCRIPT.run("beta.detach", ctx, done)


@monitor.command("report_event")
def report_event(ctx: StepContext) -> None:
    SCRIPT.alarms.append((ctx.key, dict(ctx.parameters)))


# --- fake Redis ----------------------------------------------------------------------


def unique_broker_url() -> str:
    """kombu keeps connection pools per URL for the whole process: a fresh host per test."""
    return f"redis://redis-{uuid.uuid4().hex[:12]}:6379/{DB}"


def connection_class_on(server: fakeredis.FakeServer) -> type[fakeredis.FakeRedisConnection]:
    """A redis-py connection class whose every connection reaches ``server``."""

    class ServerConnection(fakeredis.FakeRedisConnection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["server"] = server
            super().__init__(*args, **kwargs)

    return ServerConnection


def message_keys(client: fakeredis.FakeRedis) -> set[str]:
    """Every key except kombu's bindings: the module queues (whatever the priority level of
    their lists) and the unacknowledged set."""
    keys = {key.decode() for key in client.keys("*")}
    return {_queue_of(key) for key in keys if not key.startswith("_kombu.binding")}


def _queue_of(key: str) -> str:
    queue, _, level = key.rpartition(":")
    return queue if queue and level.isdigit() else key


def priority_lists(queue: str) -> list[str]:
    """The Redis lists of ``queue``, in the order they are read: kombu keeps one per priority
    level, level 0 (read first) under the queue's own name."""
    return [queue] + [f"{queue}:{level}" for level in range(1, MAX_PRIORITY + 1)]


def envelopes(client: fakeredis.FakeRedis, queue: str) -> list[dict[str, Any]]:
    """The messages on ``queue`` in delivery order: by priority, then oldest first
    (kombu pushes on the left and pops on the right)."""
    return [json.loads(raw) for key in priority_lists(queue) for raw in reversed(client.lrange(key, 0, -1))]


def task_args(envelope: Mapping[str, Any]) -> list[Any]:
    """The positional arguments of the Celery task a stored message calls."""
    assert envelope["properties"]["body_encoding"] == "base64"
    args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
    return list(args)


def step_message(module: str = "alpha", seq: int = 1, timeout: float = 10.0, **changes: Any) -> StepMessage:
    values: dict[str, Any] = dict(
        task_id="t-" + uuid.uuid4().hex[:8],
        flow=FLOW,
        seq=seq,
        cursor=0,
        type=StepType.NORMAL,
        attempt=1,
        module=module,
        command="create",
        timeout=timeout,
        retry=0,
        parameters={"Size": 2, "Tags": ["a", "b"], "Name": "café"},
    )
    values.update(changes)
    return StepMessage(**values)


# --- the worker ----------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    queue: str
    task: str
    args: list[Any]
    at: float  # the manual clock when it ran

    @property
    def step(self) -> StepMessage:
        return StepMessage.from_payload(self.args[0])

    @property
    def label(self) -> tuple[str, str, StepType, int]:
        m = self.step
        return self.queue, f"{m.module}.{m.command}", m.type, m.attempt


@dataclass
class Worker:
    """A worker process for ``modules``, taking its messages off Redis one at a time."""

    runtime: Runtime
    clock: ManualClock
    modules: Iterable[str] = MODULES
    deliveries: list[Delivery] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.modules = tuple(self.modules)
        self.runtime.consumer(list(self.modules))  # registers the step and alarm tasks
        self.app = self.runtime.celery
        self.connection = self.app.connection_for_read()
        channel = self.connection.default_channel
        self.queues = [Queue(queue_name(m), channel=channel) for m in self.modules]

    def take(self) -> Message | None:
        """The next message of any of the worker's queues, unacknowledged; None when all are empty."""
        for queue in self.queues:
            message = queue.get(no_ack=False, accept=["json"])
            if message is not None:
                return message
        return None

    def handle(self, message: Message) -> Delivery:
        """Run the task the message names, as the worker's pool would; does not acknowledge."""
        args, kwargs, _embed = message.decode()
        task = message.headers["task"]
        delivery = Delivery(message.delivery_info["routing_key"], task, list(args), self.clock.now)
        self.deliveries.append(delivery)
        self.app.tasks[task](*args, **kwargs)
        return delivery

    def step(self) -> Delivery | None:
        message = self.take()
        if message is None:
            return None
        delivery = self.handle(message)
        message.ack()
        return delivery

    def run(self, tick: float = 0.5, limit: int = 500) -> list[Delivery]:
        """Deliver until Redis is empty and nothing is due; on an empty Redis the clock moves on a tick."""
        start = len(self.deliveries)
        for _ in range(limit):
            if self.step() is not None:
                continue
            if not any(self.runtime.service.due(float("inf"), 1, kind) for kind in Outstanding):
                return self.deliveries[start:]
            self.clock.advance(tick)
            sweep_tasks(self.runtime.service, self.clock.now)
        raise AssertionError(f"the flows did not settle within {limit} rounds")

    def steps(self) -> list[tuple[str, str, StepType, int]]:
        return [d.label for d in self.deliveries if d.task == "asyncflow.step"]

    def close(self) -> None:
        self.connection.close()


def priority_examples() -> list[StepMessage]:
    """Step messages of alpha in publish order; ``PRIORITY_ORDER`` is the order they must be delivered in."""
    return [
        step_message("alpha", seq=1, task_id="new", cursor=0),
        step_message("alpha", seq=2, task_id="urgent-new", cursor=0, priority=50),
        step_message("alpha", seq=3, task_id="under-way", cursor=2),
        step_message("alpha", seq=4, task_id="retrying", cursor=0, attempt=2),
        step_message("alpha", seq=5, task_id="low-new", cursor=0, priority=-5),
    ]


# A flow under way (a later step, a retry) first, then new flows by task priority.
PRIORITY_ORDER = ["under-way", "retrying", "urgent-new", "new", "low-new"]
