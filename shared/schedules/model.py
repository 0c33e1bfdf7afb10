"""What a schedule is: what it starts, when, under which policies, and where it stands.

A schedule's definition (``Target``, ``When``, ``Policy``) is what users write in
flows.yaml, the API or the CLI. Its state (``cursor``, ``running``, ``buffered``)
is what the leader scheduler keeps between firings: every scheduled time up to
``cursor`` has been handled (fired, buffered or skipped) and has a run record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Overlap(StrEnum):
    """What a firing does while the task of an earlier firing still runs (Temporal's policies)."""

    SKIP = "skip"  # record the firing as skipped
    BUFFER_ONE = "buffer_one"  # start it when the running one ends; at most one waits
    BUFFER_ALL = "buffer_all"  # start each, in order, as the one before ends
    ALLOW_ALL = "allow_all"  # start it anyway
    CANCEL_OTHER = "cancel_other"  # cancel the running one (its saga compensates), start this one


class RunState(StrEnum):
    FIRED = "fired"  # its task was created
    BUFFERED = "buffered"  # waits for the running task to end
    SKIPPED = "skipped"  # not fired; ``reason`` says why


class SkipReason(StrEnum):
    MISSED = "missed"  # older than the catch-up window when the scheduler got to it
    OVERLAP = "overlap"  # the overlap policy said so


@dataclass(frozen=True)
class Target:
    """What a firing creates: a flow task, or a v1 task (exactly one of ``flow``, ``task_type``)."""

    flow: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    task_type: str | None = None
    task_stage: str = ""
    task_content: str = ""
    user_id: str | None = None  # owner of the tasks it creates


@dataclass(frozen=True)
class When:
    """When it fires: exactly one of ``run_at`` (epoch s), ``cron``, ``every`` (s).

    ``cron`` has 5 fields, or 6 with seconds first; it is read in ``timezone``.
    ``every`` counts from ``start_at`` when given, else from the epoch. No firing
    falls before ``start_at`` or after ``end_at``. ``jitter`` delays each firing by
    a fixed pseudo-random part of it (the same for a given scheduled time, so a new
    leader computes the same moment).
    """

    run_at: float | None = None
    cron: str | None = None
    every: float | None = None
    timezone: str = "UTC"
    start_at: float | None = None
    end_at: float | None = None
    jitter: float = 0.0


DEFAULT_CATCHUP_WINDOW = 300.0


@dataclass(frozen=True)
class Policy:
    overlap: Overlap = Overlap.SKIP
    # Firings missed (scheduler down, failover) that are at most this old still fire, once each.
    catchup_window: float = DEFAULT_CATCHUP_WINDOW
    pause_on_failure: bool = False


@dataclass(frozen=True)
class Schedule:
    schedule_id: str
    target: Target
    when: When
    policy: Policy = Policy()
    paused: bool = False
    note: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    # --- state, kept by the leader -------------------------------------------------
    # Every scheduled time <= cursor is handled. None: nothing handled yet.
    cursor: float | None = None
    # The next scheduled time after cursor (None: the schedule will not fire again).
    next_at: float | None = None
    # The task of the latest firing while it may still run (overlap, pause_on_failure).
    running: str | None = None
    # Scheduled times of the firings waiting for ``running`` to end (buffer policies), oldest first.
    buffered: tuple[float, ...] = ()
    version: int = 0


@dataclass(frozen=True)
class Run:
    """One firing: the seed's job-flow record. One per (schedule_id, scheduled_at)."""

    schedule_id: str
    scheduled_at: float
    state: RunState
    fired_at: float | None = None
    task_id: str | None = None
    reason: str | None = None


TASK_ID_PREFIX = "sch."


def task_id_of(schedule_id: str, scheduled_at: float) -> str:
    """The id of the task a firing creates: the same for the same firing, whoever fires it."""
    return f"{TASK_ID_PREFIX}{schedule_id}.{round(scheduled_at * 1000)}"
