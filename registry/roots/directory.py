"""A directory root: each step a directory under the root, published by a staged rename (``registry.fs.store``)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import CheckpointReadError, CorruptCheckpointError, PublishError, RegistryError
from registry.format.layout import hidden_sibling, scan_run
from registry.fs import inodes as inode_files
from registry.fs.store import (FileProblem, Reuse, Store, check_written, discard, install, new_staging,
                               remove_stale_staging, uninstall, write_payload)
from registry.records import CheckpointInfo
from registry.roots.aside import DirectoryAside
from registry.roots.base import Capabilities, Capability, Gone, Tiered, refuse
from registry.roots.landing import Previous, os_cause
from registry.roots.shards import FileShards

if TYPE_CHECKING:
    from registry.roots.dirscan import DirectoryScan
    from registry.fs.objects import ObjectRoot
    from registry.format.manifest import Manifest
    from registry.fs.filemaps import Extras, Loaded
    from registry.fs.payloadfiles import Payload, Written

DIRECTORY = Capabilities(links=True, sharded=True, local_import=True, directories=True)


@dataclass(frozen=True)
class DirectoryRoot:
    """A :class:`~registry.roots.base.Root` over a :class:`~registry.fs.store.Store`."""

    store: Store
    kind: str = "directory"
    can: Capabilities = DIRECTORY

    @property
    def url(self) -> str:
        return str(self.store.root)

    @property
    def directory(self) -> Path:
        """The root directory on this host."""
        return self.store.root

    def place(self, info: CheckpointInfo) -> CheckpointInfo:
        return info.under(self.store.root)

    @property
    def local_dir(self) -> Path | None:
        return self.store.root

    def holds(self, relpath: str) -> bool:
        return (self.store.root / relpath).is_dir()

    def stored_manifest(self, info: CheckpointInfo) -> tuple[Manifest | None, str]:
        from registry.format.manifest import MANIFEST, read_manifest  # the parsers: what a listing never needs
        directory = Path(info.path)
        try:
            st = os.stat(directory)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointReadError(f"directory missing: {directory}", errno=errno.ENOENT, path=directory) from None
        except OSError as exc:
            raise CheckpointReadError(f"cannot read {directory}: {exc.strerror}", errno=exc.errno,
                                      path=directory) from None
        if not stat.S_ISDIR(st.st_mode):
            return None, f"{directory} is not a directory"
        try:
            return read_manifest(directory)
        except CheckpointReadError:
            raise
        except CorruptCheckpointError as exc:  # missing, a symlink, not a file, or not a valid manifest
            return None, f"{MANIFEST}: {exc}"

    def rehash(self, info: CheckpointInfo, manifest: Manifest, *, on_bytes: Callable[[int], None]) -> list[FileProblem]:
        from registry.fs.store import verify_directory  # looked up here: the fault tests patch it there
        directory = Path(info.path)
        try:
            damaged = verify_directory(directory, manifest, on_bytes=on_bytes)
        except OSError as exc:
            raise CheckpointReadError(f"cannot read {exc.filename or directory}: {exc.strerror or exc}",
                                      errno=exc.errno, path=directory) from None
        if damaged and not directory.is_dir():  # vanished while being read: gc, or the mount went away
            raise CheckpointReadError(f"directory disappeared while being read: {directory}", path=directory)
        return damaged

    def read(self, info: CheckpointInfo, *, verify: bool, trust_pickle: bool, map_location: Any,
             extras: Extras = True) -> Loaded:
        from registry.fs.filemaps import read_directory  # the parsers: what a listing never needs
        return read_directory(Path(info.path), verify=verify, trust_pickle=trust_pickle, map_location=map_location,
                              extras=extras, expected_digest=info.manifest_sha256)

    def manifest_bytes(self, info: CheckpointInfo) -> tuple[bytes, Path]:
        from registry.format.manifest import MANIFEST, manifest_bytes
        return manifest_bytes(Path(info.path)), Path(info.path) / MANIFEST

    def read_marker(self) -> str | None:
        return self.store.read_marker()

    def write_marker(self, catalog_id: str, *, bound_from: str, overwrite: bool = False) -> None:
        self.store.write_marker(catalog_id, bound_from=bound_from)  # an atomic replace: it always overwrites

    def remove_marker(self) -> None:
        self.store.remove_marker()

    def reopen(self) -> dict[str, str]:
        return {"root": self.url}

    def new_relpath(self, run: str, step: int) -> str:
        return self.store.relpath(self.store.step_dir(run, step))

    def scan(self) -> DirectoryScan:
        from registry.roots.dirscan import DirectoryScan  # fsck's: hashing and removal, which a listing never needs
        return DirectoryScan(self.store.root)

    def removal(self) -> FileRemoval:
        return FileRemoval(self.store.root)

    def aside(self) -> DirectoryAside:
        return DirectoryAside(self.store.root)

    def landing(self, relpath: str) -> DirectoryLanding:
        """Phases 2-3 of a publish to ``relpath``: a hidden staging sibling renamed into place."""
        return DirectoryLanding(self.store.root / relpath)

    def write(self, dest: Path, payload: Payload, reuse: Reuse | None) -> Written:
        """Fill the staging directory ``dest`` with ``payload`` (``reuse`` may link files a step holds)."""
        return write_payload(dest, payload, reuse=reuse)

    def shards(self) -> FileShards:
        """DCP's files written hashed into the staging directory, read mapped."""
        return FileShards()

    def require(self, capability: Capability, what: str) -> None:
        refuse(self, capability, what)

    def local_store(self, what: str) -> Store:
        return self.store

    def object_store(self) -> ObjectRoot | None:
        return None

    def tiered(self) -> Tiered | None:
        return None


@dataclass
class DirectoryLanding:
    """A filesystem root's landing: a hidden staging sibling, fsync'd, then renamed to ``final``."""

    final: Path
    shares_inodes: bool = True

    @property
    def where(self) -> str:
        return str(self.final)

    @property
    def path(self) -> Path:
        return self.final

    def prepare(self, claim: Previous) -> Path:
        remove_stale_staging(self.final)
        return new_staging(self.final)

    def check(self, dest: Path, written: Written) -> list[FileProblem]:
        return check_written(dest, written)

    def install(self, dest: Path) -> Path | None:
        return install(dest, self.final, keep_retired=True)

    def discard(self, dest: Path) -> None:
        discard(dest)

    def old_intact(self) -> bool:
        try:
            return self.final.is_dir()
        except OSError:
            return False

    def undo(self, dest: Path, retired: Path | None) -> bool:
        parked = hidden_sibling(self.final, "tmp")  # a name only: making a directory can fail on a full disk
        try:
            uninstall(parked, self.final, retired)
        finally:
            discard(parked)
        return retired is not None

    def settle(self, retired: Path) -> None:
        discard(retired)

    def failure(self, exc: OSError) -> RegistryError:
        return PublishError(f"could not publish {self.final}: {os_cause(exc, self.final)}",
                            errno=exc.errno, path=self.final)


@dataclass(frozen=True)
class FileRemoval:
    """:class:`~registry.roots.base.Removal` for a directory root: retire, then remove (:mod:`registry.fs.removal`)."""

    root: Path

    def held(self, info: CheckpointInfo) -> Mapping[Any, int]:
        """What a candidate's directory holds on disk, for :class:`~registry.retention.MaxBytes`."""
        return inode_files.inodes(Path(info.path))

    def freed_bytes(self, doomed: Sequence[CheckpointInfo]) -> int:
        return inode_files.freed_bytes(Path(c.path) for c in doomed)

    def kept_bytes(self, kept: Sequence[CheckpointInfo]) -> int:
        """Bytes on disk of the steps' directories, each inode once (a catalog size where one cannot be read)."""
        seen: dict[inode_files.Inode, int] = {}
        unread = 0
        for c in kept:
            held = inode_files.inodes(Path(c.path))
            if not held:
                unread += c.total_bytes
            seen.update(held)
        return sum(seen.values()) + unread

    def shared_bytes(self, doomed: Sequence[Path], kept: Sequence[Path]) -> int:
        """Counted per inode, and only what a *kept* step links: two deleted steps sharing a file between
        them free it, and a name elsewhere (a checkout) is not a step."""
        held = inode_files.held(doomed)
        also = inode_files.held(kept)
        return sum(size for key, size in held.items() if key in also)

    def remove(self, gone: Gone) -> bool:
        from registry.fs.removal import remove_checkpoint_dir  # it reads manifests: what a listing never needs
        return remove_checkpoint_dir(self.root / gone.path, gone.manifest_sha256)

    def finish(self, run: str, rows: Sequence[Gone]) -> tuple[set[int], dict[int, str]]:
        """Remove what a killed gc left of ``deleted`` rows: final or retired directories."""
        deleted = {r.step for r in rows}
        healed: set[int] = set()
        errors: dict[int, str] = {}
        for r in rows:
            try:
                if self.remove(r):
                    healed.add(r.step)
            except OSError as exc:
                errors[r.step] = f"cannot remove {self.root / r.path}: {exc.strerror or exc}"
        run_dir = self.root / run
        if deleted and run_dir.is_dir():
            from registry.fs.removal import remove_tree
            for entry in scan_run(run_dir):
                if entry.kind == "retired" and entry.step in deleted:
                    try:
                        remove_tree(entry.path)
                        healed.add(entry.step)
                    except OSError as exc:
                        errors[entry.step] = f"cannot remove {entry.path}: {exc.strerror or exc}"
        return healed, errors


__all__ = ["DIRECTORY", "DirectoryLanding", "DirectoryRoot", "FileRemoval"]
