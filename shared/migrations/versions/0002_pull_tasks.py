"""Asyncflow v1 pull-mode tasks and their task types

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "af_task_types",
        sa.Column("task_type", sa.String(64), primary_key=True),
        sa.Column("schedule_limit", sa.Integer(), nullable=False),
        sa.Column("schedule_interval", sa.Integer(), nullable=False),
        sa.Column("max_processing_time", sa.Integer(), nullable=False),
        sa.Column("max_retry_num", sa.Integer(), nullable=False),
        sa.Column("max_retry_interval", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
    )
    op.create_table(
        "af_pull_tasks",
        sa.Column("task_id", sa.String(64), primary_key=True),
        sa.Column("task_type", sa.String(64), nullable=False),
        sa.Column("user_id", sa.String(128), nullable=False),
        sa.Column("task_stage", sa.String(64), nullable=False),
        sa.Column("status", sa.SmallInteger(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("crt_retry_num", sa.Integer(), nullable=False),
        sa.Column("max_retry_num", sa.Integer(), nullable=False),
        sa.Column("max_retry_interval", sa.Integer(), nullable=False),
        sa.Column("max_processing_time", sa.Integer(), nullable=False),
        sa.Column("schedule_log", sa.Text(), nullable=False),
        sa.Column("task_content", sa.Text(), nullable=False),
        sa.Column("order_time", sa.Double(), nullable=False),
        sa.Column("create_time", sa.Double(), nullable=False),
        sa.Column("modify_time", sa.Double(), nullable=False),
        sa.Column("lease_until", sa.Double()),
        sa.Column("version", sa.Integer(), nullable=False),
    )
    op.create_index("ix_af_pull_tasks_hold", "af_pull_tasks", ["task_type", "status", "order_time"])
    op.create_index("ix_af_pull_tasks_lease", "af_pull_tasks", ["lease_until"])
    op.create_index("ix_af_pull_tasks_type_created", "af_pull_tasks", ["task_type", "create_time"])


def downgrade() -> None:
    op.drop_table("af_pull_tasks")
    op.drop_table("af_task_types")
