"""What the catalog is told and hands back about a publish: claims, payloads, files, commits and lineage.

Plain frozen records, shared by the catalog's query modules and the layers above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from registry.records import Status


@dataclass(frozen=True, kw_only=True)
class LineageRecord:
    """What a commit records about where its payload came from (``how``: see
    :data:`registry.catalog.lineage.HOWS`)."""

    how: str
    parent_run: str | None = None
    parent_step: int | None = None
    source: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class Claim:
    checkpoint_id: int
    run_id: int
    previous_status: str | None
    previous_path: str | None = None  # the row's path before the claim: where an overwritten payload lives


@dataclass(frozen=True, kw_only=True)
class FileRecord:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class PayloadRecord:
    """What the catalog records about a payload found valid on disk, by a publish, an import or fsck."""

    status: str  # published or verified
    manifest_sha256: str
    files: Sequence[FileRecord]
    total_bytes: int
    epoch: int = 0
    consumed_samples: int = 0
    optimizer_step: int | None = None
    policy_version: int | None = None
    linked: Sequence[str] = ()  # files stored as hard links to identical live files (see registry.fs.dedup)
    linked_bytes: int = 0
    policy: PolicyRecord | None = None  # what a repair recovers of a policy step from its manifest

    def columns(self, now: datetime) -> dict[str, Any]:
        """The checkpoint row's values once this payload is in place, as of ``now``."""
        return dict(status=self.status, manifest_sha256=self.manifest_sha256, total_bytes=self.total_bytes,
                    epoch=self.epoch, consumed_samples=self.consumed_samples,
                    optimizer_step=self.optimizer_step, policy_version=self.policy_version, updated_at=now,
                    published_at=now, verified_at=now if self.status == Status.VERIFIED else None, deleted_at=None)


@dataclass(frozen=True, kw_only=True)
class PolicyRecord:
    """What a commit records about how a policy step stores its version (see :mod:`registry.catalog.policy`).

    ``immutable``: the publish asked for the policy channel's rule that a
    version names one set of weights for good, checked again inside the commit
    (another live step of the run with the same version and other weights
    makes the commit fail with ``PolicyVersionConflictError``).
    """

    kind: str                     # full or delta
    full_sha256: str
    base_step: int | None = None  # a delta's base, a step of the same run
    immutable: bool = False
    base_sha256: str | None = None  # a delta's base by its full_sha256, where its step is not known (a repair)


@dataclass(frozen=True, kw_only=True)
class PartRecord:
    """One host's part of a step published from several hosts: its location (``part:<tier id>``), its directory
    relative to that host's fast root, and the data files it holds."""

    location: str
    path: str
    files: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CommitRecord:
    """A publish's commit: its payload, and what its writer records in the same transaction.

    ``attempt_id`` is the writer's attempt (None for an import);
    ``resumed_from`` is set on the first publish of an attempt that resumed
    (see :meth:`Catalog.commit_publish`).
    """

    payload: PayloadRecord
    metrics: Sequence[tuple[int, str, float]] = ()
    attempt_id: int | None = None
    tags: Sequence[str] = ()
    resumed_from: int | None = None
    lineage: LineageRecord | None = None  # an explicit parent or an import; else the attempt says
    replica: tuple[str, str] | None = None  # (location, path) of the copy a tiered root's publish made
    parts: Sequence[PartRecord] = ()  # the hosts' parts of a sharded step published from several hosts
    policy: PolicyRecord | None = None  # how a step that carries a policy version stores it


__all__ = ["Claim", "CommitRecord", "FileRecord", "LineageRecord", "PartRecord", "PayloadRecord", "PolicyRecord"]
