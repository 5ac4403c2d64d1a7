"""Policy deltas: what changed between two states of the same tensors, exactly, in a safetensors file.

A delta takes a base state dict to a target with the same tensor names,
shapes and dtypes (anything else raises :class:`~registry.errors.DeltaBaseError`:
only a full publish stores it). For each tensor with a changed element it
holds two zstandard frames, each entry a 1-D uint8 tensor of the file:

- ``positions:NAME``: the flat indices of the changed elements, gap-coded
  (the first index, then each difference to the one before minus one), at
  the tensor's gap width (1, 2, 4 or 8 bytes, the narrowest that holds its
  largest gap), as byte planes: every gap's low byte, then every gap's next
  byte, and so on;
- ``values:NAME``: each changed element's raw bytes XOR the base's, as byte
  planes of the element size. An optimizer step rarely changes the sign,
  exponent or high mantissa bits, so those planes are zeros that zstd
  reduces to almost nothing.

Equality is bitwise: a NaN with another payload, or -0.0 for 0.0, is a
change, and a decode gives back the target's exact bytes. The
``__metadata__`` (``format``, ``version``, ``base_sha256``,
``target_sha256``, ``tensors``, ``content_sha256``; see
docs/reference/format.md) names the base by the digest of the
``model.safetensors`` a full publish of it writes (:func:`full_sha256`),
gives every target tensor's digest (xxh3-128; sha256 in version 1 files,
which still read), and digests the file's own content so a damaged byte
anywhere is a :class:`~registry.errors.CorruptCheckpointError`.

Pure: bytes in, bytes or tensors out; no file, no catalog. Tensors are
worked on one per task on a thread pool (numpy, zstd and the hashes release
the GIL); an encode compares each in chunks that stay in cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import CorruptCheckpointError, DeltaBaseError, SafetensorsFormatError
from registry.format.safetensors import (PUBLISH_METADATA, Encoded, check_state_dict, dtype_names, dtypes,
                                         read_safetensors_header, safetensors_header, tensor_bytes)
from registry.pools import Pool

if TYPE_CHECKING:
    import numpy as np
    import torch

FORMAT = "registry-policy-delta"
# 2 records each tensor's xxh3-128 instead of its sha256: the target's full sha256 already names the version, and a
# second sha256 stream over every byte was a third of an encode's CPU; both versions read
VERSION = "2"
TENSOR_DIGESTS = {"1": "sha256", "2": "xxh3_128"}  # a version's key (and hash) for each tensor's digest
# zstd's: on these streams level 1 is the fastest and no bigger than 3 to 9 (smaller at 20 % changed); 19 saves
# 5-15 % at a hundred times the time
LEVEL = 1
POSITIONS, VALUES = "positions:", "values:"
GAP_WIDTHS = (1, 2, 4, 8)
CHUNK = 1 << 20  # bytes of a tensor compared at a time: the XOR and the mask of a chunk stay in cache

_POOL = Pool(max(2, min(16, os.cpu_count() or 2)), "registry-delta")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX = {"sha256": _HEX64, "xxh3_128": re.compile(r"[0-9a-f]{32}")}


@dataclass(frozen=True)
class TensorRecord:
    """One target tensor as a delta records it: what it is, its digest, and how many of its elements changed."""

    dtype: str                 # the safetensors name: BF16, F32, F8_E4M3, ...
    shape: tuple[int, ...]
    digest: str                # of the tensor's raw little-endian bytes, by the hash the file's version names
    changed: int = 0           # elements that differ from the base's
    gap_width: int = 0         # bytes per coded gap; 0 when nothing changed
    algorithm: str = TENSOR_DIGESTS[VERSION]  # "xxh3_128", or "sha256" in a version 1 file

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), self.algorithm: self.digest}
        if self.changed:
            doc.update(changed=self.changed, gap_width=self.gap_width)
        return doc


@dataclass(frozen=True, kw_only=True)
class DeltaHeader:
    """What a delta file says, checked: the base and target it joins and every target tensor, in the target's order."""

    base_sha256: str
    target_sha256: str
    tensors: dict[str, TensorRecord]
    size: int                  # bytes of the whole file

    @property
    def changed(self) -> int:
        """Elements changed over all tensors."""
        return sum(r.changed for r in self.tensors.values())


@dataclass(frozen=True)
class _Parsed:
    header: DeltaHeader
    streams: dict[str, tuple[memoryview, memoryview]]  # changed tensor -> its positions and values frames
    path: Path


class _Sha256Writer:
    def __init__(self) -> None:
        self.hash = hashlib.sha256()

    def write(self, data: Any, /) -> int:
        self.hash.update(data)
        return memoryview(data).nbytes


def full_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 of the ``model.safetensors`` a full (unsharded) publish of ``tensors`` writes: its manifest's digest."""
    out = _Sha256Writer()
    Encoded(check_state_dict(tensors), PUBLISH_METADATA).write(out)
    return out.hash.hexdigest()


def tensor_digest(tensor: torch.Tensor, algorithm: str = TENSOR_DIGESTS[VERSION]) -> str:
    """The digest a delta records of a tensor: ``algorithm`` (``xxh3_128`` or ``sha256``) of its raw
    little-endian bytes (contiguous, as a safetensors file holds them)."""
    return _digest(tensor_bytes(tensor), algorithm)


def _hasher(algorithm: str) -> Any:
    import xxhash
    return xxhash.xxh3_128() if algorithm == "xxh3_128" else hashlib.sha256()


def _digest(data: Any, algorithm: str) -> str:
    h = _hasher(algorithm)
    h.update(data)
    return str(h.hexdigest())


def _ints(itemsize: int) -> Any:
    import numpy as np
    return {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize]


def _elements(raw: memoryview, itemsize: int) -> np.ndarray:
    import numpy as np
    return np.frombuffer(raw, dtype=_ints(itemsize))


def _planes(values: np.ndarray, width: int) -> memoryview:
    """``values`` as ``width``-byte little-endian integers, byte planes: all low bytes first."""
    import numpy as np
    as_bytes = values.astype(f"<u{width}", copy=False).view(np.uint8).reshape(-1, width)
    return np.ascontiguousarray(as_bytes.T).reshape(-1).data


def _unplanes(raw: bytes, width: int, count: int) -> np.ndarray:
    """The inverse of :func:`_planes`: ``count`` unsigned ``width``-byte integers."""
    import numpy as np
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, count)
    out = planes[0].astype(f"<u{width}")  # shifts and ORs: twice as quick as a transposed copy
    for k in range(1, width):
        plane = planes[k].astype(f"<u{width}")
        plane <<= 8 * k
        out |= plane
    return out


def _gap_width(largest: int) -> int:
    return next(w for w in GAP_WIDTHS if largest < 1 << (8 * w))


# ---------------------------------------------------------------------------------------------------- encode


def _check_same_tensors(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> None:
    names = dtype_names()
    added, removed = sorted(set(target) - set(base)), sorted(set(base) - set(target))
    if added or removed:
        parts = [f"{what} {', '.join(map(repr, found[:3]))}{' ...' if len(found) > 3 else ''}"
                 for what, found in (("adds", added), ("removes", removed)) if found]
        raise DeltaBaseError(f"the target {' and '.join(parts)} against the base: a delta cannot store a changed "
                             "set of tensors; publish a full")
    for name, t in target.items():
        b = base[name]
        if b.dtype != t.dtype or tuple(b.shape) != tuple(t.shape):
            raise DeltaBaseError(
                f"tensor {name!r} is {names[b.dtype]}{list(b.shape)} in the base but {names[t.dtype]}{list(t.shape)} "
                "in the target: a delta cannot store a changed shape or dtype; publish a full")


def _encode_one(base: torch.Tensor, target: torch.Tensor, level: int, *,
                advance: bool) -> tuple[TensorRecord, bytes, bytes]:
    """One tensor's record and frames, worked in cache-sized chunks: the XOR, the mask and (with ``advance``) the
    base taking the target's bytes all happen on a chunk still in cache, in reused buffers, instead of passes over
    fresh whole-tensor arrays (a page fault for each of their pages)."""
    import numpy as np
    import zstandard

    size = target.element_size()
    traw = tensor_bytes(target)
    in_place = advance and base.device.type == "cpu" and base.is_contiguous() and not base.is_conj() \
        and not base.is_neg()  # tensor_bytes(base) is then a view of base's own memory
    braw = tensor_bytes(base)
    digest = _hasher(TENSOR_DIGESTS[VERSION])
    new, old = _elements(traw, size), np.frombuffer(braw, dtype=_ints(size))
    step = max(1, CHUNK // size)
    xor_buf = np.empty(min(new.size, step), dtype=new.dtype)
    mask_buf = np.empty(min(new.size, step), dtype=bool)
    positions: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for start in range(0, new.size, step):
        stop = min(new.size, start + step)
        now, was = new[start:stop], old[start:stop]
        digest.update(traw[start * size:stop * size])
        xor = np.bitwise_xor(was, now, out=xor_buf[:stop - start])
        found = np.flatnonzero(np.not_equal(xor, 0, out=mask_buf[:stop - start]))  # a bool mask: numpy's fast path
        if found.size:
            values.append(xor[found])
            found += start
            positions.append(found)
            if in_place:
                was[...] = now
    if advance and not in_place:
        base.copy_(target)
    record = TensorRecord(dtype_names()[target.dtype], tuple(target.shape), digest.hexdigest())
    if not positions:
        return record, b"", b""
    changed = np.concatenate(positions)
    gaps = np.diff(changed, prepend=-1)
    gaps -= 1
    width = _gap_width(int(gaps.max()))
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
    coded_positions = compressor.compress(_planes(gaps, width))
    coded_values = compressor.compress(_planes(np.concatenate(values), size))
    return (TensorRecord(record.dtype, record.shape, record.digest, int(changed.size), width), coded_positions,
            coded_values)


def encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], *,
           base_sha256: str | None = None, level: int = LEVEL, advance: bool = False) -> bytes:
    """The delta file that takes ``base`` to ``target`` (same names, shapes and dtypes).

    ``base_sha256``: :func:`full_sha256` of ``base`` where the caller has it
    already (a full publish's manifest records it), else it is computed.
    ``level``: zstd's. An unchanged target gives a delta with no entries,
    which decodes to the base. Deterministic: the same inputs give the same
    bytes. ``advance``: the base's tensors are the caller's to overwrite, and
    each takes the target's bytes as it is encoded (never before the names,
    shapes and dtypes were checked), so the caller keeps it as the next
    delta's base without allocating or copying it again.
    """
    return _encode(base, target, base_sha256=base_sha256, target_sha256=None, level=level, advance=advance)


def _encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], *,
            base_sha256: str | None, target_sha256: str | None, level: int,
            advance: bool = False) -> bytes:
    base = check_state_dict(base, what="base")
    target = check_state_dict(target, what="target")
    _check_same_tensors(base, target)
    digests: list[Future[str]] = []
    if base_sha256 is None:
        if advance:  # the base is about to be overwritten: hash it first
            base_sha256 = full_sha256(base)
        else:
            digests.append(_POOL.submit(full_sha256, base))
    if target_sha256 is None:
        digests.append(_POOL.submit(full_sha256, target))

    done = list(_POOL.map(lambda name: _encode_one(base[name], target[name], level, advance=advance), target))
    if base_sha256 is None:
        base_sha256 = digests.pop(0).result()
    if target_sha256 is None:
        target_sha256 = digests.pop(0).result()
    streams: dict[str, bytes] = {}
    for name, (record, positions, values) in zip(target, done):
        if record.changed:
            streams[POSITIONS + name], streams[VALUES + name] = positions, values
    metadata = {"format": FORMAT, "version": VERSION, "base_sha256": base_sha256, "target_sha256": target_sha256,
                "tensors": json.dumps({n: r.to_json() for n, (r, _, _) in zip(target, done)},
                                      separators=(",", ":"))}
    placeholders = _placeholders(streams)
    _, order, _ = safetensors_header(placeholders)  # the file's order, which the content digest follows
    data = [streams[n] for n in order]
    metadata["content_sha256"] = _content_sha256(metadata, data)
    head, _, _ = safetensors_header(placeholders, metadata)
    return b"".join([head, *data])


def _placeholders(streams: Mapping[str, bytes]) -> dict[str, torch.Tensor]:
    import torch
    return {name: torch.empty(len(blob), dtype=torch.uint8, device="meta") for name, blob in streams.items()}


def _content_sha256(metadata: Mapping[str, str], data: Iterable[bytes | memoryview]) -> str:
    """The digest a delta records of itself: its other metadata (as sorted, compact JSON), then its data area."""
    h = hashlib.sha256(json.dumps({k: v for k, v in metadata.items() if k != "content_sha256"},
                                  sort_keys=True, separators=(",", ":")).encode())
    for blob in data:
        h.update(blob)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------- read


class _ViewReader:
    def __init__(self, view: memoryview) -> None:
        self._view, self._at = view, 0

    def read(self, n: int) -> bytes:
        out = bytes(self._view[self._at:self._at + n])
        self._at += len(out)
        return out


def read_header(data: bytes | bytearray | memoryview, *, path: str | Path | None = None) -> DeltaHeader:
    """What delta file ``data`` says, every field and its content digest checked (``CorruptCheckpointError``)."""
    return _parse(data, path).header


def _parse(data: bytes | bytearray | memoryview, path: str | Path | None) -> _Parsed:
    where = Path(path) if path is not None else Path("<delta>")
    view = memoryview(data).cast("B")

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"malformed policy delta {where}: {why}", path=where)

    try:
        header = read_safetensors_header(_ViewReader(view), len(view), where)  # type: ignore[arg-type]
    except SafetensorsFormatError as exc:
        raise bad(str(exc).rsplit(": ", 1)[-1]) from None
    meta = header.metadata
    if meta.get("format") != FORMAT:
        raise bad(f"its format is {meta.get('format')!r}, not {FORMAT!r}")
    version = meta.get("version")
    if version not in TENSOR_DIGESTS:
        raise bad(f"format version {version!r}; this registry reads versions {', '.join(TENSOR_DIGESTS)}")
    expected = {"format", "version", "base_sha256", "target_sha256", "tensors", "content_sha256"}
    if set(meta) != expected:
        raise bad(f"its metadata keys are {sorted(meta)}, not {sorted(expected)}")
    start = header.data_start
    blobs = {e.name: view[start + e.begin:start + e.end] for e in header.entries}
    order = [e.name for e in header.entries]
    if _content_sha256(meta, [blobs[n] for n in order]) != meta["content_sha256"]:
        raise bad("its content does not match its content_sha256: the file is damaged")
    for key in ("base_sha256", "target_sha256"):
        if not _HEX64.fullmatch(meta[key]):
            raise bad(f"{key} is not a sha256 digest")
    try:
        doc = json.loads(meta["tensors"])
    except ValueError:
        raise bad("its tensors field is not JSON") from None
    if type(doc) is not dict:
        raise bad("its tensors field is not an object")
    tensors = {name: _record(name, spec, TENSOR_DIGESTS[version], bad) for name, spec in doc.items()}
    import torch
    streams: dict[str, tuple[memoryview, memoryview]] = {}
    wanted = {kind + n for n, r in tensors.items() if r.changed for kind in (POSITIONS, VALUES)}
    if set(blobs) != wanted:
        odd = sorted(set(blobs) ^ wanted)
        raise bad(f"its entries do not match the changed tensors: {', '.join(map(repr, odd[:3]))}")
    for e in header.entries:
        if e.dtype != torch.uint8 or len(e.shape) != 1:
            raise bad(f"entry {e.name!r} is not a 1-D U8 tensor")
    for name, record in tensors.items():
        if record.changed:
            streams[name] = (blobs[POSITIONS + name], blobs[VALUES + name])
    return _Parsed(DeltaHeader(base_sha256=meta["base_sha256"], target_sha256=meta["target_sha256"],
                               tensors=tensors, size=len(view)), streams, where)


def _record(name: str, spec: object, algorithm: str, bad: Any) -> TensorRecord:
    if not name or name == "__metadata__":
        raise bad(f"it names a tensor {name!r}")
    if type(spec) is not dict or not {"dtype", "shape", algorithm} <= set(spec) \
            or not set(spec) <= {"dtype", "shape", algorithm, "changed", "gap_width"}:
        raise bad(f"tensor {name!r} has malformed fields")
    dtype, shape, digest = spec["dtype"], spec["shape"], spec[algorithm]
    changed, width = spec.get("changed", 0), spec.get("gap_width", 0)
    if type(dtype) is not str or dtype not in dtypes():
        raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
    if type(shape) is not list or not all(type(d) is int and 0 <= d < 2**53 for d in shape):
        raise bad(f"tensor {name!r} has an invalid shape")
    if type(digest) is not str or not _HEX[algorithm].fullmatch(digest):
        raise bad(f"tensor {name!r} has no valid {algorithm}")
    record = TensorRecord(dtype, tuple(shape), digest, algorithm=algorithm)
    if type(changed) is not int or type(width) is not int or not 0 <= changed <= record.numel \
            or (changed > 0) != (width in GAP_WIDTHS) or (changed == 0 and width != 0):
        raise bad(f"tensor {name!r} has an invalid changed count or gap width")
    return TensorRecord(dtype, tuple(shape), digest, changed, width, algorithm)


# ---------------------------------------------------------------------------------------------------- decode


def _inflate(frame: memoryview, size: int, bad: Any) -> bytes:
    import zstandard
    try:
        if zstandard.frame_content_size(frame) != size:
            raise bad(f"a frame does not hold the {size} bytes its tensor needs")
        inflater = zstandard.ZstdDecompressor().decompressobj()
        out = inflater.decompress(frame)
        if not inflater.eof or inflater.unused_data or len(out) != size:
            raise bad("a frame is truncated or followed by other bytes")
    except zstandard.ZstdError as exc:
        raise bad(f"a frame does not decompress ({exc})") from None
    return out


def _changes(record: TensorRecord, stream: tuple[memoryview, memoryview], size: int,
             bad: Any) -> tuple[np.ndarray, np.ndarray]:
    """A changed tensor's flat element indices (int64, ascending, each inside the tensor) and what each element
    is XORed with (integers of the element's ``size``), from its positions and values frames."""
    import numpy as np
    n, width = record.changed, record.gap_width
    gaps = _unplanes(_inflate(stream[0], n * width, bad), width, n)
    values = _unplanes(_inflate(stream[1], n * size, bad), size, n).view(_ints(size))
    numel = record.numel
    # a sum past numel cannot wrap int64 once every gap is below numel and the float sum is bounded
    if int(gaps.max()) >= numel or float(gaps.sum(dtype=np.float64)) + n > numel + 1:
        raise bad("its positions run past the tensor's end")
    index = gaps.astype(np.int64)
    index += 1
    np.cumsum(index, out=index)
    index -= 1
    if int(index[-1]) >= numel:
        raise bad("its positions run past the tensor's end")
    return index, values


def _xor(elements: np.ndarray, index: np.ndarray, values: np.ndarray, record: TensorRecord, bad: Any) -> None:
    """``elements[index] ^= values``, in place; a bool tensor must keep every byte 0 or 1 (torch assumes it)."""
    elements[index] ^= values
    if record.dtype == "BOOL" and bool((elements[index] & ~1).any()):
        raise bad("it makes a bool element other than 0 or 1")


def _decode_one(base: torch.Tensor, record: TensorRecord, stream: tuple[memoryview, memoryview] | None,
                name: str, where: Path, check: bool = True) -> torch.Tensor:
    import torch

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"policy delta {where}: tensor {name!r}: {why}", path=where)

    if stream is None:
        tensor = base
        digest = _digest(tensor_bytes(base), record.algorithm) if check else record.digest
    else:
        size = base.element_size()
        index, values = _changes(record, stream, size, bad)
        out = _elements(tensor_bytes(base), size).copy()
        _xor(out, index, values, record, bad)
        digest = _digest(out, record.algorithm) if check else record.digest
        tensor = torch.from_numpy(out).view(base.dtype).reshape(record.shape)
    if digest != record.digest:
        raise bad(f"the decoded bytes do not match its {record.algorithm}")
    return tensor


def decode(base: Mapping[str, torch.Tensor], data: bytes | bytearray | memoryview, *,
           base_sha256: str | None = None, path: str | Path | None = None,
           check_tensors: bool = True) -> dict[str, torch.Tensor]:
    """The target tensors of delta file ``data`` applied to ``base``: exactly the bytes encoded, each checked.

    Raises ``DeltaBaseError`` when ``base`` is not the delta's base (other
    names, shapes or dtypes, or another :func:`full_sha256`; pass
    ``base_sha256`` where the caller has verified its base against it
    already, which saves hashing it), and ``CorruptCheckpointError`` for a
    damaged file or a tensor that does not decode to its digest. Changed
    tensors are new CPU tensors; unchanged ones are the base's own tensor
    objects (no copy). ``path`` names the file in errors.

    ``check_tensors=False`` skips hashing the result, for a link in the
    middle of a chain whose last link is checked: a wrong element is never
    written over by a later delta (each XORs the value it finds), so it
    reaches the last link's digests, and hashing every tensor at every link
    is what made a chain's rebuild cost its length in full hashes.
    """
    return _decode(base, _parse(data, path), base_sha256=base_sha256, check_tensors=check_tensors)


def _decode(base: Mapping[str, torch.Tensor], parsed: _Parsed, *, base_sha256: str | None,
            check_tensors: bool = True) -> dict[str, torch.Tensor]:
    base = check_state_dict(base, what="base")
    header = parsed.header
    names = dtype_names()
    missing, extra = sorted(set(header.tensors) - set(base)), sorted(set(base) - set(header.tensors))
    if missing or extra:
        raise DeltaBaseError(f"the base is not this delta's: it lacks {missing[:3]} and has {extra[:3]} besides")
    for name, record in header.tensors.items():
        b = base[name]
        if names[b.dtype] != record.dtype or tuple(b.shape) != record.shape:
            raise DeltaBaseError(f"the base is not this delta's: tensor {name!r} is {names[b.dtype]}{list(b.shape)}, "
                                 f"the delta's base had {record.dtype}{list(record.shape)}")
    if base_sha256 is not None and base_sha256 != header.base_sha256:
        raise DeltaBaseError(f"the base is not this delta's: its digest is {base_sha256}, the delta was made "
                             f"against {header.base_sha256}")
    checking = _POOL.submit(full_sha256, base) if base_sha256 is None else None
    work = {name: _POOL.submit(_decode_one, base[name], record, parsed.streams.get(name), name, parsed.path,
                               check_tensors)
            for name, record in header.tensors.items()}
    try:
        got = checking.result() if checking is not None else base_sha256
        if got != header.base_sha256:
            raise DeltaBaseError(f"the base is not this delta's: its digest is {got}, the delta was made against "
                                 f"{header.base_sha256}")
        return {name: future.result() for name, future in work.items()}
    finally:
        for future in work.values():
            future.cancel()


# ---------------------------------------------------------------------------------------------------- patch


class Patch:
    """Delta file ``data`` applied in place to a copy of its base's ``model.safetensors``, window by window.

    A delta keeps names, shapes and dtypes, so the file a full publish of its
    target writes has the very first bytes (:attr:`head`: length prefix and
    header) and size of its base's: a copy of the base's file with every
    changed element XORed in place is the target's file. :meth:`apply` takes
    that copy in consecutive windows, in file order; each tensor's changes
    are decoded once (by the code :func:`decode` runs) when a window first
    reaches the tensor, and dropped once a window passes its end, so what is
    held is one tensor's changes, never a tensor.

    No tensor's digest is checked here: whoever writes the file checks its
    sha256 against :attr:`DeltaHeader.target_sha256`, which covers every byte,
    the patched ones and the copied ones alike, before the file is used.
    """

    def __init__(self, data: bytes | bytearray | memoryview, *, path: str | Path | None = None) -> None:
        import torch
        parsed = _parse(data, path)
        self.header = parsed.header
        known = dtypes()
        layout = {n: torch.empty(r.shape, dtype=known[r.dtype], device="meta") for n, r in self.header.tensors.items()}
        self.head, order, sizes = safetensors_header(layout, PUBLISH_METADATA)
        self.size = len(self.head) + sum(sizes)  # of the file, the base's and the target's
        self._where = parsed.path
        self._spans: list[tuple[int, int, str, TensorRecord, int]] = []  # changed tensors, in file order
        at = len(self.head)
        for name, nbytes in zip(order, sizes):
            record = self.header.tensors[name]
            if record.changed:
                self._spans.append((at, at + nbytes, name, record, known[record.dtype].itemsize))
            at += nbytes
        self._streams = parsed.streams
        self._decoded: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._next = 0   # the first span a window has not passed yet
        self._done = 0   # bytes of the file patched so far

    def apply(self, window: bytearray | memoryview, offset: int) -> None:
        """XOR into ``window`` (writable), bytes ``offset`` to ``offset + len(window)`` of the file, the changes
        that fall there. Each window starts where the one before ended (the first at 0) and ends on a multiple
        of 8 bytes or at the file's end, which keeps every element whole in one window."""
        import numpy as np
        view = memoryview(window).cast("B")
        end = offset + len(view)
        if offset != self._done or end > self.size or (end % 8 and end != self.size):
            raise ValueError(f"a delta patches consecutive windows ending on 8-byte boundaries: got bytes "
                             f"{offset}-{end} after {self._done} of {self.size}")
        self._done = end
        for i in range(self._next, len(self._spans)):
            begin, stop, name, record, size = self._spans[i]
            if begin >= end:
                break
            bad = self._bad(name)
            changes = self._decoded.get(name)
            if changes is None:
                changes = self._decoded[name] = _changes(record, self._streams[name], size, bad)
            index, values = changes
            lo, hi = max(begin, offset), min(stop, end)
            first, last = (lo - begin) // size, (hi - begin) // size
            a, b = (int(k) for k in np.searchsorted(index, (first, last)))
            if b > a:
                elements = np.frombuffer(view, dtype=_ints(size), count=last - first, offset=lo - offset)
                _xor(elements, index[a:b] - first, values[a:b], record, bad)
            if stop <= end:
                del self._decoded[name]
                self._next = i + 1

    def _bad(self, name: str) -> Any:
        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"policy delta {self._where}: tensor {name!r}: {why}", path=self._where)
        return bad


# ---------------------------------------------------------------------------------------------------- fold


def fold(delta_ab: bytes | bytearray | memoryview, delta_bc: bytes | bytearray | memoryview,
         base_a: Mapping[str, torch.Tensor], *, base_sha256: str | None = None, level: int = LEVEL) -> bytes:
    """A delta from a to c, from the deltas a→b and b→c and a's tensors.

    The simplest correct way: decode b, then c (every tensor checked against
    its digest on the way), and encode c against a. Its bytes are those
    ``encode(a, c)`` gives, so a fold of a fold is a fold; an element that
    changed and changed back is no change. ``DeltaBaseError`` when b→c does
    not start where a→b ends, or ``base_a`` is not a→b's base (``base_sha256``
    as in :func:`decode`).
    """
    ab, bc = _parse(delta_ab, None), _parse(delta_bc, None)
    if bc.header.base_sha256 != ab.header.target_sha256:
        raise DeltaBaseError("these deltas do not chain: the second's base is not the first's target "
                             f"({bc.header.base_sha256} against {ab.header.target_sha256})")
    b = _decode(base_a, ab, base_sha256=base_sha256)
    c = _decode(b, bc, base_sha256=ab.header.target_sha256)
    return _encode(base_a, c, base_sha256=ab.header.base_sha256, target_sha256=bc.header.target_sha256, level=level)


__all__ = ["FORMAT", "VERSION", "DeltaHeader", "Patch", "TensorRecord", "decode", "encode", "fold", "full_sha256",
           "read_header", "tensor_digest"]
