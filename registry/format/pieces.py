"""xxh3-128 digests of fixed-size pieces of a file, so a load can check it on every core.

A whole-file xxh3 is one sequential stream: a verified load of one large file
then runs on a single core (~30 GB/s from the page cache) while the others
wait. Recording a digest per ``PIECE_SIZE`` bytes instead lets the loader hash
the pieces of a mapped file concurrently (python-xxhash releases the GIL), so
checking every byte costs about what touching every byte costs. The writer
computes the pieces inline as it writes, at no extra pass over the data.

The manifest records them per file, next to sha256 (the reference module
ignores the field)::

    "xxh3_128_pieces": {"piece_size": 16777216, "digests": ["<32 hex>", ...]}

Pieces are ``piece_size`` bytes each, the last one shorter; an empty file has
no pieces.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Sequence

import xxhash

from registry.pools import Pool

PIECE_SIZE = 16 << 20
MIN_PIECE_SIZE = 4096

_POOL = Pool(os.cpu_count() or 2, "registry-verify")


def piece_count(size: int, piece_size: int) -> int:
    return -(-size // piece_size)


class PieceHasher:
    """Digests of consecutive ``piece_size`` pieces of a stream fed in order."""

    def __init__(self, piece_size: int | None = None) -> None:
        self.piece_size = piece_size if piece_size is not None else PIECE_SIZE
        self._hasher = xxhash.xxh3_128()
        self._filled = 0
        self._digests: list[str] = []

    def update(self, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data).cast("B")
        while view:
            part = view[:self.piece_size - self._filled]
            self._hasher.update(part)
            self._filled += len(part)
            view = view[len(part):]
            if self._filled == self.piece_size:
                self._digests.append(self._hasher.hexdigest())
                self._hasher.reset()
                self._filled = 0

    def digests(self) -> tuple[str, ...]:
        tail = (self._hasher.hexdigest(),) if self._filled else ()
        return (*self._digests, *tail)


def piece_digests(data: memoryview | bytes | bytearray, piece_size: int) -> tuple[str, ...]:
    """The digest of every piece of ``data``, hashed on all cores when there are several."""
    view = memoryview(data).cast("B")
    starts = range(0, len(view), piece_size)
    if len(starts) < 2:
        return tuple(xxhash.xxh3_128_hexdigest(view[s:s + piece_size]) for s in starts)
    return tuple(_POOL.map(lambda s: xxhash.xxh3_128_hexdigest(view[s:s + piece_size]), starts))


def first_mismatch(data: memoryview | bytes | bytearray, piece_size: int,
                   expected: Sequence[str]) -> int | None:
    """Index of the first piece whose digest differs from ``expected`` (or -1 on a count mismatch)."""
    view = memoryview(data).cast("B")
    if piece_count(len(view), piece_size) != len(expected):
        return -1
    for index, (got, want) in enumerate(zip(piece_digests(view, piece_size), expected)):
        if got != want:
            return index
    return None


class NotHeld(Exception):
    """Raised by a :class:`HeldBytes` ``buffer(i)`` whose bytes are not memory as they are (a tensor on
    another device, or not contiguous): they cannot be looked at before they are written, only after."""


class HeldBytes:
    """A file's bytes before it is written, held as consecutive buffers (a header, then each tensor's memory).

    Lets dedup find a stored file with these bytes from the digests its
    manifest records, and compare them, without writing or copying anything:
    :meth:`matches` hashes pieces up to the first that differs from a
    manifest's (a miss is usually told by the first), :meth:`piece` gives the
    buffers that make up one piece. ``buffer(i)`` gives buffer ``i`` of
    ``lengths``, asked only for the pieces looked at, or raises
    :class:`NotHeld` on this thread.
    """

    def __init__(self, lengths: Sequence[int], buffer: Callable[[int], memoryview], piece_size: int) -> None:
        self.piece_size = piece_size
        self._buffer = buffer
        self._lengths = list(lengths)
        self._starts = [0] * len(self._lengths)
        offset = 0
        for i, n in enumerate(self._lengths):
            self._starts[i] = offset
            offset += n
        self.size = offset
        self._digests: dict[int, str] = {}

    @property
    def count(self) -> int:
        return piece_count(self.size, self.piece_size)

    def piece(self, index: int) -> list[tuple[int, memoryview]]:
        """The buffers of piece ``index``, each with its offset within the piece."""
        begin = index * self.piece_size
        return self.span(begin, min(begin + self.piece_size, self.size))

    def span(self, begin: int, end: int) -> list[tuple[int, memoryview]]:
        """The buffers holding bytes ``begin`` to ``end`` of the file, each with its offset from ``begin``."""
        out: list[tuple[int, memoryview]] = []
        i = max(0, bisect.bisect_right(self._starts, begin) - 1)
        while i < len(self._lengths) and self._starts[i] < end:
            start, n = self._starts[i], self._lengths[i]
            lo, hi = max(begin, start), min(end, start + n)
            if lo < hi:
                out.append((lo - begin, self._buffer(i)[lo - start:hi - start]))
            i += 1
        return out

    def digest(self, index: int) -> str:
        found = self._digests.get(index)
        if found is None:
            hasher = xxhash.xxh3_128()
            for _, part in self.piece(index):
                hasher.update(part)
            found = self._digests[index] = hasher.hexdigest()
        return found

    def matches(self, expected: Sequence[str]) -> bool:
        """Whether the pieces' digests are ``expected``: hashed a few at a time on every core, up to the first
        that differs (a file that differs early costs little, one that differs only at its end a full pass)."""
        if len(expected) != self.count:
            return False
        batch = max(1, _POOL.max_workers)
        index = 0
        while index < self.count:
            todo = range(index, min(self.count, index + (1 if index == 0 else batch)))
            for i in todo:  # the buffers first, on this thread: making one is Python work, hashing is not
                self.piece(i)
            found = [self.digest(todo[0])] if len(todo) == 1 else list(_POOL.map(self.digest, todo))
            if found != list(expected[todo.start:todo.stop]):
                return False
            index = todo.stop
        return True
