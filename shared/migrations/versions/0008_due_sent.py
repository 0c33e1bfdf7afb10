"""An index of the messages already sent (queued or running) by when they are due

A batch's first steps wait in af_tasks until the scheduler publishes them, and
can be due by the hundred thousand. The sweep asks for the other due messages
(expiries, requeues) apart, through this index, so such a backlog does not hold
them up behind it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

SENT = sa.text("active_phase <> 0")


def upgrade() -> None:
    op.create_index("ix_af_tasks_due_sent", "af_tasks", ["due_at"], postgresql_where=SENT, sqlite_where=SENT)


def downgrade() -> None:
    op.drop_index("ix_af_tasks_due_sent", table_name="af_tasks")
