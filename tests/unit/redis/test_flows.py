"""Whole flows through the real CeleryPublisher and Celery tasks over fake Redis, outages included."""

from __future__ import annotations

from collections.abc import Callable

import fakeredis
import pytest
from kombu.exceptions import OperationalError

from shared.config import Settings
from shared.messaging import ALARM_TASK, BrokerUnavailable, CeleryPublisher
from shared.module import StepContext
from shared.runtime import Runtime
from shared.scheduler.sweeps import sweep_tasks
from shared.states import Phase, StepState, StepType, TaskStatus
from shared.storage import Outstanding
from shared.task import Alarm, StepMessage
from shared.testing import ManualClock, wait_for
from tests.unit.redis.support import (
    BACKOFF,
    FLOW,
    Script,
    Worker,
    envelopes,
    flaky,
    message_keys,
    refuse,
    step_message,
    task_args,
)

NORMAL, ROLLBACK = StepType.NORMAL, StepType.ROLLBACK
ALPHA_CREATE = ("asyncflow.alpha", "alpha.create", NORMAL, 1)
BETA_ATTACH = ("asyncflow.beta", "beta.attach", NORMAL, 1)


def queued(client: fakeredis.FakeRedis, queue: str) -> list[StepMessage]:
    return [StepMessage.from_payload(task_args(e)[0]) for e in envelopes(client, queue)]


def test_a_two_step_flow_succeeds_through_redis_and_leaves_it_empty(
    runtime: Runtime, worker: Worker, script: Script, redis_client: fakeredis.FakeRedis
) -> None:
    task, created = runtime.service.submit(FLOW, {"Region": "eu"})
    assert created
    assert [m.command for m in queued(redis_client, "asyncflow.alpha")] == ["create"]

    worker.run()

    done = runtime.service.get(task.task_id)
    assert done.status is TaskStatus.SUCCESS
    alpha_id = f"alpha-{task.task_id}"
    assert done.parameters == {"Region": "eu", "AlphaId": alpha_id, "BetaOn": alpha_id}
    assert [s.state for s in done.steps] == [StepState.SUCCEEDED, StepState.SUCCEEDED]
    assert worker.steps() == [ALPHA_CREATE, BETA_ATTACH]
    assert script.commands() == [("alpha.create", 0, 1), ("beta.attach", 0, 1)]
    assert message_keys(redis_client) == set()


def test_a_flaky_step_is_published_again_by_the_scheduler_after_its_backoff(
    runtime: Runtime, worker: Worker, script: Script, clock: ManualClock, redis_client: fakeredis.FakeRedis
) -> None:
    script.plan("beta.attach", flaky)
    task, _ = runtime.service.submit(FLOW, {})
    assert worker.step() is not None and worker.step() is not None

    waiting = runtime.service.get(task.task_id)
    assert waiting.active is not None and waiting.active.phase is Phase.WAITING
    assert (waiting.active.cursor, waiting.active.attempt) == (1, 2)
    assert waiting.active.due_at == clock.now + BACKOFF
    assert "flaky on attempt 1" in (waiting.steps[1].message or "")
    assert worker.step() is None
    assert message_keys(redis_client) == set()

    failed_at = clock.now
    clock.now = failed_at + BACKOFF - 0.5
    assert sweep_tasks(runtime.service, clock.now) == 0
    assert message_keys(redis_client) == set()
    clock.now = failed_at + BACKOFF
    assert sweep_tasks(runtime.service, clock.now) == 1
    (again,) = queued(redis_client, "asyncflow.beta")
    assert (again.command, again.attempt, again.seq) == ("attach", 2, waiting.active.seq)

    worker.run()

    assert runtime.service.get(task.task_id).status is TaskStatus.SUCCESS
    assert worker.steps() == [ALPHA_CREATE, BETA_ATTACH, ("asyncflow.beta", "beta.attach", NORMAL, 2)]
    assert worker.deliveries[-1].at - worker.deliveries[-2].at >= BACKOFF
    assert message_keys(redis_client) == set()


def test_a_failed_flow_compensates_both_steps_in_reverse_order_on_their_queues(
    runtime: Runtime, worker: Worker, script: Script, redis_client: fakeredis.FakeRedis
) -> None:
    script.plan("beta.attach", refuse)
    task, _ = runtime.service.submit(FLOW, {})

    worker.run()

    failed = runtime.service.get(task.task_id)
    assert failed.status is TaskStatus.FAILED
    assert "no capacity left" in (failed.message or "")
    assert [s.state for s in failed.steps] == [StepState.SUCCEEDED, StepState.FAILED]
    assert [s.rollback_state for s in failed.steps] == [StepState.SUCCEEDED, StepState.SUCCEEDED]
    assert worker.steps() == [
        ALPHA_CREATE,
        BETA_ATTACH,
        ("asyncflow.beta", "beta.detach", ROLLBACK, 1),
        ("asyncflow.alpha", "alpha.delete", ROLLBACK, 1),
    ]
    assert [c.command for c in script.calls] == ["alpha.create", "beta.attach", "beta.detach", "alpha.delete"]
    assert message_keys(redis_client) == set()


def test_a_failed_rollback_stops_the_task_and_its_alarm_reaches_the_monitor_through_redis(
    runtime: Runtime, worker: Worker, script: Script, redis_client: fakeredis.FakeRedis
) -> None:
    script.plan("beta.attach", refuse)
    script.plan("beta.detach", flaky)
    task, _ = runtime.service.submit(FLOW, {})

    worker.run()

    stopped = runtime.service.get(task.task_id)
    assert stopped.status is TaskStatus.ROLLBACK_FAILED
    assert [s.rollback_state for s in stopped.steps] == [StepState.PENDING, StepState.FAILED]
    assert "alpha.delete" not in [c.command for c in script.calls]

    alarm_delivery = worker.deliveries[-1]
    assert (alarm_delivery.queue, alarm_delivery.task) == ("asyncflow.monitor", ALARM_TASK)
    failed_rollback = worker.deliveries[-2].step
    assert worker.steps()[-1] == ("asyncflow.beta", "beta.detach", ROLLBACK, 1)
    alarm = Alarm(**alarm_delivery.args[0])
    error = "RuntimeError: flaky on attempt 1"
    assert alarm == Alarm(task.task_id, FLOW, failed_rollback.seq, 1, "beta", "detach", error)
    assert script.alarms == [(f"{task.task_id}:alarm:{alarm.seq}", alarm.to_parameters())]
    assert message_keys(redis_client) == set()


def test_publish_fails_while_redis_is_down_then_fails_fast_until_the_pause_is_over(
    make_publisher: Callable[..., CeleryPublisher],
    fake_server: fakeredis.FakeServer,
    redis_client: fakeredis.FakeRedis,
) -> None:
    publisher = make_publisher()
    publisher.publish(step_message(seq=1))
    assert publisher.healthy()

    fake_server.connected = False
    with pytest.raises(OperationalError):
        publisher.publish(step_message(seq=2))
    assert not publisher.healthy()

    fake_server.connected = True
    with pytest.raises(BrokerUnavailable):
        publisher.publish(step_message(seq=3))
    assert [m.seq for m in queued(redis_client, "asyncflow.alpha")] == [1]

    wait_for(publisher.healthy, 2.0, "the publisher's pause after a failure to end")
    publisher.publish(step_message(seq=4))
    assert [m.seq for m in queued(redis_client, "asyncflow.alpha")] == [1, 4]


def test_a_task_submitted_while_redis_is_down_is_published_by_the_sweep_once_it_is_back(
    runtime: Runtime,
    publisher: CeleryPublisher,
    worker: Worker,
    settings: Settings,
    clock: ManualClock,
    fake_server: fakeredis.FakeServer,
    redis_client: fakeredis.FakeRedis,
) -> None:
    fake_server.connected = False
    task, created = runtime.service.submit(FLOW, {"Region": "eu"})
    assert created and not publisher.healthy()

    stored = runtime.service.get(task.task_id)
    assert stored.status is TaskStatus.PENDING
    assert stored.active is not None and stored.active.phase is Phase.QUEUED
    assert stored.active.due_at == clock.now + settings.publish_retry

    fake_server.connected = True
    clock.advance(settings.publish_retry)
    outstanding = [(task.task_id, stored.active.seq, Phase.QUEUED)]
    assert runtime.service.due(clock.now, 10, Outstanding.SENT) == outstanding
    assert sweep_tasks(runtime.service, clock.now) == 0
    assert runtime.service.due(clock.now, 10, Outstanding.SENT) == outstanding
    assert message_keys(redis_client) == set()

    wait_for(publisher.healthy, 2.0, "the publisher's pause after a failure to end")
    assert sweep_tasks(runtime.service, clock.now) == 1
    assert [(m.task_id, m.seq) for m in queued(redis_client, "asyncflow.alpha")] == [
        (task.task_id, stored.active.seq)
    ]

    worker.run()

    assert runtime.service.get(task.task_id).status is TaskStatus.SUCCESS
    assert worker.steps() == [ALPHA_CREATE, BETA_ATTACH]
    assert message_keys(redis_client) == set()


def test_redis_down_after_a_step_succeeds_keeps_its_result_and_the_next_step_is_published_later(
    runtime: Runtime,
    publisher: CeleryPublisher,
    worker: Worker,
    script: Script,
    settings: Settings,
    clock: ManualClock,
    fake_server: fakeredis.FakeServer,
    redis_client: fakeredis.FakeRedis,
) -> None:
    def create_then_lose_redis(ctx: StepContext) -> dict[str, str]:
        fake_server.connected = False
        return {"AlphaId": "alpha-kept"}

    script.plan("alpha.create", create_then_lose_redis)
    task, _ = runtime.service.submit(FLOW, {})
    message = worker.take()
    assert message is not None
    worker.handle(message)

    stored = runtime.service.get(task.task_id)
    assert stored.status is TaskStatus.RUNNING
    assert stored.steps[0].state is StepState.SUCCEEDED
    assert stored.parameters["AlphaId"] == "alpha-kept"
    assert stored.active is not None
    assert (stored.active.cursor, stored.active.phase) == (1, Phase.QUEUED)
    assert stored.active.due_at == clock.now + settings.publish_retry
    assert not publisher.healthy()

    fake_server.connected = True
    message.ack()
    assert message_keys(redis_client) == set()

    wait_for(publisher.healthy, 2.0, "the publisher's pause after a failure to end")
    clock.advance(settings.publish_retry)
    assert sweep_tasks(runtime.service, clock.now) == 1
    (next_step,) = queued(redis_client, "asyncflow.beta")
    assert (next_step.cursor, next_step.seq, next_step.command) == (1, stored.active.seq, "attach")
    assert next_step.parameters["AlphaId"] == "alpha-kept"

    worker.run()

    done = runtime.service.get(task.task_id)
    assert done.status is TaskStatus.SUCCESS
    assert done.parameters["BetaOn"] == "alpha-kept"
    assert script.commands() == [("alpha.create", 0, 1), ("beta.attach", 0, 1)]
    assert message_keys(redis_client) == set()
