"""Tables of the core, as SQLAlchemy Core metadata (Alembic migrations mirror it)."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Double,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from shared.pull.rules import MAX_TASK_ID

metadata = MetaData()

# JSONB on PostgreSQL, JSON text elsewhere.
Json = JSON().with_variant(JSONB(), "postgresql")
# JSON text everywhere, for a document written whole at every transition and never
# queried inside: PostgreSQL checks json's syntax only, where it parses jsonb into a
# binary form at every write (benchmarks/README.md, "Steps as json").
JsonText = JSON()

# Which due messages each kind is (shared.states.Phase: 0 is waiting; a task's first
# message has seq 1, and only a batch's waits): the conditions of their indexes.
SENT = text("active_phase <> 0")
LATER = text("active_phase = 0 AND active_seq <> 1")
FIRST = text("active_phase = 0 AND active_seq = 1")

tasks = Table(
    "af_tasks",
    metadata,
    Column("task_id", String(64), primary_key=True),
    Column("flow", String(64), nullable=False),
    Column("status", SmallInteger, nullable=False),
    Column("cursor", Integer, nullable=False),
    Column("message", Text),
    Column("priority", Integer, nullable=False, default=0),
    Column("user_id", String(128)),
    Column("parameters", Json, nullable=False),
    Column("steps", JsonText, nullable=False),
    Column("created_at", Double, nullable=False),
    Column("started_at", Double),
    Column("ended_at", Double),
    Column("updated_at", Double, nullable=False),
    Column("cancel_requested", Boolean, nullable=False, default=False),
    Column("seq", Integer, nullable=False, default=0),
    # The one outstanding step message (NULL when nothing is in flight).
    Column("active_seq", Integer),
    Column("active_cursor", Integer),
    Column("active_type", SmallInteger),
    Column("active_attempt", Integer),
    Column("active_phase", SmallInteger),
    Column("due_at", Double),
    Column("active_started_at", Double),
    Column("active_held", SmallInteger, nullable=False, server_default="0"),
    Column("version", Integer, nullable=False, default=0),
    Index("ix_af_tasks_created", "created_at"),
    Index("ix_af_tasks_flow_created", "flow", "created_at"),
    Index("ix_af_tasks_user_created", "user_id", "created_at"),
    Index("ix_af_tasks_status_created", "status", "created_at"),
    # The due messages of each kind apart (migration 0008).
    Index("ix_af_tasks_due_sent", "due_at", postgresql_where=SENT, sqlite_where=SENT),
    Index("ix_af_tasks_due_later", "due_at", postgresql_where=LATER, sqlite_where=LATER),
    Index("ix_af_tasks_due_first", "flow", "due_at", postgresql_where=FIRST, sqlite_where=FIRST),
)

# Every attempt of every step, for inspection; the task row stays the truth.
attempts = Table(
    "af_attempts",
    metadata,
    Column("task_id", String(64), primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("cursor", Integer, nullable=False),
    Column("type", SmallInteger, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("module", String(64), nullable=False),
    Column("command", String(64), nullable=False),
    Column("started_at", Double),
    Column("ended_at", Double),
    Column("outcome", String(16)),
    Column("error", Text),
    # The process that ran it (shared.presence process id), its last heartbeat and
    # the progress details the handler sent with it.
    Column("worker", String(128)),
    Column("heartbeat_at", Double),
    Column("progress", Json),
    # What the attempt merged into the task's parameters (a result, or PollLater's values).
    Column("result", Json),
)

# What operators and callers did to a task (cancel, retry, resume, parameter
# corrections), oldest first; the steps' own history is in af_attempts.
task_events = Table(
    "af_task_events",
    metadata,
    Column("event_id", Integer, primary_key=True, autoincrement=True),
    Column("task_id", String(64), nullable=False),
    Column("at", Double, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("actor", String(128)),
    Column("detail", Json, nullable=False),
    Index("ix_af_task_events_task", "task_id", "event_id"),
)

# Every API, worker and scheduler process: what it is, when it was last seen alive
# and a snapshot of its metrics, so one /metrics and the dashboard cover them all.
processes = Table(
    "af_processes",
    metadata,
    Column("process_id", String(128), primary_key=True),
    Column("role", String(16), nullable=False),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("detail", Json, nullable=False),
    Column("metrics", Json, nullable=False),
    Column("started_at", Double, nullable=False),
    Column("seen_at", Double, nullable=False),
    Column("stopped_at", Double),
    Index("ix_af_processes_seen", "seen_at"),
)

# --- Asyncflow v1 pull-mode tasks (seed 000) -----------------------------------

task_types = Table(
    "af_task_types",
    metadata,
    Column("task_type", String(64), primary_key=True),
    Column("schedule_limit", Integer, nullable=False),
    Column("schedule_interval", Integer, nullable=False),
    Column("max_processing_time", Integer, nullable=False),
    Column("max_retry_num", Integer, nullable=False),
    Column("max_retry_interval", Integer, nullable=False),
    Column("created_at", Double, nullable=False),
    Column("updated_at", Double, nullable=False),
)

pull_tasks = Table(
    "af_pull_tasks",
    metadata,
    Column("task_id", String(MAX_TASK_ID), primary_key=True),
    Column("task_type", String(64), nullable=False),
    Column("user_id", String(128), nullable=False),
    Column("task_stage", String(64), nullable=False),
    Column("status", SmallInteger, nullable=False),
    Column("priority", Integer, nullable=False),
    Column("crt_retry_num", Integer, nullable=False),
    Column("max_retry_num", Integer, nullable=False),
    Column("max_retry_interval", Integer, nullable=False),
    Column("max_processing_time", Integer, nullable=False),
    Column("schedule_log", Text, nullable=False),
    Column("task_content", Text, nullable=False),
    Column("order_time", Double, nullable=False),
    Column("create_time", Double, nullable=False),
    Column("modify_time", Double, nullable=False),
    # modify_time + max_processing_time while running, else NULL: the expiry sweep's index.
    Column("lease_until", Double),
    # Set while leased by a worker that sends heartbeats: its lease then ends this many
    # seconds after its last report instead of max_processing_time.
    Column("heartbeat_timeout", Double),
    Column("version", Integer, nullable=False),
    # hold_tasks: pending tasks of a type, smallest order_time first (seed 000 §四.1).
    Index("ix_af_pull_tasks_hold", "task_type", "status", "order_time"),
    Index("ix_af_pull_tasks_lease", "lease_until"),
    Index("ix_af_pull_tasks_type_created", "task_type", "create_time"),
)

# --- Schedules (SPEC §9, seed 002) ------------------------------------------------

schedules = Table(
    "af_schedules",
    metadata,
    Column("schedule_id", String(40), primary_key=True),
    # What it starts, when, and its policies, as written (shared.schedules.model).
    Column("definition", Json, nullable=False),
    # The owner of the tasks it creates (target.user_id), for per-user lists.
    Column("user_id", String(128)),
    Column("paused", Boolean, nullable=False),
    Column("note", Text, nullable=False),
    Column("created_at", Double, nullable=False),
    # Set when a user changes the schedule, not when it fires: the leader's change feed.
    Column("changed_at", Double, nullable=False),
    # The leader's state: every scheduled time <= cursor is handled.
    Column("cursor", Double),
    Column("next_at", Double),
    Column("running", String(MAX_TASK_ID)),
    Column("buffered", Json, nullable=False),
    # When the leader must act on it (next_at plus jitter); NULL while paused or finished.
    Column("fire_at", Double),
    Column("version", Integer, nullable=False),
    Index("ix_af_schedules_fire_at", "fire_at"),
    Index("ix_af_schedules_changed", "changed_at"),
    Index("ix_af_schedules_user", "user_id", "schedule_id"),
)

# One row per firing (the seed's job-flow table); the key makes a firing happen once.
schedule_runs = Table(
    "af_schedule_runs",
    metadata,
    Column("schedule_id", String(40), primary_key=True),
    Column("scheduled_at", Double, primary_key=True),
    Column("state", String(16), nullable=False),
    Column("fired_at", Double),
    Column("task_id", String(MAX_TASK_ID)),
    Column("reason", Text),
    Index("ix_af_schedule_runs_time", "scheduled_at"),
    Index("ix_af_schedule_runs_task", "task_id"),
)

# Leadership among scheduler processes: the owner holds it until expires_at; each new
# owner gets the next epoch, and a write fenced by an older epoch is refused.
leases = Table(
    "af_leases",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("owner", String(128), nullable=False),
    Column("epoch", Integer, nullable=False),
    Column("expires_at", Double, nullable=False),
)
