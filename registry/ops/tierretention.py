"""Retention per tier on a root with a durable tier: a policy for the fast copies, another for the durable ones.

A plan is for one tier. Its candidates are the steps with a copy on that
tier (on the fast tier: the step's directory under this fast root, else
this host's cached download of it, else this host's part of a step
published from several hosts; one copy per step and plan, so a step with
both goes in two plans). The invariants of :func:`protections` hold
on both tiers (``@latest``, tags, readers' leases...), and so does plain
retention's rule for delta chains (:func:`~registry.ops.retention.with_bases`):
a step that stays keeps its bases, checked again when a step is marked. Deleting a copy
while another good copy of the step stays (a fast copy whose step is
durable, a durable copy whose step is still on a fast tier) removes that
copy only: the step stays live and loads from its other copy. A host's
cached download is never the copy that stays (it is disposable, and read
only through the durable copy: see :mod:`registry.catalog.replicas`), so
deleting a durable copy whose step has no fast copy left ends the step,
whatever caches hold it; its removal takes this host's cached copy with it.
Deleting the
last copy of a step is the only deletion that ends the step (``deleted``,
through the same marking transaction as plain retention, which takes every
copy of the step with it). The fast tier never deletes a copy that is not
yet durable unless told (``force=True``; a corrupt step may always go); a
step whose durable copy was deleted on purpose (durable retention) is not
waiting for one, and goes with its fast copy when the policy says. A copy
of this host marked ``corrupt`` (the step stands on another copy) serves no
reader: the fast tier deletes it whatever the policy keeps.

Execution is plain retention's own engine
(:func:`~registry.ops.retention.execute_deletions`, this tier's storage being
a :class:`TierDeletion`): it checks again what plain retention checks when it marks
(:func:`~registry.ops.retention.still_doomed`: a new publish, tag, lease,
policy hold or late metric since the plan wins, and what stays keeps its
chain), then is compare-and-set on the step's copies: a copy is marked
``deleted`` only if, in the same transaction (with the step's row locked, so
two tiers' retention at once never both take a copy), the step still holds
that payload, no reader holds a lease on it, and (for a copy-only deletion)
the other tier's copy is still good; then its directory is retired and
removed, or its prefix deleted. A retention killed after its mark (or a
removal that failed) is finished by the next one on the same tier, as on a
plain root (:func:`finish_interrupted`; ``fsck --repair`` finishes it too),
and expired registry-owned checkouts of the run are reclaimed first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from registry.catalog import Catalog
from registry.catalog.replicas import DURABLE, FAST, ReplicaCatalog, ReplicaInfo
from registry.catalog.retention import CANDIDATES, DeletedRow, RetentionCatalog, RunSnapshot
from registry.errors import PolicyError
from registry.fs.prefixes import remove_prefix
from registry.format.layout import parse_hidden
from registry.fs.removal import manifest_digest, remove_checkpoint_dir, remove_tree
from registry.ops.checkouts import reclaim as reclaim_checkouts
from registry.ops.protocol import restore_fallback
from registry.ops.retention import (Doomed, RetentionScope, anchorable, execute_deletions, guard_fallback,
                                    plan_options, protections, with_bases)
from registry.ops.tiers import Tiers
from registry.progress import ProgressFn
from registry.records import CheckpointInfo, Status
from registry.retention import Policy, RetentionContext, evaluate
from registry.roots.aside import Aside
from registry.roots.directory import FileRemoval
from registry.roots.objectstore import ObjectRemoval

Tier = Literal["fast", "durable"]
GOOD = ("published", "verified")


@dataclass(frozen=True, kw_only=True)
class TierDecision:
    """One step's copy on the plan's tier: kept (with why) or deleted; ``ends_step``: it is the step's last copy."""

    step: int
    action: Literal["keep", "delete"]
    reasons: tuple[str, ...]
    path: str               # the copy, relative to its tier's root
    location: str           # the copy's replica location: the durable tier, this fast tier, or this host's cache
    total_bytes: int
    ends_step: bool = False
    condemned: bool = False  # this host's copy is marked corrupt: deleted whatever the policy keeps

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "action": self.action, "reasons": list(self.reasons), "path": self.path,
                "location": self.location, "total_bytes": self.total_bytes, "ends_step": self.ends_step,
                "condemned": self.condemned}


@dataclass(frozen=True, kw_only=True)
class TierResult:
    """What :meth:`TierPlan.execute` did (the one engine's outcome, as plain retention's
    :class:`~registry.ops.retention.RetentionResult` says it): ``deleted``, the steps whose copy on this tier it
    marked deleted (a removal that failed then is in ``errors``: the next retention or fsck finishes it);
    ``ended``, those whose last copy that was; steps skipped (why); ``healed``: steps whose earlier, interrupted
    deletion on this tier it finished first; ``checkouts_removed``: the registry-owned checkouts of the run whose
    lease had expired, removed first."""

    tier: Tier
    deleted: tuple[int, ...] = ()
    ended: tuple[int, ...] = ()
    skipped: Mapping[int, str] = field(default_factory=dict)
    errors: Mapping[int, str] = field(default_factory=dict)
    bytes_freed: int = 0
    healed: tuple[int, ...] = ()
    checkouts_removed: tuple[Path, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"tier": self.tier, "deleted": list(self.deleted), "ended": list(self.ended),
                "skipped": {str(k): v for k, v in self.skipped.items()}, "bytes_freed": self.bytes_freed,
                "healed": list(self.healed), "errors": {str(k): v for k, v in self.errors.items()},
                "checkouts_removed": [str(p) for p in self.checkouts_removed]}


@dataclass(frozen=True, kw_only=True)
class TierPlan:
    """What a policy keeps and deletes on one tier of a run; changes nothing until :meth:`execute`."""

    run: str
    tier: Tier
    decisions: tuple[TierDecision, ...]
    catalog: Catalog = field(repr=False)
    tiers: Tiers = field(repr=False)
    aside: Aside = field(repr=False)  # the root's: where it keeps a run's policy folds
    policy: Policy = field(repr=False)
    now: datetime
    allow_missing_metrics: bool = False
    keep_fork_parents: bool = True   # see registry.ops.retention.protections
    actor: str | None = None
    protect: Mapping[int, str] = field(default_factory=dict)
    anchorable: tuple[int, ...] = ()  # see registry.ops.retention.anchorable

    @property
    def keep(self) -> Mapping[int, str]:
        return {d.step: "; ".join(d.reasons) for d in self.decisions if d.action == "keep"}

    @property
    def delete(self) -> Mapping[int, str]:
        return {d.step: "; ".join(d.reasons) for d in self.decisions if d.action == "delete"}

    @property
    def bytes_freed(self) -> int:
        return sum(d.total_bytes for d in self.decisions if d.action == "delete")

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "tier": self.tier, "decisions": [d.to_json() for d in self.decisions],
                "anchorable": list(self.anchorable),
                "bytes_freed": self.bytes_freed}

    def execute(self, progress: ProgressFn | None = None) -> TierResult:
        """Delete what the plan deletes, each copy checked again first (see the module's docstring); ``progress``
        hears of each copy as it goes, as plain retention's does."""
        return _execute(self, progress)


@dataclass(frozen=True)
class _Copies:
    fast: dict[int, str]                    # this fast root's good copy of each step (its path)
    cached: dict[int, str]                  # this host's good cached copy of each step (its path)
    durable: dict[int, ReplicaInfo]         # the durable copy's row, whatever its status
    others: dict[int, list[ReplicaInfo]]    # good copies on other fast roots (never a host's cache)
    condemned: dict[int, str]               # this fast root's copy marked corrupt, still there (its path)
    parts: dict[int, str]                   # this host's good part of a step published from several hosts


def _copies(tiers: Tiers, snap: RunSnapshot, copies: Sequence[ReplicaInfo]) -> _Copies:
    """Per step: this fast root's copy, this host's cached copy, the durable copy, the good copies on other fast
    roots, and this fast root's condemned copy."""
    digest = {c.step: c.manifest_sha256 for c in snap.checkpoints}
    fast: dict[int, str] = {}
    cached: dict[int, str] = {}
    durable: dict[int, ReplicaInfo] = {}
    others: dict[int, list[ReplicaInfo]] = {}
    condemned: dict[int, str] = {}
    parts: dict[int, str] = {}
    for r in copies:
        if r.manifest_sha256 != digest.get(r.step):
            continue
        if r.location == DURABLE:
            durable[r.step] = r
        elif r.location == tiers.location:
            if r.status in GOOD and (tiers.fast.root / r.path).is_dir():
                fast[r.step] = r.path
            elif r.status == "corrupt" and (tiers.fast.root / r.path).is_dir():
                condemned[r.step] = r.path
        elif r.location == tiers.cache_location:
            if r.status in GOOD and (tiers.fast.root / r.path).is_dir():
                cached[r.step] = r.path
        elif r.location == tiers.part_location:
            if r.status in GOOD and (tiers.fast.root / r.path).is_dir():
                parts[r.step] = r.path
        elif r.status in GOOD and r.location.startswith(FAST):
            others.setdefault(r.step, []).append(r)
    for c in snap.checkpoints:  # the step's own directory here (a step published before its copies were recorded)
        rel = c.path.as_posix()
        # a row here for that directory that is not a good copy of this payload: gone, or an older payload of the
        # step (published again on another host since), which is no copy of it
        gone = any(r.step == c.step and r.location == tiers.location and r.path == rel
                   and (r.status not in GOOD or r.manifest_sha256 != c.manifest_sha256) for r in copies)
        if c.step not in fast and not gone and (tiers.fast.root / rel).is_dir():
            fast[c.step] = rel
    return _Copies(fast=fast, cached=cached, durable=durable, others=others, condemned=condemned, parts=parts)


@dataclass(frozen=True)
class _Side:
    """What differs between the tiers a plan decides for: which copies are its candidates, which copy must
    stand for one of them to go alone, and what it keeps whatever the policy says."""

    name: Tier
    other: str              # the location whose good copy lets one of this tier's copies go alone
    durable: bool           # its copies are prefixes on the durable tier (else directories under this fast root)
    keeps_unreplicated: bool  # a copy with no durable copy yet stays unless forced

    def on_tier(self, tiers: Tiers, found: _Copies) -> dict[int, tuple[str, str]]:
        """step -> the location and path of its copy on this tier."""
        if self.durable:
            return {s: (DURABLE, r.path) for s, r in found.durable.items() if r.status in ("verified", "corrupt")}
        return {**{s: (tiers.part_location, p) for s, p in found.parts.items()},
                **{s: (tiers.cache_location, p) for s, p in found.cached.items()},
                **{s: (tiers.location, p) for s, p in found.fast.items()}}

    def condemned(self, found: _Copies) -> dict[int, str]:
        """This host's copies marked corrupt, which go whatever the policy keeps (only fast copies are judged so
        here: a durable copy marked corrupt is retention's like any other)."""
        return {} if self.durable else found.condemned

    def protections(self, found: _Copies) -> dict[int, str]:
        """What this tier keeps besides the run's invariants: the newest verified durable copy."""
        good = [s for s, r in found.durable.items() if r.status == "verified"] if self.durable else []
        return {max(good): "@latest-durable"} if good else {}

    def other_good(self, step: int, found: _Copies) -> bool:
        """Whether another good copy of ``step`` stands on the other tier."""
        if self.durable:
            return step in found.fast
        return step in found.durable and found.durable[step].status == "verified"


SIDES = {"fast": _Side(name="fast", other=DURABLE, durable=False, keeps_unreplicated=True),
         "durable": _Side(name="durable", other=FAST, durable=True, keeps_unreplicated=False)}


def make_tier_plan(catalog: Catalog, tiers: Tiers, run: str, policy: Policy, *, tier: Tier, aside: Aside,
                   force: bool = False, now: datetime | None = None,
                   protect: Mapping[int, str] = MappingProxyType({}), allow_missing_metrics: bool = False,
                   keep_fork_parents: bool = True, actor: str | None = None) -> TierPlan:
    """Decide what ``policy`` keeps and deletes of ``run``'s copies on ``tier`` (see the module's docstring);
    ``aside``: the root's (:meth:`registry.roots.base.Root.aside`), where the folds of the steps it ends are."""
    now, protect = plan_options(run, policy, now=now, protect=protect)
    if tier not in SIDES:
        raise PolicyError(f"tier must be 'fast' or 'durable', got {tier!r}")
    side = SIDES[tier]
    snap = RetentionCatalog(catalog).snapshot(run)
    found = _copies(tiers, snap, ReplicaCatalog(catalog).replicas(run))
    durable, others = found.durable, found.others
    condemned = side.condemned(found)
    extra = dict(protect)
    for step, why in side.protections(found).items():
        extra[step] = "; ".join(r for r in (extra.get(step), why) if r)
    protected = protections(snap, extra, keep_fork_parents=keep_fork_parents)
    on_tier = side.on_tier(tiers, found)
    candidates = [c for c in snap.checkpoints if c.step in on_tier and c.status in CANDIDATES]
    kept = evaluate(policy, [c.under(tiers.fast.root) for c in candidates],
                    RetentionContext(run=run, now=now, protected=protected,
                                     allow_missing_metrics=allow_missing_metrics))
    # a step with no copy on this tier stays whatever this plan does: what stays keeps its delta chain
    staying = {*kept, *(c.step for c in snap.checkpoints if c.step not in on_tier)}
    before, protected = protected, with_bases(snap, protected, staying)
    decisions = [TierDecision(step=c.step, action="delete", reasons=("this host's copy is corrupt",),
                              path=condemned[c.step], location=tiers.location, total_bytes=c.total_bytes,
                              condemned=True)
                 for c in snap.checkpoints if c.step in condemned and c.status in CANDIDATES]
    for c in candidates:
        # a cached copy is disposable: its deletion needs no other copy and never ends the step
        disposable = on_tier[c.step][0] == tiers.cache_location
        other_good = disposable or bool(others.get(c.step)) or side.other_good(c.step, found)
        # a durable copy deleted on purpose is none the step waits for (the queue never takes it again)
        waiting = c.step not in durable or durable[c.step].status != "deleted"
        reasons = tuple(r for r in (protected.get(c.step), kept.get(c.step)) if r)
        keep = c.step in protected or c.step in kept
        if (not keep and side.keeps_unreplicated and not other_good and waiting and not force
                and c.status != Status.CORRUPT):
            keep, reasons = True, ("not durable yet (force=True deletes it, and the step with it)",)
        decisions.append(TierDecision(step=c.step, action="keep" if keep else "delete",
                                      reasons=reasons or (("kept",) if keep else ("not kept by the policy",)),
                                      location=on_tier[c.step][0], path=on_tier[c.step][1],
                                      total_bytes=c.total_bytes,
                                      ends_step=not keep and not other_good))
    decisions.sort(key=lambda d: d.step)
    return TierPlan(run=run, tier=tier, decisions=tuple(decisions), catalog=catalog, tiers=tiers, aside=aside,
                    policy=policy, now=now, allow_missing_metrics=allow_missing_metrics,
                    keep_fork_parents=keep_fork_parents, actor=actor,
                    protect=MappingProxyType(dict(protect)), anchorable=anchorable(snap, before, protected, staying))


@dataclass(frozen=True)
class LeftCopy:
    """A copy of this host marked ``deleted`` and what still holds its payload: its directory, or retired siblings
    of it (a removal killed between the rename and the delete)."""

    copy: ReplicaInfo
    paths: tuple[Path, ...]

    def remove(self) -> bool:
        """Remove each of ``paths`` that still holds the copy's payload (digest-checked); True when one went."""
        done = False
        for path in self.paths:
            if parse_hidden(path.name) is None:
                done = remove_checkpoint_dir(path, self.copy.manifest_sha256) or done
            elif manifest_digest(path) == self.copy.manifest_sha256:
                remove_tree(path)
                done = True
        return done


def unfinished_here(tiers: Tiers, copies: Sequence[ReplicaInfo]) -> list[LeftCopy]:
    """This host's copies (fast, in its cache, or its parts) marked ``deleted`` whose payload is still on disk: a
    retention killed after its mark or after its rename, or a removal that failed. Checked by the manifest's
    digest, so a directory that holds another payload of the step now is never one. Each directory is listed
    once."""
    mine = (tiers.location, tiers.cache_location, tiers.part_location)
    retired: dict[Path, dict[str, list[Path]]] = {}

    def siblings(where: Path) -> list[Path]:
        if where.parent not in retired:
            found: dict[str, list[Path]] = {}
            try:
                names = sorted(os.listdir(where.parent))
            except (FileNotFoundError, NotADirectoryError):
                names = []
            for name in names:
                hidden = parse_hidden(name)
                if hidden is not None and hidden[1] == "retired":
                    found.setdefault(hidden[0], []).append(where.parent / name)
            retired[where.parent] = found
        return retired[where.parent].get(where.name, [])

    left = []
    for c in copies:
        if c.location not in mine or c.status != "deleted" or c.manifest_sha256 is None:
            continue
        where = tiers.fast.root / c.path
        paths = tuple(p for p in (where, *siblings(where)) if manifest_digest(p) == c.manifest_sha256)
        if paths:
            left.append(LeftCopy(c, paths))
    return left


def finish_interrupted(tiers: Tiers, catalog: Catalog, run: str, *, tier: Tier) -> tuple[set[int], dict[int, str]]:
    """What an earlier retention of ``run`` on ``tier`` left when it was killed after its mark (or failed to remove),
    finished as a plain root's next gc finishes it: on the fast tier the directories of the steps it ended
    (:meth:`~registry.roots.directory.FileRemoval.finish`, digest-checked) and this host's copies marked deleted
    (:func:`unfinished_here`); on the durable tier the prefixes of copies marked deleted that are still listed
    (:meth:`~registry.roots.objectstore.ObjectRemoval.finish`). Steps healed, and errors."""
    copies = ReplicaCatalog(catalog).replicas(run)
    if not SIDES[tier].durable:
        healed, errors = FileRemoval(tiers.fast.root).finish(run, RetentionCatalog(catalog).deleted_rows(run))
        for left in unfinished_here(tiers, copies):
            try:
                if left.remove():
                    healed.add(left.copy.step)
            except OSError as exc:
                errors[left.copy.step] = f"cannot remove {left.paths[0]}: {exc.strerror or exc}"
        return healed, errors
    # a durable copy is an attempt prefix, never reused: the object store's own finishing (one listing of the run)
    gone = [c for c in copies if c.location == DURABLE and c.status == "deleted"]
    return ObjectRemoval(tiers.durable).finish(run, gone)


def _remove(tiers: Tiers, durable: bool, path: str, digest: str | None) -> None:
    if durable:
        remove_prefix(tiers.durable, path, point="gc-after-retire")
    else:
        remove_checkpoint_dir(tiers.fast.root / path, digest)


@dataclass(frozen=True)
class TierDeletion:
    """A tier's :class:`~registry.ops.retention.Deletion`: what the one retention engine
    (:func:`~registry.ops.retention.execute_deletions`) asks of storage when it executes a :class:`TierPlan`.
    A step's last copy goes as the deletion of the step (the marking takes every copy with it); a copy alone by
    compare-and-set on the step's copies, while the other tier's good copy stands (a fast one: any fast tier's,
    never a host's cache)."""

    plan: TierPlan

    @property
    def durable(self) -> bool:
        return SIDES[self.plan.tier].durable

    def _on_tier(self) -> dict[int, TierDecision]:
        return {d.step: d for d in self.plan.decisions}

    def candidates(self, snap: RunSnapshot) -> list[CheckpointInfo]:
        on_tier = self._on_tier()
        return [c.under(self.plan.tiers.fast.root) for c in snap.checkpoints
                if c.step in on_tier and c.status in CANDIDATES]

    def delete_copy(self, run: str, doomed: Doomed, digest: str | None) -> str | None:
        assert doomed.location is not None and doomed.path is not None
        disposable = doomed.condemned or doomed.location == self.plan.tiers.cache_location
        return ReplicaCatalog(self.plan.catalog).copy_deleted(
            run, doomed.step, location=doomed.location, path=doomed.path, manifest_sha256=digest,
            require=None if disposable else SIDES[self.plan.tier].other, actor=self.plan.actor,
            condemned=doomed.condemned)

    def remove_copy(self, doomed: Doomed, digest: str | None) -> None:
        assert doomed.path is not None
        _remove(self.plan.tiers, self.durable, doomed.path, digest)

    def locate(self, info: CheckpointInfo) -> CheckpointInfo:
        d = self._on_tier().get(info.step)
        if d is not None and self.durable:
            return replace(info, path=Path(d.path), url=self.plan.tiers.durable.url(d.path))
        return info.under(self.plan.tiers.fast.root) if d is None else replace(
            info, path=self.plan.tiers.fast.root / d.path)

    def held(self, info: CheckpointInfo) -> Mapping[Any, int]:
        return {}  # a copy's size is its step's

    def freed_bytes(self, doomed: Sequence[CheckpointInfo]) -> int:
        return sum(i.total_bytes for i in doomed)

    def kept_bytes(self, kept: Sequence[CheckpointInfo]) -> int:
        return sum(i.total_bytes for i in kept)

    def shared_bytes(self, doomed: Sequence[Path], kept: Sequence[Path]) -> int:
        return 0

    def guard(self, catalog: Catalog, run: str, doomed: Sequence[int]) -> dict[int, str]:
        # as on a plain root: the steps that stay keep the run's fallback apart (dedup's links on the fast tier)
        return guard_fallback(catalog, self.plan.tiers.fast.root, run, doomed)

    def after_mark(self, catalog: Catalog, run: str) -> None:
        restore_fallback(catalog, self.plan.tiers.fast.root, run, after="tier retention ended a step")

    def reclaim(self, catalog: Catalog, run: str) -> tuple[Path, ...]:
        return reclaim_checkouts(catalog, self.plan.tiers.fast.root, run=run)

    def remove(self, row: DeletedRow, doomed: Doomed) -> bool:
        """The step ended with this tier's copy: that copy (a copy with no row yet, of a step published before
        its copies were recorded, is recorded deleted first), and the step's other copies this host reaches: the
        durable one, this host's others. A claim still uploading is its replicator's to remove (it finds the
        claim deleted when it commits; fsck removes it after a replicator that died)."""
        plan = self.plan
        assert doomed.location is not None and doomed.path is not None
        ReplicaCatalog(plan.catalog).copy_deleted(plan.run, row.step, location=doomed.location, path=doomed.path,
                                                  manifest_sha256=row.manifest_sha256, require=None,
                                                  actor=plan.actor)
        found = [(self.durable, doomed.path, row.manifest_sha256)]
        for copy in row.copies:
            durable = copy.location == DURABLE
            here = copy.location in (plan.tiers.location, plan.tiers.cache_location, plan.tiers.part_location)
            if (durable and copy.status != "pending" or here) \
                    and (durable, copy.path) not in [(x, p) for x, p, _ in found]:
                found.append((durable, copy.path, copy.manifest_sha256))
        for durable, path, held in found:
            _remove(plan.tiers, durable, path, held)
        return True

    def finish(self, run: str, rows: Sequence[DeletedRow]) -> tuple[set[int], dict[int, str]]:
        return finish_interrupted(self.plan.tiers, self.plan.catalog, run, tier=self.plan.tier)

    def remove_aside(self, rel: str) -> bool:
        return self.plan.aside.delete(rel)


def _execute(plan: TierPlan, progress: ProgressFn | None = None) -> TierResult:
    done = execute_deletions(
        RetentionScope(catalog=plan.catalog, storage=TierDeletion(plan), actor=plan.actor), run=plan.run,
        deletions=[Doomed(step=d.step, why="; ".join(d.reasons), ends_step=d.ends_step, condemned=d.condemned,
                          location=d.location, path=d.path, total_bytes=d.total_bytes)
                   for d in plan.decisions if d.action == "delete"],
        policy=plan.policy, now=plan.now, protect=plan.protect, allow_missing_metrics=plan.allow_missing_metrics,
        keep_fork_parents=plan.keep_fork_parents, progress=progress, unit="copies")
    return TierResult(tier=plan.tier, deleted=done.deleted, ended=done.ended, skipped=done.skipped,
                      errors=done.errors, bytes_freed=done.bytes_freed, healed=done.healed,
                      checkouts_removed=done.checkouts_removed)


__all__ = ["LeftCopy", "TierDecision", "TierDeletion", "TierPlan", "TierResult", "finish_interrupted",
           "make_tier_plan", "unfinished_here"]
