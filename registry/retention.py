"""Retention policies: plain Python, importing neither torch nor SQL.

A :class:`Policy` answers one question: of these checkpoints, which do you
want to keep, and why? Policies combine with ``|`` (keep what any keeps), and
a script can define its own by subclassing :class:`Policy`. Everything a
policy does not keep among the ``published``, ``verified`` and ``corrupt``
steps of the run is deleted, except what the invariants protect whatever the
policy says: ``@latest``, ``@latest-published``, tagged steps, ``staging`` rows
and steps under an unexpired reader lease.

``Registry.plan_retention`` turns a policy into a plan and
:meth:`~registry.ops.retention.RetentionPlan.execute` carries it out
(:mod:`registry.ops.retention`).
"""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from registry.errors import PolicyError, RegistryError, UnknownMetricError
from registry.format.refs import check_metric_key, close_match
from registry.records import LIVE, RANKABLE, CheckpointInfo, human_bytes


class RetentionWarning(RuntimeWarning):
    """Retention after a publish failed; the publish itself succeeded."""


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"{what} must be a positive integer, got {value!r}")
    return value


def _unread(_checkpoint: CheckpointInfo) -> Mapping[Any, int]:
    return {}


@dataclass(frozen=True, kw_only=True)
class RetentionContext:
    """What a policy may know besides the checkpoints themselves."""

    run: str
    now: datetime
    protected: Mapping[int, str]   # steps the invariants keep whatever the policy says, with why
    allow_missing_metrics: bool = False   # a KeepBest over a metric no checkpoint has keeps nothing, silently
    # the inodes a checkpoint's files occupy (any key naming one inode), each with its size on disk;
    # empty when they cannot be read. The plan fills it from the step directories.
    held: Callable[[CheckpointInfo], Mapping[Any, int]] = field(default=_unread, repr=False, compare=False)


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
    many steps by dedup counts once. What a step holds is the context's
    ``held`` (the plan reads it from the step directories); a step whose
    inodes cannot be read costs its catalog size.
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
        counted: set[Any] = set()

        def cost(c: CheckpointInfo) -> int:
            held = context.held(c)
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


__all__ = ["AnyOf", "KeepBest", "KeepEvery", "KeepLast", "KeepNewerThan", "KeepPolicyVersions", "KeepTagged",
           "MISSING_METRIC_HINT", "MaxBytes", "Policy", "RetentionContext", "RetentionWarning", "evaluate"]
