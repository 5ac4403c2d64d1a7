"""DCP's files under an attempt prefix in a bucket: every rank uploads its own, hashed; a load fetches only its ranges.

Writing: :func:`object_dcp_writer` is ``torch.distributed.checkpoint``'s
``FileSystemWriter`` whose streams are :class:`~registry.fs.objectwrite.HashingUpload`\\ s:
each ``.distcp`` file goes up as a multipart upload while DCP writes it (parts
in flight concurrently, sha256 and the xxh3 pieces computed on the way, nothing
read back), under the attempt prefix the publish claimed, so every rank uploads
in parallel and no other attempt can share a key. Rank 0's ``.metadata``
(written by DCP once every rank's data is up) is one create-only PUT under its
final name: there is no rename on an object store, and nothing is visible until
the catalog commit anyway. The manifest goes last, through
:func:`registry.fs.dcpfiles.sharded_tail`, the same tail a directory gets.

Reading: :class:`ObjectDcpReader` is the restricted reader
(:class:`~registry.format.dcp_metadata.RestrictedFileSystemReader`) whose
``read_data`` first fetches the byte ranges this rank's load plan names
(DCP's ``ReadItem``\\ s: file, offset, length) by concurrent ranged GETs: with
``verify``, whole manifest pieces, each checked by
:func:`registry.fs.dcpfiles.check_piece` on the thread that fetched it before
DCP sees a byte of it; without, the exact ranges. Every rank reads only what
its own shards need; at another world size DCP's plan reshards as on a
directory. :func:`part_dcp_reader` is the same reader for a host's part of a
step: the files the host holds are mapped, ranges other hosts sent are
taken as they came (their digests checked), and only the rest is fetched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, cast

from registry.crashpoints import armed, crashpoint
from registry.errors import CheckpointReadError, CorruptCheckpointError, ManifestError, ObjectNotFoundError
from registry.format.manifest import MANIFEST, FileEntry, Manifest
from registry.format.pieces import PIECE_SIZE
from registry.fs.dcpfiles import check_piece, sharded_tail
from registry.fs.objectread import READ_CONCURRENCY
from registry.fs.objects import PART_SIZE, ObjectRoot, ObjectWriter
from registry.fs.objectwrite import HashingUpload, _CreateOnly, _put
from registry.pools import Pool

if TYPE_CHECKING:
    import io

    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    from registry.format.sharding import ShardedLayout
    from registry.fs.payloadfiles import Written

_POOL = Pool(READ_CONCURRENCY, "registry-s3-dcp")  # as many ranged GETs in flight per rank as a plain load
_TMP = ".tmp"


class _Counting:
    """An object upload that passes the crash point ``sharded-upload-midway`` once a part has gone up (a
    multipart upload started and not completed: what a rank killed mid-upload leaves for fsck)."""

    def __init__(self, sink: ObjectWriter) -> None:
        self._sink = sink
        self.rel = sink.rel
        self._sent = 0

    def write(self, data: Any) -> int:
        n = self._sink.write(data)
        self._sent += n
        if self._sent > PART_SIZE and armed("sharded-upload-midway"):
            self._sink.flush()  # a part on the server: the incomplete upload is real when the process dies
            crashpoint("sharded-upload-midway")
        return n

    def close(self) -> None:
        self._sink.close()

    def abort(self) -> None:
        self._sink.abort()


class _Upload(HashingUpload):
    """A hashed upload that DCP may close, and the stream's context then closes again (a no-op)."""

    _closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            super().close()


def _object_writer() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemWriter

    class _Uploads(FileSystemBase):
        """DCP's filesystem over one attempt prefix: streams are hashed uploads, there is nothing to rename."""

        def __init__(self, root: ObjectRoot, prefix: str) -> None:
            import threading
            self.root, self.prefix = root, prefix
            self.written: dict[str, FileEntry] = {}
            self._lock = threading.Lock()

        @contextmanager
        def create_stream(self, path: str | Any, mode: str) -> Iterator[io.IOBase]:
            if mode != "wb":
                raise ValueError(f"an upload is written, never read: {path} ({mode})")
            name = PurePosixPath(path).name
            final = name[:-len(_TMP)] if name.endswith(_TMP) else name  # DCP's .metadata.tmp, renamed below
            rel = f"{self.prefix}/{final}"
            sink = _CreateOnly(self.root, rel) if final != name else _Counting(self.root.writer(rel))
            out = _Upload(sink)  # type: ignore[arg-type]
            try:
                yield cast("io.IOBase", out)
                out.close()  # DCP closes it itself; a second close is a no-op
            except BaseException:
                out.abort()
                raise
            assert out.sha256 is not None
            with self._lock:
                self.written[name] = FileEntry(name=name, size=out.size, sha256=out.sha256,
                                               piece_size=out.piece_size, xxh3_128_pieces=out.xxh3_128_pieces)

        def concat_path(self, path: str | Any, suffix: str) -> str:
            return f"{path}/{suffix}"

        def rename(self, path: str | Any, new_path: str | Any) -> None:
            old, new = PurePosixPath(path).name, PurePosixPath(new_path).name
            if old != new + _TMP:
                raise ValueError(f"an object store renames nothing: {path} -> {new_path}")
            with self._lock:  # stored under its final name already
                entry = self.written.pop(old, None)
                if entry is not None:
                    self.written[new] = replace(entry, name=new)

        def init_path(self, path: str | Any) -> str:
            return str(path)

        def mkdir(self, path: str | Any) -> None:
            pass  # a prefix needs no making

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: str | Any) -> bool:
            return True

        def exists(self, path: str | Any) -> bool:
            return False  # a fresh attempt prefix: nothing of this publish is there before DCP writes it

        def rm_file(self, path: str | Any) -> None:
            raise ValueError(f"an upload never deletes: {path}")

    class _Writer(FileSystemWriter):
        def __init__(self, root: ObjectRoot, prefix: str, threads: int) -> None:
            # sync_files=False: an upload is durable once completed (DCP would fall back to a global sync())
            super().__init__(prefix, single_file_per_rank=True, sync_files=False, overwrite=True,
                             thread_count=threads)
            self.fs = _Uploads(root, prefix)  # type: ignore[assignment]
            self.path = prefix

        @property
        def written(self) -> dict[str, FileEntry]:
            return dict(cast(_Uploads, self.fs).written)

    return _Writer


def object_dcp_writer(root: ObjectRoot, prefix: str, *, threads: int = 1) -> Any:
    """A DCP ``StorageWriter`` uploading under ``prefix``; its ``.written`` gives name -> ``FileEntry``.

    ``threads`` files per rank, uploaded (and hashed) at once, as on a directory (``write_threads``).
    """
    return _object_writer()(root, prefix, threads)


def upload_sharded_tail(root: ObjectRoot, prefix: str, *, entries: Mapping[str, FileEntry], layout: ShardedLayout,
                        tensors: Any, meta: Mapping[str, Any], meta_raw: bytes, config_raw: bytes) -> Written:
    """``meta.json``, ``config.json`` and the manifest (last) as create-only PUTs beside the DCP files."""
    return sharded_tail(lambda name, raw: _put(root, prefix, name, lambda out: out.write(raw)), entries=entries,
                        layout=layout, tensors=tensors, meta=meta, meta_raw=meta_raw, config_raw=config_raw)


def read_object(root: ObjectRoot, prefix: str, name: str) -> torch.Tensor:
    """A small file of the step under ``prefix`` (manifest, ``.metadata``, ``meta.json``) as a uint8 buffer.

    A missing manifest is this reader's trouble (``CheckpointReadError``: the catalog lists the step, fsck
    judges); any other missing file is the step's (``CorruptCheckpointError``, judged after a second read).
    """
    import torch
    try:
        raw = root.get(f"{prefix}/{name}")
    except ObjectNotFoundError:
        if name == MANIFEST:
            raise CheckpointReadError(f"cannot read {root.url(prefix)}: its manifest is missing from the bucket "
                                      "although the catalog lists the step; nothing was marked: run 'registry "
                                      "fsck' to check the root") from None
        raise CorruptCheckpointError(f"checkpoint file is missing: {root.url(f'{prefix}/{name}')}") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)


def piece_ranges(entry: FileEntry, wanted: list[tuple[int, int]], *, verify: bool) -> list[tuple[int, int, int | None]]:
    """``(start, end, piece)`` GETs covering ``wanted`` (offset, length) ranges of one file: whole pieces when
    ``verify`` and the file has pieces, else the whole file (a whole-file digest), else the ranges merged and cut
    into ``PIECE_SIZE`` GETs (one range is many GETs in flight, not one stream)."""
    if verify and entry.xxh3_128_pieces is not None and entry.piece_size:
        size = entry.piece_size
        pieces = sorted({p for off, n in wanted for p in range(off // size, (off + max(n, 1) - 1) // size + 1)})
        return [(p * size, min(entry.size, (p + 1) * size), p) for p in pieces if p * size < entry.size]
    if verify:
        return [(0, entry.size, 0)] if entry.size else []
    merged: list[tuple[int, int, int | None]] = []
    for off, n in sorted(wanted):
        if merged and off <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], off + n), None)
        elif n:
            merged.append((off, off + n, None))
    return [(s, min(e, s + PIECE_SIZE), None) for start, e, _ in merged for s in range(start, e, PIECE_SIZE)]


def fetch_ranges(root: ObjectRoot, prefix: str, manifest: Manifest, wanted: Mapping[str, list[tuple[int, int]]],
                 *, verify: bool) -> dict[str, memoryview]:
    """The ``wanted`` ranges of each file, fetched by concurrent ranged GETs into a buffer of the file's size
    (only the pages fetched are touched), each piece checked when ``verify``; name -> buffer. Raises only once
    no GET is in flight."""
    import torch

    from registry.fs.mapping import host_view
    buffers: dict[str, memoryview] = {}
    jobs: list[tuple[str, FileEntry, int, int, int | None]] = []
    for name, ranges in sorted(wanted.items()):
        entry = manifest.files.get(name)
        if entry is None:
            raise ManifestError(f"manifest of {root.url(prefix)} does not cover {name!r}")
        buffers[name] = host_view(torch.empty(entry.size, dtype=torch.uint8))
        jobs.extend((name, entry, start, end, piece)
                    for start, end, piece in piece_ranges(entry, ranges, verify=verify))
    heads = dict(zip(wanted, _POOL.map(lambda n: root.head(f"{prefix}/{n}"), list(wanted))))
    for name, head in heads.items():
        path = Path(root.url(f"{prefix}/{name}"))
        if head is None:
            raise CorruptCheckpointError(f"checkpoint file is missing: {path}", path=path)
        if head.size != manifest.files[name].size:
            raise CorruptCheckpointError(f"checkpoint file size mismatch: {path} is {head.size} bytes, manifest "
                                         f"says {manifest.files[name].size}", path=path)

    def one(name: str, entry: FileEntry, start: int, end: int, piece: int | None) -> None:
        path = Path(root.url(f"{prefix}/{name}"))
        data = root.get_ranges(f"{prefix}/{name}", [start], [end])[0]
        if len(data) != end - start:
            raise CorruptCheckpointError(f"checkpoint file size mismatch: {path} (bytes {start}-{end - 1} short)",
                                         path=path)
        if piece is not None:
            check_piece(path, entry, piece, data)
        buffers[name][start:end] = data

    _POOL.run_all(one, jobs)
    return buffers


# what a rank got of the files another host holds: name -> (offset, length) -> the bytes as read there and their
# xxh3-128, or None where that host could not read them (registry.distributed.parts)
Received = Mapping[str, Mapping[tuple[int, int], tuple[bytes, str] | None]]


def map_ranges(directory: Path, manifest: Manifest, wanted: Mapping[str, list[tuple[int, int]]], *,
               verify: bool) -> dict[str, memoryview]:
    """The ``wanted`` files of a directory of this host, mapped (each size checked against the manifest first),
    and with ``verify`` every piece the ``wanted`` ranges touch checked, as :func:`fetch_ranges` checks what it
    fetches; name -> buffer. What a rank reads from its own host's share of a step, beside ranged GETs of the rest."""
    from registry.fs.mapping import host_view, map_file
    buffers: dict[str, memoryview] = {}
    jobs: list[tuple[str, FileEntry, int, int, int]] = []
    for name, ranges in sorted(wanted.items()):
        entry = manifest.files.get(name)
        if entry is None:
            raise ManifestError(f"manifest of {directory} does not cover {name!r}", path=directory / name)
        buffers[name] = host_view(map_file(directory, name, expected_size=entry.size))
        if verify:
            jobs.extend((name, entry, start, end, piece or 0)
                        for start, end, piece in piece_ranges(entry, ranges, verify=True))

    def one(name: str, entry: FileEntry, start: int, end: int, piece: int) -> None:
        check_piece(directory / name, entry, piece, buffers[name][start:end])

    _POOL.run_all(one, jobs)
    return buffers


def received_ranges(directory: Path, manifest: Manifest, wanted: Mapping[str, list[tuple[int, int]]],
                    received: Received, *,
                    verify: bool) -> dict[str, memoryview]:
    """The ``wanted`` ranges of files another host sent (name -> (offset, length) -> the bytes it read there, checked
    against the manifest's pieces by that host, and their xxh3-128; None where it could not), put into a buffer of
    each file's size, with ``verify`` each range's digest checked as it lands; name -> buffer. ``directory`` (this
    host's part) names the files in errors: a range missing or changed is a ``CorruptCheckpointError`` of a
    part, which condemns nothing."""
    import torch
    import xxhash

    from registry.fs.mapping import host_view
    buffers: dict[str, memoryview] = {}
    for name, ranges in sorted(wanted.items()):
        entry = manifest.files.get(name)
        if entry is None:
            raise ManifestError(f"manifest of {directory} does not cover {name!r}", path=directory / name)
        buffers[name] = buf = host_view(torch.empty(entry.size, dtype=torch.uint8))
        sent = received.get(name, {})
        for offset, length in ranges:
            got = sent.get((offset, length))
            if got is None or len(got[0]) != length or verify and xxhash.xxh3_128_hexdigest(got[0]) != got[1]:
                raise CorruptCheckpointError(f"bytes {offset}-{offset + length - 1} of {name} did not arrive whole "
                                             "from the host whose part holds them", path=directory / name)
            buf[offset:offset + length] = got[0]
    return buffers


def _object_reader() -> type:
    from registry.format.dcp_metadata import RestrictedFileSystemReader

    class _Reader(RestrictedFileSystemReader):
        def __init__(self, root: ObjectRoot | None, prefix: str | None, *, metadata: Metadata, manifest: Manifest,
                     verify: bool, trust_pickle: bool, local: Path | None = None,
                     local_files: frozenset[str] = frozenset(),
                     received: Received | None = None) -> None:
            self._fetched: dict[str, memoryview] = {}
            super().__init__(prefix or str(local), metadata=metadata, buffers=self._fetched,
                             trust_pickle=trust_pickle)
            self._root, self._prefix, self._manifest, self._verify = root, prefix, manifest, verify
            self._local, self._local_files, self._received = local, local_files, received or {}

        def read_data(self, plan: Any, planner: Any) -> Any:
            wanted: dict[str, list[tuple[int, int]]] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                wanted.setdefault(info.relative_path, []).append((info.offset, info.length))
            here = {n: r for n, r in wanted.items() if n in self._local_files}
            sent = {n: r for n, r in wanted.items() if n not in here and n in self._received}
            far = {n: r for n, r in wanted.items() if n not in here and n not in sent}
            self._fetched.clear()
            if far:
                if self._root is None or self._prefix is None:
                    raise CheckpointReadError(f"{len(far)} files this rank reads are not in {self._local} and the "
                                              f"step has no durable copy to fetch them from (first: {min(far)})",
                                              path=self._local)
                self._fetched.update(fetch_ranges(self._root, self._prefix, self._manifest, far,
                                                  verify=self._verify))
            if here or sent:
                assert self._local is not None
                self._fetched.update(map_ranges(self._local, self._manifest, here, verify=self._verify))
                self._fetched.update(received_ranges(self._local, self._manifest, sent, self._received,
                                                     verify=self._verify))
            try:
                return super().read_data(plan, planner)
            finally:
                self._fetched.clear()

    return _Reader


def object_dcp_reader(root: ObjectRoot, prefix: str, *, metadata: Metadata, manifest: Manifest, verify: bool,
                      trust_pickle: bool) -> Any:
    """A DCP ``StorageReader`` for the step under ``prefix`` (``metadata`` already checked against ``manifest``)."""
    return _object_reader()(root, prefix, metadata=metadata, manifest=manifest, verify=verify,
                            trust_pickle=trust_pickle)


def part_dcp_reader(local: Path, files: frozenset[str], root: ObjectRoot | None, prefix: str | None, *,
                    received: Received, metadata: Metadata,
                    manifest: Manifest, verify: bool, trust_pickle: bool) -> Any:
    """A DCP ``StorageReader`` that maps ``files`` from ``local`` (a directory of this host holding a share of the
    step), takes the ranges of other files other hosts sent (``received``, :func:`received_ranges`) and fetches
    the rest from ``prefix`` by ranged GETs, what it reads checked each way; a file in none of them is a
    ``CheckpointReadError``."""
    return _object_reader()(root, prefix, metadata=metadata, manifest=manifest, verify=verify,
                            trust_pickle=trust_pickle, local=local, local_files=files, received=received)


__all__ = ["Received", "fetch_ranges", "map_ranges", "object_dcp_reader", "object_dcp_writer", "part_dcp_reader",
           "piece_ranges", "read_object", "received_ranges", "upload_sharded_tail"]
