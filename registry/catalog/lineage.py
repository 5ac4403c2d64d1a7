"""Lineage in the catalog: how each step came to be, walked up to its root in one query.

Every commit of a step records one ``checkpoint_lineage`` row (in the
publish transaction, see :func:`record_lineage`) saying how the step came to
be and which step it came from:

- ``started``: written by an attempt that started from nothing;
- ``resumed``: written by an attempt that resumed the same run from a step;
- ``forked``: written by an attempt forked from a checkpoint
  (``begin_attempt(run, fork_from=REF)``, possibly of another run), or
  published with an explicit ``parent=REF``;
- ``imported``: adopted from a directory (``source`` says which, in what
  layout, and the digest of what was read);
- ``unknown``: a directory fsck adopted (written outside the catalog), or a
  step committed before lineage was recorded. A step fsck rolls forward
  after its writer died between rename and commit gets what its commit would
  have recorded, from that writer's latest attempt at the run.

The parent is named by run and step plus its manifest digest at the time, so
it stays named after retention deletes it (its row stays, ``deleted``) or a
publish replaces it (the digest then differs: ``parent_replaced``, where the
walk stops, for the parent's row now tells the replacement's history). Steps an
attempt wrote one after another are not hops of each other: a hop is where a
history changed hands (a resume after a crash, a fork, an import), which is
what ``lineage`` is asked for, and keeps a 1,000-hop chain 1,000 rows.

Knows SQL and nothing of torch or files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, DateTime, and_, delete, func, insert, select, text

from registry.catalog.models import Attempt, CheckpointFile, CheckpointRow, Lineage, Run
from registry.catalog.records import LineageRecord
from registry.catalog.session import Transactions, aware
from registry.records import HAS_PAYLOAD, LIVE

HOWS = ("started", "resumed", "forked", "imported", "unknown")
MAX_DEPTH = 100_000


@dataclass(frozen=True, kw_only=True)
class LineageHop:
    """One step of a chain: the step itself, and how it came from the next hop (its parent).

    ``status`` is the step's status now (``deleted`` after retention), or
    ``missing`` for a parent that was named but never committed (a resume
    from files outside the registry). ``parent_replaced``: the parent step
    was published again since, so its payload is no longer the one this
    step came from: the chain ends here (the parent's row now describes the
    replacement). ``parent_repeated``: the parent is an earlier hop of this
    chain (a cycle); the chain ends here too.
    """

    run: str
    step: int
    status: str
    how: str
    attempt: int | None = None
    writer: str | None = None
    when: datetime | None = None
    manifest_sha256: str | None = None
    parent_run: str | None = None
    parent_step: int | None = None
    parent_manifest_sha256: str | None = None
    parent_replaced: bool = False
    parent_repeated: bool = False
    source: dict[str, Any] | None = None

    @property
    def ref(self) -> str:
        return f"{self.run}@{self.step}"

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "status": str(self.status), "how": self.how,
                "attempt": self.attempt, "writer": self.writer,
                "when": self.when.isoformat() if self.when else None, "manifest_sha256": self.manifest_sha256,
                "parent": (None if self.parent_run is None else
                           {"run": self.parent_run, "step": self.parent_step,
                            "manifest_sha256": self.parent_manifest_sha256, "replaced": self.parent_replaced,
                            "repeated": self.parent_repeated}),
                "source": self.source}


def record_lineage(conn: Connection, *, checkpoint_id: int, run_id: int, attempt_id: int | None,
                   resumed_from: int | None, explicit: LineageRecord | None,
                   replacing: str | None = None) -> None:
    """Record how the step ``checkpoint_id`` came to be, inside its commit transaction.

    ``explicit`` (a ``parent=`` or an import) wins; otherwise the attempt
    says: its fork, else the step it resumed from, else it started fresh. An
    overwrite replaces the row of the payload it replaces. The parent's
    manifest digest is read here, in the same transaction; a step that names
    itself as parent (resumed from the step it now overwrites) came from the
    payload it replaces, whose digest is ``replacing``.
    """
    record = explicit
    if record is None:
        attempt = (conn.execute(select(Attempt.c.resumed_from, Attempt.c.fork_run, Attempt.c.fork_step)
                                .where(Attempt.c.id == attempt_id)).first() if attempt_id is not None else None)
        if attempt is None:
            record = LineageRecord(how="unknown")
        elif attempt.fork_run is not None:
            record = LineageRecord(how="forked", parent_run=attempt.fork_run, parent_step=attempt.fork_step)
        else:
            start = resumed_from if resumed_from is not None else attempt.resumed_from
            run = conn.scalar(select(Run.c.name).where(Run.c.id == run_id)) if start is not None else None
            record = (LineageRecord(how="started") if start is None
                      else LineageRecord(how="resumed", parent_run=run, parent_step=start))
    parent: Any = None
    if record.parent_run is not None and record.parent_step is not None:
        query = (select(CheckpointRow.c.id, CheckpointRow.c.manifest_sha256)
                 .join(Run, Run.c.id == CheckpointRow.c.run_id)
                 .where(Run.c.name == record.parent_run, CheckpointRow.c.step == record.parent_step))
        if conn.dialect.name == "postgresql" and record.how == "forked":
            # FOR SHARE, as a tag does: a gc marking the parent deleted either commits first (the fork
            # then names a deleted parent) or waits for this commit and sees the fork that keeps it
            query = query.with_for_update(read=True, of=CheckpointRow)
        parent = conn.execute(query).first()
    parent_sha = None if parent is None else replacing if parent.id == checkpoint_id else parent.manifest_sha256
    conn.execute(delete(Lineage).where(Lineage.c.checkpoint_id == checkpoint_id))
    conn.execute(insert(Lineage).values(
        checkpoint_id=checkpoint_id, how=record.how, parent_run=record.parent_run, parent_step=record.parent_step,
        parent_manifest_sha256=parent_sha,
        parent_checkpoint_id=parent.id if parent is not None else None,
        source=json.dumps(record.source, sort_keys=True) if record.source is not None else None))


# A hop is followed only while the parent still holds the payload the child recorded (a replaced parent
# ends the chain: its row now describes the replacement) and only to a row not yet on the path, so a cycle
# (a parent overwritten by its own descendant, in rows written before digests were compared) stops at once.
_CHAIN = text("""
WITH RECURSIVE chain(depth, cid, path) AS (
    SELECT 0, c.id, ',' || CAST(c.id AS TEXT) || ',' FROM checkpoints c JOIN runs r ON r.id = c.run_id
    WHERE r.name = :run AND c.step = :step
    UNION ALL
    SELECT chain.depth + 1, l.parent_checkpoint_id, chain.path || CAST(l.parent_checkpoint_id AS TEXT) || ','
    FROM chain JOIN checkpoint_lineage l ON l.checkpoint_id = chain.cid
    JOIN checkpoints p ON p.id = l.parent_checkpoint_id
    WHERE chain.depth < :limit
      AND (p.manifest_sha256 = l.parent_manifest_sha256
           OR (p.manifest_sha256 IS NULL AND l.parent_manifest_sha256 IS NULL))
      AND chain.path NOT LIKE ('%,' || CAST(l.parent_checkpoint_id AS TEXT) || ',%')
)
SELECT chain.depth, c.id, r.name AS run, c.step, c.status, c.attempt_id, c.writer, c.manifest_sha256,
       c.created_at, c.published_at, l.how, l.parent_run, l.parent_step, l.parent_manifest_sha256,
       l.parent_checkpoint_id, p.manifest_sha256 AS parent_now_sha256, l.source
FROM chain JOIN checkpoints c ON c.id = chain.cid JOIN runs r ON r.id = c.run_id
LEFT JOIN checkpoint_lineage l ON l.checkpoint_id = c.id
LEFT JOIN checkpoints p ON p.id = l.parent_checkpoint_id
ORDER BY chain.depth
""").columns(created_at=DateTime(timezone=True), published_at=DateTime(timezone=True))


def replaced(recorded: str | None, now: str | None) -> bool:
    """Whether a parent holding the payload ``now`` is no longer the one a child recorded as ``recorded``
    (a parent with no digest when the child was committed, a payload since, counts as replaced)."""
    return recorded != now


def _hops(rows: Sequence[Any]) -> list[LineageHop]:
    hops: list[LineageHop] = []
    ids = {r.id for r in rows}
    for i, r in enumerate(rows):
        last = i == len(rows) - 1
        gone = r.parent_checkpoint_id is not None and replaced(r.parent_manifest_sha256, r.parent_now_sha256)
        hops.append(LineageHop(
            run=r.run, step=int(r.step), status=str(r.status), how=r.how or "unknown", attempt=r.attempt_id,
            writer=r.writer, when=aware(r.published_at) or aware(r.created_at), manifest_sha256=r.manifest_sha256,
            parent_run=r.parent_run, parent_step=r.parent_step, parent_manifest_sha256=r.parent_manifest_sha256,
            parent_replaced=gone, parent_repeated=last and not gone and r.parent_checkpoint_id in ids,
            source=json.loads(r.source) if r.source else None))
    end = hops[-1] if hops else None
    if end is not None and end.parent_run is not None and end.parent_step is not None \
            and rows[-1].parent_checkpoint_id is None:
        hops.append(LineageHop(run=end.parent_run, step=end.parent_step, status="missing", how="unknown"))
    return hops


class LineageCatalog:
    """Lineage's queries, run through a catalog's transactions (a :class:`registry.catalog.Catalog`)."""

    def __init__(self, catalog: Transactions) -> None:
        self.catalog = catalog

    def chain(self, run: str, step: int, *, max_depth: int = MAX_DEPTH) -> list[LineageHop]:
        """``run@step`` and its ancestors, nearest first, in one recursive query.

        Empty when the step has no row; ends at a root (``started``,
        ``imported``, ``unknown``), at a named parent that has no row
        (returned as a ``missing`` hop), at a hop whose parent was replaced
        since (``parent_replaced``: what the parent's row says now is the
        replacement's history, not this chain's) or at the first repeat
        (``parent_repeated``).
        """
        def fn(conn: Connection) -> list[LineageHop]:
            rows = conn.execute(_CHAIN, {"run": run, "step": step, "limit": max_depth}).all()
            return _hops(rows)
        result: list[LineageHop] = self.catalog.read(fn)
        return result

    def descendants(self, run: str, step: int, *, forks_only: bool = True) -> list[LineageHop]:
        """The steps whose lineage names ``run@step`` as parent (only forks unless ``forks_only=False``),
        by run and step, each as its own hop; one that came from a payload the step no longer holds (it was
        replaced since, or had none yet) says ``parent_replaced``: it does not descend from what is there now."""
        def fn(conn: Connection) -> list[LineageHop]:
            c, lin = CheckpointRow.c, Lineage.c
            query = (select(Run.c.name.label("run"), c.step, c.status, c.attempt_id, c.writer, c.manifest_sha256,
                            c.created_at, c.published_at, lin.how, lin.parent_manifest_sha256, lin.source)
                     .join(CheckpointRow, c.id == lin.checkpoint_id).join(Run, Run.c.id == c.run_id)
                     .where(lin.parent_run == run, lin.parent_step == step))
            if forks_only:
                query = query.where(lin.how == "forked")
            current = conn.scalar(select(c.manifest_sha256).join(Run, Run.c.id == c.run_id)
                                  .where(Run.c.name == run, c.step == step))
            rows = conn.execute(query.order_by(Run.c.name, c.step)).all()
            return [LineageHop(run=r.run, step=int(r.step), status=str(r.status), how=r.how, attempt=r.attempt_id,
                               writer=r.writer, when=aware(r.published_at) or aware(r.created_at),
                               manifest_sha256=r.manifest_sha256, parent_run=run, parent_step=step,
                               parent_manifest_sha256=r.parent_manifest_sha256,
                               parent_replaced=replaced(r.parent_manifest_sha256, current),
                               source=json.loads(r.source) if r.source else None) for r in rows]
        result: list[LineageHop] = self.catalog.read(fn)
        return result


def fork_children(conn: Connection, run: str) -> dict[int, tuple[str, ...]]:
    """Steps of ``run`` that a fork with a payload in *another* run names as its parent: step -> the forks.

    What retention counts as referenced (see ``registry.ops.retention.protections``).
    A fork within the run is a resume by another name: the run's own policy
    decides about its history.
    """
    c, lin = CheckpointRow.c, Lineage.c
    rows = conn.execute(select(lin.parent_step, Run.c.name, c.step).join(CheckpointRow, c.id == lin.checkpoint_id)
                        .join(Run, Run.c.id == c.run_id)
                        .where(lin.parent_run == run, lin.how == "forked", c.status.in_(HAS_PAYLOAD))
                        .order_by(Run.c.name, c.step)).all()
    out: dict[int, list[str]] = {}
    for parent_step, child_run, child_step in rows:
        if parent_step is not None and child_run != run:
            out.setdefault(int(parent_step), []).append(f"{child_run}@{child_step}")
    return {step: tuple(children) for step, children in out.items()}


@dataclass(frozen=True, kw_only=True)
class SameBytes:
    """A file of a live step with a given size and sha256: where a publish may link instead of copying."""

    size: int
    sha256: str
    path: str   # the step's directory, relative to the root
    name: str
    run: str
    step: int


def identical_files(catalog: Transactions, wanted: Sequence[tuple[int, str]], *, run: str | None = None,
                    statuses: Sequence[str] = LIVE, exclude_steps: Sequence[int] = (),
                    limit: int = 8) -> list[SameBytes]:
    """Files of steps in ``statuses`` with one of the ``(size, sha256)`` pairs in ``wanted``.

    ``run`` keeps the search within one run, ``exclude_steps`` leaves those
    steps of it out. One indexed query (``ix_checkpoint_files_sha256``) with at
    most ``limit`` rows per digest, newest steps first, so a link goes to the
    copy least likely to be deleted soon and a publish costs the same whatever
    the length of the run.
    """
    if not wanted:
        return []
    sizes = {sha: size for size, sha in wanted}

    def fn(conn: Connection) -> list[SameBytes]:
        f, c = CheckpointFile.c, CheckpointRow.c
        rank = func.row_number().over(partition_by=f.sha256,
                                      order_by=(c.published_at.desc(), c.id.desc())).label("rank")
        query = (select(f.size, f.sha256, f.name, c.path, c.step, Run.c.name.label("run"), rank)
                 .join(CheckpointRow, and_(c.id == f.checkpoint_id, c.status.in_(list(statuses))))
                 .join(Run, Run.c.id == c.run_id)
                 .where(f.sha256.in_(sorted(sizes))))
        if run is not None:
            query = query.where(Run.c.name == run)
        if exclude_steps:
            query = query.where(c.step.notin_(sorted(set(exclude_steps))))
        ranked = query.subquery()
        rows = conn.execute(select(ranked).where(ranked.c.rank <= limit)
                            .order_by(ranked.c.sha256, ranked.c.rank)).all()
        return [SameBytes(size=r.size, sha256=r.sha256, path=r.path, name=r.name, run=r.run, step=int(r.step))
                for r in rows if sizes.get(r.sha256) == r.size]
    result: list[SameBytes] = catalog.read(fn)
    return result


__all__ = ["HOWS", "LineageCatalog", "LineageHop", "SameBytes", "fork_children",
           "identical_files", "record_lineage"]
