"""A checkpoint's files as byte buffers, and the checkpoint parsed out of them.

The distributed loader moves *files*, not tensors: rank 0 memory-maps the
files a load needs, the other ranks either map the same files (shared
filesystem) or receive their bytes into buffers allocated ahead. Every rank
then parses the very same bytes with the very same code below, which is why
the results are bit-identical everywhere.

Parsing makes no second copy of the weights, and every tensor owns a storage
of exactly its bytes, as ``safetensors.torch.load_file`` gives: over a mapped
file (rank 0, or a shared filesystem) a slice of the private, copy-on-write
mapping, so the page cache is the only copy; on a receiving rank the very
storage its bytes were received into, because a safetensors file travels as
its header plus one piece per tensor (:func:`layout`). A tensor whose offset
is not a multiple of its element size (never in files we or ``safetensors``
write) is copied into an aligned storage of its own.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import re
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from registry.errors import CorruptCheckpointError, ManifestError, SafetensorsFormatError, UnsafePickleError
from registry.manifest import (CONFIG, MANIFEST, MAX_JSON_BYTES, META, WEIGHTS, WEIGHTS_INDEX, Manifest,
                               check_file_name, digest_bytes, open_regular, parse_manifest)
from registry.store import Loaded, assemble_shards
from registry.tensorio import MAX_HEADER, SafetensorsHeader, read_safetensors_header, tensors_in


def map_file(directory: Path, name: str, *, expected_size: int | None = None) -> torch.Tensor:
    """``directory/name`` as a uint8 tensor over a private (copy-on-write) memory map.

    Symlinks are refused; the size is checked against the manifest before any
    byte is touched. The mapping lives as long as the tensor or any view of it.
    """
    path = directory / name
    fd = open_regular(directory, name)
    try:
        size = os.fstat(fd).st_size
        if expected_size is not None and size != expected_size:
            raise CorruptCheckpointError(
                f"checkpoint file size mismatch: {path} is {size} bytes, manifest says {expected_size}", path=path)
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
        mapped.madvise(mmap.MADV_SEQUENTIAL)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def host_view(buf: torch.Tensor) -> memoryview:
    """The bytes of a CPU uint8 tensor, without a copy."""
    return memoryview(buf.numpy()).cast("B") if buf.numel() else memoryview(b"")


def _host_bytes(buf: torch.Tensor, limit: int | None = None) -> bytes:
    part = buf if limit is None else buf[:limit]
    return bytes(host_view(part.cpu()))


def json_object(buf: torch.Tensor, path: Path) -> dict[str, Any]:
    if buf.numel() > MAX_JSON_BYTES:
        raise CorruptCheckpointError(f"{path} is larger than {MAX_JSON_BYTES} bytes", path=path)
    try:
        doc = json.loads(_host_bytes(buf).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ManifestError(f"{path} is not valid JSON", path=path) from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{path} is not a JSON object", path=path)
    return doc


def weight_map(index: dict[str, Any], path: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json``, every shard name checked."""
    mapping = index.get("weight_map")
    if not isinstance(mapping, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise ManifestError(f"{path} has no valid weight_map", path=path)
    for shard in set(mapping.values()):
        check_file_name(shard, where=path)
    return mapping


def parse_manifest_buffer(buf: torch.Tensor, directory: Path) -> tuple[Manifest, str]:
    raw = _host_bytes(buf)
    return parse_manifest(raw, path=directory / MANIFEST), digest_bytes(raw)


class _ViewReader:
    """Just enough of a binary file for ``read_safetensors_header``, over a buffer."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._raw) if n < 0 else self._pos + n
        out = self._raw[self._pos:end]
        self._pos += len(out)
        return out


def _header(buf: torch.Tensor, size: int, path: Path) -> SafetensorsHeader:
    """The validated header at the start of ``buf``, for a file of ``size`` bytes."""
    have = buf.numel()
    prefix = _host_bytes(buf, min(have, 8))
    declared = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
    # only the header is copied out; its parser checks the declared length against the limits
    head = _host_bytes(buf, min(have, 8 + min(declared, MAX_HEADER + 1)))
    return read_safetensors_header(_ViewReader(head), size, path)  # type: ignore[arg-type]


_OFFSETS = re.compile(rb'"data_offsets"\s*:\s*\[\s*(\d+)\s*,\s*(\d+)\s*\]')


def layout(name: str, buf: torch.Tensor) -> list[int]:
    """How a file is cut for the wire: the lengths of pieces that each get a storage of their own.

    A safetensors file is its header, then each non-empty tensor; any other
    file is one piece. This is a hint, read from the header's offsets
    without building its JSON (rank 0 parses every header once more after
    the transfer, and a parse of thousands of entries is the garbage
    collector's busiest moment): the pieces must tile the file exactly or
    the file is one piece, and the receiving side parses the header in full
    and joins the pieces when they do not fit it, so a wrong hint costs
    time, never a wrong tensor.
    """
    size = buf.numel()
    if not name.endswith(".safetensors") or size < 8:
        return [size]
    declared = int.from_bytes(_host_bytes(buf, 8), "little")
    if declared > min(MAX_HEADER, size - 8):
        return [size]
    spans = sorted((int(a), int(b)) for a, b in _OFFSETS.findall(_host_bytes(buf, 8 + declared), 8))
    lengths, cursor = [8 + declared], 0
    for begin, end in spans:
        if begin != cursor or end < begin:
            return [size]
        if end > begin:
            lengths.append(end - begin)
        cursor = end
    return lengths if cursor == size - 8 - declared else [size]


def tensors_of(buf: torch.Tensor | Sequence[torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``buf``, each over its own bytes without a copy.

    ``buf`` is the whole file, or the pieces of its :func:`layout` (each
    tensor is then the storage its piece was received into).
    """
    if isinstance(buf, torch.Tensor):
        return tensors_in(buf, _header(buf, buf.numel(), path))
    try:
        header = _header(buf[0], sum(b.numel() for b in buf), path)
        lengths = [e.end - e.begin for e in header.entries if e.end > e.begin]
        fits = buf[0].numel() == header.data_start and [b.numel() for b in buf[1:]] == lengths
    except SafetensorsFormatError:
        fits = False
    if not fits:  # cut by another reading of the file than the one received; parse the bytes as they are
        return {k: v.clone() for k, v in tensors_of(torch.cat(list(buf)), path).items()}
    pieces = iter(buf[1:])  # detach(): the tensor keeps the piece's storage, not a view's base object
    return {e.name: next(pieces).view(e.dtype).view(e.shape).detach() if e.end > e.begin
            else torch.empty(e.shape, dtype=e.dtype, device=buf[0].device) for e in header.entries}


def unpickle(buf: torch.Tensor, path: Path, *, trust_pickle: bool, map_location: Any) -> Any:
    """A ``.pt`` extra: ``weights_only`` unless the caller trusts its author."""
    try:
        return torch.load(io.BytesIO(_host_bytes(buf)), map_location=map_location, weights_only=not trust_pickle)
    except pickle.UnpicklingError as exc:
        if trust_pickle:
            raise CorruptCheckpointError(f"cannot unpickle {path}: {exc}".splitlines()[0], path=path) from None
        raise UnsafePickleError(f"{path} needs full unpickling, which can run arbitrary code; "
                                "pass trust_pickle=True only if you trust its author", path=path) from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CorruptCheckpointError(f"cannot load {path}: {first}", path=path) from None


def is_cpu(device: torch.device | None) -> bool:
    return device is None or device.type == "cpu"


def parse_files(directory: Path, files: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], *,
                trust_pickle: bool, device: torch.device | None) -> Loaded:
    """The checkpoint held in ``files`` (name -> bytes), as ``read_directory`` would load it.

    ``files`` holds exactly what a load needs (see the loader's plan): the
    manifest if any, meta, config, weights or index plus shards, ``.pt`` extras.
    A safetensors file may be given as the pieces of its :func:`layout`;
    every other file is one buffer.
    """
    def whole(name: str) -> torch.Tensor:
        buf = files[name]
        return buf if isinstance(buf, torch.Tensor) else torch.cat(list(buf))

    manifest: Manifest | None = None
    manifest_sha: str | None = None
    if MANIFEST in files:
        manifest, manifest_sha = parse_manifest_buffer(whole(MANIFEST), directory)
    meta = json_object(whole(META), directory / META) if META in files else {}
    config = json_object(whole(CONFIG), directory / CONFIG) if CONFIG in files else {}
    owner: dict[str, str] | None = None
    if WEIGHTS in files:
        weight_files = [WEIGHTS]
    elif WEIGHTS_INDEX in files:
        owner = weight_map(json_object(whole(WEIGHTS_INDEX), directory / WEIGHTS_INDEX), directory / WEIGHTS_INDEX)
        weight_files = sorted(set(owner.values()))
        missing = [w for w in weight_files if w not in files]
        if missing:
            raise ManifestError(f"shard {missing[0]!r} of {directory} was not loaded", path=directory)
    else:
        raise CorruptCheckpointError(f"no model weights in {directory}", path=directory)
    state = assemble_shards(directory, ((name, tensors_of(files[name], directory / name))
                                        for name in weight_files), owner)
    extra = {name[:-3]: unpickle(whole(name), directory / name, trust_pickle=trust_pickle,
                                 map_location=device if device is not None else "cpu")
             for name in sorted(n for n in files if n.endswith(".pt"))}
    if device is not None:
        state = {k: (v if v.device == device else v.to(device)) for k, v in state.items()}
    return Loaded(state_dict=state, extra=extra, meta=meta, config=config,
                  manifest=manifest, manifest_sha256=manifest_sha)


__all__ = ["json_object", "layout", "map_file", "parse_files", "tensors_of", "weight_map"]
