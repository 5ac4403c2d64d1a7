"""DCP's files in a step directory: written hashed, read back only after their checksums.

Writing: :class:`HashingDcpWriter` is ``torch.distributed.checkpoint``'s own
``FileSystemWriter`` with its file streams replaced by ``HashingWriter``\\ s,
so every ``.distcp`` file (and rank 0's ``.metadata``) gets its size, sha256
and xxh3 pieces while DCP writes it, and is fsync'd when DCP closes it.
Nothing is read back to hash it. :func:`write_sharded_tail` then writes
``meta.json``, ``config.json`` and the manifest (last) next to them.

Reading: ``.metadata`` is a pickle. It is unpickled by :func:`unpickle_metadata`
only, and only after its bytes matched the sha256 the manifest records (whose
own digest the caller checked against the catalog). Non-tensor values of the
state (``param_groups``, counters) are ``torch.load``-ed with
``weights_only=True`` unless the caller trusts the author. :func:`full_state`
turns the files into one flat state dict of full tensors, in this process,
without a process group, through the one restricted reader,
:class:`~registry.format.dcp_metadata.RestrictedFileSystemReader`, which a
collective load hands to ``dcp.load`` too.

Key naming: the flat state dict uses DCP's flattened keys, the nested keys of
the saved state joined with ``.`` (``model.layers.0.weight``,
``optim.state.layers.0.weight.exp_avg``, ``optim.param_groups``), exactly the
keys of ``Metadata.state_dict_metadata``.
"""

from __future__ import annotations

import io
import os
import threading
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from registry.errors import CorruptCheckpointError, ManifestError, UnsafePickleError
from registry.format.manifest import CONFIG, MANIFEST, META, FileEntry, Manifest
from registry.format.pieces import piece_count
from registry.format.sharding import DCP_METADATA, ShardedLayout
from registry.fs.hashing import HashingWriter, hash_bytes

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    from registry.fs.payloadfiles import Written


def unpickle_metadata(raw: bytes, *, path: Path) -> Metadata:
    """THE one place a step's ``.metadata`` is unpickled; call only on bytes whose sha256 the manifest vouches for.

    Even then through the restricted unpickler (only DCP's metadata records can
    be built): a catalog is no reason to run what a pickle names.
    """
    from registry.format.dcp_metadata import load_dcp_metadata
    return load_dcp_metadata(raw, path=path)


def checked_metadata(directory: Path, manifest: Manifest, raw: bytes | memoryview) -> Metadata:
    """``.metadata``'s bytes, checked against the manifest's sha256, unpickled."""
    path = directory / DCP_METADATA
    entry = manifest.files.get(DCP_METADATA)
    if entry is None:
        raise ManifestError(f"manifest of {directory} does not list {DCP_METADATA}", path=directory)
    if len(raw) != entry.size or hash_bytes(raw, "sha256") != entry.sha256:
        raise CorruptCheckpointError(f"checkpoint file checksum mismatch: {path}", path=path)
    return unpickle_metadata(bytes(raw), path=path)


# --------------------------------------------------------------------------- writing


def _filesystem_writer() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

    class _HashingFileSystem(FileSystem):
        """DCP's filesystem with every written stream hashed, and fsync'd at close."""

        def __init__(self) -> None:
            super().__init__()
            self.written: dict[str, FileEntry] = {}
            self._lock = threading.Lock()

        @contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            target = Path(path)
            out = HashingWriter(target)
            try:
                yield cast(io.IOBase, out)
                out.close()  # DCP closes it itself; a second close is a no-op
            except BaseException:
                out.abort()
                raise
            assert out.sha256 is not None
            with self._lock:
                self.written[target.name] = FileEntry(name=target.name, size=out.size, sha256=out.sha256,
                                                      piece_size=out.piece_size,
                                                      xxh3_128_pieces=out.xxh3_128_pieces)

        def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
            super().rename(path, new_path)
            with self._lock:  # DCP writes .metadata.tmp, then renames it
                entry = self.written.pop(Path(path).name, None)
                if entry is not None:
                    self.written[Path(new_path).name] = replace(entry, name=Path(new_path).name)

    class _Writer(FileSystemWriter):
        def __init__(self, path: Path, threads: int) -> None:
            # sync_files=False: our streams fsync as they close (DCP would fall back to a global sync())
            super().__init__(path, single_file_per_rank=True, sync_files=False, overwrite=True, thread_count=threads)
            self.fs = _HashingFileSystem()

        @property
        def written(self) -> dict[str, FileEntry]:
            return dict(cast(_HashingFileSystem, self.fs).written)

    return _Writer


def hashing_writer(path: Path, *, threads: int = 1) -> Any:
    """A DCP ``FileSystemWriter`` into ``path`` whose ``.written`` gives name -> ``FileEntry`` of its files.

    ``threads`` > 1 splits a rank's shard into that many files written (and
    hashed) at once: one file's sha256 is one sequential stream, the
    slowest part of a publish, so more files use more cores.
    """
    return _filesystem_writer()(path, threads)


def write_threads(ranks_here: int) -> int:
    """Files per rank: this host's cores shared among the ``ranks_here`` ranks that run on it, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // max(1, ranks_here)))


def write_sharded_tail(staging: Path, *, entries: Mapping[str, FileEntry], layout: ShardedLayout,
                       tensors: Collection[str], meta: Mapping[str, Any], meta_raw: bytes,
                       config_raw: bytes) -> Written:
    """Write ``meta.json``, ``config.json`` and the manifest (last) beside the DCP files; fsync it all.

    ``entries`` are the DCP files every rank wrote, as their writers hashed them.
    """
    from registry.fs.store import fsync_dir
    written = sharded_tail(lambda name, raw: write_small(staging / name, raw), entries=entries, layout=layout,
                           tensors=tensors, meta=meta, meta_raw=meta_raw, config_raw=config_raw)
    fsync_dir(staging)
    return written


def sharded_tail(put: Callable[[str, bytes], FileEntry], *, entries: Mapping[str, FileEntry],
                 layout: ShardedLayout, tensors: Collection[str], meta: Mapping[str, Any], meta_raw: bytes,
                 config_raw: bytes) -> Written:
    """``meta.json``, ``config.json`` and the manifest (last) stored through ``put(name, bytes)``, which hashes
    what it stores: the one tail of a sharded step, whatever storage ``put`` writes to."""
    from registry.fs.payloadfiles import Written
    files = dict(entries)
    for name, raw in ((META, meta_raw), (CONFIG, config_raw)):
        files[name] = put(name, raw)
    manifest = Manifest(files=files, tensors=tuple(sorted(tensors)), created_at=meta.get("timestamp"),
                        optimizer_step=meta.get("optimizer_step"), policy_version=meta.get("policy_version"),
                        layout=layout)
    raw = manifest.encode()
    entry = put(MANIFEST, raw)
    return Written(manifest=manifest, manifest_sha256=entry.sha256, total_bytes=manifest.total_bytes + len(raw))


def write_small(path: Path, raw: bytes) -> FileEntry:
    """Write one small file of a step (meta, config, manifest, ``.metadata``), hashed and fsync'd; its entry."""
    with HashingWriter(path) as out:
        out.write(raw)
    assert out.sha256 is not None
    return FileEntry(name=path.name, size=out.size, sha256=out.sha256, piece_size=out.piece_size,
                     xxh3_128_pieces=out.xxh3_128_pieces)


# --------------------------------------------------------------------------- reading


def full_state(directory: Path, manifest: Manifest, files: Mapping[str, torch.Tensor], *, trust_pickle: bool,
               keys: Collection[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole saved state from the step's file buffers, as (flat tensors, flat non-tensor values).

    ``files`` must hold ``.metadata`` and every data file. No process group is
    needed or used. ``keys`` keeps only those flat keys (or those under a
    prefix ``key.``).
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from registry.format.dcp_metadata import RestrictedFileSystemReader, dcp_failure
    from registry.fs.mapping import host_view
    views = {name: host_view(buf) for name, buf in files.items()}
    md = checked_metadata(directory, manifest, views[DCP_METADATA])
    flat: dict[str, Any] = {}
    for key, item in md.state_dict_metadata.items():
        if keys is not None and not wanted(key, keys):
            continue
        if isinstance(item, TensorStorageMetadata):
            flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[key] = item  # a placeholder DCP replaces with the unpickled value
    try:
        load_flat(flat, RestrictedFileSystemReader(directory, metadata=md, buffers=views, trust_pickle=trust_pickle),
                  no_dist=True)
    except (UnsafePickleError, CorruptCheckpointError):
        raise
    except dcp_failures() as exc:  # DCP wraps everything; files that passed their checksums but do not parse
        _, cause = dcp_failure(exc)
        if isinstance(cause, (UnsafePickleError, CorruptCheckpointError)):
            raise cause from None
        if isinstance(cause, OSError):  # this process could not read: never evidence against the step
            from registry.fs.mapping import read_error
            raise read_error(directory, cause) from None
        raise CorruptCheckpointError(f"cannot load the sharded checkpoint {directory}: {cause}".splitlines()[0],
                                     path=directory) from None
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in flat.items() if k not in tensors}


def load_flat(flat: dict[str, Any], reader: Any, *, process_group: Any = None, no_dist: bool = False) -> None:
    """``dcp.load`` of a flat state (DCP's flattened keys) without its wrapper, whose only work for such a state is
    asking of every value whether it is ``Stateful`` (a runtime protocol check, about 10 us a value, twice: 4-9 ms
    of a load of 400 keys, more with more): a flat state's values are tensors and plain values, never ``Stateful``.
    Raises what ``dcp.load`` raises."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    with quiet():
        _load_state_dict(flat, storage_reader=reader, process_group=process_group, no_dist=no_dist)


@contextmanager
def quiet() -> Iterator[None]:
    """DCP warns on every call without a process group that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_failures() -> tuple[type[BaseException], ...]:
    """What a DCP call raises when it fails: any ``Exception``, or its ``CheckpointException`` (a ``BaseException``)."""
    from torch.distributed.checkpoint.api import CheckpointException
    return (Exception, CheckpointException)


def wanted(key: str, keys: Collection[str]) -> bool:
    """Whether flat ``key`` is one of ``keys`` or lies under one of them (``model`` covers ``model.x``)."""
    return key in keys or any(key.startswith(prefix + ".") for prefix in keys)


def part_of(manifest: Manifest, names: Collection[str]) -> Manifest:
    """``manifest`` as far as one host's part of a sharded step holds it (``registry.distributed.parts``): the data
    files ``names`` and every file that is not a data file (the small files every part holds)."""
    data = set(manifest.layout.data_files) if manifest.layout is not None else set()
    return replace(manifest, files={n: e for n, e in manifest.files.items() if n in names or n not in data})


def piece_share(manifest: Manifest, rank: int, world: int) -> list[tuple[str, int]]:
    """The (file, piece) pairs of the DCP data files that ``rank`` of ``world`` checks."""
    assert manifest.layout is not None
    pairs: list[tuple[str, int]] = []
    for name in sorted(manifest.layout.data_files):
        entry = manifest.files[name]
        count = piece_count(entry.size, entry.piece_size) if entry.piece_size else 1
        pairs.extend((name, i) for i in range(count))
    return pairs[rank::world]


def check_piece(path: Path, entry: FileEntry, piece: int, data: bytes | memoryview) -> None:
    """Piece ``piece`` of ``entry``'s file (the whole file where the entry has no pieces) against the manifest:
    the one check of a sharded step's bytes, mapped or downloaded; ``CorruptCheckpointError`` if it differs."""
    import xxhash
    if entry.xxh3_128_pieces is not None and entry.piece_size is not None:
        ok = piece < len(entry.xxh3_128_pieces) and xxhash.xxh3_128_hexdigest(data) == entry.xxh3_128_pieces[piece]
    elif entry.xxh3_128 is not None:
        ok = xxhash.xxh3_128_hexdigest(data) == entry.xxh3_128
    else:
        ok = hash_bytes(data, "sha256") == entry.sha256
    if not ok:
        start = piece * (entry.piece_size or entry.size)
        raise CorruptCheckpointError(f"checkpoint file checksum mismatch: {path} (bytes "
                                     f"{start}-{start + len(data) - 1})", path=path)


def check_share(directory: Path, manifest: Manifest, share: list[tuple[str, int]]) -> None:
    """Check the given pieces of the data files against the manifest; ``CorruptCheckpointError`` if not.

    Each file is mapped read-only and shared (the page cache's own pages, no
    copy) and each piece hashed where it lies: 512 MiB in ~15 ms on a
    2-core VM, a read into a buffer took ~25 ms.
    """
    import mmap

    from registry.format.manifest import open_regular
    by_file: dict[str, list[int]] = {}
    for name, piece in share:
        by_file.setdefault(name, []).append(piece)
    for name, pieces in by_file.items():
        entry = manifest.files[name]
        path = directory / name
        fd = open_regular(directory, name)
        try:
            actual = os.fstat(fd).st_size
            if actual != entry.size:
                raise CorruptCheckpointError(f"checkpoint file size mismatch: {path} is {actual} bytes, manifest "
                                             f"says {entry.size}", path=path)
            if entry.size == 0:
                continue
            with mmap.mmap(fd, entry.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mapped:
                view = memoryview(mapped)
                try:
                    size = entry.piece_size or entry.size
                    for piece in pieces:
                        start = piece * size
                        data = view[start:start + size]
                        try:
                            check_piece(path, entry, piece, data)
                        finally:
                            data.release()
                finally:
                    view.release()
        except OSError as exc:
            from registry.fs.mapping import read_error
            raise read_error(path, exc) from None
        finally:
            os.close(fd)


__all__ = ["check_piece", "check_share", "checked_metadata", "dcp_failures", "full_state", "hashing_writer",
           "load_flat", "piece_share", "quiet", "sharded_tail", "unpickle_metadata", "wanted", "write_sharded_tail",
           "write_small", "write_threads"]
