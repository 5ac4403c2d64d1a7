"""Reading a checkpoint directory: which files a load reads, mapped once, and one parser of their bytes.

Every reader of a checkpoint directory goes through here: a local load
(:func:`read_directory`), rank 0 of a distributed load and the ranks that
receive its bytes (:func:`map_directory`, :func:`parse_files`), an import
(which checks what a load would read) and fsck (:func:`read_json`). A load
reads the manifest if any, ``meta.json``, ``config.json``, the weights (one
file, or the index and every shard it names) and the ``.pt`` extras asked
for; :func:`map_directory` decides that once and maps exactly those files.

Every file is mapped private (copy-on-write), and the tensors are views of
that mapping: parsing makes no second copy of the weights, and a verified
load hashes the very bytes its tensors view. Every tensor owns a storage of
exactly its bytes, as ``safetensors.torch.load_file`` gives: over a mapped
file a slice of the mapping, so the page cache is the only copy; on a
receiving rank the very storage its bytes were received into, because a
safetensors file travels as its header plus one piece per tensor
(:func:`layout`). A tensor whose offset is not a multiple of its element
size (never in files we or ``safetensors`` write) is copied into an aligned
storage of its own.

Bytes that do not match raise ``CorruptCheckpointError`` (or a subclass); a
directory that is not there, or a file this process cannot open or map (no
permission, out of file descriptors), raises ``CheckpointReadError``: that is
the reader's trouble, not the checkpoint's.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from registry.errors import (CheckpointReadError, CorruptCheckpointError, ExtraNotFoundError, InvalidStateError,
                             ManifestError, RegistryError, SafetensorsFormatError, UnsafePickleError)
from registry.format.manifest import (CONFIG, DELTA, MANIFEST, MAX_JSON_BYTES, META, WEIGHTS, WEIGHTS_INDEX, Manifest,
                                      check_file_name, decode_json_object, digest_bytes, parse_manifest)
from registry.format.safetensors import MAX_HEADER, SafetensorsHeader, read_safetensors_header, tensors_in
from registry.fs.mapping import check_file_digest, host_bytes, host_view, map_file, read_error

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
Extras = bool | Collection[str]


@dataclass(frozen=True, kw_only=True)
class Loaded:
    state_dict: dict[str, torch.Tensor]
    extra: dict[str, Any]
    meta: dict[str, Any]
    config: dict[str, Any]
    manifest: Manifest | None
    manifest_sha256: str | None
    # a policy delta step as read: its ``delta.safetensors`` bytes, and ``state_dict`` empty until the reader
    # above rebuilds it from its chain (registry.ops.policy)
    delta: torch.Tensor | None = None

    @property
    def epoch(self) -> int:
        return self.meta.get("epoch", 0)

    @property
    def consumed_samples(self) -> int:
        return self.meta.get("consumed_samples", 0)

    @property
    def policy_version(self) -> int | None:
        """The step's policy version: the manifest's, else an integer ``policy_version`` in ``meta.json``."""
        policy = self.meta.get("policy_version")
        if self.manifest is not None and self.manifest.policy_version is not None:
            policy = self.manifest.policy_version
        return policy if isinstance(policy, int) else None


# --------------------------------------------------------------------------- directories


def _checked_directory(directory: Path) -> None:
    if not directory.is_dir():
        if directory.exists():
            raise CorruptCheckpointError(f"checkpoint path is not a directory: {directory}", path=directory)
        raise CheckpointReadError(f"checkpoint directory is missing: {directory}", errno=errno.ENOENT,
                                  path=directory)


# --------------------------------------------------------------------------- the plan


def check_extras(extras: object) -> Extras:
    """``extras`` of a load: True (all), False (none) or a collection of extra names."""
    if isinstance(extras, bool):
        return extras
    if isinstance(extras, (str, bytes)) or not isinstance(extras, Collection) or not all(
            isinstance(n, str) and n and "/" not in n and not n.startswith(".") for n in extras):
        raise InvalidStateError(f"extras must be True, False or a list of extra names, got {extras!r}")
    return frozenset(extras)


def select_extras(directory: Path, present: Iterable[str], extras: Extras) -> list[str]:
    """The ``NAME.pt`` files among ``present`` that a load with ``extras`` reads, sorted."""
    files = sorted(n for n in present if n.endswith(".pt"))
    if extras is True:
        return files
    if extras is False:
        return []
    missing = sorted(set(extras) - {n[:-3] for n in files})
    if missing:
        raise ExtraNotFoundError(f"{directory} has no extra {missing[0]!r} (it has: "
                                 f"{', '.join(n[:-3] for n in files) or 'none'})", path=directory)
    return [n for n in files if n[:-3] in extras]


@dataclass(frozen=True, kw_only=True)
class MappedFiles:
    """The files a load of ``directory`` reads, each mapped whole, in the order they were mapped."""

    directory: Path
    buffers: dict[str, torch.Tensor]
    manifest: Manifest | None
    manifest_sha256: str | None
    owner: dict[str, str] | None  # an index's weight_map (tensor -> shard); None for one weights file


def check_manifest_digest(directory: Path, digest: str | None, recorded: str | None, *,
                          run: str | None = None, step: int | None = None) -> None:
    """The manifest read (sha256 ``digest``, None without one) must be the one the catalog ``recorded``.

    ``recorded`` None (nothing recorded: a directory outside the catalog) accepts any manifest.
    """
    if recorded and digest != recorded:
        raise CorruptCheckpointError(f"manifest of {directory} does not match the catalog's record",
                                     path=directory, run=run, step=step)


def map_directory(directory: Path, *, extras: Extras = True, verify: bool = False,
                  expected_digest: str | None = None) -> MappedFiles:
    """Map exactly what a load with ``extras`` reads, checking names, sizes and the catalog's digest.

    ``expected_digest`` (the catalog's record of the manifest) is checked
    first, before any other file is mapped or hashed. With a manifest, only
    the files it lists are read and every size is checked before a byte is
    touched; with ``verify`` each file is checked against its digest as soon
    as it is mapped, before anything parses it. Without a manifest the
    reference's layout is read as it is and nothing can be verified.
    """
    _checked_directory(directory)
    try:
        return _map_directory(directory, extras=extras, verify=verify, expected_digest=expected_digest)
    except RegistryError:
        raise
    except OSError as exc:
        raise read_error(directory, exc) from exc


def _map_directory(directory: Path, *, extras: Extras, verify: bool, expected_digest: str | None) -> MappedFiles:
    buffers: dict[str, torch.Tensor] = {}
    manifest: Manifest | None = None
    digest: str | None = None
    if os.path.lexists(os.path.join(directory, MANIFEST)):  # a symlink there is refused, not skipped
        buffers[MANIFEST] = map_file(directory, MANIFEST, error=ManifestError, what="manifest")
        manifest, digest = _parse_manifest(buffers[MANIFEST], directory)
    check_manifest_digest(directory, digest, expected_digest)  # before any other file is mapped
    listed = manifest.files if manifest is not None else None
    present = set(listed) if listed is not None else {p.name for p in directory.iterdir() if p.is_file()}

    def add(name: str) -> torch.Tensor:
        entry = listed.get(name) if listed is not None else None
        if listed is not None and entry is None:  # only a shard can be asked for without being listed
            raise ManifestError(f"manifest of {directory} does not cover shard {name!r}", path=directory)
        buffers[name] = map_file(directory, name, expected_size=entry.size if entry is not None else None)
        if entry is not None and verify:
            check_file_digest(directory, entry, host_view(buffers[name]))
        return buffers[name]

    owner = read_plan(directory, manifest, present, extras, add, buffers)
    for name in sorted(present - buffers.keys()) if listed is not None else ():
        _check_listed_exists(directory, name)
    return MappedFiles(directory=directory, buffers=buffers, manifest=manifest, manifest_sha256=digest, owner=owner)


def read_plan(directory: Path, manifest: Manifest | None, present: set[str], extras: Extras,
              add: Callable[[str], torch.Tensor], buffers: Mapping[str, torch.Tensor]) -> dict[str, str] | None:
    """Read, through ``add(name)``, exactly the files a load with ``extras`` needs; return the index's weight map.

    ``present``: the files the step has; ``buffers``: those read so far (``add`` fills it).
    """
    for name in (META, CONFIG):
        if name in present:
            add(name)
    owner: dict[str, str] | None = None
    if manifest is not None and manifest.layout is not None:  # a sharded step: DCP's files, all of them
        for name in sorted(present - buffers.keys()):
            add(name)
    elif WEIGHTS in present:
        add(WEIGHTS)
    elif WEIGHTS_INDEX in present:
        owner = weight_map(json_object(add(WEIGHTS_INDEX), directory / WEIGHTS_INDEX), directory / WEIGHTS_INDEX)
        for shard in sorted(set(owner.values())):
            add(shard)
    elif DELTA in present and manifest is not None:
        add(DELTA)
    else:
        raise CorruptCheckpointError(f"no model weights in {directory}", path=directory)
    for name in select_extras(directory, present, extras):
        add(name)
    return owner


def _check_listed_exists(directory: Path, name: str) -> None:
    """A file the manifest lists but this load does not read must still be there.

    Otherwise one damaged name in a manifest (``meta.json`` spelt ``oeta.json``)
    passes for a checkpoint without that file, and a catalog-free load drops
    its meta without a word. Only looked up, never opened.
    """
    try:
        os.lstat(directory / name)
    except FileNotFoundError:
        if not directory.is_dir():
            raise  # the whole directory went away: the reader's trouble, not evidence against the checkpoint
        raise CorruptCheckpointError(f"checkpoint file is missing: {directory / name}",
                                     path=directory / name) from None


# --------------------------------------------------------------------------- the parser


def json_object(buf: torch.Tensor, path: Path) -> dict[str, Any]:
    if buf.numel() > MAX_JSON_BYTES:
        raise CorruptCheckpointError(f"{path} is larger than {MAX_JSON_BYTES} bytes", path=path)
    return decode_json_object(host_bytes(buf), path=path)


def read_json(directory: Path, name: str) -> dict[str, Any]:
    """One JSON object file of a checkpoint directory (e.g. ``meta.json``), checked as a load checks it."""
    return json_object(map_file(directory, name), directory / name)


def weight_map(index: dict[str, Any], path: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``model.safetensors.index.json``, every shard name checked."""
    mapping = index.get("weight_map")
    if not isinstance(mapping, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise ManifestError(f"{path} has no valid weight_map", path=path)
    for shard in set(mapping.values()):
        check_file_name(shard, where=path)
    return mapping


def _parse_manifest(buf: torch.Tensor, directory: Path) -> tuple[Manifest, str]:
    raw = host_bytes(buf)
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


def header_of(buf: torch.Tensor, path: Path, *, size: int | None = None) -> SafetensorsHeader:
    """The validated header at the start of ``buf``, for a file of ``size`` bytes (default: all of ``buf``)."""
    have = buf.numel()
    prefix = host_bytes(buf, min(have, 8))
    declared = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
    # only the header is copied out; its parser checks the declared length against the limits
    head = host_bytes(buf, min(have, 8 + min(declared, MAX_HEADER + 1)))
    return read_safetensors_header(_ViewReader(head), have if size is None else size, path)  # type: ignore[arg-type]


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
    declared = int.from_bytes(host_bytes(buf, 8), "little")
    if declared > min(MAX_HEADER, size - 8):
        return [size]
    spans = sorted((int(a), int(b)) for a, b in _OFFSETS.findall(host_bytes(buf, 8 + declared), 8))
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
    import torch
    if isinstance(buf, torch.Tensor):
        return tensors_in(buf, header_of(buf, path))
    try:
        header = header_of(buf[0], path, size=sum(b.numel() for b in buf))
        lengths = [e.end - e.begin for e in header.entries if e.end > e.begin]
        fits = buf[0].numel() == header.data_start and [b.numel() for b in buf[1:]] == lengths
    except SafetensorsFormatError:
        fits = False
    if not fits:  # cut by another reading of the file than the one received; parse the bytes as they are
        return {k: v.clone() for k, v in tensors_of(torch.cat(list(buf)), path).items()}
    pieces = iter(buf[1:])  # detach(): the tensor keeps the piece's storage, not a view's base object
    return {e.name: next(pieces).view(e.dtype).view(e.shape).detach() if e.end > e.begin
            else torch.empty(e.shape, dtype=e.dtype, device=buf[0].device) for e in header.entries}


def assemble_shards(directory: Path, shards: Iterable[tuple[str, Mapping[str, T]]],
                    owner: Mapping[str, str] | None) -> dict[str, T]:
    """One state dict from weight files; with an index (``owner``: tensor -> shard), exactly as it maps."""
    state: dict[str, T] = {}
    for name, tensors in shards:
        for key, tensor in tensors.items():
            if key in state:
                raise SafetensorsFormatError(f"tensor {key!r} appears in two shards of {directory}",
                                             path=directory / name)
            if owner is not None and owner.get(key) != name:
                raise SafetensorsFormatError(f"the shards of {directory} do not hold exactly the tensors that "
                                             f"{WEIGHTS_INDEX} maps: {key!r} is in {name}", path=directory / name)
            state[key] = tensor
    if owner is not None and set(owner) != set(state):
        raise SafetensorsFormatError(f"the shards of {directory} do not hold exactly the tensors that "
                                     f"{WEIGHTS_INDEX} maps", path=directory)
    return state


def unpickle(buf: torch.Tensor, path: Path, *, trust_pickle: bool, map_location: Any) -> Any:
    """A ``.pt`` extra: ``weights_only`` unless the caller trusts its author."""
    import torch
    try:
        return torch.load(io.BytesIO(host_bytes(buf)), map_location=map_location, weights_only=not trust_pickle)
    except pickle.UnpicklingError as exc:
        if trust_pickle:
            raise CorruptCheckpointError(f"cannot unpickle {path}: {exc}".splitlines()[0], path=path) from None
        raise UnsafePickleError(f"{path} needs full unpickling, which can run arbitrary code; "
                                "pass trust_pickle=True only if you trust its author", path=path) from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CorruptCheckpointError(f"cannot load {path}: {first}", path=path) from None


def _on_cpu(map_location: Any) -> bool:
    import torch
    return map_location is None or map_location == "cpu" or (
        isinstance(map_location, torch.device) and map_location.type == "cpu")


def parse_files(directory: Path, files: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], *,
                trust_pickle: bool, map_location: Any, mapped: MappedFiles | None = None) -> Loaded:
    """The checkpoint held in ``files`` (name -> bytes): what :func:`map_directory` mapped, or its bytes received.

    A safetensors file may be given as the pieces of its :func:`layout`;
    every other file is one buffer. ``mapped``, when ``files`` are its
    buffers, spares parsing the manifest and the index a second time.
    Tensors are moved to ``map_location`` unless it is the CPU; extras are
    unpickled onto it.
    """
    import torch

    def whole(name: str) -> torch.Tensor:
        buf = files[name]
        return buf if isinstance(buf, torch.Tensor) else torch.cat(list(buf))

    manifest: Manifest | None = None
    manifest_sha: str | None = None
    if mapped is not None:
        manifest, manifest_sha = mapped.manifest, mapped.manifest_sha256
    elif MANIFEST in files:
        manifest, manifest_sha = _parse_manifest(whole(MANIFEST), directory)
    meta = json_object(whole(META), directory / META) if META in files else {}
    config = json_object(whole(CONFIG), directory / CONFIG) if CONFIG in files else {}
    if manifest is not None and manifest.layout is not None:
        from registry.fs.dcpfiles import full_state
        state, objects = full_state(directory, manifest, {n: whole(n) for n in files}, trust_pickle=trust_pickle)
        if not _on_cpu(map_location):
            state = {k: v.to(map_location) for k, v in state.items()}
        return Loaded(state_dict=state, extra=objects, meta=meta, config=config, manifest=manifest,
                      manifest_sha256=manifest_sha)
    owner: dict[str, str] | None = None
    if WEIGHTS in files:
        weight_files = [WEIGHTS]
    elif WEIGHTS_INDEX in files:
        owner = mapped.owner if mapped is not None else None
        if owner is None:
            owner = weight_map(json_object(whole(WEIGHTS_INDEX), directory / WEIGHTS_INDEX),
                               directory / WEIGHTS_INDEX)
        weight_files = sorted(set(owner.values()))
        missing = [w for w in weight_files if w not in files]
        if missing:
            raise ManifestError(f"shard {missing[0]!r} of {directory} was not loaded", path=directory)
    elif DELTA in files and manifest is not None:
        weight_files = []
    else:
        raise CorruptCheckpointError(f"no model weights in {directory}", path=directory)
    state = assemble_shards(directory, ((name, tensors_of(files[name], directory / name))
                                        for name in weight_files), owner)
    extra = {name[:-3]: unpickle(whole(name), directory / name, trust_pickle=trust_pickle,
                                 map_location=map_location)
             for name in sorted(n for n in files if n.endswith(".pt"))}
    if not _on_cpu(map_location):
        state = {k: v.to(map_location) for k, v in state.items()}
    return Loaded(state_dict=state, extra=extra, meta=meta, config=config,
                  manifest=manifest, manifest_sha256=manifest_sha, delta=whole(DELTA) if not weight_files else None)


def read_directory(directory: Path, *, verify: bool = True, trust_pickle: bool = False,
                   map_location: Any = "cpu", extras: Extras = True, expected_digest: str | None = None) -> Loaded:
    """Load a checkpoint directory written by us, the reference module, or a legacy trainer.

    Reads what :func:`map_directory` plans (with ``verify`` every byte is
    hashed, the very mapping the tensors then view). ``extras``: read every
    ``.pt`` extra (True), none (False), or only those named; the others are
    never opened. ``expected_digest``: the manifest's sha256 as the catalog
    records it, checked before any other file is mapped, hashed or unpickled.

    A sharded (DCP) step loads whole: ``state_dict`` holds every tensor in
    full under DCP's flattened keys, ``extra`` the non-tensor values under
    theirs (see :mod:`registry.fs.dcpfiles`).
    """
    mapped = map_directory(directory, extras=extras, verify=verify, expected_digest=expected_digest)
    return parse_files(directory, mapped.buffers, trust_pickle=trust_pickle, map_location=map_location,
                       mapped=mapped)


__all__ = ["Extras", "Loaded", "MappedFiles", "assemble_shards", "check_extras", "check_manifest_digest",
           "header_of", "json_object", "layout",
           "map_directory", "parse_files", "read_directory", "read_json", "select_extras", "tensors_of", "weight_map"]
