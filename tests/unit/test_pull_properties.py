"""Properties of v1 pull-mode tasks for any sequence of creates, holds, reports, lease expiries and time.

A Hypothesis state machine drives the real PullService with a manual clock, on
the in-memory store here and on SQLite in tests/integration/test_pull_store_contract.py, and after every step compares the stored tasks with what seed 000
§三 says they must be:

- hold_tasks leases at most schedule_limit tasks, only pending ones whose
  order_time has come, smallest order_time first, and leaves no due task behind
  with a smaller order_time than one it leased;
- set_task and lease expiry move a task exactly as the rules say (success,
  next stage behind the others, failed attempt after its retry interval, failed
  once the retries are spent, progress renewing the lease);
- only a running task can be set; crt_retry_num never passes max_retry_num.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shared.pull.rules import InvalidReport, PullStatus, PullTask, Report
from shared.pull.service import PullService
from shared.retry import retry_delay
from shared.scheduler import sweep_leases
from shared.storage import InMemoryPullStore, PullStore
from shared.testing import ManualClock

TYPE = "t"


def same(a: PullTask, b: PullTask) -> bool:
    """Equal but for the version, which counts stored writes."""
    return replace(a, version=0) == replace(b, version=0)


class PullTasks(RuleBasedStateMachine):
    open_store: Callable[[], PullStore] = InMemoryPullStore

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.service = PullService(type(self).open_store(), clock=self.clock)
        self.count = 0

    @initialize(
        limit=st.integers(1, 4),
        retries=st.integers(0, 3),
        interval=st.integers(-3, 6),
        lease=st.integers(1, 8),
    )
    def register(self, limit: int, retries: int, interval: int, lease: int) -> None:
        self.service.register_type({
            "task_type": TYPE, "schedule_limit": limit, "max_retry_num": retries,
            "max_retry_interval": interval, "max_processing_time": lease,
        })
        self.limit, self.lease = limit, lease

    def tasks(self) -> dict[str, PullTask]:
        return {t.task_id: t for t in self.service.store.list(TYPE, None, None, 10_000)}

    def running(self) -> list[str]:
        return sorted(i for i, t in self.tasks().items() if t.status is PullStatus.RUNNING)

    @rule(priority=st.integers(-3, 3), stage=st.sampled_from(["", "a"]))
    def create(self, priority: int, stage: str) -> None:
        self.count += 1
        task, created = self.service.create(TYPE, "{}", priority=priority, stage=stage, task_id=f"task{self.count}")
        assert created and task.status is PullStatus.PENDING
        assert task.order_time == self.clock.now - priority

    @rule(seconds=st.sampled_from([0.5, 1, 2, 3, 5]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def hold(self) -> None:
        now = self.clock.now
        before = self.tasks()
        leased = self.service.hold(TYPE)
        due = sorted(
            (t.order_time, i) for i, t in before.items() if t.status is PullStatus.PENDING and t.order_time <= now
        )
        assert len(leased) == min(self.limit, len(due))
        # The smallest order_times, in order (ties may go either way).
        assert [t.order_time for t in leased] == [o for o, _ in due[: len(leased)]]
        after = self.tasks()
        for task in leased:
            assert before[task.task_id].status is PullStatus.PENDING
            assert task.status is PullStatus.RUNNING and after[task.task_id].modify_time == now

    @precondition(lambda self: self.count > 0)
    @rule(
        pick=st.integers(0, 10_000),
        status=st.sampled_from(list(PullStatus)),
        stage=st.sampled_from([None, "a", "b"]),
        counted=st.booleans(),
        on_running=st.booleans(),
    )
    def set(self, pick: int, status: PullStatus, stage: str | None, counted: bool, on_running: bool) -> None:
        tasks = self.tasks()
        running = self.running()
        task_id = running[pick % len(running)] if on_running and running else sorted(tasks)[pick % len(tasks)]
        task = tasks[task_id]
        now = self.clock.now
        crt = task.crt_retry_num + 1 if counted else task.crt_retry_num
        report = Report(status=status, task_stage=stage, task_content=f"c{now}", crt_retry_num=crt)
        if task.status is not PullStatus.RUNNING:
            with pytest.raises(InvalidReport):
                self.service.set(task_id, report)
            assert same(self.tasks()[task_id], task)
            return
        new = self.service.set(task_id, report)
        assert same(self.tasks()[task_id], new)
        assert new.task_content == f"c{now}" and new.modify_time == now
        failed = status is PullStatus.FAILED or (status is PullStatus.PENDING and counted)
        if status is PullStatus.SUCCESS:
            assert new.status is PullStatus.SUCCESS
        elif status is PullStatus.RUNNING:
            assert (new.status, new.order_time, new.crt_retry_num) == (PullStatus.RUNNING, task.order_time, crt - counted)
        elif failed:
            self.check_failed_attempt(task, new, now)
        else:  # the next stage, or the same one again: behind the tasks already waiting
            changed = stage is not None and stage != task.task_stage
            assert new.status is PullStatus.PENDING and new.order_time == now - task.priority
            assert new.task_stage == (stage if stage is not None else task.task_stage)
            assert new.crt_retry_num == (0 if changed else task.crt_retry_num)

    def check_failed_attempt(self, task: PullTask, new: PullTask, now: float) -> None:
        if task.crt_retry_num >= task.max_retry_num:
            assert (new.status, new.crt_retry_num) == (PullStatus.FAILED, task.crt_retry_num)
            return
        assert (new.status, new.crt_retry_num) == (PullStatus.PENDING, task.crt_retry_num + 1)
        # Its retry interval, not its priority: a failed task does not jump the queue.
        assert new.order_time == now + retry_delay(task.crt_retry_num, task.max_retry_interval) >= now
        assert new.task_stage == task.task_stage

    @rule()
    def expire(self) -> None:
        now = self.clock.now
        before = self.tasks()
        overdue = {
            i for i, t in before.items() if t.status is PullStatus.RUNNING and now >= t.modify_time + self.lease
        }
        assert sweep_leases(self.service, now) == len(overdue)
        after = self.tasks()
        for task_id, task in before.items():
            if task_id in overdue:
                self.check_failed_attempt(task, after[task_id], now)
            else:
                assert same(after[task_id], task)

    @invariant()
    def retries_are_bounded(self) -> None:
        if not hasattr(self, "limit"):
            return
        for task in self.tasks().values():
            assert 0 <= task.crt_retry_num <= task.max_retry_num
            if task.status is PullStatus.FAILED:
                assert task.crt_retry_num == task.max_retry_num


PullTasks.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_pull_tasks = PullTasks.TestCase
