"""The catalog: every question and every state change, as one method each.

Knows SQL and nothing of torch or files. Each public method is one
transaction; writes go through :func:`session.write_connection` (``BEGIN
IMMEDIATE`` on SQLite) and are retried as a whole on lock timeouts,
serialization failures and deadlocks, so none of those reach the caller.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal, overload

from sqlalchemy import (Connection, Engine, and_, bindparam, delete, func, insert, literal_column,
                        or_, select, text, union_all, update)
from sqlalchemy.exc import DBAPIError, IntegrityError

from registry.catalog.lineage import record_lineage
from registry.catalog.policy import record_policy_step
from registry.catalog.outbox import forget_written, record_outbox, took_written
from registry.catalog.models import (Attempt, AttemptEnvironment, CheckpointFile, CheckpointRow, Event, Lease, Metric,
                                     Replica, Run, Tag)
from registry.catalog.records import Claim, CommitRecord, FileRecord
from registry.catalog.driver import DriverRead, DriverStatement
from registry.catalog.session import (aware, catalog_name, failure_reason, head_revision,
                                      open_engine, read_engine, retrying, utcnow, write_connection)
from registry.crashpoints import crashpoint
from registry.errors import CatalogError, CheckpointNotFoundError, InvalidRefError, StepExistsError
from registry.records import ENDED, HAS_PAYLOAD, LIVE, RANKABLE, CheckpointInfo, EventInfo, MetricPoint, RunInfo, Status
from registry.format.refs import Ref, did_you_mean, missing_tag

NOTIFY_CHANNEL = "registry_checkpoints"


def replace_files(conn: Connection, checkpoint_id: int, files: Iterable[FileRecord]) -> None:
    """Make ``files`` the checkpoint's whole file table."""
    conn.execute(delete(CheckpointFile).where(CheckpointFile.c.checkpoint_id == checkpoint_id))
    rows = [{"checkpoint_id": checkpoint_id, "name": f.name, "size": f.size, "sha256": f.sha256} for f in files]
    if rows:
        conn.execute(insert(CheckpointFile), rows)


DURABLE = "durable"  # the replica location of the durable tier (see registry.catalog.replicas)


def record_replica(conn: Connection, checkpoint_id: int, *, location: str, status: str, path: str,
                   manifest_sha256: str | None, writer: str | None, files: Sequence[str] | None = None) -> None:
    """Make ``location``'s copy of the step this row (in the caller's transaction); ``files``: a part's data
    files (None: the copy holds the whole payload)."""
    now = utcnow()
    values: dict[str, Any] = dict(status=status, path=path, manifest_sha256=manifest_sha256, writer=writer,
                                  updated_at=now, files=None if files is None else json.dumps(sorted(files)))
    if location == DURABLE and status == "verified":
        values["durable_at"] = now
    changed = conn.execute(update(Replica).where(Replica.c.checkpoint_id == checkpoint_id,
                                                 Replica.c.location == location).values(**values)).rowcount
    if not changed:
        conn.execute(insert(Replica).values(checkpoint_id=checkpoint_id, location=location, created_at=now,
                                            **values))


def _durable_copy_exists(c: Any) -> Any:
    """The condition that the checkpoint row ``c`` has a verified durable copy of its own payload."""
    return select(Replica.c.checkpoint_id).where(
        Replica.c.checkpoint_id == c.id, Replica.c.location == DURABLE, Replica.c.status == "verified",
        Replica.c.manifest_sha256 == c.manifest_sha256).exists()


WriterAlive = Callable[[str | None, datetime | None], bool]  # (writer, row last refreshed at) -> may still write


def _claim_conflict(run: str, step: int, status: str, writer: str | None, updated_at: datetime | None, *,
                    overwrite: bool, writer_alive: WriterAlive) -> StepExistsError | None:
    """Why an existing row of ``run@step`` may not be claimed now, or None if it may."""
    if status == Status.STAGING and writer_alive(writer, aware(updated_at)):
        return StepExistsError(f"{run}@{step} is being published by {writer}", run=run, step=step)
    if status in HAS_PAYLOAD and not overwrite:
        return StepExistsError(f"{run}@{step} already exists ({status}); pass overwrite=True to replace it",
                               run=run, step=step)
    return None


class _SqliteFile:
    """The identity (device, inode) of the SQLite file a catalog opened, checked before each transaction.

    SQLite keeps answering from a file that was deleted or replaced under an
    open connection, and a fresh connection would create an empty one in its
    place; one ``stat`` per transaction turns both into a clear error.
    """

    def __init__(self, database: str) -> None:
        self.path = os.path.abspath(database)
        self.identity: tuple[int, int] | None = None
        self.check()

    def check(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        except OSError:
            return  # cannot tell from here: the database itself reports what is wrong
        if st is not None and self.identity is None:
            self.identity = (st.st_dev, st.st_ino)
        elif self.identity is not None and (st is None or (st.st_dev, st.st_ino) != self.identity):
            what = "deleted" if st is None else "replaced by another file"
            raise CatalogError(f"catalog file {self.path} was {what} while this registry had it open; "
                               "restore it from a backup or open the registry again", path=self.path)


log = logging.getLogger(__name__)


class Catalog:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # called after a commit that wrote webhook outbox rows (the registry's background deliverer)
        self.on_outbox: Callable[[], None] | None = None
        self._read_engine = read_engine(engine) if engine.dialect.name == "sqlite" else engine
        self._file = _SqliteFile(str(engine.url.database)) if engine.dialect.name == "sqlite" else None

    @classmethod
    def open(cls, url: str, *, migrate: bool = True) -> Catalog:
        return cls(open_engine(url, migrate=migrate))

    def close(self) -> None:
        if self._read_engine is not self.engine:
            self._read_engine.dispose()
        self.engine.dispose()

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def write(self, fn: Any, *, durable: bool = True) -> Any:
        """``fn(conn)`` in one write transaction, retried on lock timeouts (so ``fn`` must not keep state)."""
        wrote: list[bool] = []

        def txn() -> Any:
            wrote.clear()
            with write_connection(self.engine, durable=durable) as conn:
                forget_written(conn)
                result = fn(conn)
                wrote.append(took_written(conn))
            return result
        result = self._transaction(txn)
        if wrote and wrote[-1]:
            crashpoint("outbox-after-commit")
            if self.on_outbox is not None:
                self.on_outbox()
        return result

    @functools.cached_property
    def _driver_leases(self) -> tuple[DriverStatement, DriverStatement] | None:
        """On a writable SQLite catalog, the lease and its release as driver statements, over pooled connections.

        A load takes and releases a lease every time; through SQLAlchemy those
        two writes cost more than the rest of a lazy load (see ``DriverStatement``).
        """
        if self._read_engine is self.engine:
            return None
        return (DriverStatement(_lease_statement("sqlite"), self._read_engine),
                DriverStatement(_RELEASE_LEASE, self._read_engine))

    @functools.cached_property
    def _driver_reads(self) -> DriverRead | None:
        """On a writable SQLite catalog, a resolve's read transaction on a pooled driver connection: a load
        resolves every time, and SQLAlchemy's execution around its statements cost more than they do."""
        if self._read_engine is self.engine:
            return None
        return DriverRead(self._read_engine)

    def _take_lease(self, run: str, step: int, holder: str, ttl: timedelta) -> int | None:
        """A reader lease on the live ``run@step``; None when it is not live. A lease outlives no power loss
        (its reader died too), so on SQLite its commit skips the WAL fsync."""
        def params() -> dict[str, Any]:
            return {"run": run, "step": step, "holder": holder, "expires_at": utcnow() + ttl}
        driver = self._driver_leases
        if driver is None:
            return self.write(lambda conn: conn.scalar(_lease_statement(conn.dialect.name), params()), durable=False)
        return self._transaction(lambda: driver[0].run(params()))

    def read(self, fn: Any) -> Any:
        """``fn(conn)`` in one read transaction, retried like :meth:`write`."""
        def txn() -> Any:
            with self._read_engine.connect() as conn, conn.begin():
                return fn(conn)
        return self._transaction(txn)

    def read_prebuilt(self, fn: Any) -> Any:
        """:meth:`read` for ``fn(conn)`` that runs only statements built once, each by ``conn.execute`` (its
        rows iterated, ``.first()``, ``.all()``, columns by name): on a writable SQLite catalog, a
        :class:`DriverRead` with none of SQLAlchemy's execution around them, for a publish that asks on
        every call (dedup's candidates)."""
        driver = self._driver_reads
        if driver is None:
            return self.read(fn)
        return self._transaction(lambda: driver.run(fn))

    def _transaction(self, txn: Callable[[], Any]) -> Any:
        """Run ``txn`` with retries; a database error that outlasts them is a one-line ``CatalogError``."""
        if self._file is not None:
            self._file.check()
        try:
            return retrying(txn)
        except DBAPIError as exc:
            if self._file is not None:
                try:
                    self._file.check()  # a vanished file explains the error better than the driver does
                except CatalogError as gone:
                    raise gone from exc
            raise CatalogError(f"catalog {catalog_name(self.engine.url)}: {failure_reason(exc)}") from exc

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def lookup_run(conn: Connection, run: str, *, create: bool = False) -> int | None:
        """The id of ``run``; None when it has none, unless ``create``."""
        run_id = conn.scalar(select(Run.c.id).where(Run.c.name == run))
        if run_id is None and create:
            try:  # a concurrent writer may create the same run first: then use theirs
                with conn.begin_nested():
                    conn.execute(insert(Run).values(name=run, created_at=utcnow()))
            except IntegrityError:
                pass
            run_id = conn.scalar(select(Run.c.id).where(Run.c.name == run))
        return run_id

    def require_run(self, conn: Connection, run: str) -> int:
        """The id of ``run``; ``CheckpointNotFoundError`` when there is no such run."""
        run_id = self.lookup_run(conn, run)
        if run_id is None:
            hint = did_you_mean(run, conn.scalars(select(Run.c.name)), shown="{!r}")
            raise CheckpointNotFoundError(f"no run named {run!r}{hint}", run=run)
        return run_id

    @staticmethod
    def tag_names(conn: Connection, run_id: int) -> list[str]:
        return list(conn.scalars(select(Tag.c.name).where(Tag.c.run_id == run_id)))

    @staticmethod
    def _metric_key_query(run_id: int) -> Any:
        return (select(Metric.c.key).where(Metric.c.run_id == run_id, Metric.c.superseded.is_(False))
                .distinct().order_by(Metric.c.key))

    def _not_found_hint(self, conn: Connection, ref: Ref) -> str:
        """What a ``best:`` ref that found nothing probably meant, from the run's own metric keys."""
        run_id = self.require_run(conn, ref.run)
        if ref.kind == "best" and ref.metric is not None:
            keys = list(conn.scalars(self._metric_key_query(run_id)))
            if ref.metric not in keys:
                mode = ":max" if ref.mode == "max" else ""
                return did_you_mean(ref.metric, keys, shown=f"{ref.run}@best:{{}}{mode}")
        return ""

    @staticmethod
    def record_event(conn: Connection, run_id: int | None, step: int | None, kind: str,
                     actor: str | None = None, **detail: Any) -> None:
        """Append an event to the audit log, in the caller's transaction, and to the webhook outbox of each
        webhook that subscribes to it."""
        conn.execute(insert(Event).values(run_id=run_id, step=step, kind=kind, actor=actor,
                                          detail=json.dumps(detail, sort_keys=True), created_at=utcnow()))
        record_outbox(conn, run_id, step, kind, detail)

    def checkpoint_infos(self, conn: Connection, run: str, rows: Sequence[Any]) -> list[CheckpointInfo]:
        """Checkpoint rows of one run as records, with their current metrics and tags."""
        if not rows:
            return []
        run_id = rows[0].run_id
        ids = [r.id for r in rows]
        steps = [r.step for r in rows]
        metrics: dict[int, dict[str, float]] = {}
        tags: dict[int, list[str]] = {}
        if len(rows) == 1:  # resolve's case: one round trip for both, it is most of resolve's cost
            one = rows[0]
            found: Sequence[Any] = conn.execute(_METRICS_AND_TAGS, {"run_id": run_id, "step": one.step,
                                                                  "checkpoint_id": one.id}).all()
            for kind, name, value, _ in sorted(found, key=lambda f: (f.kind, f.ord, f.name)):
                if kind == "m":
                    metrics.setdefault(one.step, {})[name] = value
                else:
                    tags.setdefault(one.id, []).append(name)
            ids = []
        for chunk_start in range(0, len(ids), 500):
            step_chunk = steps[chunk_start:chunk_start + 500]
            id_chunk = ids[chunk_start:chunk_start + 500]
            for step, key, value in conn.execute(
                    select(Metric.c.step, Metric.c.key, Metric.c.value)
                    .where(Metric.c.run_id == run_id, Metric.c.step.in_(step_chunk), Metric.c.superseded.is_(False))
                    .order_by(Metric.c.id)):
                metrics.setdefault(step, {})[key] = value
            for cid, name in conn.execute(select(Tag.c.checkpoint_id, Tag.c.name)
                                          .where(Tag.c.checkpoint_id.in_(id_chunk)).order_by(Tag.c.name)):
                tags.setdefault(cid, []).append(name)
        return [CheckpointInfo(
            run=run, step=r.step, status=Status(r.status), path=Path(r.path), epoch=r.epoch,
            consumed_samples=r.consumed_samples, policy_version=r.policy_version,
            optimizer_step=r.optimizer_step, metrics=metrics.get(r.step, {}),
            tags=tuple(tags.get(r.id, ())), total_bytes=r.total_bytes,
            manifest_sha256=r.manifest_sha256, created_at=aware(r.created_at),
            verified_at=aware(r.verified_at), writer=r.writer) for r in rows]

    # ------------------------------------------------------------------ publish

    def claim(self, run: str, step: int, *, path: str, writer: str, overwrite: bool,
              writer_alive: WriterAlive = lambda _writer, _at: True) -> Claim:
        """Phase 1: a ``staging`` row decides between racing writers.

        A ``staging`` row left by a writer that ``writer_alive`` says is dead
        (a crashed trainer that is now resuming) is taken over.
        """
        def fn(conn: Connection) -> Claim:
            taken_from.clear()  # a retried transaction starts over
            run_id = self.lookup_run(conn, run, create=True)
            assert run_id is not None
            now = utcnow()
            query = select(CheckpointRow).where(CheckpointRow.c.run_id == run_id, CheckpointRow.c.step == step)
            if conn.dialect.name == "postgresql":
                query = query.with_for_update()
            row = conn.execute(query).first()
            if row is None:
                try:
                    with conn.begin_nested():
                        cid = conn.execute(insert(CheckpointRow).values(
                            run_id=run_id, step=step, status=Status.STAGING, path=path, writer=writer,
                            epoch=0, consumed_samples=0, total_bytes=0, created_at=now,
                            updated_at=now).returning(CheckpointRow.c.id)).scalar_one()
                except IntegrityError:
                    raise StepExistsError(f"{run}@{step} is being published by another writer",
                                          run=run, step=step) from None
                return Claim(checkpoint_id=cid, run_id=run_id, previous_status=None)
            conflict = _claim_conflict(run, step, row.status, row.writer, row.updated_at, overwrite=overwrite,
                                       writer_alive=writer_alive)
            if conflict is not None:
                raise conflict
            # a staging row taken over from a dead writer is this writer's step from now: its time, not the dead one's
            taken = {"created_at": now} if row.status == Status.STAGING else {}
            conn.execute(update(CheckpointRow).where(CheckpointRow.c.id == row.id)
                         .values(status=Status.STAGING, writer=writer, path=path, updated_at=now, **taken))
            previous = row.status if row.status != Status.STAGING else None
            if row.status == Status.STAGING:
                self.record_event(conn, run_id, step, "takeover", actor=writer, dead_writer=row.writer)
                taken_from.append(row.writer)
            return Claim(checkpoint_id=row.id, run_id=run_id, previous_status=previous,
                         previous_path=row.path if previous is not None else None)
        taken_from: list[str | None] = []
        claim: Claim = self.write(fn)
        if taken_from:
            log.info("%s@%d: took over the staging row of dead writer %s", run, step, taken_from[-1])
        return claim

    def check_claimable(self, run: str, step: int, *, overwrite: bool,
                        writer_alive: WriterAlive = lambda _writer, _at: True) -> None:
        """Raise the ``StepExistsError`` that :meth:`claim` would raise now, without writing.

        For an asynchronous publish, which claims in the background but should
        refuse an existing step before it returns.
        """
        def fn(conn: Connection) -> None:
            row = conn.execute(select(CheckpointRow.c.status, CheckpointRow.c.writer, CheckpointRow.c.updated_at)
                               .join(Run, Run.c.id == CheckpointRow.c.run_id)
                               .where(Run.c.name == run, CheckpointRow.c.step == step)).first()
            if row is not None:
                conflict = _claim_conflict(run, step, row.status, row.writer, row.updated_at,
                                           overwrite=overwrite, writer_alive=writer_alive)
                if conflict is not None:
                    raise conflict
        self.read(fn)

    def touch_claim(self, claim: Claim) -> None:
        """Refresh a claimed ``staging`` row: other hosts see that its writer is still at work.

        Not durable: after a power loss the writer is gone with the beat.
        """
        def fn(conn: Connection) -> None:
            conn.execute(update(CheckpointRow).where(CheckpointRow.c.id == claim.checkpoint_id,
                                                     CheckpointRow.c.status == Status.STAGING)
                         .values(updated_at=utcnow()))
        self.write(fn, durable=False)

    def abort_claim(self, claim: Claim, *, reason: str, old_payload_intact: bool) -> None:
        """Undo phase 1 after a failure: the row returns to its previous status, or ``failed``.

        A live step returns only with its payload intact; a ``deleted`` one
        always does (gc removes whatever is left of it). A restored row gets
        its previous path back (an object-store attempt's prefix differs).
        """
        def fn(conn: Connection) -> None:
            restore = (claim.previous_status == Status.DELETED
                       or claim.previous_status in HAS_PAYLOAD and old_payload_intact)
            status = claim.previous_status if restore else Status.FAILED
            path = {"path": claim.previous_path} if restore and claim.previous_path is not None else {}
            conn.execute(update(CheckpointRow).where(CheckpointRow.c.id == claim.checkpoint_id,
                                                     CheckpointRow.c.status == Status.STAGING)
                         .values(status=status, updated_at=utcnow(), **path))
            step = conn.scalar(select(CheckpointRow.c.step).where(CheckpointRow.c.id == claim.checkpoint_id))
            self.record_event(conn, claim.run_id, step, "publish-failed", reason=reason, restored=restore)
        self.write(fn)

    def start_attempt(self, run: str, *, writer: str, resumed_from: int | None,
                      fork: tuple[str, int, str | None] | None = None, environment: str | None = None) -> int:
        """A new attempt; ``fork`` is the (run, step, manifest digest) of the checkpoint it was forked from,
        ``environment`` the JSON of the code and environment it runs in (``registry.ops.environment``)."""
        def fn(conn: Connection) -> int:
            run_id = self.lookup_run(conn, run, create=True)
            forked = {} if fork is None else {"fork_run": fork[0], "fork_step": fork[1],
                                              "fork_manifest_sha256": fork[2]}
            attempt_id: int = conn.execute(insert(Attempt).values(run_id=run_id, writer=writer,
                                                                  resumed_from=resumed_from, started_at=utcnow(),
                                                                  **forked)
                                           .returning(Attempt.c.id)).scalar_one()
            if environment is not None:
                conn.execute(insert(AttemptEnvironment).values(attempt_id=attempt_id, environment=environment))
            return attempt_id
        return self.write(fn)

    def commit_publish(self, claim: Claim, record: CommitRecord, *, writer: str) -> CheckpointInfo:
        """Phase 4: the step becomes visible together with its files, metrics and tags.

        Returns the step as committed, read back in the same transaction.

        ``record.resumed_from=N`` says this is the first publish of an attempt that
        resumed from step N: in the same transaction, current metric points of
        the run at steps > N logged by any *other* attempt become superseded
        (kept as history), because they describe a timeline that was abandoned.
        Publishing a step again (an overwrite, or over a deleted, failed or
        corrupt incarnation) supersedes the points of the earlier incarnation at
        that step: they scored weights that no longer exist. Those are the points
        other attempts logged there, and this attempt's own up to the moment the
        earlier incarnation was published (or deleted, if it was); this
        attempt's later points, and those committed here, are for the new one.
        """
        payload, attempt_id, resumed_from = record.payload, record.attempt_id, record.resumed_from

        def fn(conn: Connection) -> CheckpointInfo:
            now = utcnow()
            cid = claim.checkpoint_id
            c = CheckpointRow.c
            earlier = conn.execute(select(c.step, c.published_at, c.deleted_at, c.manifest_sha256)
                                   .where(CheckpointRow.c.id == cid)).one()
            step = earlier.step
            conn.execute(update(CheckpointRow).where(CheckpointRow.c.id == cid).values(
                **payload.columns(now), attempt_id=attempt_id, writer=writer))
            self._lock_run(conn, claim.run_id)
            others = or_(Metric.c.attempt_id.is_(None), Metric.c.attempt_id != attempt_id)
            current = [Metric.c.run_id == claim.run_id, Metric.c.superseded.is_(False), others]
            if resumed_from is not None:
                n = conn.execute(update(Metric).where(*current, Metric.c.step > resumed_from)
                                 .values(superseded=True)).rowcount
                if attempt_id is not None:
                    conn.execute(update(Attempt).where(Attempt.c.id == attempt_id).values(resumed_from=resumed_from))
                self.record_event(conn, claim.run_id, step, "resume", actor=writer, attempt=attempt_id,
                            resumed_from=resumed_from, superseded_points=n)
            ended = max((t for t in (aware(earlier.published_at), aware(earlier.deleted_at)) if t is not None),
                        default=None)
            superseded = None
            if claim.previous_status is not None or ended is not None:
                stale = others if ended is None else or_(others, Metric.c.logged_at <= ended)
                superseded = conn.execute(update(Metric).where(
                    Metric.c.run_id == claim.run_id, Metric.c.superseded.is_(False), Metric.c.step == step, stale)
                    .values(superseded=True)).rowcount
            replace_files(conn, cid, payload.files)
            record_lineage(conn, checkpoint_id=cid, run_id=claim.run_id, attempt_id=attempt_id,
                           resumed_from=resumed_from, explicit=record.lineage, replacing=earlier.manifest_sha256)
            record_policy_step(conn, checkpoint_id=cid, run_id=claim.run_id, record=record.policy)
            self._insert_metrics(conn, claim.run_id, record.metrics, attempt_id, now=now)
            again: dict[str, Any] = {} if superseded is None else {"superseded_points": superseded}
            if payload.linked:
                again.update(linked=list(payload.linked), linked_bytes=payload.linked_bytes)
            self.record_event(conn, claim.run_id, step, "publish", actor=writer, status=payload.status,
                              manifest_sha256=payload.manifest_sha256, overwrite=claim.previous_status is not None,
                              **again)
            for name in record.tags:
                self._set_tag(conn, claim.run_id, step, cid, name, actor=writer)
            if record.replica is not None:
                record_replica(conn, cid, location=record.replica[0], status=payload.status, path=record.replica[1],
                               manifest_sha256=payload.manifest_sha256, writer=writer)
            for part in record.parts:
                record_replica(conn, cid, location=part.location, status=payload.status, path=part.path,
                               manifest_sha256=payload.manifest_sha256, writer=writer, files=part.files)
            self.notify(conn, claim.run_id, step, payload.status)
            row = conn.execute(select(CheckpointRow, Run.c.name.label("run_name"))
                               .join(Run, Run.c.id == CheckpointRow.c.run_id).where(CheckpointRow.c.id == cid)).one()
            return self.checkpoint_infos(conn, row.run_name, [row])[0]
        info: CheckpointInfo = self.write(fn)
        return info

    @staticmethod
    def notify(conn: Connection, run_id: int, step: int | None, status: str) -> None:
        """Wake PostgreSQL followers of the run when the caller's transaction commits."""
        if conn.dialect.name == "postgresql":
            run = conn.scalar(select(Run.c.name).where(Run.c.id == run_id))
            conn.execute(text("SELECT pg_notify(:c, :p)"),
                         {"c": NOTIFY_CHANNEL, "p": json.dumps({"run": run, "step": step, "status": status})})

    @staticmethod
    def _lock_run(conn: Connection, run_id: int) -> None:
        """Serialize metric writers of one run on PostgreSQL (SQLite's BEGIN IMMEDIATE already does),
        so two racing writers cannot both leave a current point for the same (step, key).
        ``FOR NO KEY UPDATE`` does not block other transactions' foreign-key checks on the run."""
        if conn.dialect.name == "postgresql":
            conn.execute(select(Run.c.id).where(Run.c.id == run_id).with_for_update(key_share=True))

    @classmethod
    def _insert_metrics(cls, conn: Connection, run_id: int, metrics: Sequence[tuple[int, str, float]],
                        attempt_id: int | None, *, now: datetime | None = None) -> None:
        """``now``: a publish passes its ``published_at``, so its points can be told from later ones."""
        if not metrics:
            return
        cls._lock_run(conn, run_id)
        now = now if now is not None else utcnow()
        latest: dict[tuple[int, str], float] = {}
        for step, key, value in metrics:
            latest[(step, key)] = value
        for (step, key) in latest:
            conn.execute(update(Metric).where(Metric.c.run_id == run_id, Metric.c.step == step, Metric.c.key == key,
                                              Metric.c.superseded.is_(False)).values(superseded=True))
        conn.execute(insert(Metric), [
            {"run_id": run_id, "step": step, "key": key, "value": value, "attempt_id": attempt_id,
             "superseded": False, "logged_at": now} for (step, key), value in latest.items()])

    def add_metrics(self, run: str, metrics: Sequence[tuple[int, str, float]], *,
                    attempt_id: int | None) -> None:
        """Durably record metric points outside a publish (``flush``, late evaluation)."""
        def fn(conn: Connection) -> None:
            run_id = self.lookup_run(conn, run, create=True)
            assert run_id is not None
            self._insert_metrics(conn, run_id, metrics, attempt_id)
        self.write(fn)

    # ------------------------------------------------------------------ status changes

    def set_status(self, run: str, step: int, status: str, *, kind: str, actor: str | None = None,
                   only_from: Sequence[str] | None = None, manifest_sha256: str | None = None,
                   **detail: Any) -> bool:
        """Move a step to ``status`` (when it is in ``only_from``) and record an event, with the status it left.

        ``manifest_sha256``: compare-and-set on the digest of the manifest the
        caller actually read. A verdict (verified, corrupt, deleted) is about
        one payload; if another writer replaced it since, the row is left
        alone and False is returned.
        """
        def fn(conn: Connection) -> bool:
            run_id = self.require_run(conn, run)
            cond = [CheckpointRow.c.run_id == run_id, CheckpointRow.c.step == step]
            if only_from is not None:
                cond.append(CheckpointRow.c.status.in_(only_from))
            if manifest_sha256 is not None:
                cond.append(CheckpointRow.c.manifest_sha256 == manifest_sha256)
            before = conn.scalar(select(CheckpointRow.c.status).where(*cond).with_for_update())
            if before is None:
                return False
            now = utcnow()
            values: dict[str, Any] = {"status": status, "updated_at": now}
            if status == Status.VERIFIED:
                values["verified_at"] = now
            if status == Status.DELETED:
                values["deleted_at"] = now
            changed = conn.execute(update(CheckpointRow).where(*cond).values(**values)).rowcount
            if changed:
                self.record_event(conn, run_id, step, kind, actor=actor, status=status,
                                  previous_status=str(before), **detail)
                if status == Status.VERIFIED:
                    self.notify(conn, run_id, step, status)  # followers wait for verified steps
            return bool(changed)
        return self.write(fn)

    # ------------------------------------------------------------------ tags

    @staticmethod
    def _tagged(conn: Connection, run_id: int, name: str) -> Any:
        """The checkpoint id and step the tag ``name`` points to now, or None."""
        return conn.execute(select(Tag.c.checkpoint_id, CheckpointRow.c.step, Tag.c.note)
                            .join(CheckpointRow, CheckpointRow.c.id == Tag.c.checkpoint_id)
                            .where(Tag.c.run_id == run_id, Tag.c.name == name)).first()

    def _set_tag(self, conn: Connection, run_id: int, step: int, checkpoint_id: int, name: str,
                 actor: str | None, note: str | None = None) -> None:
        """Point the tag at the step with ``note``; a tag moved without a note loses the one it had, and one
        set again where it is keeps it unless a note is given (``""`` removes it)."""
        old = self._tagged(conn, run_id, name)
        now = utcnow()
        noted = {} if note is None else {"note": note}
        if old is None:
            try:  # another writer may create the same name first (PostgreSQL): then move theirs
                with conn.begin_nested():
                    conn.execute(insert(Tag).values(run_id=run_id, name=name, checkpoint_id=checkpoint_id,
                                                    updated_at=now, note=note or None))
            except IntegrityError:
                old = self._tagged(conn, run_id, name)
                if old is None:
                    raise
        if old is not None and old.checkpoint_id == checkpoint_id:
            if note is not None and (note or None) != old.note:
                conn.execute(update(Tag).where(Tag.c.run_id == run_id, Tag.c.name == name).values(note=note or None))
                self.record_event(conn, run_id, step, "tag-note", actor=actor, tag=name, note=note)
            return
        if old is not None:
            conn.execute(update(Tag).where(Tag.c.run_id == run_id, Tag.c.name == name)
                         .values(checkpoint_id=checkpoint_id, updated_at=now, note=note or None))
        self.record_event(conn, run_id, step, "tag", actor=actor, tag=name,
                    old_step=old.step if old is not None else None, new_step=step, **noted)

    def tag(self, run: str, step: int, name: str, *, actor: str | None = None, note: str | None = None) -> None:
        def fn(conn: Connection) -> None:
            run_id = self.require_run(conn, run)
            query = select(CheckpointRow.c.id, CheckpointRow.c.status).where(CheckpointRow.c.run_id == run_id,
                                                                         CheckpointRow.c.step == step)
            if conn.dialect.name == "postgresql":
                query = query.with_for_update(read=True)  # serialise with gc, as acquire_lease does
            row = conn.execute(query).first()
            if row is None or row.status not in LIVE:
                raise CheckpointNotFoundError(
                    f"cannot tag {run}@{step}: no published checkpoint at that step", run=run, step=step)
            self._set_tag(conn, run_id, step, row.id, name, actor, note)
        self.write(fn)

    def untag(self, run: str, name: str, *, actor: str | None = None) -> int:
        def fn(conn: Connection) -> int:
            run_id = self.require_run(conn, run)
            old = self._tagged(conn, run_id, name)
            if old is None:
                hint = did_you_mean(name, self.tag_names(conn, run_id), shown="{!r}")
                raise CheckpointNotFoundError(f"run {run!r} has no tag {name!r}{hint}", run=run)
            conn.execute(delete(Tag).where(Tag.c.run_id == run_id, Tag.c.name == name))
            self.record_event(conn, run_id, old.step, "untag", actor=actor, tag=name, old_step=old.step)
            return int(old.step)
        return self.write(fn)

    # ------------------------------------------------------------------ queries

    @staticmethod
    def resolve_query(ref: Ref, *, below: int | None = None,
                      min_policy_version: int | None = None) -> tuple[Any, str]:
        """The one SELECT behind :meth:`resolve`, its values bound (exposed so the benchmark can EXPLAIN it),
        and what to say when it finds nothing."""
        query, params, what = _resolve_statement(ref, below=below, min_policy_version=min_policy_version)
        return query.params(params), what

    def resolve(self, ref: Ref, *, below: int | None = None, min_policy_version: int | None = None) -> CheckpointInfo:
        """The checkpoint a ref names now (the grammar is in docs/reference/refs.md).

        - ``latest``: the newest ``verified`` step; ``latest-published``: the
          newest ``published`` or ``verified`` one; ``latest-durable``: the newest
          live one with a ``verified`` copy of its payload on the durable tier. ``below`` restricts them to
          older steps (the loader's fallback past a corrupt step) and
          ``min_policy_version`` to steps whose policy version is at least that.
        - ``best:METRIC[:min|max]``: among ``published``/``verified`` steps, the
          one whose *current* (not superseded) point for METRIC at its own step
          is lowest (highest). Ties go to the newest step. Metric points at
          steps without a checkpoint, and steps that are deleted, corrupt,
          failed or still staging, never take part.
        - a step number or a tag: that step when it is ``published``,
          ``verified`` or ``corrupt`` (a corrupt one resolves so it can be shown
          and re-verified; loading it raises ``CorruptCheckpointError``); any
          other status is a ``CheckpointNotFoundError`` that names the status.
        """
        driver = self._driver_reads
        if driver is not None:  # what it finds; what it does not is explained by the read below
            found = self._transaction(lambda: driver.run(lambda conn: self._resolve_in(
                conn, ref, below=below, min_policy_version=min_policy_version, explain=False)))
            if found is not None:
                return found
        return self.read(lambda conn: self._resolve_in(conn, ref, below=below, min_policy_version=min_policy_version))

    def resolve_leased(self, ref: Ref, *, below: int | None = None, holder: str,
                       ttl: timedelta) -> tuple[CheckpointInfo, int | None]:
        """:meth:`resolve`, and a reader lease on the step when it is live.

        The lease is None for a step that is not live (a corrupt one resolves
        by step or tag) or that gc deleted since it resolved: the caller
        resolves again. The lease names the run and step, not the payload: a
        step published again in between is caught by the reader, which checks
        what it reads against ``manifest_sha256``.
        """
        if self._driver_leases is not None:  # SQLite: a read, then the lease as one driver statement
            info = self.resolve(ref, below=below)
            return info, self._take_lease(info.run, info.step, holder, ttl) if info.status in LIVE else None

        def fn(conn: Connection) -> tuple[CheckpointInfo, int | None]:  # one transaction, one commit
            info = self._resolve_in(conn, ref, below=below, min_policy_version=None)
            if info.status not in LIVE:
                return info, None
            return info, conn.scalar(_lease_statement(conn.dialect.name), {
                "run": info.run, "step": info.step, "holder": holder, "expires_at": utcnow() + ttl})
        return self.write(fn, durable=False)

    @overload
    def _resolve_in(self, conn: Connection, ref: Ref, *, below: int | None,
                    min_policy_version: int | None) -> CheckpointInfo: ...

    @overload
    def _resolve_in(self, conn: Any, ref: Ref, *, below: int | None, min_policy_version: int | None,
                    explain: Literal[False]) -> CheckpointInfo | None: ...

    def _resolve_in(self, conn: Any, ref: Ref, *, below: int | None, min_policy_version: int | None,
                    explain: bool = True) -> CheckpointInfo | None:
        """The checkpoint ``ref`` names, in ``conn``'s transaction; without ``explain``, None where
        :meth:`resolve` raises (nothing beyond the resolve's own statements is run)."""
        query, params, what = _resolve_statement(ref, below=below, min_policy_version=min_policy_version)
        row = conn.execute(query, params).first()
        if row is None or ref.kind in ("tag", "step", "pv") and row.status not in HAS_PAYLOAD:
            if not explain:
                return None
            if row is None:
                if ref.kind == "tag" and ref.tag is not None:
                    raise self._missing_tag_error(conn, ref, ref.tag, what)
                hint = self._not_found_hint(conn, ref)
                raise CheckpointNotFoundError(f"{ref}: {what}{hint}", run=ref.run, step=ref.step)
            raise CheckpointNotFoundError(f"{ref}: step {row.step} is {row.status}", run=ref.run, step=row.step)
        return self.checkpoint_infos(conn, ref.run, [row])[0]

    def _missing_tag_error(self, conn: Connection, ref: Ref, tag: str,
                           what: str) -> InvalidRefError | CheckpointNotFoundError:
        """A tag ref that names no tag: a misspelt keyword is an ``InvalidRefError``, never "nothing yet" (a
        trainer whose resume starts fresh on ``CheckpointNotFoundError`` must not start over on a typo)."""
        run_id = self.lookup_run(conn, ref.run)
        keyword, hint = missing_tag(ref.run, tag, self.tag_names(conn, run_id) if run_id is not None else ())
        if keyword:
            return InvalidRefError(f"invalid ref {str(ref)!r}: no tag {tag!r}; {hint}", run=ref.run)
        if run_id is None:
            self.require_run(conn, ref.run)  # raises, naming the closest run
        return CheckpointNotFoundError(f"{ref}: {what}{f'; {hint}' if hint else ''}", run=ref.run)

    def resolve_each(self, refs: Sequence[Ref]) -> list[CheckpointInfo | None]:
        """:meth:`resolve` of many refs in one read transaction; None where one names no step (a runs table)."""
        def fn(conn: Connection) -> list[CheckpointInfo | None]:
            found: list[CheckpointInfo | None] = []
            for ref in refs:
                query, params, _ = _resolve_statement(ref)
                row = conn.execute(query, params).first()
                ok = row is not None and (ref.kind not in ("tag", "step", "pv") or row.status in HAS_PAYLOAD)
                found.append(self.checkpoint_infos(conn, ref.run, [row])[0] if ok else None)
            return found
        return self.read(fn)

    def next_after(self, run: str, after_step: int | None, *, newest: bool = False,
                   statuses: Sequence[str] = (Status.VERIFIED,),
                   min_policy_version: int | None = None, durable: bool = False) -> CheckpointInfo | None:
        """The first (or, with ``newest``, the last) step above ``after_step`` in ``statuses``.

        ``None`` when there is none yet, also when the run does not exist yet:
        a follower may start before its trainer. One indexed lookup, cheap
        enough to poll.
        """
        def fn(conn: Connection) -> CheckpointInfo | None:
            run_id = self.lookup_run(conn, run)
            if run_id is None:
                return None
            c = CheckpointRow.c
            query = select(CheckpointRow).where(c.run_id == run_id, c.status.in_(statuses))
            if after_step is not None:
                query = query.where(c.step > after_step)
            if min_policy_version is not None:
                query = query.where(c.policy_version >= min_policy_version)
            if durable:
                query = query.where(_durable_copy_exists(c))
            row = conn.execute(query.order_by(c.step.desc() if newest else c.step.asc()).limit(1)).first()
            return self.checkpoint_infos(conn, run, [row])[0] if row is not None else None
        return self.read(fn)

    def get(self, run: str, step: int) -> CheckpointInfo | None:
        def fn(conn: Connection) -> CheckpointInfo | None:
            run_id = self.lookup_run(conn, run)
            if run_id is None:
                return None
            row = conn.execute(select(CheckpointRow).where(CheckpointRow.c.run_id == run_id,
                                                                     CheckpointRow.c.step == step)).first()
            return self.checkpoint_infos(conn, run, [row])[0] if row is not None else None
        return self.read(fn)

    def checkpoints(self, run: str, *, include_deleted: bool = False,
                    statuses: Sequence[str] | None = None,
                    policy_version: int | None = None) -> list[CheckpointInfo]:
        def fn(conn: Connection) -> list[CheckpointInfo]:
            run_id = self.require_run(conn, run)
            query = select(CheckpointRow).where(CheckpointRow.c.run_id == run_id)
            if statuses is not None:
                query = query.where(CheckpointRow.c.status.in_(statuses))
            elif not include_deleted:
                query = query.where(CheckpointRow.c.status.not_in(ENDED))
            if policy_version is not None:
                query = query.where(CheckpointRow.c.policy_version == policy_version)
            rows = conn.execute(query.order_by(CheckpointRow.c.step)).all()
            return self.checkpoint_infos(conn, run, rows)
        return self.read(fn)

    def runs(self) -> list[RunInfo]:
        def fn(conn: Connection) -> list[RunInfo]:
            live = CheckpointRow.c.status.in_(LIVE)
            stats = (select(CheckpointRow.c.run_id,
                            func.count(CheckpointRow.c.id).label("n"),
                            func.max(CheckpointRow.c.step).label("latest"),
                            func.coalesce(func.sum(CheckpointRow.c.total_bytes), 0).label("bytes"))
                     .where(live).group_by(CheckpointRow.c.run_id).subquery())
            rows = conn.execute(select(Run.c.name, Run.c.created_at, stats.c.n, stats.c.latest, stats.c.bytes)
                                .outerjoin(stats, stats.c.run_id == Run.c.id).order_by(Run.c.name)).all()
            return [RunInfo(name=r.name, created_at=aware(r.created_at), checkpoints=int(r.n or 0),
                            latest_step=r.latest, total_bytes=int(r.bytes or 0)) for r in rows]
        return self.read(fn)

    def run_health(self, run: str | None = None) -> dict[str, tuple[dict[str, int], datetime | None]]:
        """Per run (or just ``run``): how many checkpoints are in each status, and when it last changed (its
        newest event, or the newest metric point at its highest step, whichever is later). Runs with neither
        are absent."""
        def fn(conn: Connection) -> dict[str, tuple[dict[str, int], datetime | None]]:
            def only(query: Any) -> Any:
                return query if run is None else query.where(Run.c.name == run)
            counts: dict[str, dict[str, int]] = {}
            for name, status, n in conn.execute(only(
                    select(Run.c.name, CheckpointRow.c.status, func.count(CheckpointRow.c.id))
                    .join(CheckpointRow, CheckpointRow.c.run_id == Run.c.id))
                    .group_by(Run.c.name, CheckpointRow.c.status)):
                counts.setdefault(name, {})[str(status)] = int(n)
            last: dict[str, datetime | None] = {}
            top = only(select(Metric.c.run_id, func.max(Metric.c.step).label("step"))
                       .join(Run, Run.c.id == Metric.c.run_id)) \
                .group_by(Metric.c.run_id).subquery()
            newest_metric = (select(Run.c.name, func.max(Metric.c.logged_at))
                             .join(top, top.c.run_id == Run.c.id)
                             .join(Metric, and_(Metric.c.run_id == top.c.run_id, Metric.c.step == top.c.step))
                             .group_by(Run.c.name))
            newest_event = only(select(Run.c.name, func.max(Event.c.created_at))
                                .join(Event, Event.c.run_id == Run.c.id)) \
                .group_by(Run.c.name)
            for query in (newest_event, newest_metric):
                for name, raw in conn.execute(query):
                    when = aware(raw)
                    seen = last.get(name)
                    if when is not None and (seen is None or when > seen):
                        last[name] = when
            return {name: (counts.get(name, {}), last.get(name)) for name in {*counts, *last}}
        return self.read(fn)

    def run_activity(self, run: str | None = None) -> dict[str, tuple[datetime | None, datetime | None]]:
        """Per run (or just ``run``): ``(active, ended)``, when a trainer last wrote to it and when its newest
        attempt ended.

        ``active`` is the latest of a claim (a publish in flight, or one that failed), a commit, and the
        newest metric point at the run's highest step; tags, verifies and deletions are not training.
        ``ended`` is None unless attempts record an ``ended_at``. Runs with neither are absent."""
        def fn(conn: Connection) -> dict[str, tuple[datetime | None, datetime | None]]:
            def only(query: Any) -> Any:
                return query if run is None else query.where(Run.c.name == run)
            c = CheckpointRow.c
            top = only(select(Metric.c.run_id, func.max(Metric.c.step).label("step"))
                       .join(Run, Run.c.id == Metric.c.run_id)).group_by(Metric.c.run_id).subquery()
            queries = [only(select(Run.c.name, func.max(c.created_at), func.max(c.published_at))
                            .join(CheckpointRow, c.run_id == Run.c.id)).group_by(Run.c.name),
                       select(Run.c.name, func.max(Metric.c.logged_at), literal_column("NULL"))
                       .join(top, top.c.run_id == Run.c.id)
                       .join(Metric, and_(Metric.c.run_id == top.c.run_id, Metric.c.step == top.c.step))
                       .group_by(Run.c.name)]
            active: dict[str, datetime | None] = {}
            for query in queries:
                for name, *raw in conn.execute(query):
                    for when in map(aware, raw):
                        seen = active.get(name)
                        if when is not None and (seen is None or when > seen):
                            active[name] = when
            ended: dict[str, datetime | None] = {}
            if "ended_at" in Attempt.c:  # an attempt that records its clean end
                newest = only(select(Attempt.c.run_id, func.max(Attempt.c.id).label("id"))
                              .join(Run, Run.c.id == Attempt.c.run_id)).group_by(Attempt.c.run_id).subquery()
                for name, when in conn.execute(select(Run.c.name, Attempt.c.ended_at)
                                               .join(newest, newest.c.run_id == Run.c.id)
                                               .join(Attempt, Attempt.c.id == newest.c.id)):
                    ended[name] = aware(when)
            return {name: (active.get(name), ended.get(name)) for name in {*active, *ended}}
        return self.read(fn)

    def metrics(self, run: str, *, key: str | None = None, history: bool = False) -> list[MetricPoint]:
        def fn(conn: Connection) -> list[MetricPoint]:
            run_id = self.require_run(conn, run)
            query = select(Metric).where(Metric.c.run_id == run_id)
            if key is not None:
                query = query.where(Metric.c.key == key)
            if not history:
                query = query.where(Metric.c.superseded.is_(False))
            rows = conn.execute(query.order_by(Metric.c.step, Metric.c.key, Metric.c.id)).all()
            return [MetricPoint(step=r.step, key=r.key, value=r.value, logged_at=aware(r.logged_at),
                                attempt=r.attempt_id, current=not r.superseded) for r in rows]
        return self.read(fn)

    def curve(self, run: str, key: str) -> list[tuple[int, float]]:
        """The current ``(step, value)`` points of one metric by step: :meth:`metrics` without the records."""
        def fn(conn: Connection) -> list[tuple[int, float]]:
            run_id = self.require_run(conn, run)
            rows = conn.execute(select(Metric.c.step, Metric.c.value)
                                .where(Metric.c.run_id == run_id, Metric.c.key == key, Metric.c.superseded.is_(False))
                                .order_by(Metric.c.step, Metric.c.id))
            return [(int(step), float(value)) for step, value in rows]
        return self.read(fn)

    def checkpoint_marks(self, run: str) -> list[tuple[int, str, int, datetime | None, tuple[str, ...]]]:
        """Every checkpoint of ``run``, any status, by step, as ``(step, status, total_bytes, created_at, tags)``.

        What a chart marks, for runs of any length: :meth:`checkpoints` builds a
        full record per step, which a run of 10,000 steps cannot afford per page view.
        """
        def fn(conn: Connection) -> list[tuple[int, str, int, datetime | None, tuple[str, ...]]]:
            run_id = self.require_run(conn, run)
            c = CheckpointRow.c
            tags: dict[int, list[str]] = {}
            for step, name in conn.execute(select(c.step, Tag.c.name).join(Tag, Tag.c.checkpoint_id == c.id)
                                           .where(Tag.c.run_id == run_id).order_by(Tag.c.name)):
                tags.setdefault(step, []).append(name)
            rows = conn.execute(select(c.step, c.status, c.total_bytes, c.created_at)
                                .where(c.run_id == run_id).order_by(c.step))
            return [(r.step, str(r.status), int(r.total_bytes or 0), aware(r.created_at), tuple(tags.get(r.step, ())))
                    for r in rows]
        return self.read(fn)

    def metric_keys(self, run: str) -> list[str]:
        """The keys ``run`` has current metric points for, sorted: what a curve may be drawn of."""
        def fn(conn: Connection) -> list[str]:
            return list(conn.scalars(self._metric_key_query(self.require_run(conn, run))))
        return self.read(fn)

    def files(self, run: str, step: int) -> list[FileRecord]:
        def fn(conn: Connection) -> list[FileRecord]:
            run_id = self.require_run(conn, run)
            rows = conn.execute(select(CheckpointFile)
                                .join(CheckpointRow, CheckpointRow.c.id == CheckpointFile.c.checkpoint_id)
                                .where(CheckpointRow.c.run_id == run_id, CheckpointRow.c.step == step)
                                .order_by(CheckpointFile.c.name)).all()
            return [FileRecord(name=r.name, size=r.size, sha256=r.sha256) for r in rows]
        return self.read(fn)

    def events(self, run: str | None = None, *, step: int | None = None, limit: int = 1000) -> list[EventInfo]:
        def fn(conn: Connection) -> list[EventInfo]:
            query = select(Event, Run.c.name.label("run_name")).outerjoin(Run, Run.c.id == Event.c.run_id)
            if run is not None:
                query = query.where(Event.c.run_id == self.require_run(conn, run))
            if step is not None:
                query = query.where(Event.c.step == step)
            rows = conn.execute(query.order_by(Event.c.id.desc()).limit(limit)).all()
            return [EventInfo(id=e.id, run=e.run_name, step=e.step, kind=e.kind, detail=json.loads(e.detail),
                              actor=e.actor, created_at=aware(e.created_at)) for e in reversed(rows)]
        return self.read(fn)

    # ------------------------------------------------------------------ reader leases

    def acquire_lease(self, run: str, step: int, *, holder: str, ttl: timedelta) -> int | None:
        lease = self._take_lease(run, step, holder, ttl)
        if lease is None:
            self.read(lambda conn: self.require_run(conn, run))  # no such run says so; a step no longer live gets none
        return lease

    def release_lease(self, lease_id: int) -> None:
        driver = self._driver_leases
        if driver is None:
            self.write(lambda conn: conn.execute(_RELEASE_LEASE, {"lease": lease_id}), durable=False)
        else:
            self._transaction(lambda: driver[1].run({"lease": lease_id}))

    def lease_live(self, lease_id: int) -> bool:
        """Whether lease ``lease_id`` is still held and unexpired (a released one is gone)."""
        return bool(self.read(lambda conn: conn.scalar(
            select(Lease.c.id).where(Lease.c.id == lease_id, Lease.c.expires_at > utcnow()))))

    def leased_steps(self, run: str) -> set[int]:
        def fn(conn: Connection) -> set[int]:
            run_id = self.require_run(conn, run)
            return set(conn.scalars(select(CheckpointRow.c.step)
                                    .join(Lease, Lease.c.checkpoint_id == CheckpointRow.c.id)
                                    .where(CheckpointRow.c.run_id == run_id, Lease.c.expires_at > utcnow())))
        return self.read(fn)

    # ------------------------------------------------------------------ schema

    def revision(self) -> str | None:
        from registry.catalog.session import current_revision
        with self.engine.connect() as conn:
            return current_revision(conn)

    @staticmethod
    def head() -> str:
        return head_revision()


def _resolve_statement(ref: Ref, *, below: int | None = None,
                       min_policy_version: int | None = None) -> tuple[Any, dict[str, Any], str]:
    """The SELECT that resolves ``ref``, the values to bind to it, and what to say when it finds nothing."""
    query = _resolve_shape(ref.kind, ref.mode, below is not None, min_policy_version is not None)
    params = {"run": ref.run, "below": below, "min_policy_version": min_policy_version, "step": ref.step,
              "tag": ref.tag, "metric": ref.metric, "version": ref.version}
    if ref.kind in ("latest", "latest-published", "latest-durable", "latest-policy"):
        what = {"latest": "no verified checkpoint", "latest-published": "no published checkpoint",
                "latest-durable": "no checkpoint with a verified durable copy",
                "latest-policy": "no verified checkpoint with a policy version"}[ref.kind]
        if min_policy_version is not None:
            what += f" with policy version >= {min_policy_version}"
    elif ref.kind == "step":
        what = f"no checkpoint at step {ref.step}"
    elif ref.kind == "pv":
        what = f"no checkpoint with policy version {ref.version}"
    elif ref.kind == "tag":
        what = f"no tag {ref.tag!r}"
    else:
        what = f"no published or verified checkpoint has a current value of {ref.metric!r}"
    return query, {k: v for k, v in params.items() if v is not None}, what


@functools.cache
def _resolve_shape(kind: str, mode: str | None, below: bool, min_policy_version: bool) -> Any:
    """The resolve SELECT for one shape of ref, with its values as bind parameters.

    Built once per shape: a load resolves every time, and building the
    statement cost about as much as running it.
    """
    run_id = select(Run.c.id).where(Run.c.name == bindparam("run", type_=Run.c.name.type)).scalar_subquery()
    c = CheckpointRow.c
    query = select(CheckpointRow)
    if kind not in ("best", "tag"):  # those constrain the run through their join: one subquery
        query = query.where(c.run_id == run_id)
    if kind in ("latest", "latest-published", "latest-durable", "latest-policy"):
        # one status is an equality: an IN list is expanded anew at every execution
        query = query.where(c.status == Status.VERIFIED if kind in ("latest", "latest-policy") else c.status.in_(LIVE))
        if kind == "latest-durable":
            query = query.where(_durable_copy_exists(c))
        if kind == "latest-policy":
            query = query.where(c.policy_version.is_not(None))
        if below:
            query = query.where(c.step < bindparam("below", type_=c.step.type))
        if min_policy_version:
            query = query.where(c.policy_version >= bindparam("min_policy_version", type_=c.policy_version.type))
        return query.order_by(c.step.desc()).limit(1)
    if kind == "step":
        return query.where(c.step == bindparam("step", type_=c.step.type))
    if kind == "pv":  # the newest step with a payload that carries the version (a version names one set of weights)
        return (query.where(c.policy_version == bindparam("version", type_=c.policy_version.type),
                            c.status.in_(HAS_PAYLOAD)).order_by(c.step.desc()).limit(1))
    if kind == "tag":
        return (query.join(Tag, and_(Tag.c.checkpoint_id == c.id, Tag.c.run_id == c.run_id))
                .where(Tag.c.run_id == run_id, Tag.c.name == bindparam("tag", type_=Tag.c.name.type)))
    return ranked_by_metric(query, run_id, bindparam("metric", type_=Metric.c.key.type),
                            "max" if mode == "max" else "min")


def ranked_by_metric(query: Any, run_id: Any, metric: Any, mode: Literal["min", "max", "last"]) -> Any:
    """``query`` (a SELECT from ``checkpoints``, joined here to ``metrics``) narrowed to the one step that
    ``RUN@best:METRIC[:min|max]`` names: among the run's published or verified steps, the one whose current
    point of ``metric`` at its own step is lowest (``min``) or highest (``max``), ties to the newest step;
    ``last``: the newest such step. The resolver and the search of runs both rank by it."""
    c, m = CheckpointRow.c, Metric.c
    # ORDER BY the index's own columns (m.step, not c.step) so the
    # planner walks ix_metrics_best and stops at the first live step.
    order = {"min": (m.value.asc(), m.step.desc()), "max": (m.value.desc(), m.step.desc()),
             "last": (m.step.desc(),)}[mode]
    return (query.join(Metric, and_(m.run_id == c.run_id, m.step == c.step))
            .where(m.run_id == run_id, m.key == metric, m.superseded.is_(False), c.status.in_(RANKABLE))
            .order_by(*order).limit(1))


@functools.cache
def _lease_statement(dialect: str) -> Any:
    """One statement: the live row of a run (by name) and step, and a lease on it; no row, no lease.

    Built once: a load takes a lease every time, and building the statement cost more than running it.
    """
    live = (select(CheckpointRow.c.id, bindparam("holder", type_=Lease.c.holder.type),
                   bindparam("expires_at", type_=Lease.c.expires_at.type))
            .where(CheckpointRow.c.run_id == select(Run.c.id).where(Run.c.name == bindparam("run")).scalar_subquery(),
                   CheckpointRow.c.step == bindparam("step"), CheckpointRow.c.status.in_(LIVE)))
    if dialect == "postgresql":
        # FOR SHARE waits for a gc transaction that holds the row FOR UPDATE, then
        # re-checks the status: a step gc just deleted gets no lease (see catalog/retention.py).
        live = live.with_for_update(read=True, of=CheckpointRow)
    return insert(Lease).from_select(["checkpoint_id", "holder", "expires_at"], live).returning(Lease.c.id)


# one step's current metrics and its tags in one round trip (built once: resolve and get run it every time)
_METRICS_AND_TAGS: Any = union_all(
    select(literal_column("'m'").label("kind"), Metric.c.key.label("name"), Metric.c.value.label("value"),
           Metric.c.id.label("ord"))
    .where(Metric.c.run_id == bindparam("run_id"), Metric.c.step == bindparam("step"), Metric.c.superseded.is_(False)),
    select(literal_column("'t'"), Tag.c.name, literal_column("NULL"), literal_column("0"))
    .where(Tag.c.checkpoint_id == bindparam("checkpoint_id")))
_RELEASE_LEASE = delete(Lease).where(Lease.c.id == bindparam("lease"))


__all__ = ["Catalog", "NOTIFY_CHANNEL", "ranked_by_metric", "replace_files"]
