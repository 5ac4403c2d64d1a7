"""Webhooks: receivers of the catalog's events, an outbox of what each is still owed, and a delivery log.

``webhooks`` holds each receiver: its URL (which may hold credentials, never
shown), the secret its requests are signed with, the events it subscribes to
(comma-separated names, or ``*``) and how many attempts a delivery gets
before it is dead-lettered.

``webhook_outbox`` holds one row per event per subscribing webhook, written
in the same transaction as what the event reports, so a process killed
between that commit and the delivery loses nothing. ``uid`` is the id the
receiver sees on every attempt (it de-duplicates by it); ``status`` is
``pending``, ``delivered`` or ``dead``; ``claimed_by``/``claimed_until`` are
one deliverer's lease on the row. The index serves the deliverers' question,
each (webhook, run)'s oldest pending row.

``webhook_deliveries`` logs every attempt: its number, the HTTP status or
the error, who tried and when.

No existing row changes: the tables start empty.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("secret", sa.String(255)),
        sa.Column("events", sa.Text, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_webhooks"),
    )
    op.create_table(
        "webhook_outbox",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("uid", sa.String(32), nullable=False),
        sa.Column("webhook_id", sa.Integer, nullable=False),
        sa.Column("run_id", sa.Integer, nullable=False),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("next_attempt_at", TS, nullable=False),
        sa.Column("claimed_by", sa.String(255)),
        sa.Column("claimed_until", TS),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("finished_at", TS),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_outbox"),
        sa.ForeignKeyConstraint(["webhook_id"], ["webhooks.id"], ondelete="CASCADE",
                                name="fk_webhook_outbox_webhook_id_webhooks"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_webhook_outbox_run_id_runs"),
        sa.CheckConstraint("status IN ('pending', 'delivered', 'dead')", name="ck_webhook_outbox_status"),
    )
    op.create_index("ix_webhook_outbox_status_webhook_id_run_id_id", "webhook_outbox",
                    ["status", "webhook_id", "run_id", "id"])
    op.create_index("ix_webhook_outbox_webhook_id_id", "webhook_outbox", ["webhook_id", "id"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("outbox_id", sa.Integer, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("status_code", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("deliverer", sa.String(255)),
        sa.Column("attempted_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_deliveries"),
        sa.ForeignKeyConstraint(["outbox_id"], ["webhook_outbox.id"], ondelete="CASCADE",
                                name="fk_webhook_deliveries_outbox_id_webhook_outbox"),
    )
    op.create_index("ix_webhook_deliveries_outbox_id", "webhook_deliveries", ["outbox_id"])


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_outbox_id", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_webhook_outbox_webhook_id_id", table_name="webhook_outbox")
    op.drop_index("ix_webhook_outbox_status_webhook_id_run_id_id", table_name="webhook_outbox")
    op.drop_table("webhook_outbox")
    op.drop_table("webhooks")
