"""Per-step success rates and run-time percentiles from a sample of attempts (pure)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.states import StepType
from shared.storage import AttemptRecord

# Outcomes that end an attempt with its command done or given up on.
SUCCESS = "succeeded"
ENDED = frozenset({"succeeded", "failed", "timed_out", "expired"})


@dataclass(frozen=True)
class StepStats:
    attempts: int  # ended attempts (poll-later answers are not counted)
    succeeded: int
    p50: float | None
    p95: float | None
    p99: float | None

    @property
    def success_rate(self) -> float | None:
        return self.succeeded / self.attempts if self.attempts else None


def percentile(ordered: Sequence[float], p: float) -> float | None:
    """The nearest-rank percentile of ``ordered`` (sorted ascending)."""
    if not ordered:
        return None
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def step_stats(records: Iterable[AttemptRecord]) -> dict[tuple[int, StepType], StepStats]:
    """By (step index, normal or rollback)."""
    runs: dict[tuple[int, StepType], list[float]] = {}
    ended: dict[tuple[int, StepType], int] = {}
    wins: dict[tuple[int, StepType], int] = {}
    for a in records:
        if a.outcome not in ENDED:
            continue
        key = (a.cursor, a.type)
        times = runs.setdefault(key, [])
        ended[key] = ended.get(key, 0) + 1
        wins[key] = wins.get(key, 0) + (a.outcome == SUCCESS)
        if a.started_at is not None and a.ended_at is not None:
            times.append(max(0.0, a.ended_at - a.started_at))
    found = {}
    for key, times in runs.items():
        times.sort()
        found[key] = StepStats(
            attempts=ended[key],
            succeeded=wins.get(key, 0),
            p50=percentile(times, 50),
            p95=percentile(times, 95),
            p99=percentile(times, 99),
        )
    return found
