"""Store a staged file as a hard link to a byte-identical file of a verified step, instead of a second copy.

Opt-in (``Registry.open(..., dedup=True)``, ``publish(..., dedup=True)``). A
frozen base model in a fine-tuning run is written by every publish; linking
it to the copy an earlier step already holds keeps one set of blocks. What
may be linked is bounded so that one bad inode never takes a run's fallback
(the callers, ``registry.ops.protocol.HeldSources`` and ``link_duplicates``, pick candidates):
files below :data:`MIN_LINK_BYTES` and the small JSON files are never linked
(no saving, all risk); links stay within a run; and a new step never links
to an inode its fallback neighbours hold, so the two newest verified steps of
a run share no inode. A deletion that would make them share one first gives
the newer step an independent copy (:func:`unshare`). Checkpoint files are never written in place
(a publish writes a new staging directory, gc removes whole directories), so
a shared inode is as immutable as a private one, and removing one step's
directory only unlinks that step's names: the bytes stay while any step
links them.

A safetensors file is looked for before it is written (:func:`link_held`):
the catalog names files of its size in verified steps, and one whose
manifest records the xxh3 pieces of the bytes in memory (hashed at memory
speed; a miss is usually told by the first piece) is compared with the
memory and linked, so a hit writes and hashes nothing. Other files are
written first and linked after (:func:`link_identical`): the catalog says a
live step records a file of the same size and sha256.

"Identical" is confirmed, not assumed: the candidate must be a regular file
on the staging directory's filesystem whose bytes equal ours, compared in
full (one read of the candidate, against the tensors' memory or our copy
still in the page cache), so a candidate that rotted on disk since it was
verified is never linked: we keep (or write) our good copy. After linking,
the new name must be the very inode that was compared, so a candidate
replaced in between is not taken either.

A link goes to a temporary name in the staging directory and is then renamed
over the staged copy (or to the file's name, before writing), and the staging directory is fsync'd: a crash at any
point leaves a staging directory whose files are each either our copy or a
link to the same bytes, and staging directories are discarded anyway. A
link never crosses filesystems (``EXDEV``) or roots (candidates come from
this root's catalog); any failure to link keeps the copy.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from registry.crashpoints import crashpoint
from registry.errors import RegistryError
from registry.format.manifest import MANIFEST, FileEntry, digest_bytes, manifest_bytes, parse_manifest, read_manifest
from registry.format import pieces as piece_format
from registry.format.pieces import HeldBytes
from registry.fs.hashing import libc_function
from registry.fs.inodes import Inode, inodes
from registry.fs.store import fsync_dir
from registry.pools import Pool

log = logging.getLogger(__name__)

CHUNK = 2 << 20  # two of these are all a confirmation holds: a publish stays a streaming writer
#: files smaller than this are never linked: the saving is nothing, a shared bad byte would cost steps
MIN_LINK_BYTES = 1 << 20
#: never linked whatever their size: small, per-step, and read by every load
NEVER_LINKED = frozenset({MANIFEST, "meta.json", "config.json"})

def linkable(name: str, size: int) -> bool:
    """Whether dedup may store ``name`` (of ``size`` bytes) as a link at all."""
    return size >= MIN_LINK_BYTES and name.rsplit("/", 1)[-1] not in NEVER_LINKED


@dataclass(frozen=True, kw_only=True)
class Linked:
    """A staged file now stored as a link to ``source`` (a file of a live step)."""

    name: str
    source: Path
    size: int


def _open_inode(path: Path, expect: os.stat_result, size: int) -> int | None:
    """A read descriptor on ``path`` if it still is the inode ``expect`` and ``size`` bytes long, else None.

    Not a symlink, not blocking on a FIFO: what is compared must be the very file that was looked up.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if (st.st_dev, st.st_ino, st.st_size) != (expect.st_dev, expect.st_ino, size):
        os.close(fd)
        return None
    return fd


def _same_bytes(ours: Path, theirs: Path, expect: os.stat_result) -> bool:
    """Whether ``theirs`` (still the inode ``expect``) holds exactly the bytes of ``ours``."""
    fd = _open_inode(theirs, expect, expect.st_size)
    if fd is None:
        return False
    try:
        chunk = max(1, min(CHUNK, expect.st_size))  # a small config.json gets a small buffer
        mine_buf, theirs_buf = bytearray(chunk), bytearray(chunk)  # reused: no fresh pages per chunk
        with open(ours, "rb", buffering=0) as mine:
            offset = 0
            while True:
                n = mine.readinto(mine_buf)
                m = os.preadv(fd, [theirs_buf], offset)
                if n != m:
                    return False
                if n == 0:
                    return True
                same = (mine_buf == theirs_buf if n == chunk
                        else bytes(memoryview(mine_buf)[:n]) == bytes(memoryview(theirs_buf)[:n]))
                if not same:
                    return False
                offset += n
    except OSError:
        return False
    finally:
        os.close(fd)


def _may_link(theirs: os.stat_result, size: int, device: int, exclude: Collection[Inode]) -> bool:
    """Whether a candidate (its ``lstat``) may stand for a file of ``size`` bytes on ``device``."""
    if (theirs.st_dev, theirs.st_ino) in exclude:
        return False  # a fallback neighbour holds it: linking would give the two one fate
    return stat.S_ISREG(theirs.st_mode) and theirs.st_size == size and theirs.st_dev == device


def _link_one(staging: Path, name: str, candidate: Path, device: int, exclude: Collection[Inode]) -> bool:
    ours = staging / name
    try:
        mine = os.lstat(ours)
        theirs = os.lstat(candidate)
    except OSError:
        return False
    if not _may_link(theirs, mine.st_size, device, exclude) or mine.st_dev != device:
        return False
    if theirs.st_ino == mine.st_ino:
        return True  # already one inode (an import that hard-linked it)
    if not _same_bytes(ours, candidate, theirs):
        return False
    return _link_as(staging, name, candidate, theirs)


def _link_as(staging: Path, name: str, candidate: Path, theirs: os.stat_result) -> bool:
    """Make ``staging/name`` a link to ``candidate``, which must still be the inode ``theirs`` (compared)."""
    ours = staging / name
    tmp = staging / f".{name}.link-{secrets.token_hex(4)}"
    try:
        os.link(candidate, tmp, follow_symlinks=False)
    except OSError:
        return False  # EXDEV, EMLINK, EPERM, the candidate's step deleted meanwhile: keep the copy
    try:
        now = os.lstat(tmp)
        if (now.st_dev, now.st_ino) != (theirs.st_dev, theirs.st_ino):
            os.unlink(tmp)
            return False
        crashpoint("dedup-after-link")
        os.replace(tmp, ours)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True


def link_identical(staging: Path, candidates: Mapping[str, Sequence[Path]], *,
                   exclude: Collection[Inode] = ()) -> list[Linked]:
    """Replace each staged ``name`` by a link to the first of its ``candidates`` confirmed identical.

    ``candidates`` come from the catalog (same size and sha256, verified steps
    of the run), best first; a candidate whose inode is in ``exclude`` (held
    by a fallback neighbour) is never taken. Returns what was linked; the
    staging directory is fsync'd when anything was.
    """
    device = os.stat(staging).st_dev
    linked: list[Linked] = []
    for name, paths in candidates.items():
        for path in paths:
            if _link_one(staging, name, path, device, exclude):
                linked.append(Linked(name=name, source=path, size=os.lstat(staging / name).st_size))
                break
    if linked:
        fsync_dir(staging)
        crashpoint("dedup-after-fsync")
    return linked


@dataclass(frozen=True, kw_only=True)
class Source:
    """A file of a verified step that may hold the bytes a publish is about to write (the catalog's word)."""

    step_dir: Path
    name: str
    sha256: str           # the file's digest, as the catalog records it
    manifest_sha256: str  # its step's manifest digest, as the catalog records it


def link_held(staging: Path, name: str, lengths: Sequence[int], buffer: Callable[[int], memoryview],
              sources: Sequence[Source], *, exclude: Collection[Inode] = ()) -> tuple[FileEntry, Path] | None:
    """Store ``staging/name`` as a link to the first of ``sources`` holding the bytes in memory, never writing them.

    The file's bytes are buffers of ``lengths`` in order (a safetensors
    header, then each tensor's memory), ``buffer(i)`` the ``i``-th, asked
    for only as the pieces are looked at; a :class:`~registry.format.pieces.NotHeld` it raises
    propagates before anything is linked. A source is taken only when its
    step's manifest on disk is the one the catalog verified, records this
    file with the catalog's sha256 and xxh3 pieces equal to those of the
    memory, and the file's bytes then compare equal to the memory in full (a
    miss is usually told by a few small windows of the file, :func:`_samples_equal`,
    before any of that);
    the link must be the very inode compared. Only then does the new
    manifest entry, returned with the file linked to, take the source's
    sha256: it is the digest of exactly these bytes. ``None``: nothing was
    linked, nothing is left in ``staging``, and the caller writes the file.
    """
    device = os.stat(staging).st_dev
    size = sum(lengths)
    cut = piece_format.PIECE_SIZE  # as the writer cuts them now
    held = {cut: HeldBytes(lengths, buffer, cut)}
    data_start = lengths[0] if len(lengths) > 1 else 0  # past the header, which a same-shapes file shares
    for source in sources:
        path = source.step_dir / source.name
        try:
            theirs = os.lstat(path)
        except OSError:
            continue
        if not _may_link(theirs, size, device, exclude) or not _samples_equal(
                path, theirs, held[cut], data_start=data_start):
            continue
        entry = _recorded(source, size, held[cut])
        if entry is None or entry.piece_size is None or entry.xxh3_128_pieces is None:
            continue
        ours = held.get(entry.piece_size)
        if ours is None:
            ours = held[entry.piece_size] = HeldBytes(lengths, buffer, entry.piece_size)
        pieces = entry.xxh3_128_pieces
        if not ours.matches(pieces):
            continue
        if _held_equal(path, theirs, ours) and _link_as(staging, name, path, theirs):
            return FileEntry(name=name, size=size, sha256=entry.sha256, piece_size=entry.piece_size,
                             xxh3_128_pieces=pieces), path
    return None


def _recorded(source: Source, size: int, ours: HeldBytes) -> FileEntry | None:
    """``source``'s entry in its step's manifest, if that manifest and entry are what the catalog verified.

    A manifest that does not hold the digest of our first piece (as the
    writer cuts pieces) is not even parsed: the usual miss costs a read and
    a search of its bytes.
    """
    try:
        raw = manifest_bytes(source.step_dir)
        if digest_bytes(raw) != source.manifest_sha256 or (ours.count and ours.digest(0).encode() not in raw):
            return None
        manifest = parse_manifest(raw, path=source.step_dir / MANIFEST)
    except (RegistryError, OSError):
        return None
    entry = manifest.files.get(source.name)
    if entry is None or entry.size != size or entry.sha256 != source.sha256:
        return None
    return entry


_COMPARE_POOL = Pool(max(1, min(8, os.cpu_count() or 1)), "registry-compare")
_MEMCMP = libc_function("memcmp")
if _MEMCMP is not None:
    _MEMCMP.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    _MEMCMP.restype = ctypes.c_int


SAMPLE = 16 << 10  # bytes of one window of a candidate compared before a piece of the memory is hashed
SAMPLES = 8  # windows, spread evenly from the first byte after the header to the file's last


def _samples_equal(path: Path, expect: os.stat_result, ours: HeldBytes, *, data_start: int) -> bool:
    """Whether :data:`SAMPLES` windows of ``path`` (still the inode ``expect``) spread over its data, the
    first at ``data_start`` and the last at the file's end, hold the bytes of ``ours`` there.

    A candidate of the same size usually is the same shapes at another step:
    its header is ours, its weights are not, and a training step changes
    them everywhere; a partly frozen model still differs over whole tensors.
    A few small reads tell that miss apart before its manifest is read and a
    16 MiB piece of the memory hashed; a difference between the windows is
    still found by the pieces, and a match goes through the manifest, the
    pieces and the full comparison.
    """
    fd = _open_inode(path, expect, ours.size)
    if fd is None:
        return False
    data_start = min(max(0, data_start), ours.size)
    n = min(SAMPLE, ours.size - data_start)
    last = ours.size - n
    begins = sorted({data_start + (last - data_start) * k // (SAMPLES - 1) for k in range(SAMPLES)})
    buf = bytearray(n)
    view = memoryview(buf)
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0
        return all(_read_equal(fd, view, base, begin, ours.span(begin, begin + n)) for begin in begins)
    except OSError:
        return False
    finally:
        view.release()
        os.close(fd)


def _held_equal(path: Path, expect: os.stat_result, ours: HeldBytes) -> bool:
    """Whether ``path`` (still the inode ``expect``) holds exactly ``ours``, read and compared on every core.

    Each worker reads its share of the pieces into one reused buffer and
    compares it with the memory by ``memcmp``, which, like the read, runs
    without the GIL; the first difference stops them all.
    """
    fd = _open_inode(path, expect, ours.size)
    if fd is None:
        return False
    try:
        differs = threading.Event()
        count = ours.count
        workers = max(1, min(count, _COMPARE_POOL.max_workers))
        shares = [range(count * k // workers, count * (k + 1) // workers) for k in range(workers)]
        results = list(_COMPARE_POOL.map(lambda share: _compare_share(fd, ours, share, differs), shares))
        return all(results) and not differs.is_set()
    finally:
        os.close(fd)


def _compare_share(fd: int, ours: HeldBytes, share: range, differs: threading.Event) -> bool:
    buf = bytearray(min(ours.piece_size, ours.size))
    view = memoryview(buf)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0
    try:
        for index in share:
            if differs.is_set():
                return False
            begin = index * ours.piece_size
            n = min(ours.piece_size, ours.size - begin)
            if not _read_equal(fd, view[:n], base, begin, ours.piece(index)):
                differs.set()
                return False
        return True
    except OSError:
        differs.set()
        return False
    finally:
        view.release()


def _read_equal(fd: int, view: memoryview, base: int, begin: int, parts: list[tuple[int, memoryview]]) -> bool:
    """Whether the ``len(view)`` bytes of ``fd`` from ``begin``, read into ``view`` (whose memory starts at
    ``base``), are ``parts`` (each a buffer at its offset in ``view``); a file shorter than that is not."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], begin + done)
        if got <= 0:
            return False
        done += got
    return all(_same(view, base, offset, part) for offset, part in parts)


def _same(view: memoryview, base: int, offset: int, part: memoryview) -> bool:
    if _MEMCMP is None:
        return view[offset:offset + len(part)].tobytes() == part.tobytes()
    import numpy  # the address of any buffer, read-only ones (a header's bytes) too
    address = numpy.frombuffer(part, dtype=numpy.uint8).ctypes.data
    return bool(_MEMCMP(base + offset, address, len(part)) == 0)


def unshare(newer: Path, older: Path) -> list[str]:
    """Give ``newer`` its own copy of each file whose inode ``older`` also holds; the names copied.

    Each copy is written to a temporary name beside the file, fsync'd, its
    sha256 checked against ``newer``'s manifest, and renamed over the link;
    the directory is fsync'd after. A crash at any point leaves every name
    holding the same bytes (the link or the checked copy). A copy whose
    digest does not match (the shared inode is already bad) is not installed:
    that step is corrupt either way, and ``verify`` says so.
    """
    theirs = inodes(older)
    if not theirs:
        return []
    try:
        manifest, _ = read_manifest(newer)
    except Exception:  # noqa: BLE001 - an unreadable manifest: verify condemns the step, nothing to copy for
        return []
    copied: list[str] = []
    touched: set[Path] = set()
    for name, entry in sorted(manifest.files.items()):
        path = newer / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) not in theirs:
            continue
        if _copy_over(path, st, entry.sha256):
            copied.append(name)
            touched.add(path.parent)
    for directory in touched:
        fsync_dir(directory)
    if copied:
        log.info("gave %s its own copy of %s (was shared with %s)", newer, ", ".join(copied), older)
    return copied


def _copy_over(path: Path, st: os.stat_result, sha256: str) -> bool:
    tmp = path.parent / f".{path.name}.unshare-{secrets.token_hex(4)}"
    src = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if os.fstat(src).st_ino != st.st_ino:
            return False
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            digest = hashlib.sha256()
            buf = bytearray(8 << 20)
            view = memoryview(buf)
            while n := os.readv(src, [buf]):
                digest.update(view[:n])
                done = 0
                while done < n:
                    done += os.write(dst, view[done:n])
            os.fchmod(dst, stat.S_IMODE(st.st_mode))
            os.fsync(dst)
        finally:
            os.close(dst)
        if digest.hexdigest() != sha256:
            log.error("%s does not match its manifest: not copied (the step is corrupt)", path)
            os.unlink(tmp)
            return False
        crashpoint("unshare-after-copy")
        os.replace(tmp, path)
        return True
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        os.close(src)


__all__ = ["Linked", "MIN_LINK_BYTES", "NEVER_LINKED", "Source", "link_held", "link_identical", "linkable", "unshare"]
