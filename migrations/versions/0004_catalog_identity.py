"""The catalog's identity: an id that the checkpoint root it is bound to also carries.

One row. Every catalog, new or migrated, gets a fresh random id here; no root
is bound yet (``root_bound_at`` NULL), so the first writer that opens it binds
its root (see ``registry.ops.binding``).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    table = op.create_table(
        "catalog_identity",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("catalog_id", sa.String(32), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("root_bound_at", TS),
        sa.Column("root_hint", sa.String(1024)),
        sa.PrimaryKeyConstraint("id", name="pk_catalog_identity"),
    )
    op.bulk_insert(table, [{"id": 1, "catalog_id": uuid.uuid4().hex, "created_at": datetime.now(timezone.utc)}])


def downgrade() -> None:
    op.drop_table("catalog_identity")
