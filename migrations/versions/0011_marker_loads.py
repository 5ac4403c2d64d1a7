"""Loads of markers: ``policy_loads.step`` may be NULL.

A consumer leases and applies a marker's version (``publish_policy_marker``:
its bytes moved outside the registry) like a step's, so that lag and the load
audit cover it; such a load has no step. A NULL ``step`` holds nothing from
retention (there are no bytes to keep), and ``policy_consumers.applied_step``
was already nullable for a consumer serving one.

Existing rows: every load is of a step; nothing changes.

``policy_loads`` is referenced by no table, so copying it on SQLite (batch
mode) sets nothing else to NULL. The downgrade forgets the loads of markers:
the old schema cannot hold them.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policy_loads") as batch:
        batch.alter_column("step", existing_type=sa.BigInteger, nullable=True)


def downgrade() -> None:
    loads = sa.table("policy_loads", sa.column("step", sa.BigInteger))
    op.execute(loads.delete().where(loads.c.step.is_(None)))
    with op.batch_alter_table("policy_loads") as batch:
        batch.alter_column("step", existing_type=sa.BigInteger, nullable=False)
