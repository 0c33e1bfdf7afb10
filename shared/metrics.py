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
HEARTBEATS = Counter("asyncflow_step_heartbeats_total", "Running attempts renewed by their worker", ["module"])
EXPIRED = Counter(
    "asyncflow_attempts_expired_total",
    "Running attempts failed by the sweep: worker silent (heartbeat) or past timeout + grace (deadline)",
    ["reason"],
)

# The v1 API (pull-mode tasks), by task type.
V1_CREATED = Counter("asyncflow_v1_tasks_created_total", "v1 tasks created", ["task_type"])
V1_LEASED = Counter("asyncflow_v1_tasks_leased_total", "v1 tasks handed out by hold_tasks", ["task_type"])
V1_REPORTED = Counter("asyncflow_v1_reports_total", "set_task calls accepted, by reported status", ["task_type", "status"])
V1_FINISHED = Counter(
    "asyncflow_v1_tasks_finished_total", "v1 tasks ended by a set_task (3 success, 4 failed)", ["task_type", "status"]
)

# Schedules: every firing by what became of it, and how late the fired ones were.
SCHEDULE_RUNS = Counter("asyncflow_schedule_runs_total", "Schedule firings recorded, by state", ["state"])
SCHEDULE_LATENESS = Histogram(
    "asyncflow_schedule_lateness_seconds",
    "Fire time minus the scheduled time (plus its jitter) of fired runs",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 300),
)
