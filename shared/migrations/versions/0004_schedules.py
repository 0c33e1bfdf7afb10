"""Schedules, their runs (one per firing) and the scheduler's leader lease

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "af_schedules",
        sa.Column("schedule_id", sa.String(40), primary_key=True),
        sa.Column("definition", Json, nullable=False),
        sa.Column("user_id", sa.String(128)),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("changed_at", sa.Double(), nullable=False),
        sa.Column("cursor", sa.Double()),
        sa.Column("next_at", sa.Double()),
        sa.Column("running", sa.String(80)),
        sa.Column("buffered", Json, nullable=False),
        sa.Column("fire_at", sa.Double()),
        sa.Column("version", sa.Integer(), nullable=False),
    )
    op.create_index("ix_af_schedules_fire_at", "af_schedules", ["fire_at"])
    op.create_index("ix_af_schedules_changed", "af_schedules", ["changed_at"])
    op.create_index("ix_af_schedules_user", "af_schedules", ["user_id", "schedule_id"])
    op.create_table(
        "af_schedule_runs",
        sa.Column("schedule_id", sa.String(40), primary_key=True),
        sa.Column("scheduled_at", sa.Double(), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("fired_at", sa.Double()),
        sa.Column("task_id", sa.String(80)),
        sa.Column("reason", sa.Text()),
    )
    op.create_index("ix_af_schedule_runs_time", "af_schedule_runs", ["scheduled_at"])
    op.create_index("ix_af_schedule_runs_task", "af_schedule_runs", ["task_id"])
    op.create_table(
        "af_leases",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("af_leases")
    op.drop_table("af_schedule_runs")
    op.drop_table("af_schedules")
