"""Store a staged file as a hard link to a byte-identical file of a live step, instead of a second copy.

A frozen base model in a fine-tuning run, or an unchanged ``config.json``,
is written by every publish; linking it to the copy an earlier step already
holds keeps one set of blocks. Checkpoint files are never written in place
(a publish writes a new staging directory, gc removes whole directories), so
a shared inode is as immutable as a private one, and removing one step's
directory only unlinks that step's names: the bytes stay while any step
links them.

"Identical" is confirmed, not assumed: the catalog says a live step records
a file of the same size and sha256 (that is how candidates are found), and
then the candidate must be a regular file on the staging directory's
filesystem whose bytes equal ours, compared in full. That costs one read of
the candidate (ours is still in the page cache from the write), and it means
a candidate that rotted on disk since it was verified is never linked: we
keep our good copy. After linking, the new name must be the very inode that
was compared, so a candidate replaced in between is not taken either.

A link goes to a temporary name in the staging directory and is then renamed
over the staged copy, and the staging directory is fsync'd: a crash at any
point leaves a staging directory whose files are each either our copy or a
link to the same bytes, and staging directories are discarded anyway. A
link never crosses filesystems (``EXDEV``) or roots (candidates come from
this root's catalog); any failure to link keeps the copy.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from registry.crashpoints import crashpoint
from registry.fs.store import fsync_dir

CHUNK = 2 << 20  # two of these are all a confirmation holds: a publish stays a streaming writer


@dataclass(frozen=True, kw_only=True)
class Linked:
    """A staged file now stored as a link to ``source`` (a file of a live step)."""

    name: str
    source: Path
    size: int


def _same_bytes(ours: Path, theirs: Path, expect: os.stat_result) -> bool:
    """Whether ``theirs`` (still the inode ``expect``) holds exactly the bytes of ``ours``."""
    try:
        fd = os.open(theirs, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino, st.st_size) != (expect.st_dev, expect.st_ino, expect.st_size):
            return False
        chunk = max(1, min(CHUNK, st.st_size))  # a small config.json gets a small buffer
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


def _link_one(staging: Path, name: str, candidate: Path, device: int) -> bool:
    ours = staging / name
    try:
        mine = os.lstat(ours)
        theirs = os.lstat(candidate)
    except OSError:
        return False
    if (not stat.S_ISREG(theirs.st_mode) or theirs.st_size != mine.st_size or theirs.st_dev != device
            or mine.st_dev != device):
        return False
    if theirs.st_ino == mine.st_ino:
        return True  # already one inode (an import that hard-linked it)
    if not _same_bytes(ours, candidate, theirs):
        return False
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


def link_identical(staging: Path, candidates: Mapping[str, Sequence[Path]]) -> list[Linked]:
    """Replace each staged ``name`` by a link to the first of its ``candidates`` confirmed identical.

    ``candidates`` come from the catalog (same size and sha256, live steps of
    this root), best first. Returns what was linked; the staging directory is
    fsync'd when anything was.
    """
    device = os.stat(staging).st_dev
    linked: list[Linked] = []
    for name, paths in candidates.items():
        for path in paths:
            if _link_one(staging, name, path, device):
                linked.append(Linked(name=name, source=path, size=os.lstat(staging / name).st_size))
                break
    if linked:
        fsync_dir(staging)
        crashpoint("dedup-after-fsync")
    return linked


def shared_bytes(directory: Path) -> int:
    """Bytes of ``directory``'s files that other names (another step's links) also hold.

    What deleting the directory would not free; what linking saved.
    """
    total = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            total += st.st_size
    return total


__all__ = ["Linked", "link_identical", "shared_bytes"]
