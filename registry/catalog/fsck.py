"""The catalog half of ``fsck``: a snapshot of every row, and compare-and-set repairs.

Every repair is conditional on the row still being in the state fsck saw
(status, writer, last update and manifest digest), so a writer that takes a
step over between the scan and the repair is never clobbered: the repair
simply does nothing and says so. A verdict about a payload is therefore tied
to the manifest digest the files were checked against.
Knows SQL and nothing of files or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from registry.catalog.lineage import record_lineage
from registry.catalog.policy import record_policy_step
from registry.catalog.models import Attempt, CheckpointFile, CheckpointRow, Replica, Run
from registry.catalog.queries import Catalog, record_replica, replace_files
from registry.catalog.records import PayloadRecord
from registry.catalog.session import aware, utcnow
from registry.records import ENDED, Status


@dataclass(frozen=True, kw_only=True)
class RowState:
    """One checkpoint row as fsck saw it."""

    run: str
    step: int
    status: str
    path: str
    writer: str | None
    manifest_sha256: str | None
    files: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (size, sha256)
    updated_at: datetime | None = None  # a live writer on another host keeps refreshing it


def snapshot(catalog: Catalog, *, run: str | None = None, step: int | None = None) -> list[RowState]:
    """Every checkpoint row of every run (or the one row of ``run@step``), with its file table."""
    def fn(conn: Connection) -> list[RowState]:
        c = CheckpointRow.c
        query = (select(c.id, c.step, c.status, c.path, c.writer, c.manifest_sha256, c.updated_at, Run.c.name)
                 .join(Run, Run.c.id == c.run_id).order_by(Run.c.name, c.step))
        files_query = select(CheckpointFile.c.checkpoint_id, CheckpointFile.c.name, CheckpointFile.c.size,
                             CheckpointFile.c.sha256)
        if run is not None and step is not None:
            query = query.where(Run.c.name == run, c.step == step)
            files_query = files_query.join(CheckpointRow, c.id == CheckpointFile.c.checkpoint_id).join(
                Run, Run.c.id == c.run_id).where(Run.c.name == run, c.step == step)
        rows = conn.execute(query).all()
        files: dict[int, dict[str, tuple[int, str]]] = {}
        for cid, name, size, sha in conn.execute(files_query):
            files.setdefault(cid, {})[name] = (size, sha)
        return [RowState(run=r.name, step=r.step, status=r.status, path=r.path, writer=r.writer,
                         manifest_sha256=r.manifest_sha256, files=files.get(r.id, {}),
                         updated_at=aware(r.updated_at)) for r in rows]
    return catalog.read(fn)


def _row(conn: Connection, run: str, step: int, *, lock: bool = True) -> Any:
    """The row, locked: on PostgreSQL a writer's in-flight transaction is waited for, then seen."""
    query = (select(CheckpointRow.c.id, CheckpointRow.c.run_id, CheckpointRow.c.status, CheckpointRow.c.writer,
                    CheckpointRow.c.updated_at, CheckpointRow.c.manifest_sha256)
             .join(Run, Run.c.id == CheckpointRow.c.run_id).where(Run.c.name == run, CheckpointRow.c.step == step))
    if lock and conn.dialect.name == "postgresql":
        query = query.with_for_update(of=CheckpointRow)
    return conn.execute(query).first()


def _unchanged(row: Any, seen: RowState | None) -> bool:
    if seen is None:
        return row is None
    return (row is not None and row.status == seen.status and row.writer == seen.writer
            and row.manifest_sha256 == seen.manifest_sha256
            and aware(row.updated_at) == seen.updated_at)  # refreshed since: its writer is alive


def unchanged(catalog: Catalog, seen: RowState) -> bool:
    """Whether the row is still as ``seen``: read now, so after whatever fsck checked on disk since."""
    return bool(catalog.read(lambda conn: _unchanged(_row(conn, seen.run, seen.step, lock=False), seen)))


def record_payload(catalog: Catalog, seen: RowState | None, *, run: str, step: int, path: str,
                   payload: PayloadRecord, kind: str, actor: str, copy_at: str | None = None, **detail: Any) -> bool:
    """Roll a row forward (or adopt a directory with no row) to a payload found on disk.

    ``copy_at``: the replica location the payload was found at (a tiered root's fast tier), recorded as that
    location's copy in the same transaction, as a publish's commit records it. Returns False, changing nothing,
    when the row is no longer as ``seen``.
    """
    def fn(conn: Connection) -> bool:
        now = utcnow()
        row = _row(conn, run, step)
        if not _unchanged(row, seen):
            return False
        values = {**payload.columns(now), "path": path}
        if row is None:
            run_id = Catalog.lookup_run(conn, run, create=True)
            try:
                with conn.begin_nested():
                    cid = conn.execute(insert(CheckpointRow).values(
                        run_id=run_id, step=step, writer=None, created_at=now,
                        **values).returning(CheckpointRow.c.id)).scalar_one()
            except IntegrityError:
                return False  # a writer claimed the step meanwhile
        else:
            run_id, cid = row.run_id, row.id
            conn.execute(update(CheckpointRow).where(CheckpointRow.c.id == cid).values(**values))
        replace_files(conn, cid, payload.files)
        if copy_at is not None:
            record_replica(conn, cid, location=copy_at, status=payload.status, path=path,
                           manifest_sha256=payload.manifest_sha256, writer=None)
        assert run_id is not None, "lookup_run(create=True) returns an id"
        record_policy_step(conn, checkpoint_id=cid, run_id=run_id, record=payload.policy)
        _record_lineage(conn, run_id, cid, row.writer if row is not None else None)
        Catalog.record_event(conn, run_id, step, "repair", actor=actor, problem=kind, status=payload.status, **detail)
        return True
    return bool(catalog.write(fn))


def _record_lineage(conn: Connection, run_id: int, checkpoint_id: int, writer: str | None) -> None:
    """The lineage of a rolled-forward step: its dead writer's latest attempt at the run says where it
    came from, as its commit would have; an adopted directory's origin is ``unknown``."""
    attempt = None
    if writer is not None:
        attempt = conn.scalar(select(Attempt.c.id).where(Attempt.c.run_id == run_id, Attempt.c.writer == writer)
                              .order_by(Attempt.c.id.desc()).limit(1))
        if attempt is not None:
            conn.execute(update(CheckpointRow).where(CheckpointRow.c.id == checkpoint_id).values(attempt_id=attempt))
    record_lineage(conn, checkpoint_id=checkpoint_id, run_id=run_id, attempt_id=attempt, resumed_from=None,
                   explicit=None)


def set_status_if(catalog: Catalog, seen: RowState, status: str, *, kind: str, actor: str,
                  **detail: Any) -> bool:
    """Move a row to ``status`` if it is still as ``seen``; records a ``repair`` event."""
    def fn(conn: Connection) -> bool:
        row = _row(conn, seen.run, seen.step)
        if not _unchanged(row, seen):
            return False
        now = utcnow()
        values: dict[str, Any] = {"status": status, "updated_at": now}
        if status == Status.DELETED:
            values["deleted_at"] = now
        conn.execute(update(CheckpointRow).where(CheckpointRow.c.id == row.id).values(**values))
        Catalog.record_event(conn, row.run_id, seen.step, "repair", actor=actor, problem=kind, status=status, **detail)
        return True
    return bool(catalog.write(fn))


# ---------------------------------------------------------------------------- one location's copies
#
# A tier's copies are judged by the same rules as steps (registry.ops.fsck): each copy row of one location is
# a RowState, its ``pending`` claim seen as a ``staging`` row, and every repair is compare-and-set on the copy
# row as seen (status, writer, last update, digest, path), with the step's row locked as retention locks it.

_COPY_STATUS: dict[str, str] = {"pending": Status.STAGING}
_ROW_STATUS: dict[str, str] = {Status.STAGING: "pending"}


def _copy_query(location: str) -> Any:
    r = Replica.c
    return (select(r.checkpoint_id, r.status, r.path, r.writer, r.manifest_sha256, r.updated_at,
                   CheckpointRow.c.step, Run.c.name)
            .join(CheckpointRow, CheckpointRow.c.id == r.checkpoint_id).join(Run, Run.c.id == CheckpointRow.c.run_id)
            .where(r.location == location))


def _copy_state(row: Any) -> RowState:
    return RowState(run=row.name, step=row.step, status=_COPY_STATUS.get(row.status, row.status), path=row.path,
                    writer=row.writer, manifest_sha256=row.manifest_sha256, updated_at=aware(row.updated_at))


def copy_snapshot(catalog: Catalog, location: str, *, run: str | None = None,
                  step: int | None = None) -> list[RowState]:
    """Every copy row at ``location`` (of ``run@step`` only, when given), as fsck's judge reads rows."""
    def fn(conn: Connection) -> list[RowState]:
        query = _copy_query(location)
        if run is not None and step is not None:
            query = query.where(Run.c.name == run, CheckpointRow.c.step == step)
        return [_copy_state(r) for r in conn.execute(query.order_by(Run.c.name, CheckpointRow.c.step))]
    result: list[RowState] = catalog.read(fn)
    return result


def _locked_step(conn: Connection, run: str, step: int) -> Any:
    query = (select(CheckpointRow.c.id, CheckpointRow.c.run_id, CheckpointRow.c.status, CheckpointRow.c.manifest_sha256)
             .join(Run, Run.c.id == CheckpointRow.c.run_id).where(Run.c.name == run, CheckpointRow.c.step == step))
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(of=CheckpointRow)
    return conn.execute(query).first()


def _copy_unchanged(conn: Connection, location: str, seen: RowState | None, run: str, step: int) -> bool:
    now = conn.execute(_copy_query(location).where(Run.c.name == run, CheckpointRow.c.step == step)).first()
    if seen is None or now is None:
        return seen is None and now is None
    return (_COPY_STATUS.get(now.status, now.status) == seen.status and now.writer == seen.writer
            and now.manifest_sha256 == seen.manifest_sha256 and now.path == seen.path
            and aware(now.updated_at) == seen.updated_at)


def copy_unchanged(catalog: Catalog, location: str, seen: RowState) -> bool:
    """Whether ``location``'s copy row of the step is still as ``seen``, read now."""
    return bool(catalog.read(lambda conn: _copy_unchanged(conn, location, seen, seen.run, seen.step)))


def set_copy_status_if(catalog: Catalog, location: str, seen: RowState, status: str, *, kind: str, actor: str,
                       **detail: Any) -> bool:
    """Move ``location``'s copy row to ``status`` if it is still as ``seen``; ``failed`` forgets the row (the
    step is queued again for that copy). Records a ``repair`` event."""
    def fn(conn: Connection) -> bool:
        step = _locked_step(conn, seen.run, seen.step)
        if step is None or not _copy_unchanged(conn, location, seen, seen.run, seen.step):
            return False
        where = (Replica.c.checkpoint_id == step.id, Replica.c.location == location)
        if status == Status.FAILED:
            conn.execute(delete(Replica).where(*where))
        else:
            conn.execute(update(Replica).where(*where).values(status=_ROW_STATUS.get(status, status),
                                                              updated_at=utcnow()))
        Catalog.record_event(conn, step.run_id, seen.step, "repair", actor=actor, problem=kind, location=location,
                             status=status, **detail)
        return True
    return bool(catalog.write(fn))


def record_copy(catalog: Catalog, location: str, seen: RowState | None, *, run: str, step: int, path: str,
                manifest_sha256: str, kind: str, actor: str) -> bool:
    """Record a whole copy found at ``path`` as ``location``'s verified copy of ``run@step``: a claim's upload
    that finished before its writer died (rolled forward), or a copy with no row (adopted). Only while the
    step is live and holds that payload, and the copy row is still as ``seen``."""
    def fn(conn: Connection) -> bool:
        row = _locked_step(conn, run, step)
        if (row is None or row.status in ENDED or row.status == Status.STAGING or row.manifest_sha256 != manifest_sha256
                or not _copy_unchanged(conn, location, seen, run, step)):
            return False
        record_replica(conn, row.id, location=location, status="verified", path=path, manifest_sha256=manifest_sha256,
                       writer=None)
        Catalog.record_event(conn, row.run_id, step, "repair", actor=actor, problem=kind, location=location,
                             path=path, status="verified")
        Catalog.notify(conn, row.run_id, step, "durable")
        return True
    return bool(catalog.write(fn))


def holds_payload(catalog: Catalog, run: str, step: int, manifest_sha256: str | None) -> bool:
    """Whether ``run@step`` is a live step holding the payload ``manifest_sha256``: a copy of it may be recorded."""
    def fn(conn: Connection) -> bool:
        row = conn.execute(select(CheckpointRow.c.status, CheckpointRow.c.manifest_sha256)
                           .join(Run, Run.c.id == CheckpointRow.c.run_id)
                           .where(Run.c.name == run, CheckpointRow.c.step == step)).first()
        return (row is not None and row.status not in ENDED and row.status != Status.STAGING
                and manifest_sha256 is not None and row.manifest_sha256 == manifest_sha256)
    return bool(catalog.read(fn))


__all__ = ["RowState", "copy_snapshot", "copy_unchanged", "holds_payload", "record_copy", "record_payload",
           "set_copy_status_if", "set_status_if", "snapshot", "unchanged"]
