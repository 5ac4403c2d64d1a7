"""``fsck``: reconcile the catalog with the checkpoint root after any crash.

The publish protocol (docs/reference/protocol.md) is a two-phase commit between the
catalog and the filesystem, and retention is a mark-then-delete; a process
killed at any moment leaves one of a handful of states. fsck looks at both
sides, names each state it finds with one of the kinds below, and with
``repair=True`` moves it to the state the interrupted operation would have
reached (or rolled back to). Without ``repair`` it changes nothing at all.

The disk is scanned *before* the catalog is read: a staging directory seen on
disk therefore belongs to a claim the snapshot already shows, so fsck never
mistakes a brand-new writer's directory for an abandoned one. A row's own
directory is looked at again *after* the snapshot, and every verdict about a
row is kept only if the row, read again once the files were checked, is still
as the snapshot showed it (status, writer, last update, manifest digest): a
publish, overwrite or gc that moves while fsck looks is never taken for damage
(the step is listed in ``in_progress``; fsck run again judges it). Every catalog
repair is compare-and-set on that same state, so a writer that takes a step
over in the meantime wins and fsck leaves it alone. Each step is checked, and
each repair made, in isolation: one that fails is listed in ``failures`` (its
problem stays unrepaired) and the rest still run. A root that goes away while
fsck runs (an unmounted share) stops it before its next verdict: past that
point every step would look missing.

| kind | found | repair |
|---|---|---|
| uncommitted-publish | staging row (dead writer), valid final dir | roll forward: published (verified if hashed) |
| invalid-staged-payload | staging row (dead writer), final dir fails its manifest or checksums | mark corrupt |
| abandoned-publish | staging row (dead writer), no final dir | remove staging dirs, mark failed |
| abandoned-staging | ``.tmp-`` dir with no live writer | remove |
| interrupted-overwrite | ``.retired-`` dir, no final dir | restore it (then the row is judged as above) |
| leftover-retired | ``.retired-`` dir next to its final dir | remove |
| unfinished-deletion | ``deleted`` row whose final or retired dir exists | remove the directories |
| unregistered-checkpoint | final dir with no row (or a failed row) | adopt if valid and its step fits the catalog |
| missing-payload | published/verified row, no directory | mark corrupt |
| damaged-payload | published/verified row, files differ from the catalog | mark corrupt |
| corrupt-step | corrupt row | none: says what to do (restore, ``registry verify``; or gc) |
| expired-checkout | registry-owned checkout whose reader lease expired or was released | remove it |
| orphan-fold | a file under a run's ``.policy-folds/`` with no ``verified`` fold row of live steps | remove it |

On an ``s3://`` root (:mod:`registry.ops.objectfsck`) the same kinds name the
same states, with an attempt prefix in place of a directory, plus two:

| kind | found | repair |
|---|---|---|
| orphan-prefix | attempt prefix no row or live claim names (an old overwritten payload) | delete its objects |
| incomplete-upload | a multipart upload never completed, not of a live claim | abort it |

A staging row whose writer is alive is reported in ``in_progress`` and left alone
(on another host: one it refreshed within ``registry.ops.writers.STALE_AFTER``).
A repair skipped because the row changed after the snapshot (a writer took the
step over, or a dead writer's last COMMIT was still completing on the server)
is listed in ``failures``; running fsck again judges the new state. An
unfinished deletion is finished by gc's own :func:`registry.fs.removal.remove_checkpoint_dir`
(:func:`~registry.fs.removal.retire_and_remove`), which removes a directory only
while it holds the payload the row deleted.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.progress import ProgressFn
from registry.catalog import Catalog
from registry.catalog.fsck import RowState, record_payload, set_status_if, snapshot, unchanged
from registry.catalog.policy import stale_folds, usable_folds
from registry.catalog.records import PayloadRecord
from registry.crashpoints import crashpoint
from registry.errors import CheckpointReadError, CorruptCheckpointError, RegistryError, RootError
from registry.fs.filemaps import check_manifest_digest, read_json
from registry.format.layout import scan_run, step_dirname
from registry.format.manifest import MANIFEST, META, Manifest, read_manifest
from registry.records import LIVE, Status
from registry.format.refs import MAX_STEP, RUN_NAME_RE
from registry.ops.checkouts import expired as expired_checkouts, remove_owned
from registry.fs.removal import manifest_digest, remove_tree, retire_and_remove
from registry.fs.store import fsync_dir, verify_directory
from registry.ops.verdicts import (REPAIRS, REPORTED, CopyOnly, FsckPass, FsckReport, Problem, one_line, _RootVanished,
                                   condemned, damage_again, found_payload, iter_lines, meta_numbers)
from registry.ops.writers import writer_alive
from registry.roots.aside import Aside, DirectoryAside


@dataclass(kw_only=True)
class _Step:
    """Everything fsck found on disk for one (run, step)."""

    final: Path | None = None
    tmp: list[Path] = field(default_factory=list)
    retired: list[Path] = field(default_factory=list)


def _is_dir(path: Path) -> bool:
    """A real directory (not a symlink) at ``path`` now; False once it has vanished."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _scan(root: Path, failures: list[str]) -> dict[tuple[str, int], _Step]:
    """Step directories under ``root``, without following symlinks or reading any file.

    A run directory that vanishes meanwhile is skipped; one that cannot be
    listed is named in ``failures``.
    """
    found: dict[tuple[str, int], _Step] = {}
    try:
        runs = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return found
    for run_entry in runs:
        if not run_entry.is_dir(follow_symlinks=False) or not RUN_NAME_RE.fullmatch(run_entry.name):
            continue
        try:
            entries = scan_run(Path(run_entry.path))
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            failures.append(f"{run_entry.name}: cannot list {run_entry.path}: {one_line(exc)}")
            continue
        for entry in entries:
            slot = found.setdefault((run_entry.name, entry.step), _Step())
            if entry.kind == "final":
                slot.final = entry.path
            else:
                (slot.tmp if entry.kind == "tmp" else slot.retired).append(entry.path)
    return found


def _read_meta(directory: Path, manifest: Manifest) -> dict[str, Any]:
    """The few numbers a repair records from meta.json; anything odd gives defaults."""
    if META not in manifest.files:
        return {}
    try:
        doc = read_json(directory, META)
    except (RegistryError, OSError):
        return {}
    return meta_numbers(doc)


def _check_payload(directory: Path, *, checksums: bool,
                   on_bytes: Callable[[int], object] | None = None) -> tuple[PayloadRecord | None, str]:
    """A record of a valid payload, or (None, why it is not valid).

    Files that vanish while being read make the payload invalid, never raise;
    any other failure to read (``OSError``) is raised: it is not corruption.
    """
    if directory.is_symlink():
        return None, "the directory is a symlink"
    try:
        manifest, digest = read_manifest(directory)
    except CorruptCheckpointError as exc:
        return None, str(exc)
    except CheckpointReadError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None, "the directory vanished while being checked"
        raise
    status = Status.PUBLISHED
    try:
        if checksums:
            problems = verify_directory(directory, manifest, on_bytes=on_bytes)
            if problems:
                return None, f"{problems[0].name}: {problems[0].problem}"
            status = Status.VERIFIED
        else:
            for name, entry in manifest.files.items():
                try:
                    st = os.stat(directory / name, follow_symlinks=False)
                except (FileNotFoundError, NotADirectoryError):
                    st = None
                if st is None or not stat.S_ISREG(st.st_mode):
                    return None, f"{name}: missing or not a regular file"
                if st.st_size != entry.size:
                    return None, f"{name}: size {st.st_size}, manifest says {entry.size}"
        manifest_size = os.stat(directory / MANIFEST, follow_symlinks=False).st_size
    except (FileNotFoundError, NotADirectoryError) as exc:
        return None, f"{Path(exc.filename or directory).name}: vanished while being checked"
    return found_payload(manifest, digest, manifest_size, status=status, meta=_read_meta(directory, manifest)), ""


def _matches_catalog(directory: Path, row: RowState, *, checksums: bool,
                     on_bytes: Callable[[int], object] | None = None) -> str:
    """Why a live row's directory does not hold what the catalog recorded ('' when it does)."""
    record, why = _check_payload(directory, checksums=checksums, on_bytes=on_bytes)
    if record is None:
        return why
    try:
        check_manifest_digest(directory, record.manifest_sha256, row.manifest_sha256)
    except CorruptCheckpointError as exc:
        return str(exc)
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


class Fsck(FsckPass):
    """One pass of fsck over a catalog and a directory root. Use :func:`run_fsck`."""

    def __init__(self, *, catalog: Catalog, root: Path, repair: bool, checksums: bool, actor: str,
                 progress: ProgressFn | None = None, elsewhere: Collection[tuple[str, int]] = (),
                 copy_only: CopyOnly | None = None, superseded: Collection[tuple[str, int]] = (),
                 copy_at: str | None = None) -> None:
        super().__init__(catalog=catalog, repair=repair, checksums=checksums, actor=actor, progress=progress)
        self.root = root
        # on a root with tiers: this host's fast tier, where a payload rolled forward or adopted is a copy
        self.copy_at = copy_at
        # steps whose copy is on another tier (a durable tier, another host's fast root): no directory here
        # is no missing payload
        self.elsewhere = frozenset(elsewhere)
        # steps whose directory here holds an older payload of theirs (published again on another host): the
        # tier pass reports those, never as damage to the step
        self.superseded = frozenset(superseded)
        # on a root with tiers: records damage against this host's copy alone where another good copy stands
        self.copy_only = copy_only

    def _root_present(self) -> bool:
        return os.path.isdir(self.root)  # follows a symlinked root, as the check at the start does

    def _remove(self, paths: list[Path]) -> None:
        for path in paths:
            remove_tree(path)

    def run(self) -> FsckReport:
        if not self.root.is_dir():
            # a root that is not there (an unmounted share) says nothing about the steps: judging
            # them against it would condemn every one
            raise RootError(f"checkpoint root {self.root} is not there on this host (is the shared filesystem "
                            "mounted?); fsck checked and changed nothing", path=self.root)
        disk = _scan(self.root, self.failures)  # before the snapshot: see the module docstring
        rows = {(r.run, r.step): r for r in snapshot(self.catalog)}
        vanished = False
        for key in sorted(set(disk) | set(rows)):
            try:
                self._step(key[0], key[1], rows.get(key), disk.get(key, _Step()))
            except OSError as exc:  # a local failure to read: neither corruption nor a reason to stop
                self.failures.append(f"{key[0]}@{key[1]}: cannot check: {one_line(exc)}")
            except _RootVanished:
                self.failures.append(f"checkpoint root {self.root} vanished while fsck ran (unmounted?); "
                                     f"stopped at {key[0]}@{key[1]} and judged nothing after it")
                vanished = True
                break
        for co in expired_checkouts(self.catalog, self.root):
            problem = self._found("expired-checkout", co.run, co.step, co.path,
                                  f"checkout {co.path}: its reader lease expired or was released")
            self._fix(problem, functools.partial(remove_owned, co.path))
        try:
            runs = sorted(e.name for e in os.scandir(self.root)
                          if e.is_dir(follow_symlinks=False) and RUN_NAME_RE.fullmatch(e.name))
        except FileNotFoundError:  # the root vanished (unmounted): its folds say nothing either
            if not vanished:
                self.failures.append(f"checkpoint root {self.root} vanished while fsck ran (unmounted?); "
                                     "judged no policy fold")
            return self.report(len(rows))
        check_folds(self, DirectoryAside(self.root), runs, where=lambda rel: (self.root / rel, None))
        return self.report(len(rows))

    def _step(self, run: str, step: int, row: RowState | None, scanned: _Step) -> None:
        canonical = self.root / run / step_dirname(step)
        final = self.root / row.path if row is not None else canonical
        # What the scan saw, looked at again now that the row has been read: a publish or gc
        # that finished between the scan and the snapshot must not look like a missing payload.
        found = _Step(final=(final if _is_dir(final) else None) if row is not None
                      else (scanned.final if scanned.final is not None and _is_dir(scanned.final) else None),
                      tmp=[p for p in scanned.tmp if _is_dir(p)],
                      retired=[p for p in scanned.retired if _is_dir(p)])
        staging_live = row is not None and row.status == Status.STAGING and writer_alive(row.writer, row.updated_at)

        for tmp in found.tmp:
            if staging_live:
                continue
            p = self._found("abandoned-staging", run, step, tmp, "staging directory with no live writer")
            self._fix(p, functools.partial(self._remove, [tmp]))
        if staging_live:
            assert row is not None
            self.in_progress.append(Problem(kind="in-progress", run=run, step=step, path=final,
                                            detail=f"being published by {row.writer}", repair=None))
            return

        if row is not None and row.status == Status.DELETED:
            leftovers = ([found.final] if found.final is not None else []) + found.retired
            if leftovers:
                p = self._found("unfinished-deletion", run, step, leftovers[0],
                                f"deleted step still has {len(leftovers)} "
                                f"director{'y' if len(leftovers) == 1 else 'ies'}", row=row)
                self._fix(p, lambda: self._finish_deletion(row, final, found.retired))
            return

        payload_dir = found.final
        if found.retired:
            if found.final is None:
                chosen = _newest(found.retired)
                p = self._found("interrupted-overwrite", run, step, chosen,
                                "a retired payload and no final directory: crash between the two renames", row=row)
                if p is None:
                    return
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
                self._fix(p, functools.partial(self._remove, [old]))

        if row is None or row.status == Status.FAILED:
            if payload_dir is not None:
                self._unregistered(run, step, row, payload_dir)
            return
        if row.status == Status.STAGING:
            self._dead_staging(row, payload_dir, final)
        elif row.status == Status.CORRUPT:
            where = "its directory is missing" if payload_dir is None else f"its files are at {payload_dir}"
            self._found("corrupt-step", run, step, final,
                        f"marked corrupt ({where}): restore its files and run 'registry verify {run}@{step}', "
                        f"or let 'registry gc {run}' delete it", repairable=False, row=row)
        elif row.status in LIVE:
            if payload_dir is None and (run, step) in self.elsewhere or (run, step) in self.superseded:
                return
            if payload_dir is None:
                p = self._found("missing-payload", run, step, final, f"{row.status} step has no directory", row=row,
                                still=lambda: not _is_dir(final))
                self._fix(p, lambda: self._condemned(set_status_if(
                    self.catalog, row, Status.CORRUPT, kind="missing-payload", actor=self.actor,
                    reason=f"{row.status} step has no directory"), run))
                return
            checked = manifest_digest(payload_dir)
            why = _matches_catalog(payload_dir, row, checksums=self.checksums,
                                   on_bytes=lambda n: self.counter.advance(n, item=f"{run}@{step}"))
            if why:
                why = damage_again(why, lambda: _matches_catalog(payload_dir, row, checksums=self.checksums),
                                   what=f"{run}@{step}")
            if why:
                p = self._found("damaged-payload", run, step, payload_dir, why, row=row,
                                still=lambda: manifest_digest(payload_dir) == checked)
                self._fix(p, lambda: (self.copy_only is not None and row.manifest_sha256 is not None
                                      and self.copy_only(run, step, payload_dir, row.manifest_sha256, why))
                          or self._condemned(set_status_if(self.catalog, row, Status.CORRUPT, kind="damaged-payload",
                                                           actor=self.actor, reason=why), run))

    def _condemned(self, marked: bool, run: str) -> bool:
        if marked:
            condemned(self.catalog, self.root, run)
        return marked

    def _restore(self, retired: Path, final: Path) -> None:
        os.replace(retired, final)
        fsync_dir(final.parent)
        crashpoint("fsck-after-restore")

    def _finish_deletion(self, row: RowState, final: Path, retired: list[Path]) -> bool | str:
        """gc's own finishing, for one step whose row is (re-read now) still the deleted one fsck saw."""
        if not unchanged(self.catalog, row):
            return False
        self._remove(retired)
        if retire_and_remove(final, row.manifest_sha256) == "kept":
            return "its directory holds another payload than the one deleted; left in place"
        return True

    def _dead_staging(self, row: RowState, payload_dir: Path | None, final: Path) -> None:
        if payload_dir is None:
            detail = f"staging row of dead writer {row.writer} and no directory: crash before the rename"
            p = self._found("abandoned-publish", row.run, row.step, final, detail, row=row)
            self._fix(p, lambda: set_status_if(self.catalog, row, Status.FAILED, kind="abandoned-publish",
                                               actor=self.actor, dead_writer=row.writer))
            return
        record, why = _check_payload(payload_dir, checksums=True)
        if record is None:
            p = self._found("invalid-staged-payload", row.run, row.step, payload_dir,
                            f"staging row of dead writer {row.writer}; its directory is invalid: {why}", row=row)
            self._fix(p, lambda: set_status_if(self.catalog, row, Status.CORRUPT, kind="invalid-staged-payload",
                                               actor=self.actor, reason=why))
            return
        p = self._found("uncommitted-publish", row.run, row.step, payload_dir,
                        f"payload in place but writer {row.writer} died before the catalog commit", row=row)
        self._fix(p, lambda: record_payload(self.catalog, row, run=row.run, step=row.step, path=row.path,
                                            payload=record, kind="uncommitted-publish", actor=self.actor,
                                            copy_at=self.copy_at, dead_writer=row.writer))

    def _unregistered(self, run: str, step: int, row: RowState | None, payload_dir: Path) -> None:
        what = "no catalog row" if row is None else "a failed catalog row"
        if step > MAX_STEP:
            self._found("unregistered-checkpoint", run, step, payload_dir,
                        f"directory with {what} cannot be adopted: step {step} is beyond the catalog's "
                        f"range (0..{MAX_STEP})", repairable=False)
            return
        record, why = _check_payload(payload_dir, checksums=True)
        if record is None:
            if not _is_dir(payload_dir):
                return  # removed while being checked: nothing left to report
            self._found("unregistered-checkpoint", run, step, payload_dir,
                        f"directory with {what} cannot be adopted: {why}", repairable=False, row=row)
            return
        p = self._found("unregistered-checkpoint", run, step, payload_dir, f"valid checkpoint with {what}", row=row)
        self._fix(p, lambda: record_payload(self.catalog, row, run=run, step=step,
                                            path=payload_dir.relative_to(self.root).as_posix(),
                                            payload=record, kind="unregistered-checkpoint", actor=self.actor,
                                            copy_at=self.copy_at))


def _fold_step(rel: str) -> int:
    """The step a fold's file name starts at (``<from>-<to>.delta.safetensors``), 0 for a name fold never writes."""
    head = rel.rsplit("/", 1)[-1].split("-", 1)[0]
    return int(head) if head.isdigit() and int(head) <= MAX_STEP else 0


def check_folds(fsck: FsckPass, aside: Aside, runs: Collection[str], *,
                where: Callable[[str], tuple[Path, str | None]]) -> None:
    """Every file under a run's ``.policy-folds/`` that no usable fold row names (``verified``, both its steps
    with a payload) is an ``orphan-fold``: a fold whose step was deleted, whose bytes were found corrupt, or
    whose write died before its row. ``--repair`` marks a row whose step is gone ``deleted`` and removes the
    file, unless a row made it usable meanwhile: a fold recorded after the listing is never taken for an
    orphan, since the catalog is read after it. ``where(rel)``: the problem's path and URL."""
    from registry.ops.policy import FOLDS
    listed = {run: aside.names(f"{run}/{FOLDS}") for run in runs}
    usable = usable_folds(fsck.catalog)
    for run, names in listed.items():
        for rel in names:
            if rel in usable:
                continue
            path, url = where(rel)
            p = fsck._found("orphan-fold", run, _fold_step(rel), path,
                            "policy fold no verified row of live steps names (a step deleted, or found corrupt)",
                            url=url)
            fsck._fix(p, functools.partial(_drop_fold, fsck.catalog, aside, rel))


def _drop_fold(catalog: Catalog, aside: Aside, rel: str) -> bool | str:
    stale_folds(catalog, rel)
    if rel in usable_folds(catalog):
        return "a fold row names it now"
    aside.delete(rel)
    return True


def run_fsck(*, catalog: Catalog, root: Path, repair: bool = False, checksums: bool = False,
             actor: str, progress: ProgressFn | None = None,
             elsewhere: Collection[tuple[str, int]] = (), copy_only: CopyOnly | None = None,
             superseded: Collection[tuple[str, int]] = (), copy_at: str | None = None) -> FsckReport:
    """Check (and with ``repair`` fix) every step under ``root`` against ``catalog``.

    ``checksums`` re-hashes every live step's files instead of checking sizes
    and the manifest digest; roll-forward and adoption always hash. ``progress``
    hears of the bytes that ``checksums`` re-hashes (the total is not known ahead).
    """
    return Fsck(catalog=catalog, root=root, repair=repair, checksums=checksums, actor=actor,
                progress=progress, elsewhere=elsewhere, copy_only=copy_only, superseded=superseded,
                copy_at=copy_at).run()


# FsckReport, Problem, REPAIRS, REPORTED, iter_lines: verdicts' names, re-exported
__all__ = ["FsckReport", "Problem", "REPAIRS", "REPORTED", "check_folds", "iter_lines", "run_fsck"]
