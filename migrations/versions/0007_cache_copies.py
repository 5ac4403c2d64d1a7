"""Cache copies: a host's cached download of a durable copy is a replica location of its own.

Before this revision a host recorded its cached download of a step's
durable copy (``<fast>/.registry/cache/...``) at its fast tier's location
(``fast:<tier id>``), the one row that location may have per step, so the
download overwrote the row of the host's own fast directory of the step. A
cache copy now has its own location, ``cache:<tier id>``: every row at a
``fast:`` location whose path is under ``.registry/cache/`` moves there. No
``cache:`` row exists before this revision, so the move never collides.

A fast copy whose row such a download overwrote before this revision is not
brought back: nothing recorded its digest.

Downgrading moves each cache copy back to its fast tier's location where that
step has no fast copy row, and forgets the others (a cache copy is
disposable; the older revision cannot hold both).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(sa.text(
        "UPDATE checkpoint_replicas SET location = 'cache:' || substr(location, 6) "
        "WHERE location LIKE 'fast:%' AND path LIKE '.registry/cache/%'"))


def downgrade() -> None:
    op.execute(sa.text(
        "DELETE FROM checkpoint_replicas WHERE location LIKE 'cache:%' AND EXISTS ("
        "  SELECT 1 FROM checkpoint_replicas f WHERE f.checkpoint_id = checkpoint_replicas.checkpoint_id"
        "  AND f.location = 'fast:' || substr(checkpoint_replicas.location, 7))"))
    op.execute(sa.text(
        "UPDATE checkpoint_replicas SET location = 'fast:' || substr(location, 7) WHERE location LIKE 'cache:%'"))
