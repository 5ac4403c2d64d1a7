"""One side of a diff: a step's manifest, where each of its tensors lies, and its files held open.

Structure comes from the safetensors headers of a full step, or from the
``.metadata`` of a sharded (DCP) one, read through
:func:`registry.fs.dcpfiles.checked_metadata` (its sha256 checked against the
manifest, then the restricted unpickler). Both name tensors by the same flat
keys: a sharded step's are DCP's flattened keys (``model.layers.0.weight``),
the very names a load of it returns, so a full step published from such a
load compares key by key.

A safetensors tensor is read where it lies in its file. A sharded tensor's
bytes are chunks serialized inside ``.distcp`` files: they can be compared as
stored (piece digests, then bytes), but its values exist only once loaded
through the restricted DCP reader (:func:`registry.fs.dcpfiles.full_state`),
over the files this side holds open.

A policy delta step (``delta.safetensors``) has no tensor where it lies: its
tensors are rebuilt through the reader (``rebuild``, see
:mod:`registry.ops.policy`) and compared as loaded values, like a sharded
step's.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import stat
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import CheckpointReadError, CorruptCheckpointError, UnsafePathError
from registry.format.manifest import (CONFIG, DELTA, MANIFEST, MAX_JSON_BYTES, MAX_MANIFEST_BYTES, FileEntry,
                                      check_file_name, decode_json_object, digest_bytes, parse_manifest)
from registry.format.sharding import DCP_METADATA
from registry.format.safetensors import read_safetensors_header
from registry.ops.reading import check_digest
from registry.records import CheckpointInfo

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Stored:
    """Where one DCP record lies: a chunk of a tensor, or a whole non-tensor value."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...]


@dataclass(frozen=True)
class Loc:
    """Where a tensor lies: at ``offset`` of a safetensors ``file``, or (``file`` None) in DCP ``chunks``."""

    name: str
    dtype: Any          # torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    file: str | None = None
    offset: int = 0     # of its first byte in the file
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], Stored], ...] = ()  # (offsets, sizes, stored), sorted


class Moved(Exception):
    """The step's directory or manifest is not the one its catalog row described a moment ago."""


_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0))


class Side:
    """One checkpoint being compared: its manifest, tensor locations and open files, counting bytes read.

    Every file it will read is opened here, relative to one descriptor of the
    directory, right after the manifest read through it matched the catalog:
    from then on the bytes cannot go away (a deleted file stays readable
    through an open descriptor), so no reader lease is taken. A directory
    that vanished or holds another manifest by then raises :class:`Moved`.
    """

    def __init__(self, info: CheckpointInfo, stack: ExitStack,
                 rebuild: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> None:
        self.info = info
        self._rebuilt: Mapping[str, torch.Tensor] | None = None
        self.directory = Path(info.path)
        self._stack = stack
        self._fds: dict[str, int] = {}
        self._maps: dict[str, memoryview] = {}
        self._buffers: dict[str, torch.Tensor] | None = None
        self._loaded: dict[str, memoryview] = {}
        self._metadata_size = 0
        self.bytes_read = 0
        try:
            self._dir = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                                | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise Moved() from None
        except OSError as exc:
            raise CheckpointReadError(f"cannot open {self.directory}: {exc.strerror}", errno=exc.errno,
                                      path=self.directory) from None
        stack.callback(os.close, self._dir)
        with os.fdopen(self.fd(MANIFEST), "rb", closefd=False) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        try:
            check_digest(info, digest_bytes(raw))
        except CorruptCheckpointError:
            raise Moved() from None
        self.manifest = parse_manifest(raw, path=self.directory / MANIFEST)
        layout = self.manifest.layout
        files = self.manifest.files
        if layout is not None:
            wanted = sorted({DCP_METADATA, *layout.data_files, *([CONFIG] if CONFIG in files else [])})
        else:
            wanted = [n for n in sorted(files) if (n.endswith(".safetensors") and n != DELTA) or n == CONFIG]
        for name in wanted:
            self.fd(name)
        self.tensors: dict[str, Loc] = {}
        self.objects: dict[str, Stored] = {}  # a sharded step's non-tensor values, by flat key
        self.extras = tuple(sorted(n for n in files if n.endswith(".pt")))  # a full step's pickled extras
        self._data_files = layout.data_files if layout is not None else ()
        if layout is not None:
            self._read_dcp_metadata()
            return
        if DELTA in files and rebuild is not None:  # a policy delta step: its tensors as the reader rebuilds them
            self._rebuilt = rebuild()
            for name, t in self._rebuilt.items():
                self.tensors[name] = Loc(name, t.dtype, tuple(t.shape), t.numel() * t.element_size())
        for name in wanted:
            if name.endswith(".safetensors"):
                with os.fdopen(os.dup(self.fd(name)), "rb", buffering=0) as f:
                    header = read_safetensors_header(f, files[name].size, self.directory / name)
                self.bytes_read += header.data_start
                for e in header.entries:
                    self.tensors.setdefault(e.name, Loc(e.name, e.dtype, e.shape, e.end - e.begin, file=name,
                                                        offset=header.data_start + e.begin))

    @property
    def sharded(self) -> bool:
        return self.manifest.layout is not None

    @property
    def label(self) -> str:
        return f"{self.info.run}@{self.info.step}"

    def _read_dcp_metadata(self) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from registry.format.dcp_metadata import MAX_METADATA_BYTES, check_data_files
        from registry.fs.dcpfiles import checked_metadata
        size = min(self.manifest.files[DCP_METADATA].size, MAX_METADATA_BYTES)
        with os.fdopen(self.fd(DCP_METADATA), "rb", closefd=False) as f:
            raw = f.read(size + 1)
        self.bytes_read += len(raw)
        self._metadata_size = len(raw)
        metadata = checked_metadata(self.directory, self.manifest, raw)
        # every record lies inside a data file this side holds open, as the manifest sizes it
        check_data_files(self.directory, metadata,
                         {name: self.manifest.files[name].size for name in self._data_files})
        stored = {(index.fqn, None if index.offset is None else tuple(index.offset)):
                  Stored(info.relative_path, info.offset, info.length, tuple(info.transform_descriptors or ()))
                  for index, info in metadata.storage_data.items()}
        for fqn, entry in metadata.state_dict_metadata.items():
            if type(entry) is TensorStorageMetadata:
                dtype = entry.properties.dtype
                # every chunk has its stored entry: checked_metadata refuses a .metadata without
                chunks = tuple(sorted((tuple(c.offsets), tuple(c.sizes), stored[(fqn, tuple(c.offsets))])
                                      for c in entry.chunks))
                self.tensors[fqn] = Loc(fqn, dtype, tuple(entry.size), math.prod(entry.size) * dtype.itemsize,
                                        chunks=chunks)
            elif (fqn, None) in stored:
                self.objects[fqn] = stored[(fqn, None)]
            else:
                path = self.directory / DCP_METADATA
                raise CorruptCheckpointError(f"{path}: {fqn[:200]!r} has no stored bytes", path=path)

    def fd(self, name: str) -> int:
        """``name`` opened in the step's directory: a regular file, never through a symlink."""
        if name not in self._fds:
            path = self.directory / check_file_name(name, where=self.directory)
            try:
                fd = os.open(name, _OPEN_FLAGS, dir_fd=self._dir)
            except FileNotFoundError:
                if name == MANIFEST:
                    raise Moved() from None  # gc emptying the directory we hold
                raise CorruptCheckpointError(f"checkpoint file is missing: {path}", path=path) from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafePathError(f"checkpoint file is a symlink: {path}", path=path) from None
                raise CheckpointReadError(f"cannot open {path}: {exc.strerror}", errno=exc.errno,
                                          path=path) from None
            self._stack.callback(os.close, fd)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CorruptCheckpointError(f"checkpoint file is not a regular file: {path}", path=path)
            self._fds[name] = fd
        return self._fds[name]

    def config(self) -> dict[str, Any]:
        """``config.json`` (``{}`` without one), read through its open descriptor."""
        if CONFIG not in self.manifest.files:
            return {}
        path = self.directory / CONFIG
        with os.fdopen(self.fd(CONFIG), "rb", closefd=False) as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        self.bytes_read += len(raw)
        if len(raw) > MAX_JSON_BYTES:
            raise CorruptCheckpointError(f"{path} is larger than {MAX_JSON_BYTES} bytes", path=path)
        return decode_json_object(raw, path=path)

    def entry(self, file: str) -> FileEntry:
        return self.manifest.files[file]

    def _mapped(self, file: str) -> memoryview:
        if file not in self._maps:
            fd = self.fd(file)
            size = os.fstat(fd).st_size
            if size < self.manifest.files[file].size:  # never map past the end: SIGBUS
                raise CorruptCheckpointError(f"{self.directory / file} is shorter than its manifest says",
                                             path=self.directory / file)
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
            view = memoryview(mapped) if mapped is not None else memoryview(b"")
            if mapped is not None:
                self._stack.callback(mapped.close)
            self._stack.callback(view.release)  # callbacks run last-in first-out: the view goes first
            self._maps[file] = view
        return self._maps[file]

    def span(self, file: str, start: int, end: int) -> memoryview:
        """Bytes ``start..end`` of ``file``, mapped (no copy); counted as read."""
        self.bytes_read += end - start
        return self._mapped(file)[start:end]

    def view(self, loc: Loc, start: int, end: int) -> memoryview:
        """Bytes ``start..end`` of tensor ``loc``: mapped from its file, or of its loaded values (DCP)."""
        if loc.file is not None:
            return self.span(loc.file, loc.offset + start, loc.offset + end)
        return self._loaded[loc.name][start:end]

    def read(self, loc: Loc, start: int, size: int) -> bytearray:
        """Bytes ``start..start+size`` of tensor ``loc``, in a fresh (writable, for torch) buffer."""
        if loc.file is None:
            return bytearray(self._loaded[loc.name][start:start + size])
        buf = bytearray(size)
        got = os.preadv(self.fd(loc.file), [buf], loc.offset + start)
        self.bytes_read += got
        if got != size:
            raise CorruptCheckpointError(f"{self.directory / loc.file} is shorter than its header says",
                                         path=self.directory / loc.file)
        return buf

    def load(self, names: list[str]) -> None:
        """Load the sharded tensors ``names`` (replacing those loaded before), through the restricted reader.

        The reader reads the files this side holds open (mapped copy-on-write,
        as a load maps them), and checks ``.metadata`` against the manifest
        again.
        """
        import torch

        from registry.fs.dcpfiles import full_state
        from registry.fs.mapping import host_view
        self._loaded = {}
        if not names:
            return
        if self._rebuilt is not None:
            for name in names:
                value = self._rebuilt[name].detach().contiguous().reshape(-1)
                self._loaded[name] = host_view(value.view(torch.uint8))
            return
        tensors, _ = full_state(self.directory, self.manifest, self._files(), trust_pickle=False, keys=names)
        self.bytes_read += self._metadata_size + sum(s.length for n in names for *_, s in self.tensors[n].chunks)
        for name in names:
            value = tensors[name].detach().contiguous().reshape(-1)
            self._loaded[name] = host_view(value.view(torch.uint8))

    def _files(self) -> dict[str, torch.Tensor]:
        """``.metadata`` and every data file, mapped copy-on-write from the descriptors opened at the start."""
        import torch
        if self._buffers is None:
            self._buffers = {}
            for name in (DCP_METADATA, *self._data_files):
                fd = self.fd(name)
                size = os.fstat(fd).st_size
                if size < self.manifest.files[name].size:  # never map past the end: SIGBUS
                    raise CorruptCheckpointError(f"{self.directory / name} is shorter than its manifest says",
                                                 path=self.directory / name)
                self._buffers[name] = (torch.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
                                       if size else torch.empty(0, dtype=torch.uint8))
        return self._buffers

    def unload(self) -> None:
        self._loaded = {}


__all__ = ["Loc", "Moved", "Side", "Stored"]
