"""A checkout's files, and the checkouts the registry owns: made, renewed, released, reclaimed.

Files. By default every file of a checkout is the caller's own: a reflink
(``ioctl FICLONE``: XFS, btrfs; the blocks are shared until either side
writes, and a write never reaches the other) where the filesystem clones,
a plain copy otherwise. Each is hashed as it is copied (a clone is read
once) and checked against the manifest's sha256, and the copied manifest
against the digest the catalog recorded, before the directory is handed
out. Hard links (``link="hardlink"``) and symlinks (``link="symlink"``) are
an explicit opt-in: they cost no bytes, but they alias the step. Writing
through one (``save_pretrained`` into the directory, ``open(..., "r+b")``)
rewrites the registry's own file; write bits do not stop root, so that
step, and every step that shares its inode, is then condemned by
``fsck --checksums`` or the next verified load. A symlink also serves
whatever the step's path holds now (an overwrite of the step changes it).

Ownership. A checkout without a directory of the caller's goes under
``<root>/.registry/checkouts/NAME/`` with a record ``NAME.json`` beside it
(run, step, lease id). It is the registry's: ``close()`` removes it,
:func:`release` ends it early (``registry checkout --release DIR``), and
gc and ``fsck --repair`` remove it once its reader lease has expired or was
released (:func:`expired`). A directory there without a record (one made
before records existed, or one whose record was never written) counts as
live while its step has any unexpired lease. A read-only registry writes
nothing into the root: its checkouts go to a temporary directory of this
host's (``tempfile.gettempdir()``), removed on ``close()``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from registry.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidStateError
from registry.format.manifest import MANIFEST, read_manifest
from registry.fs.filemaps import check_manifest_digest
from registry.fs.hashing import CHUNK, Hasher
from registry.fs.bounds import real
from registry.format.layout import REGISTRY_DIR

if TYPE_CHECKING:
    from registry.catalog import Catalog
    from registry.format.manifest import FileEntry

CHECKOUTS = "checkouts"  # under <root>/.registry/
Kind = Literal["reflink", "copy", "hardlink", "symlink"]
Link = Literal["hardlink", "symlink"]
LINKS: tuple[str, ...] = ("hardlink", "symlink")
FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EBADF}
_NAME = re.compile(r"(?P<run>[A-Za-z0-9][A-Za-z0-9._-]{0,127})-step-(?P<step>\d{8,})-[A-Za-z0-9_]+")
RECORD = ".json"


def home(root: Path) -> Path:
    """Where the registry-owned checkouts of ``root`` live."""
    return root / REGISTRY_DIR / CHECKOUTS


def check_link(link: object) -> Link | None:
    if link is not None and link not in LINKS:
        raise InvalidStateError(f"link must be None (independent copies), 'hardlink' or 'symlink', got {link!r}")
    return link  # type: ignore[return-value]


# ---------------------------------------------------------------------- files


def _clone(src_fd: int, dst_fd: int) -> bool:
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return True
    except OSError as exc:
        if exc.errno in _NO_CLONE:
            return False
        raise


def _write_all(fd: int, piece: bytes) -> None:
    view = memoryview(piece)
    while view:
        view = view[os.write(fd, view):]


def _copy_in_kernel(sfd: int, dfd: int) -> int:
    size = 0
    try:
        while (n := os.copy_file_range(sfd, dfd, CHUNK)) > 0:
            size += n
        return size
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL) or size:
            raise
    while piece := os.read(sfd, CHUNK):
        _write_all(dfd, piece)
        size += len(piece)
    return size


def copy_file(src: Path, dst: Path, *, clone: bool, hash: bool) -> tuple[bool, int, str | None]:  # noqa: A002
    """Copy ``src`` to a new ``dst``: (whether it was cloned, its size, its sha256 if ``hash``).

    A copy is hashed from the bytes read for it, a clone by reading the
    clone once: either way what is hashed is what the caller gets.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    sfd = os.open(src, flags)
    try:
        dfd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            cloned = clone and _clone(sfd, dfd)
            hasher = Hasher(sha256=True, xxh3=False, max_pending=2) if hash else None
            size = 0
            read_fd = dfd if cloned else sfd
            if cloned and hasher is None:
                size = os.fstat(dfd).st_size
            elif hasher is None:
                size = _copy_in_kernel(sfd, dfd)
            else:
                while piece := os.read(read_fd, CHUNK):  # a fresh piece each time: the hasher may still hold one
                    hasher.update(piece)
                    if not cloned:
                        _write_all(dfd, piece)
                    size += len(piece)
            digest = hasher.digests().sha256 if hasher is not None else None
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return cloned, size, digest


def _check(src: Path, entry_size: int, entry_sha256: str | None, size: int, digest: str | None) -> None:
    if size != entry_size:
        raise CorruptCheckpointError(f"checkpoint file size mismatch: {src} is {size} bytes, manifest says "
                                     f"{entry_size}", path=src)
    if digest is not None and entry_sha256 is not None and digest != entry_sha256:
        raise CorruptCheckpointError(f"checkpoint file checksum mismatch: {src}", path=src)


def copy_step(source: Path, target: Path, *, expected_digest: str | None, verify: bool) -> Kind:
    """Copy (or clone) a step's manifest and every file it lists into the empty ``target``, checked.

    The manifest copied is matched against ``expected_digest`` (the
    catalog's), and the files against the manifest as copied, so the
    directory holds exactly what the catalog vouches for.
    """
    clone = True
    cloned, size, digest = copy_file(source / MANIFEST, target / MANIFEST, clone=clone, hash=True)
    check_manifest_digest(source, digest, expected_digest)
    manifest, _ = read_manifest(target)
    clone = every = cloned
    for name in sorted(manifest.files):
        entry: FileEntry = manifest.files[name]
        cloned, size, digest = copy_file(source / name, target / name, clone=clone, hash=verify)
        _check(source / name, entry.size, entry.sha256, size, digest)
        clone = clone and cloned  # a filesystem that refused one clone refuses the rest: stop asking
        every = every and cloned
    return "reflink" if every else "copy"


def link_step(source: Path, names: list[str], target: Path, link: Link, *, drop_write_bits: bool) -> Kind:
    """Hard-link or symlink every file; only on the caller's explicit opt-in (see the module doc)."""
    for name in names:
        src, dst = source / name, target / name
        if link == "symlink":
            os.symlink(src, dst)
            continue
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise InvalidStateError(f"cannot hard-link {src} into {target}: another filesystem; check out "
                                        "without link= (a copy) or with link='symlink'") from None
            raise
        if drop_write_bits:  # a tool that honours modes then fails instead of editing the step (root ignores it)
            try:
                mode = dst.stat().st_mode
                if mode & 0o222:
                    os.chmod(dst, mode & ~0o222)
            except OSError:
                pass
    return link


# ---------------------------------------------------------------------- owned checkouts


def temp_dir(run: str, step: int) -> Path:
    """A checkout directory outside the root (a read-only registry's, or one whose root refuses writes)."""
    return Path(tempfile.mkdtemp(prefix=f"registry-checkout-{run}-step-{step:08d}-"))


def new_owned(root: Path, *, run: str, step: int, lease: int, holder: str) -> Path:
    """An empty registry-owned checkout directory, with its record written before anything goes in."""
    where = home(root)
    where.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{run}-step-{step:08d}-", dir=where))
    write_record(path, run=run, step=step, lease=lease, holder=holder)
    return path


def _record(path: Path) -> Path:
    return path.with_name(path.name + RECORD)


def write_record(path: Path, *, run: str, step: int, lease: int, holder: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}{RECORD}")
    tmp.write_text(json.dumps({"run": run, "step": step, "lease": lease, "holder": holder}))
    os.replace(tmp, _record(path))


def _read_record(path: Path) -> dict[str, object] | None:
    try:
        doc = json.loads(_record(path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("lease"), int) else None


def remove_owned(path: Path) -> None:
    """Remove a registry-owned checkout: the directory first, the record (which says what it was) last."""
    while path.is_dir() and not path.is_symlink():
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            continue  # a concurrent close or gc removed part of it first: finish what is left
    for leftover in (_record(path), path.with_name(f".tmp-{path.name}{RECORD}")):
        try:
            leftover.unlink()
        except FileNotFoundError:
            pass


@dataclass(frozen=True, kw_only=True)
class OwnedCheckout:
    """A registry-owned checkout found under ``<root>/.registry/checkouts/``."""

    path: Path
    run: str
    step: int
    lease: int | None  # None: no record (it counts as live while its step has any unexpired lease)


def owned(root: Path) -> list[OwnedCheckout]:
    """Every registry-owned checkout of ``root`` (directories or records whose name says run and step)."""
    where = home(root)
    try:
        names = sorted(os.listdir(where))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found: dict[str, OwnedCheckout] = {}
    for name in names:
        base = name[:-len(RECORD)] if name.endswith(RECORD) else name
        match = _NAME.fullmatch(base)
        if match is None or base in found:
            continue
        path = where / base
        record = _read_record(path)
        lease = record["lease"] if record is not None else None
        found[base] = OwnedCheckout(path=path, run=match["run"], step=int(match["step"]),
                                    lease=lease if isinstance(lease, int) else None)
    return list(found.values())


def _live(catalog: Catalog, checkout: OwnedCheckout) -> bool:
    if checkout.lease is not None:
        return catalog.lease_live(checkout.lease)
    try:
        return checkout.step in catalog.leased_steps(checkout.run)
    except CheckpointNotFoundError:
        return False  # the run is gone: nothing protects what it left


def expired(catalog: Catalog, root: Path | None, *, run: str | None = None) -> list[OwnedCheckout]:
    """The registry-owned checkouts (of ``run``, or all) whose reader lease expired or was released; ``root``
    None (a root with no directory on this host) has none."""
    if root is None:
        return []
    return [c for c in owned(root) if (run is None or c.run == run) and not _live(catalog, c)]


def reclaim(catalog: Catalog, root: Path, *, run: str | None = None) -> tuple[Path, ...]:
    """Remove the expired registry-owned checkouts (of ``run``, or all); the paths removed."""
    done: list[Path] = []
    for c in expired(catalog, root, run=run):
        remove_owned(c.path)
        done.append(c.path)
    return tuple(done)


def release(catalog: Catalog, root: Path, path: Path) -> OwnedCheckout:
    """End the registry-owned checkout at ``path`` now: release its lease, remove it."""
    where = real(home(root))
    mine = real(path)
    if mine.parent != where:
        raise InvalidStateError(f"{path} is not a registry-owned checkout (those are directories in {where}); "
                                "a checkout into your own directory is yours to remove, and its lease "
                                "expires after its ttl")
    found = next((c for c in owned(root) if real(c.path) == mine), None)
    if found is None or not (mine.is_dir() or _record(mine).exists()):
        raise CheckpointNotFoundError(f"no registry-owned checkout at {path}", path=path)
    if found.lease is not None:
        catalog.release_lease(found.lease)
    remove_owned(found.path)
    return found


__all__ = ["CHECKOUTS", "Kind", "LINKS", "Link", "OwnedCheckout", "check_link", "copy_file", "copy_step",
           "expired", "home", "link_step", "new_owned", "owned", "reclaim", "release", "remove_owned",
           "temp_dir", "write_record"]
