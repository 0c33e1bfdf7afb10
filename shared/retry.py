"""When to try again. Pure: every backoff formula of Asyncflow is in this file.

**Work** (flow steps in flows.yaml, v1 task types) follows seed 000 §三.1: one
signed number, ``max_retry_interval``, chooses the policy.

    negative   uniform:     every retry waits |max_retry_interval| seconds
    positive   progressive: retry n (0-based) waits min(2**n, max_retry_interval) seconds,
                            e.g. 10 gives 1, 2, 4, 8, 10, 10, ...
    zero       at once

**Infrastructure** (a broker or a database that does not answer) backs off
exponentially from ``first`` up to ``cap``: there is no count of attempts to
exhaust, only a service to wait for.
"""

from __future__ import annotations


def retry_delay(retries_done: int, max_retry_interval: float) -> float:
    """Seconds before the next attempt of work that has been retried ``retries_done`` times."""
    if max_retry_interval <= 0:
        return float(-max_retry_interval)
    return float(min(2.0 ** min(retries_done, 62), max_retry_interval))


def reconnect_delay(failures: int, first: float = 1.0, cap: float = 30.0) -> float:
    """Seconds before trying an unavailable service again after ``failures`` failed tries."""
    return float(min(first * 2.0 ** min(failures, 62), cap))
