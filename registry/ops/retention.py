"""Retention planning and execution: a frozen plan, and a crash-safe ``execute``.

``Registry.plan_retention`` returns a :class:`RetentionPlan` and changes
nothing. :meth:`RetentionPlan.execute` deletes only steps the plan meant to
delete, and only those that are *still* deletable: inside the write
transaction that marks them it re-reads the catalog, re-applies the
invariants and re-runs the policy (a new publish, tag, lease or late metric
since the plan wins), and reports what it skipped and why.

Deletion order, so a SIGKILL anywhere leaves nothing worse than a ``deleted``
row whose directory still exists: (1) one catalog transaction marks the rows
``deleted`` and records ``delete`` events (metrics and rows stay as history);
(2) each directory is renamed to a hidden ``.step-N.retired-XXXX`` sibling, so
it vanishes from its final path at once; (3) the retired copy is removed
(:mod:`registry.fs.removal`). ``execute`` first finishes any such interrupted
deletion of the run, so running gc again (or ``fsck --repair``) completes the job.

What a root does for steps (2) and (3) and how it measures a step's bytes is
its :class:`~registry.roots.base.Removal` (a directory root retires and
removes; an ``s3://`` root deletes the keys under the step's attempt prefix);
:class:`RootDeletion` adds the guards a root's capabilities call for. The
catalog side, the plan and the re-check inside the marking transaction are
the same for every root, and :func:`execute_deletions` is the one engine that
executes every plan: a plain one, where each deletion ends a step, and a
tier's (:mod:`registry.ops.tierretention`), where a copy may go alone.

The policies themselves are :mod:`registry.retention`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Protocol

from registry.catalog import Catalog
from registry.catalog.fallback import newest_verified
from registry.catalog.retention import CANDIDATES, DeletedRow, RetentionCatalog, RunSnapshot
from registry.crashpoints import crashpoint
from registry.errors import PolicyError, StorageError
from registry.format.refs import check_run_name, check_step
from registry.ops.checkouts import reclaim as reclaim_checkouts
from registry.ops.protocol import keep_fallback_apart, restore_fallback
from registry.progress import Counter, ProgressFn
from registry.records import LIVE, CheckpointInfo, Status
from registry.retention import Policy, RetentionContext, evaluate
from registry.roots.base import Root

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Doomed:
    """One deletion a plan asks of the engine: a copy of a step, with why. ``ends_step``: it is the step's last
    copy, so the step is deleted with it (on a root whose steps have one copy, every deletion); otherwise the
    copy alone goes, while another good copy of the step stands. ``condemned``: a copy marked corrupt, which goes
    whatever the policy keeps. ``location``/``path``: the copy (None on a root whose steps have one copy)."""

    step: int
    why: str
    ends_step: bool = True
    condemned: bool = False
    location: str | None = None
    path: str | None = None
    total_bytes: int = 0


class Deletion(Protocol):
    """What retention needs of a checkpoint root: where a step is, what it holds, and removing a deleted one."""

    def candidates(self, snap: RunSnapshot) -> list[CheckpointInfo]:
        """The located steps a plan's policy is evaluated over (again, when they are marked)."""

    def delete_copy(self, run: str, doomed: Doomed, digest: str | None) -> str | None:
        """Mark ``doomed``'s copy deleted while the step stays (compare-and-set on the step's copies); None when
        it was, else why not."""

    def remove_copy(self, doomed: Doomed, digest: str | None) -> None:
        """Remove the files of a copy :meth:`delete_copy` marked. Raises ``OSError`` or ``StorageError``."""

    def locate(self, info: CheckpointInfo) -> CheckpointInfo:
        """``info`` (its path relative to the root) as callers see it: an absolute path, or its URL set."""

    def held(self, info: CheckpointInfo) -> Mapping[Any, int]:
        """What a located step occupies, by storage unit (an inode), with sizes; empty: use its catalog size."""

    def freed_bytes(self, doomed: Sequence[CheckpointInfo]) -> int:
        """The bytes removing the located ``doomed`` steps would free."""

    def kept_bytes(self, kept: Sequence[CheckpointInfo]) -> int:
        """The bytes the located ``kept`` steps hold, each unit once."""

    def shared_bytes(self, doomed: Sequence[Path], kept: Sequence[Path]) -> int:
        """Of what the ``doomed`` steps hold, the bytes ``kept`` steps hold too (they stay)."""

    def guard(self, catalog: Catalog, run: str, doomed: Sequence[int]) -> dict[int, str]:
        """Before marking: steps that must be kept after all, with why (see :func:`guard_fallback`)."""

    def after_mark(self, catalog: Catalog, run: str) -> None:
        """After marking, before removing: whatever the root must re-establish (never raises)."""

    def reclaim(self, catalog: Catalog, run: str) -> tuple[Path, ...]:
        """Registry-owned checkouts of ``run`` whose lease expired, removed (first: they may hold bytes)."""

    def remove(self, row: DeletedRow, doomed: Doomed) -> bool:
        """Remove what ``row`` (marked ``deleted``, as ``doomed`` asked) left; False when nothing was there.
        Raises ``OSError`` or ``StorageError``."""

    def finish(self, run: str, rows: Sequence[DeletedRow]) -> tuple[set[int], dict[int, str]]:
        """Finish killed deletions of ``rows`` (the run's ``deleted`` rows): steps healed, and errors."""

    def remove_aside(self, rel: str) -> bool:
        """Remove a file the root keeps beside its steps (a policy fold marked deleted). Raises ``OSError``."""


@dataclass(frozen=True)
class RootDeletion:
    """:class:`Deletion` on any root: the root measures and removes what it stores (its
    :class:`~registry.roots.base.Removal`); a root whose steps may share inodes keeps the fallback chain apart,
    and one of directories reclaims the expired checkouts it owns first."""

    root: Root

    def candidates(self, snap: RunSnapshot) -> list[CheckpointInfo]:
        return [self.locate(c) for c in snap.checkpoints if c.status in CANDIDATES]

    def delete_copy(self, run: str, doomed: Doomed, digest: str | None) -> str | None:
        raise PolicyError(f"{run}@{doomed.step}: a root whose steps have one copy deletes only whole steps")

    def remove_copy(self, doomed: Doomed, digest: str | None) -> None:
        raise PolicyError(f"step {doomed.step}: a root whose steps have one copy deletes only whole steps")

    def locate(self, info: CheckpointInfo) -> CheckpointInfo:
        return self.root.place(info)

    def held(self, info: CheckpointInfo) -> Mapping[Any, int]:
        return self.root.removal().held(info)

    def freed_bytes(self, doomed: Sequence[CheckpointInfo]) -> int:
        return self.root.removal().freed_bytes(doomed)

    def kept_bytes(self, kept: Sequence[CheckpointInfo]) -> int:
        return self.root.removal().kept_bytes(kept)

    def shared_bytes(self, doomed: Sequence[Path], kept: Sequence[Path]) -> int:
        return self.root.removal().shared_bytes(doomed, kept)

    def guard(self, catalog: Catalog, run: str, doomed: Sequence[int]) -> dict[int, str]:
        directory = self.root.local_dir
        if not self.root.can.links or directory is None:
            return {}
        return guard_fallback(catalog, directory, run, doomed)

    def after_mark(self, catalog: Catalog, run: str) -> None:
        directory = self.root.local_dir
        if not self.root.can.links or directory is None:
            return
        restore_fallback(catalog, directory, run, after="retention deleted a step")

    def reclaim(self, catalog: Catalog, run: str) -> tuple[Path, ...]:
        directory = self.root.local_dir
        if not self.root.can.directories or directory is None:
            return ()
        return reclaim_checkouts(catalog, directory, run=run)

    def remove(self, row: DeletedRow, doomed: Doomed) -> bool:
        return self.root.removal().remove(row)

    def finish(self, run: str, rows: Sequence[DeletedRow]) -> tuple[set[int], dict[int, str]]:
        return self.root.removal().finish(run, rows)

    def remove_aside(self, rel: str) -> bool:
        return self.root.aside().delete(rel)


@dataclass(frozen=True, kw_only=True)
class RetentionScope:
    """What retention acts on: a catalog, the root its paths are relative to (as a :class:`Deletion`), and
    who acts."""

    catalog: Catalog
    storage: Deletion
    actor: str | None  # recorded on the ``delete`` events


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One step of a plan: kept (with every reason) or deleted."""

    step: int
    status: str
    action: Literal["keep", "delete"]
    reasons: tuple[str, ...]
    protected: bool        # kept by an invariant, whatever the policy says
    total_bytes: int
    path: Path             # absolute on a directory root; relative to the root on an object-store root
    url: str | None = None  # the step's URL on an object-store root

    def __post_init__(self) -> None:
        if self.action not in ("keep", "delete") or (self.action == "delete" and self.protected):
            raise PolicyError(f"invalid retention decision for step {self.step}: {self.action}")

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "status": self.status, "action": self.action, "reasons": list(self.reasons),
                "protected": self.protected, "total_bytes": self.total_bytes, "path": str(self.path),
                "url": self.url}


def protections(snap: RunSnapshot, extra: Mapping[int, str] = MappingProxyType({}), *,
                keep_fork_parents: bool = True) -> dict[int, str]:
    """The invariants: steps no policy may delete, with why.

    A step that a fork with a payload in another run names as its parent (``begin_attempt(run,
    fork_from=...)``, ``publish(..., parent=...)``) counts as referenced and
    is kept too, unless the caller says otherwise explicitly
    (``keep_fork_parents=False``; ``registry gc --release-fork-parents``):
    the fork's lineage then names a deleted parent, which it survives.
    """
    why: dict[int, list[str]] = {}
    for c in snap.checkpoints:
        if c.status == Status.STAGING:
            why.setdefault(c.step, []).append("staging: publish in progress")
        if c.step == snap.latest:
            why.setdefault(c.step, []).append("@latest")
        if c.step == snap.latest_published:
            why.setdefault(c.step, []).append("@latest-published")
        if c.tags:
            why.setdefault(c.step, []).append("tagged " + ",".join(c.tags))
        if c.step in snap.leases:
            why.setdefault(c.step, []).append(f"leased by a reader until {snap.leases[c.step]:%Y-%m-%d %H:%M:%S}Z")
        if c.step in snap.policy_holds:
            why.setdefault(c.step, []).append(snap.policy_holds[c.step])
        if c.step == snap.latest_policy:
            why.setdefault(c.step, []).append("@latest-policy")
    if keep_fork_parents:
        present = {c.step for c in snap.checkpoints}
        for step, children in snap.forks.items():
            if step in present:
                more = f" and {len(children) - 3} more" if len(children) > 3 else ""
                why.setdefault(step, []).append(f"parent of fork {', '.join(children[:3])}{more}")
    for step, reason in extra.items():
        why.setdefault(step, []).append(reason)
    return {step: "; ".join(reasons) for step, reasons in why.items()}


def chain_bases(snap: RunSnapshot, keeping: Iterable[int]) -> dict[int, str]:
    """The bases, transitively, of every delta step in ``keeping``, with why: a delta step loads only through its
    chain, so whatever keeps it keeps the steps it is made against."""
    out: dict[int, str] = {}
    stack = sorted(set(keeping), reverse=True)
    while stack:
        step = stack.pop()
        base = snap.delta_bases.get(step)
        if base is not None and base not in out:
            out[base] = f"base of delta step {step}"
            stack.append(base)
    return out


def with_bases(snap: RunSnapshot, protected: Mapping[int, str], staying: Iterable[int]) -> dict[int, str]:
    """``protected`` and the chain bases (:func:`chain_bases`) of every step that stays: ``staying``, the protected
    steps and those retention never takes. Every engine (plain, and each tier's) ends a step only through this."""
    keeping = set(protected) | set(staying) | {c.step for c in snap.checkpoints if c.status not in CANDIDATES}
    merged = dict(protected)
    for step, why in chain_bases(snap, keeping).items():
        merged[step] = f"{merged[step]}; {why}" if step in merged else why
    return merged


def anchorable(snap: RunSnapshot, before: Mapping[int, str], after: Mapping[int, str],
               staying: Collection[int]) -> tuple[int, ...]:
    """The delta steps that stay for their own sake (``staying``, or protected in ``before``) whose base stays only
    as a chain base (in ``after``, :func:`with_bases`' result, and nowhere else): with each of them re-anchored
    (its version stored whole, :func:`registry.ops.folds.reanchor`), the plan takes the chains' older steps."""
    status = {c.step: c.status for c in snap.checkpoints}
    only_base = {s for s in after if s not in before and s not in staying and status.get(s) in CANDIDATES}
    return tuple(sorted(step for step, base in snap.delta_bases.items()
                        if base in only_base and step not in only_base and status.get(step) in LIVE
                        and (step in staying or step in before)))


@dataclass(frozen=True, kw_only=True)
class RetentionResult:
    """What :meth:`RetentionPlan.execute` did."""

    run: str
    deleted: tuple[int, ...]
    skipped: Mapping[int, str]      # planned deletions that became protected or kept, with why
    bytes_freed: int
    healed: tuple[int, ...]         # interrupted earlier deletions this run finished
    errors: Mapping[int, str]       # marked deleted but the directory could not be removed (retry gc)
    checkouts_removed: tuple[Path, ...] = ()  # registry-owned checkouts of the run whose lease had expired

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "deleted": list(self.deleted),
                "skipped": {str(k): v for k, v in self.skipped.items()}, "bytes_freed": self.bytes_freed,
                "healed": list(self.healed), "errors": {str(k): v for k, v in self.errors.items()},
                "checkouts_removed": [str(p) for p in self.checkouts_removed]}


@dataclass(frozen=True, kw_only=True)
class RetentionPlan:
    """What retention would do to one run, and why. Frozen; ``execute()`` acts on it."""

    run: str
    policy: Policy
    decisions: tuple[Decision, ...]     # every staging/published/verified/corrupt step, ascending
    now: datetime
    protect: Mapping[int, str] = field(default_factory=dict)  # extra protections (the step just published)
    allow_missing_metrics: bool = False  # see KeepBest: keep nothing by a metric no checkpoint has
    keep_fork_parents: bool = True       # see protections
    scope: RetentionScope | None = field(default=None, repr=False, compare=False)
    physical_freed: int | None = None    # measured by make_plan: see bytes_freed
    physical_kept: int | None = None
    anchorable: tuple[int, ...] = ()     # delta steps whose re-anchoring frees their chains (see anchorable)

    @property
    def keep(self) -> Mapping[int, str]:
        """step -> why it is kept, ascending."""
        return MappingProxyType({d.step: "; ".join(d.reasons) for d in self.decisions if d.action == "keep"})

    @property
    def delete(self) -> Mapping[int, str]:
        """step -> why it is deleted, ascending."""
        return MappingProxyType({d.step: "; ".join(d.reasons) for d in self.decisions if d.action == "delete"})

    @property
    def bytes_freed(self) -> int:
        """The bytes deleting would free on disk when planned: inodes with no name outside the deleted steps
        (a file dedup stored once for a kept step too stays, and is not counted)."""
        if self.physical_freed is not None:
            return self.physical_freed
        return sum(d.total_bytes for d in self.decisions if d.action == "delete")

    @property
    def shared_bytes(self) -> int:
        """Of the files the plan deletes, the bytes that kept steps hold too (stored once by dedup): they stay."""
        if self.scope is None:
            return 0
        return self.scope.storage.shared_bytes([d.path for d in self.decisions if d.action == "delete"],
                                               [d.path for d in self.decisions if d.action == "keep"])

    @property
    def bytes_kept(self) -> int:
        """The bytes the kept steps hold on disk, each inode once."""
        if self.physical_kept is not None:
            return self.physical_kept
        return sum(d.total_bytes for d in self.decisions if d.action == "keep")

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "policy": repr(self.policy), "now": self.now.isoformat(),
                "keep": [d.step for d in self.decisions if d.action == "keep"],
                "delete": [d.step for d in self.decisions if d.action == "delete"],
                "bytes_freed": self.bytes_freed, "bytes_kept": self.bytes_kept,
                "decisions": [d.to_json() for d in self.decisions], "anchorable": list(self.anchorable)}

    def execute(self, *, progress: ProgressFn | None = None) -> RetentionResult:
        """Delete what the plan deletes and is still deletable now; see the module docstring.

        ``progress`` hears of each checkpoint removed (see :mod:`registry.progress`).
        """
        if self.scope is None:
            raise PolicyError("this plan is not bound to a registry; make it with Registry.plan_retention")
        return _execute(self.scope, self, progress)


def _candidates(scope: RetentionScope, snap: RunSnapshot) -> list[CheckpointInfo]:
    return [scope.storage.locate(c) for c in snap.checkpoints if c.status in CANDIDATES]


def make_plan(scope: RetentionScope, run: str, policy: Policy, *, now: datetime | None = None,
              protect: Mapping[int, str] = MappingProxyType({}),
              allow_missing_metrics: bool = False, keep_fork_parents: bool = True) -> RetentionPlan:
    """Decide, without changing anything, what ``policy`` keeps and deletes in ``run``.

    A policy that ranks by a metric no candidate has is refused
    (:class:`UnknownMetricError`) unless ``allow_missing_metrics``.
    """
    now, protect = plan_options(run, policy, now=now, protect=protect)
    snap = RetentionCatalog(scope.catalog).snapshot(run)
    protected = protections(snap, protect, keep_fork_parents=keep_fork_parents)
    candidates = _candidates(scope, snap)
    kept = evaluate(policy, candidates, RetentionContext(run=run, now=now, protected=protected,
                                                         allow_missing_metrics=allow_missing_metrics,
                                                         held=scope.storage.held))
    before, protected = protected, with_bases(snap, protected, kept)
    staying = {*kept, *(c.step for c in snap.checkpoints if c.status not in CANDIDATES)}
    decisions = []
    located: dict[int, CheckpointInfo] = {}
    for c in snap.checkpoints:
        keep = c.step in protected or c.step in kept or c.status not in CANDIDATES
        reasons = tuple(r for r in (protected.get(c.step), kept.get(c.step)) if r)
        if not keep:
            reasons = ("not kept by the policy",)
        where = located[c.step] = scope.storage.locate(c)
        decisions.append(Decision(step=c.step, status=c.status, action="keep" if keep else "delete",
                                  reasons=reasons or ("kept",),
                                  protected=c.step in protected, total_bytes=c.total_bytes,
                                  path=Path(where.path), url=where.url))
    return RetentionPlan(run=run, policy=policy, decisions=tuple(decisions), now=now,
                         protect=MappingProxyType(dict(protect)), allow_missing_metrics=allow_missing_metrics,
                         keep_fork_parents=keep_fork_parents, scope=scope,
                         physical_freed=scope.storage.freed_bytes(
                             [located[d.step] for d in decisions if d.action == "delete"]),
                         physical_kept=scope.storage.kept_bytes(
                             [located[d.step] for d in decisions if d.action == "keep"]),
                         anchorable=anchorable(snap, before, protected, staying))


def still_doomed(snap: RunSnapshot, planned: Mapping[int, str], policy: Policy, candidates: Sequence[CheckpointInfo],
                 *, now: datetime, protect: Mapping[int, str], allow_missing_metrics: bool,
                 keep_fork_parents: bool = True, held: Callable[[CheckpointInfo], Mapping[Any, int]] | None = None,
                 staying: Iterable[int] = ()) -> tuple[dict[int, str], dict[int, str]]:
    """Of the ``planned`` deletions, those still due in ``snap`` (the run as the marking transaction sees it), and
    the others with why: a new publish, tag, lease, policy hold or late metric since the plan wins.

    The policy is evaluated again over ``candidates``; what stays (``staying``, what the policy keeps, the
    protected steps) keeps its delta chains. Every retention engine marks through this, the plain one and each
    tier's.
    """
    protected = protections(snap, protect, keep_fork_parents=keep_fork_parents)
    by_step = {c.step: c for c in snap.checkpoints}
    kept = evaluate(policy, candidates, RetentionContext(run=snap.run, now=now, protected=protected,
                                                         allow_missing_metrics=allow_missing_metrics,
                                                         **({"held": held} if held is not None else {})))
    protected = with_bases(snap, protected, {*kept, *staying})
    doomed: dict[int, str] = {}
    skipped: dict[int, str] = {}
    for step, why in planned.items():
        c = by_step.get(step)
        if c is None or c.status not in CANDIDATES:
            skipped[step] = f"no longer a candidate ({c.status if c is not None else 'deleted or failed'})"
        elif step in protected:
            skipped[step] = f"now protected: {protected[step]}"
        elif step in kept:
            skipped[step] = f"now kept by the policy: {kept[step]}"
        else:
            doomed[step] = why
    return doomed, skipped


def plan_options(run: str, policy: object, *, now: object, protect: object) -> tuple[datetime, dict[int, str]]:
    """What every retention plan (plain, or a tier's) is given, checked: a run name, a :class:`Policy`, ``now``
    (timezone-aware; None: the clock) and ``protect`` (``{step: why}``). Returns ``now`` and ``protect``."""
    check_run_name(run)
    if not isinstance(policy, Policy):
        raise PolicyError(f"a retention policy must be a registry.retention.Policy, got {policy!r}")
    if now is None:
        now = datetime.now(timezone.utc)
    elif not isinstance(now, datetime) or now.tzinfo is None:
        raise PolicyError(f"now= must be a timezone-aware datetime, got {now!r}")
    if not isinstance(protect, Mapping):
        raise PolicyError(f"protect= must map steps to the reasons they are kept, got {protect!r}")
    for step, why in protect.items():
        check_step(step)
        if not isinstance(why, str) or not why.strip():
            raise PolicyError(f"protect= gives step {step} the reason {why!r}: say why it is kept, in words")
    return now, dict(protect)


def finish_interrupted(scope: RetentionScope, run: str) -> tuple[tuple[int, ...], dict[int, str]]:
    """Remove what a killed gc left of ``deleted`` rows (see :meth:`Deletion.finish`)."""
    healed, errors = scope.storage.finish(run, RetentionCatalog(scope.catalog).deleted_rows(run))
    return tuple(sorted(healed)), errors


def guard_fallback(catalog: Catalog, root: Path, run: str, doomed: Sequence[int]) -> dict[int, str]:
    """Before ``doomed`` go: the two newest verified steps left must share no inode (see ``registry.fs.dedup``).

    The newer one gets its own copy of what they share. When that copy cannot
    be made (a full disk), the doomed steps among today's two newest verified
    are kept instead, with why: they are the independent copy the fallback needs.
    """
    if not doomed:
        return {}
    try:
        keep_fallback_apart(catalog, root, run, excluding=doomed)
        return {}
    except OSError as exc:
        why = f"kept as the fallback's own copy: could not copy a shared file ({exc.strerror or exc})"
        log.warning("retention of %s: %s", run, why)
        return {s.step: why for s in newest_verified(catalog, run, n=2) if s.step in doomed}


@dataclass(frozen=True, kw_only=True)
class Executed:
    """What :func:`execute_deletions` did: ``deleted``, the steps one of whose copies (or whose only copy) it
    marked deleted, in step order (a removal that failed then is in ``errors``, and the next retention or fsck
    finishes it); ``ended``, the steps it deleted with their last copy; the rest as in :class:`RetentionResult`."""

    deleted: tuple[int, ...]
    ended: tuple[int, ...]
    skipped: Mapping[int, str]
    errors: Mapping[int, str]
    bytes_freed: int
    healed: tuple[int, ...]
    checkouts_removed: tuple[Path, ...]


def execute_deletions(scope: RetentionScope, *, run: str, deletions: Sequence[Doomed], policy: Policy,
                      now: datetime, protect: Mapping[int, str], allow_missing_metrics: bool, keep_fork_parents: bool,
                      progress: ProgressFn | None = None, unit: str = "checkpoints") -> Executed:
    """The one retention engine, for every root and every tier: what a plan deletes, each deletion checked
    again when it is marked (the module's docstring; ``scope.storage`` is the root's or a tier's).

    First what an earlier, killed run left is finished and expired checkouts are reclaimed; then the steps whose
    last copy goes are marked ``deleted`` in one transaction that evaluates the policy again (a new publish,
    tag, lease, policy hold or late metric since the plan wins, and every step that stays keeps its delta
    chain), the run's fallback kept apart around it; then each copy that goes alone is marked by
    compare-and-set on the step's copies, after the same check; then the files go.
    """
    healed, errors = finish_interrupted(scope, run)
    # first: an expired checkout made of hard links would keep a deleted step's bytes on disk
    reclaimed = scope.storage.reclaim(scope.catalog, run)
    retention = RetentionCatalog(scope.catalog)
    enders = {d.step: d.why for d in deletions if d.ends_step}
    skipped: dict[int, str] = {}
    fallback = scope.storage.guard(scope.catalog, run, sorted(enders)) if enders else {}

    def recheck(snap: RunSnapshot, planned: Mapping[int, str], *,
                ending: Iterable[int] = ()) -> tuple[dict[int, str], dict[int, str]]:
        """Every step but those whose last copy goes (``ending``) stays, with its chain."""
        return still_doomed(snap, planned, policy, scope.storage.candidates(snap), now=now,
                            protect={**protect, **fallback}, allow_missing_metrics=allow_missing_metrics,
                            keep_fork_parents=keep_fork_parents, held=scope.storage.held,
                            staying={c.step for c in snap.checkpoints} - set(ending))

    def decide(snap: RunSnapshot) -> dict[int, str]:
        due, why_not = recheck(snap, enders, ending=enders)
        skipped.clear()  # the transaction may be retried: start over each time
        skipped.update(why_not)
        return due
    marked = retention.mark_deleted(run, decide, actor=scope.actor) if enders else []
    if marked:
        crashpoint("gc-after-mark")
    scope.storage.after_mark(scope.catalog, run)
    ended = {row.step: row for row in marked}
    for step in enders:
        if step not in ended:
            skipped.setdefault(step, "changed since the plan")
    freed = scope.storage.freed_bytes([scope.storage.locate(_deleted_info(run, r)) for r in marked])

    alone = [d for d in deletions if not d.ends_step]
    copies: list[tuple[Doomed, str | None]] = []
    if alone:
        snap = retention.snapshot(run)
        digests = {c.step: c.manifest_sha256 for c in snap.checkpoints}
        _, changed = recheck(snap, {d.step: d.why for d in alone if not d.condemned})
        for d in alone:
            why = None if d.condemned else changed.get(d.step)
            why = why or scope.storage.delete_copy(run, d, digests.get(d.step))
            if why is not None:
                skipped[d.step] = why
                continue
            crashpoint("gc-after-mark")  # the copy marked deleted, its bytes still in place
            copies.append((d, digests.get(d.step)))
            freed += d.total_bytes

    by_step = {d.step: d for d in deletions}
    counter = Counter(progress, task="gc", total=len(marked) + len(copies), unit=unit)
    removals: list[tuple[int, str, Callable[[], object]]] = []
    for row in marked:
        located = scope.storage.locate(_deleted_info(run, row))
        removals.append((row.step, located.url or str(located.path),
                         functools.partial(scope.storage.remove, row, by_step[row.step])))
    removals += [(d.step, d.path or "", functools.partial(scope.storage.remove_copy, d, digest))
                 for d, digest in copies]
    for step, where, remove in sorted(removals, key=lambda r: r[0]):
        counter.advance(0, item=f"{run}@{step}")
        log.info("retention deleted %s%s@%d (%s): %s", "" if step in ended else "a copy of ", run, step, where,
                 by_step[step].why)
        try:
            remove()
        except (OSError, StorageError) as exc:
            errors[step] = f"cannot remove {where}: {(exc.strerror if isinstance(exc, OSError) else None) or exc}"
        counter.advance(1, item=f"{run}@{step}")
    for rel in sorted({f for row in marked for f in row.folds}):
        try:  # a fold left behind is an orphan fsck --repair removes: its row is deleted already
            scope.storage.remove_aside(rel)
        except (OSError, StorageError) as exc:
            log.warning("retention of %s: could not remove the policy fold %s: %s", run, rel, exc)
    return Executed(deleted=tuple(sorted({*ended, *(d.step for d, _ in copies)})), ended=tuple(sorted(ended)),
                    skipped=dict(skipped), errors=errors, bytes_freed=freed, healed=healed,
                    checkouts_removed=reclaimed)


def _execute(scope: RetentionScope, plan: RetentionPlan, progress: ProgressFn | None = None) -> RetentionResult:
    done = execute_deletions(scope, run=plan.run, deletions=[Doomed(step=step, why=why)
                                                             for step, why in plan.delete.items()],
                             policy=plan.policy, now=plan.now, protect=plan.protect,
                             allow_missing_metrics=plan.allow_missing_metrics,
                             keep_fork_parents=plan.keep_fork_parents, progress=progress)
    return RetentionResult(run=plan.run, deleted=done.deleted, skipped=done.skipped, bytes_freed=done.bytes_freed,
                           healed=done.healed, errors=done.errors, checkouts_removed=done.checkouts_removed)


def _deleted_info(run: str, row: DeletedRow) -> CheckpointInfo:
    """A marked row as a (minimal) ``CheckpointInfo``, for the root to locate and measure."""
    return CheckpointInfo(run=run, step=row.step, status=Status.DELETED, path=Path(row.path),
                          total_bytes=row.total_bytes, manifest_sha256=row.manifest_sha256)


__all__ = ["Decision", "Deletion", "Doomed", "Executed", "RetentionPlan", "RetentionResult", "RetentionScope",
           "RootDeletion", "anchorable", "chain_bases", "execute_deletions", "finish_interrupted", "guard_fallback",
           "make_plan", "protections", "still_doomed", "with_bases"]
