"""Prometheus metrics of the core, counted in the process where things happen.

Each process keeps its own (a worker's pool processes add theirs to the worker's,
asyncflow.metrics) and stores a snapshot in its registry row (shared.presence);
the API's /metrics adds them all up (shared.exposition). The names are what the
README lists and the Grafana dashboard reads: change neither alone.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

from shared.saga import Failed, PollLater, Succeeded

SUBMITTED = Counter("asyncflow_tasks_submitted_total", "Tasks accepted", ["flow"])
FINISHED = Counter("asyncflow_tasks_finished_total", "Tasks that stopped", ["flow", "status"])
STEP_SECONDS = Histogram(
    "asyncflow_step_seconds",
    "Time a step attempt ran in its handler",
    ["module", "command", "outcome"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600),
)
# Every attempt by how it ended: succeeded, failed, timed_out, poll_later, or lost
# (its process died or the worker stopped before it ended).
STEP_ATTEMPTS = Counter(
    "asyncflow_step_attempts_total", "Step attempts ended, by outcome", ["module", "command", "outcome"]
)
# Queue lag as deliveries see it: publish (sent_at in the message) to the start of handling.
QUEUE_WAIT = Histogram(
    "asyncflow_step_queue_wait_seconds",
    "Time a step message waited between its publish and a worker taking it",
    ["module"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 60, 300),
)
RETRIES = Counter("asyncflow_step_retries_total", "Failed attempts that will be retried", ["module", "command"])
ROLLBACKS = Counter("asyncflow_rollbacks_total", "Rollback commands dispatched", ["flow", "module"])
STALE = Counter("asyncflow_stale_messages_total", "Step messages ignored as duplicate or stale", ["module"])
ALARMS = Counter("asyncflow_alarms_total", "Compensations that failed", ["flow", "module"])
CONTINUED = Counter(
    "asyncflow_steps_continued_total",
    "Next steps run at once by the worker that ran the step before, without their queue",
    ["module"],
)
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
V1_LEASE_EXPIRIES = Counter(
    "asyncflow_v1_lease_expiries_total", "v1 leases the scheduler ended (worker silent or too slow)", ["task_type"]
)

# The API's intake (oss_api.coalesce): how many concurrent requests went in one batch,
# stored in one commit (a second one only when an id repeats in the batch).
INTAKE_BATCH = Histogram(
    "asyncflow_api_intake_batch_size",
    "Concurrent submits, create_task or hold_tasks calls served together, by call",
    ["call"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1000),
)

# Schedules: every firing by what became of it, and how late the fired ones were.
SCHEDULE_RUNS = Counter("asyncflow_schedule_runs_total", "Schedule firings recorded, by state", ["state"])
SCHEDULE_LATENESS = Histogram(
    "asyncflow_schedule_lateness_seconds",
    "Fire time minus the scheduled time (plus its jitter) of fired runs",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 300),
)

# The scheduler: whether this one leads (the sum over live schedulers is how many
# lead: 1 when all is well), and how late its sweeps run past their due time.
SCHEDULER_LEADER = Gauge(
    "asyncflow_scheduler_leader", "1 while this scheduler holds the lead", multiprocess_mode="livesum"
)
SCHEDULER_LAG = Histogram(
    "asyncflow_scheduler_lag_seconds",
    "How late the leader's governance sweeps ran past their due time",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
)

# /metrics itself: parts it could not compute within its time bound (broker, database).
SCRAPE_ERRORS = Counter("asyncflow_scrape_errors_total", "Parts of a /metrics scrape left out on error", ["part"])


def outcome_of(event: Succeeded | Failed | PollLater) -> str:
    """The outcome label of an attempt that ended with ``event``."""
    if isinstance(event, Succeeded):
        return "succeeded"
    if isinstance(event, PollLater):
        return "poll_later"
    return "timed_out" if event.timed_out else "failed"


def observe_queue_wait(module: str, sent_at: float | None) -> None:
    """How long a message of ``module`` published at ``sent_at`` (wall clock) waited; not known: nothing."""
    if sent_at is not None:
        QUEUE_WAIT.labels(module).observe(max(0.0, time.time() - sent_at))
