"""Retention: plain-Python policies, a frozen plan, and a crash-safe ``execute``.

A :class:`Policy` answers one question: of these checkpoints, which do you
want to keep, and why? Policies combine with ``|`` (keep what any keeps), and
a script can define its own by subclassing :class:`Policy`. Everything a
policy does not keep among the ``published``, ``verified`` and ``corrupt``
steps of the run is deleted, except what the invariants protect whatever the
policy says: ``@latest``, ``@latest-published``, tagged steps, ``staging`` rows
and steps under an unexpired reader lease.

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
it vanishes from its final path at once; (3) the retired copy is removed.
``execute`` first finishes any such interrupted deletion of the run, so
running gc again (or ``fsck --repair``) completes the job.
"""

from __future__ import annotations

import difflib
import logging
import os
import shutil
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from registry.catalog import Catalog
from registry.catalog.retention import CANDIDATES, RetentionCatalog, RunSnapshot
from registry.crashpoints import crashpoint
from registry.errors import CorruptCheckpointError, PolicyError, RegistryError, UnknownMetricError
from registry.format.layout import hidden_sibling, scan_run
from registry.format.manifest import MANIFEST, MAX_MANIFEST_BYTES, digest_bytes, open_regular
from registry.records import LIVE, RANKABLE, CheckpointInfo, Status, human_bytes
from registry.format.refs import check_metric_key, check_run_name, close_match
from registry.fs import dedup as dedup_files
from registry.fs.store import fsync_dir
from registry.ops.protocol import keep_fallback_apart
from registry.catalog.fallback import newest_verified
from registry.ops.checkouts import reclaim as reclaim_checkouts
from registry.progress import Counter, ProgressFn

log = logging.getLogger(__name__)


class RetentionWarning(RuntimeWarning):
    """Retention after a publish failed; the publish itself succeeded."""


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"{what} must be a positive integer, got {value!r}")
    return value


# ---------------------------------------------------------------------------- policies


@dataclass(frozen=True, kw_only=True)
class RetentionContext:
    """What a policy may know besides the checkpoints themselves."""

    run: str
    now: datetime
    protected: Mapping[int, str]   # steps the invariants keep whatever the policy says, with why
    allow_missing_metrics: bool = False   # a KeepBest over a metric no checkpoint has keeps nothing, silently


class Policy(ABC):
    """Which checkpoints of a run to keep. Subclass it and implement :meth:`keep`.

    ``checkpoints`` are the deletion candidates (``published``, ``verified``,
    ``corrupt``), ascending by step, each with its current metrics, tags and
    size. Return a mapping ``step -> reason`` (or an iterable of steps). A
    policy should be a pure function of its arguments: ``execute`` calls it
    again inside the write transaction that marks deletions.
    """

    @abstractmethod
    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        """The steps to keep, each with a short human reason."""

    def __or__(self, other: object) -> Policy:
        if not isinstance(other, Policy):
            return NotImplemented
        return AnyOf(self, other)


def evaluate(policy: Policy, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> dict[int, str]:
    """Run ``policy`` and check what it returned; a misbehaving policy is a :class:`PolicyError`."""
    try:
        result = policy.keep(checkpoints, context)
    except RegistryError:
        raise
    except Exception as exc:
        raise PolicyError(f"retention policy {policy!r} failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(result, Mapping):
        items = list(result.items())
    elif isinstance(result, Iterable) and not isinstance(result, (str, bytes)):
        items = [(step, repr(policy)) for step in result]
    else:
        raise PolicyError(f"retention policy {policy!r} returned {type(result).__name__}, "
                          "not a mapping of step -> reason")
    steps = {c.step for c in checkpoints}
    kept: dict[int, str] = {}
    for step, reason in items:
        if isinstance(step, bool) or not isinstance(step, int):
            raise PolicyError(f"retention policy {policy!r} returned step {step!r}, not an integer")
        if step in steps:
            kept[step] = str(reason)
    return kept


@dataclass(frozen=True, repr=False)
class AnyOf(Policy):
    """Keep what any of ``policies`` keeps (what ``a | b`` builds); reasons are joined."""

    policies: tuple[Policy, ...]

    def __init__(self, *policies: Policy) -> None:
        flat: list[Policy] = []
        for p in policies:
            if not isinstance(p, Policy):
                raise PolicyError(f"cannot combine {p!r}: not a retention Policy")
            flat.extend(p.policies if isinstance(p, AnyOf) else (p,))
        if not flat:
            raise PolicyError("AnyOf needs at least one policy")
        object.__setattr__(self, "policies", tuple(flat))

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        kept: dict[int, list[str]] = {}
        for p in self.policies:
            for step, reason in evaluate(p, checkpoints, context).items():
                kept.setdefault(step, []).append(reason)
        return {step: "; ".join(reasons) for step, reasons in kept.items()}

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.policies)


@dataclass(frozen=True, repr=False)
class KeepLast(Policy):
    """The ``n`` newest loadable (``published``/``verified``) steps: what you can resume from."""

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "KeepLast(n)")

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        live = [c.step for c in checkpoints if c.status in LIVE]
        return {step: f"last {self.n}" for step in live[-self.n:]}

    def __repr__(self) -> str:
        return f"KeepLast({self.n})"


MISSING_METRIC_HINT = ("pass missing_ok=True to the policy, or allow_missing_metrics=True to the plan, "
                       "if that is intended")


@dataclass(frozen=True, repr=False)
class KeepBest(Policy):
    """The ``k`` best steps by ``metric`` at their own step, ranked exactly like ``RUN@best:METRIC``.

    When no candidate of the run has ``metric`` at all (a typo, or a metric
    nobody logged), ``keep`` raises :class:`UnknownMetricError` naming the
    metrics the run does have, rather than keeping nothing and letting the
    rest of the plan delete the real best; a run whose candidates are all
    protected anyway has nothing to lose and is not refused.
    ``missing_ok=True`` (or the plan's ``allow_missing_metrics``) says that
    is intended: it then keeps nothing.
    """

    k: int
    metric: str
    mode: Literal["min", "max"] = "min"
    missing_ok: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if isinstance(self.k, str) and isinstance(self.metric, int) and not isinstance(self.metric, bool):
            # KeepBest("eval/loss", 2), as --keep-best eval/loss=2 reads: the types say which is which
            k, metric = self.metric, self.k
            object.__setattr__(self, "k", k)
            object.__setattr__(self, "metric", metric)
        if not isinstance(self.metric, str) or isinstance(self.k, bool) or not isinstance(self.k, int):
            raise PolicyError(f"KeepBest takes the count and the metric, as in KeepBest(2, 'eval/loss'); "
                              f"got KeepBest({self.k!r}, {self.metric!r})")
        _positive_int(self.k, "KeepBest(k)")
        check_metric_key(self.metric)
        if self.mode not in ("min", "max"):
            raise PolicyError(f"KeepBest mode must be 'min' or 'max', got {self.mode!r}")
        if not isinstance(self.missing_ok, bool):
            raise PolicyError(f"KeepBest missing_ok must be True or False, got {self.missing_ok!r}")

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        deletable = any(c.step not in context.protected for c in checkpoints)
        if deletable and not (self.missing_ok or context.allow_missing_metrics) \
                and not any(self.metric in c.metrics for c in checkpoints):
            raise self._unknown(checkpoints, context.run)
        ranked = [c for c in checkpoints if c.status in RANKABLE and self.metric in c.metrics]
        sign = 1.0 if self.mode == "min" else -1.0
        ranked.sort(key=lambda c: (sign * c.metrics[self.metric], -c.step))
        return {c.step: f"best {i + 1}/{self.k} {self.metric}={c.metrics[self.metric]:.6g} ({self.mode})"
                for i, c in enumerate(ranked[:self.k])}

    def _unknown(self, checkpoints: Sequence[CheckpointInfo], run: str) -> UnknownMetricError:
        def likeness(key: str) -> float:
            return difflib.SequenceMatcher(None, self.metric, key).ratio()
        known = tuple(sorted(sorted({k for c in checkpoints for k in c.metrics}), key=lambda k: -likeness(k)))
        if not known:
            listed = "its checkpoints have no metrics"
        else:
            more = f" and {len(known) - 10} more" if len(known) > 10 else ""
            close = close_match(self.metric, known)
            guess = f"did you mean {close!r}? " if close is not None else ""
            listed = f"{guess}its checkpoints have {', '.join(known[:10])}{more}"
        return UnknownMetricError(f"{self!r}: no checkpoint of run {run!r} has metric {self.metric!r}; "
                                  f"{listed}; {MISSING_METRIC_HINT}", metric=self.metric, known=known, run=run)

    def __repr__(self) -> str:
        return (f"KeepBest({self.k}, {self.metric!r}{'' if self.mode == 'min' else ', mode=' + repr(self.mode)}"
                f"{', missing_ok=True' if self.missing_ok else ''})")


@dataclass(frozen=True, repr=False)
class KeepEvery(Policy):
    """Steps that are a multiple of ``n_steps`` (a sparse long-term history)."""

    n_steps: int

    def __post_init__(self) -> None:
        _positive_int(self.n_steps, "KeepEvery(n_steps)")

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        return {c.step: f"every {self.n_steps}" for c in checkpoints if c.step % self.n_steps == 0}

    def __repr__(self) -> str:
        return f"KeepEvery({self.n_steps})"


@dataclass(frozen=True, repr=False)
class KeepTagged(Policy):
    """Tagged steps (any tag, or only ``names``). Tags protect anyway; this makes it explicit."""

    names: frozenset[str]

    def __init__(self, *names: str) -> None:
        object.__setattr__(self, "names", frozenset(names))

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        return {c.step: "tagged " + ",".join(c.tags) for c in checkpoints
                if c.tags and (not self.names or self.names.intersection(c.tags))}

    def __repr__(self) -> str:
        return f"KeepTagged({', '.join(map(repr, sorted(self.names)))})"


@dataclass(frozen=True)
class KeepNewerThan(Policy):
    """Steps created less than ``age`` before the plan (a grace period for evaluators)."""

    age: timedelta

    def __post_init__(self) -> None:
        if not isinstance(self.age, timedelta) or self.age <= timedelta(0):
            raise PolicyError(f"KeepNewerThan needs a positive timedelta, got {self.age!r}")

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        cutoff = context.now - self.age
        return {c.step: f"newer than {self.age}" for c in checkpoints
                if c.created_at is not None and c.created_at >= cutoff}


@dataclass(frozen=True, repr=False)
class KeepPolicyVersions(Policy):
    """Steps of the ``last`` highest policy versions and/or of the listed ``versions`` (RL rollouts).

    Like :class:`KeepBest`, it refuses (:class:`UnknownMetricError`) a run
    none of whose candidates records a policy version, unless ``missing_ok``.
    """

    last: int | None
    versions: frozenset[int]
    missing_ok: bool

    def __init__(self, last: int | None = None, *, versions: Iterable[int] = (), missing_ok: bool = False) -> None:
        if last is not None:
            _positive_int(last, "KeepPolicyVersions(last)")
        chosen = frozenset(versions)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in chosen):
            raise PolicyError("KeepPolicyVersions versions must be non-negative integers, "
                              f"got {sorted(chosen, key=str)}")
        if last is None and not chosen:
            raise PolicyError("KeepPolicyVersions needs last=N or versions=[...]")
        if not isinstance(missing_ok, bool):
            raise PolicyError(f"KeepPolicyVersions missing_ok must be True or False, got {missing_ok!r}")
        object.__setattr__(self, "last", last)
        object.__setattr__(self, "versions", chosen)
        object.__setattr__(self, "missing_ok", missing_ok)

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        if any(c.step not in context.protected for c in checkpoints) \
                and not (self.missing_ok or context.allow_missing_metrics) \
                and all(c.policy_version is None for c in checkpoints):
            raise UnknownMetricError(f"{self!r}: no checkpoint of run {context.run!r} has a policy version "
                                     f"(publish(..., policy_version=N) records one); {MISSING_METRIC_HINT}",
                                     metric="policy_version", run=context.run)
        wanted = set(self.versions)
        if self.last is not None:
            present = sorted({c.policy_version for c in checkpoints
                              if c.policy_version is not None and c.status in LIVE})
            wanted.update(present[-self.last:])
        return {c.step: f"policy version {c.policy_version}" for c in checkpoints if c.policy_version in wanted}

    def __repr__(self) -> str:
        parts = ([str(self.last)] if self.last is not None else []) + (
            [f"versions={sorted(self.versions)}"] if self.versions else []) + (
            ["missing_ok=True"] if self.missing_ok else [])
        return f"KeepPolicyVersions({', '.join(parts)})"


@dataclass(frozen=True)
class MaxBytes(Policy):
    """A byte budget: keep the newest steps that fit in ``max_bytes``, deleting the oldest first.

    The steps the invariants protect count against the budget first (they stay
    anyway, so the run may still exceed it). ``keep`` narrows the candidates:
    ``MaxBytes(n, keep=KeepLast(5) | KeepBest(1, "loss"))`` keeps what that
    policy keeps, minus its oldest steps while the run is over budget; without
    ``keep`` every loadable step is eligible. Once one step does not fit, no older
    step is kept either, so what is deleted is always the oldest.

    Bytes are physical: a step costs the bytes of the inodes it holds that no
    newer kept (or protected) step already holds, so a file stored once for
    many steps by dedup counts once. That is read from the step directories
    (the one home of which names share an inode); a directory that cannot be
    read costs its catalog size.
    """

    max_bytes: int
    keep_policy: Policy | None = None

    def __init__(self, max_bytes: int, *, keep: Policy | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise PolicyError(f"MaxBytes needs a non-negative number of bytes, got {max_bytes!r}")
        if keep is not None and not isinstance(keep, Policy):
            raise PolicyError(f"MaxBytes(keep=...) must be a retention Policy, got {keep!r}")
        object.__setattr__(self, "max_bytes", max_bytes)
        object.__setattr__(self, "keep_policy", keep)

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        eligible = (evaluate(self.keep_policy, checkpoints, context) if self.keep_policy is not None
                    else {c.step: "" for c in checkpoints if c.status in LIVE})
        counted: set[dedup_files.Inode] = set()

        def cost(c: CheckpointInfo) -> int:
            held = dedup_files.inodes(Path(c.path))
            if not held:
                return c.total_bytes
            new = sum(size for key, size in held.items() if key not in counted)
            counted.update(held)
            return new
        used = sum(cost(c) for c in checkpoints if c.step in context.protected)
        kept: dict[int, str] = {}
        for c in sorted(checkpoints, key=lambda c: -c.step):
            if c.step in context.protected or c.step not in eligible:
                continue
            more = cost(c)
            if used + more > self.max_bytes:
                break
            used += more
            why = f"within {human_bytes(self.max_bytes)}"
            kept[c.step] = f"{eligible[c.step]}, {why}" if eligible[c.step] else why
        return kept

    def __repr__(self) -> str:
        return f"MaxBytes({self.max_bytes}{'' if self.keep_policy is None else f', keep={self.keep_policy!r}'})"


# ---------------------------------------------------------------------------- plan


@dataclass(frozen=True, kw_only=True)
class RetentionScope:
    """What retention acts on: a catalog, the checkpoint root its paths are relative to, and who acts."""

    catalog: Catalog
    root: Path
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
    path: Path

    def __post_init__(self) -> None:
        if self.action not in ("keep", "delete") or (self.action == "delete" and self.protected):
            raise PolicyError(f"invalid retention decision for step {self.step}: {self.action}")

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "status": self.status, "action": self.action, "reasons": list(self.reasons),
                "protected": self.protected, "total_bytes": self.total_bytes, "path": str(self.path)}


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
    if keep_fork_parents:
        present = {c.step for c in snap.checkpoints}
        for step, children in snap.forks.items():
            if step in present:
                more = f" and {len(children) - 3} more" if len(children) > 3 else ""
                why.setdefault(step, []).append(f"parent of fork {', '.join(children[:3])}{more}")
    for step, reason in extra.items():
        why.setdefault(step, []).append(reason)
    return {step: "; ".join(reasons) for step, reasons in why.items()}


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
                "decisions": [d.to_json() for d in self.decisions]}

    def execute(self, *, progress: ProgressFn | None = None) -> RetentionResult:
        """Delete what the plan deletes and is still deletable now; see the module docstring.

        ``progress`` hears of each checkpoint removed (see :mod:`registry.progress`).
        """
        if self.scope is None:
            raise PolicyError("this plan is not bound to a registry; make it with Registry.plan_retention")
        return _execute(self.scope, self, progress)


def _candidates(scope: RetentionScope, snap: RunSnapshot) -> list[CheckpointInfo]:
    return [c.under(scope.root) for c in snap.checkpoints if c.status in CANDIDATES]


def make_plan(scope: RetentionScope, run: str, policy: Policy, *, now: datetime | None = None,
              protect: Mapping[int, str] = MappingProxyType({}),
              allow_missing_metrics: bool = False, keep_fork_parents: bool = True) -> RetentionPlan:
    """Decide, without changing anything, what ``policy`` keeps and deletes in ``run``.

    A policy that ranks by a metric no candidate has is refused
    (:class:`UnknownMetricError`) unless ``allow_missing_metrics``.
    """
    check_run_name(run)
    if not isinstance(policy, Policy):
        raise PolicyError(f"a retention policy must be a registry.retention.Policy, got {policy!r}")
    if now is None:
        now = datetime.now(timezone.utc)
    elif now.tzinfo is None:
        raise PolicyError("now= must be a timezone-aware datetime")
    snap = RetentionCatalog(scope.catalog).snapshot(run)
    protected = protections(snap, protect, keep_fork_parents=keep_fork_parents)
    candidates = _candidates(scope, snap)
    kept = evaluate(policy, candidates, RetentionContext(run=run, now=now, protected=protected,
                                                         allow_missing_metrics=allow_missing_metrics))
    decisions = []
    for c in snap.checkpoints:
        keep = c.step in protected or c.step in kept or c.status not in CANDIDATES
        reasons = tuple(r for r in (protected.get(c.step), kept.get(c.step)) if r)
        if not keep:
            reasons = ("not kept by the policy",)
        decisions.append(Decision(step=c.step, status=c.status, action="keep" if keep else "delete",
                                  reasons=reasons or ("kept",),
                                  protected=c.step in protected, total_bytes=c.total_bytes,
                                  path=scope.root / c.path))
    return RetentionPlan(run=run, policy=policy, decisions=tuple(decisions), now=now,
                         protect=MappingProxyType(dict(protect)), allow_missing_metrics=allow_missing_metrics,
                         keep_fork_parents=keep_fork_parents, scope=scope,
                         physical_freed=dedup_files.freed_bytes(d.path for d in decisions if d.action == "delete"),
                         physical_kept=_held_bytes([d for d in decisions if d.action == "keep"]))


def _held_bytes(decisions: Sequence[Decision]) -> int:
    """Bytes on disk of ``decisions``' directories, each inode once (a catalog size where one cannot be read)."""
    seen: dict[dedup_files.Inode, int] = {}
    unread = 0
    for d in decisions:
        held = dedup_files.inodes(d.path)
        if not held:
            unread += d.total_bytes
        seen.update(held)
    return sum(seen.values()) + unread


# ---------------------------------------------------------------------------- execute


def remove_tree(path: Path) -> None:
    """``shutil.rmtree`` that tolerates a concurrent gc (or fsck) removing the same tree.

    Whatever vanishes under it was being removed anyway; any other error is raised.
    """
    def vanished_ok(exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _fn, _path, exc: vanished_ok(exc))
    else:
        shutil.rmtree(path, onerror=lambda _fn, _path, info: vanished_ok(info[1]))


def manifest_digest(directory: Path) -> str | None:
    """The sha256 of ``directory``'s manifest as it is now; None when there is none to read.

    Opened like any checkpoint file: never through a symlink, never blocking on a FIFO.
    """
    try:
        with os.fdopen(open_regular(directory, MANIFEST, what="manifest"), "rb") as f:
            return digest_bytes(f.read(MAX_MANIFEST_BYTES + 1))
    except (OSError, CorruptCheckpointError):
        return None


def remove_checkpoint_dir(final: Path, manifest_sha256: str | None = None) -> bool:
    """Rename ``final`` to a hidden retired sibling (atomic for readers), then remove it.

    False when there was nothing to remove (or a concurrent gc renamed it
    first). ``manifest_sha256`` is the digest of the payload the catalog
    marked deleted: a step re-published in the meantime (a ``deleted`` row can
    be claimed again) has installed a different manifest, and that directory
    is put back instead of removed. See :func:`retire_and_remove` for which.
    """
    return retire_and_remove(final, manifest_sha256) == "removed"


def retire_and_remove(final: Path, manifest_sha256: str | None) -> Literal["removed", "absent", "kept"]:
    """:func:`remove_checkpoint_dir`, saying what happened: ``kept`` is a different payload put back.

    The digest is read before the rename too, so a payload re-published long
    after the caller read the row is never hidden from readers, even briefly;
    read again after the rename, it catches one installed in between.
    """
    if not final.exists():
        return "absent"
    if manifest_sha256 is not None and manifest_digest(final) not in (None, manifest_sha256):
        return "kept"
    retired = hidden_sibling(final, "retired")
    try:
        os.replace(final, retired)
    except FileNotFoundError:
        return "absent"
    digest = manifest_digest(retired) if manifest_sha256 is not None else None
    if digest is not None and digest != manifest_sha256:
        try:
            os.replace(retired, final)
        except OSError:
            pass  # something new is in place already; fsck sorts out the retired copy
        return "kept"
    fsync_dir(final.parent)
    crashpoint("gc-after-retire")
    remove_tree(retired)
    return "removed"


def finish_interrupted(scope: RetentionScope, run: str) -> tuple[tuple[int, ...], dict[int, str]]:
    """Remove what a killed gc left of ``deleted`` rows: final or retired directories."""
    rows = RetentionCatalog(scope.catalog).deleted_rows(run)
    deleted = {r.step for r in rows}
    healed: set[int] = set()
    errors: dict[int, str] = {}
    for r in rows:
        try:
            if remove_checkpoint_dir(scope.root / r.path, r.manifest_sha256):
                healed.add(r.step)
        except OSError as exc:
            errors[r.step] = f"cannot remove {scope.root / r.path}: {exc.strerror or exc}"
    run_dir = scope.root / run
    if deleted and run_dir.is_dir():
        for entry in scan_run(run_dir):
            if entry.kind == "retired" and entry.step in deleted:
                try:
                    remove_tree(entry.path)
                    healed.add(entry.step)
                except OSError as exc:
                    errors[entry.step] = f"cannot remove {entry.path}: {exc.strerror or exc}"
    return tuple(sorted(healed)), errors


def guard_fallback(scope: RetentionScope, run: str, doomed: Sequence[int]) -> dict[int, str]:
    """Before ``doomed`` go: the two newest verified steps left must share no inode (see ``registry.fs.dedup``).

    The newer one gets its own copy of what they share. When that copy cannot
    be made (a full disk), the doomed steps among today's two newest verified
    are kept instead, with why: they are the independent copy the fallback needs.
    """
    if not doomed:
        return {}
    try:
        keep_fallback_apart(scope.catalog, scope.root, run, excluding=doomed)
        return {}
    except OSError as exc:
        why = f"kept as the fallback's own copy: could not copy a shared file ({exc.strerror or exc})"
        log.warning("retention of %s: %s", run, why)
        return {s.step: why for s in newest_verified(scope.catalog, run, n=2) if s.step in doomed}


def _execute(scope: RetentionScope, plan: RetentionPlan, progress: ProgressFn | None = None) -> RetentionResult:
    healed, errors = finish_interrupted(scope, plan.run)
    # first: an expired checkout made of hard links would keep a deleted step's bytes on disk
    reclaimed = reclaim_checkouts(scope.catalog, scope.root, run=plan.run)
    planned = sorted(plan.delete)
    skipped: dict[int, str] = {}
    fallback = guard_fallback(scope, plan.run, planned)

    def decide(snap: RunSnapshot) -> dict[int, str]:
        skipped.clear()  # the transaction may be retried: start over each time
        protected = protections(snap, {**plan.protect, **fallback}, keep_fork_parents=plan.keep_fork_parents)
        by_step = {c.step: c for c in snap.checkpoints}
        kept = evaluate(plan.policy, _candidates(scope, snap),
                        RetentionContext(run=plan.run, now=plan.now, protected=protected,
                                         allow_missing_metrics=plan.allow_missing_metrics))
        doomed: dict[int, str] = {}
        for step in planned:
            c = by_step.get(step)
            if c is None or c.status not in CANDIDATES:
                skipped[step] = f"no longer a candidate ({c.status if c is not None else 'deleted or failed'})"
            elif step in protected:
                skipped[step] = f"now protected: {protected[step]}"
            elif step in kept:
                skipped[step] = f"now kept by the policy: {kept[step]}"
            else:
                doomed[step] = plan.delete[step]
        return doomed

    marked = RetentionCatalog(scope.catalog).mark_deleted(plan.run, decide, actor=scope.actor)
    if marked:
        crashpoint("gc-after-mark")
    try:  # whatever changed since the guard above (a step published, verified or repaired meanwhile)
        keep_fallback_apart(scope.catalog, scope.root, plan.run)
    except OSError as exc:
        log.warning("retention of %s: could not give the newest verified step its own copy of a file it "
                    "shares with the next: %s", plan.run, exc.strerror or exc)
    freed = dedup_files.freed_bytes(scope.root / r.path for r in marked)
    counter = Counter(progress, task="gc", total=len(marked), unit="checkpoints")
    for row in marked:
        counter.advance(0, item=f"{plan.run}@{row.step}")
        log.info("retention deleted %s@%d (%d bytes): %s", plan.run, row.step, row.total_bytes,
                 plan.delete.get(row.step, "not kept"))
        try:
            remove_checkpoint_dir(scope.root / row.path, row.manifest_sha256)
        except OSError as exc:
            errors[row.step] = f"cannot remove {scope.root / row.path}: {exc.strerror or exc}"
        counter.advance(1, item=f"{plan.run}@{row.step}")
    return RetentionResult(run=plan.run, deleted=tuple(r.step for r in marked), skipped=dict(skipped),
                           bytes_freed=freed, healed=healed, errors=errors, checkouts_removed=reclaimed)


__all__ = ["AnyOf", "Decision", "KeepBest", "KeepEvery", "KeepLast", "KeepNewerThan", "KeepPolicyVersions",
           "KeepTagged", "MISSING_METRIC_HINT", "MaxBytes", "Policy", "RetentionContext", "RetentionPlan",
           "RetentionResult", "RetentionScope", "RetentionWarning", "evaluate", "finish_interrupted", "guard_fallback",
           "make_plan", "protections"]
