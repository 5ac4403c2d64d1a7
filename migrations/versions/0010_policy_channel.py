"""The policy channel: policy steps and their delta chains, markers, folds, consumers and their loads.

``policy_steps`` says how a step that carries a policy version stores it:
``full`` (its own ``model.safetensors``) or ``delta`` (a
``delta.safetensors`` against the step ``base_step``, whose row is
``base_checkpoint_id``, a plain id as in ``checkpoint_lineage``), and
``full_sha256``, the digest of the ``model.safetensors`` a full publish of
that version writes, which every materialized copy is checked against. A
table of its own rather than columns of ``checkpoints``: dropping a column of
``checkpoints`` copies the table on SQLite, and dropping the old copy would
delete every step's files, tags and replicas (``ON DELETE CASCADE``) on a
downgrade. The step's version stays where it was, ``checkpoints.policy_version``.

``policy_markers`` records a version whose bytes moved outside the registry
(NCCL, RDMA), so that lag and audit cover it.

``policy_folds`` records a derived delta from one policy step to a later one
(for consumers that lag), stored under the run's ``.policy-folds/`` directory
with its size and digest, and the status of that copy.

``policy_consumers`` is one registered consumer of a run's versions
(``Registry.subscribe``): its host and process, its heartbeat and when it
expires, the version it serves now (``applied_version``) and when it ended.

``policy_loads`` is one lease of one version by one consumer, and the audit of
that load: the copy it was read from, the bytes fetched, the time of each
phase (committed, notified, leased, fetched, verified, applied, released),
whether every tensor verified, and the error if it failed. A load not yet
released, of a consumer that has not expired, keeps its version.

Existing rows: no step is a policy step of this table (a step published with
``policy_version`` before this revision is a full whose ``full_sha256`` is
not known), no marker, fold, consumer or load.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "policy_steps",
        sa.Column("checkpoint_id", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("base_checkpoint_id", sa.Integer),
        sa.Column("base_step", sa.BigInteger),
        sa.Column("full_sha256", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("checkpoint_id", name="pk_policy_steps"),
        sa.ForeignKeyConstraint(["checkpoint_id"], ["checkpoints.id"], ondelete="CASCADE",
                                name="fk_policy_steps_checkpoint_id_checkpoints"),
        sa.CheckConstraint("kind IN ('full', 'delta')", name="ck_policy_steps_kind"),
    )
    op.create_index("ix_policy_steps_base_checkpoint_id", "policy_steps", ["base_checkpoint_id"])
    op.create_table(
        "policy_markers",
        sa.Column("run_id", sa.Integer, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("full_sha256", sa.String(64)),
        sa.Column("note", sa.Text),
        sa.Column("writer", sa.String(255)),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("run_id", "version", name="pk_policy_markers"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_policy_markers_run_id_runs"),
    )
    op.create_table(
        "policy_folds",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("run_id", sa.Integer, nullable=False),
        sa.Column("from_step", sa.BigInteger, nullable=False),
        sa.Column("to_step", sa.BigInteger, nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_policy_folds"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_policy_folds_run_id_runs"),
        sa.UniqueConstraint("run_id", "from_step", "to_step", name="uq_policy_folds_run_id_from_step_to_step"),
        sa.CheckConstraint("status IN ('verified', 'corrupt', 'deleted')", name="ck_policy_folds_status"),
    )
    op.create_table(
        "policy_consumers",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("run_id", sa.Integer, nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer),
        sa.Column("ttl", sa.Float, nullable=False),
        sa.Column("registered_at", TS, nullable=False),
        sa.Column("heartbeat_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.Column("applied_version", sa.BigInteger),
        sa.Column("applied_step", sa.BigInteger),
        sa.Column("applied_at", TS),
        sa.Column("ended_at", TS),
        sa.PrimaryKeyConstraint("id", name="pk_policy_consumers"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_policy_consumers_run_id_runs"),
        sa.UniqueConstraint("run_id", "name", name="uq_policy_consumers_run_id_name"),
    )
    op.create_index("ix_policy_consumers_run_id_expires_at", "policy_consumers", ["run_id", "expires_at"])
    op.create_table(
        "policy_loads",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("consumer_id", sa.Integer, nullable=False),
        sa.Column("run_id", sa.Integer, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("source", sa.String(255)),
        sa.Column("bytes_fetched", sa.BigInteger, nullable=False),
        sa.Column("verified", sa.Boolean, nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("committed_at", TS),
        sa.Column("notified_at", TS),
        sa.Column("leased_at", TS, nullable=False),
        sa.Column("fetched_at", TS),
        sa.Column("verified_at", TS),
        sa.Column("applied_at", TS),
        sa.Column("released_at", TS),
        sa.PrimaryKeyConstraint("id", name="pk_policy_loads"),
        sa.ForeignKeyConstraint(["consumer_id"], ["policy_consumers.id"], ondelete="CASCADE",
                                name="fk_policy_loads_consumer_id_policy_consumers"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_policy_loads_run_id_runs"),
    )
    # retention's question (the versions a live consumer still holds) and the audit's (who loaded version N)
    op.create_index("ix_policy_loads_run_id_released_at_version", "policy_loads", ["run_id", "released_at", "version"])
    op.create_index("ix_policy_loads_run_id_version", "policy_loads", ["run_id", "version"])
    op.create_index("ix_policy_loads_consumer_id_id", "policy_loads", ["consumer_id", "id"])


def downgrade() -> None:
    # nothing outside these tables references them: dropping them sets nothing else to NULL
    op.drop_index("ix_policy_loads_consumer_id_id", table_name="policy_loads")
    op.drop_index("ix_policy_loads_run_id_version", table_name="policy_loads")
    op.drop_index("ix_policy_loads_run_id_released_at_version", table_name="policy_loads")
    op.drop_table("policy_loads")
    op.drop_index("ix_policy_consumers_run_id_expires_at", table_name="policy_consumers")
    op.drop_table("policy_consumers")
    op.drop_table("policy_folds")
    op.drop_table("policy_markers")
    op.drop_index("ix_policy_steps_base_checkpoint_id", table_name="policy_steps")
    op.drop_table("policy_steps")
