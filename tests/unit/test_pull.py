"""Rules of v1 pull-mode tasks (seed 000 §三): ordering, retries, stages, leases."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.pull.rules import (
    MAX_LOG_BYTES,
    InvalidReport,
    PullStatus,
    Report,
    TaskType,
    expire,
    leased,
    new_pull_task,
    reported,
)
from shared.retry import retry_delay

NOW = 1_000_000.0


def task(priority: int = 0, **config: int):
    cfg = TaskType(task_type="video", **config)
    return new_pull_task("t1", cfg, "u1", "submit", '{"a":1}', priority, NOW)


def test_created_pending_and_ordered_ahead_by_its_priority() -> None:
    t = task(priority=30)
    assert t.status is PullStatus.PENDING and t.order_time == NOW - 30 and t.crt_retry_num == 0


def test_progressive_and_uniform_retry_intervals() -> None:
    assert [retry_delay(n, 10) for n in range(7)] == [1, 2, 4, 8, 10, 10, 10]
    assert [retry_delay(n, -5) for n in range(3)] == [5, 5, 5]


def test_failure_retries_behind_the_queue_then_fails() -> None:
    t = leased(task(priority=100, max_retry_num=2, max_retry_interval=10), NOW)
    t = reported(t, Report(PullStatus.FAILED), NOW + 1)
    # No priority bonus while retrying: it waits its interval (seed 000 §三.2).
    assert (t.status, t.crt_retry_num, t.order_time) == (PullStatus.PENDING, 1, NOW + 1 + 1)
    t = reported(leased(t, NOW + 2), Report(PullStatus.FAILED), NOW + 3)
    assert (t.crt_retry_num, t.order_time) == (2, NOW + 3 + 2)
    t = reported(leased(t, NOW + 6), Report(PullStatus.FAILED), NOW + 7)
    assert t.status is PullStatus.FAILED


def test_next_stage_goes_back_to_pending_behind_tasks_already_waiting() -> None:
    t = leased(task(priority=5), NOW)
    t = reported(t, Report(PullStatus.PENDING, task_stage="transcode", task_content='{"job":7}'), NOW + 50)
    assert (t.status, t.task_stage, t.task_content) == (PullStatus.PENDING, "transcode", '{"job":7}')
    assert t.order_time == NOW + 50 - 5 and t.crt_retry_num == 0


def test_worker_counted_retry_is_a_failed_attempt() -> None:
    t = leased(task(max_retry_interval=-3), NOW)
    t = reported(t, Report(PullStatus.PENDING, crt_retry_num=1), NOW + 1)
    assert (t.status, t.crt_retry_num, t.order_time) == (PullStatus.PENDING, 1, NOW + 1 + 3)


def test_success_and_progress() -> None:
    t = leased(task(), NOW)
    t = reported(t, Report(PullStatus.RUNNING, schedule_log="50%"), NOW + 10)
    assert t.status is PullStatus.RUNNING and t.modify_time == NOW + 10 and t.schedule_log == "50%"
    assert reported(t, Report(PullStatus.SUCCESS), NOW + 11).status is PullStatus.SUCCESS


@pytest.mark.parametrize("status", [PullStatus.PENDING, PullStatus.SUCCESS, PullStatus.FAILED])
def test_only_a_leased_task_can_be_set(status: PullStatus) -> None:
    from dataclasses import replace

    with pytest.raises(InvalidReport):
        reported(replace(task(), status=status), Report(PullStatus.SUCCESS), NOW)


def test_lease_expiry_counts_as_a_failed_attempt() -> None:
    t = leased(task(max_processing_time=60), NOW)
    assert expire(t, NOW + 59) is None
    back = expire(t, NOW + 60)
    assert back is not None and back.status is PullStatus.PENDING and back.crt_retry_num == 1
    assert back.schedule_log == "lease expired: no report within max_processing_time (60 s)"
    # Added to what the workers wrote, and kept within the log's size.
    long = replace(leased(task(max_processing_time=60), NOW), schedule_log="x" * MAX_LOG_BYTES)
    again = expire(long, NOW + 60)
    assert again is not None and len(again.schedule_log) == MAX_LOG_BYTES
    assert again.schedule_log.endswith("x\nlease expired: no report within max_processing_time (60 s)")
    assert expire(task(), NOW + 10_000) is None  # pending: no lease
