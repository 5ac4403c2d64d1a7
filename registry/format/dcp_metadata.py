"""Reading ``torch.distributed.checkpoint`` (DCP) directories without unpickling anything foreign.

A DCP checkpoint is a directory holding ``.metadata`` (a pickled
``Metadata``: which tensors exist, their shapes and chunks, and where each
chunk's bytes lie) and ``__<rank>_<n>.distcp`` data files. DCP's own
``FileSystemReader`` reads ``.metadata`` with ``pickle.load``, and its default
planner reads every non-tensor entry with ``torch.load(weights_only=False)``:
a directory someone else wrote would run whatever code it names. Here
``.metadata`` goes through an unpickler that can only build DCP's metadata
classes (the list is what torch's own ``dcp.save`` writes, for plain,
FSDP2/DTensor and optimizer state), whose result is then checked field by
field; and :class:`RestrictedFileSystemReader` reads non-tensor entries with
``torch.load(weights_only=True)``. Anything else is refused with a one-line
``UnsafePickleError`` (a forbidden global) or ``DcpMetadataError``
(truncated, malformed, or naming files that are not there).
"""

from __future__ import annotations

import io
import math
import os
import pathlib
import pickle
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard, TypeVar, cast

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from registry.format.sharding import ShardedLayout
from registry.errors import CorruptCheckpointError, DcpMetadataError, RegistryError, UnsafePickleError
from registry.format.manifest import check_file_name, open_regular

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # read whole before unpickling, so bounded; a 70B model's is tens of MiB
DATA_FILE = re.compile(r"__([0-9]{1,6})_([0-9]{1,6})\.distcp")
MAX_WORLD_SIZE = 1 << 16
_T = TypeVar("_T")

# The classes a ``.metadata`` may instantiate and fill in (BUILD), by exact type.
_RECORDS: tuple[type, ...] = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                              TensorProperties, MetadataIndex, StorageMeta, _StorageInfo)


class _Sealed(type):
    """The type of a shadow record class: nothing may be set on the class object itself.

    A pickle can push any class it may name and then BUILD on the class object
    (not an instance), which would set attributes on it for every later user
    in the process. The unpickler hands out shadow subclasses of this type in
    place of DCP's records, so such a BUILD fails; what it builds are fresh
    instances, given their real class back once the load is done.
    """

    def __setattr__(cls, name: str, value: Any) -> None:
        raise UnsafePickleError(f"refusing to set {str(name)[:100]} on the class {cls.__name__}")

    def __delattr__(cls, name: str) -> None:
        raise UnsafePickleError(f"refusing to delete {str(name)[:100]} from the class {cls.__name__}")


_SHADOWS: dict[type, type] = {cls: _Sealed(cls.__name__, (cls,), {"__module__": __name__, "__slots__": ()})
                              for cls in _RECORDS}
_REAL: dict[type, type] = {shadow: cls for cls, shadow in _SHADOWS.items()}


class _Factory:
    """A global the unpickler hands out as a plain callable: slotted, so a BUILD aimed at it has nothing to set."""

    __slots__ = ("_make",)
    _make: Any

    def __init__(self, make: Any) -> None:
        object.__setattr__(self, "_make", make)

    def __setattr__(self, name: str, value: Any) -> None:
        raise UnsafePickleError("refusing to set an attribute of an unpickling factory")

    def __call__(self, *args: Any) -> Any:
        return self._make(*args)


class _Encoding:
    """A fresh stand-in for a ``_MEM_FORMAT_ENCODING`` member (shared by the process, so never handed to a
    pickle to BUILD on): equal to that member, which is all ``TensorProperties.__setstate__`` asks of it."""

    __slots__ = ("member",)

    def __init__(self, value: Any) -> None:
        self.member = _MEM_FORMAT_ENCODING(value)

    def __eq__(self, other: object) -> bool:
        return other is self.member

    __hash__ = None  # type: ignore[assignment]


def _layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout``, but with the name checked first."""
    layout = _LAYOUTS.get(name) if isinstance(name, str) else None
    if layout is None:
        raise UnsafePickleError(f"unknown tensor layout {name!r}")
    return layout


def _path(cls: type[pathlib.PurePath]) -> _Factory:
    def make(*parts: Any) -> pathlib.PurePath:
        if not all(isinstance(p, str) for p in parts):
            raise UnsafePickleError("a path whose parts are not strings")
        return cls(*parts)
    return _Factory(make)


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
# Every value is a shadow class, a factory, or a C object with no attributes to set (sizes, dtypes)
_GLOBALS: dict[tuple[str, str], Any] = {
    **{(cls.__module__, cls.__qualname__): shadow for cls, shadow in _SHADOWS.items()},
    (_MEM_FORMAT_ENCODING.__module__, _MEM_FORMAT_ENCODING.__qualname__): _Factory(_Encoding),
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _Factory(_layout),
    # StorageMeta.checkpoint_id: a path is only ever a name here, so a Windows one stays pure
    ("pathlib", "PosixPath"): _path(pathlib.PurePosixPath),
    ("pathlib", "PurePosixPath"): _path(pathlib.PurePosixPath),
    ("pathlib", "WindowsPath"): _path(pathlib.PureWindowsPath),
    ("pathlib", "PureWindowsPath"): _path(pathlib.PureWindowsPath),
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}


class _Unpickler(pickle.Unpickler):
    """The C unpickler, restricted to the globals above (see :class:`_Sealed` for why they are shadows)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise UnsafePickleError(f"refusing to unpickle {str(module)[:100]}.{str(name)[:100]}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refusing a persistent id")


_FIELDS: dict[type, frozenset[str]] = {cls: frozenset(getattr(cls, "__dataclass_fields__", ())) for cls in _RECORDS}


def _read(source: bytes | str | os.PathLike[str], named: Path | None) -> tuple[bytes, str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), str(named) if named is not None else "DCP .metadata"
    path = Path(source)
    if path.is_dir():
        path = path / METADATA
    fd = open_regular(path.parent, path.name, error=DcpMetadataError, what="DCP metadata")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_METADATA_BYTES + 1)
    if len(raw) > MAX_METADATA_BYTES:
        raise DcpMetadataError(f"{path} is larger than {MAX_METADATA_BYTES} bytes", path=path)
    return raw, str(path)


def load_dcp_metadata(source: bytes | str | os.PathLike[str], *, path: Path | None = None) -> Metadata:
    """The ``Metadata`` in ``source`` (its bytes, the file, or the checkpoint directory), checked.

    Never runs code the file names: only DCP's metadata classes, torch sizes,
    dtypes and layouts can be built. The result is checked as
    :func:`check_metadata` says before it is returned. ``path`` names bytes
    read elsewhere (e.g. already checked against a manifest) in errors.
    """
    raw, where = _read(source, path)
    if not isinstance(source, (bytes, bytearray, memoryview)):
        path = Path(where)
    try:
        metadata = _Unpickler(io.BytesIO(raw)).load()
    except UnsafePickleError as exc:
        raise UnsafePickleError(f"{where}: {exc}; a DCP .metadata may only hold DCP's metadata records",
                                path=path) from None
    except RegistryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle fails in every way pickle can fail
        raise DcpMetadataError(f"{where} does not unpickle ({_short(exc)}); it is truncated or damaged",
                               path=path) from None
    check_metadata(metadata, where=where, path=path)
    return metadata


def _bad(where: str, path: Path | None, why: str) -> DcpMetadataError:
    return DcpMetadataError(f"{where}: {why}", path=path)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_size(value: object) -> bool:
    return isinstance(value, torch.Size) and all(_is_int(v) and v >= 0 for v in value)


def _record(obj: object, cls: type[_T]) -> TypeGuard[_T]:
    """``obj`` is exactly a ``cls`` with every field set and no other attribute (pickle can leave any out).

    One the unpickler built (a shadow's instance, see :class:`_Sealed`) gets
    its real class here: :func:`check_metadata` reaches every record, and
    checks every field of each, so none is left a shadow.
    """
    kind = type(obj)
    if kind is not cls:
        if kind is not _SHADOWS.get(cls):
            return False
        object.__setattr__(obj, "__class__", cls)
    names = _FIELDS[cls]
    return vars(obj).keys() <= names and all(hasattr(obj, name) for name in names)


def _optional_str(value: object) -> bool:
    return value is None or isinstance(value, str)


def _plain_path(meta: StorageMeta) -> bool:
    """Whether ``meta.checkpoint_id`` is a path, made afresh from its text (a BUILD may have set a path's slots,
    its text among them, to anything a pickle can make)."""
    given = meta.checkpoint_id
    if not isinstance(given, pathlib.PurePath):
        return False
    try:
        text = str(given)
    except Exception:  # noqa: BLE001 - a path whose slots a pickle set fails in any way str() can
        return False
    if not isinstance(text, str):
        return False
    meta.checkpoint_id = type(given)(text)
    return True


def check_metadata(metadata: object, *, where: str, path: Path | None = None) -> None:
    """Refuse a ``Metadata`` whose fields are not what DCP writes, before anything acts on them.

    Every record must have all its fields and no others; every data file must
    be a plain name inside the directory, with a non-negative offset and
    length; every chunk must lie inside its tensor.
    """
    if not _record(metadata, Metadata):
        raise _bad(where, path, f"holds a {type(metadata).__name__}, not a complete DCP Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise _bad(where, path, "state_dict_metadata is not a dict")
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise _bad(where, path, f"a key is a {type(fqn).__name__}, not a string")
        if _record(entry, BytesStorageMetadata):
            continue
        if not _record(entry, TensorStorageMetadata):
            raise _bad(where, path, f"{fqn[:200]!r} is not a complete tensor entry")
        props = entry.properties
        if (not _record(props, TensorProperties) or not isinstance(props.dtype, torch.dtype)
                or not isinstance(props.layout, torch.layout)
                or not isinstance(props.memory_format, torch.memory_format)
                or not isinstance(props.requires_grad, bool) or not isinstance(props.pin_memory, bool)):
            raise _bad(where, path, f"{fqn[:200]!r} has no valid tensor properties")
        if not _is_size(entry.size) or not isinstance(entry.chunks, list):
            raise _bad(where, path, f"{fqn[:200]!r} has an invalid size or chunk list")
        for chunk in entry.chunks:
            if (not _record(chunk, ChunkStorageMetadata) or not _is_size(chunk.offsets)
                    or not _is_size(chunk.sizes) or len(chunk.offsets) != len(entry.size)
                    or len(chunk.sizes) != len(entry.size)
                    or any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size))):
                raise _bad(where, path, f"{fqn[:200]!r} has a chunk outside its tensor")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise _bad(where, path, "storage_data is not a dict")
    for index, info in storage.items():
        if (not _record(index, MetadataIndex) or not isinstance(index.fqn, str) or index.fqn not in entries
                or not (index.offset is None or _is_size(index.offset))
                or not (index.index is None or _is_int(index.index))):
            raise _bad(where, path, "storage_data has an entry for no known state entry")
        if (not _record(info, _StorageInfo) or not _is_int(info.offset) or not _is_int(info.length)
                or info.offset < 0 or info.length < 0):
            raise _bad(where, path, f"storage_data entry for {index.fqn[:200]!r} is malformed")
        if not isinstance(info.relative_path, str):
            raise _bad(where, path, f"storage_data entry for {index.fqn[:200]!r} names no file")
        check_file_name(info.relative_path, where=path)
        descriptors = info.transform_descriptors
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(isinstance(d, str) for d in descriptors)):
            raise _bad(where, path, f"storage_data entry for {index.fqn[:200]!r} has malformed transforms")
    _check_stored_bytes(metadata, where=where, path=path)
    planner = metadata.planner_data
    if planner is not None and not (isinstance(planner, dict) and all(
            isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v)
            for k, v in planner.items())):
        raise _bad(where, path, "planner_data is not a map of names to key paths")
    meta = metadata.storage_meta
    if meta is not None and not (
            _record(meta, StorageMeta) and _optional_str(meta.save_id) and _optional_str(meta.load_id)
            and (_optional_str(meta.checkpoint_id) or _plain_path(meta))
            and isinstance(meta.modules, list) and all(isinstance(m, str) for m in meta.modules)):
        raise _bad(where, path, "storage_meta is malformed")
    if metadata.version is not None and not isinstance(metadata.version, str):
        raise _bad(where, path, "version is not a string")


def _check_stored_bytes(metadata: Metadata, *, where: str, path: Path | None) -> None:
    """Every chunk of every tensor has a stored entry holding at least its bytes.

    A load allocates each tensor at the size ``.metadata`` claims before it
    reads a byte; tying every claim to stored bytes (which the data files
    must then have, :func:`check_data_files`) bounds what a hostile file can
    make a load allocate. Compressed entries (DCP's optional transforms)
    cannot be tied this way and are only checked for presence.
    """
    stored = {(index.fqn, None if index.offset is None else tuple(index.offset)): info
              for index, info in metadata.storage_data.items()}
    for fqn, entry in metadata.state_dict_metadata.items():
        if type(entry) is not TensorStorageMetadata:
            continue
        for chunk in entry.chunks:
            info = stored.get((fqn, tuple(chunk.offsets)))
            if info is None:
                raise _bad(where, path, f"{fqn[:200]!r} has a chunk with no stored entry")
            need = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
            if not info.transform_descriptors and info.length < need:
                raise _bad(where, path, f"{fqn[:200]!r} claims {need} bytes for a chunk stored in {info.length}")


@dataclass(frozen=True, kw_only=True)
class DcpFiles:
    """What a ``.metadata`` says about the directory's data files."""

    needed: dict[str, int]                 # data file -> the bytes it must have at least
    world_size: int                        # ranks seen in the data file names (``__<rank>_<n>.distcp``)
    files_per_rank: dict[int, tuple[str, ...]]

    def layout(self) -> ShardedLayout:
        """The manifest's sharded layout for these files: what tells a load this step is a DCP checkpoint."""
        ranks = range(self.world_size)
        return ShardedLayout(world_size=self.world_size,
                             files_per_rank=tuple(tuple(self.files_per_rank.get(r, ())) for r in ranks))


def tensor_names(metadata: Metadata) -> tuple[str, ...]:
    """The flattened names of the tensor entries (the manifest's ``tensors``)."""
    return tuple(sorted(k for k, v in metadata.state_dict_metadata.items() if type(v) is TensorStorageMetadata))


def data_files(metadata: Metadata, present: Mapping[str, int]) -> DcpFiles:
    """The data files ``metadata`` needs and how they map to ranks; ``present`` is name -> size."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    per_rank: dict[int, list[str]] = {}
    for name in sorted({*needed, *present}):
        match = DATA_FILE.fullmatch(name)
        if match:
            per_rank.setdefault(int(match[1]), []).append(name)
    world = max(per_rank, default=-1) + 1
    if world > MAX_WORLD_SIZE:
        raise DcpMetadataError(f"DCP data files name rank {world - 1}, more than {MAX_WORLD_SIZE} ranks")
    return DcpFiles(needed=needed, world_size=world,
                    files_per_rank={rank: tuple(per_rank.get(rank, ())) for rank in range(world)})


def check_data_files(directory: Path, metadata: Metadata, sizes: Mapping[str, int]) -> DcpFiles:
    """Every file ``metadata`` references exists in ``sizes`` (name -> size) with enough bytes."""
    files = data_files(metadata, sizes)
    for name, need in sorted(files.needed.items()):
        if name not in sizes:
            raise DcpMetadataError(f"{directory / METADATA} references {name}, which is missing: {directory / name}",
                                   path=directory / name)
        if sizes[name] < need:
            raise DcpMetadataError(f"{directory / name} is {sizes[name]} bytes; {METADATA} needs at least {need}",
                                   path=directory / name)
    return files


class _SafeBytes:
    """A load planner whose non-tensor entries were read with ``weights_only=True``.

    DCP's default planner unpickles them with ``weights_only=False``; the
    value the restricted load produced is put where that planner puts it
    (its state dict, or the nested one it flattened), and any other planner
    is handed a fresh pickle of it (saving and loading each entry again
    cost three times the restricted load itself).
    """

    def __init__(self, planner: LoadPlanner, where: Path) -> None:
        self._planner, self._where = planner, where

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafePickleError(f"{self._where}: entry {read_item.dest_index.fqn[:200]!r} needs full "
                                    "unpickling, which can run arbitrary code; pass trust_pickle=True only if you "
                                    "trust its author", path=self._where) from None
        except Exception as exc:  # noqa: BLE001 - a damaged entry
            raise DcpMetadataError(f"{self._where}: entry {read_item.dest_index.fqn[:200]!r} does not load "
                                   f"({_short(exc)})", path=self._where) from None
        planner = self._planner
        if isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
            fqn = read_item.dest_index.fqn
            if planner.flatten_state_dict:
                set_element(planner.original_state_dict, planner.mappings[fqn], obj)
            else:
                planner.state_dict[fqn] = obj
            return
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        planner.load_bytes(read_item, clean)


class _PlainFiles(FileSystem):
    """DCP's filesystem, reading only regular files directly inside the directory (no symlinks, no FIFOs)."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":  # a reader never writes; kept as DCP has it
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = Path(path)
        fd = open_regular(target.parent, target.name, error=DcpMetadataError, what="DCP data file")
        with os.fdopen(fd, "rb") as stream:
            yield cast(io.IOBase, stream)


class _View(io.RawIOBase):
    """A seekable read-only file over a buffer (a mapped or received file), without a copy."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._data) - self._pos))
        out[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


class _Buffers(FileSystem):
    """DCP's filesystem over buffers already in memory (name -> bytes): a load reads the very bytes checked."""

    def __init__(self, buffers: Mapping[str, memoryview]) -> None:
        super().__init__()
        self._buffers = buffers

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        name = Path(path).name
        if mode != "rb" or name not in self._buffers:
            raise DcpMetadataError(f"{path} is not among the checked files", path=Path(path))
        yield cast(io.IOBase, _View(self._buffers[name]))


class RestrictedFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with nothing unpickled beyond plain data and tensors.

    ``.metadata`` goes through :func:`load_dcp_metadata`, or is the
    ``metadata`` the caller already read that way (after checking its bytes
    against a manifest); non-tensor entries through
    ``torch.load(weights_only=True)`` unless ``trust_pickle``; tensors DCP
    already reads with ``weights_only=True``. Data files are opened only as
    regular files directly inside the directory (a symlink is refused, not
    followed), or read from ``buffers`` (name -> bytes) when given, so a load
    reads the very bytes that were verified. Pass it as ``storage_reader=``
    to ``dcp.load``, which reports a refused ``.metadata`` inside its own
    exception; the refusal itself is kept in ``refusal``.
    """

    refusal: RegistryError | None = None  # why ``.metadata`` was refused, once it was

    def __init__(self, path: str | os.PathLike[str], *, metadata: Metadata | None = None,
                 buffers: Mapping[str, memoryview] | None = None, trust_pickle: bool = False) -> None:
        super().__init__(path)
        self.fs = _PlainFiles() if buffers is None else _Buffers(buffers)
        self._metadata, self._trust_pickle = metadata, trust_pickle

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None and self.refusal is not None:
            # DCP retries with a rank's own metadata after any failure: a refused one is not a missing one
            raise self.refusal
        metadata = self._metadata
        if metadata is None:
            try:
                metadata = load_dcp_metadata(Path(self._get_metadata_path(rank)))
            except RegistryError as exc:
                if rank is None:
                    self.refusal = exc
                raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        if self._trust_pickle:
            return super().read_data(plan, planner)
        return super().read_data(plan, _SafeBytes(planner, Path(self.path)))  # type: ignore[arg-type]


def load_dcp_state_dict(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole state dict a DCP directory holds, as plain CPU tensors and values, in one process.

    For evaluation and conversion: no process group, every shard assembled
    into full tensors, nested as it was saved. DCP reports every failure as
    a ``CheckpointException`` (a ``BaseException``); the registry error inside
    it is raised instead, and any other failure as ``CorruptCheckpointError``.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = RestrictedFileSystemReader(os.fspath(directory))
    try:
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointException as exc:
        cause = reader.refusal or dcp_cause(exc)
        if isinstance(cause, RegistryError):
            raise cause from None
        raise CorruptCheckpointError(f"cannot load the DCP checkpoint {directory}: {_short(cause)}",
                                     path=Path(directory)) from None
    return state


def dcp_failure(exc: BaseException) -> tuple[int | None, BaseException]:
    """The first original exception inside DCP's ``CheckpointException``, and the rank it happened on.

    DCP gathers each rank's failure and raises them all on every rank; the
    exception itself derives from ``BaseException``.
    """
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for rank in sorted(failures):
            failure = failures[rank]
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(inner, BaseException):
                return rank if isinstance(rank, int) else None, dcp_failure(inner)[1]
    return None, exc


def dcp_cause(exc: BaseException) -> BaseException:
    """The first original exception inside DCP's ``CheckpointException`` (which gathers them per rank)."""
    return dcp_failure(exc)[1]


def _short(exc: BaseException) -> str:
    """An exception in at most one short line: its text may echo bytes from a hostile file."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


__all__ = ["DATA_FILE", "METADATA", "DcpFiles", "RestrictedFileSystemReader", "check_data_files", "check_metadata",
           "data_files", "dcp_cause", "dcp_failure", "load_dcp_metadata", "load_dcp_state_dict", "tensor_names"]
