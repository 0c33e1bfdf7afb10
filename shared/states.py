"""Status codes and the shape of a task's state, with the allowed transitions.

Task status (seed 004 §二: 0 success, 1 not started, 2 running, 3 rolling back,
any other code a failure):

    PENDING(1) ──first attempt starts──▶ RUNNING(2) ──last step ok──▶ SUCCESS(0)
        │                                   │
        │ cancel                            │ step fails / cancel
        ▼                                   ▼
    CANCELLED(6) ◀──rollbacks done, cancelled── ROLLING_BACK(3) ──rollbacks done──▶ FAILED(4)
                                            │  ▲
                             rollback fails ▼  │ resume (operator)
                                    ROLLBACK_FAILED(5)

    FAILED / CANCELLED ──retry (operator)──▶ RUNNING
"""

from __future__ import annotations

from enum import IntEnum


class TaskStatus(IntEnum):
    SUCCESS = 0
    PENDING = 1
    RUNNING = 2
    ROLLING_BACK = 3
    FAILED = 4  # a step failed; every completed step was compensated
    ROLLBACK_FAILED = 5  # a compensation failed; an operator must resume it
    CANCELLED = 6  # cancelled by an operator; completed steps were compensated

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL

    @property
    def label(self) -> str:
        return self.name.lower()


TERMINAL = frozenset({TaskStatus.SUCCESS, TaskStatus.FAILED, TaskStatus.CANCELLED})
# A stopped task that still holds un-compensated work: not terminal, but nothing runs.
STOPPED = TERMINAL | {TaskStatus.ROLLBACK_FAILED}


class StepType(IntEnum):
    """Message type of seed 004 §三."""

    NORMAL = 0
    ROLLBACK = 1


class Phase(IntEnum):
    """Where the task's one outstanding step message is.

    WAITING ──due──▶ QUEUED ──consumer starts──▶ RUNNING ──outcome──▶ (next message or none)
    """

    WAITING = 0  # held until due_at (backoff, poll later); the scheduler publishes it
    QUEUED = 1  # published to the module queue, not started
    RUNNING = 2  # a consumer is executing the attempt


class StepState(IntEnum):
    """State of one direction (normal or rollback) of one step."""

    PENDING = 0
    RUNNING = 1
    SUCCEEDED = 2
    FAILED = 3
    SKIPPED = 4  # rollback only: the step has no rollback command
    CANCELLED = 5  # normal only: stopped by a cancel before it finished

    @property
    def label(self) -> str:
        return self.name.lower()


class StepCode(IntEnum):
    """``Code`` of a step in the task document (seed 004 §二)."""

    OK = 0
    FAILED = 1
    TIMED_OUT = 2
    CANCELLED = 3
