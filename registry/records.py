"""Frozen result types shared by the catalog, the loader and the API.

Plain data with no torch and no SQL, so every layer can return them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import Any


class Status(str, Enum):
    """A checkpoint's status: the catalog's ``status`` column and the ``status`` of every record.

    Members are strings, so ``info.status == "verified"``, JSON output, SQL parameters and f-strings see the
    plain value.
    """

    STAGING = "staging"        # a writer holds the step and is writing its payload
    PUBLISHED = "published"    # committed, not yet re-hashed
    VERIFIED = "verified"      # committed and re-hashed against its manifest
    FAILED = "failed"          # a publish that never committed; nothing on disk is kept
    CORRUPT = "corrupt"        # committed, but bytes read did not match the manifest
    DELETED = "deleted"        # committed once, payload removed (or being removed) on purpose

    def __str__(self) -> str:
        return self.value


STATUSES: tuple[Status, ...] = tuple(Status)
LIVE = (Status.PUBLISHED, Status.VERIFIED)                         # loadable, resolvable by latest-published
RANKABLE = (Status.PUBLISHED, Status.VERIFIED)                     # eligible for best:
HAS_PAYLOAD = (Status.PUBLISHED, Status.VERIFIED, Status.CORRUPT)  # committed bytes on disk: verify, retention
NO_PAYLOAD = (Status.DELETED, Status.FAILED, Status.STAGING)       # nothing committed on disk to read
ENDED = (Status.DELETED, Status.FAILED)                            # over; only a new publish of the step revives it


def human_bytes(n: int) -> str:
    """``1.5 GiB``: sizes as an operator reads them in tables and plans."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    run: str
    step: int
    status: Status
    path: Path
    epoch: int = 0
    consumed_samples: int = 0
    policy_version: int | None = None
    optimizer_step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    total_bytes: int = 0
    manifest_sha256: str | None = None
    created_at: datetime | None = None
    verified_at: datetime | None = None
    writer: str | None = None
    url: str | None = None  # the step's s3:// URL on an object-store root; None on a filesystem root

    def under(self, root: Path) -> CheckpointInfo:
        """This step with its path made absolute: the catalog records it relative to the checkpoint ``root``."""
        return replace(self, path=root / self.path)

    def at(self, url: str) -> CheckpointInfo:
        """This step on an object-store root: ``path`` stays relative, ``url`` is where its objects are."""
        return replace(self, url=url)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run, "step": self.step, "status": str(self.status), "path": str(self.path),
            "epoch": self.epoch, "consumed_samples": self.consumed_samples,
            "policy_version": self.policy_version, "optimizer_step": self.optimizer_step,
            "metrics": dict(self.metrics), "tags": list(self.tags), "total_bytes": self.total_bytes,
            "manifest_sha256": self.manifest_sha256,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "verified_at": self.verified_at.isoformat() if self.verified_at else None,
            "url": self.url,
        }


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    name: str
    created_at: datetime | None = None
    checkpoints: int = 0
    latest_step: int | None = None
    total_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "checkpoints": self.checkpoints, "latest_step": self.latest_step,
                "total_bytes": self.total_bytes,
                "created_at": self.created_at.isoformat() if self.created_at else None}


@dataclass(frozen=True, kw_only=True)
class MetricPoint:
    step: int
    key: str
    value: float
    logged_at: datetime | None = None
    attempt: int | None = None
    current: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "key": self.key, "value": self.value, "attempt": self.attempt,
                "current": self.current,
                "logged_at": self.logged_at.isoformat() if self.logged_at else None}


@dataclass(frozen=True, kw_only=True)
class TagInfo:
    """A tag of a run: the step it points at, when it was set there, and the note given with it."""

    run: str
    name: str
    step: int
    updated_at: datetime | None = None
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "name": self.name, "step": self.step, "note": self.note,
                "updated_at": self.updated_at.isoformat() if self.updated_at else None}


@dataclass(frozen=True, kw_only=True)
class AttemptInfo:
    """One process's stint at a run (``Registry.begin_attempt``), and the code and environment it ran in.

    ``environment`` (empty for an attempt recorded before environments were): ``git`` (``commit``, ``branch``,
    ``dirty``; None outside a repository), ``host``, ``python``, ``torch``, ``registry``, ``argv``, ``cwd``,
    ``packages`` and ``packages_sha256`` (see :mod:`registry.ops.environment`).
    """

    id: int
    run: str
    writer: str
    started_at: datetime | None = None
    resumed_from: int | None = None
    fork_run: str | None = None
    fork_step: int | None = None
    environment: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "run": self.run, "writer": self.writer, "resumed_from": self.resumed_from,
                "fork": None if self.fork_run is None else {"run": self.fork_run, "step": self.fork_step},
                "started_at": self.started_at.isoformat() if self.started_at else None,
                "environment": dict(self.environment)}


@dataclass(frozen=True, kw_only=True)
class FoundRun:
    """A run a search found (``Registry.search_runs``), with the value of each column asked for (None where the
    run has none): ``params.KEY`` as set; ``KEY:min``/``:max``, the best value at a live checkpoint (the step
    ``RUN@best:KEY[:max]`` names), ``KEY:last`` the value at the newest live checkpoint that has one. ``steps``:
    the step of each metric column's value."""

    name: str
    created_at: datetime | None = None
    values: dict[str, Any] = field(default_factory=dict)
    steps: dict[str, int | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "values": dict(self.values), "steps": dict(self.steps),
                "created_at": self.created_at.isoformat() if self.created_at else None}


@dataclass(frozen=True, kw_only=True)
class EventInfo:
    id: int
    run: str | None
    step: int | None
    kind: str
    detail: dict[str, Any]
    actor: str | None
    created_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "run": self.run, "step": self.step, "kind": self.kind,
                "detail": self.detail, "actor": self.actor,
                "created_at": self.created_at.isoformat() if self.created_at else None}


@dataclass(frozen=True, kw_only=True)
class Skipped:
    """A step a load fell back past, and why."""

    step: int
    reason: str
    created_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class Fallback:
    """How far a load of ``ref`` fell back past corrupt steps (``Checkpoint.fallback``)."""

    ref: str
    skipped: tuple[Skipped, ...]  # newest first; each was marked corrupt
    step: int  # the step loaded instead
    created_at: datetime | None

    @property
    def from_step(self) -> int:
        return self.skipped[0].step

    @property
    def steps(self) -> int:
        """How many training steps older the loaded step is than the one asked for."""
        return self.from_step - self.step

    @property
    def age(self) -> timedelta | None:
        """How much older the loaded step was published than the newest skipped one."""
        newest = self.skipped[0].created_at
        if newest is None or self.created_at is None:
            return None
        return newest - self.created_at

    def __str__(self) -> str:
        age = f", {self.age} older" if self.age is not None else ""
        return (f"{self.ref} fell back {self.steps} steps{age}: step {self.from_step} -> {self.step}, "
                f"past {len(self.skipped)} corrupt step(s)")


# ---------------------------------------------------------------------- the policy channel's consumers


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when is not None else None


@dataclass(frozen=True, kw_only=True)
class ConsumerInfo:
    """One registered consumer of a run's policy versions (``Registry.subscribe``), as the catalog has it."""

    run: str
    name: str
    host: str
    pid: int | None
    ttl: float
    registered_at: datetime
    heartbeat_at: datetime
    expires_at: datetime
    ended_at: datetime | None
    live: bool                          # not ended and not expired when this was read
    applied_version: int | None         # the version it serves now (None: none yet)
    applied_step: int | None            # its step; None also when that version is a marker
    applied_at: datetime | None
    lag: int | None = None              # newest verified version - applied_version; None: nothing applied

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "name": self.name, "host": self.host, "pid": self.pid, "ttl": self.ttl,
                "registered_at": _iso(self.registered_at), "heartbeat_at": _iso(self.heartbeat_at),
                "expires_at": _iso(self.expires_at), "ended_at": _iso(self.ended_at), "live": self.live,
                "applied_version": self.applied_version, "applied_step": self.applied_step,
                "applied_at": _iso(self.applied_at), "lag": self.lag}


@dataclass(frozen=True, kw_only=True)
class LoadInfo:
    """One lease of one policy version by one consumer: where its bytes came from and when each phase ended."""

    id: int
    run: str
    consumer: str
    host: str
    version: int
    step: int | None            # None: a marker's version (bytes moved outside the registry; never fetched)
    source: str | None          # the copy it was read from; ``host-cache`` when this host already had it
    bytes_fetched: int          # 0 when the host cache already had the version
    verified: bool              # False for a marker: verifying bytes the registry never had is the engine's
    error: str | None
    committed_at: datetime | None   # when the step became verified in the catalog (a marker: was recorded)
    notified_at: datetime | None    # when the consumer's process saw it
    leased_at: datetime
    fetched_at: datetime | None
    verified_at: datetime | None
    applied_at: datetime | None
    released_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "run": self.run, "consumer": self.consumer, "host": self.host,
                "version": self.version, "step": self.step, "source": self.source,
                "bytes_fetched": self.bytes_fetched, "verified": self.verified, "error": self.error,
                "committed_at": _iso(self.committed_at), "notified_at": _iso(self.notified_at),
                "leased_at": _iso(self.leased_at), "fetched_at": _iso(self.fetched_at),
                "verified_at": _iso(self.verified_at), "applied_at": _iso(self.applied_at),
                "released_at": _iso(self.released_at)}


@dataclass(frozen=True, kw_only=True)
class PolicyLag:
    """How far a run's live consumers lag behind its newest verified policy version (``Registry.policy_lag``).

    ``lag`` is ``newest_version - oldest_applied`` over the live consumers that serve a version (0 when there
    is nothing to compare). A live consumer that serves nothing yet is listed in ``pending``: it counts as
    unbounded lag once a version exists, so :meth:`within` (and ``wait_lag``) wait for it to apply one.
    Expired and ended consumers are listed in ``consumers`` but count for nothing.
    """

    run: str
    newest_version: int | None      # the newest verified policy step's version, or a newer marker's
    newest_step: int | None         # that step (None for a marker or when there is none)
    oldest_applied: int | None      # the oldest version a live consumer serves
    lag: int
    pending: tuple[str, ...]        # live consumers that have applied nothing yet
    consumers: tuple[ConsumerInfo, ...]
    taken_at: datetime

    def within(self, max_lag: int) -> bool:
        """True when no live consumer lags more than ``max_lag`` versions (one serving nothing yet does,
        once a version exists)."""
        if self.newest_version is not None and self.pending:
            return False
        return self.lag <= max_lag

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "newest_version": self.newest_version, "newest_step": self.newest_step,
                "oldest_applied": self.oldest_applied, "lag": self.lag, "pending": list(self.pending),
                "consumers": [c.to_json() for c in self.consumers], "taken_at": _iso(self.taken_at)}


@dataclass(frozen=True, kw_only=True)
class PolicyVersionInfo:
    """One policy version of a run (``registry policy ls``): its step, how it is stored, and its status.

    ``kind``: ``full`` (the step's own weights), ``delta`` (against ``base_step``) or ``marker`` (bytes moved
    outside the registry; no step). A step published with a policy version before the policy channel existed
    is a ``full``.
    """

    run: str
    version: int
    step: int | None
    kind: str
    base_step: int | None
    total_bytes: int
    status: str                     # the step's status; ``marker`` for a marker
    created_at: datetime | None
    anchored: bool = False          # a delta step stored whole beside it too: it reads without its chain

    @property
    def storage(self) -> str:
        """``kind``, and for a delta step with an anchor, so."""
        return f"{self.kind} (anchored)" if self.anchored else self.kind

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "version": self.version, "step": self.step, "kind": self.kind,
                "base_step": self.base_step, "total_bytes": self.total_bytes, "status": self.status,
                "created_at": _iso(self.created_at), "anchored": self.anchored}
