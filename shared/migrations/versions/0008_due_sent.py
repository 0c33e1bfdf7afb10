"""The due messages in three indexes: sent ones, later ones, a batch's first steps by flow

A batch's first steps wait in af_tasks until the scheduler publishes them, as
their queues make room, and can be due by the hundred thousand. The sweep asks
for each kind apart, each through an index of its own: the messages already
sent (expiries, requeues), the later steps waiting (retries, polls), and the
first steps of each flow. A backlog of one kind never holds up another. The
index of all due messages goes.

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

INDEXES = {
    "ix_af_tasks_due_sent": (["due_at"], "active_phase <> 0"),
    "ix_af_tasks_due_later": (["due_at"], "active_phase = 0 AND active_seq <> 1"),
    "ix_af_tasks_due_first": (["flow", "due_at"], "active_phase = 0 AND active_seq = 1"),
}


def upgrade() -> None:
    for name, (columns, where) in INDEXES.items():
        condition = sa.text(where)
        op.create_index(name, "af_tasks", columns, postgresql_where=condition, sqlite_where=condition)
    # Every due message is found through one of the three now; left, it cost a write at
    # every transition and drew PostgreSQL's planner away from the flows' index.
    op.drop_index("ix_af_tasks_due", table_name="af_tasks")


def downgrade() -> None:
    op.create_index("ix_af_tasks_due", "af_tasks", ["due_at"])
    for name in INDEXES:
        op.drop_index(name, table_name="af_tasks")
