"""The catalog side of policy consumers: registration, batched heartbeats, leases of versions, lag.

A consumer (``policy_consumers``) is live while it is not ended and its
``expires_at`` (last heartbeat + ttl) is in the future. A load
(``policy_loads``) is one lease of one version by one consumer: of a verified
policy step, or of a marker (``step`` NULL: the version's bytes moved outside
the registry, so there is nothing to fetch, verify or keep). An unreleased
load of a live consumer, and the version a live consumer serves
(``applied_step``), keep their steps from retention: :func:`policy_holds`
answers that inside retention's marking transaction, and :meth:`lease` takes a
lease the way ``acquire_lease`` does (the step row ``FOR SHARE`` on
PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), so a lease and a deletion of the
same step never both commit.

Heartbeats of every subscription of a process arrive as one list and are
written as one ``UPDATE`` per distinct ttl in one transaction. Knows SQL and
nothing of files or torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, delete, func, insert, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from registry.catalog.models import CheckpointRow, PolicyConsumer, PolicyLoad, PolicyMarker, PolicyStep, Run
from registry.catalog.policy import anchored
from registry.catalog.queries import Catalog
from registry.catalog.session import aware, utcnow
from registry.errors import InvalidStateError, RegistryError
from registry.records import ConsumerInfo, LoadInfo, PolicyLag, PolicyVersionInfo, Status

APPLIED = "applied"  # the NOTIFY status an applied version sends: it wakes wait_lag, not followers of steps
MARKER = "marker"  # the NOTIFY status of a new marker: a version consumers lease

_PC = PolicyConsumer.c
_PL = PolicyLoad.c


@dataclass(frozen=True)
class LeaseRequest:
    """One consumer's lease of ``run@step``, or with ``step`` None of the marker ``version``, seen at
    ``notified_at``; ``release``: a load of its to release."""

    consumer_id: int
    run: str
    step: int | None
    notified_at: datetime
    release: int | None = None
    version: int | None = None  # a marker's version (``step`` None); a step's comes from its row

    def __post_init__(self) -> None:
        if self.step is None and self.version is None:
            raise InvalidStateError(f"a lease of {self.run} names a policy step or a marker's version")


@dataclass(frozen=True)
class LeasableVersion:
    """A policy version a consumer may lease: a verified policy step, or a marker (``step`` None)."""

    version: int
    step: int | None


def _live(now: datetime) -> Any:
    return and_(_PC.ended_at.is_(None), _PC.expires_at > now)


def _named(names: Sequence[str]) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def policy_holds(conn: Connection, run_id: int, now: datetime) -> dict[int, str]:
    """step -> why a live consumer keeps it: an unreleased lease, or the version it serves."""
    leased: dict[int, list[str]] = {}
    served: dict[int, list[str]] = {}
    # a marker's load (step NULL) holds no bytes: nothing to keep
    for step, name in conn.execute(select(_PL.step, _PC.name).join(PolicyConsumer, _PC.id == _PL.consumer_id)
                                   .where(_PL.run_id == run_id, _PL.released_at.is_(None), _PL.step.is_not(None),
                                          _live(now))
                                   .distinct().order_by(_PL.step, _PC.name)):
        leased.setdefault(int(step), []).append(name)
    for step, name in conn.execute(select(_PC.applied_step, _PC.name)
                                   .where(_PC.run_id == run_id, _PC.applied_step.is_not(None), _live(now))
                                   .order_by(_PC.applied_step, _PC.name)):
        served.setdefault(int(step), []).append(name)
    why: dict[int, str] = {}
    for step in sorted(set(leased) | set(served)):
        parts = ([f"leased by {_named(leased[step])}"] if step in leased else []) + \
                ([f"served by {_named(served[step])}"] if step in served else [])
        why[step] = "; ".join(parts)
    return why


def _next_version(conn: Connection, run_id: int, after: int | None, *, newest: bool) -> LeasableVersion | None:
    """The run's first policy version above ``after`` (with ``newest``: its newest): a verified step's (the
    newest step of that version) or a marker's. A step and a marker of one version: the step, whose bytes
    the registry has."""
    c, m = CheckpointRow.c, PolicyMarker.c
    steps = select(c.policy_version, c.step).where(c.run_id == run_id, c.status == Status.VERIFIED,
                                                   c.policy_version.is_not(None))
    markers = select((func.max if newest else func.min)(m.version)).where(m.run_id == run_id)
    if after is not None:
        steps = steps.where(c.policy_version > after)
        markers = markers.where(m.version > after)
    row = conn.execute(steps.order_by(c.policy_version.desc() if newest else c.policy_version.asc(),
                                      c.step.desc()).limit(1)).first()
    marker = conn.scalar(markers)
    step = None if row is None else LeasableVersion(version=int(row.policy_version), step=int(row.step))
    if marker is not None and (step is None or (marker > step.version if newest else marker < step.version)):
        return LeasableVersion(version=int(marker), step=None)
    return step


def newest_policy_step(conn: Connection, run_id: int) -> int | None:
    """The verified step with the newest policy version (``@latest-policy``), or None."""
    c = CheckpointRow.c
    step = conn.scalar(select(c.step).where(c.run_id == run_id, c.status == Status.VERIFIED,
                                            c.policy_version.is_not(None))
                       .order_by(c.policy_version.desc(), c.step.desc()).limit(1))
    return None if step is None else int(step)


class ConsumersCatalog:
    """The consumers' queries, run through a :class:`Catalog`'s transactions."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    # ------------------------------------------------------------------ registration and heartbeats

    def register(self, run: str, name: str, *, host: str, pid: int | None, ttl: float) -> int:
        """Register (or revive) consumer ``name`` of ``run``; its id. Creates the run: a consumer may start
        before its trainer. Reviving ends the earlier incarnation's leases and what it served: a new process
        serves nothing yet."""
        def fn(conn: Connection) -> int:
            run_id = Catalog.lookup_run(conn, run, create=True)
            now = utcnow()
            values = {"run_id": run_id, "name": name, "host": host, "pid": pid, "ttl": ttl, "registered_at": now,
                      "heartbeat_at": now, "expires_at": now + timedelta(seconds=ttl), "ended_at": None,
                      "applied_version": None, "applied_step": None, "applied_at": None}
            dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
            stmt = dialect.insert(PolicyConsumer).values(**values)
            conn.execute(stmt.on_conflict_do_update(
                index_elements=[_PC.run_id, _PC.name],
                set_={k: getattr(stmt.excluded, k) for k in values if k not in ("run_id", "name")}))
            cid: int = conn.execute(select(_PC.id).where(_PC.run_id == run_id, _PC.name == name)).scalar_one()
            conn.execute(update(PolicyLoad).where(_PL.consumer_id == cid, _PL.released_at.is_(None))
                         .values(released_at=now))
            return cid
        result: int = self.catalog.write(fn)
        return result

    def heartbeat(self, beats: Iterable[tuple[int, float]]) -> None:
        """Extend every ``(consumer_id, ttl)`` of ``beats`` from now, one ``UPDATE`` per ttl, one transaction.

        An expired consumer that beats again is live again; an ended one stays ended. A heartbeat outlives no
        power loss (nor does its process), so on SQLite its commit skips the WAL fsync."""
        by_ttl: dict[float, list[int]] = {}
        for cid, ttl in beats:
            by_ttl.setdefault(float(ttl), []).append(cid)
        if not by_ttl:
            return

        def fn(conn: Connection) -> None:
            now = utcnow()
            for ttl, ids in by_ttl.items():
                conn.execute(update(PolicyConsumer).where(_PC.id.in_(ids), _PC.ended_at.is_(None))
                             .values(heartbeat_at=now, expires_at=now + timedelta(seconds=ttl)))
        self.catalog.write(fn, durable=False)

    def end(self, consumer_id: int) -> None:
        """The consumer is gone: ``ended_at``, and its open leases released (what it served stays recorded)."""
        def fn(conn: Connection) -> None:
            now = utcnow()
            conn.execute(update(PolicyConsumer).where(_PC.id == consumer_id, _PC.ended_at.is_(None))
                         .values(ended_at=now))
            conn.execute(update(PolicyLoad).where(_PL.consumer_id == consumer_id, _PL.released_at.is_(None))
                         .values(released_at=now))
        self.catalog.write(fn)

    def wake(self, run: str) -> None:
        """Wake the run's waiting consumers now (PostgreSQL; on SQLite they poll) after a marker committed:
        ``registry.catalog.policy`` records it below the catalog's notifications. A wake lost to a crash
        in between costs only a consumer's slow re-poll."""
        if self.catalog.dialect != "postgresql":
            return

        def fn(conn: Connection) -> None:
            run_id = self.catalog.lookup_run(conn, run)
            if run_id is not None:
                Catalog.notify(conn, run_id, None, MARKER)
        self.catalog.write(fn, durable=False)

    # ------------------------------------------------------------------ leases

    def next_version(self, run: str, after: int | None, *, newest: bool = False) -> LeasableVersion | None:
        """``run``'s first policy version above version ``after`` (None: any), or with ``newest`` its newest:
        a verified policy step or a marker, whichever has that version (a step, when both). None when there
        is none yet, also when the run does not exist yet."""
        def fn(conn: Connection) -> LeasableVersion | None:
            run_id = self.catalog.lookup_run(conn, run)
            return None if run_id is None else _next_version(conn, run_id, after, newest=newest)
        result: LeasableVersion | None = self.catalog.read(fn)
        return result

    def lease(self, consumer_id: int, run: str, step: int | None, *, notified_at: datetime,
              release: int | None = None, version: int | None = None) -> LoadInfo | None:
        """A load of ``run@step``'s policy version (with ``step`` None: of the marker ``version``) by the
        consumer; None when the step is no longer a verified policy step (deleted or condemned since it was
        seen) or the marker is gone. ``InvalidStateError`` for an ended consumer. ``release``: a load of the
        consumer's to release in the same transaction (one it skipped)."""
        (outcome,) = self.lease_many([LeaseRequest(consumer_id, run, step, notified_at, release, version)])
        if isinstance(outcome, RegistryError):
            raise outcome
        return outcome

    def lease_many(self, requests: Sequence[LeaseRequest]) -> list[LoadInfo | None | RegistryError]:
        """Every request's lease in one transaction (a process's consumers that saw the same version at once):
        each request's load, None (the step is gone) or the error refusing it (an ended consumer)."""
        def fn(conn: Connection) -> list[LoadInfo | None | RegistryError]:
            c, m = CheckpointRow.c, PolicyMarker.c
            # (run, step, marker version) -> (run_id, version, committed_at), or None when it is gone
            found: dict[tuple[str, int, int], tuple[int, int, datetime | None] | None] = {}
            for run, step, version in sorted({_target(r) for r in requests}):
                run_id = self.catalog.require_run(conn, run)
                if step >= 0:
                    query = select(c.run_id, c.policy_version, c.verified_at, c.published_at).where(
                        c.run_id == run_id, c.step == step, c.status == Status.VERIFIED,
                        c.policy_version.is_not(None))
                    if conn.dialect.name == "postgresql":
                        query = query.with_for_update(read=True)  # against retention's FOR UPDATE: see the module doc
                    row = conn.execute(query).first()
                    found[(run, step, version)] = None if row is None else (
                        row.run_id, int(row.policy_version), aware(row.verified_at) or aware(row.published_at))
                else:  # a marker: no bytes, so nothing retention could delete under it
                    made = conn.scalar(select(m.created_at).where(m.run_id == run_id, m.version == version))
                    found[(run, step, version)] = None if made is None else (run_id, version, aware(made))
            consumers = {r.id: r for r in conn.execute(select(_PC.id, _PC.name, _PC.host, _PC.ended_at).where(
                _PC.id.in_(sorted({r.consumer_id for r in requests}))))}
            now = utcnow()
            outcomes: list[LoadInfo | None | RegistryError] = []
            rows: list[dict[str, Any]] = []
            for r in requests:
                consumer, target = consumers.get(r.consumer_id), found[_target(r)]
                if consumer is None or consumer.ended_at is not None:
                    outcomes.append(InvalidStateError(f"policy consumer of {r.run} has ended (closed, or "
                                                      "subscribed again elsewhere): subscribe again"))
                    continue
                if target is None:
                    outcomes.append(None)
                    continue
                run_id, version, committed = target
                rows.append({"consumer_id": r.consumer_id, "run_id": run_id, "version": version,
                             "step": r.step, "bytes_fetched": 0, "verified": False, "committed_at": committed,
                             "notified_at": r.notified_at, "leased_at": now})
                outcomes.append(LoadInfo(id=0, run=r.run, consumer=consumer.name, host=consumer.host,
                                         version=version, step=r.step, source=None, bytes_fetched=0,
                                         verified=False, error=None, committed_at=committed,
                                         notified_at=r.notified_at, leased_at=now, fetched_at=None,
                                         verified_at=None, applied_at=None, released_at=None))
            if rows:
                ids = iter(conn.scalars(insert(PolicyLoad).returning(_PL.id, sort_by_parameter_order=True), rows)
                           .all())
                outcomes = [replace(o, id=int(next(ids))) if isinstance(o, LoadInfo) else o for o in outcomes]
            released = sorted({r.release for r in requests if r.release is not None})
            if released:
                conn.execute(update(PolicyLoad).where(_PL.id.in_(released), _PL.released_at.is_(None))
                             .values(released_at=now))
            return outcomes
        result: list[LoadInfo | None | RegistryError] = self.catalog.write(fn, durable=False)
        return result

    def fetched(self, load_id: int, *, source: str | None, bytes_fetched: int, fetched_at: datetime | None,
                verified: bool, error: str | None) -> None:
        """Record how a load's bytes arrived: from where, how many, and whether they verified."""
        def fn(conn: Connection) -> None:
            conn.execute(update(PolicyLoad).where(_PL.id == load_id).values(
                source=source, bytes_fetched=bytes_fetched, fetched_at=fetched_at, verified=verified,
                verified_at=utcnow() if verified else None, error=error))
        self.catalog.write(fn, durable=False)

    def applied(self, load_id: int) -> None:
        """The consumer now serves this load's version: recorded on the load and the consumer, and the
        consumer's leases of older versions released. Refused for a load that did not verify or was released.

        A marker's load (``step`` NULL) is applied without a check (``verified`` stays False): the registry
        never had its bytes, so verifying them is the engine's business. The consumer then serves the
        version with ``applied_step`` NULL: lag counts it, retention keeps no step for it."""
        def fn(conn: Connection) -> None:
            load = conn.execute(select(PolicyLoad, Run.c.name.label("run_name"))
                                .join(Run, Run.c.id == _PL.run_id).where(_PL.id == load_id)).one_or_none()
            if load is None:  # pruned (its consumer had expired or ended long ago) or its run deleted
                raise InvalidStateError(f"policy load {load_id} is no longer on record; lease the version again "
                                        "to apply it")
            what = f"{load.run_name} policy version {load.version} " + \
                ("(marker)" if load.step is None else f"(step {load.step})")
            if load.step is not None and not load.verified:
                why = f": {load.error}" if load.error else " (materialize it first)"
                raise InvalidStateError(f"{what} did not verify{why}; not applied")
            if load.released_at is not None:
                raise InvalidStateError(f"{what}: its lease was released; lease it again to apply it")
            now = utcnow()
            conn.execute(update(PolicyLoad).where(_PL.id == load_id).values(applied_at=now))
            conn.execute(update(PolicyConsumer).where(_PC.id == load.consumer_id).values(
                applied_version=load.version, applied_step=load.step, applied_at=now))
            conn.execute(update(PolicyLoad).where(_PL.consumer_id == load.consumer_id, _PL.version < load.version,
                                                  _PL.released_at.is_(None)).values(released_at=now))
            Catalog.notify(conn, load.run_id, load.step, APPLIED)
        self.catalog.write(fn)

    def release(self, load_id: int) -> None:
        """The consumer holds this load no more (what it serves is kept by ``applied_step`` alone)."""
        def fn(conn: Connection) -> None:
            conn.execute(update(PolicyLoad).where(_PL.id == load_id, _PL.released_at.is_(None))
                         .values(released_at=utcnow()))
        self.catalog.write(fn, durable=False)

    def host_floor(self, run: str, host: str) -> int | None:
        """The oldest version a live consumer on ``host`` leases (unreleased) or serves; None when none does.
        A host's copies of older versions are no one's any more."""
        def fn(conn: Connection) -> int | None:
            run_id = self.catalog.lookup_run(conn, run)
            if run_id is None:
                return None
            now = utcnow()
            mine = and_(_PC.run_id == run_id, _PC.host == host, _live(now))
            leased = conn.scalar(select(func.min(_PL.version)).join(PolicyConsumer, _PC.id == _PL.consumer_id)
                                 .where(mine, _PL.released_at.is_(None)))
            served = conn.scalar(select(func.min(_PC.applied_version)).where(mine))
            held = [int(v) for v in (leased, served) if v is not None]
            return min(held) if held else None
        result: int | None = self.catalog.read(fn)
        return result

    def prune_loads(self, run: str | None, *, before: datetime) -> int:
        """Forget the loads (of ``run``, or of every run) that protect nothing any more and ended before
        ``before``: released then, or of a consumer that ended or expired then. Never an unreleased load of a
        live consumer (it keeps its version from retention), nor the load of the version a consumer serves
        (``applied_version``: what ``policy who`` answers). How many were forgotten."""
        def fn(conn: Connection) -> int:
            now = utcnow()
            consumer = select(PolicyConsumer).where(_PC.id == _PL.consumer_id)
            gone = consumer.where(~_live(now), func.coalesce(_PC.ended_at, _PC.expires_at) < before).exists()
            serving = consumer.where(_PC.applied_version == _PL.version, _PL.applied_at.is_not(None)).exists()
            old = and_(_PL.released_at.is_not(None), _PL.released_at < before)
            where = [or_(old, gone), ~serving]
            if run is not None:
                run_id = self.catalog.lookup_run(conn, run)
                if run_id is None:
                    return 0
                where.append(_PL.run_id == run_id)
            keep_live = consumer.where(_live(now)).exists()
            where.append(or_(_PL.released_at.is_not(None), ~keep_live))
            return int(conn.execute(delete(PolicyLoad).where(*where)).rowcount)
        result: int = self.catalog.write(fn)
        return result

    # ------------------------------------------------------------------ what the catalog says

    def lag(self, run: str) -> PolicyLag:
        """The run's newest verified policy version against what its live consumers serve."""
        def fn(conn: Connection) -> PolicyLag:
            run_id = self.catalog.require_run(conn, run)
            now = utcnow()
            newest = _next_version(conn, run_id, None, newest=True)  # what a consumer's newest lease is of
            version, step = (None, None) if newest is None else (newest.version, newest.step)
            rows = conn.execute(select(PolicyConsumer).where(_PC.run_id == run_id).order_by(_PC.name)).all()
            consumers = tuple(_consumer(run, r, now, version) for r in rows)
            live = [x for x in consumers if x.live]
            applied = [x.applied_version for x in live if x.applied_version is not None]
            oldest = min(applied, default=None)
            lag = max(0, version - oldest) if version is not None and oldest is not None else 0
            return PolicyLag(run=run, newest_version=version, newest_step=step, oldest_applied=oldest, lag=lag,
                             pending=tuple(x.name for x in live if x.applied_version is None),
                             consumers=consumers, taken_at=now)
        result: PolicyLag = self.catalog.read(fn)
        return result

    def loads(self, run: str, *, policy_version: int | None = None) -> list[LoadInfo]:
        """Every load of ``run`` (of one version), oldest first, with its consumer."""
        def fn(conn: Connection) -> list[LoadInfo]:
            run_id = self.catalog.require_run(conn, run)
            query = (select(PolicyLoad, _PC.name.label("consumer_name"), _PC.host.label("consumer_host"))
                     .join(PolicyConsumer, _PC.id == _PL.consumer_id).where(_PL.run_id == run_id))
            if policy_version is not None:
                query = query.where(_PL.version == policy_version)
            return [_load(run, r) for r in conn.execute(query.order_by(_PL.id))]
        result: list[LoadInfo] = self.catalog.read(fn)
        return result

    def versions(self, run: str) -> list[PolicyVersionInfo]:
        """Every policy version of ``run``: its steps (not failed ones) and its markers, by version."""
        def fn(conn: Connection) -> list[PolicyVersionInfo]:
            run_id = self.catalog.require_run(conn, run)
            c, p = CheckpointRow.c, PolicyStep.c
            rows = conn.execute(select(c.step, c.policy_version, c.status, c.total_bytes, c.created_at, p.kind,
                                       p.base_step, anchored(run_id).label("anchored"))
                                .outerjoin(PolicyStep, p.checkpoint_id == c.id)
                                .where(c.run_id == run_id, c.policy_version.is_not(None),
                                       c.status != Status.FAILED)).all()
            found = [PolicyVersionInfo(run=run, version=int(r.policy_version), step=int(r.step),
                                       kind=r.kind or "full", base_step=r.base_step, total_bytes=int(r.total_bytes),
                                       status=str(r.status), created_at=aware(r.created_at),
                                       anchored=bool(r.anchored)) for r in rows]
            m = PolicyMarker.c
            found += [PolicyVersionInfo(run=run, version=int(r.version), step=None, kind="marker", base_step=None,
                                        total_bytes=0, status="marker", created_at=aware(r.created_at))
                      for r in conn.execute(select(m.version, m.created_at).where(m.run_id == run_id))]
            return sorted(found, key=lambda v: (v.version, -1 if v.step is None else v.step))
        result: list[PolicyVersionInfo] = self.catalog.read(fn)
        return result


def _target(r: LeaseRequest) -> tuple[str, int, int]:
    """What a request leases, sortable (the order its rows are locked in): (run, step, -1) for a step,
    (run, -1, version) for a marker."""
    return (r.run, r.step, -1) if r.step is not None else (r.run, -1, -1 if r.version is None else r.version)


def _consumer(run: str, r: Any, now: datetime, newest: int | None) -> ConsumerInfo:
    expires = aware(r.expires_at)
    live = r.ended_at is None and expires is not None and expires > now
    lag = None if newest is None or r.applied_version is None else max(0, newest - int(r.applied_version))
    return ConsumerInfo(run=run, name=r.name, host=r.host, pid=r.pid, ttl=float(r.ttl),
                        registered_at=aware(r.registered_at), heartbeat_at=aware(r.heartbeat_at),  # type: ignore[arg-type]
                        expires_at=expires, ended_at=aware(r.ended_at), live=live,  # type: ignore[arg-type]
                        applied_version=r.applied_version, applied_step=r.applied_step,
                        applied_at=aware(r.applied_at), lag=lag)


def _load(run: str, r: Any) -> LoadInfo:
    return LoadInfo(id=r.id, run=run, consumer=r.consumer_name, host=r.consumer_host, version=r.version,
                    step=r.step, source=r.source, bytes_fetched=r.bytes_fetched, verified=bool(r.verified),
                    error=r.error, committed_at=aware(r.committed_at), notified_at=aware(r.notified_at),
                    leased_at=aware(r.leased_at), fetched_at=aware(r.fetched_at),  # type: ignore[arg-type]
                    verified_at=aware(r.verified_at), applied_at=aware(r.applied_at),
                    released_at=aware(r.released_at))


__all__ = ["APPLIED", "ConsumersCatalog", "LeasableVersion", "LeaseRequest", "newest_policy_step", "policy_holds"]
