"""What changed between two checkpoints: tensors, non-tensor values, files, config and metrics.

Structure comes from the safetensors headers (a few KiB per file) or, for a
sharded (DCP) step, from its ``.metadata``, sha-checked against the manifest
and read by the restricted unpickler: tensors added, removed, or changed in
dtype or shape, by flat key (a sharded step's keys are DCP's flattened ones,
``model.layers.0.weight``, as a load of it returns them), so a sharded step
and a full one compare key by key. Content comes from the manifests first:
two tensors at the same offset of files with the same ``xxh3_128_pieces``
layout are unchanged wherever every piece they cover has the same digest, so
only the bytes of the differing pieces that a tensor covers are ever read, and
a tensor is called changed only when those bytes really differ (a piece can
differ because of its other tensors). A tensor at another offset (keys
reordered by another writer, a tensor added before it), or in files without
pieces, is compared by reading it, in bounded chunks.

Two sharded steps compare their stored chunks the same way (pieces, then the
chunks' bytes). Where chunks are laid out differently, their bytes differ, or
one side is a full step, the sharded tensors are loaded through the
restricted DCP reader (whole, :data:`LOAD_BATCH` bytes per side at a time)
and their values' bytes compared. A sharded step's non-tensor values
(``optim.param_groups.0.lr``) are compared by their stored bytes; against a
full step's pickled extras they cannot be matched by key, and the diff says
they were not compared (``not_compared``) rather than calling the steps
identical. Nothing is called identical that was not compared.

``values=True`` measures each change of same-shape tensors (content, or a
cast to another dtype): the
largest absolute difference and the relative L2 change
``||b - a|| / ||a||``, both in float64, streamed in chunks of
:data:`CHUNK` bytes per side, so memory stays bounded whatever the tensor
size (this reads the changed tensors whole).

Each manifest must be the one the catalog recorded, and every file is opened
right after it is checked, so a gc or publish racing the diff can neither
take bytes away nor mix payloads (see :class:`~registry.ops.diffread.Side`);
no reader lease, and no catalog write, is needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from registry.errors import CheckpointDeletedError, CheckpointReadError
from registry.format.manifest import MANIFEST, FileEntry, Manifest
from registry.ops.diffread import Loc, Moved, Side, Stored
from registry.ops.reading import Access, check_digest, read_step
from registry.records import HAS_PAYLOAD, CheckpointInfo

CHUNK = 8 << 20  # bytes read per side at a time while comparing or measuring
LOAD_BATCH = 1 << 30  # bytes of sharded tensors loaded per side at a time (a larger tensor is loaded alone)


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
class NotCompared:
    """A part of the two steps that the diff could not compare, and why: the steps are not known identical."""

    what: str
    why: str

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "why": self.why}


@dataclass(frozen=True, kw_only=True)
class CheckpointDiff:
    """What changed from ``a`` to ``b``. ``bytes_read`` counts every byte read (headers included).

    ``objects`` are a sharded step's non-tensor values (``added``, ``removed``
    or ``changed``, by flat key, compared as stored); ``not_compared`` what
    could not be compared at all.
    """

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
    objects: tuple[Change, ...] = ()
    unchanged_objects: int = 0
    not_compared: tuple[NotCompared, ...] = ()

    def of(self, change: str) -> tuple[TensorChange, ...]:
        return tuple(t for t in self.tensors if t.change == change)

    @property
    def identical(self) -> bool:
        """Everything was compared and no tensor, non-tensor value, config or metric differs.

        Files are not counted: ``meta.json`` always carries a timestamp.
        """
        return not (self.tensors or self.objects or self.config or self.metrics or self.not_compared)

    def to_json(self) -> dict[str, Any]:
        return {"a": f"{self.a.run}@{self.a.step}", "b": f"{self.b.run}@{self.b.step}",
                "identical": self.identical, "values": self.values,
                "tensors": {kind: [t.to_json() for t in self.of(kind)]
                            for kind in ("added", "removed", "dtype", "shape", "content")},
                "unchanged_tensors": self.unchanged_tensors,
                "objects": [c.to_json() for c in self.objects], "unchanged_objects": self.unchanged_objects,
                "not_compared": [n.to_json() for n in self.not_compared],
                "files": [c.to_json() for c in self.files], "config": [c.to_json() for c in self.config],
                "metrics": [c.to_json() for c in self.metrics],
                "bytes_read": self.bytes_read, "bytes_total": self.bytes_total}


def _suspect(fa: FileEntry, oa: int, fb: FileEntry, ob: int, n: int) -> list[tuple[int, int]]:
    """Byte ranges of ``n`` bytes at ``oa`` of file ``fa`` and ``ob`` of ``fb`` (relative to them) that may
    differ; empty when none can."""
    if oa == ob and fa.sha256 == fb.sha256 and fa.size == fb.size:
        return []  # the same file bytes: the same bytes at the same offset
    ps = fa.piece_size
    if (oa != ob or ps is None or ps != fb.piece_size or fa.xxh3_128_pieces is None
            or fb.xxh3_128_pieces is None):
        return [(0, n)] if n else []
    ranges: list[tuple[int, int]] = []
    for i in range(oa // ps, (oa + n - 1) // ps + 1) if n else ():
        same = (i < len(fa.xxh3_128_pieces) and i < len(fb.xxh3_128_pieces)
                and fa.xxh3_128_pieces[i] == fb.xxh3_128_pieces[i])
        if same:
            continue
        lo, hi = max(i * ps, oa) - oa, min((i + 1) * ps, oa + n) - oa
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges


def _whole_piece_differs(fa: FileEntry, oa: int, fb: FileEntry, ob: int, n: int) -> bool:
    """Whether a piece lying wholly inside the ``n`` bytes has another digest: then those bytes differ, unread."""
    ps = fa.piece_size
    pa, pb = fa.xxh3_128_pieces, fb.xxh3_128_pieces
    if oa != ob or ps is None or ps != fb.piece_size or pa is None or pb is None:
        return False
    return any(i < len(pa) and i < len(pb) and pa[i] != pb[i] for i in range(-(-oa // ps), (oa + n) // ps))


def _chunks(start: int, end: int, step: int) -> Iterator[tuple[int, int]]:
    while start < end:
        yield start, min(end, start + step)
        start += step


View = Callable[[int, int], memoryview]


def _differ(view_a: View, view_b: View, ranges: list[tuple[int, int]]) -> bool:
    """Whether the bytes in ``ranges`` differ: their xxh3-128 digests, over the mapped files or loaded values.

    The same digest the manifest's pieces use (an equal piece digest already
    counts as equal bytes); hashing mapped pages runs at memory speed, where
    comparing copies would first have to copy.
    """
    for lo, hi in ranges:
        for s, e in _chunks(lo, hi, CHUNK):
            va, vb = view_a(s, e), view_b(s, e)
            try:
                if xxhash.xxh3_128_digest(va) != xxhash.xxh3_128_digest(vb):
                    return True
            finally:
                va.release()
                vb.release()
    return False


def _tensor_view(side: Side, loc: Loc) -> View:
    return lambda s, e: side.view(loc, s, e)


def _stored_view(side: Side, stored: Stored) -> View:
    return lambda s, e: side.span(stored.file, stored.offset + s, stored.offset + e)


def _same_stored(a: Side, sa: Stored, b: Side, sb: Stored) -> bool:
    """Whether two DCP records hold the same bytes: piece digests first, then the bytes of the rest."""
    fa, fb = a.entry(sa.file), b.entry(sb.file)
    if (sa.length != sb.length or sa.transforms != sb.transforms
            or _whole_piece_differs(fa, sa.offset, fb, sb.offset, sa.length)):
        return False
    ranges = _suspect(fa, sa.offset, fb, sb.offset, sa.length)
    return not _differ(_stored_view(a, sa), _stored_view(b, sb), ranges)


def _same_chunks(a: Side, la: Loc, b: Side, lb: Loc) -> bool:
    """Whether two sharded tensors are stored as the same chunks with the same bytes (then their values are)."""
    if [c[:2] for c in la.chunks] != [c[:2] for c in lb.chunks] or not (la.chunks or lb.chunks):
        return False  # no chunks: values only loaded (a delta step's), compared as such
    return all(_same_stored(a, x[2], b, y[2]) for x, y in zip(la.chunks, lb.chunks))


def _measure(a: Side, la: Loc, b: Side, lb: Loc) -> tuple[float | None, float | None]:
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


def _changed(la: Loc, lb: Loc, change: str, measured: tuple[float | None, float | None]) -> TensorChange:
    return TensorChange(name=la.name, change=change, dtype_a=_dtype_name(la.dtype), dtype_b=_dtype_name(lb.dtype),
                        shape_a=la.shape, shape_b=lb.shape, max_abs_diff=measured[0], rel_l2=measured[1])


def _recast(la: Loc, lb: Loc) -> str | None:
    """``dtype`` or ``shape`` when the structure changed, else None."""
    return "dtype" if la.dtype != lb.dtype else "shape" if la.shape != lb.shape else None


def _tensor_changes(a: Side, b: Side, *, values: bool) -> tuple[list[TensorChange], int]:
    found: dict[str, TensorChange] = {}
    unchanged = 0
    pending: list[str] = []  # decided (or measured) only from values that have to be read or loaded first
    for name in sorted(a.tensors.keys() | b.tensors.keys()):
        la, lb = a.tensors.get(name), b.tensors.get(name)
        if lb is None:
            assert la is not None
            found[name] = TensorChange(name=name, change="removed", dtype_a=_dtype_name(la.dtype), shape_a=la.shape)
        elif la is None:
            found[name] = TensorChange(name=name, change="added", dtype_b=_dtype_name(lb.dtype), shape_b=lb.shape)
        elif (kind := _recast(la, lb)) is not None:
            if values and la.shape == lb.shape and la.nbytes:  # a cast keeps the shape: how far did it move?
                pending.append(name)
            else:
                found[name] = _changed(la, lb, kind, (None, None))
        elif la.file is not None and lb.file is not None:
            fa, fb = a.entry(la.file), b.entry(lb.file)
            if (_whole_piece_differs(fa, la.offset, fb, lb.offset, la.nbytes)
                    or _differ(_tensor_view(a, la), _tensor_view(b, lb),
                               _suspect(fa, la.offset, fb, lb.offset, la.nbytes))):
                found[name] = _changed(la, lb, "content", _measure(a, la, b, lb) if values else (None, None))
            else:
                unchanged += 1
        elif la.file is None and lb.file is None and _same_chunks(a, la, b, lb):
            unchanged += 1
        else:
            pending.append(name)
    for batch in _batches(pending, a, b):
        for side in (a, b):
            side.load([n for n in batch if side.tensors[n].file is None])
        for name in batch:
            la, lb = a.tensors[name], b.tensors[name]
            kind = _recast(la, lb)
            if kind is not None:
                found[name] = _changed(la, lb, kind, _measure(a, la, b, lb))
            elif _differ(_tensor_view(a, la), _tensor_view(b, lb), [(0, la.nbytes)] if la.nbytes else []):
                found[name] = _changed(la, lb, "content", _measure(a, la, b, lb) if values else (None, None))
            else:
                unchanged += 1
        for side in (a, b):
            side.unload()
    return [found[n] for n in sorted(found)], unchanged


def _batches(names: list[str], a: Side, b: Side) -> Iterator[list[str]]:
    """``names`` in groups whose sharded tensors hold at most :data:`LOAD_BATCH` bytes on each side."""
    batch: list[str] = []
    size = 0
    for name in names:
        cost = max(loc.nbytes if loc.file is None else 0 for loc in (a.tensors[name], b.tensors[name]))
        if batch and size + cost > LOAD_BATCH:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += cost
    if batch:
        yield batch


def _object_changes(a: Side, b: Side) -> tuple[list[Change], int, list[NotCompared]]:
    """Non-tensor values by flat key, compared as stored; against pickled extras, not compared."""
    for side, other in ((a, b), (b, a)):
        if side.objects and not other.sharded and other.extras:
            keys = sorted(side.objects)
            shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
            return [], 0, [NotCompared(
                what="non-tensor values",
                why=f"{side.label} keeps them by key ({shown}), {other.label} in pickled extras "
                    f"({', '.join(other.extras)}), which diff does not unpickle")]
    changes: list[Change] = []
    same = 0
    for key in sorted(a.objects.keys() | b.objects.keys()):
        sa, sb = a.objects.get(key), b.objects.get(key)
        if sa is None or sb is None:
            changes.append(Change(key=key, change="added" if sa is None else "removed"))
        elif _same_stored(a, sa, b, sb):
            same += 1
        else:
            changes.append(Change(key=key, change="changed"))
    return changes, same, []


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
        check_digest(info, None)  # the same payload listed, another manifest (or none) on disk
    return now.under(access.root)


def _rebuilder(access: Access, info: CheckpointInfo) -> Callable[[], Any]:
    """How a side that is a policy delta step gets its tensors: read through the one reader, chain rebuilt."""
    return lambda: read_step(access, info, verify=True, map_location="cpu", trust_pickle=False,
                             extras=False).state_dict


def diff_checkpoints(access: Access, a: CheckpointInfo, b: CheckpointInfo, *, values: bool = False) -> CheckpointDiff:
    """Compare two resolved checkpoints (absolute paths); see the module docstring and :class:`Side`."""
    for _ in range(MAX_RACES):
        with ExitStack() as stack:
            try:
                side_a = Side(a, stack, rebuild=_rebuilder(access, a))
            except Moved:
                a = _refreshed(access, a)
                continue
            try:
                side_b = Side(b, stack, rebuild=_rebuilder(access, b))
            except Moved:
                b = _refreshed(access, b)
                continue
            tensors, unchanged = _tensor_changes(side_a, side_b, values=values)
            objects, same_objects, not_compared = _object_changes(side_a, side_b)
            config = json_diff(side_a.config(), side_b.config())
            return CheckpointDiff(
                a=a, b=b, tensors=tuple(tensors), unchanged_tensors=unchanged, objects=tuple(objects),
                unchanged_objects=same_objects, not_compared=tuple(not_compared),
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
    for c in diff.objects:
        yield f"  value {c.change}: {c.key}"
    if diff.objects or diff.unchanged_objects:
        yield f"  {diff.unchanged_objects} non-tensor values unchanged"
    for n in diff.not_compared:
        yield f"  not compared: {n.what}: {n.why}"
    for c in diff.files:
        yield f"  file {c.change}: {c.key} ({c.a} -> {c.b} bytes)"
    for c in diff.config:
        yield f"  config {c.change}: {c.key}: {json.dumps(c.a)} -> {json.dumps(c.b)}"
    for c in diff.metrics:
        yield f"  metric {c.change}: {c.key}: {c.a} -> {c.b}"
    pct = 100.0 * diff.bytes_read / diff.bytes_total if diff.bytes_total else 0.0
    yield f"  read {diff.bytes_read} of {diff.bytes_total} bytes ({pct:.2f}%)"


__all__ = ["CHUNK", "LOAD_BATCH", "Change", "CheckpointDiff", "NotCompared", "TensorChange", "diff_checkpoints",
           "json_diff", "render"]
