"""How many requeue passes left a task's queued message in its queue's backlog

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("af_tasks") as table:
        table.add_column(sa.Column("active_held", sa.SmallInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("af_tasks") as table:
        table.drop_column("active_held")
