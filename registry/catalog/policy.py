"""The policy channel's catalog side: how each policy step is stored, its delta chain, markers and folds.

A step that carries a policy version gets one ``policy_steps`` row in the
transaction that commits it (:func:`record_policy_step`, called from
:meth:`Catalog.commit_publish`): ``full`` (its own ``model.safetensors``) or
``delta`` (a ``delta.safetensors`` against ``base_step``), and the
``full_sha256`` every reconstruction is checked against. A reader rebuilds a
delta step from its chain (:func:`chain_steps`, full first); retention keeps
every base of a kept delta (:func:`delta_bases`). A fold from a step to
itself is that step's *anchor*: its version stored whole (the very
``model.safetensors`` a full publish writes), so the step reads without its
chain and no longer keeps its bases.

Knows SQL and nothing of torch or files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, delete, insert, or_, select, text, update

from registry.catalog.models import CheckpointRow, PolicyFold, PolicyMarker, PolicyStep, Run
from registry.catalog.records import PolicyRecord
from registry.catalog.session import Transactions, aware, utcnow
from registry.errors import CheckpointNotFoundError, PolicyVersionConflictError
from registry.records import HAS_PAYLOAD, Status

# a chain longer than this is a loop in rows written by hand, not a chain a publish made
MAX_CHAIN = 100_000


@dataclass(frozen=True, kw_only=True)
class PolicyStepInfo:
    """One policy step as the catalog knows it."""

    run: str
    step: int
    version: int | None
    status: str
    kind: str
    full_sha256: str
    base_step: int | None = None
    manifest_sha256: str | None = None


@dataclass(frozen=True, kw_only=True)
class MarkerInfo:
    run: str
    version: int
    full_sha256: str | None
    note: str | None
    writer: str | None
    created_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class FoldRecord:
    run: str
    from_step: int
    to_step: int
    path: str
    size: int
    sha256: str
    status: str
    created_at: datetime | None
    piece_size: int | None = None  # with xxh3_128_pieces: the digests of its bytes' pieces, checked on every core
    xxh3_128_pieces: tuple[str, ...] | None = None  # None (a row from before they were recorded): sha256 alone

    @property
    def anchor(self) -> bool:
        """A fold from a step to itself: the step's version stored whole (see the module's docstring)."""
        return self.from_step == self.to_step

    def pieces_json(self) -> str | None:
        if self.piece_size is None or self.xxh3_128_pieces is None:
            return None
        return json.dumps({"piece_size": self.piece_size, "xxh3_128": list(self.xxh3_128_pieces)})


def _fold_of(r: Any, run: str) -> FoldRecord:
    """A ``policy_folds`` row as a record; pieces that do not parse are no pieces (its sha256 still checks it)."""
    piece_size, pieces = None, None
    try:
        parsed = json.loads(r.pieces) if r.pieces else {}
        size, digests = (parsed.get("piece_size"), parsed.get("xxh3_128")) if isinstance(parsed, dict) else (0, 0)
        if (isinstance(size, int) and not isinstance(size, bool) and size > 0 and isinstance(digests, list)
                and all(isinstance(d, str) for d in digests)):
            piece_size, pieces = size, tuple(digests)
    except ValueError:
        pass
    return FoldRecord(run=run, from_step=int(r.from_step), to_step=int(r.to_step), path=r.path, size=int(r.size),
                      sha256=r.sha256, status=str(r.status), created_at=aware(r.created_at), piece_size=piece_size,
                      xxh3_128_pieces=pieces)


# The chain from a step back to its full: each delta's base, by checkpoint id, until a step that is not a delta
# (a full, or a step with no policy row). ``depth`` bounds a loop among rows written by hand.
_CHAIN = text("""
WITH RECURSIVE chain(depth, cid) AS (
    SELECT 0, c.id FROM checkpoints c JOIN runs r ON r.id = c.run_id WHERE r.name = :run AND c.step = :step
    UNION ALL
    SELECT chain.depth + 1, p.base_checkpoint_id FROM chain JOIN policy_steps p ON p.checkpoint_id = chain.cid
    WHERE p.kind = 'delta' AND p.base_checkpoint_id IS NOT NULL AND chain.depth < :limit
)
SELECT chain.depth, c.step FROM chain JOIN checkpoints c ON c.id = chain.cid ORDER BY chain.depth DESC
""")


def _chain_in(conn: Connection, run: str, step: int) -> list[int]:
    steps = [int(r.step) for r in conn.execute(_CHAIN, {"run": run, "step": step, "limit": MAX_CHAIN})]
    if not steps:
        raise CheckpointNotFoundError(f"{run}@{step}: no checkpoint at step {step}", run=run, step=step)
    return steps


def chain_steps(conn_or_catalog: Connection | Transactions, run: str, step: int) -> list[int]:
    """The steps a reader needs to rebuild ``run@step``: its full first, then each delta in order, ending at
    ``step`` (``[step]`` for a full, or a step that carries no policy version).

    ``conn_or_catalog``: a connection (inside the caller's transaction) or a
    catalog (one read transaction). ``CheckpointNotFoundError`` when the step
    has no row.
    """
    if isinstance(conn_or_catalog, Connection):
        return _chain_in(conn_or_catalog, run, step)
    result: list[int] = conn_or_catalog.read(lambda conn: _chain_in(conn, run, step))
    return result


# ---------------------------------------------------------------------------------------------------- steps


def record_policy_step(conn: Connection, *, checkpoint_id: int, run_id: int, record: PolicyRecord | None) -> None:
    """Make ``record`` the step's policy row, inside its commit transaction (None: the step has none).

    With ``record.immutable`` another live or corrupt step of the run that
    carries the same version with other weights refuses the commit
    (``PolicyVersionConflictError``): two publishers racing for one version
    cannot both commit different weights under it.
    """
    conn.execute(delete(PolicyStep).where(PolicyStep.c.checkpoint_id == checkpoint_id))
    if record is None:
        return
    c, p = CheckpointRow.c, PolicyStep.c
    if record.immutable:
        version = conn.scalar(select(c.policy_version).where(c.id == checkpoint_id))
        other = conn.execute(select(c.step, p.full_sha256).join(PolicyStep, p.checkpoint_id == c.id)
                             .where(c.run_id == run_id, c.policy_version == version, c.id != checkpoint_id,
                                    c.status.in_(HAS_PAYLOAD), p.full_sha256 != record.full_sha256)
                             .limit(1)).first()
        if version is not None and other is not None:
            raise PolicyVersionConflictError(
                f"policy version {version} is already step {other.step} of this run, with other weights "
                f"({other.full_sha256[:12]}, not {record.full_sha256[:12]}); a version names one set of weights")
    base_id, base_step = None, record.base_step
    if base_step is not None:
        base_id = conn.scalar(select(c.id).where(c.run_id == run_id, c.step == base_step))
    elif record.base_sha256 is not None:
        found = _step_with_digest(conn, run_id, checkpoint_id, record.base_sha256)
        if found is not None:
            base_id, base_step = found
    conn.execute(insert(PolicyStep).values(checkpoint_id=checkpoint_id, kind=record.kind, base_checkpoint_id=base_id,
                                           base_step=base_step, full_sha256=record.full_sha256))


def _step_with_digest(conn: Connection, run_id: int, checkpoint_id: int, digest: str) -> tuple[int, int] | None:
    """The newest step of the run below ``checkpoint_id``'s with a payload whose version's ``full_sha256`` is
    ``digest`` (a repair naming a delta's base by digest), as (checkpoint id, step); None when none is."""
    c, p = CheckpointRow.c, PolicyStep.c
    below = select(c.step).where(c.id == checkpoint_id).scalar_subquery()
    row = conn.execute(select(c.id, c.step).join(PolicyStep, p.checkpoint_id == c.id)
                       .where(c.run_id == run_id, c.step < below, c.status.in_(HAS_PAYLOAD), p.full_sha256 == digest)
                       .order_by(c.step.desc()).limit(1)).first()
    return (int(row.id), int(row.step)) if row is not None else None


_STEP_COLUMNS = (Run.c.name.label("run"), CheckpointRow.c.step, CheckpointRow.c.policy_version,
                 CheckpointRow.c.status, CheckpointRow.c.manifest_sha256, PolicyStep.c.kind, PolicyStep.c.base_step,
                 PolicyStep.c.full_sha256)


def _info(row: Any) -> PolicyStepInfo:
    return PolicyStepInfo(run=row.run, step=int(row.step), version=row.policy_version, status=str(row.status),
                          kind=row.kind, full_sha256=row.full_sha256,
                          base_step=int(row.base_step) if row.base_step is not None else None,
                          manifest_sha256=row.manifest_sha256)


def _steps_query() -> Any:
    return (select(*_STEP_COLUMNS).join(Run, Run.c.id == CheckpointRow.c.run_id)
            .join(PolicyStep, PolicyStep.c.checkpoint_id == CheckpointRow.c.id))


def policy_steps(catalog: Transactions, run: str, steps: Sequence[int] | None = None) -> dict[int, PolicyStepInfo]:
    """The policy rows of ``run``'s steps (all of them, or those in ``steps``), by step."""
    def fn(conn: Connection) -> dict[int, PolicyStepInfo]:
        query = _steps_query().where(Run.c.name == run)
        if steps is not None:
            query = query.where(CheckpointRow.c.step.in_(sorted(set(steps))))
        return {int(r.step): _info(r) for r in conn.execute(query.order_by(CheckpointRow.c.step))}
    result: dict[int, PolicyStepInfo] = catalog.read(fn)
    return result


def version_step(catalog: Transactions, run: str, version: int) -> PolicyStepInfo | None:
    """The newest step of ``run`` with a payload (published, verified or corrupt) that carries policy version
    ``version`` and has a policy row; None when there is none."""
    def fn(conn: Connection) -> PolicyStepInfo | None:
        c = CheckpointRow.c
        row = conn.execute(_steps_query().where(Run.c.name == run, c.policy_version == version,
                                                c.status.in_(HAS_PAYLOAD))
                           .order_by(c.step.desc()).limit(1)).first()
        return _info(row) if row is not None else None
    result: PolicyStepInfo | None = catalog.read(fn)
    return result


def newest_base(catalog: Transactions, run: str, *, below: int | None = None) -> tuple[PolicyStepInfo, int] | None:
    """The run's newest verified policy step (below step ``below`` if given) that a delta may be made against,
    and the length of its chain (1 for a full); None when there is none."""
    def fn(conn: Connection) -> tuple[PolicyStepInfo, int] | None:
        c = CheckpointRow.c
        query = _steps_query().where(Run.c.name == run, c.status == Status.VERIFIED, c.policy_version.is_not(None))
        if below is not None:
            query = query.where(c.step < below)
        row = conn.execute(query.order_by(c.step.desc()).limit(1)).first()
        if row is None:
            return None
        return _info(row), len(_chain_in(conn, run, int(row.step)))
    result: tuple[PolicyStepInfo, int] | None = catalog.read(fn)
    return result


def anchored(run_id: int) -> Any:
    """The condition that the checkpoint row of the run ``run_id`` in the query has a verified anchor."""
    c, f = CheckpointRow.c, PolicyFold.c
    return select(f.id).where(f.run_id == run_id, f.from_step == c.step, f.to_step == c.step,
                              f.status == "verified").exists()


def delta_bases(conn: Connection, run_id: int) -> dict[int, int]:
    """step -> the step its delta is made against, for every delta step of the run that still has a payload and
    no verified anchor: what retention keeps whole (a kept delta step keeps its base, transitively; an anchored
    one reads without it)."""
    c, p = CheckpointRow.c, PolicyStep.c
    rows = conn.execute(select(c.step, p.base_step).join(PolicyStep, p.checkpoint_id == c.id)
                        .where(c.run_id == run_id, p.kind == "delta", p.base_step.is_not(None),
                               c.status.in_(HAS_PAYLOAD), ~anchored(run_id)))
    return {int(r.step): int(r.base_step) for r in rows}


# ---------------------------------------------------------------------------------------------------- markers


def add_marker(catalog: Transactions, run: str, version: int, *, note: str | None, writer: str | None,
               full_sha256: str | None = None) -> MarkerInfo:
    """Record that ``version`` of ``run`` was published outside the registry (its bytes moved elsewhere).

    Refused (``PolicyVersionConflictError``) when the version is a stored step
    of the run; marking the same version again replaces its note.
    """
    def fn(conn: Connection) -> MarkerInfo:
        run_id = conn.scalar(select(Run.c.id).where(Run.c.name == run))
        if run_id is None:
            conn.execute(insert(Run).values(name=run, created_at=utcnow()))
            run_id = conn.scalar(select(Run.c.id).where(Run.c.name == run))
        c = CheckpointRow.c
        stored = conn.scalar(select(c.step).where(c.run_id == run_id, c.policy_version == version,
                                                  c.status.in_(HAS_PAYLOAD)).limit(1))
        if stored is not None:
            raise PolicyVersionConflictError(f"policy version {version} of {run!r} is stored as step {stored}; "
                                             "a marker records only a version whose bytes live elsewhere")
        now = utcnow()
        m = PolicyMarker.c
        conn.execute(delete(PolicyMarker).where(m.run_id == run_id, m.version == version))
        conn.execute(insert(PolicyMarker).values(run_id=run_id, version=version, full_sha256=full_sha256, note=note,
                                                 writer=writer, created_at=now))
        return MarkerInfo(run=run, version=version, full_sha256=full_sha256, note=note, writer=writer, created_at=now)
    result: MarkerInfo = catalog.write(fn)
    return result


def markers(catalog: Transactions, run: str) -> list[MarkerInfo]:
    """The run's markers, by version."""
    def fn(conn: Connection) -> list[MarkerInfo]:
        m = PolicyMarker.c
        rows = conn.execute(select(PolicyMarker).join(Run, Run.c.id == m.run_id).where(Run.c.name == run)
                            .order_by(m.version))
        return [MarkerInfo(run=run, version=int(r.version), full_sha256=r.full_sha256, note=r.note, writer=r.writer,
                           created_at=aware(r.created_at)) for r in rows]
    result: list[MarkerInfo] = catalog.read(fn)
    return result


# ---------------------------------------------------------------------------------------------------- folds


def record_fold(catalog: Transactions, fold: FoldRecord) -> None:
    """Record a fold's stored file (replacing an earlier record of the same pair of steps).

    ``CheckpointNotFoundError`` when either end no longer has a payload: a
    deletion that committed first ended the fold's steps, and a fold recorded
    after it would outlive them. The ends are read ``FOR SHARE`` on
    PostgreSQL against retention's ``FOR UPDATE`` (SQLite serialises writes).
    """
    def fn(conn: Connection) -> None:
        run_id = conn.scalar(select(Run.c.id).where(Run.c.name == fold.run))
        if run_id is None:
            raise CheckpointNotFoundError(f"no run named {fold.run!r}", run=fold.run)
        c = CheckpointRow.c
        ends = select(c.step).where(c.run_id == run_id, c.step.in_((fold.from_step, fold.to_step)),
                                    c.status.in_(HAS_PAYLOAD))
        if conn.dialect.name == "postgresql":
            ends = ends.with_for_update(read=True)
        if len(set(conn.scalars(ends))) < len({fold.from_step, fold.to_step}):
            raise CheckpointNotFoundError(f"{fold.run}: step {fold.from_step} or {fold.to_step} was deleted while "
                                          "being folded; nothing was recorded", run=fold.run)
        f = PolicyFold.c
        values = dict(path=fold.path, size=fold.size, sha256=fold.sha256, pieces=fold.pieces_json(),
                      status=fold.status, created_at=utcnow())
        changed = conn.execute(update(PolicyFold).where(f.run_id == run_id, f.from_step == fold.from_step,
                                                        f.to_step == fold.to_step).values(**values)).rowcount
        if not changed:
            conn.execute(insert(PolicyFold).values(run_id=run_id, from_step=fold.from_step, to_step=fold.to_step,
                                                   **values))
    catalog.write(fn)


def folds(catalog: Transactions, run: str) -> list[FoldRecord]:
    """The run's recorded folds, by their steps."""
    def fn(conn: Connection) -> list[FoldRecord]:
        f = PolicyFold.c
        rows = conn.execute(select(PolicyFold).join(Run, Run.c.id == f.run_id).where(Run.c.name == run)
                            .order_by(f.from_step, f.to_step))
        return [_fold_of(r, run) for r in rows]
    result: list[FoldRecord] = catalog.read(fn)
    return result


def end_folds(conn: Connection, run_id: int, steps: Sequence[int]) -> list[FoldRecord]:
    """Mark ``deleted`` every fold of the run that starts or ends at one of ``steps`` (steps being deleted, inside
    the transaction that marks them): a fold is usable only while both its ends are. The folds as they were."""
    if not steps:
        return []
    f = PolicyFold.c
    touching = (f.run_id == run_id, f.status != "deleted",
                or_(f.from_step.in_(sorted(set(steps))), f.to_step.in_(sorted(set(steps)))))
    run = conn.scalar(select(Run.c.name).where(Run.c.id == run_id))
    gone = [_fold_of(r, str(run))
            for r in conn.execute(select(PolicyFold).where(*touching).order_by(f.from_step, f.to_step))]
    if gone:
        conn.execute(update(PolicyFold).where(*touching).values(status="deleted"))
    return gone


def condemn_fold(catalog: Transactions, fold: FoldRecord, *, to: str = "corrupt") -> bool:
    """Move a fold's row from ``verified`` to ``to`` (``corrupt``: its bytes differ; ``deleted``: an end is
    gone), compare-and-set on the digest the caller checked; False when the row moved meanwhile."""
    def fn(conn: Connection) -> bool:
        f = PolicyFold.c
        run_id = select(Run.c.id).where(Run.c.name == fold.run).scalar_subquery()
        changed = conn.execute(update(PolicyFold).where(
            f.run_id == run_id, f.from_step == fold.from_step, f.to_step == fold.to_step,
            f.sha256 == fold.sha256, f.status == "verified").values(status=to)).rowcount
        return bool(changed)
    result: bool = catalog.write(fn)
    return result


def usable_folds(catalog: Transactions) -> dict[str, FoldRecord]:
    """Every fold row whose file a reader may use, by path: ``verified``, both its ends steps with a payload.
    What fsck keeps; every other file under a run's folds folder is an orphan."""
    def fn(conn: Connection) -> dict[str, FoldRecord]:
        f, c = PolicyFold.c, CheckpointRow.c
        ends = [select(c.id).where(c.run_id == f.run_id, c.step == col, c.status.in_(HAS_PAYLOAD)).exists()
                for col in (f.from_step, f.to_step)]
        rows = conn.execute(select(PolicyFold, Run.c.name.label("run_name")).join(Run, Run.c.id == f.run_id)
                            .where(f.status == "verified", *ends))
        return {r.path: _fold_of(r, r.run_name) for r in rows}
    result: dict[str, FoldRecord] = catalog.read(fn)
    return result


def stale_folds(catalog: Transactions, path: str) -> int:
    """Mark ``deleted`` the ``verified`` rows naming ``path`` whose ends are no longer both steps with a payload
    (a step deleted by something other than retention): fsck's repair, before it removes the file."""
    def fn(conn: Connection) -> int:
        f, c = PolicyFold.c, CheckpointRow.c
        ends = [select(c.id).where(c.run_id == f.run_id, c.step == col, c.status.in_(HAS_PAYLOAD)).exists()
                for col in (f.from_step, f.to_step)]
        return int(conn.execute(update(PolicyFold).where(f.path == path, f.status == "verified",
                                                         ~and_(*ends)).values(status="deleted")).rowcount)
    result: int = catalog.write(fn)
    return result


__all__ = ["FoldRecord", "MarkerInfo", "PolicyRecord", "PolicyStepInfo", "add_marker", "anchored", "chain_steps",
           "condemn_fold", "delta_bases", "end_folds", "folds", "markers", "newest_base", "policy_steps", "record_fold",
           "record_policy_step", "stale_folds", "usable_folds", "version_step"]
