"""The safetensors encoding: a state dict to a header and its tensors' bytes, and a hostile file's header checked.

A header is validated completely (size, JSON, dtypes, shapes, offsets that
tile the data area exactly) before any tensor is made from it, so a hostile
file cannot make us allocate or view beyond the file, and each tensor of a
mapped file gets a storage of its own bytes (:func:`tensors_in`). Writing goes
to any binary writer (:class:`registry.fs.hashing.HashingWriter` in a
publish), reading maps files (``registry.fs.mapping``): this module touches
no file of its own.
"""

from __future__ import annotations

import functools
import json
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, Protocol

from registry.errors import InvalidStateError, SafetensorsFormatError
from registry.format.pieces import NotHeld

if TYPE_CHECKING:
    import torch

MAX_HEADER = 100 << 20    # the safetensors reference implementation's own limit
# a publish's model.safetensors carries this __metadata__ (transformers checks it when loading)
PUBLISH_METADATA: Mapping[str, str] = MappingProxyType({"format": "pt"})

if sys.byteorder != "little":  # safetensors is little-endian; we write tensor memory as is
    raise ImportError("registry.format.safetensors supports little-endian machines only")


class Writer(Protocol):
    """Where :func:`write_safetensors` puts the bytes."""

    def write(self, data: Any, /) -> int: ...


@functools.cache
def dtypes() -> Mapping[str, torch.dtype]:
    """The safetensors dtype names and the torch dtypes they stand for.

    Built on first use: the store imports this module for commands that
    never touch a tensor, and those should not pay for importing torch.
    """
    import torch
    return {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
        "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
        "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
        "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    }


@functools.cache
def dtype_names() -> Mapping[torch.dtype, str]:
    """The inverse of :func:`dtypes`."""
    return {v: k for k, v in dtypes().items()}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when contiguous."""
    import torch
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def check_state_dict(state_dict: object, *, what: str = "state_dict") -> dict[str, torch.Tensor]:
    import torch
    if not isinstance(state_dict, Mapping):
        raise InvalidStateError(f"{what} must be a mapping of names to tensors, got {type(state_dict).__name__}")
    names = dtype_names()
    for name, value in state_dict.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise InvalidStateError(f"{what} has an invalid tensor name {name!r}")
        if not isinstance(value, torch.Tensor):
            raise InvalidStateError(
                f"{what}[{name!r}] is a {type(value).__name__}, not a tensor; "
                "put non-tensor state in extra=, meta= or config=")
        if value.layout != torch.strided or value.dtype not in names:
            raise InvalidStateError(
                f"{what}[{name!r}] has layout {value.layout} and dtype {value.dtype}, "
                "which safetensors cannot store")
        if value.device.type == "meta":
            raise InvalidStateError(f"{what}[{name!r}] is on the meta device: it has no data to store")
    return dict(state_dict)


def _ordered(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    # widest dtypes first keeps every tensor aligned to its element size
    return sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))


def safetensors_header(tensors: Mapping[str, torch.Tensor],
                       metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[str], list[int]]:
    """The file's first bytes (length prefix and header), its tensors' names in file order, and their sizes."""
    order = _ordered(tensors)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    names = dtype_names()
    sizes = [0] * len(order)
    for i, name in enumerate(order):
        t = tensors[name]
        sizes[i] = nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order, sizes


def write_safetensors(out: Writer, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> bytes:
    """Write a safetensors file; returns its first bytes (length prefix and header) for read-back checks."""
    encoded = Encoded(tensors, metadata)
    encoded.write(out)
    return encoded.head


class Encoded:
    """A safetensors file about to be written: its header, then its tensors' bytes, made on demand.

    Buffer 0 is the header, buffer ``i`` the ``i``-th tensor in file order.
    A buffer over a tensor's own memory is made once and kept (it costs no
    memory), so whoever looks at the bytes before they are written (dedup
    hashing a piece) and the writer share that work; a tensor that needs a
    copy (not on the CPU, not contiguous) is copied only as it is written.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
        self.head, order, sizes = safetensors_header(tensors, metadata)
        self.tensors = [tensors[n] for n in order]
        self.lengths = [len(self.head), *sizes]  # of each buffer
        self.size = sum(self.lengths)
        self._views: dict[int, memoryview] = {0: memoryview(self.head)}

    def held(self, index: int) -> memoryview:
        """Buffer ``index`` over the memory it already is, without a copy: a
        :class:`registry.format.pieces.HeldBytes` buffer. Raises
        :class:`~registry.format.pieces.NotHeld` for a tensor that would need a
        copy (on another device, not contiguous, a conjugate or negative view):
        only the tensors looked at are asked, so a miss told by a few of them
        never looks at the others."""
        view = self._views.get(index)
        if view is None:
            t = self.tensors[index - 1]
            if not (t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()):
                raise NotHeld(index)
            view = self._views[index] = tensor_bytes(t)
        return view

    def write(self, out: Writer) -> None:
        out.write(self.head)
        for index, tensor in enumerate(self.tensors, start=1):
            view = self._views.get(index)
            out.write(view if view is not None else tensor_bytes(tensor))


class TensorEntry(NamedTuple):  # a tuple: headers can list many thousands, and a dataclass costs 3x to build
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
    known = dtypes()
    for name, spec in doc.items():  # type(x) is int: bools are ints to isinstance, never to a shape
        if type(spec) is not dict:
            raise bad(f"entry {name!r} is not an object")
        dtype_name, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        dtype = known.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise bad(f"entry {name!r} has unknown dtype {dtype_name!r}")
        if type(shape) is not list:
            raise bad(f"entry {name!r} has an invalid shape")
        numel = 1
        for d in shape:
            if type(d) is not int or not 0 <= d < 2**53:
                raise bad(f"entry {name!r} has an invalid shape")
            numel *= d
        if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int \
                or type(offsets[1]) is not int:
            raise bad(f"entry {name!r} has invalid data_offsets")
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
            raise bad(f"entry {name!r} offsets do not match its shape and dtype")
        entries.append(TensorEntry(name, dtype, tuple(shape), begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = 0
    for entry in entries:
        if entry.begin != cursor:
            raise bad(f"entry {entry.name!r} overlaps another or leaves a gap")
        cursor = entry.end
    if cursor != file_size - 8 - size:
        raise bad(f"tensor data covers {cursor} bytes but the file holds {file_size - 8 - size}")
    return SafetensorsHeader(header_size=size, entries=tuple(entries), metadata=metadata)


def tensors_in(u8: torch.Tensor, header: SafetensorsHeader) -> dict[str, torch.Tensor]:
    """Every tensor of a validated header, each over its own bytes of ``u8`` (the whole file, on the CPU).

    Nothing is copied, yet each tensor gets a storage that is exactly its
    bytes, as ``safetensors`` gives: ``torch.save`` of one tensor writes only
    its bytes, and tensors of different dtypes never share a storage. Each
    storage holds a numpy slice of ``u8``'s memory (which keeps ``u8``, e.g. a
    file mapping, alive while any tensor lives); numpy arrays are no work
    for the garbage collector, unlike one storage or view object per tensor.
    An empty tensor owns nothing; a tensor whose bytes are not aligned to
    its element size (legal in the format, never written by us) is copied
    into a storage of its own.
    """
    import torch
    array = u8.numpy()
    base = header.data_start
    address = u8.data_ptr() + base
    empty, frombuffer = torch.empty, torch.frombuffer
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, begin, end in header.entries:
        if end == begin:
            out[name] = empty(shape, dtype=dtype)
        elif (address + begin) % dtype.itemsize:
            tensor = empty(shape, dtype=dtype)
            tensor.reshape(-1).view(torch.uint8).copy_(u8[base + begin:base + end])
            out[name] = tensor
        else:
            tensor = frombuffer(array[base + begin:base + end], dtype=dtype)
            if len(shape) != 1:
                tensor.resize_(shape)  # in place: same bytes, and no view object keeping a base alive
            out[name] = tensor
    return out
