"""Replicas: each copy of a step on a storage tier, with its own status.

``checkpoint_replicas`` holds one row per copy of a committed step: on a fast
tier (``fast:<tier id>``, a local or shared filesystem root; the id lives in
that root's ``.registry/tier.json``) or on the durable tier (``durable``, an
``s3://`` root). ``path`` is where that copy is, relative to its tier's root
(a directory, or an attempt prefix); ``manifest_sha256`` is the digest of the
manifest that copy holds, so a copy of an overwritten step's earlier payload
is never taken for the new one. ``pending`` is a replication under way
(``writer`` holds it). The ``checkpoints`` row stays the step itself. The
index serves the replication queue (copies of one location by status).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "checkpoint_replicas",
        sa.Column("checkpoint_id", sa.Integer, nullable=False),
        sa.Column("location", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("manifest_sha256", sa.String(64)),
        sa.Column("writer", sa.String(255)),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("durable_at", TS),
        sa.PrimaryKeyConstraint("checkpoint_id", "location", name="pk_checkpoint_replicas"),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE",
                                name="fk_checkpoint_replicas_checkpoint_id_checkpoints"),
        sa.CheckConstraint("status IN ('pending', 'published', 'verified', 'corrupt', 'deleted')",
                           name="ck_checkpoint_replicas_status"),
    )
    op.create_index("ix_checkpoint_replicas_location_status", "checkpoint_replicas", ["location", "status"])


def downgrade() -> None:
    op.drop_index("ix_checkpoint_replicas_location_status", table_name="checkpoint_replicas")
    op.drop_table("checkpoint_replicas")
