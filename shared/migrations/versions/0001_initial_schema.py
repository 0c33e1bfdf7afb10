"""initial schema: tasks and their attempt log

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "af_tasks",
        sa.Column("task_id", sa.String(64), primary_key=True),
        sa.Column("flow", sa.String(64), nullable=False),
        sa.Column("status", sa.SmallInteger(), nullable=False),
        sa.Column("cursor", sa.Integer(), nullable=False),
        sa.Column("message", sa.Text()),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.String(128)),
        sa.Column("parameters", JSON, nullable=False),
        sa.Column("steps", JSON, nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("started_at", sa.Double()),
        sa.Column("ended_at", sa.Double()),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("active_seq", sa.Integer()),
        sa.Column("active_cursor", sa.Integer()),
        sa.Column("active_type", sa.SmallInteger()),
        sa.Column("active_attempt", sa.Integer()),
        sa.Column("active_phase", sa.SmallInteger()),
        sa.Column("due_at", sa.Double()),
        sa.Column("active_started_at", sa.Double()),
        sa.Column("version", sa.Integer(), nullable=False),
    )
    op.create_index("ix_af_tasks_created", "af_tasks", ["created_at"])
    op.create_index("ix_af_tasks_flow_created", "af_tasks", ["flow", "created_at"])
    op.create_index("ix_af_tasks_user_created", "af_tasks", ["user_id", "created_at"])
    op.create_index("ix_af_tasks_status_created", "af_tasks", ["status", "created_at"])
    op.create_index("ix_af_tasks_due", "af_tasks", ["due_at"])

    op.create_table(
        "af_attempts",
        sa.Column("task_id", sa.String(64), primary_key=True),
        sa.Column("seq", sa.Integer(), primary_key=True),
        sa.Column("cursor", sa.Integer(), nullable=False),
        sa.Column("type", sa.SmallInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("module", sa.String(64), nullable=False),
        sa.Column("command", sa.String(64), nullable=False),
        sa.Column("started_at", sa.Double()),
        sa.Column("ended_at", sa.Double()),
        sa.Column("outcome", sa.String(16)),
        sa.Column("error", sa.Text()),
    )


def downgrade() -> None:
    op.drop_table("af_attempts")
    op.drop_table("af_tasks")
