"""The catalog side of retention: a snapshot of a run, and marking steps ``deleted``.

Knows SQL and nothing of files or torch. Deciding *what* to delete is the
caller's business (``registry/retention.py``); this module only guarantees that
the decision is taken against the catalog as it is at the moment of marking:
:meth:`RetentionCatalog.mark_deleted` re-reads everything that can protect a
step (statuses, ``@latest``, ``@latest-published``, tags, unexpired reader
leases, metrics) *inside* the write transaction that marks, and asks the
caller's ``decide`` function again there. That re-read includes the forks
that name a step as their parent (``RunSnapshot.forks``), so a fork committed
before the marking is seen by it, and the policy versions live consumers
lease or serve (``RunSnapshot.policy_holds``, see ``registry.catalog.consumers``);
the policy folds that start or end at a marked step are marked ``deleted`` with it (``DeletedRow.folds``).
The same transaction marks every copy of
a marked step (its ``checkpoint_replicas`` rows) ``deleted``: a deleted step
has no copy a reader or a replication could still stand on, and a
replication committing at that moment finds its claim gone.

Why that is enough against a reader in another process: on SQLite every
write transaction (``acquire_lease`` included) starts with ``BEGIN
IMMEDIATE``, so lease-taking and marking are serialised. On PostgreSQL the
marking transaction first locks the run's rows ``FOR UPDATE``; ``acquire_lease``
and ``tag`` read the row ``FOR SHARE``, so either their lease or tag commits
first and we see it, or we commit first and they find the row no longer
live (``acquire_lease`` returns ``None`` and the reader resolves again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, func, select, update

from registry.catalog.consumers import newest_policy_step, policy_holds
from registry.catalog.lineage import fork_children
from registry.catalog.models import CheckpointRow, Lease, Replica
from registry.catalog.policy import delta_bases, end_folds
from registry.catalog.queries import Catalog
from registry.catalog.session import aware, utcnow
from registry.records import HAS_PAYLOAD, LIVE, CheckpointInfo, Status

#: statuses retention may delete; everything else is never touched
CANDIDATES = HAS_PAYLOAD
#: statuses a plan shows (``staging`` rows are always kept)
SHOWN = (Status.STAGING,) + CANDIDATES


@dataclass(frozen=True, kw_only=True)
class RunSnapshot:
    """A run as one transaction saw it. Paths are relative to the checkpoint root."""

    run: str
    checkpoints: tuple[CheckpointInfo, ...]   # staging/published/verified/corrupt rows, ascending step
    latest: int | None                        # newest verified step
    latest_published: int | None              # newest published-or-verified step
    leases: Mapping[int, datetime]            # step -> furthest expiry of its unexpired leases
    taken_at: datetime
    forks: Mapping[int, tuple[str, ...]] = field(default_factory=dict)  # step -> forks with a payload naming it
    # step -> why live policy consumers keep it ("leased by rollout-3", "served by rollout-1")
    policy_holds: Mapping[int, str] = field(default_factory=dict)
    latest_policy: int | None = None          # the verified step with the newest policy version (@latest-policy)
    # delta step -> the step its delta is made against: a kept delta step keeps its chain (registry.catalog.policy)
    delta_bases: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class GoneCopy:
    """A copy of a step the marking took with it: where, and its status just before."""

    location: str
    path: str
    status: str
    manifest_sha256: str | None


@dataclass(frozen=True, kw_only=True)
class DeletedRow:
    step: int
    path: str          # relative to the checkpoint root
    total_bytes: int
    manifest_sha256: str | None = None
    reason: str = ""
    copies: tuple[GoneCopy, ...] = ()
    folds: tuple[str, ...] = ()  # paths of the policy folds from or to this step, marked deleted with it


class RetentionCatalog:
    """Retention's SQL, on top of a :class:`Catalog` (its engine and transaction helpers)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def _snapshot(self, conn: Connection, run_id: int, run: str) -> RunSnapshot:
        c = CheckpointRow.c
        rows = conn.execute(select(CheckpointRow).where(c.run_id == run_id, c.status.in_(SHOWN))
                            .order_by(c.step)).all()
        infos = tuple(self.catalog.checkpoint_infos(conn, run, rows))
        verified = [i.step for i in infos if i.status == Status.VERIFIED]
        live = [i.step for i in infos if i.status in LIVE]
        now = utcnow()
        leases = {int(step): when for step, expires in conn.execute(
            select(c.step, func.max(Lease.c.expires_at)).join(Lease, Lease.c.checkpoint_id == c.id)
            .where(c.run_id == run_id, Lease.c.expires_at > now).group_by(c.step))
            if (when := aware(expires)) is not None}
        return RunSnapshot(run=run, checkpoints=infos, latest=max(verified, default=None),
                           latest_published=max(live, default=None), leases=leases, taken_at=now,
                           forks=fork_children(conn, run), policy_holds=policy_holds(conn, run_id, now),
                           latest_policy=newest_policy_step(conn, run_id), delta_bases=delta_bases(conn, run_id))

    def snapshot(self, run: str) -> RunSnapshot:
        """The run now, for planning; raises ``CheckpointNotFoundError`` for an unknown run."""
        def fn(conn: Connection) -> RunSnapshot:
            return self._snapshot(conn, self.catalog.require_run(conn, run), run)
        result: RunSnapshot = self.catalog.read(fn)
        return result

    def mark_deleted(self, run: str, decide: Callable[[RunSnapshot], Mapping[int, str]], *,
                     actor: str | None) -> list[DeletedRow]:
        """One write transaction: snapshot, ``decide(snapshot) -> {step: reason}``, mark those ``deleted``.

        ``decide`` may run more than once (the transaction is retried on lock
        timeouts), so it must not accumulate state across calls. Only rows
        still in :data:`CANDIDATES` are marked, whatever ``decide`` returns.
        Each mark records a ``delete`` event; metrics and the row stay as history.
        """
        def fn(conn: Connection) -> list[DeletedRow]:
            run_id = self.catalog.require_run(conn, run)
            c = CheckpointRow.c
            if conn.dialect.name == "postgresql":
                conn.execute(select(c.id).where(c.run_id == run_id).order_by(c.id).with_for_update())
            snap = self._snapshot(conn, run_id, run)
            doomed = decide(snap)
            by_step = {i.step: i for i in snap.checkpoints}
            now = utcnow()
            marked: list[DeletedRow] = []
            for step in sorted(doomed):
                info = by_step.get(step)
                if info is None or info.status not in CANDIDATES:
                    continue
                changed = conn.execute(update(CheckpointRow).where(c.run_id == run_id, c.step == step,
                                                       c.status.in_(CANDIDATES))
                                       .values(status=Status.DELETED, deleted_at=now, updated_at=now)).rowcount
                if not changed:
                    continue
                copies = _end_copies(conn, run_id, step, now)
                self.catalog.record_event(conn, run_id, step, "delete", actor=actor, status=Status.DELETED,
                                    previous_status=info.status, total_bytes=info.total_bytes,
                                    reason=doomed[step])
                self.catalog.notify(conn, run_id, step, Status.DELETED)
                marked.append(DeletedRow(step=step, path=info.path.as_posix(), total_bytes=info.total_bytes,
                                         manifest_sha256=info.manifest_sha256, reason=doomed[step],
                                         copies=copies))
            ended = end_folds(conn, run_id, [m.step for m in marked])
            return [replace(m, folds=tuple(f.path for f in ended if m.step in (f.from_step, f.to_step)))
                    for m in marked]
        result: list[DeletedRow] = self.catalog.write(fn)
        return result

    def deleted_rows(self, run: str) -> list[DeletedRow]:
        """Every ``deleted`` row of ``run``: whose directories a finished deletion has removed."""
        def fn(conn: Connection) -> list[DeletedRow]:
            run_id = self.catalog.require_run(conn, run)
            c = CheckpointRow.c
            rows: Any = conn.execute(select(c.step, c.path, c.total_bytes, c.manifest_sha256)
                                     .where(c.run_id == run_id, c.status == Status.DELETED).order_by(c.step)).all()
            return [DeletedRow(step=r.step, path=r.path, total_bytes=r.total_bytes,
                               manifest_sha256=r.manifest_sha256) for r in rows]
        result: list[DeletedRow] = self.catalog.read(fn)
        return result


def _end_copies(conn: Connection, run_id: int, step: int, now: datetime) -> tuple[GoneCopy, ...]:
    """Mark every copy of ``run_id``'s ``step`` that is not ``deleted`` yet ``deleted``; the copies as they were."""
    cid = select(CheckpointRow.c.id).where(CheckpointRow.c.run_id == run_id, CheckpointRow.c.step == step)
    r = Replica.c
    live = (r.checkpoint_id == cid.scalar_subquery(), r.status != "deleted")
    copies = tuple(GoneCopy(location=x.location, path=x.path, status=x.status, manifest_sha256=x.manifest_sha256)
                   for x in conn.execute(select(r.location, r.path, r.status, r.manifest_sha256).where(*live)
                                         .order_by(r.location)))
    if copies:
        conn.execute(update(Replica).where(*live).values(status="deleted", updated_at=now))
    return copies


__all__ = ["CANDIDATES", "DeletedRow", "GoneCopy", "RetentionCatalog", "RunSnapshot"]
