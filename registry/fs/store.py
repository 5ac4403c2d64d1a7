"""The filesystem layer: staged, checksummed, fsync'd checkpoint directories.

This module knows paths and bytes, never SQL. A checkpoint becomes a final
directory in exactly one ``os.replace`` of a fully written and fsync'd hidden
staging sibling, so a reader that finds ``step-N/`` finds all of it. The
catalog decides *when* that happens; this module makes sure it is atomic.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from registry.crashpoints import crashpoint
from registry.errors import CorruptCheckpointError, PublishError, RootError, SafetensorsFormatError
from registry.format.layout import (CATALOG_FILE, REGISTRY_DIR, ROOT_MARKER, hidden_sibling, hidden_siblings,
                                    step_dirname)
from registry.pools import Pool

if TYPE_CHECKING:  # the writers' and the verifiers' modules, imported where they run: a listing opens a Store
    from registry.format.manifest import FileEntry, Manifest
    from registry.format.safetensors import Encoded
    from registry.fs.payloadfiles import Payload, Written


def remove_stale_staging(final: Path) -> list[Path]:
    """Remove ``.NAME.tmp-*`` siblings of ``final``; call only while owning its catalog row."""
    removed = []
    for candidate in hidden_siblings(final, "tmp"):
        shutil.rmtree(candidate, ignore_errors=True)
        removed.append(candidate)
    return removed


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Reuse(Protocol):
    """Where a publish may find a file it is about to write already stored: dedup (``registry.fs.dedup``)."""

    def link(self, staging: Path, name: str, encoded: Encoded) -> FileEntry | None:
        """Store ``staging/name`` (``encoded``'s bytes) as a link and return its entry; None: write it."""


_SYNC_POOL = Pool(4, "registry-fsync")


def write_payload(staging: Path, payload: Payload, *, reuse: Reuse | None = None) -> Written:
    """Write every file of ``payload`` into ``staging``, hashing as it goes.

    The manifest is written last and everything, the directory included, is
    fsync'd before return. Nothing is ever read back to hash it, and tensors
    are written from their own memory (see ``registry.fs.hashing``), so the extra memory
    is a few MiB plus the largest non-contiguous tensor, whatever the size of
    the state dict. Each file entry records sha256 and xxh3-128 piece
    digests. Each file is fsync'd on a helper thread while the next one is
    written: the fsyncs of the small files then share one journal commit
    instead of paying one each. Each safetensors file is first offered to
    ``reuse`` (dedup), which may store it as a link instead of it being written.
    """
    syncing: list[Future[None]] = []
    try:
        written = _write_files(staging, payload, syncing, reuse)
    finally:
        errors = [exc for f in syncing if (exc := f.exception()) is not None]  # waits for every fsync
    if errors:
        raise errors[0]
    fsync_dir(staging)
    return written


def _write_files(staging: Path, payload: Payload, syncing: list[Future[None]], reuse: Reuse | None) -> Written:
    from registry.fs.hashing import HashingWriter
    from registry.fs.payloadfiles import entry_of, write_files

    def put(name: str, writer_fn: Callable[[Any], object]) -> FileEntry:
        for done in syncing:  # an fsync already failed: stop writing, never retry it
            if done.done() and done.exception() is not None:
                raise done.exception()  # type: ignore[misc]
        out = HashingWriter(staging / name)
        try:
            writer_fn(out)
        except BaseException:
            out.abort()
            raise
        syncing.append(out.close_later(_SYNC_POOL.submit))
        return entry_of(name, out)

    return write_files(payload, put, reuse=(lambda name, encoded: reuse.link(staging, name, encoded))
                       if reuse is not None else None)


def new_staging(final: Path) -> Path:
    """A fresh hidden ``.NAME.tmp-*`` sibling of ``final``, creating the run directory as needed.

    Both get the mode a plain ``mkdir`` gives under the process umask (not
    ``mkdtemp``'s 0700), so the step directory it becomes is readable by
    whoever the umask lets read the root.
    """
    parent = final.parent
    if parent.exists() and not parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
    missing = [] if parent.is_dir() else [d for d in (parent, *parent.parents) if not d.is_dir()]
    parent.mkdir(parents=True, exist_ok=True)
    for d in reversed(missing):  # a new run directory must survive a power cut as surely as the step in it
        fsync_dir(d.parent)
    for _ in range(100):
        staging = hidden_sibling(final, "tmp")
        try:
            staging.mkdir()
        except FileExistsError:
            continue
        return staging
    raise FileExistsError(errno.EEXIST, "no unused staging name", str(parent))


def install(staging: Path, final: Path, *, keep_retired: bool = False) -> Path | None:
    """Atomically make ``staging`` the directory ``final``.

    An existing ``final`` is first renamed to a hidden ``.retired-`` sibling;
    a crash between the two renames leaves the old payload under that name,
    which fsck restores. ``final`` may vanish at any moment (gc removing a
    step that is being re-published): then there is nothing to retire. The
    parent is fsync'd so the rename survives power loss;
    if that fsync fails the renames are undone, since the caller will not commit
    them. With ``keep_retired`` the old payload is returned instead of removed, so
    a caller whose catalog commit fails can put it back (:func:`uninstall`).
    """
    retired: Path | None = None
    if os.path.lexists(final):
        retired = hidden_sibling(final, "retired")
        try:
            os.replace(final, retired)
        except FileNotFoundError:  # removed since the check
            retired = None
        else:
            crashpoint("after-retire")
    try:
        os.replace(staging, final)
    except BaseException:
        if retired is not None:
            os.replace(retired, final)
        raise
    try:
        fsync_dir(final.parent)
    except BaseException:
        uninstall(staging, final, retired, fsync=False)
        raise
    crashpoint("after-rename")
    if retired is not None and not keep_retired:
        shutil.rmtree(retired, ignore_errors=True)
        return None
    return retired


def uninstall(staging: Path, final: Path, retired: Path | None, *, fsync: bool = True) -> None:
    """Undo :func:`install`: the new payload back to ``staging``, the retired one back in place.

    The parent is fsync'd before return: the caller then removes the new
    payload and tells the catalog the old one is back, and a power cut must
    not find the new payload in place, half removed, and the old one retired.
    ``fsync=False`` where the parent's fsync has just failed: it is never retried.
    """
    os.replace(final, staging)
    if retired is not None:
        os.replace(retired, final)
    if fsync:
        fsync_dir(final.parent)


def discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def save_directory(directory: Path, payload: Payload) -> Written:
    """Catalog-free atomic save: stage, write, fsync, rename into place."""
    if directory.exists() and not directory.is_dir():
        raise RootError(f"checkpoint path exists and is not a directory: {directory}", path=directory)
    staging = new_staging(directory)
    try:
        written = write_payload(staging, payload)
        install(staging, directory)
    except OSError as exc:
        discard(staging)
        raise PublishError(f"could not write checkpoint {directory}: {exc.strerror or exc}",
                           errno=exc.errno, path=directory) from exc
    except BaseException:
        discard(staging)
        raise
    return written


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True, kw_only=True)
class FileProblem:
    name: str
    problem: str


def verify_directory(directory: Path, manifest: Manifest | None = None, *,
                     on_bytes: Callable[[int], object] | None = None) -> list[FileProblem]:
    """Re-read and re-hash (sha256) every file the manifest lists; an empty list means intact.

    This is the full scrub behind ``registry verify``: it trusts nothing that
    was computed at write time. Files are hashed in parallel (sha256 of one
    file cannot be split), each overlapping its reads with its hashing.
    ``on_bytes(n)`` hears of every piece hashed (from several threads).
    """
    from registry.format.manifest import MANIFEST, read_manifest
    from registry.fs.hashing import hash_file

    if manifest is None:
        try:
            manifest, _ = read_manifest(directory)
        except CorruptCheckpointError as exc:
            return [FileProblem(name=MANIFEST, problem=str(exc))]

    def check(entry: FileEntry) -> FileProblem | None:
        path = directory / entry.name
        if path.is_symlink() or not path.is_file():
            return FileProblem(name=entry.name, problem="missing or not a regular file")
        size, digest = hash_file(path, "sha256", on_bytes=on_bytes)
        if size != entry.size:
            return FileProblem(name=entry.name, problem=f"size {size}, manifest says {entry.size}")
        if digest != entry.sha256:
            return FileProblem(name=entry.name, problem="checksum mismatch")
        return None

    entries = [manifest.files[name] for name in sorted(manifest.files)]
    # biggest first, so the longest sha256 starts at once
    order = sorted(entries, key=lambda e: -e.size)
    workers = max(1, min(len(order), os.cpu_count() or 1, 8))
    if workers == 1:
        found = {e.name: check(e) for e in order}
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="registry-verify") as pool:
            found = dict(zip((e.name for e in order), pool.map(check, order)))
    return [p for e in entries if (p := found[e.name]) is not None]


def check_written(directory: Path, written: Written) -> list[FileProblem]:
    """The publish-time check behind status ``verified``; an empty list means it passed.

    It does not re-hash: the digests in the manifest were computed from
    exactly the bytes handed to ``write()`` (every write completed in full),
    and every file was then fsync'd without error. What it adds is a re-check
    of what the filesystem now holds, at the cost of a few small reads: each
    listed file is a regular file of the recorded size, each safetensors
    header read back from disk is byte for byte the header written (whose
    offsets tile the recorded size exactly),
    and the manifest on disk has the recorded sha256. Re-hashing every byte
    here would double the cost of a publish and only read the page cache we
    just wrote, not the disk; the full scrub from storage is
    ``verify_directory`` (``registry verify``).
    """
    from registry.format.manifest import MANIFEST, digest_bytes
    from registry.format.safetensors import read_safetensors_header

    problems: list[FileProblem] = []
    for name, entry in sorted(written.manifest.files.items()):
        path = directory / name
        try:
            st = os.lstat(path)
        except OSError as exc:
            problems.append(FileProblem(name=name, problem=f"cannot stat: {exc.strerror}"))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(FileProblem(name=name, problem="not a regular file"))
        elif st.st_size != entry.size:
            problems.append(FileProblem(name=name, problem=f"size {st.st_size}, manifest says {entry.size}"))
        elif name in written.heads:  # byte-compare: stronger than a re-parse, and allocates nothing per tensor
            head = written.heads[name]
            with open(path, "rb", buffering=0) as f:
                if f.read(len(head)) != head:
                    problems.append(FileProblem(name=name, problem="safetensors header read back differs"))
        elif name.endswith(".safetensors"):
            try:
                with open(path, "rb", buffering=0) as f:
                    read_safetensors_header(f, st.st_size, path)
            except SafetensorsFormatError as exc:
                problems.append(FileProblem(name=name, problem=str(exc)))
    try:
        raw = (directory / MANIFEST).read_bytes()
    except OSError as exc:
        problems.append(FileProblem(name=MANIFEST, problem=f"cannot read: {exc.strerror}"))
    else:
        if digest_bytes(raw) != written.manifest_sha256:
            problems.append(FileProblem(name=MANIFEST, problem="checksum mismatch"))
    return problems


# --------------------------------------------------------------------------- layout


class Store:
    """Where a run's checkpoints live under the root, and how they are named.

    ``create=False`` is for readers: a root that does not exist is an error
    (a mistyped or unmounted path), never an empty new root; ``missing_ok``
    accepts one that does not exist yet without making it (a read-only
    registry's fast directory on a host new to a durable tier).
    """

    def __init__(self, root: Path, *, create: bool = True, missing_ok: bool = False) -> None:
        if root.exists() and not root.is_dir():
            raise RootError(f"checkpoint root is not a directory: {root}", path=root)
        if not create and not (missing_ok and not root.exists()):
            if not root.is_dir():
                raise RootError(f"checkpoint root {root} does not exist: nothing was created; check --root "
                                "(publish and import create a root)", path=root)
        else:
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RootError(f"cannot create checkpoint root {root}: {exc.strerror}", path=root) from None
        self.root = root

    @staticmethod
    def default_catalog(root: Path) -> Path:
        """The default SQLite catalog of ``root``: ``<root>/.registry/catalog.db``.

        A root made before the catalog moved there keeps ``<root>/catalog.db``
        while no ``.registry/catalog.db`` exists: moving a live SQLite file and
        its ``-wal``/``-shm`` is safe only while nobody has it open, so an
        operator does it (see docs/guide/one-machine.md), never an ``open``.
        """
        new = root / REGISTRY_DIR / CATALOG_FILE
        legacy = root / CATALOG_FILE
        return legacy if legacy.is_file() and not new.exists() else new

    @property
    def marker(self) -> Path:
        return self.root / REGISTRY_DIR / ROOT_MARKER

    def read_marker(self) -> str | None:
        """The id of the catalog this root is bound to, or None for a root not bound yet."""
        try:
            raw = self.marker.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RootError(f"cannot read {self.marker}: {exc.strerror}", path=self.marker) from None
        try:
            catalog_id = json.loads(raw)["catalog_id"]
        except (ValueError, TypeError, KeyError):
            catalog_id = None
        if not isinstance(catalog_id, str) or not catalog_id:
            raise RootError(f"{self.marker} is not a root marker (expected JSON with a catalog_id)",
                            path=self.marker)
        return catalog_id

    def write_marker(self, catalog_id: str, *, bound_from: str) -> None:
        """Bind this root to catalog ``catalog_id``: write the marker atomically and durably."""
        doc = {"catalog_id": catalog_id, "bound_from": bound_from, "bound_at": now_timestamp()}
        directory = self.marker.parent
        tmp: Path | None = None
        try:
            directory.mkdir(exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{ROOT_MARKER}.", dir=directory)
            tmp = Path(name)
            with os.fdopen(fd, "wb") as f:
                f.write((json.dumps(doc, indent=2) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.marker)
            tmp = None
            fsync_dir(directory)
            fsync_dir(self.root)
        except OSError as exc:
            raise RootError(f"cannot bind checkpoint root {self.root}: {self.marker}: {exc.strerror}",
                            path=self.marker) from None
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def remove_marker(self) -> None:
        self.marker.unlink(missing_ok=True)

    def run_dir(self, run: str) -> Path:
        return self.root / run

    def step_dir(self, run: str, step: int) -> Path:
        return self.root / run / step_dirname(step)

    def relpath(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()


def now_timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")
