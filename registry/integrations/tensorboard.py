"""A run's metrics as TensorBoard event files, and TensorBoard scalars as a run's metrics (extra
``checkpoint-registry[tensorboard]``: TensorBoard alone, no TensorFlow).

- :func:`export_tensorboard` writes ``DIR/RUN/events.out.tfevents.registry``: one scalar series per metric key
  with its steps, a ``registry/checkpoint`` scalar of 1 at each live checkpoint's step, and a
  ``registry/step`` text at every step that had a payload (its status, tags and manifest digest), so a
  deleted step still shows where it was. ``tensorboard --logdir DIR`` shows each run by name; exporting
  again replaces the file in one rename.
- :func:`import_tensorboard` reads the scalars of every event file under a directory (TF1 ``simple_value``
  and TF2 scalar tensors alike, as TensorBoard's own reader sees them) and logs them as late metric points;
  a subdirectory's tags are prefixed by its path (``DIR/eval`` gives ``eval/TAG``). A point the run already
  holds at the same value is left alone, so importing twice changes nothing.

TensorBoard keeps scalars as 32-bit floats: an exported value reads back rounded to one, and an import
counts a registry value that rounds to the imported one as already there.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import CheckpointNotFoundError, InvalidStateError, install_hint
from registry.format.refs import METRIC_KEY_RE, check_run_name
from registry.records import CheckpointInfo, MetricPoint, Status

if TYPE_CHECKING:
    from registry.api import Registry

EVENT_FILE = "events.out.tfevents.registry"
CHECKPOINT_TAG = "registry/checkpoint"  # a scalar, 1 at each live checkpoint's step
STEP_TAG = "registry/step"  # a text: what the registry knows of the step
OWN_PREFIX = "registry/"  # the tags an export adds: never imported back as metrics
_MARKED = (Status.PUBLISHED, Status.VERIFIED)
_DESCRIBED = (Status.PUBLISHED, Status.VERIFIED, Status.CORRUPT, Status.DELETED)


@dataclass(frozen=True)
class Exported:
    """What :func:`export_tensorboard` wrote: the file, its metric points and its checkpoint marks."""

    path: Path
    points: int
    checkpoints: int

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "points": self.points, "checkpoints": self.checkpoints}


@dataclass
class Imported:
    """What :func:`import_tensorboard` logged, what the run already held, and what it left out and why."""

    points: int = 0
    unchanged: int = 0
    keys: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # a tag (with its prefix) -> why

    def to_json(self) -> dict[str, Any]:
        return {"points": self.points, "unchanged": self.unchanged, "keys": list(self.keys),
                "skipped": dict(self.skipped)}


def _require() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        from registry.cli.terminal import MissingExtraError
        raise MissingExtraError(f"TensorBoard files need tensorboard: {install_hint('tensorboard')}") from None


def export_tensorboard(reg: Registry, run: str, directory: str | os.PathLike[str], *,
                       key: str | None = None) -> Exported:
    """Write ``run``'s current metric points (of ``key``, or all) and its checkpoints as ``DIR/RUN``'s event file."""
    _require()
    check_run_name(run)
    points = reg.metrics(run, key)
    checkpoints = reg.checkpoints(run, include_deleted=True)
    dest = Path(directory) / run
    dest.mkdir(parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix=".registry-", suffix=".tmp", dir=dest)
    try:
        with os.fdopen(fd, "wb") as f:
            from tensorboard.summary.writer.record_writer import RecordWriter
            writer = RecordWriter(f)
            for event in _events(points, checkpoints):
                writer.write(event.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, dest / EVENT_FILE)
    except BaseException:
        Path(staged).unlink(missing_ok=True)
        raise
    return Exported(dest / EVENT_FILE, len(points), sum(i.status in _MARKED for i in checkpoints))


def _events(points: list[MetricPoint], checkpoints: list[CheckpointInfo]) -> Iterator[Any]:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.compat.proto.types_pb2 import DT_STRING

    def when(info: CheckpointInfo | MetricPoint) -> float:
        stamp = info.created_at if isinstance(info, CheckpointInfo) else info.logged_at
        return stamp.timestamp() if stamp is not None else 0.0

    first = min([when(p) for p in points] + [when(i) for i in checkpoints], default=0.0)
    yield Event(wall_time=first, file_version="brain.Event:2")  # what every TensorBoard event file opens with
    for p in points:
        yield Event(wall_time=when(p), step=p.step, summary=Summary(value=[Summary.Value(
            tag=p.key, simple_value=p.value)]))
    text = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
    for info in checkpoints:
        if info.status in _MARKED:
            yield Event(wall_time=when(info), step=info.step, summary=Summary(value=[Summary.Value(
                tag=CHECKPOINT_TAG, simple_value=1.0)]))
        if info.status in _DESCRIBED:
            line = f"{info.run}@{info.step}: {info.status}" + (f", tags {', '.join(info.tags)}" if info.tags else "") \
                + (f", manifest sha256 {info.manifest_sha256}" if info.manifest_sha256 else "")
            tensor = TensorProto(dtype=DT_STRING, string_val=[line.encode()], tensor_shape=TensorShapeProto())
            yield Event(wall_time=when(info), step=info.step, summary=Summary(value=[Summary.Value(
                tag=STEP_TAG, metadata=text, tensor=tensor)]))


def event_directories(directory: Path) -> list[Path]:
    """Every directory under ``directory`` (itself included) that holds an event file, hidden ones left out."""
    found = []
    for here, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if any("tfevents" in name for name in files):
            found.append(Path(here))
    return found


def read_scalars(directory: Path) -> Iterator[tuple[str, int, float, float]]:
    """``(tag, step, value, wall_time)`` of every scalar of the event files directly in ``directory``, read by
    TensorBoard's own reader (which drops what a restarted writer left orphaned, as TensorBoard shows it)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray
    accumulator = EventAccumulator(str(directory), size_guidance={SCALARS: 0, TENSORS: 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    for tag in tags["scalars"]:
        for event in accumulator.Scalars(tag):
            yield tag, event.step, float(event.value), event.wall_time
    for tag in tags["tensors"]:  # TF2's tf.summary.scalar writes a tensor marked for the scalars plugin
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name != "scalars":
            continue
        for tensor_event in accumulator.Tensors(tag):
            value = make_ndarray(tensor_event.tensor_proto)
            if value.size == 1 and value.dtype.kind in "fiu":
                yield tag, tensor_event.step, float(value.item()), tensor_event.wall_time


def _as_float32(value: float) -> float:
    import numpy as np
    return float(np.float32(value)) if math.isfinite(value) and abs(value) < 3.4e38 else value


def import_tensorboard(reg: Registry, run: str, directory: str | os.PathLike[str], *,
                       key: str | None = None) -> Imported:
    """Log the scalars of the event files under ``directory`` (of one ``key``, or all) as ``run``'s metric
    points, durable when this returns; a point the run holds at the same value is not logged again."""
    _require()
    check_run_name(run)
    root = Path(directory)
    places = event_directories(root) if root.is_dir() else []
    if not places:
        raise InvalidStateError(f"no TensorBoard event files under {root}", path=root)
    latest: dict[tuple[int, str], tuple[float, float]] = {}  # (step, key) -> (wall_time, value): the last wins
    result = Imported()
    for place in places:
        prefix = "" if place == root else place.relative_to(root).as_posix() + "/"
        for tag, step, value, wall_time in read_scalars(place):
            name = prefix + tag
            if tag.startswith(OWN_PREFIX) or (key is not None and name != key):
                continue
            if not METRIC_KEY_RE.fullmatch(name):
                result.skipped[name] = "not a metric key (letters, digits, '_', '.', '/', '-')"
            elif not math.isfinite(value):
                result.skipped.setdefault(name, "a value that is not finite (left out)")
            elif step < 0:
                result.skipped.setdefault(name, "a negative step (left out)")
            elif (step, name) not in latest or wall_time >= latest[(step, name)][0]:
                latest[(step, name)] = (wall_time, value)
    try:
        held = {(p.step, p.key): p.value for p in reg.metrics(run)}
    except CheckpointNotFoundError:  # a run that is not there yet: the import starts it
        held = {}
    by_step: dict[int, dict[str, float]] = {}
    for (step, name), (_, value) in sorted(latest.items()):
        have = held.get((step, name))
        if have is not None and (have == value or _as_float32(have) == value):
            result.unchanged += 1
            continue
        by_step.setdefault(step, {})[name] = value
        result.points += 1
    for step, metrics in by_step.items():
        reg.log_metrics(run, step, metrics)
    if by_step:
        reg.flush(run)
    result.keys = sorted({name for _, name in latest})
    return result


__all__ = ["Exported", "Imported", "event_directories", "export_tensorboard", "import_tensorboard", "read_scalars"]
