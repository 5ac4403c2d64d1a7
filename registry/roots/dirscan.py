"""What a directory root holds, as fsck's judge asks it (:mod:`registry.roots.scan`).

A step is a directory ``RUN/step-00001000`` installed by one rename of a
staged sibling (``.step-00001000.tmp-*``); an overwrite first renames the old
payload to a retired sibling (``.step-00001000.retired-*``), and a deletion
retires the directory before removing it. So a crash leaves, per step, at
most: the final directory, staging siblings, retired siblings. Listing never
follows a symlink or reads a file; every look is taken again once the
catalog was read, so a publish or gc that finished in between is never taken
for a missing payload.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.crashpoints import crashpoint
from registry.errors import CheckpointReadError, CorruptCheckpointError, RegistryError, RootError
from registry.format.layout import scan_run, step_dirname
from registry.format.manifest import MANIFEST, META, read_manifest
from registry.format.refs import RUN_NAME_RE
from registry.fs.filemaps import read_json
from registry.fs.removal import manifest_digest, remove_tree, retire_and_remove
from registry.fs.store import fsync_dir, verify_directory
from registry.roots.aside import Aside, DirectoryAside
from registry.roots.scan import Checked, Leftover, StepKey, Stored, Valid


@dataclass(kw_only=True)
class Listed:
    """What the listing found of one step."""

    final: Path | None = None
    tmp: list[Path] = field(default_factory=list)
    retired: list[Path] = field(default_factory=list)


def is_dir(path: Path) -> bool:
    """A real directory (not a symlink) at ``path`` now; False once it has vanished."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def check_directory(directory: Path, *, checksums: bool, on_bytes: Callable[[int], object] | None = None) -> Checked:
    """Whether ``directory`` holds a valid payload (:meth:`registry.roots.scan.Stored.check`)."""
    if directory.is_symlink():
        return Checked(valid=None, why="the directory is a symlink", digest=None)
    try:
        manifest, digest = read_manifest(directory)
    except CorruptCheckpointError as exc:
        return Checked(valid=None, why=str(exc), digest=manifest_digest(directory))
    except CheckpointReadError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return Checked(valid=None, why="the directory vanished while being checked", digest=None,
                           vanished=True)
        raise
    try:
        if checksums:
            problems = verify_directory(directory, manifest, on_bytes=on_bytes)
            if problems:
                return Checked(valid=None, why=f"{problems[0].name}: {problems[0].problem}", digest=digest)
        else:
            for name, entry in manifest.files.items():
                try:
                    st = os.stat(directory / name, follow_symlinks=False)
                except (FileNotFoundError, NotADirectoryError):
                    st = None
                if st is None or not stat.S_ISREG(st.st_mode):
                    return Checked(valid=None, why=f"{name}: missing or not a regular file", digest=digest)
                if st.st_size != entry.size:
                    return Checked(valid=None, why=f"{name}: size {st.st_size}, manifest says {entry.size}",
                                   digest=digest)
        manifest_size = os.stat(directory / MANIFEST, follow_symlinks=False).st_size
    except (FileNotFoundError, NotADirectoryError) as exc:
        return Checked(valid=None, why=f"{Path(exc.filename or directory).name}: vanished while being checked",
                       digest=digest, vanished=not is_dir(directory))
    meta = None
    if META in manifest.files:
        try:
            meta = read_json(directory, META)
        except (RegistryError, OSError):
            meta = None
    return Checked(valid=Valid(manifest=manifest, digest=digest, manifest_size=manifest_size, meta=meta), why="",
                   digest=digest)


@dataclass(frozen=True)
class StoredDirectory:
    """A step directory (or a retired one) as a :class:`~registry.roots.scan.Stored`."""

    root: Path
    path: Path

    @property
    def rel(self) -> str:
        return self.path.relative_to(self.root).as_posix()

    @property
    def url(self) -> str | None:
        return None

    def check(self, *, checksums: bool, on_bytes: Callable[[int], object] | None = None) -> Checked:
        return check_directory(self.path, checksums=checksums, on_bytes=on_bytes)

    def digest(self) -> str | None:
        return manifest_digest(self.path)


def _newest(paths: list[Path]) -> Path:
    def mtime(p: Path) -> float:
        try:
            return (p / MANIFEST).stat().st_mtime
        except OSError:
            return float("-inf")
    return max(paths, key=lambda p: (mtime(p), p.name))


def _remove(paths: list[Path]) -> bool:
    for path in paths:
        remove_tree(path)
    return True


def _finish_deletion(final: Path, retired: list[Path], digest: str | None) -> bool | str:
    """gc's own finishing: the retired payloads go, the final directory only while it holds ``digest``."""
    _remove(retired)
    if retire_and_remove(final, digest) == "kept":
        return "its directory holds another payload than the one deleted; left in place"
    return True


class DirectoryStep:
    """What a directory root holds of one step (:class:`registry.roots.scan.StepFound`)."""

    def __init__(self, root: Path, key: StepKey, listed: Listed | None, rel: str | None) -> None:
        self.root = root
        scanned = listed or Listed()
        self.where = root / rel if rel is not None else root / key[0] / step_dirname(key[1])
        self.final = (self.where if is_dir(self.where) else None) if rel is not None else (
            scanned.final if scanned.final is not None and is_dir(scanned.final) else None)
        self.tmp = [p for p in scanned.tmp if is_dir(p)]
        self.retired = [p for p in scanned.retired if is_dir(p)]
        self.chosen: Path | None = None
        self.deleting = False

    @property
    def absent(self) -> str:
        return "no directory"

    def payload(self) -> Stored | None:
        return StoredDirectory(self.root, self.final) if self.final is not None else None

    def present(self) -> bool:
        return is_dir(self.where)

    def older(self, *, digest: str | None, claim: bool, theirs: Collection[Path] = ()) -> tuple[Stored, str] | None:
        retired = [p for p in self.retired if p not in theirs]
        if self.final is not None or not retired:
            return None
        self.chosen = _newest(retired)
        return (StoredDirectory(self.root, self.chosen),
                "a retired payload and no final directory: crash between the two renames")

    def restore(self, old: Stored) -> Stored:
        os.replace(self.root / old.rel, self.where)
        fsync_dir(self.where.parent)
        crashpoint("fsck-after-restore")
        self.final = self.where
        return StoredDirectory(self.root, self.where)

    def adoptable(self, *, failed: bool) -> list[Stored]:
        at = self.final if self.final is not None else self.chosen
        return [StoredDirectory(self.root, at)] if at is not None else []

    def deleted(self, *, digest: str | None) -> list[Leftover]:
        self.deleting = True
        left = ([self.final] if self.final is not None else []) + self.retired
        if not left:
            return []
        return [Leftover(kind="unfinished-deletion", path=left[0],
                         detail=f"deleted step still has {len(left)} director{'y' if len(left) == 1 else 'ies'}",
                         remove=functools.partial(_finish_deletion, self.where, list(self.retired), digest))]

    def leftovers(self) -> list[Leftover]:
        found = [Leftover(kind="abandoned-staging", path=tmp, detail="staging directory with no live writer",
                          remove=functools.partial(_remove, [tmp])) for tmp in self.tmp]
        if not self.deleting:
            found += [Leftover(kind="leftover-retired", path=old, detail="retired payload next to its replacement",
                               remove=functools.partial(_remove, [old]))
                      for old in self.retired if old != self.chosen]
        return found


@dataclass(frozen=True)
class DirectoryScan:
    """A directory root as fsck reads it (:class:`registry.roots.scan.Scan`)."""

    root: Path

    @property
    def local_dir(self) -> Path | None:
        return self.root

    def check(self) -> None:
        if not self.root.is_dir():
            raise RootError(f"checkpoint root {self.root} is not there on this host (is the shared filesystem "
                            "mounted?); fsck checked and changed nothing", path=self.root)

    def still_there(self) -> bool:
        return os.path.isdir(self.root)  # follows a symlinked root, as the check at the start does

    def listing(self, failures: list[str]) -> Mapping[StepKey, Listed]:
        found: dict[StepKey, Listed] = {}
        try:
            runs = sorted(os.scandir(self.root), key=lambda e: e.name)
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
                failures.append(f"{run_entry.name}: cannot list {run_entry.path}: "
                                f"{exc.strerror or type(exc).__name__}")
                continue
            for entry in entries:
                slot = found.setdefault((run_entry.name, entry.step), Listed())
                if entry.kind == "final":
                    slot.final = entry.path
                else:
                    (slot.tmp if entry.kind == "tmp" else slot.retired).append(entry.path)
        return found

    def step(self, key: StepKey, listed: Any, rel: str | None) -> DirectoryStep:
        return DirectoryStep(self.root, key, listed, rel)

    def runs(self, listed: Mapping[StepKey, Any]) -> list[str]:
        return sorted(e.name for e in os.scandir(self.root)
                      if e.is_dir(follow_symlinks=False) and RUN_NAME_RE.fullmatch(e.name))

    def aside(self) -> Aside:
        return DirectoryAside(self.root)

    def where(self, rel: str) -> tuple[Path, str | None]:
        return self.root / rel, None


__all__ = ["DirectoryScan", "DirectoryStep", "Listed", "StoredDirectory", "check_directory", "is_dir"]
