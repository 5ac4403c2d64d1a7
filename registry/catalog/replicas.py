"""Replicas in the catalog: each copy of a step on a storage tier, and the durable tier's replication queue.

A step (its ``checkpoints`` row) may have copies in several places, one
``checkpoint_replicas`` row each: ``fast:<tier id>`` for the step's
directory under a fast root, ``cache:<tier id>`` for that host's cached
download of the durable copy (``<fast>/.registry/cache/``), and ``durable``
for the durable root. Each copy has its own status and the digest of the
manifest it holds; a copy whose digest is not the step's is a copy of an
earlier payload of the step and never stands for it. So a host holding an
older payload in its fast directory and the step's new payload in its cache
has two rows, neither overwriting the other.

A cache copy is disposable: a load reads it only while the step has a
verified durable copy, and any host may evict it. It is therefore never a
copy that keeps a step alive: a deletion that needs another good copy to
stay (``ReplicaCatalog.copy_deleted``'s ``require``) counts fast and durable
copies only, and deleting a durable copy whose step is left with cache
copies alone ends the step. Its bytes are still the step's, so a verdict
that spares a step while another copy of its payload stands (verify of a
damaged durable copy, fsck of a missing directory) counts it.

A *part* (``part:<tier id>``, with ``files``) is one host's share of a
sharded step published from ranks on several hosts, each writing to a fast
directory of its own: its ranks' data files and the step's small files,
under ``<fast>/.registry/parts/``. No part is a copy of the step: nothing
reads a step from its parts, and nothing counts one as the copy that keeps
a step; the hosts' parts together are what its durable copy is made from
(``registry.distributed.parts``). A verdict that spares a step while its
bytes stand somewhere (fsck of a directory no host holds) counts them.

The replication queue is a query, so it survives every process: the
``verified`` steps with no durable copy of their payload yet, in step order.
A replicator claims one by writing a ``pending`` durable row naming its
attempt prefix (compare-and-set: a live writer's claim is left alone), and
ends it with one compare-and-set commit that makes it ``verified``.

Knows SQL and nothing of torch or files.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, delete, insert, or_, select, update

from registry.catalog.models import CheckpointRow, Lease, Replica, Run
from registry.catalog.queries import DURABLE, Catalog, record_replica
from registry.catalog.session import Transactions, aware, utcnow
from registry.records import ENDED, Status

PENDING, PUBLISHED, VERIFIED, CORRUPT, DELETED = "pending", "published", "verified", "corrupt", "deleted"

WriterAlive = Callable[[str | None, datetime | None], bool]


FAST, CACHE, PART = "fast:", "cache:", "part:"  # the prefixes of every fast tier's, host cache's and host part's


def fast_location(tier_id: str) -> str:
    """The replica location of the fast tier whose id is ``tier_id``: the steps' directories under its root."""
    return f"{FAST}{tier_id}"


def cache_location(tier_id: str) -> str:
    """The replica location of the cache of the fast tier whose id is ``tier_id``: its downloads of durable
    copies, a location of its own so that a host's cached copy never overwrites the row of its fast copy."""
    return f"{CACHE}{tier_id}"


def part_location(tier_id: str) -> str:
    """The replica location of the parts the fast tier ``tier_id`` holds: on a sharded publish from ranks on
    several hosts, each host's ranks' files (under ``<fast>/.registry/parts/``), never a whole copy of a step."""
    return f"{PART}{tier_id}"


@dataclass(frozen=True, kw_only=True)
class ReplicaInfo:
    """One copy of a step: where (``location``, ``path`` relative to that tier's root), in what state."""

    run: str
    step: int
    location: str
    status: str
    path: str
    manifest_sha256: str | None
    writer: str | None
    created_at: datetime | None
    updated_at: datetime | None
    durable_at: datetime | None
    files: tuple[str, ...] | None = None  # a part's data files; None: a copy of the whole payload


@dataclass(frozen=True, kw_only=True)
class Queued:
    """A step waiting for its durable copy: the step's row (its fast copy) and the durable row if one exists."""

    checkpoint_id: int
    run: str
    step: int
    path: str             # the fast copy, relative to the fast root
    manifest_sha256: str  # the step's payload, which the durable copy must hold
    total_bytes: int
    replica_status: str | None
    replica_writer: str | None
    replica_updated_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class DurableClaim:
    """A replication this writer holds: upload to ``path``; ``stale`` names an earlier prefix to delete."""

    checkpoint_id: int
    run: str
    step: int
    path: str
    manifest_sha256: str
    stale: str | None


def _info(row: Any) -> ReplicaInfo:
    return ReplicaInfo(run=row.run_name, step=row.step, location=row.location, status=row.status, path=row.path,
                       manifest_sha256=row.manifest_sha256, writer=row.writer, created_at=aware(row.created_at),
                       updated_at=aware(row.updated_at), durable_at=aware(row.durable_at),
                       files=None if row.files is None else tuple(json.loads(row.files)))


_COLUMNS = (Replica.c.location, Replica.c.status, Replica.c.path, Replica.c.manifest_sha256, Replica.c.writer,
            Replica.c.created_at, Replica.c.updated_at, Replica.c.durable_at, Replica.c.files, CheckpointRow.c.step,
            Run.c.name.label("run_name"))


class ReplicaCatalog:
    """The replica queries over a catalog's transactions (see the module's docstring)."""

    def __init__(self, catalog: Transactions) -> None:
        self.catalog = catalog

    # ------------------------------------------------------------------ reads

    def replicas(self, run: str, step: int | None = None) -> list[ReplicaInfo]:
        """Every copy of ``run``'s steps (of one ``step``), by step and location."""
        def fn(conn: Connection) -> list[ReplicaInfo]:
            query = (select(*_COLUMNS).join(CheckpointRow, CheckpointRow.c.id == Replica.c.checkpoint_id)
                     .join(Run, Run.c.id == CheckpointRow.c.run_id).where(Run.c.name == run))
            if step is not None:
                query = query.where(CheckpointRow.c.step == step)
            return [_info(r) for r in conn.execute(query.order_by(CheckpointRow.c.step, Replica.c.location))]
        result: list[ReplicaInfo] = self.catalog.read(fn)
        return result

    def copy(self, run: str, step: int, location: str, *, manifest_sha256: str | None) -> ReplicaInfo | None:
        """``location``'s ``verified`` copy of ``run@step`` holding the payload ``manifest_sha256``, or None."""
        def fn(conn: Connection) -> ReplicaInfo | None:
            row = conn.execute(
                select(*_COLUMNS).join(CheckpointRow, CheckpointRow.c.id == Replica.c.checkpoint_id)
                .join(Run, Run.c.id == CheckpointRow.c.run_id)
                .where(Run.c.name == run, CheckpointRow.c.step == step, Replica.c.location == location,
                       Replica.c.status == VERIFIED, Replica.c.manifest_sha256 == manifest_sha256)).first()
            return _info(row) if row is not None else None
        result: ReplicaInfo | None = self.catalog.read(fn)
        return result

    def snapshot(self) -> list[tuple[ReplicaInfo, str, str | None, str]]:
        """Every copy of every step, with its step's status, manifest digest and path: what fsck checks."""
        def fn(conn: Connection) -> list[tuple[ReplicaInfo, str, str | None, str]]:
            query = (select(*_COLUMNS, CheckpointRow.c.status.label("c_status"),
                            CheckpointRow.c.manifest_sha256.label("c_manifest"), CheckpointRow.c.path.label("c_path"))
                     .join(CheckpointRow, CheckpointRow.c.id == Replica.c.checkpoint_id)
                     .join(Run, Run.c.id == CheckpointRow.c.run_id).order_by(Run.c.name, CheckpointRow.c.step))
            return [(_info(r), r.c_status, r.c_manifest, r.c_path) for r in conn.execute(query)]
        result: list[tuple[ReplicaInfo, str, str | None, str]] = self.catalog.read(fn)
        return result

    def forget(self, run: str, step: int, location: str, *, path: str, status: str) -> bool:
        """Forget ``location``'s copy judged bad (compare-and-set on its path and status): the step is queued
        again for that copy."""
        def fn(conn: Connection) -> bool:
            cid = conn.scalar(select(CheckpointRow.c.id).join(Run, Run.c.id == CheckpointRow.c.run_id)
                              .where(Run.c.name == run, CheckpointRow.c.step == step))
            if cid is None:
                return False
            return bool(conn.execute(delete(Replica).where(
                Replica.c.checkpoint_id == cid, Replica.c.location == location, Replica.c.path == path,
                Replica.c.status == status)).rowcount)
        result: bool = self.catalog.write(fn)
        return result

    def copy_deleted(self, run: str, step: int, *, location: str, path: str, manifest_sha256: str | None,
                     require: str | None, actor: str | None, condemned: bool = False) -> str | None:
        """Mark ``location``'s copy of ``run@step`` at ``path`` ``deleted`` (recorded if it had no row); None when
        it was, else why not. Compare-and-set on the step's set of copies, in one transaction: the step still
        holds ``manifest_sha256``, no reader holds a lease on it, this location's copy is still the one at
        ``path`` (still ``corrupt`` when ``condemned``), and ``require`` (a location, or :data:`FAST` for any fast
        tier's, never a host's cache: see the module's docstring) still has a good copy of the same payload. The
        step's row is locked first, so two deletions of its copies at once (two tiers' retention) never both see
        the other's copy as the one that stays."""
        def fn(conn: Connection) -> str | None:
            row = conn.execute(select(CheckpointRow.c.id, CheckpointRow.c.run_id, CheckpointRow.c.manifest_sha256)
                               .join(Run, Run.c.id == CheckpointRow.c.run_id)
                               .where(Run.c.name == run, CheckpointRow.c.step == step)
                               .with_for_update(of=CheckpointRow)).first()
            if row is None or (manifest_sha256 is not None and row.manifest_sha256 != manifest_sha256):
                return "the step changed since the plan"
            leased = conn.scalar(select(Lease.c.id)
                                 .where(Lease.c.checkpoint_id == row.id, Lease.c.expires_at > utcnow()).limit(1))
            if leased is not None:
                return "leased by a reader"
            held = conn.execute(select(Replica.c.path, Replica.c.status).where(Replica.c.checkpoint_id == row.id,
                                                                               Replica.c.location == location)).first()
            if held is not None and held.path != path:  # a copy made since the plan (a re-replication) stays
                return f"its {location} copy changed since the plan"
            if condemned and (held is None or held.status != CORRUPT):
                return f"its {location} copy is no longer marked corrupt"
            if require is not None:
                # a fast tier's copy may be only published (verify=False); the durable one is verified or nothing
                other = (Replica.c.location.startswith(require), Replica.c.status.in_((VERIFIED, PUBLISHED))) \
                    if require.endswith(":") else (Replica.c.location == require, Replica.c.status == VERIFIED)
                if conn.scalar(select(Replica.c.checkpoint_id).where(
                        Replica.c.checkpoint_id == row.id, *other,
                        Replica.c.manifest_sha256 == row.manifest_sha256).limit(1)) is None:
                    return f"no other good copy of it ({require.rstrip(':')}) is recorded any more"
            record_replica(conn, row.id, location=location, status=DELETED, path=path,
                           manifest_sha256=row.manifest_sha256, writer=actor)
            Catalog.record_event(conn, row.run_id, step, "replica-deleted", actor=actor, location=location,
                                 path=path)
            return None
        result: str | None = self.catalog.write(fn)
        return result

    def has_durable(self) -> bool:
        """Whether any step has a durable copy recorded: the catalog's bound root is then a durable tier."""
        def fn(conn: Connection) -> bool:
            query = select(Replica.c.checkpoint_id).where(Replica.c.location == DURABLE).limit(1)
            return conn.scalar(query) is not None
        result: bool = self.catalog.read(fn)
        return result

    def queue(self, *, run: str | None = None, limit: int = 1000) -> list[Queued]:
        """The steps whose payload has no durable copy yet (or only a claimed one), oldest step first.

        A ``corrupt`` or ``deleted`` durable copy of the same payload is not
        queued again by itself: fsck's repair, or a new publish, does that.
        """
        def fn(conn: Connection) -> list[Queued]:
            c, r = CheckpointRow.c, Replica.c
            joined = and_(r.checkpoint_id == c.id, r.location == DURABLE)
            query = (select(c.id, c.step, c.path, c.manifest_sha256, c.total_bytes, Run.c.name.label("run_name"),
                            r.status.label("r_status"), r.writer.label("r_writer"),
                            r.updated_at.label("r_updated_at"))
                     .join(Run, Run.c.id == c.run_id).outerjoin(Replica, joined)
                     .where(c.status == Status.VERIFIED, c.manifest_sha256.is_not(None),
                            or_(r.checkpoint_id.is_(None), r.status == PENDING,
                                r.manifest_sha256.is_(None), r.manifest_sha256 != c.manifest_sha256)))
            if run is not None:
                query = query.where(Run.c.name == run)
            rows = conn.execute(query.order_by(Run.c.name, c.step).limit(limit)).all()
            return [Queued(checkpoint_id=x.id, run=x.run_name, step=x.step, path=x.path,
                           manifest_sha256=x.manifest_sha256, total_bytes=x.total_bytes, replica_status=x.r_status,
                           replica_writer=x.r_writer, replica_updated_at=aware(x.r_updated_at)) for x in rows]
        result: list[Queued] = self.catalog.read(fn)
        return result

    # ------------------------------------------------------------------ replication

    def claim_durable(self, item: Queued, *, path: str, writer: str,
                      writer_alive: WriterAlive) -> DurableClaim | None:
        """Hold ``item``'s replication to ``path`` (a fresh attempt prefix); None when it is not ours to do.

        Not ours: the step is no longer ``verified`` with that payload, its
        durable copy of that payload exists, or a live writer holds it. The
        earlier prefix of a dead claim, or of a copy of an earlier payload,
        comes back as ``stale`` (the caller deletes it once its own copy committed).
        """
        def fn(conn: Connection) -> DurableClaim | None:
            c = conn.execute(select(CheckpointRow.c.status, CheckpointRow.c.manifest_sha256)
                             .where(CheckpointRow.c.id == item.checkpoint_id)).first()
            if c is None or c.status != Status.VERIFIED or c.manifest_sha256 != item.manifest_sha256:
                return None
            now = utcnow()
            row = conn.execute(select(Replica.c.status, Replica.c.path, Replica.c.writer, Replica.c.updated_at,
                                      Replica.c.manifest_sha256)
                               .where(Replica.c.checkpoint_id == item.checkpoint_id, Replica.c.location == DURABLE)
                               ).first()
            if row is None:
                conn.execute(insert(Replica).values(checkpoint_id=item.checkpoint_id, location=DURABLE,
                                                    status=PENDING, path=path, manifest_sha256=item.manifest_sha256,
                                                    writer=writer, created_at=now, updated_at=now))
                return DurableClaim(checkpoint_id=item.checkpoint_id, run=item.run, step=item.step, path=path,
                                    manifest_sha256=item.manifest_sha256, stale=None)
            if row.status != PENDING and row.manifest_sha256 == item.manifest_sha256:
                return None  # done (verified), or judged (corrupt, deleted): not the queue's to redo
            if (row.status == PENDING and row.writer != writer
                    and writer_alive(row.writer, aware(row.updated_at))):
                return None
            changed = conn.execute(update(Replica).where(
                Replica.c.checkpoint_id == item.checkpoint_id, Replica.c.location == DURABLE,
                Replica.c.status == row.status, Replica.c.path == row.path).values(
                status=PENDING, path=path, manifest_sha256=item.manifest_sha256, writer=writer, updated_at=now,
                durable_at=None)).rowcount
            if not changed:
                return None
            return DurableClaim(checkpoint_id=item.checkpoint_id, run=item.run, step=item.step, path=path,
                                manifest_sha256=item.manifest_sha256,
                                stale=row.path if row.path != path else None)
        result: DurableClaim | None = self.catalog.write(fn)
        return result

    def finish_durable(self, claim: DurableClaim, *, writer: str) -> bool:
        """The upload under ``claim.path`` checked out: the durable copy is ``verified`` (compare-and-set); False
        when the claim is no longer this writer's or the step has ended since (the caller deletes its upload)."""
        def fn(conn: Connection) -> bool:
            now = utcnow()
            # locked as retention's marking locks it: a step deleted meanwhile (its claim marked deleted with it)
            # is seen here, and a step deleted after this commit takes the new copy with it
            step = conn.execute(select(CheckpointRow.c.status).where(CheckpointRow.c.id == claim.checkpoint_id)
                                .with_for_update(read=True)).first()
            if step is None or step.status in ENDED:
                return False
            changed = conn.execute(update(Replica).where(
                Replica.c.checkpoint_id == claim.checkpoint_id, Replica.c.location == DURABLE,
                Replica.c.status == PENDING, Replica.c.path == claim.path, Replica.c.writer == writer).values(
                status=VERIFIED, manifest_sha256=claim.manifest_sha256, updated_at=now, durable_at=now)).rowcount
            if changed:
                run_id: int = conn.execute(select(CheckpointRow.c.run_id)
                                           .where(CheckpointRow.c.id == claim.checkpoint_id)).scalar_one()
                Catalog.record_event(conn, run_id, claim.step, "replicate", actor=writer, location=DURABLE,
                                     path=claim.path, manifest_sha256=claim.manifest_sha256)
                Catalog.notify(conn, run_id, claim.step, "durable")  # wakes follow(..., durable=True)
            return bool(changed)
        result: bool = self.catalog.write(fn)
        return result

    def touch_durable(self, claim: DurableClaim, *, writer: str) -> None:
        """Refresh ``claim``'s row while its upload runs: other hosts see that its writer is still at work."""
        def fn(conn: Connection) -> None:
            conn.execute(update(Replica).where(
                Replica.c.checkpoint_id == claim.checkpoint_id, Replica.c.location == DURABLE,
                Replica.c.status == PENDING, Replica.c.path == claim.path, Replica.c.writer == writer).values(
                updated_at=utcnow()))
        self.catalog.write(fn, durable=False)

    def drop_claim(self, claim: DurableClaim, *, writer: str) -> bool:
        """Give up ``claim`` (its upload was removed): the step is queued again as if never claimed."""
        def fn(conn: Connection) -> bool:
            return bool(conn.execute(delete(Replica).where(
                Replica.c.checkpoint_id == claim.checkpoint_id, Replica.c.location == DURABLE,
                Replica.c.status == PENDING, Replica.c.path == claim.path, Replica.c.writer == writer)).rowcount)
        result: bool = self.catalog.write(fn)
        return result

    def set_replica_status(self, run: str, step: int, location: str, status: str, *, path: str,
                           manifest_sha256: str | None, only_from: Sequence[str], actor: str | None = None,
                           reason: str | None = None) -> bool:
        """Move one copy to ``status``, compare-and-set on its path and digest; records an event."""
        def fn(conn: Connection) -> bool:
            cid = conn.scalar(select(CheckpointRow.c.id).join(Run, Run.c.id == CheckpointRow.c.run_id)
                              .where(Run.c.name == run, CheckpointRow.c.step == step))
            if cid is None:
                return False
            cond = [Replica.c.checkpoint_id == cid, Replica.c.location == location, Replica.c.path == path,
                    Replica.c.status.in_(only_from)]
            cond.append(Replica.c.manifest_sha256 == manifest_sha256 if manifest_sha256 is not None
                        else Replica.c.manifest_sha256.is_(None))
            changed = conn.execute(update(Replica).where(*cond).values(status=status, updated_at=utcnow())).rowcount
            if changed:
                run_id = conn.scalar(select(CheckpointRow.c.run_id).where(CheckpointRow.c.id == cid))
                detail: dict[str, Any] = {"location": location, "status": status, "path": path}
                if reason is not None:
                    detail["reason"] = reason
                Catalog.record_event(conn, run_id, step, f"replica-{status}", actor=actor, **detail)
            return bool(changed)
        result: bool = self.catalog.write(fn)
        return result

    def record(self, run: str, step: int, *, location: str, status: str, path: str, manifest_sha256: str,
               writer: str | None, event: str) -> bool:
        """Record ``location``'s copy of ``run@step`` and an event of kind ``event``, only while the step still
        holds that payload (a cache copy of a step overwritten meanwhile is not recorded)."""
        def fn(conn: Connection) -> bool:
            row = conn.execute(select(CheckpointRow.c.id, CheckpointRow.c.run_id, CheckpointRow.c.manifest_sha256)
                               .join(Run, Run.c.id == CheckpointRow.c.run_id)
                               .where(Run.c.name == run, CheckpointRow.c.step == step)).first()
            if row is None or row.manifest_sha256 != manifest_sha256:
                return False
            record_replica(conn, row.id, location=location, status=status, path=path,
                           manifest_sha256=manifest_sha256, writer=writer)
            Catalog.record_event(conn, row.run_id, step, event, actor=writer, location=location, path=path)
            return True
        result: bool = self.catalog.write(fn)
        return result


__all__ = ["CACHE", "DURABLE", "FAST", "PART", "DurableClaim", "Queued", "ReplicaCatalog", "ReplicaInfo",
           "cache_location", "fast_location", "part_location", "record_replica"]
