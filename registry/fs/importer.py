"""Adopting a checkpoint directory written elsewhere: scan, check, stage.

Four layouts are recognised: one with a ``manifest.json`` (the reference
module's, or ours), a legacy one without a manifest (``meta.json`` plus
weights), a Hugging Face style one (``config.json`` plus
``model.safetensors`` or ``model.safetensors.index.json`` and shards), and a
``torch.distributed.checkpoint`` one (``.metadata`` plus ``__<rank>_<n>.distcp``
files, as ``dcp.save`` and torchtitan write them), whose ``.metadata`` is read
with the restricted unpickler of :mod:`registry.format.dcp_metadata`.

Everything is checked before anything is touched: only plain files directly
inside the directory (no symlinks, no subdirectories, only safe names), a
manifest that parses and whose every file exists with its size, JSON that
parses, safetensors headers that validate, and an index whose shards hold
exactly the tensors it maps. While staging, each file is hashed as it is
copied (or, with ``move``, hard-linked and then hashed) and compared with the
existing manifest's checksum when there is one. This module knows files, not
the catalog: ``Registry.import_checkpoint`` runs the two-phase publish.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.progress import Counter, ProgressFn
from registry.errors import (CheckpointNotFoundError, CorruptCheckpointError, ManifestError, PublishError,
                             UnsafePathError)
from registry.fs.filemaps import assemble_shards, header_of, json_object, map_directory, read_json
from registry.format.manifest import (CONFIG, MANIFEST, META, WEIGHTS, WEIGHTS_INDEX, FileEntry, Manifest,
                                      check_file_name, digest_bytes, read_manifest)
from registry.format.refs import MAX_STEP
from registry.format.sharding import DCP_METADATA
from registry.fs.store import fsync_dir, now_timestamp
from registry.fs.payloadfiles import Written
from registry.fs.hashing import CHUNK, HashingWriter, sha256_file

if TYPE_CHECKING:
    from registry.format.dcp_metadata import DcpFiles



@dataclass(frozen=True, kw_only=True)
class Foreign:
    """A scanned directory that is safe to adopt."""

    directory: Path
    layout: str                      # "manifest", "legacy", "huggingface" or "dcp"
    sizes: dict[str, int]            # every file to adopt (the old manifest excluded)
    manifest: Manifest | None
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: tuple[str, ...] = ()
    dcp: DcpFiles | None = None      # a DCP directory: its data files by rank


def _listing(directory: Path) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        path = directory / entry.name
        if entry.is_symlink():
            raise UnsafePathError(f"{path} is a symlink; the registry imports only plain files", path=path)
        if not entry.is_file(follow_symlinks=False):
            raise UnsafePathError(f"{path} is not a regular file; the registry imports flat directories "
                                  "of plain files only", path=path)
        check_file_name(entry.name, where=directory)
        sizes[entry.name] = entry.stat(follow_symlinks=False).st_size
    return sizes


def scan(directory: Path) -> Foreign:
    """Check ``directory`` for adoption without changing anything: it must load as a load would read it."""
    if directory.is_symlink():
        raise UnsafePathError(f"{directory} is a symlink; pass the real directory", path=directory)
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint directory at {directory}", path=directory)
    sizes = _listing(directory)
    if DCP_METADATA in sizes:
        return _scan_dcp(directory, sizes)
    # extras are only listed: adopting them does not unpickle them
    files = map_directory(directory, extras=False)
    manifest = files.manifest
    if manifest is not None:
        _check_listed(directory, manifest, sizes)
        del sizes[MANIFEST]
        layout = "manifest"
    elif META in sizes:
        layout = "legacy"
    else:
        layout = "huggingface"
    meta = json_object(files.buffers[META], directory / META) if META in files.buffers else {}
    if CONFIG in files.buffers:
        json_object(files.buffers[CONFIG], directory / CONFIG)
    if files.owner is not None and not files.owner:
        raise ManifestError(f"{directory / WEIGHTS_INDEX} has no valid weight_map", path=directory / WEIGHTS_INDEX)
    weights = [WEIGHTS] if files.owner is None else sorted(set(files.owner.values()))
    tensors = assemble_shards(directory, ((name, {e.name: e for e in header_of(files.buffers[name],
                                                                                 directory / name).entries})
                                          for name in weights), files.owner)
    return Foreign(directory=directory, layout=layout, sizes=sizes, manifest=manifest, meta=meta,
                   tensors=tuple(sorted(tensors)))


def _check_listed(directory: Path, manifest: Manifest, sizes: dict[str, int]) -> None:
    """Every file an existing manifest lists is there with its size, and its integers fit the catalog."""
    for name, entry in manifest.files.items():
        if name not in sizes:
            raise CorruptCheckpointError(f"checkpoint file is missing: {directory / name}", path=directory / name)
        if sizes[name] != entry.size:
            raise CorruptCheckpointError(f"checkpoint file size mismatch: {directory / name} is "
                                         f"{sizes[name]} bytes, manifest says {entry.size}", path=directory / name)
    for key, value in (("optimizer_step", manifest.optimizer_step), ("policy_version", manifest.policy_version)):
        if value is not None and abs(value) > MAX_STEP:
            raise ManifestError(f"manifest {directory / MANIFEST}: {key} {value} does not fit the catalog's "
                                "64-bit integers", path=directory / MANIFEST)


def _scan_dcp(directory: Path, sizes: dict[str, int]) -> Foreign:
    """A DCP directory: ``.metadata`` read without running anything, and every file it references there.

    A manifest of ours, when present, is checked as for any import; the
    tensors recorded are the flattened names of the tensor entries.
    """
    from registry.format.dcp_metadata import check_data_files, load_dcp_metadata, tensor_names
    manifest = read_manifest(directory)[0] if MANIFEST in sizes else None
    if manifest is not None:
        _check_listed(directory, manifest, sizes)
        del sizes[MANIFEST]
    metadata = load_dcp_metadata(directory / DCP_METADATA)
    dcp = check_data_files(directory, metadata, sizes)
    meta = read_json(directory, META) if META in sizes else {}
    if CONFIG in sizes:
        read_json(directory, CONFIG)
    return Foreign(directory=directory, layout="dcp", sizes=sizes, manifest=manifest, meta=meta,
                   tensors=tensor_names(metadata), dcp=dcp)


def _copy(src: Path, dst: Path) -> FileEntry:
    fd = os.open(src, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb", buffering=0) as f, HashingWriter(dst) as out:
        # a fresh piece each time: the previous one may still be hashing on a worker thread
        while piece := f.read(CHUNK):
            out.write(piece)
    assert out.sha256 is not None
    return FileEntry(name=dst.name, size=out.size, sha256=out.sha256, piece_size=out.piece_size,
                     xxh3_128_pieces=out.xxh3_128_pieces)


def _link(src: Path, dst: Path) -> FileEntry:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise PublishError(f"cannot move {src} into the registry: it is on another filesystem; "
                               "import without --move to copy it", errno=exc.errno, path=src) from None
        raise
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    size, digest = sha256_file(dst)
    return FileEntry(name=dst.name, size=size, sha256=digest)


def stage(foreign: Foreign, staging: Path, *, move: bool, progress: ProgressFn | None = None) -> Written:
    """Put every file into ``staging`` (copied, or hard-linked with ``move``), hashed; manifest last.

    Hard links rather than renames make ``move`` crash-safe: the originals stay
    where they were until the catalog has committed the import, and only then
    does the caller unlink them.
    """
    entries: dict[str, FileEntry] = {}
    counter = Counter(progress, task="import", total=sum(foreign.sizes.values()))
    for name, size in foreign.sizes.items():
        src = foreign.directory / name
        entry = (_link if move else _copy)(src, staging / name)
        if entry.size != size or not stat.S_ISREG(os.lstat(staging / name).st_mode):
            raise CorruptCheckpointError(f"{src} changed while it was being imported", path=src)
        listed = foreign.manifest.files.get(name) if foreign.manifest is not None else None
        if listed is not None and listed.sha256 != entry.sha256:
            raise CorruptCheckpointError(f"checkpoint file checksum mismatch: {src}", path=src)
        entries[name] = entry
        counter.advance(entry.size, item=name)
    meta, old = foreign.meta, foreign.manifest
    manifest = Manifest(
        files=entries, tensors=foreign.tensors,
        created_at=(old.created_at if old is not None and old.created_at else None)
        or (meta.get("timestamp") if isinstance(meta.get("timestamp"), str) else None) or now_timestamp(),
        optimizer_step=int_field(meta, "optimizer_step") if old is None else old.optimizer_step,
        policy_version=int_field(meta, "policy_version") if old is None else old.policy_version,
        extra_fields={"imported": {"from": str(foreign.directory), "layout": foreign.layout,
                                   "at": now_timestamp()}},
        layout=foreign.dcp.layout() if foreign.dcp is not None else None,  # format version 2: a sharded step
    )
    raw = manifest.encode()
    with HashingWriter(staging / MANIFEST) as out:
        out.write(raw)
    fsync_dir(staging)
    return Written(manifest=manifest, manifest_sha256=digest_bytes(raw), total_bytes=manifest.total_bytes + len(raw))


def provenance(foreign: Foreign, digests: Mapping[str, str]) -> dict[str, Any]:
    """Where an import came from, for its lineage: the directory, the layout detected, and the digest
    of what was read (sha256 over ``"NAME SHA256\n"`` of every adopted file, sorted by name)."""
    listing = "".join(f"{name} {digests[name]}\n" for name in sorted(digests) if name != MANIFEST)
    return {"path": str(foreign.directory), "layout": foreign.layout,
            "files_sha256": digest_bytes(listing.encode())}


def int_field(meta: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = meta.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEP else default


def remove_originals(foreign: Foreign) -> None:
    """After a committed ``move``: drop the original links, the old manifest, and the empty directory."""
    for name in [*foreign.sizes, *([MANIFEST] if foreign.manifest is not None else [])]:
        try:
            os.unlink(foreign.directory / name)
        except FileNotFoundError:
            pass
    try:
        foreign.directory.rmdir()
    except OSError:
        pass  # something new appeared in it; leave it to the user


__all__ = ["Foreign", "int_field", "provenance", "remove_originals", "scan", "stage"]
