"""Reading a step from an attempt prefix in a bucket: parallel ranged gets into memory, pieces checked as they land.

The same plan as a directory load (:func:`registry.fs.filemaps.read_plan`:
meta, config, the weights, the extras asked for) and the same parser
(:func:`registry.fs.filemaps.parse_files`) over the downloaded buffers. The
manifest comes first and must be the catalog's; each file's size is asked
before its bytes; with ``verify`` every ``PIECE_SIZE`` range is checked
against its xxh3-128 piece digest on the thread that fetched it, so checking
overlaps downloading. Bytes that do not match raise
``CorruptCheckpointError``; the server's trouble raises ``StorageError``;
a step whose manifest is gone raises ``CheckpointReadError`` (its objects are
missing although the catalog lists it: fsck's to judge, nothing is marked).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from registry.errors import (CheckpointReadError, CorruptCheckpointError, ManifestError, ObjectNotFoundError,
                             RegistryError)
from registry.format.manifest import MANIFEST, FileEntry, Manifest, digest_bytes, parse_manifest
from registry.format.pieces import PIECE_SIZE
from registry.fs.filemaps import Extras, Loaded, MappedFiles, check_manifest_digest, parse_files, read_plan
from registry.fs.mapping import check_file_digest, host_view
from registry.fs.objects import ObjectRoot
from registry.pools import Pool

if TYPE_CHECKING:
    import torch

READ_CONCURRENCY = 16  # ranged GETs in flight at once
_POOL = Pool(READ_CONCURRENCY, "registry-s3-read")


def read_objects(root: ObjectRoot, rel: str, *, verify: bool = True, trust_pickle: bool = False,
                 map_location: Any = "cpu", extras: Extras = True, expected_digest: str | None = None) -> Loaded:
    """Load the step stored under ``rel`` (its catalog path); errors name its s3:// URL."""
    try:
        mapped = _fetch_step(root, rel, verify=verify, extras=extras, expected_digest=expected_digest)
        return parse_files(mapped.directory, mapped.buffers, trust_pickle=trust_pickle, map_location=map_location,
                           mapped=mapped)
    except RegistryError as exc:
        raise _with_url(exc, rel, root.url(rel)) from exc.__cause__


def fetch_step(root: ObjectRoot, rel: str, *, verify: bool = True, extras: Extras = True,
               expected_digest: str | None = None) -> MappedFiles:
    """The files a load of the step under ``rel`` reads, downloaded into CPU buffers and not yet parsed.

    What a directory's :func:`registry.fs.filemaps.map_directory` is to a
    mapped load: a broadcast load fetches once on rank 0 and sends these
    buffers to the other ranks.
    """
    try:
        return _fetch_step(root, rel, verify=verify, extras=extras, expected_digest=expected_digest)
    except RegistryError as exc:
        raise _with_url(exc, rel, root.url(rel)) from exc.__cause__


def _with_url(exc: RegistryError, rel: str, url: str) -> RegistryError:
    """``exc`` with the step's relative path in its message replaced by its URL (same class, same fields)."""
    text = str(exc)
    if rel not in text or url in text:
        return exc
    named = type(exc).__new__(type(exc))
    named.__dict__.update(exc.__dict__)
    named.args = (text.replace(rel, url),)
    return named


def _fetch_step(root: ObjectRoot, rel: str, *, verify: bool, extras: Extras,
                expected_digest: str | None) -> MappedFiles:
    import torch
    directory = Path(rel)
    raw, manifest = _manifest(root, rel, expected_digest)
    digest = digest_bytes(raw)
    if manifest.layout is not None:
        raise CorruptCheckpointError(f"{rel} is a sharded step; an s3:// root holds none")
    buffers: dict[str, torch.Tensor] = {MANIFEST: torch.frombuffer(bytearray(raw), dtype=torch.uint8)}

    def add(name: str) -> torch.Tensor:
        entry = manifest.files.get(name)
        if entry is None:
            raise ManifestError(f"manifest of {directory} does not cover {name!r}", path=directory)
        buffers[name] = fetch(root, f"{rel}/{name}", entry, verify=verify, directory=directory)
        return buffers[name]

    present = set(manifest.files)
    owner = read_plan(directory, manifest, present, extras, add, buffers)
    unread = sorted(present - buffers.keys())
    for name, head in zip(unread, _POOL.map(lambda n: root.head(f"{rel}/{n}"), unread)):
        if head is None:  # listed but gone: one damaged name must not pass for a file the step lacks
            raise CorruptCheckpointError(f"checkpoint file is missing: {directory / name}")
    return MappedFiles(directory=directory, buffers=buffers, manifest=manifest, manifest_sha256=digest, owner=owner)


def _manifest(root: ObjectRoot, rel: str, expected_digest: str | None) -> tuple[bytes, Manifest]:
    """The step's manifest, checked against the catalog's digest before any other object is fetched."""
    directory = Path(rel)
    try:
        raw = bytes(root.get(f"{rel}/{MANIFEST}"))
    except ObjectNotFoundError:
        raise CheckpointReadError(f"cannot read {rel}: its manifest is missing from the bucket although the catalog "
                                  "lists the step; nothing was marked: run 'registry fsck' to check the root",
                                  errno=errno.ENOENT) from None
    manifest = parse_manifest(raw, path=directory / MANIFEST)
    check_manifest_digest(directory, digest_bytes(raw), expected_digest)
    return raw, manifest


def fetch(root: ObjectRoot, key: str, entry: FileEntry, *, verify: bool, directory: Path) -> torch.Tensor:
    """One object's bytes in a fresh CPU buffer, by concurrent ranged GETs of its pieces, checked as they land."""
    import torch
    buf = torch.empty(entry.size, dtype=torch.uint8)
    view = host_view(buf)

    def land(start: int, data: Any) -> None:
        view[start:start + len(data)] = data
    checked = _get_pieces(root, key, entry, verify=verify, directory=directory, land=land)
    if verify and not checked:
        check_file_digest(directory, entry, view)
    return buf


def _get_pieces(root: ObjectRoot, key: str, entry: FileEntry, *, verify: bool, directory: Path,
                land: Callable[[int, Any], None]) -> bool:
    """Hand each piece of one object to ``land(offset, bytes)``, fetched by concurrent ranged GETs and, when
    ``verify``, checked against the manifest's pieces first; whether they were (False: it records none).
    Returns or raises only once no piece is in flight."""
    path = directory / entry.name
    head = root.head(key)
    if head is None:
        raise CorruptCheckpointError(f"checkpoint file is missing: {path}", path=path)
    if head.size != entry.size:
        raise CorruptCheckpointError(f"checkpoint file size mismatch: {path} is {head.size} bytes, "
                                     f"manifest says {entry.size}", path=path)
    pieces = entry.xxh3_128_pieces if entry.piece_size is not None else None
    if entry.size == 0:
        return pieces is not None
    step = entry.piece_size if pieces is not None and entry.piece_size else PIECE_SIZE
    starts = range(0, entry.size, step)
    if pieces is not None and len(pieces) != len(starts):
        raise CorruptCheckpointError(f"checkpoint file checksum mismatch: {path} (piece count)", path=path)

    def one(index: int) -> None:
        start = starts[index]
        end = min(entry.size, start + step)
        data = root.get_ranges(key, [start], [end])[0]
        if len(data) != end - start:
            raise CorruptCheckpointError(f"checkpoint file size mismatch: {path} (bytes {start}-{end - 1} short)",
                                         path=path)
        if verify and pieces is not None and xxhash.xxh3_128_hexdigest(data) != pieces[index]:
            raise CorruptCheckpointError(f"checkpoint file checksum mismatch: {path} (bytes {start}-{end - 1})",
                                         path=path)
        land(start, data)

    if len(starts) == 1:
        one(0)
        return pieces is not None
    _POOL.run_all(one, ((index,) for index in range(len(starts))))  # no piece lands after this returns
    return pieces is not None


def download(root: ObjectRoot, rel: str, dest: Path, *, expected_digest: str | None) -> None:
    """Write the manifest and every file of the step under ``rel`` into the empty directory ``dest``.

    The manifest must be the catalog's (``expected_digest``); each file is
    checked against its pieces as it lands, and fsync'd.
    """
    try:
        return _download(root, rel, dest, expected_digest=expected_digest)
    except RegistryError as exc:
        raise _with_url(exc, rel, root.url(rel)) from exc.__cause__


def _download(root: ObjectRoot, rel: str, dest: Path, *, expected_digest: str | None) -> None:
    directory = Path(rel)
    raw, manifest = _manifest(root, rel, expected_digest)
    _write(dest / MANIFEST, memoryview(raw))
    for name in sorted(manifest.files):
        entry = manifest.files[name]
        if entry.xxh3_128_pieces is None:  # only a whole-file digest: checked in memory before it is written
            _write(dest / name, host_view(fetch(root, f"{rel}/{name}", entry, verify=True, directory=directory)))
        else:
            _download_file(root, f"{rel}/{name}", entry, dest / name, directory=directory)


def _download_file(root: ObjectRoot, key: str, entry: FileEntry, path: Path, *, directory: Path) -> None:
    """Each checked piece written at its offset as it lands, then fsync'd: no buffer of the whole file, whose
    fresh pages would cost as much again as the file's own (and as much memory)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        def land(start: int, data: Any) -> None:
            view = memoryview(data).cast("B")
            while view:
                written = os.pwrite(fd, view, start)
                view, start = view[written:], start + written
        _get_pieces(root, key, entry, verify=True, directory=directory, land=land)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        view = data.cast("B")
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
