"""Runs as experiments: run parameters, the environment of each attempt, notes on tags.

``run_params`` holds a run's parameters (``Registry.set_params``), one row
per flattened key (``optimizer.lr``): the value as JSON, and as a number
where it is one (not a boolean), so that a search compares numbers in SQL.
The index serves a search's question, the runs whose parameter KEY compares
so with a number.

``attempt_environments`` holds the code and environment an attempt ran in,
captured once when it started (git commit and dirty flag, host, versions, the
command line, a digest of the installed packages), as JSON. A table of its
own rather than a column of ``attempts``: dropping a column of ``attempts``
copies the table on SQLite, and dropping the old copy would set every
checkpoint's and metric point's ``attempt_id`` to NULL (``ON DELETE SET
NULL``) on a downgrade.

``tags`` gain a ``note``: what the person who set a tag said about it.

Existing rows: no run has parameters, no attempt an environment, no tag a note.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "run_params",
        sa.Column("run_id", sa.Integer, nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("value", sa.Text, nullable=False),
        sa.Column("number", sa.Float),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("run_id", "key", name="pk_run_params"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_run_params_run_id_runs"),
    )
    op.create_index("ix_run_params_key_number_run_id", "run_params", ["key", "number", "run_id"])
    op.create_table(
        "attempt_environments",
        sa.Column("attempt_id", sa.Integer, nullable=False),
        sa.Column("environment", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("attempt_id", name="pk_attempt_environments"),
        sa.ForeignKeyConstraint(["attempt_id"], ["attempts.id"], ondelete="CASCADE",
                                name="fk_attempt_environments_attempt_id_attempts"),
    )
    with op.batch_alter_table("tags") as batch:
        batch.add_column(sa.Column("note", sa.Text))


def downgrade() -> None:
    # nothing references ``tags``: copying it on SQLite sets nothing else to NULL
    with op.batch_alter_table("tags") as batch:
        batch.drop_column("note")
    op.drop_table("attempt_environments")
    op.drop_index("ix_run_params_key_number_run_id", table_name="run_params")
    op.drop_table("run_params")
