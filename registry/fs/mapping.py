"""A checkpoint file's bytes: mapped without a copy, checked against its manifest entry, read errors named.

The lowest piece of the read path, shared by the directory reader (:mod:`registry.fs.filemaps`), the DCP
shard reader (:mod:`registry.fs.dcpfiles`) and the collectives that ship bytes between ranks.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

from registry.errors import CheckpointReadError, CorruptCheckpointError
from registry.format.manifest import FileEntry, open_regular
from registry.format.pieces import first_mismatch
from registry.fs.hashing import hash_bytes

if TYPE_CHECKING:
    import torch


def map_file(directory: Path, name: str, *, expected_size: int | None = None,
             error: type[CorruptCheckpointError] = CorruptCheckpointError,
             what: str = "checkpoint file") -> torch.Tensor:
    """``directory/name`` as a uint8 tensor over a private (copy-on-write) memory map, or over a copy in
    memory of a JSON file up to :data:`SMALL_JSON` bytes (a manifest, ``meta.json``, an index).

    Symlinks are refused; the size is checked against the manifest before any
    byte is touched. The mapping lives as long as the tensor or any view of it.
    """
    import torch
    fd = open_regular(directory, name, error=error, what=what)
    try:
        size = os.fstat(fd).st_size
        if expected_size is not None and size != expected_size:
            path = directory / name
            raise CorruptCheckpointError(
                f"checkpoint file size mismatch: {path} is {size} bytes, manifest says {expected_size}", path=path)
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        if size <= SMALL_JSON and name.endswith(".json"):  # parsed whole, never viewed as tensors
            return torch.frombuffer(_read_all(fd, size, directory, name), dtype=torch.uint8)
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
        mapped.madvise(mmap.MADV_SEQUENTIAL)
    return torch.frombuffer(mapped, dtype=torch.uint8)


SMALL_JSON = 64 << 10  # read into memory: a map, its page fault and its unmap cost more than the copy


def _read_all(fd: int, size: int, directory: Path, name: str) -> bytearray:
    """The ``size`` bytes of ``fd``; a file that shrank while read is a size mismatch, as a map would find."""
    buf = bytearray(size)
    view, done = memoryview(buf), 0
    while done < size:
        n = os.readv(fd, [view[done:]])
        if n == 0:
            path = directory / name
            raise CorruptCheckpointError(f"checkpoint file size mismatch: {path} ended at byte {done}, "
                                         f"{size} expected", path=path)
        done += n
    return buf


def host_view(buf: torch.Tensor) -> memoryview:
    """The bytes of a CPU uint8 tensor, without a copy."""
    return buf.reshape(-1).numpy().data.cast("B") if buf.numel() else memoryview(b"")


def host_bytes(buf: torch.Tensor, limit: int | None = None) -> bytes:
    """The first ``limit`` bytes (all by default) of a uint8 tensor on any device, as ``bytes``."""
    part = buf if limit is None else buf[:limit]
    return bytes(host_view(part.cpu()))


def check_file_digest(directory: Path, entry: FileEntry, data: bytes | memoryview) -> None:
    """Check a whole file's bytes against the fastest digest its manifest entry has.

    xxh3-128 of 16 MiB pieces (hashed on all cores), else of the whole file
    (manifests written before pieces), else sha256 (the reference module's).
    The manifest itself is matched against the sha256 the catalog keeps, so a
    recorded xxh3 is as trustworthy as the manifest; xxh3 catches any
    accidental damage (bit rot, torn or truncated writes) but, unlike sha256,
    not a deliberate forgery, which is what ``registry verify`` re-checks.
    """
    where = ""
    if entry.xxh3_128_pieces is not None and entry.piece_size is not None:
        piece = first_mismatch(data, entry.piece_size, entry.xxh3_128_pieces)
        ok = piece is None
        if piece is not None and piece >= 0:  # tells an operator where the damage starts
            where = f" (bytes {piece * entry.piece_size}-{min(len(data), (piece + 1) * entry.piece_size) - 1})"
    elif entry.xxh3_128 is not None:
        ok = hash_bytes(data, "xxh3_128") == entry.xxh3_128
    else:
        ok = hash_bytes(data, "sha256") == entry.sha256
    if not ok:
        path = directory / entry.name
        raise CorruptCheckpointError(f"checkpoint file checksum mismatch: {path}{where}", path=path)


def read_error(directory: Path, exc: OSError) -> CheckpointReadError:
    """A failure of this process to read ``directory``: never evidence against the checkpoint."""
    where = exc.filename or directory
    return CheckpointReadError(f"cannot read {where}: {exc.strerror or exc}", errno=exc.errno, path=where)


__all__ = ["check_file_digest", "host_bytes", "host_view", "map_file", "read_error"]
