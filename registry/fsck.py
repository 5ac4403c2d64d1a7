"""``fsck``: reconcile the catalog with the checkpoint root after any crash.

The publish protocol (design section 4) is a two-phase commit between the
catalog and the filesystem, and retention is a mark-then-delete; a process
killed at any moment leaves one of a handful of states. fsck looks at both
sides, names each state it finds with one of the kinds below, and with
``repair=True`` moves it to the state the interrupted operation would have
reached (or rolled back to). Without ``repair`` it changes nothing at all.

The disk is scanned *before* the catalog is read: a staging directory seen on
disk therefore belongs to a claim the snapshot already shows, so fsck never
mistakes a brand-new writer's directory for an abandoned one. Every catalog
repair is compare-and-set on the status and writer fsck saw, so a writer that
takes a step over in the meantime wins and fsck leaves it alone.

| kind | found | repair |
|---|---|---|
| uncommitted-publish | staging row (dead writer), valid final dir | roll forward: published, or verified when checksums pass |
| invalid-staged-payload | staging row (dead writer), final dir fails its manifest or checksums | mark corrupt |
| abandoned-publish | staging row (dead writer), no final dir | remove staging dirs, mark failed |
| abandoned-staging | ``.tmp-`` dir with no live writer | remove |
| interrupted-overwrite | ``.retired-`` dir, no final dir | restore it (then the row is judged as above) |
| leftover-retired | ``.retired-`` dir next to its final dir | remove |
| unfinished-deletion | ``deleted`` row whose final or retired dir exists | remove the directories |
| unregistered-checkpoint | final dir with no row (or a failed row) | adopt if its manifest and checksums are valid, else report |
| missing-payload | published/verified row, no directory | mark corrupt |
| damaged-payload | published/verified row, files differ from the catalog | mark corrupt |

A staging row whose writer is alive is reported in ``in_progress`` and left alone
(on another host: one it refreshed within ``registry.store.STALE_AFTER``).
A repair skipped because the row changed after the snapshot (a writer took the
step over, or a dead writer's last COMMIT was still completing on the server)
is listed in ``failures``; running fsck again judges the new state.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.catalog import Catalog, FileRecord
from registry.catalog.fsck import PayloadRecord, RowState, record_payload, set_status_if, snapshot
from registry.crashpoints import crashpoint
from registry.errors import CorruptCheckpointError
from registry.manifest import MANIFEST, META, Manifest, read_manifest
from registry.refs import RUN_NAME_RE, step_dirname
from registry.store import fsync_dir, verify_directory, writer_alive

_STEP_RE = re.compile(r"step-(\d{8,20})")
_HIDDEN_RE = re.compile(r"\.step-(\d{8,20})\.(tmp|retired)-.+")
MAX_META_BYTES = 1 << 20

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
}


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One inconsistency between the catalog and the disk."""

    kind: str
    run: str
    step: int
    path: Path
    detail: str
    repair: str | None  # what --repair does about it; None: it can only be reported

    def __post_init__(self) -> None:
        if self.kind not in REPAIRS and self.kind != "in-progress":
            raise ValueError(f"unknown fsck problem kind {self.kind!r}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "run": self.run, "step": self.step, "path": str(self.path),
                "detail": self.detail, "repair": self.repair}

    def __str__(self) -> str:
        return f"{self.run}@{self.step}: {self.kind}: {self.detail}"


@dataclass(frozen=True, kw_only=True)
class FsckReport:
    """What fsck found (``problems``) and what it fixed (``repaired``, a subset)."""

    problems: tuple[Problem, ...] = ()
    repaired: tuple[Problem, ...] = ()
    in_progress: tuple[Problem, ...] = ()
    failures: tuple[str, ...] = ()  # repairs that were attempted and failed, one line each
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


@dataclass(kw_only=True)
class _Step:
    """Everything fsck found on disk for one (run, step)."""

    final: Path | None = None
    tmp: list[Path] = field(default_factory=list)
    retired: list[Path] = field(default_factory=list)


def _scan(root: Path) -> dict[tuple[str, int], _Step]:
    """Step directories under ``root``, without following symlinks or reading any file."""
    found: dict[tuple[str, int], _Step] = {}
    try:
        runs = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return found
    for run_entry in runs:
        if not run_entry.is_dir(follow_symlinks=False) or not RUN_NAME_RE.fullmatch(run_entry.name):
            continue
        for entry in sorted(os.scandir(run_entry.path), key=lambda e: e.name):
            if not entry.is_dir(follow_symlinks=False):
                continue
            if m := _STEP_RE.fullmatch(entry.name):
                found.setdefault((run_entry.name, int(m.group(1))), _Step()).final = Path(entry.path)
            elif m := _HIDDEN_RE.fullmatch(entry.name):
                slot = found.setdefault((run_entry.name, int(m.group(1))), _Step())
                (slot.tmp if m.group(2) == "tmp" else slot.retired).append(Path(entry.path))
    return found


def _read_meta(directory: Path, manifest: Manifest) -> dict[str, Any]:
    """The few numbers a repair records from meta.json; anything odd gives defaults."""
    if META not in manifest.files:
        return {}
    try:
        fd = os.open(directory / META, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(MAX_META_BYTES + 1)[:MAX_META_BYTES])
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: doc[k] for k in ("epoch", "consumed_samples")
            if isinstance(doc.get(k), int) and not isinstance(doc.get(k), bool) and doc[k] >= 0}


def _check_payload(directory: Path, *, checksums: bool) -> tuple[PayloadRecord | None, str]:
    """A record of a valid payload, or (None, why it is not valid)."""
    if directory.is_symlink():
        return None, "the directory is a symlink"
    try:
        manifest, digest = read_manifest(directory)
    except CorruptCheckpointError as exc:
        return None, str(exc)
    status = "published"
    if checksums:
        problems = verify_directory(directory, manifest)
        if problems:
            return None, f"{problems[0].name}: {problems[0].problem}"
        status = "verified"
    else:
        for name, entry in manifest.files.items():
            path = directory / name
            if path.is_symlink() or not path.is_file():
                return None, f"{name}: missing or not a regular file"
            if path.stat().st_size != entry.size:
                return None, f"{name}: size {path.stat().st_size}, manifest says {entry.size}"
    meta = _read_meta(directory, manifest)
    total = manifest.total_bytes + (directory / MANIFEST).stat().st_size
    return PayloadRecord(status=status, manifest_sha256=digest, total_bytes=total,
                         files=[FileRecord(name=f.name, size=f.size, sha256=f.sha256)
                                for f in manifest.files.values()],
                         epoch=meta.get("epoch", 0), consumed_samples=meta.get("consumed_samples", 0),
                         optimizer_step=manifest.optimizer_step, policy_version=manifest.policy_version), ""


def _matches_catalog(directory: Path, row: RowState, *, checksums: bool) -> str:
    """Why a live row's directory does not hold what the catalog recorded ('' when it does)."""
    record, why = _check_payload(directory, checksums=checksums)
    if record is None:
        return why
    if row.manifest_sha256 and record.manifest_sha256 != row.manifest_sha256:
        return "manifest does not match the catalog's record"
    if row.files and {f.name: (f.size, f.sha256) for f in record.files} != row.files:
        return "file table does not match the catalog's"
    return ""


def _newest(paths: list[Path]) -> Path:
    def mtime(p: Path) -> float:
        try:
            return (p / MANIFEST).stat().st_mtime
        except OSError:
            return float("-inf")
    return max(paths, key=lambda p: (mtime(p), p.name))


class Fsck:
    """One pass of fsck over a catalog and a root. Use :func:`run_fsck`."""

    def __init__(self, *, catalog: Catalog, root: Path, repair: bool, checksums: bool, actor: str) -> None:
        self.catalog = catalog
        self.root = root
        self.repair = repair
        self.checksums = checksums
        self.actor = actor
        self.problems: list[Problem] = []
        self.repaired: list[Problem] = []
        self.in_progress: list[Problem] = []
        self.failures: list[str] = []

    def _found(self, kind: str, run: str, step: int, path: Path, detail: str, *,
               repairable: bool = True) -> Problem:
        problem = Problem(kind=kind, run=run, step=step, path=path, detail=detail,
                          repair=REPAIRS[kind] if repairable else None)
        self.problems.append(problem)
        return problem

    def _fix(self, problem: Problem, action: Any) -> bool:
        """Run one repair; a repair that fails is recorded, never raised, so fsck fixes what it can."""
        if not self.repair or problem.repair is None:
            return False
        try:
            done = action()
        except (OSError, CorruptCheckpointError) as exc:
            self.failures.append(f"{problem}: repair failed: {exc}")
            return False
        if done is False:
            self.failures.append(f"{problem}: skipped, the catalog row changed meanwhile")
            return False
        self.repaired.append(problem)
        return True

    def _remove(self, paths: list[Path]) -> None:
        for path in paths:
            shutil.rmtree(path)

    def run(self) -> FsckReport:
        disk = _scan(self.root)  # before the snapshot: see the module docstring
        rows = {(r.run, r.step): r for r in snapshot(self.catalog)}
        for key in sorted(set(disk) | set(rows)):
            self._step(key[0], key[1], rows.get(key), disk.get(key, _Step()))
        return FsckReport(problems=tuple(self.problems), repaired=tuple(self.repaired),
                          in_progress=tuple(self.in_progress), failures=tuple(self.failures),
                          rows_checked=len(rows), checksums=self.checksums)

    def _step(self, run: str, step: int, row: RowState | None, found: _Step) -> None:
        canonical = self.root / run / step_dirname(step)
        final = self.root / row.path if row is not None else canonical
        if row is not None and final != canonical and found.final is None and final.is_dir():
            found.final = final  # a row pointing outside the standard layout (an import)
        staging_live = row is not None and row.status == "staging" and writer_alive(row.writer, row.updated_at)

        for tmp in found.tmp:
            if staging_live:
                continue
            p = self._found("abandoned-staging", run, step, tmp, "staging directory with no live writer")
            self._fix(p, lambda tmp=tmp: self._remove([tmp]))
        if staging_live:
            assert row is not None
            self.in_progress.append(Problem(kind="in-progress", run=run, step=step, path=final,
                                            detail=f"being published by {row.writer}", repair=None))
            return

        if row is not None and row.status == "deleted":
            leftovers = ([found.final] if found.final is not None else []) + found.retired
            if leftovers:
                p = self._found("unfinished-deletion", run, step, leftovers[0],
                                f"deleted step still has {len(leftovers)} director{'y' if len(leftovers) == 1 else 'ies'}")
                self._fix(p, lambda: self._remove(leftovers))
            return

        payload_dir = found.final
        if found.retired:
            if found.final is None:
                chosen = _newest(found.retired)
                p = self._found("interrupted-overwrite", run, step, chosen,
                                "a retired payload and no final directory: crash between the two renames")
                if self._fix(p, lambda: self._restore(chosen, final)):
                    payload_dir = final
                elif self.repair:
                    return  # the restore failed: judging the row by a directory not in place would be wrong
                else:
                    payload_dir = chosen  # judge the row by what a repair would restore
                rest = [r for r in found.retired if r != chosen]
            else:
                rest = found.retired
            for old in rest:
                p = self._found("leftover-retired", run, step, old, "retired payload next to its replacement")
                self._fix(p, lambda old=old: self._remove([old]))

        if row is None or row.status == "failed":
            if payload_dir is not None:
                self._unregistered(run, step, row, payload_dir, canonical)
            return
        if row.status == "staging":
            self._dead_staging(row, payload_dir, final)
        elif row.status in ("published", "verified"):
            if payload_dir is None:
                p = self._found("missing-payload", run, step, final, f"{row.status} step has no directory")
                self._fix(p, lambda: set_status_if(self.catalog, row, "corrupt", kind=p.kind, actor=self.actor,
                                                   reason=p.detail))
                return
            why = _matches_catalog(payload_dir, row, checksums=self.checksums)
            if why:
                p = self._found("damaged-payload", run, step, payload_dir, why)
                self._fix(p, lambda: set_status_if(self.catalog, row, "corrupt", kind=p.kind, actor=self.actor,
                                                   reason=why))

    def _restore(self, retired: Path, final: Path) -> None:
        os.replace(retired, final)
        fsync_dir(final.parent)
        crashpoint("fsck-after-restore")

    def _dead_staging(self, row: RowState, payload_dir: Path | None, final: Path) -> None:
        if payload_dir is None:
            p = self._found("abandoned-publish", row.run, row.step, final,
                            f"staging row of dead writer {row.writer} and no directory: crash before the rename")
            self._fix(p, lambda: set_status_if(self.catalog, row, "failed", kind=p.kind, actor=self.actor,
                                               dead_writer=row.writer))
            return
        record, why = _check_payload(payload_dir, checksums=True)
        if record is None:
            p = self._found("invalid-staged-payload", row.run, row.step, payload_dir,
                            f"staging row of dead writer {row.writer}; its directory is invalid: {why}")
            self._fix(p, lambda: set_status_if(self.catalog, row, "corrupt", kind=p.kind, actor=self.actor,
                                               reason=why))
            return
        p = self._found("uncommitted-publish", row.run, row.step, payload_dir,
                        f"payload in place but writer {row.writer} died before the catalog commit")
        self._fix(p, lambda: record_payload(self.catalog, row, run=row.run, step=row.step, path=row.path,
                                            payload=record, kind=p.kind, actor=self.actor,
                                            dead_writer=row.writer))

    def _unregistered(self, run: str, step: int, row: RowState | None, payload_dir: Path, canonical: Path) -> None:
        record, why = _check_payload(payload_dir, checksums=True)
        what = "no catalog row" if row is None else "a failed catalog row"
        if record is None:
            self._found("unregistered-checkpoint", run, step, payload_dir,
                        f"directory with {what} cannot be adopted: {why}", repairable=False)
            return
        p = self._found("unregistered-checkpoint", run, step, payload_dir, f"valid checkpoint with {what}")
        self._fix(p, lambda: record_payload(self.catalog, row, run=run, step=step,
                                            path=payload_dir.relative_to(self.root).as_posix(),
                                            payload=record, kind=p.kind, actor=self.actor))


def run_fsck(*, catalog: Catalog, root: Path, repair: bool = False, checksums: bool = False,
             actor: str) -> FsckReport:
    """Check (and with ``repair`` fix) every step under ``root`` against ``catalog``.

    ``checksums`` re-hashes every live step's files instead of checking sizes
    and the manifest digest; roll-forward and adoption always hash.
    """
    return Fsck(catalog=catalog, root=root, repair=repair, checksums=checksums, actor=actor).run()


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


__all__ = ["FsckReport", "Problem", "REPAIRS", "iter_lines", "run_fsck"]
