"""Streaming, hashing I/O for checkpoint payload files.

Why not ``safetensors.torch.save_file`` then hash? That writes every byte and
then reads every byte back to hash it. Here each file is written once: the
bytes go to the kernel in large pieces while a worker thread feeds the same
pieces to sha256 (hashlib releases the GIL), so the checksum is free on a
machine with a spare core and no second copy of the state dict is made.

Reading is the mirror image: each tensor is allocated once and filled with
``readinto`` while the worker hashes the bytes just read. The safetensors
header is validated completely (size, JSON, dtypes, shapes, offsets that tile
the data area exactly) before any tensor is allocated, so a hostile file
cannot make us allocate or read beyond the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from registry.errors import InvalidStateError, SafetensorsFormatError

CHUNK = 16 << 20          # bytes handed to write()/hash in one call
SMALL = 1 << 20           # pieces below this are coalesced before writing
MAX_HEADER = 100 << 20    # the safetensors reference implementation's own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

_HASH_POOL = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                thread_name_prefix="registry-hash")


def hash_pool() -> ThreadPoolExecutor:
    return _HASH_POOL


class _Hasher:
    """sha256 fed in order from a worker thread, one piece in flight at a time.

    Waiting for the previous piece before submitting the next keeps the updates
    ordered while still overlapping each hash with the next write or read.
    """

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._pending: Future[None] | None = None

    def update(self, piece: memoryview | bytes) -> None:
        if self._pending is not None:
            self._pending.result()
        if len(piece) < SMALL:
            self._pending = None
            self._sha.update(piece)
        else:
            self._pending = _HASH_POOL.submit(self._sha.update, piece)

    def hexdigest(self) -> str:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        return self._sha.hexdigest()


def _write_all(fd: int, piece: memoryview) -> None:
    while piece:
        written = os.write(fd, piece)
        piece = piece[written:]


class HashingWriter:
    """A write-only binary file that computes size and sha256 as it goes.

    ``close()`` fsyncs before closing: a file that is not durable is not done.
    Usable as the target of ``torch.save`` and ``json.dump``-style writers.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._hasher = _Hasher()
        self._buf = bytearray()
        self.size = 0
        self.sha256: str | None = None

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
                piece = view[start:start + CHUNK]
                self._hasher.update(piece)
                _write_all(self._fd, piece)
        self.size += n
        return n

    def _drain(self) -> None:
        if self._buf:
            piece, self._buf = memoryview(self._buf), bytearray()
            self._hasher.update(piece)
            _write_all(self._fd, piece)

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self._drain()
            self.sha256 = self._hasher.hexdigest()
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when contiguous."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def check_state_dict(state_dict: object, *, what: str = "state_dict") -> dict[str, torch.Tensor]:
    if not isinstance(state_dict, Mapping):
        raise InvalidStateError(f"{what} must be a mapping of names to tensors, got {type(state_dict).__name__}")
    for name, value in state_dict.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise InvalidStateError(f"{what} has an invalid tensor name {name!r}")
        if not isinstance(value, torch.Tensor):
            raise InvalidStateError(
                f"{what}[{name!r}] is a {type(value).__name__}, not a tensor; "
                "put non-tensor state in extra=, meta= or config=")
        if value.layout != torch.strided or value.dtype not in DTYPE_NAMES:
            raise InvalidStateError(
                f"{what}[{name!r}] has layout {value.layout} and dtype {value.dtype}, "
                "which safetensors cannot store")
    return dict(state_dict)


def _ordered(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    # widest dtypes first keeps every tensor aligned to its element size
    return sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))


def safetensors_header(tensors: Mapping[str, torch.Tensor],
                       metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[str]]:
    order = _ordered(tensors)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def write_safetensors(out: HashingWriter, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> None:
    head, order = safetensors_header(tensors, metadata)
    out.write(head)
    for name in order:
        out.write(tensor_bytes(tensors[name]))


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, kw_only=True)
class SafetensorsHeader:
    header_size: int
    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return 8 + self.header_size


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsFormatError(f"duplicate tensor name {key!r} in safetensors header")
        out[key] = value
    return out


def read_safetensors_header(f: BinaryIO, file_size: int, path: Path) -> SafetensorsHeader:
    """Parse and fully validate a safetensors header before anything is allocated."""
    def bad(why: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(f"malformed safetensors file {path}: {why}", path=path)

    prefix = f.read(8)
    if len(prefix) != 8:
        raise bad("shorter than its 8-byte header length")
    (size,) = struct.unpack("<Q", prefix)
    if size > MAX_HEADER or size > file_size - 8:
        raise bad(f"header length {size} exceeds the file or the {MAX_HEADER}-byte limit")
    raw = f.read(size)
    if len(raw) != size:
        raise bad("truncated header")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except SafetensorsFormatError as exc:
        raise bad(str(exc).rsplit(": ", 1)[-1]) from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("header is not valid JSON") from None
    if not isinstance(doc, dict):
        raise bad("header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise bad("__metadata__ must map strings to strings")
    entries = []
    for name, spec in doc.items():
        if not isinstance(spec, dict):
            raise bad(f"entry {name!r} is not an object")
        dtype = DTYPES.get(spec.get("dtype")) if isinstance(spec.get("dtype"), str) else None
        shape, offsets = spec.get("shape"), spec.get("data_offsets")
        if dtype is None:
            raise bad(f"entry {name!r} has unknown dtype {spec.get('dtype')!r}")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**53 for d in shape):
            raise bad(f"entry {name!r} has an invalid shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise bad(f"entry {name!r} has invalid data_offsets")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
            raise bad(f"entry {name!r} offsets do not match its shape and dtype")
        entries.append(TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end))
    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = 0
    for entry in entries:
        if entry.begin != cursor:
            raise bad(f"entry {entry.name!r} overlaps another or leaves a gap")
        cursor = entry.end
    if cursor != file_size - 8 - size:
        raise bad(f"tensor data covers {cursor} bytes but the file holds {file_size - 8 - size}")
    return SafetensorsHeader(header_size=size, entries=tuple(entries), metadata=metadata)


def read_safetensors(path: Path, *, checksum: bool = False,
                     names: Iterable[str] | None = None) -> tuple[dict[str, torch.Tensor], str | None]:
    """Load the tensors of ``path``, each in its own storage, and its sha256.

    With ``checksum`` the file's sha256 is computed while reading, for the
    caller to compare with the manifest; otherwise the digest is None.
    ``names`` restricts which tensors are returned (all bytes are still read
    when hashing).
    """
    wanted = set(names) if names is not None else None
    hasher = _Hasher() if checksum else None
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb", buffering=0) as f:
        file_size = os.fstat(f.fileno()).st_size
        header = read_safetensors_header(f, file_size, path)
        if hasher is not None:
            f.seek(0)
            head = f.read(header.data_start)
            hasher.update(head)
        for entry in header.entries:
            if wanted is not None and entry.name not in wanted and hasher is None:
                f.seek(header.data_start + entry.end)
                continue
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
            if entry.end > entry.begin:
                view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
                for start in range(0, len(view), CHUNK):
                    piece = view[start:start + CHUNK]
                    got = f.readinto(piece)
                    while got is not None and got < len(piece):
                        more = f.readinto(piece[got:])
                        if not more:
                            raise SafetensorsFormatError(f"truncated safetensors file {path}", path=path)
                        got += more
                    if hasher is not None:
                        hasher.update(piece)
            if wanted is None or entry.name in wanted:
                out[entry.name] = tensor
    return out, (hasher.hexdigest() if hasher is not None else None)


def sha256_file(path: Path) -> tuple[int, str]:
    """Size and sha256 of a file, reading in large pieces."""
    hasher = _Hasher()
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            piece = f.read(CHUNK)
            if not piece:
                break
            size += len(piece)
            hasher.update(piece)
    return size, hasher.hexdigest()
