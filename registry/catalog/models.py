"""The catalog schema as typed SQLAlchemy 2 models.

The live schema is created only by the migrations in ``migrations/`` (``registry.migrations`` once installed);
these models describe it for queries, and a test checks that the two agree.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (BigInteger, Boolean, CheckConstraint, DateTime, Float, ForeignKey, Index,
                        Integer, MetaData, String, Text, UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from registry.records import Status

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

STATUS_SQL = "status IN (" + ", ".join(f"'{s.value}'" for s in Status) + ")"  # migrations keep their own literal copy


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Attempt(Base):
    """One process's stint of training a run; a resume starts a new attempt."""
    __tablename__ = "attempts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    writer: Mapped[str] = mapped_column(String(255))
    resumed_from: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # the checkpoint this attempt was forked from (``begin_attempt(run, fork_from=REF)``), by name
    fork_run: Mapped[str | None] = mapped_column(String(128))
    fork_step: Mapped[int | None] = mapped_column(BigInteger)
    fork_manifest_sha256: Mapped[str | None] = mapped_column(String(64))


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "step"),
        CheckConstraint(STATUS_SQL, name="status"),
        Index("ix_checkpoints_run_status_step", "run_id", "status", "step"),
        Index("ix_checkpoints_run_policy", "run_id", "policy_version"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(String(1024))
    writer: Mapped[str | None] = mapped_column(String(255))
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempts.id", ondelete="SET NULL"))
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    consumed_samples: Mapped[int] = mapped_column(BigInteger, default=0)
    optimizer_step: Mapped[int | None] = mapped_column(BigInteger)
    policy_version: Mapped[int | None] = mapped_column(BigInteger)
    manifest_sha256: Mapped[str | None] = mapped_column(String(64))
    total_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    verified_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class CheckpointFile(Base):
    __tablename__ = "checkpoint_files"
    __table_args__ = (Index("ix_checkpoint_files_sha256", "sha256"),)  # dedup: a live file with these bytes
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"),
                                               primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))


class Lineage(Base):
    """How a committed step came to be, and the step it came from (see ``registry.catalog.lineage``).

    The parent is named by run and step, not by a foreign key, so that it is
    still named after retention deleted it or a publish replaced it; its
    manifest digest at the time tells which payload it was.
    """
    __tablename__ = "checkpoint_lineage"
    __table_args__ = (Index("ix_checkpoint_lineage_parent_run_parent_step", "parent_run", "parent_step"),)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"),
                                               primary_key=True)
    how: Mapped[str] = mapped_column(String(16))
    parent_run: Mapped[str | None] = mapped_column(String(128))
    parent_step: Mapped[int | None] = mapped_column(BigInteger)
    parent_manifest_sha256: Mapped[str | None] = mapped_column(String(64))
    # the parent's row, found when this row was written; a plain id (a step keeps its row through deletion
    # and overwrites) so that a chain is walked by primary key, whatever the planner knows of the tables
    parent_checkpoint_id: Mapped[int | None] = mapped_column(Integer)
    source: Mapped[str | None] = mapped_column(Text)


class Metric(Base):
    """A metric point. A newer point for the same (run, key, step) supersedes
    older ones, and so does a resume below its step; superseded rows stay as history."""
    __tablename__ = "metrics"
    __table_args__ = (
        Index("ix_metrics_best", "run_id", "key", "superseded", "value", "step"),
        Index("ix_metrics_run_step_current", "run_id", "step", "superseded", "key", "value"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    key: Mapped[str] = mapped_column(String(255))
    value: Mapped[float] = mapped_column(Float)
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempts.id", ondelete="SET NULL"))
    superseded: Mapped[bool] = mapped_column(Boolean, default=False)
    logged_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Tag(Base):
    __tablename__ = "tags"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_id_id", "run_id", "id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int | None] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str] = mapped_column(Text, default="{}")
    actor: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Lease(Base):
    """A reader's claim on a checkpoint; retention never deletes a leased step."""
    __tablename__ = "leases"
    __table_args__ = (Index("ix_leases_checkpoint_expires", "checkpoint_id", "expires_at"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    holder: Mapped[str] = mapped_column(String(255))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


REPLICA_STATUSES = ("pending", "published", "verified", "corrupt", "deleted")
REPLICA_STATUS_SQL = "status IN (" + ", ".join(f"'{s}'" for s in REPLICA_STATUSES) + ")"


class Replica(Base):
    """One copy of a step on one storage tier (``fast:<tier id>`` or ``durable``; see ``registry.catalog.replicas``)."""
    __tablename__ = "checkpoint_replicas"
    __table_args__ = (
        CheckConstraint(REPLICA_STATUS_SQL, name="status"),
        Index("ix_checkpoint_replicas_location_status", "location", "status"),
    )
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True)
    location: Mapped[str] = mapped_column(String(64), primary_key=True)
    status: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(String(1024))
    manifest_sha256: Mapped[str | None] = mapped_column(String(64))
    writer: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    durable_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class CatalogIdentity(Base):
    """The catalog's one identity row: its id, and whether a checkpoint root is bound to it.

    The bound root carries the same id in ``<root>/.registry/root.json``; the
    path it was bound from is kept only to name it in error messages.
    """
    __tablename__ = "catalog_identity"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    catalog_id: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    root_bound_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    root_hint: Mapped[str | None] = mapped_column(String(1024))
