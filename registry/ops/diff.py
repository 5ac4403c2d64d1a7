"""What changed between two checkpoints: tensors, files, config and metrics.

Structure comes from the safetensors headers (a few KiB per file): tensors
added, removed, or changed in dtype or shape. Content comes from the
manifests first: two tensors at the same offset of files with the same
``xxh3_128_pieces`` layout are unchanged wherever every piece they cover has
the same digest, so only the bytes of the differing pieces that a tensor
covers are ever read, and a tensor is called changed only when those bytes
really differ (a piece can differ because of its other tensors). A tensor at
another offset (keys reordered by another writer, a tensor added before it),
or in files without pieces, is compared by reading it, in bounded chunks.

``values=True`` measures each change of same-shape tensors (content, or a
cast to another dtype): the
largest absolute difference and the relative L2 change
``||b - a|| / ||a||``, both in float64, streamed in chunks of
:data:`CHUNK` bytes per side, so memory stays bounded whatever the tensor
size (this reads the changed tensors whole).

Each manifest must be the one the catalog recorded, and every file is opened
right after it is checked, so a gc or publish racing the diff can neither
take bytes away nor mix payloads (see :class:`_Side`); no reader lease, and
no catalog write, is needed.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import stat
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import xxhash

from registry.errors import (CheckpointDeletedError, CheckpointReadError, CorruptCheckpointError, UnsafePathError)
from registry.format.manifest import (CONFIG, MANIFEST, MAX_JSON_BYTES, MAX_MANIFEST_BYTES, FileEntry, Manifest,
                                      check_file_name, decode_json_object, digest_bytes, parse_manifest)
from registry.format.safetensors import read_safetensors_header
from registry.ops.reading import Access
from registry.records import HAS_PAYLOAD, CheckpointInfo

CHUNK = 8 << 20  # bytes read per side at a time while comparing or measuring


@dataclass(frozen=True, kw_only=True)
class TensorChange:
    """One tensor that differs: ``change`` is ``added``, ``removed``, ``dtype``, ``shape`` or ``content``."""

    name: str
    change: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    max_abs_diff: float | None = None   # with values=True, for content changes
    rel_l2: float | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "change": self.change}
        for key in ("dtype_a", "dtype_b", "shape_a", "shape_b", "max_abs_diff", "rel_l2"):
            value = getattr(self, key)
            if value is not None:
                doc[key] = list(value) if isinstance(value, tuple) else value
        return doc


@dataclass(frozen=True, kw_only=True)
class Change:
    """A file or config entry that differs (``added``, ``removed`` or ``changed``), with both values."""

    key: str
    change: str
    a: Any = None
    b: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "change": self.change, "a": self.a, "b": self.b}


@dataclass(frozen=True, kw_only=True)
class CheckpointDiff:
    """What changed from ``a`` to ``b``. ``bytes_read`` counts every byte read (headers included)."""

    a: CheckpointInfo
    b: CheckpointInfo
    tensors: tuple[TensorChange, ...]
    unchanged_tensors: int
    files: tuple[Change, ...]
    config: tuple[Change, ...]
    metrics: tuple[Change, ...]
    bytes_read: int
    bytes_total: int      # both payloads together
    values: bool = False

    def of(self, change: str) -> tuple[TensorChange, ...]:
        return tuple(t for t in self.tensors if t.change == change)

    @property
    def identical(self) -> bool:
        """No tensor, config or metric differs (files such as ``meta.json`` always carry a timestamp)."""
        return not (self.tensors or self.config or self.metrics)

    def to_json(self) -> dict[str, Any]:
        return {"a": f"{self.a.run}@{self.a.step}", "b": f"{self.b.run}@{self.b.step}",
                "identical": self.identical, "values": self.values,
                "tensors": {kind: [t.to_json() for t in self.of(kind)]
                            for kind in ("added", "removed", "dtype", "shape", "content")},
                "unchanged_tensors": self.unchanged_tensors,
                "files": [c.to_json() for c in self.files], "config": [c.to_json() for c in self.config],
                "metrics": [c.to_json() for c in self.metrics],
                "bytes_read": self.bytes_read, "bytes_total": self.bytes_total}


@dataclass(frozen=True)
class _Loc:
    file: str
    dtype: Any          # torch.dtype
    shape: tuple[int, ...]
    offset: int         # of its first byte in the file
    nbytes: int


class _Moved(Exception):
    """The step's directory or manifest is not the one its catalog row described a moment ago."""


_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0))


class _Side:
    """One checkpoint being compared: its manifest, tensor locations and open files, counting bytes read.

    Every file it will read is opened here, relative to one descriptor of the
    directory, right after the manifest read through it matched the catalog:
    from then on the bytes cannot go away (a deleted file stays readable
    through an open descriptor), so no reader lease is taken. A directory
    that vanished or holds another manifest by then raises :class:`_Moved`.
    """

    def __init__(self, info: CheckpointInfo, stack: ExitStack) -> None:
        self.info = info
        self.directory = Path(info.path)
        self._stack = stack
        self._fds: dict[str, int] = {}
        self._maps: dict[str, memoryview] = {}
        self.bytes_read = 0
        try:
            self._dir = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                                | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise _Moved() from None
        except OSError as exc:
            raise CheckpointReadError(f"cannot open {self.directory}: {exc.strerror}", errno=exc.errno,
                                      path=self.directory) from None
        stack.callback(os.close, self._dir)
        with os.fdopen(self.fd(MANIFEST), "rb", closefd=False) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        if info.manifest_sha256 and digest_bytes(raw) != info.manifest_sha256:
            raise _Moved()
        self.manifest = parse_manifest(raw, path=self.directory / MANIFEST)
        wanted = [n for n in sorted(self.manifest.files) if n.endswith(".safetensors") or n == CONFIG]
        for name in wanted:
            self.fd(name)
        self.tensors: dict[str, _Loc] = {}
        for name in wanted:
            if name.endswith(".safetensors"):
                fd = self.fd(name)
                with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                    header = read_safetensors_header(f, self.manifest.files[name].size, self.directory / name)
                self.bytes_read += header.data_start
                for e in header.entries:
                    self.tensors.setdefault(e.name, _Loc(name, e.dtype, e.shape, header.data_start + e.begin,
                                                         e.end - e.begin))

    def fd(self, name: str) -> int:
        """``name`` opened in the step's directory: a regular file, never through a symlink."""
        if name not in self._fds:
            path = self.directory / check_file_name(name, where=self.directory)
            try:
                fd = os.open(name, _OPEN_FLAGS, dir_fd=self._dir)
            except FileNotFoundError:
                if name == MANIFEST:
                    raise _Moved() from None  # gc emptying the directory we hold
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

    def read(self, loc: _Loc, start: int, size: int) -> bytearray:
        """Bytes ``start..start+size`` of tensor ``loc``, in a fresh (writable, for torch) buffer."""
        buf = bytearray(size)
        got = os.preadv(self.fd(loc.file), [buf], loc.offset + start)
        self.bytes_read += got
        if got != size:
            raise CorruptCheckpointError(f"{self.directory / loc.file} is shorter than its header says",
                                         path=self.directory / loc.file)
        return buf

    def view(self, loc: _Loc, start: int, end: int) -> memoryview:
        """Bytes ``start..end`` of tensor ``loc``, mapped (no copy); counted as read."""
        if loc.file not in self._maps:
            fd = self.fd(loc.file)
            size = os.fstat(fd).st_size
            if size < self.manifest.files[loc.file].size:  # never map past the end: SIGBUS
                raise CorruptCheckpointError(f"{self.directory / loc.file} is shorter than its manifest says",
                                             path=self.directory / loc.file)
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
            view = memoryview(mapped) if mapped is not None else memoryview(b"")
            if mapped is not None:
                self._stack.callback(mapped.close)
            self._stack.callback(view.release)  # callbacks run last-in first-out: the view goes first
            self._maps[loc.file] = view
        self.bytes_read += end - start
        return self._maps[loc.file][loc.offset + start:loc.offset + end]

    def entry(self, loc: _Loc) -> FileEntry:
        return self.manifest.files[loc.file]


def _suspect(a: _Side, la: _Loc, b: _Side, lb: _Loc) -> list[tuple[int, int]]:
    """Byte ranges of the tensor (relative to its start) that may differ; empty when none can."""
    fa, fb = a.entry(la), b.entry(lb)
    if la.offset == lb.offset and fa.sha256 == fb.sha256 and fa.size == fb.size:
        return []  # the same file bytes: the same tensor bytes
    n = la.nbytes
    ps = fa.piece_size
    if (la.offset != lb.offset or ps is None or ps != fb.piece_size or fa.xxh3_128_pieces is None
            or fb.xxh3_128_pieces is None):
        return [(0, n)] if n else []
    ranges: list[tuple[int, int]] = []
    for i in range(la.offset // ps, (la.offset + n - 1) // ps + 1) if n else ():
        same = (i < len(fa.xxh3_128_pieces) and i < len(fb.xxh3_128_pieces)
                and fa.xxh3_128_pieces[i] == fb.xxh3_128_pieces[i])
        if same:
            continue
        lo, hi = max(i * ps, la.offset) - la.offset, min((i + 1) * ps, la.offset + n) - la.offset
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges


def _chunks(start: int, end: int, step: int) -> Iterator[tuple[int, int]]:
    while start < end:
        yield start, min(end, start + step)
        start += step


def _bytes_differ(a: _Side, la: _Loc, b: _Side, lb: _Loc, ranges: list[tuple[int, int]]) -> bool:
    """Whether the tensor's bytes in ``ranges`` differ: their xxh3-128 digests, over the mapped files.

    The same digest the manifest's pieces use (an equal piece digest already
    counts as equal bytes); hashing mapped pages runs at memory speed, where
    comparing copies would first have to copy.
    """
    for lo, hi in ranges:
        for s, e in _chunks(lo, hi, CHUNK):
            va, vb = a.view(la, s, e), b.view(lb, s, e)
            try:
                if xxhash.xxh3_128_digest(va) != xxhash.xxh3_128_digest(vb):
                    return True
            finally:
                va.release()
                vb.release()
    return False


def _measure(a: _Side, la: _Loc, b: _Side, lb: _Loc) -> tuple[float | None, float | None]:
    """Max |b - a| and ||b - a|| / ||a|| over the whole tensor, in float64, streamed.

    The two dtypes may differ (a cast): elements are compared as numbers.
    None when one side is complex and the other is not.
    """
    import torch
    if la.dtype.is_complex != lb.dtype.is_complex:
        return None, None
    ia, ib = la.dtype.itemsize, lb.dtype.itemsize
    count = la.nbytes // ia
    max_abs, diff_sq, base_sq = 0.0, 0.0, 0.0
    for s, e in _chunks(0, count, max(1, CHUNK // max(ia, ib))):
        ta = torch.frombuffer(a.read(la, s * ia, (e - s) * ia), dtype=la.dtype)
        tb = torch.frombuffer(b.read(lb, s * ib, (e - s) * ib), dtype=lb.dtype)
        if ta.dtype.is_complex:
            ta, tb = torch.view_as_real(ta), torch.view_as_real(tb)
        xa, xb = ta.to(torch.float64), tb.to(torch.float64)
        d = xb - xa
        if d.numel():
            max_abs = max(max_abs, float(d.abs().max()))
            diff_sq += float((d * d).sum())
            base_sq += float((xa * xa).sum())
    rel = math.sqrt(diff_sq) / math.sqrt(base_sq) if base_sq > 0 else (0.0 if diff_sq == 0 else math.inf)
    return max_abs, rel


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_changes(a: _Side, b: _Side, *, values: bool) -> tuple[list[TensorChange], int]:
    changes: list[TensorChange] = []
    unchanged = 0
    for name in sorted(a.tensors.keys() | b.tensors.keys()):
        la, lb = a.tensors.get(name), b.tensors.get(name)
        if lb is None:
            assert la is not None
            changes.append(TensorChange(name=name, change="removed", dtype_a=_dtype_name(la.dtype), shape_a=la.shape))
        elif la is None:
            changes.append(TensorChange(name=name, change="added", dtype_b=_dtype_name(lb.dtype), shape_b=lb.shape))
        elif la.dtype != lb.dtype or la.shape != lb.shape:
            measured = (_measure(a, la, b, lb) if values and la.shape == lb.shape and la.nbytes
                        else (None, None))  # a cast keeps the shape: how far did it move the values?
            changes.append(TensorChange(name=name, change="dtype" if la.dtype != lb.dtype else "shape",
                                        dtype_a=_dtype_name(la.dtype), dtype_b=_dtype_name(lb.dtype),
                                        shape_a=la.shape, shape_b=lb.shape,
                                        max_abs_diff=measured[0], rel_l2=measured[1]))
        elif _bytes_differ(a, la, b, lb, _suspect(a, la, b, lb)):
            measured = _measure(a, la, b, lb) if values else (None, None)
            changes.append(TensorChange(name=name, change="content", dtype_a=_dtype_name(la.dtype),
                                        dtype_b=_dtype_name(lb.dtype), shape_a=la.shape, shape_b=lb.shape,
                                        max_abs_diff=measured[0], rel_l2=measured[1]))
        else:
            unchanged += 1
    return changes, unchanged


def _file_changes(a: Manifest, b: Manifest) -> list[Change]:
    out = []
    for name in sorted(a.files.keys() | b.files.keys()):
        fa, fb = a.files.get(name), b.files.get(name)
        if name == MANIFEST or (fa is not None and fb is not None and fa.sha256 == fb.sha256
                                and fa.size == fb.size):
            continue
        change = "added" if fa is None else "removed" if fb is None else "changed"
        out.append(Change(key=name, change=change, a=fa.size if fa is not None else None,
                          b=fb.size if fb is not None else None))
    return out


def json_diff(a: Any, b: Any, path: str = "") -> list[Change]:
    """Every difference between two JSON documents, keyed by a path like ``optim.betas[1]``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[Change] = []
        for key in sorted(a.keys() | b.keys(), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in b:
                out.append(Change(key=sub, change="removed", a=a[key]))
            elif key not in a:
                out.append(Change(key=sub, change="added", b=b[key]))
            else:
                out.extend(json_diff(a[key], b[key], sub))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [c for i, (x, y) in enumerate(zip(a, b)) for c in json_diff(x, y, f"{path}[{i}]")]
    if type(a) is not type(b) or a != b:
        return [Change(key=path or "$", change="changed", a=a, b=b)]
    return []


def _metric_changes(a: CheckpointInfo, b: CheckpointInfo) -> list[Change]:
    out = []
    for key in sorted(a.metrics.keys() | b.metrics.keys()):
        va, vb = a.metrics.get(key), b.metrics.get(key)
        if va != vb:
            change = "added" if va is None else "removed" if vb is None else "changed"
            out.append(Change(key=key, change=change, a=va, b=vb))
    return out


MAX_RACES = 8  # re-reads of a row that a publish or gc changed while it was being opened


def _refreshed(access: Access, info: CheckpointInfo) -> CheckpointInfo:
    """``info`` as the catalog has it now, after its directory did not match it.

    The same payload still listed: its directory really is missing or holds
    another manifest (a read or corruption problem, said as a load says it);
    a deleted step: ``CheckpointDeletedError``; a replaced one: the new row.
    """
    now = access.catalog.get(info.run, info.step)
    where = f"{info.run}@{info.step}"
    if now is None or now.status not in HAS_PAYLOAD:
        raise CheckpointDeletedError(f"{where} was deleted while being compared", run=info.run, step=info.step)
    if now.manifest_sha256 == info.manifest_sha256:
        if not Path(info.path).is_dir():
            raise CheckpointReadError(f"cannot read {where}: its directory {info.path} is missing although the "
                                      f"catalog lists it as {now.status}; run 'registry fsck'", path=info.path,
                                      run=info.run, step=info.step)
        raise CorruptCheckpointError(f"manifest of {info.path} does not match the catalog's record",
                                     path=info.path, run=info.run, step=info.step)
    return replace(now, path=access.root / now.path)


def diff_checkpoints(access: Access, a: CheckpointInfo, b: CheckpointInfo, *, values: bool = False) -> CheckpointDiff:
    """Compare two resolved checkpoints (absolute paths); see the module docstring and :class:`_Side`."""
    for _ in range(MAX_RACES):
        with ExitStack() as stack:
            try:
                side_a = _Side(a, stack)
            except _Moved:
                a = _refreshed(access, a)
                continue
            try:
                side_b = _Side(b, stack)
            except _Moved:
                b = _refreshed(access, b)
                continue
            tensors, unchanged = _tensor_changes(side_a, side_b, values=values)
            config = json_diff(side_a.config(), side_b.config())
            return CheckpointDiff(
                a=a, b=b, tensors=tuple(tensors), unchanged_tensors=unchanged,
                files=tuple(_file_changes(side_a.manifest, side_b.manifest)), config=tuple(config),
                metrics=tuple(_metric_changes(a, b)), bytes_read=side_a.bytes_read + side_b.bytes_read,
                bytes_total=side_a.manifest.total_bytes + side_b.manifest.total_bytes, values=values)
    raise CheckpointDeletedError(f"{a.run}@{a.step} or {b.run}@{b.step} kept changing while being compared",
                                 run=a.run, step=a.step)


def render(diff: CheckpointDiff) -> Iterator[str]:
    """The diff as the CLI prints it."""
    yield f"{diff.a.run}@{diff.a.step} -> {diff.b.run}@{diff.b.step}"
    for t in diff.tensors:
        size = "" if t.max_abs_diff is None else f"  max|d|={t.max_abs_diff:.6g} rel_l2={t.rel_l2:.6g}"
        if t.change == "added":
            yield f"  + {t.name}  {t.dtype_b} {list(t.shape_b or ())}"
        elif t.change == "removed":
            yield f"  - {t.name}  {t.dtype_a} {list(t.shape_a or ())}"
        elif t.change in ("dtype", "shape"):
            yield (f"  ~ {t.name}  {t.change}: {t.dtype_a} {list(t.shape_a or ())} -> "
                   f"{t.dtype_b} {list(t.shape_b or ())}{size}")
        else:
            yield f"  * {t.name}  content{size}"
    yield f"  {diff.unchanged_tensors} tensors unchanged"
    for c in diff.files:
        yield f"  file {c.change}: {c.key} ({c.a} -> {c.b} bytes)"
    for c in diff.config:
        yield f"  config {c.change}: {c.key}: {json.dumps(c.a)} -> {json.dumps(c.b)}"
    for c in diff.metrics:
        yield f"  metric {c.change}: {c.key}: {c.a} -> {c.b}"
    pct = 100.0 * diff.bytes_read / diff.bytes_total if diff.bytes_total else 0.0
    yield f"  read {diff.bytes_read} of {diff.bytes_total} bytes ({pct:.2f}%)"


__all__ = ["CHUNK", "Change", "CheckpointDiff", "TensorChange", "diff_checkpoints", "json_diff", "render"]
