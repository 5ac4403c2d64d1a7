"""A stored fold records the xxh3-128 digests of its pieces: ``policy_folds.pieces``.

An anchor is a model whole; a load that starts at one checked it by one sha256
stream on one core. Its pieces (``{"piece_size": N, "xxh3_128": [...]}``, as a
manifest records a file's) are checked on every core, and name the piece that
differs. NULL, as for every existing row, is checked by its sha256 as before.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policy_folds") as batch:
        batch.add_column(sa.Column("pieces", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policy_folds") as batch:
        batch.drop_column("pieces")
