"""Initial catalog: runs, attempts, checkpoints, files, metrics, tags, events, leases.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.UniqueConstraint("name", name="uq_runs_name"),
    )
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("run_id", sa.Integer, nullable=False),
        sa.Column("writer", sa.String(255), nullable=False),
        sa.Column("resumed_from", sa.BigInteger),
        sa.Column("started_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_attempts"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_attempts_run_id_runs"),
    )
    op.create_index("ix_attempts_run_id", "attempts", ["run_id"])
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("run_id", sa.Integer, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("writer", sa.String(255)),
        sa.Column("attempt_id", sa.Integer),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("consumed_samples", sa.BigInteger, nullable=False),
        sa.Column("optimizer_step", sa.BigInteger),
        sa.Column("policy_version", sa.BigInteger),
        sa.Column("manifest_sha256", sa.String(64)),
        sa.Column("total_bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("published_at", TS),
        sa.Column("verified_at", TS),
        sa.Column("deleted_at", TS),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        sa.UniqueConstraint("run_id", "step", name="uq_checkpoints_run_id_step"),
        sa.CheckConstraint("status IN ('staging', 'published', 'verified', 'failed', 'corrupt', 'deleted')",
                           name="ck_checkpoints_status"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE",
                                name="fk_checkpoints_run_id_runs"),
        sa.ForeignKeyConstraint(["attempt_id"], ["attempts.id"], ondelete="SET NULL",
                                name="fk_checkpoints_attempt_id_attempts"),
    )
    op.create_index("ix_checkpoints_run_status_step", "checkpoints", ["run_id", "status", "step"])
    op.create_index("ix_checkpoints_run_policy", "checkpoints", ["run_id", "policy_version"])
    op.create_table(
        "checkpoint_files",
        sa.Column("checkpoint_id", sa.Integer, nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("checkpoint_id", "name", name="pk_checkpoint_files"),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE",
                                name="fk_checkpoint_files_checkpoint_id_checkpoints"),
    )
    op.create_table(
        "metrics",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("run_id", sa.Integer, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("value", sa.Float, nullable=False),
        sa.Column("attempt_id", sa.Integer),
        sa.Column("superseded", sa.Boolean, nullable=False),
        sa.Column("logged_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_metrics"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_metrics_run_id_runs"),
        sa.ForeignKeyConstraint(["attempt_id"], ["attempts.id"], ondelete="SET NULL",
                                name="fk_metrics_attempt_id_attempts"),
    )
    op.create_index("ix_metrics_best", "metrics", ["run_id", "key", "superseded", "value", "step"])
    op.create_index("ix_metrics_run_step", "metrics", ["run_id", "step", "key"])
    op.create_table(
        "tags",
        sa.Column("run_id", sa.Integer, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("checkpoint_id", sa.Integer, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("run_id", "name", name="pk_tags"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_tags_run_id_runs"),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE",
                                name="fk_tags_checkpoint_id_checkpoints"),
    )
    op.create_index("ix_tags_checkpoint_id", "tags", ["checkpoint_id"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("run_id", sa.Integer),
        sa.Column("step", sa.BigInteger),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
        sa.Column("actor", sa.String(255)),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_events_run_id_runs"),
    )
    op.create_index("ix_events_run_id_id", "events", ["run_id", "id"])
    op.create_table(
        "leases",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("checkpoint_id", sa.Integer, nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_leases"),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE",
                                name="fk_leases_checkpoint_id_checkpoints"),
    )
    op.create_index("ix_leases_checkpoint_expires", "leases", ["checkpoint_id", "expires_at"])


def downgrade() -> None:
    for table in ("leases", "events", "tags", "metrics", "checkpoint_files", "checkpoints",
                  "attempts", "runs"):
        op.drop_table(table)
