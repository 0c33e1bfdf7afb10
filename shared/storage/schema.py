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
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

# JSONB on PostgreSQL, JSON text elsewhere.
Json = JSON().with_variant(JSONB(), "postgresql")

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
    Column("steps", Json, nullable=False),
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
    Column("version", Integer, nullable=False, default=0),
    Index("ix_af_tasks_created", "created_at"),
    Index("ix_af_tasks_flow_created", "flow", "created_at"),
    Index("ix_af_tasks_user_created", "user_id", "created_at"),
    Index("ix_af_tasks_status_created", "status", "created_at"),
    Index("ix_af_tasks_due", "due_at"),
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
)
