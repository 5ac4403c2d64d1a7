"""What fsck finds and does, whatever the root: the kinds of problem, the report, and one pass's bookkeeping.

:class:`FsckPass` keeps the problems, repairs, steps in flight and failures
of one pass; a verdict about a row is recorded only if the row, read again
after the storage was checked, is still as the snapshot showed it
(compare-and-set), and each repair runs in isolation. The pass over a root is
:mod:`registry.ops.fsck`, the one judge of what the root's scan reports (:mod:`registry.roots.scan`); on a tiered
root, :mod:`registry.ops.tierfsck` runs it over the fast directory and over the durable tier's copies, and judges
this host's copies.
"""

from __future__ import annotations

import re
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from registry.catalog import Catalog, FileRecord
from registry.catalog.fsck import RowState, unchanged
from registry.catalog.records import PayloadRecord, PolicyRecord
from registry.errors import CorruptCheckpointError
from registry.format.manifest import DELTA, POLICY_DELTA, WEIGHTS, Manifest
from registry.format.refs import MAX_STEP
from registry.progress import Counter, ProgressFn

log = logging.getLogger(__name__)
T = TypeVar("T")

# On a root with tiers, asked before a step is condemned for this host's copy at ``directory``:
# (run, step, directory, the payload's manifest digest, why) -> True when the damage was recorded against that
# copy alone, another good copy of the same payload standing (see registry.ops.tiers.mark_fast_copy).
CopyOnly = Callable[[str, int, Path, str, str], bool]


def read_again(first: BaseException | str, read: Callable[[], T], *, what: str) -> T:
    """The rule before every verdict on bytes: ``what`` differed as received (``first`` says how), so it is read
    once more from storage before anything is marked.

    Returns the re-read's result when it is intact: the first mismatch was this host's or the wire's, not
    corruption, and nothing is marked. Raises the re-read's ``CorruptCheckpointError`` when the mismatch stands:
    that is corruption, for the caller to record by compare-and-set on the digest it read. Any other failure of
    the re-read (the server's, this host's) is raised as it is: no verdict can rest on it.
    """
    log.warning("%s: %s; reading it again from storage before marking anything", what, first)
    result = read()
    log.warning("%s read intact from storage again: the mismatch was local or in transit, nothing was marked", what)
    return result


def damage_again(first: str, look: Callable[[], str], *, what: str) -> str:
    """:func:`read_again` for a check that says why the bytes differ instead of raising (``look()``: '' when they
    do not): why the re-read still differs, or '' when it read intact."""
    def again() -> None:
        why = look()
        if why:
            raise CorruptCheckpointError(why)
    try:
        read_again(first, again, what=what)
    except CorruptCheckpointError as exc:
        return str(exc)
    return ""


def condemned(catalog: Catalog, root: Path | None, run: str) -> None:
    """A step of ``run`` was just condemned and left the verified chain: the fallback is kept apart as after a
    deletion (:func:`registry.ops.protocol.restore_fallback`)."""
    from registry.ops.protocol import restore_fallback  # the dedup machinery, only once a step is condemned
    restore_fallback(catalog, root, run, after="a step was condemned")


REPAIRS = {
    "uncommitted-publish": "roll forward",
    "invalid-staged-payload": "mark corrupt",
    "abandoned-publish": "remove staging dirs, mark failed",
    "abandoned-staging": "remove",
    "interrupted-overwrite": "restore the retired directory",
    "leftover-retired": "remove",
    "unfinished-deletion": "remove the directories",
    "unregistered-checkpoint": "adopt",
    "missing-payload": "mark corrupt",
    "damaged-payload": "mark corrupt",
    "expired-checkout": "remove the checkout",
    "orphan-fold": "remove it",
    "orphan-prefix": "delete its objects",
    "incomplete-upload": "abort the upload",
    # a root with a durable tier (registry.ops.tierfsck)
    "only-on-fast-tier": "replicate it",
    "missing-durable-copy": "mark the copy corrupt, replicate again from the fast copy",
    "damaged-durable-copy": "mark the copy corrupt, replicate again from the fast copy",
    "corrupt-durable-copy": "replicate again from the fast copy",
    "corrupt-fast-copy": "remove it, copy it again from the durable copy",
    "orphan-durable-prefix": "delete its objects",
    "superseded-fast-copy": "remove the older payload",
    "abandoned-download": "remove it",
    "stale-cached-copy": "remove it",
    "unfinished-copy-deletion": "remove the copy's files",
    "leftover-part": "remove it",
    "superseded-part": "remove the older payload",
    "uncommitted-replication": "record the durable copy (roll forward)",
    "abandoned-replication": "give up the claim, replicate again",
    "invalid-replication": "mark the copy corrupt",
    "interrupted-replication": "point the claim back at its whole upload",
    "unrecorded-durable-copy": "record it as the step's durable copy",
}
#: kinds fsck only reports: deciding about them needs a person (the detail says what to do)
REPORTED = frozenset({"corrupt-step"})


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One inconsistency between the catalog and the disk."""

    kind: str
    run: str
    step: int
    path: Path
    detail: str
    repair: str | None  # what --repair does about it; None: it can only be reported
    url: str | None = None  # on an object-store root: where (``path`` is then relative to the root)

    def __post_init__(self) -> None:
        if self.kind not in REPAIRS and self.kind not in REPORTED and self.kind != "in-progress":
            raise ValueError(f"unknown fsck problem kind {self.kind!r}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "run": self.run, "step": self.step, "path": str(self.path),
                "detail": self.detail, "repair": self.repair, "url": self.url}

    def __str__(self) -> str:
        return f"{self.run}@{self.step}: {self.kind}: {self.detail}"


@dataclass(frozen=True, kw_only=True)
class FsckReport:
    """What fsck found (``problems``) and what it fixed (``repaired``, a subset)."""

    problems: tuple[Problem, ...] = ()
    repaired: tuple[Problem, ...] = ()
    in_progress: tuple[Problem, ...] = ()
    failures: tuple[str, ...] = ()  # checks and repairs that failed, one line each
    rows_checked: int = 0
    checksums: bool = False

    def __post_init__(self) -> None:
        if not set(self.repaired) <= set(self.problems):
            raise ValueError("an fsck report can only repair problems it found")

    @property
    def unrepaired(self) -> tuple[Problem, ...]:
        done = set(self.repaired)
        return tuple(p for p in self.problems if p not in done)

    @property
    def clean(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"clean": self.clean, "rows_checked": self.rows_checked, "checksums": self.checksums,
                "problems": [p.to_json() for p in self.problems],
                "repaired": [p.to_json() for p in self.repaired],
                "unrepaired": [p.to_json() for p in self.unrepaired],
                "in_progress": [p.to_json() for p in self.in_progress],
                "failures": list(self.failures)}



def one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def meta_numbers(doc: Any) -> dict[str, int]:
    """The few numbers a repair records from a meta.json document; anything odd gives defaults."""
    if not isinstance(doc, dict):
        return {}
    return {k: doc[k] for k in ("epoch", "consumed_samples")
            if isinstance(doc.get(k), int) and not isinstance(doc.get(k), bool) and 0 <= doc[k] <= MAX_STEP}


def policy_of(manifest: Manifest) -> PolicyRecord | None:
    """How a policy step found in storage stores its version, as its manifest says (a publish's commit records
    it in ``policy_steps``; a repair recovers it): a delta names its base and version by their digests."""
    if manifest.policy_version is None:
        return None
    doc = manifest.extra_fields.get(POLICY_DELTA)
    if DELTA in manifest.files and isinstance(doc, dict):
        base, full = doc.get("base_sha256"), doc.get("full_sha256")
        if isinstance(base, str) and isinstance(full, str) and _SHA256.fullmatch(base) and _SHA256.fullmatch(full):
            return PolicyRecord(kind="delta", full_sha256=full, base_sha256=base)
        return None
    weights = manifest.files.get(WEIGHTS)
    return PolicyRecord(kind="full", full_sha256=weights.sha256) if weights is not None else None


_SHA256 = re.compile(r"[0-9a-f]{64}")


def found_payload(manifest: Manifest, digest: str, manifest_size: int, *, status: str,
                  meta: dict[str, int]) -> PayloadRecord:
    """What a repair records about a valid payload found in storage (rolled forward, adopted)."""
    return PayloadRecord(status=status, manifest_sha256=digest, total_bytes=manifest.total_bytes + manifest_size,
                         files=[FileRecord(name=f.name, size=f.size, sha256=f.sha256)
                                for f in manifest.files.values()],
                         epoch=meta.get("epoch", 0), consumed_samples=meta.get("consumed_samples", 0),
                         optimizer_step=manifest.optimizer_step, policy_version=manifest.policy_version,
                         policy=policy_of(manifest))


Repair = Callable[[], "bool | str | None"]


class _RootVanished(Exception):
    """The root went away while fsck ran: every later "missing" would be the mount's, not the step's."""


class FsckPass:
    """What one pass of fsck found and did, whatever the root: problems, repairs, steps in flight, failures.

    A subclass judges its kind of root; :meth:`_found` records a verdict
    only if the row is still as seen (compare-and-set on the state read), and
    :meth:`_fix` runs one repair in isolation.
    """

    def __init__(self, *, catalog: Catalog, repair: bool, checksums: bool, actor: str,
                 progress: ProgressFn | None = None) -> None:
        self.catalog = catalog
        self.counter = Counter(progress, task="fsck", total=None)
        self.repair = repair
        self.checksums = checksums
        self.actor = actor
        self.problems: list[Problem] = []
        self.repaired: list[Problem] = []
        self.in_progress: list[Problem] = []
        self.failures: list[str] = []

    def _root_present(self) -> bool:
        """Whether the root is still there; past a root that went away every step would look missing."""
        return True

    def _unchanged(self, row: RowState) -> bool:
        """Whether ``row`` is still as seen (the judge asks its row source: a step's row, or a copy's)."""
        return unchanged(self.catalog, row)

    def _found(self, kind: str, run: str, step: int, path: Path, detail: str, *, repairable: bool = True,
               row: RowState | None = None, still: Callable[[], bool] | None = None,
               url: str | None = None) -> Problem | None:
        """Record a problem; with ``row``, only if the row is still as seen now that the storage was checked.

        ``still`` then looks at the storage once more: a payload briefly out of
        place while the catalog was read (gc checking what it may remove) is
        not the missing or damaged payload it looked like.
        """
        if not self._root_present():
            raise _RootVanished()
        if row is not None and (not self._unchanged(row) or (still is not None and not still())):
            self.in_progress.append(Problem(kind="in-progress", run=run, step=step, path=path, repair=None,
                                            detail=f"changed while fsck checked it ({kind}); run fsck again",
                                            url=url))
            return None
        problem = Problem(kind=kind, run=run, step=step, path=path, detail=detail,
                          repair=REPAIRS[kind] if repairable and kind in REPAIRS else None, url=url)
        self.problems.append(problem)
        return problem

    def _fix(self, problem: Problem | None, action: Repair) -> bool:
        """Run one repair; a repair that fails is recorded, never raised, so fsck fixes what it can.

        ``action`` returns False (or why, as a string) when it changed nothing
        because the step is no longer as found.
        """
        if problem is None or not self.repair or problem.repair is None:
            return False
        try:
            done = action()
        except Exception as exc:  # isolation: whatever one repair hits, the others still run
            self.failures.append(f"{problem}: repair failed: {one_line(exc)}")
            return False
        if done is False or isinstance(done, str):
            self.failures.append(f"{problem}: skipped, {done or 'the catalog row changed meanwhile'}")
            return False
        self.repaired.append(problem)
        return True

    def report(self, rows_checked: int) -> FsckReport:
        return FsckReport(problems=tuple(self.problems), repaired=tuple(self.repaired),
                          in_progress=tuple(self.in_progress), failures=tuple(self.failures),
                          rows_checked=rows_checked, checksums=self.checksums)


def iter_lines(report: FsckReport) -> Iterator[str]:
    """The human-readable report the CLI prints."""
    done = set(report.repaired)
    for p in report.problems:
        state = "repaired" if p in done else ("not repaired" if p.repair else "needs attention")
        yield f"{p.run}@{p.step}  {p.kind:<24} {state:<15} {p.detail}"
    for p in report.in_progress:
        yield f"{p.run}@{p.step}  {p.kind:<24} {'left alone':<15} {p.detail}"
    for line in report.failures:
        yield f"failure: {line}"



__all__ = ["REPAIRS", "REPORTED", "FsckPass", "FsckReport", "Problem", "Repair", "condemned", "damage_again",
           "found_payload", "iter_lines", "meta_numbers", "one_line", "read_again"]
