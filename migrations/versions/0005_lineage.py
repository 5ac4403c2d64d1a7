"""Lineage: how each step came to be, forks recorded on attempts, and an index for dedup.

``checkpoint_lineage`` holds one row per committed step: how it came to be
(``started``, ``resumed``, ``forked``, ``imported``, or ``unknown`` for a step
adopted by fsck or written before this revision), the step it came from,
named by run and step (never a foreign key: a deleted or overwritten parent is
still named) with that parent's manifest digest at the time and its row id
(a plain integer, so that walking a chain is one primary-key lookup per hop;
a step keeps its row for good, through deletion and overwrites), and, for an
import, where it came from (JSON). ``attempts`` gain the checkpoint an attempt
was forked from. ``checkpoint_files.sha256`` is indexed so a publish can find
a live file with the same bytes in one lookup.

Existing steps are backfilled from their attempts: ``resumed`` from the
attempt's ``resumed_from`` step of the same run, ``started`` for an attempt
that resumed from nothing, ``unknown`` without an attempt.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoint_lineage",
        sa.Column("checkpoint_id", sa.Integer, nullable=False),
        sa.Column("how", sa.String(16), nullable=False),
        sa.Column("parent_run", sa.String(128)),
        sa.Column("parent_step", sa.BigInteger),
        sa.Column("parent_manifest_sha256", sa.String(64)),
        sa.Column("parent_checkpoint_id", sa.Integer),
        sa.Column("source", sa.Text),
        sa.PrimaryKeyConstraint("checkpoint_id", name="pk_checkpoint_lineage"),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE",
                                name="fk_checkpoint_lineage_checkpoint_id_checkpoints"),
    )
    op.create_index("ix_checkpoint_lineage_parent_run_parent_step", "checkpoint_lineage",
                    ["parent_run", "parent_step"])
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("fork_run", sa.String(128)))
        batch.add_column(sa.Column("fork_step", sa.BigInteger))
        batch.add_column(sa.Column("fork_manifest_sha256", sa.String(64)))
    op.create_index("ix_checkpoint_files_sha256", "checkpoint_files", ["sha256"])
    op.execute(sa.text(
        "INSERT INTO checkpoint_lineage (checkpoint_id, how, parent_run, parent_step, parent_manifest_sha256, "
        "  parent_checkpoint_id) "
        "SELECT c.id, "
        "  CASE WHEN a.id IS NULL THEN 'unknown' WHEN a.resumed_from IS NULL THEN 'started' ELSE 'resumed' END, "
        "  CASE WHEN a.resumed_from IS NULL THEN NULL ELSE r.name END, "
        "  a.resumed_from, "
        "  (SELECT p.manifest_sha256 FROM checkpoints p WHERE p.run_id = c.run_id AND p.step = a.resumed_from), "
        "  (SELECT p.id FROM checkpoints p WHERE p.run_id = c.run_id AND p.step = a.resumed_from) "
        "FROM checkpoints c JOIN runs r ON r.id = c.run_id LEFT JOIN attempts a ON a.id = c.attempt_id "
        "WHERE c.status <> 'staging'"))


def downgrade() -> None:
    op.drop_index("ix_checkpoint_files_sha256", table_name="checkpoint_files")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("fork_manifest_sha256")
        batch.drop_column("fork_step")
        batch.drop_column("fork_run")
    op.drop_index("ix_checkpoint_lineage_parent_run_parent_step", table_name="checkpoint_lineage")
    op.drop_table("checkpoint_lineage")
