"""Which inodes a set of step directories hold: what dedup's links share, and what removing a step frees.

Dedup stores a file a verified step already holds as a hard link, so several
steps' names may hold one inode. Whether two steps share fate, what deleting
some steps would free, and what a step shares with others are all questions
about inodes and their names, answered from ``lstat`` alone: this module
reads no file's bytes, so a listing (``registry show``) asks it cheaply.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

Inode = tuple[int, int]  # (st_dev, st_ino)


def _files(directories: Iterable[Path]) -> Iterator[os.stat_result]:
    """The ``lstat`` of every regular file under ``directories`` (subdirectories too), one per name.

    A directory that cannot be read has none: what it holds is unknown, never guessed.
    """
    pending = list(directories)
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                pending.append(Path(entry.path))
            elif stat.S_ISREG(st.st_mode):
                yield st


def inodes(directory: Path) -> dict[Inode, int]:
    """The regular files under ``directory`` (subdirectories too), by inode, with their sizes."""
    return held((directory,))


def held(directories: Iterable[Path]) -> dict[Inode, int]:
    """Every inode the ``directories`` hold between them, with its size."""
    return {(st.st_dev, st.st_ino): st.st_size for st in _files(directories)}


def names_per_inode(directories: Iterable[Path]) -> tuple[dict[Inode, int], dict[Inode, int]]:
    """For the regular files under ``directories``: inode -> size, and inode -> how many of their names hold it.

    An inode whose names here equal its ``st_nlink`` has no name anywhere else:
    removing these directories frees its bytes.
    """
    sizes: dict[Inode, int] = {}
    names: dict[Inode, int] = {}
    nlink: dict[Inode, int] = {}
    for st in _files(directories):
        key = (st.st_dev, st.st_ino)
        sizes[key] = st.st_size
        names[key] = names.get(key, 0) + 1
        nlink[key] = st.st_nlink
    return sizes, {k: n for k, n in names.items() if n >= nlink[k]}


def freed_bytes(doomed: Iterable[Path]) -> int:
    """The bytes removing the ``doomed`` directories would actually free: inodes with no name elsewhere."""
    sizes, only_here = names_per_inode(doomed)
    return sum(sizes[k] for k in only_here)


def shared_bytes(directory: Path, others: Iterable[Path]) -> int:
    """Bytes of ``directory``'s files that one of the ``others`` (other steps' directories) also holds.

    What linking saved; what deleting ``directory`` alone would not free
    because those steps keep it. Links held by anything else (a checkout, a
    copy elsewhere) are not "shared with other steps".
    """
    mine = inodes(directory)
    theirs = held(o for o in others if o != directory)
    return sum(size for key, size in mine.items() if key in theirs)


__all__ = ["Inode", "freed_bytes", "held", "inodes", "names_per_inode", "shared_bytes"]
