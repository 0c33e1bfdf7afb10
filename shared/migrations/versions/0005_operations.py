"""Attempt heartbeats and results, v1 heartbeat leases, task events, and the process registry

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("af_pull_tasks") as table:
        table.add_column(sa.Column("heartbeat_timeout", sa.Double()))
    with op.batch_alter_table("af_attempts") as table:
        table.add_column(sa.Column("worker", sa.String(128)))
        table.add_column(sa.Column("heartbeat_at", sa.Double()))
        table.add_column(sa.Column("progress", Json))
        table.add_column(sa.Column("result", Json))
    op.create_table(
        "af_task_events",
        sa.Column("event_id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("task_id", sa.String(64), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("actor", sa.String(128)),
        sa.Column("detail", Json, nullable=False),
    )
    op.create_index("ix_af_task_events_task", "af_task_events", ["task_id", "event_id"])
    op.create_table(
        "af_processes",
        sa.Column("process_id", sa.String(128), primary_key=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("detail", Json, nullable=False),
        sa.Column("metrics", Json, nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("seen_at", sa.Double(), nullable=False),
        sa.Column("stopped_at", sa.Double()),
    )
    op.create_index("ix_af_processes_seen", "af_processes", ["seen_at"])


def downgrade() -> None:
    op.drop_table("af_processes")
    op.drop_table("af_task_events")
    with op.batch_alter_table("af_attempts") as table:
        table.drop_column("result")
        table.drop_column("progress")
        table.drop_column("heartbeat_at")
        table.drop_column("worker")
    with op.batch_alter_table("af_pull_tasks") as table:
        table.drop_column("heartbeat_timeout")
