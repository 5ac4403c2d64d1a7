"""Which steps a run's fallback rests on: what dedup must never make share an inode.

A corrupt ``RUN@latest`` falls back to the next older ``verified`` step, so
the two newest verified steps must never hold one inode between them
(``registry.fs.dedup``). These queries name the steps that rule is about;
knows SQL and nothing of files or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, select

from registry.catalog.models import CheckpointRow, Run
from registry.catalog.session import Transactions
from registry.records import HAS_PAYLOAD, Status


@dataclass(frozen=True, kw_only=True)
class StepDir:
    step: int
    path: str    # relative to the root
    status: str


def neighbours(catalog: Transactions, run: str, step: int) -> list[StepDir]:
    """The steps a new ``run@step`` must share no inode with: on each side, the nearest verified step and
    the nearest step with a payload (a corrupt one may be verified again once repaired)."""
    def fn(conn: Connection) -> list[StepDir]:
        c = CheckpointRow
        run_id = conn.scalar(select(Run.id).where(Run.name == run))
        if run_id is None:
            return []
        found: dict[int, StepDir] = {}
        for statuses in ((Status.VERIFIED,), HAS_PAYLOAD):
            for where, order in ((c.step < step, c.step.desc()), (c.step > step, c.step.asc())):
                row = conn.execute(select(c.step, c.path, c.status)
                                   .where(c.run_id == run_id, c.status.in_(list(statuses)), where)
                                   .order_by(order).limit(1)).first()
                if row is not None:
                    found[int(row.step)] = StepDir(step=int(row.step), path=row.path, status=row.status)
        return sorted(found.values(), key=lambda d: d.step)
    result: list[StepDir] = catalog.read(fn)
    return result


def newest_verified(catalog: Transactions, run: str, *, excluding: Sequence[int] = (), n: int = 2) -> list[StepDir]:
    """The ``n`` newest verified steps of ``run`` other than ``excluding``, newest first."""
    def fn(conn: Connection) -> list[StepDir]:
        c = CheckpointRow
        query = (select(c.step, c.path, c.status).join(Run, Run.id == c.run_id)
                 .where(Run.name == run, c.status == Status.VERIFIED))
        if excluding:
            query = query.where(c.step.notin_(sorted(set(excluding))))
        rows = conn.execute(query.order_by(c.step.desc()).limit(n)).all()
        return [StepDir(step=int(r.step), path=r.path, status=r.status) for r in rows]
    result: list[StepDir] = catalog.read(fn)
    return result


__all__ = ["StepDir", "neighbours", "newest_verified"]
