"""Streaming, hashing writes and reads of checkpoint files: each byte written once, hashed on the way.

Why not ``safetensors.torch.save_file`` then hash? That serialises the whole
state dict into one bytes object (a second full copy in memory), writes it,
and a checksum then needs every byte read back. Here each file is written
once, straight from the tensors' own memory: the bytes go to the kernel in
large pieces while a worker thread feeds the same pieces, in order, to sha256
(hashlib releases the GIL), so no file is re-read and no copy of the state
dict is made. What bounds a publish on a fast disk is sha256 itself, about
2 GB/s on one core, so everything else is arranged to hide behind it:

- the writer thread also computes an xxh3-128 digest of every 16 MiB piece
  (about 30 GB/s; ``registry.format.pieces``), recorded next to sha256 in the
  manifest so that loads can check every byte at memory speed on all cores;
- kernel writeback is started as each piece is written (``sync_file_range``
  on Linux), so the closing ``fsync`` has almost nothing left to flush and the
  disk works while sha256 catches up;
- the writer may run up to ``MAX_PENDING`` pieces ahead of the hasher; the
  pieces are views of the tensors, and only coalesced small pieces are copies,
  so the extra memory stays under ``MAX_PENDING * SMALL`` bytes.

What the bytes mean (the safetensors encoding) is :mod:`registry.format.safetensors`'s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from registry.format.pieces import PieceHasher
from registry.pools import Pool

CHUNK = 16 << 20          # bytes handed to write()/hash in one call
SMALL = 1 << 20           # pieces below this are coalesced before writing
MAX_PENDING = 8           # pieces the writer may run ahead of the hasher
WRITEBACK = 8 << 20       # start kernel writeback every this many bytes

_HASH_POOL = Pool(max(2, min(16, os.cpu_count() or 2)), "registry-hash")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library: the process's own symbols first, which hold it wherever Python links it dynamically.

    ``find_library`` runs ``ldconfig`` in a child process, 2 ms of every
    command's start-up that needs no C function.
    """
    for find in (lambda: None, lambda: ctypes.util.find_library("c")):
        try:
            library = ctypes.CDLL(find(), use_errno=True)
            library["memcmp"]  # noqa: B018 (a handle without libc's symbols is not libc)
            return library
        except (OSError, AttributeError, TypeError):
            continue
    return None


def libc_function(name: str) -> Any:
    """``name`` from the C library through ctypes (the GIL is released during each call), or None.

    A new function object per call: each caller sets its own ``argtypes``.
    """
    library = _libc()
    try:
        return None if library is None else library[name]
    except AttributeError:
        return None


def _sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    fn = libc_function("sync_file_range")
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range out now (a hint; ``fsync`` still decides)."""
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # errors surface at fsync


@dataclass(frozen=True, kw_only=True)
class Digests:
    sha256: str | None
    xxh3_128: str | None


class Hasher:
    """sha256 and/or xxh3-128 of one byte stream, fed in order on a worker thread.

    ``update`` queues a piece and returns at once unless ``MAX_PENDING``
    pieces are already waiting, so the caller's I/O overlaps the hashing. The
    caller must not modify a piece until :meth:`digests` has returned.
    xxh3 is cheap enough to run inline when sha256 occupies the worker
    (``inline_xxh3``), which keeps the worker, the bottleneck, on sha256 alone.
    """

    def __init__(self, *, sha256: bool = True, xxh3: bool = True, inline_xxh3: bool = False,
                 max_pending: int | None = None) -> None:
        self._max_pending = max_pending if max_pending is not None else MAX_PENDING
        self._sha = hashlib.sha256() if sha256 else None
        self._xxh = xxhash.xxh3_128() if xxh3 else None
        self._inline_xxh = inline_xxh3 and xxh3
        self._queue: deque[memoryview | bytes | bytearray] = deque()
        self._cond = threading.Condition()
        self._running = False
        self._error: BaseException | None = None

    def update(self, piece: memoryview | bytes | bytearray) -> None:
        if not len(piece):
            return
        if self._inline_xxh:
            assert self._xxh is not None
            self._xxh.update(piece)
        if self._sha is None and (self._xxh is None or self._inline_xxh):
            return  # nothing for the worker to hash
        with self._cond:
            while len(self._queue) >= self._max_pending and self._error is None:
                self._cond.wait()
            self._raise_error()
            if not self._running and len(piece) < SMALL:
                self._hash(piece)  # the worker is idle: nothing to overtake, no hand-off worth its cost
                return
            self._queue.append(piece)
            if not self._running:
                self._running = True
                _HASH_POOL.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._queue or self._error is not None:
                    self._running = False
                    self._cond.notify_all()
                    return
                piece = self._queue[0]
            try:
                self._hash(piece)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller in digests()
                with self._cond:
                    self._error = exc
            with self._cond:
                self._queue.popleft()
                self._cond.notify_all()

    def _hash(self, piece: memoryview | bytes | bytearray) -> None:
        if self._sha is not None:
            self._sha.update(piece)
        if self._xxh is not None and not self._inline_xxh:
            self._xxh.update(piece)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def digests(self) -> Digests:
        with self._cond:
            while self._running:
                self._cond.wait()
            self._raise_error()
        return Digests(sha256=self._sha.hexdigest() if self._sha is not None else None,
                       xxh3_128=self._xxh.hexdigest() if self._xxh is not None else None)


def _write_all(fd: int, piece: memoryview | bytearray) -> None:
    view = memoryview(piece)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class HashingWriter:
    """A write-only binary file that computes size, sha256 and xxh3-128 piece digests as it goes.

    ``close()`` fsyncs before closing: a file that is not durable is not done.
    Usable as the target of ``torch.save`` and ``json.dump``-style writers.
    Large writes go to the kernel straight from the caller's buffer (the
    caller must keep it unchanged until ``close``, as a publish does); small
    ones are coalesced into ``SMALL``-byte pieces.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # 0o666: the process umask decides the mode, as it does for a plain open()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        self._begin()

    def _begin(self) -> None:
        self._hasher = Hasher(sha256=True, xxh3=False)
        self._pieces = PieceHasher()
        self._buf = bytearray()
        self._synced_to = 0   # bytes for which writeback has been started
        self._on_disk = 0     # bytes handed to write()
        self.size = 0
        self.sha256: str | None = None
        self.piece_size = self._pieces.piece_size
        self.xxh3_128_pieces: tuple[str, ...] | None = None

    # the subset of the io API that torch.save and friends use
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n < SMALL:
            self._buf += view
            if len(self._buf) >= SMALL:
                self._drain()
        else:
            self._drain()
            for start in range(0, n, CHUNK):
                self._put(view[start:start + CHUNK])
        self.size += n
        return n

    def _put(self, piece: memoryview | bytearray) -> None:
        self._hasher.update(piece)
        self._pieces.update(piece)  # inline: xxh3 keeps up with the disk, sha256 is the worker's
        self._emit(piece)

    def _emit(self, piece: memoryview | bytearray) -> None:
        """Hand one hashed piece to the file (a subclass sends it elsewhere)."""
        _write_all(self._fd, piece)
        self._on_disk += len(piece)
        if self._on_disk - self._synced_to >= WRITEBACK:
            start_writeback(self._fd, self._synced_to, self._on_disk - self._synced_to)
            self._synced_to = self._on_disk

    def _drain(self) -> None:
        if self._buf:
            piece, self._buf = self._buf, bytearray()
            self._put(piece)

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self._drain()
            os.fsync(self._fd)  # overlaps with the hasher finishing its last pieces
            self._finish_digests()
        finally:
            os.close(self._fd)
            self._fd = -1

    def close_later(self, sync: Callable[[Callable[[], None]], Future[None]]) -> Future[None]:
        """Finish the digests now, but fsync and close through ``sync`` (e.g. a thread pool).

        Lets a writer of many files fsync them concurrently (one journal commit
        on ext4 instead of one per file) while it writes the next file.
        """
        try:
            self._drain()
        except BaseException:
            self.abort()
            raise
        fd, self._fd = self._fd, -1

        def fsync_close() -> None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        future = sync(fsync_close)
        self._finish_digests()
        return future

    def _finish_digests(self) -> None:
        self.sha256 = self._hasher.digests().sha256
        self.xxh3_128_pieces = self._pieces.digests()

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            try:
                self._hasher.digests()  # never leave the worker reading a buffer we give back
            except BaseException:  # noqa: BLE001 - the original error is the one to report
                pass

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


DIGESTS = ("sha256", "xxh3_128")


def _new_hasher(digest: str | None, max_pending: int | None = None) -> Hasher | None:
    if digest is None:
        return None
    if digest not in DIGESTS:
        raise ValueError(f"unknown digest {digest!r}; expected one of {DIGESTS}")
    return Hasher(sha256=digest == "sha256", xxh3=digest == "xxh3_128", max_pending=max_pending)


def _hexdigest(hasher: Hasher, digest: str) -> str:
    found = hasher.digests()
    value = found.sha256 if digest == "sha256" else found.xxh3_128
    assert value is not None
    return value


def hash_file(path: Path, digest: str = "sha256", *,
              on_bytes: Callable[[int], object] | None = None) -> tuple[int, str]:
    """Size and ``digest`` of a file, reading the next piece while the last is hashed.

    ``on_bytes(n)`` is called after each piece read, for progress reports.
    """
    hasher = _new_hasher(digest, max_pending=2)  # each queued piece is a fresh bytes object
    assert hasher is not None
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            piece = f.read(CHUNK)
            if not piece:
                break
            size += len(piece)
            hasher.update(piece)
            if on_bytes is not None:
                on_bytes(len(piece))
    return size, _hexdigest(hasher, digest)


def sha256_file(path: Path) -> tuple[int, str]:
    """Size and sha256 of a file, reading in large pieces."""
    return hash_file(path, "sha256")


def hash_bytes(raw: bytes | bytearray | memoryview, digest: str = "sha256") -> str:
    if digest == "sha256":
        return hashlib.sha256(raw).hexdigest()
    if digest == "xxh3_128":
        return xxhash.xxh3_128_hexdigest(raw)
    raise ValueError(f"unknown digest {digest!r}; expected one of {DIGESTS}")
