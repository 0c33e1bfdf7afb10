"""Longer v1 task ids: a pull-mode saga step is "<task id>.<seq>"

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("af_pull_tasks") as batch:
        batch.alter_column("task_id", existing_type=sa.String(64), type_=sa.String(80), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("af_pull_tasks") as batch:
        batch.alter_column("task_id", existing_type=sa.String(80), type_=sa.String(64), existing_nullable=False)
