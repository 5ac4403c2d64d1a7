"""A copy may hold part of a step: ``checkpoint_replicas.files``.

A sharded step published from ranks on several hosts, each writing to a fast
directory of its own, has no whole copy on any host until it is durable: each
host holds a *part* (``part:<tier id>``), the data files its ranks wrote plus
the step's small files. ``files`` lists a part's data files (JSON, sorted);
NULL, as for every existing row, is a copy of the whole payload.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoint_replicas") as batch:
        batch.add_column(sa.Column("files", sa.Text(), nullable=True))


def downgrade() -> None:
    # a part is no copy the old schema can describe: forgotten, as its step then has no copy this host can read
    replicas = sa.table("checkpoint_replicas", sa.column("files", sa.Text))
    op.execute(replicas.delete().where(replicas.c.files.is_not(None)))
    with op.batch_alter_table("checkpoint_replicas") as batch:
        batch.drop_column("files")
