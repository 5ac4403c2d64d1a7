"""The catalog schema as SQLAlchemy Core tables.

The live schema is created only by the migrations in ``migrations/`` (``registry.migrations`` once installed);
these tables describe it for queries, and a test checks that the two agree. Core, not the ORM: every query
here is a statement over columns, and importing ``sqlalchemy.orm`` would cost each CLI command ~80 ms.
"""

from __future__ import annotations

from sqlalchemy import (BigInteger, Boolean, CheckConstraint, Column, DateTime, Float, ForeignKey, Index,
                        Integer, MetaData, String, Table, Text, UniqueConstraint)

from registry.records import Status

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

STATUS_SQL = "status IN (" + ", ".join(f"'{s.value}'" for s in Status) + ")"  # migrations keep their own literal copy


metadata = MetaData(naming_convention=NAMING_CONVENTION)

Run = Table(
    "runs", metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(128), unique=True, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)


# One process's stint of training a run; a resume starts a new attempt.
Attempt = Table(
    "attempts", metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), index=True, nullable=False),
    Column("writer", String(255), nullable=False),
    Column("resumed_from", BigInteger),
    Column("started_at", DateTime(timezone=True), nullable=False),
    # the checkpoint this attempt was forked from (``begin_attempt(run, fork_from=REF)``), by name
    Column("fork_run", String(128)),
    Column("fork_step", BigInteger),
    Column("fork_manifest_sha256", String(64)),
)


CheckpointRow = Table(
    "checkpoints", metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("status", String(16), nullable=False),
    Column("path", String(1024), nullable=False),
    Column("writer", String(255)),
    Column("attempt_id", Integer, ForeignKey("attempts.id", ondelete="SET NULL")),
    Column("epoch", BigInteger, default=0, nullable=False),
    Column("consumed_samples", BigInteger, default=0, nullable=False),
    Column("optimizer_step", BigInteger),
    Column("policy_version", BigInteger),
    Column("manifest_sha256", String(64)),
    Column("total_bytes", BigInteger, default=0, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("published_at", DateTime(timezone=True)),
    Column("verified_at", DateTime(timezone=True)),
    Column("deleted_at", DateTime(timezone=True)),
    UniqueConstraint("run_id", "step"),
    CheckConstraint(STATUS_SQL, name="status"),
    Index("ix_checkpoints_run_status_step", "run_id", "status", "step"),
    Index("ix_checkpoints_run_policy", "run_id", "policy_version"),
)


CheckpointFile = Table(
    "checkpoint_files", metadata,
    Column("checkpoint_id", Integer, ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True),
    Column("name", String(255), primary_key=True),
    Column("size", BigInteger, nullable=False),
    Column("sha256", String(64), nullable=False),
    Index("ix_checkpoint_files_sha256", "sha256"),  # dedup: a live file with these bytes
)


# How a committed step came to be, and the step it came from (see ``registry.catalog.lineage``).
#
# The parent is named by run and step, not by a foreign key, so that it is
# still named after retention deleted it or a publish replaced it; its
# manifest digest at the time tells which payload it was.
Lineage = Table(
    "checkpoint_lineage", metadata,
    Column("checkpoint_id", Integer, ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True),
    Column("how", String(16), nullable=False),
    Column("parent_run", String(128)),
    Column("parent_step", BigInteger),
    Column("parent_manifest_sha256", String(64)),
    # the parent's row, found when this row was written; a plain id (a step keeps its row through deletion
    # and overwrites) so that a chain is walked by primary key, whatever the planner knows of the tables
    Column("parent_checkpoint_id", Integer),
    Column("source", Text),
    Index("ix_checkpoint_lineage_parent_run_parent_step", "parent_run", "parent_step"),
)


# A metric point. A newer point for the same (run, key, step) supersedes
# older ones, and so does a resume below its step; superseded rows stay as history.
Metric = Table(
    "metrics", metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("key", String(255), nullable=False),
    Column("value", Float, nullable=False),
    Column("attempt_id", Integer, ForeignKey("attempts.id", ondelete="SET NULL")),
    Column("superseded", Boolean, default=False, nullable=False),
    Column("logged_at", DateTime(timezone=True), nullable=False),
    Index("ix_metrics_best", "run_id", "key", "superseded", "value", "step"),
    Index("ix_metrics_run_step_current", "run_id", "step", "superseded", "key", "value"),
)


Tag = Table(
    "tags", metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("name", String(128), primary_key=True),
    Column("checkpoint_id", Integer, ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("note", Text),  # what the person who set the tag said about it
)


Event = Table(
    "events", metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE")),
    Column("step", BigInteger),
    Column("kind", String(32), nullable=False),
    Column("detail", Text, default="{}", nullable=False),
    Column("actor", String(255)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Index("ix_events_run_id_id", "run_id", "id"),
)


# A reader's claim on a checkpoint; retention never deletes a leased step.
Lease = Table(
    "leases", metadata,
    Column("id", Integer, primary_key=True),
    Column("checkpoint_id", Integer, ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False),
    Column("holder", String(255), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Index("ix_leases_checkpoint_expires", "checkpoint_id", "expires_at"),
)


REPLICA_STATUSES = ("pending", "published", "verified", "corrupt", "deleted")
REPLICA_STATUS_SQL = "status IN (" + ", ".join(f"'{s}'" for s in REPLICA_STATUSES) + ")"


# One copy of a step on one storage tier (``fast:<tier id>``, ``part:<tier id>`` or ``durable``; see
# ``registry.catalog.replicas``).
Replica = Table(
    "checkpoint_replicas", metadata,
    Column("checkpoint_id", Integer, ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True),
    Column("location", String(64), primary_key=True),
    Column("status", String(16), nullable=False),
    Column("path", String(1024), nullable=False),
    Column("manifest_sha256", String(64)),
    Column("writer", String(255)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("durable_at", DateTime(timezone=True)),
    Column("files", Text),  # a part's data files (JSON list); NULL: the copy holds the whole payload
    CheckConstraint(REPLICA_STATUS_SQL, name="status"),
    Index("ix_checkpoint_replicas_location_status", "location", "status"),
)


# The catalog's one identity row: its id, and whether a checkpoint root is bound to it.
#
# The bound root carries the same id in ``<root>/.registry/root.json``; the
# path it was bound from is kept only to name it in error messages.
CatalogIdentity = Table(
    "catalog_identity", metadata,
    Column("id", Integer, primary_key=True),
    Column("catalog_id", String(32), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("root_bound_at", DateTime(timezone=True)),
    Column("root_hint", String(1024)),
)


WEBHOOK_STATES = ("pending", "delivered", "dead")
WEBHOOK_STATE_SQL = "status IN (" + ", ".join(f"'{s}'" for s in WEBHOOK_STATES) + ")"


# A receiver of the catalog's events (see ``registry.catalog.outbox``). ``events`` is a comma-separated list of
# event names, or ``*`` for every event. The URL may hold credentials: it is never shown as stored.
Webhook = Table(
    "webhooks", metadata,
    Column("id", Integer, primary_key=True),
    Column("url", String(2048), nullable=False),
    Column("secret", String(255)),
    Column("events", Text, nullable=False),
    Column("max_attempts", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)


# One event for one webhook, written in the transaction that commits what it reports. ``uid`` is the id its
# receiver sees (the same on every attempt); ``claimed_by``/``claimed_until`` are a deliverer's lease on it.
WebhookOutbox = Table(
    "webhook_outbox", metadata,
    Column("id", Integer, primary_key=True),
    Column("uid", String(32), nullable=False),
    Column("webhook_id", Integer, ForeignKey("webhooks.id", ondelete="CASCADE"), nullable=False),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("event", String(32), nullable=False),
    Column("body", Text, nullable=False),
    Column("status", String(16), nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("next_attempt_at", DateTime(timezone=True), nullable=False),
    Column("claimed_by", String(255)),
    Column("claimed_until", DateTime(timezone=True)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True)),
    CheckConstraint(WEBHOOK_STATE_SQL, name="status"),
    # a deliverer's question: each (webhook, run)'s oldest pending row
    Index("ix_webhook_outbox_status_webhook_id_run_id_id", "status", "webhook_id", "run_id", "id"),
    Index("ix_webhook_outbox_webhook_id_id", "webhook_id", "id"),
)


# Every attempt at delivering an outbox row: when, by whom, and what came back.
WebhookDelivery = Table(
    "webhook_deliveries", metadata,
    Column("id", Integer, primary_key=True),
    Column("outbox_id", Integer, ForeignKey("webhook_outbox.id", ondelete="CASCADE"), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("status_code", Integer),
    Column("error", Text),
    Column("deliverer", String(255)),
    Column("attempted_at", DateTime(timezone=True), nullable=False),
    Index("ix_webhook_deliveries_outbox_id", "outbox_id"),
)


# A run's parameters (``Registry.set_params``; see ``registry.catalog.params``), one row per flattened key
# (``optimizer.lr``): the value as JSON, and as a number where it is one (not a boolean) so that a search compares
# numbers in SQL.
RunParam = Table(
    "run_params", metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("key", String(255), primary_key=True),
    Column("value", Text, nullable=False),
    Column("number", Float),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    # a search's question: the runs whose parameter KEY compares so with a number
    Index("ix_run_params_key_number_run_id", "key", "number", "run_id"),
)


# The code and environment an attempt ran in, captured once when it started (``registry.ops.environment``), as JSON.
AttemptEnvironment = Table(
    "attempt_environments", metadata,
    Column("attempt_id", Integer, ForeignKey("attempts.id", ondelete="CASCADE"), primary_key=True),
    Column("environment", Text, nullable=False),
)


POLICY_KINDS = ("full", "delta")
FOLD_STATUSES = ("verified", "corrupt", "deleted")


# How a step that carries a policy version stores it (see ``registry.catalog.policy``): its own full
# ``model.safetensors``, or a ``delta.safetensors`` against the step ``base_step`` (row ``base_checkpoint_id``, a
# plain id as in ``checkpoint_lineage``); ``full_sha256`` is the digest of the ``model.safetensors`` a full publish
# of the version writes.
PolicyStep = Table(
    "policy_steps", metadata,
    Column("checkpoint_id", Integer, ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True),
    Column("kind", String(8), nullable=False),
    Column("base_checkpoint_id", Integer, index=True),
    Column("base_step", BigInteger),
    Column("full_sha256", String(64), nullable=False),
    CheckConstraint("kind IN ('full', 'delta')", name="kind"),
)


# A version whose bytes moved outside the registry (``Registry.publish_policy_marker``).
PolicyMarker = Table(
    "policy_markers", metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("version", BigInteger, primary_key=True),
    Column("full_sha256", String(64)),
    Column("note", Text),
    Column("writer", String(255)),
    Column("created_at", DateTime(timezone=True), nullable=False),
)


# A derived delta from one policy step to a later one (``Registry.fold``), for consumers that lag.
PolicyFold = Table(
    "policy_folds", metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("from_step", BigInteger, nullable=False),
    Column("to_step", BigInteger, nullable=False),
    Column("path", String(1024), nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("pieces", Text),  # {"piece_size": N, "xxh3_128": [...]} of its bytes; NULL: checked by sha256 alone
    Column("status", String(16), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    UniqueConstraint("run_id", "from_step", "to_step"),
    CheckConstraint("status IN ('verified', 'corrupt', 'deleted')", name="status"),
)


# One registered consumer of a run's policy versions (``Registry.subscribe``).
PolicyConsumer = Table(
    "policy_consumers", metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("name", String(255), nullable=False),
    Column("host", String(255), nullable=False),
    Column("pid", Integer),
    Column("ttl", Float, nullable=False),
    Column("registered_at", DateTime(timezone=True), nullable=False),
    Column("heartbeat_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("applied_version", BigInteger),
    Column("applied_step", BigInteger),
    Column("applied_at", DateTime(timezone=True)),
    Column("ended_at", DateTime(timezone=True)),
    UniqueConstraint("run_id", "name"),
    Index("ix_policy_consumers_run_id_expires_at", "run_id", "expires_at"),
)


# One lease of one version by one consumer, and the audit of that load. An unreleased load of a consumer that has
# not expired keeps its version from retention. ``step`` is NULL for a marker's version (no bytes to keep).
PolicyLoad = Table(
    "policy_loads", metadata,
    Column("id", Integer, primary_key=True),
    Column("consumer_id", Integer, ForeignKey("policy_consumers.id", ondelete="CASCADE"), nullable=False),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("version", BigInteger, nullable=False),
    Column("step", BigInteger),
    Column("source", String(255)),
    Column("bytes_fetched", BigInteger, nullable=False),
    Column("verified", Boolean, nullable=False),
    Column("error", Text),
    Column("committed_at", DateTime(timezone=True)),
    Column("notified_at", DateTime(timezone=True)),
    Column("leased_at", DateTime(timezone=True), nullable=False),
    Column("fetched_at", DateTime(timezone=True)),
    Column("verified_at", DateTime(timezone=True)),
    Column("applied_at", DateTime(timezone=True)),
    Column("released_at", DateTime(timezone=True)),
    Index("ix_policy_loads_run_id_released_at_version", "run_id", "released_at", "version"),
    Index("ix_policy_loads_run_id_version", "run_id", "version"),
    Index("ix_policy_loads_consumer_id_id", "consumer_id", "id"),
)
