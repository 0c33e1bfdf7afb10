"""Prometheus metrics of the core. Counters are per process; /metrics shows the API's."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

SUBMITTED = Counter("asyncflow_tasks_submitted_total", "Tasks accepted", ["flow"])
FINISHED = Counter("asyncflow_tasks_finished_total", "Tasks that stopped", ["flow", "status"])
STEP_SECONDS = Histogram(
    "asyncflow_step_seconds",
    "Time a step attempt ran in its handler",
    ["module", "command", "outcome"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600),
)
RETRIES = Counter("asyncflow_step_retries_total", "Failed attempts that will be retried", ["module", "command"])
ROLLBACKS = Counter("asyncflow_rollbacks_total", "Rollback commands dispatched", ["flow", "module"])
STALE = Counter("asyncflow_stale_messages_total", "Step messages ignored as duplicate or stale", ["module"])
ALARMS = Counter("asyncflow_alarms_total", "Compensations that failed", ["flow", "module"])
