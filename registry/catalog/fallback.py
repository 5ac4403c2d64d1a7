"""Which steps a run's fallback rests on: what dedup must never make share an inode.

A corrupt ``RUN@latest`` falls back to the next older ``verified`` step, so
the two newest verified steps must never hold one inode between them
(``registry.fs.dedup``). These queries name the steps that rule is about;
knows SQL and nothing of files or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, CompoundSelect, Connection, Integer, Select, bindparam, select, union_all

from registry.catalog.models import CheckpointFile, CheckpointRow, Run
from registry.catalog.session import Transactions
from registry.records import HAS_PAYLOAD, Status


@dataclass(frozen=True, kw_only=True)
class StepDir:
    step: int
    path: str    # relative to the root
    status: str


#: the steps a dedup candidate query leaves out: the new step and its neighbours (two on each side), as fixed
#: parameters, so that the statement is the same whatever their number
SKIP_SLOTS = 5


def _statements() -> tuple[CompoundSelect, Select[Any]]:
    """The two prebuilt statements below (built once: building a statement costs more than running it)."""
    c, f = CheckpointRow.c, CheckpointFile.c
    run_id = select(Run.c.id).where(Run.c.name == bindparam("run")).scalar_subquery()
    step = bindparam("step", type_=BigInteger)
    sides = [select(c.step, c.path, c.status).where(c.run_id == run_id, c.status.in_(list(statuses)), where)
             .order_by(order).limit(1).subquery()
             for statuses in ((Status.VERIFIED,), HAS_PAYLOAD)
             for where, order in ((c.step < step, c.step.desc()), (c.step > step, c.step.asc()))]
    near = union_all(*(select(side.c.step, side.c.path, side.c.status) for side in sides))
    skip = [bindparam(f"skip{i}", type_=BigInteger) for i in range(SKIP_SLOTS)]
    newest = (select(c.id, c.step, c.path, c.manifest_sha256)
              .where(c.run_id == run_id, c.status == Status.VERIFIED, c.step.notin_(skip))
              .order_by(c.step.desc()).limit(bindparam("steps", type_=Integer)).subquery())
    files = (select(newest.c.step, newest.c.path, newest.c.manifest_sha256, f.name, f.sha256)
             .join(CheckpointFile, f.checkpoint_id == newest.c.id).where(f.size == bindparam("size", type_=BigInteger))
             .order_by(newest.c.step.desc(), f.name))
    return near, files


_NEAR, _SAME_SIZE = _statements()


def neighbours(catalog: Transactions, run: str, step: int) -> list[StepDir]:
    """The steps a new ``run@step`` must share no inode with: on each side, the nearest verified step and
    the nearest step with a payload (a corrupt one may be verified again once repaired). One statement."""
    result: list[StepDir] = catalog.read_prebuilt(lambda conn: _neighbours(conn, run, step))
    return result


def _neighbours(conn: Connection, run: str, step: int) -> list[StepDir]:
    found = {int(r.step): StepDir(step=int(r.step), path=r.path, status=r.status)
             for r in conn.execute(_NEAR, {"run": run, "step": step})}
    return [found[s] for s in sorted(found)]


@dataclass(frozen=True, kw_only=True)
class SizedFile:
    """A file of a verified step, as the catalog records it, with its step's manifest digest."""

    step: int
    path: str    # the step's directory, relative to the root
    name: str
    sha256: str
    manifest_sha256: str


def same_size_files(catalog: Transactions, run: str, step: int, size: int, *,
                    steps: int = 4) -> tuple[list[StepDir], list[SizedFile]]:
    """What dedup may link a new ``run@step`` file of ``size`` bytes to, before its bytes are written or hashed.

    The step's :func:`neighbours`, and the files of ``size`` bytes of the
    ``steps`` newest verified steps of the run outside them, newest first:
    two prebuilt statements in one read, the second an indexed walk down
    ``(run_id, status, step)``, so it costs the same whatever the length of
    the run. Which of them holds the same bytes is the store's to find out
    (the digests their manifests record).
    """
    def fn(conn: Connection) -> tuple[list[StepDir], list[SizedFile]]:
        near = _neighbours(conn, run, step)
        skip = sorted({step, *(n.step for n in near)})
        skip += [step] * (SKIP_SLOTS - len(skip))
        rows = conn.execute(_SAME_SIZE, {"run": run, **{f"skip{i}": s for i, s in enumerate(skip)},
                                         "steps": steps, "size": size})
        return near, [SizedFile(step=int(r.step), path=r.path, name=r.name, sha256=r.sha256,
                                manifest_sha256=r.manifest_sha256) for r in rows if r.manifest_sha256]
    result: tuple[list[StepDir], list[SizedFile]] = catalog.read_prebuilt(fn)
    return result


def newest_verified(catalog: Transactions, run: str, *, excluding: Sequence[int] = (), n: int = 2) -> list[StepDir]:
    """The ``n`` newest verified steps of ``run`` other than ``excluding``, newest first."""
    def fn(conn: Connection) -> list[StepDir]:
        c = CheckpointRow.c
        query = (select(c.step, c.path, c.status).join(Run, Run.c.id == c.run_id)
                 .where(Run.c.name == run, c.status == Status.VERIFIED))
        if excluding:
            query = query.where(c.step.notin_(sorted(set(excluding))))
        rows = conn.execute(query.order_by(c.step.desc()).limit(n)).all()
        return [StepDir(step=int(r.step), path=r.path, status=r.status) for r in rows]
    result: list[StepDir] = catalog.read(fn)
    return result


__all__ = ["SizedFile", "StepDir", "neighbours", "newest_verified", "same_size_files"]
