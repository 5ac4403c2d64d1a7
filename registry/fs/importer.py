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
copied (or, with ``move``, hard-linked and then hashed, read once) and
compared with the existing manifest's checksum when there is one. A
trainer's save is adopted the same way (:func:`scan` of the files it names,
:func:`stage` with :class:`Own` files beside them: the publish's
``meta.json`` and extras). This module knows files, not the catalog:
``Registry.import_checkpoint`` and ``Registry.publish_files`` run the
two-phase publish.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import stat
import zipfile
from collections.abc import Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.pools import Pool
from registry.progress import Counter, ProgressFn
from registry.errors import (CheckpointNotFoundError, CorruptCheckpointError, InvalidStateError, ManifestError,
                             PublishError, UnsafePathError, UnsafePickleError)
from registry.fs.filemaps import assemble_shards, header_of, json_object, map_directory, read_json
from registry.format.manifest import (CONFIG, MANIFEST, META, WEIGHTS, WEIGHTS_INDEX, FileEntry, Manifest,
                                      check_file_name, digest_bytes, read_manifest)
from registry.format.refs import MAX_STEP
from registry.format.sharding import DCP_METADATA
from registry.fs.store import fsync_dir, now_timestamp
from registry.fs.payloadfiles import Written
from registry.fs.hashing import CHUNK, HashingWriter, start_writeback
from registry.format.pieces import PieceHasher

if TYPE_CHECKING:
    from registry.format.dcp_metadata import DcpFiles

# one file hashed per thread (sha256 is sequential within a file): a save's files at once, on every core
_ADOPT_POOL = Pool(max(2, min(8, os.cpu_count() or 2)), "registry-adopt")

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


def _listing(directory: Path, files: Collection[str] | None) -> dict[str, int]:
    sizes: dict[str, int] = {}
    if files is None:
        names = sorted(entry.name for entry in os.scandir(directory))
    else:
        if isinstance(files, (str, bytes)) or not all(isinstance(n, str) for n in files):
            raise InvalidStateError(f"files must be a list of file names, got {files!r}")
        names = sorted(set(files))
        for name in names:
            check_file_name(name, where=directory)
    for name in names:
        path = directory / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint file is missing: {path}", path=path) from None
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(f"{path} is a symlink; the registry imports only plain files", path=path)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path} is not a regular file; the registry imports flat directories "
                                  "of plain files only", path=path)
        check_file_name(name, where=directory)
        sizes[name] = st.st_size
    return sizes


def scan(directory: Path, only: Collection[str] | None = None) -> Foreign:
    """Check ``directory`` for adoption without changing anything: it must load as a load would read it.

    ``only``: adopt only these files (a trainer's save among other files of its
    own); the weights a load reads must be among them.
    """
    if directory.is_symlink():
        raise UnsafePathError(f"{directory} is a symlink; pass the real directory", path=directory)
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint directory at {directory}", path=directory)
    sizes = _listing(directory, only)
    if DCP_METADATA in sizes:
        return _scan_dcp(directory, sizes)
    # extras are only listed: adopting them does not unpickle them
    files = map_directory(directory, extras=False)
    left_out = sorted(set(files.buffers) - set(sizes) - {META})
    if left_out:
        raise CorruptCheckpointError(f"{directory / left_out[0]} is read by a load but is not among the files to "
                                     "adopt", path=directory / left_out[0])
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


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise PublishError(f"cannot move {src} into the registry: it is on another filesystem; "
                               "import without --move to copy it", errno=exc.errno, path=src) from None
        raise


@dataclass(frozen=True)
class _Hashed:
    entry: FileEntry
    inode: tuple[int, int]  # (st_dev, st_ino) of the file hashed


def _hash_file(path: Path) -> _Hashed:
    """sha256 and the xxh3 piece digests of a file in one read, then fsync'd.

    Writeback starts first, so the disk writes what is still dirty (a
    trainer's fresh save) while the file is hashed from the page cache.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{path} is not a regular file", path=path)
        start_writeback(fd, 0, st.st_size)
        sha, pieces = hashlib.sha256(), PieceHasher()
        view = memoryview(bytearray(min(CHUNK, max(st.st_size, 1))))
        size = 0
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            while n := f.readinto(view):
                sha.update(view[:n])
                pieces.update(view[:n])
                size += n
        os.fsync(fd)
    finally:
        os.close(fd)
    entry = FileEntry(name=path.name, size=size, sha256=sha.hexdigest(), piece_size=pieces.piece_size,
                      xxh3_128_pieces=pieces.digests())
    return _Hashed(entry=entry, inode=(st.st_dev, st.st_ino))


class Hashing:
    """Every file of ``foreign`` being hashed (and fsync'd) on a pool, all at once: started before a
    publish claims its step, so the claim and the checks overlap the reads. Read only: the files are
    linked afterwards, each link checked to name the very file hashed."""

    def __init__(self, foreign: Foreign, directory: Path | None = None) -> None:
        where = directory if directory is not None else foreign.directory
        largest_first = sorted(foreign.sizes, key=lambda name: -foreign.sizes[name])  # the shortest makespan
        self._futures = {name: _ADOPT_POOL.submit(_hash_file, where / name) for name in largest_first}

    def entry(self, name: str, link: Path) -> FileEntry:
        hashed = self._futures[name].result()
        st = os.lstat(link)
        if (st.st_dev, st.st_ino) != hashed.inode:
            raise CorruptCheckpointError(f"{link.name} was replaced while it was being imported", path=link)
        return hashed.entry

    def wait(self) -> None:
        """Until no file is read any more (a failed publish discards what was linked)."""
        for future in self._futures.values():
            future.exception()


@dataclass(frozen=True, kw_only=True)
class Own:
    """What a publish of a trainer's save writes itself beside the files it adopts.

    ``meta``: the publish's ``meta.json`` (``meta_json`` its bytes), whose
    numbers go into the manifest as a publish's do; ``extra``: objects saved
    as ``NAME.pt``, checked as a publish checks them.
    """

    meta: Mapping[str, Any]
    meta_json: bytes
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def checked(cls, *, meta: object, extra: object, epoch: object, optimizer_step: object, trust_pickle: bool,
                timestamp: str) -> Own:
        """What :meth:`registry.Registry.publish` would write of ``meta`` and ``extra``, checked as it checks them."""
        from registry.fs.payloadfiles import json_bytes
        from registry.fs.validation import check_extras, publish_meta
        full = publish_meta(meta, epoch=epoch, consumed_samples=0, optimizer_step=optimizer_step,
                            policy_version=None, timestamp=timestamp)
        return cls(meta=full, meta_json=json_bytes(full, "meta"), extra=check_extras(extra, trust_pickle=trust_pickle))

    def names(self) -> list[str]:
        return [META, *(f"{key}.pt" for key in self.extra)]

    def check_beside(self, foreign: Foreign) -> None:
        """The adopted files leave room for these: none has a name this writes."""
        clash = sorted(set(self.names()) & (set(foreign.sizes) | {MANIFEST}))
        if clash:
            raise InvalidStateError(f"{foreign.directory / clash[0]} would be written by the publish itself: leave "
                                    "it out of the files (pass it as meta or extra)")


def _write_own(own: Own, staging: Path, syncing: list[Future[None]]) -> dict[str, FileEntry]:
    """``own``'s files into ``staging``; their fsyncs go to ``syncing``, sharing one journal commit."""
    import torch
    from registry.fs.payloadfiles import entry_of
    entries: dict[str, FileEntry] = {}

    def put(name: str, fill: Any) -> None:
        out = HashingWriter(staging / name)
        try:
            fill(out)
        except BaseException:
            out.abort()
            raise
        syncing.append(out.close_later(_ADOPT_POOL.submit))
        entries[name] = entry_of(name, out)
    put(META, lambda out: out.write(own.meta_json))
    for key, value in own.extra.items():
        put(f"{key}.pt", lambda out, value=value: torch.save(value, out))
    return entries


def stage(foreign: Foreign, staging: Path, *, move: bool, progress: ProgressFn | None = None,
          own: Own | None = None, copy_across: bool = False, hashing: Hashing | None = None) -> Written:
    """Put every file into ``staging`` (copied, or hard-linked with ``move``), hashed; manifest last.

    Hard links rather than renames make ``move`` crash-safe: the originals stay
    where they were until the catalog has committed the import, and only then
    does the caller unlink them. Linked files are hashed in one read each, all
    at once on a pool (``hashing``, when the caller started it already), and
    fsync'd. ``own``: the files a publish of a trainer's save writes itself,
    whose numbers the manifest records instead of an import's provenance.
    ``copy_across``: a ``move`` whose source is on another filesystem copies
    instead of failing.
    """
    entries: dict[str, FileEntry] = {}
    counter = Counter(progress, task="import", total=sum(foreign.sizes.values()))
    names = list(foreign.sizes)
    if move and names:
        try:
            _link(foreign.directory / names[0], staging / names[0])
        except PublishError as exc:
            if not (copy_across and exc.errno == errno.EXDEV):
                raise
            move = False
    syncing: list[Future[None]] = []
    try:
        if move:
            for name in names[1:]:
                _link(foreign.directory / name, staging / name)
            if hashing is None:
                hashing = Hashing(foreign, staging)
        written = _write_own(own, staging, syncing) if own is not None else {}
        for name, size in foreign.sizes.items():
            src = foreign.directory / name
            entry = hashing.entry(name, staging / name) if move and hashing is not None else _copy(src, staging / name)
            if entry.size != size or not stat.S_ISREG(os.lstat(staging / name).st_mode):
                raise CorruptCheckpointError(f"{src} changed while it was being imported", path=src)
            listed = foreign.manifest.files.get(name) if foreign.manifest is not None else None
            if listed is not None and listed.sha256 != entry.sha256:
                raise CorruptCheckpointError(f"checkpoint file checksum mismatch: {src}", path=src)
            entries[name] = entry
            counter.advance(entry.size, item=name)
    finally:
        if hashing is not None:
            hashing.wait()
        errors = [err for f in syncing if (err := f.exception()) is not None]  # waits for every fsync
    if errors:
        raise errors[0]
    meta, old = foreign.meta, foreign.manifest
    if own is not None:
        entries.update(written)
        manifest = Manifest(
            files=entries, tensors=foreign.tensors, created_at=own.meta.get("timestamp"),
            optimizer_step=own.meta.get("optimizer_step"), policy_version=own.meta.get("policy_version"),
            layout=foreign.dcp.layout() if foreign.dcp is not None else None)
    else:
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


def check_pickles(foreign: Foreign, *, trust_pickle: bool) -> None:
    """Every ``NAME.pt`` to adopt loads with ``weights_only`` (unless ``trust_pickle``), as a publish's extras must.

    Read mapped: only the pickle runs, the tensors' bytes are not read.
    """
    if trust_pickle:
        return
    import torch
    for name in foreign.sizes:
        if not name.endswith(".pt"):
            continue
        path = foreign.directory / name
        try:
            try:
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                torch.load(path, map_location="cpu", weights_only=True)  # the legacy format cannot be mapped
        except pickle.UnpicklingError:
            raise UnsafePickleError(f"{path} needs full unpickling, which can run arbitrary code; "
                                    "pass trust_pickle=True only if you trust its author", path=path) from None
        except (RuntimeError, zipfile.BadZipFile, EOFError, ValueError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CorruptCheckpointError(f"cannot load {path}: {first}", path=path) from None


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


__all__ = ["Foreign", "Hashing", "Own", "check_pickles", "int_field", "provenance", "remove_originals", "scan", "stage"]
