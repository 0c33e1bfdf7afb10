"""A task's steps as json text on PostgreSQL, not jsonb

Every transition writes the steps whole, and nothing queries inside them: jsonb's
parse into its binary form was work at every write (benchmarks/README.md, "Steps
as json"). On PostgreSQL the column's type changes, which rewrites af_tasks under
an exclusive lock: on a large table, run it in a quiet moment. Processes still
running prepare their statements that return the column anew at their next use
(shared.storage.driver). Other databases store JSON as text already.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_context().dialect.name == "postgresql":  # online or --sql
        op.alter_column("af_tasks", "steps", type_=sa.JSON(), postgresql_using="steps::json")


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":  # online or --sql
        op.alter_column("af_tasks", "steps", type_=JSONB(), postgresql_using="steps::jsonb")
