"""TensorBoard event files: a run's metrics written for TensorBoard and read back by TensorBoard's own reader, and
event files written by TensorBoard's own writer imported as late metrics. Without tensorboard the tests skip,
saying so; with ``CI=true`` that is a failure instead."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from registry import Registry
from registry.retention import KeepLast
from tests.helpers import IN_CI, make_state

try:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.compat.proto.types_pb2 import DT_FLOAT
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from tensorboard.util.tensor_util import make_ndarray
except ImportError as exc:
    if IN_CI:
        raise RuntimeError(f"the TensorBoard tests must run in CI: tensorboard not installed ({exc})") from exc
    pytest.skip(f"tensorboard not installed ({exc}); the TensorBoard tests skipped", allow_module_level=True)


def f32(value: float) -> float:
    return float(np.float32(value))


def accumulator(directory: Path) -> Any:
    reader = EventAccumulator(str(directory), size_guidance={SCALARS: 0, TENSORS: 0})
    reader.Reload()
    return reader


def scalars(reader: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in reader.Scalars(tag)]


def publish_run(reg: Registry, run: str) -> None:
    for step, loss in ((100, 0.9), (200, 0.4), (300, 0.6)):
        reg.publish(run, step, make_state(step), metrics={"eval/loss": loss, "train/loss": 1.0 / 3 / step})
    reg.log_metrics(run, 150, {"train/loss": 0.1}, flush=True)
    reg.tag(run, 300, "release")


def test_an_export_reads_back_with_tensorboards_reader(reg: Registry, tmp_path: Path) -> None:
    from registry.integrations.tensorboard import export_tensorboard
    publish_run(reg, "demo")
    assert reg.apply_retention("demo", KeepLast(2)).deleted == (100,)
    written = export_tensorboard(reg, "demo", tmp_path / "tb")
    assert written.path == tmp_path / "tb" / "demo" / "events.out.tfevents.registry"
    assert (written.points, written.checkpoints) == (7, 2)

    reader = accumulator(tmp_path / "tb" / "demo")
    assert set(reader.Tags()["scalars"]) == {"eval/loss", "train/loss", "registry/checkpoint"}
    for key in ("eval/loss", "train/loss"):
        assert scalars(reader, key) == [(p.step, f32(p.value)) for p in reg.metrics("demo", key)]
    assert scalars(reader, "registry/checkpoint") == [(200, 1.0), (300, 1.0)]  # live checkpoints only
    texts = {e.step: make_ndarray(e.tensor_proto).item().decode() for e in reader.Tensors("registry/step")}
    assert sorted(texts) == [100, 200, 300]
    assert texts[100].startswith("demo@100: deleted")
    assert texts[300].startswith("demo@300: verified, tags release, manifest sha256 ")

    reg.log_metrics("demo", 300, {"eval/accuracy": 0.5}, flush=True)
    again = export_tensorboard(reg, "demo", tmp_path / "tb", key="eval/accuracy")
    assert again.points == 1
    assert sorted(p.name for p in (tmp_path / "tb" / "demo").iterdir()) == ["events.out.tfevents.registry"]
    reader = accumulator(tmp_path / "tb" / "demo")  # the file was replaced, not appended to
    assert set(reader.Tags()["scalars"]) == {"eval/accuracy", "registry/checkpoint"}
    assert scalars(reader, "eval/accuracy") == [(300, 0.5)]


def write_foreign_events(directory: Path) -> None:
    """Event files as a trainer's TensorBoard logger writes them: TF1 scalars, a TF2 scalar tensor, an eval
    subdirectory, a NaN, a tag that is no metric key, and one step written twice (the later one counts)."""
    base = time.time()
    train = EventFileWriter(str(directory))
    for i, step in enumerate((100, 200, 300)):
        train.add_event(Event(wall_time=base + i, step=step, summary=Summary(value=[
            Summary.Value(tag="loss", simple_value=1.0 / step), Summary.Value(tag="lr rate", simple_value=0.1)])))
    train.add_event(Event(wall_time=base + 5, step=300, summary=Summary(value=[
        Summary.Value(tag="loss", simple_value=0.25)])))
    train.add_event(Event(wall_time=base + 6, step=400, summary=Summary(value=[
        Summary.Value(tag="loss", simple_value=math.nan)])))
    train.close()
    evaluation = EventFileWriter(str(directory / "eval"))
    scalar_plugin = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))
    for i, (step, accuracy) in enumerate(((100, 0.5), (200, 0.8), (300, 0.7))):
        tensor = TensorProto(dtype=DT_FLOAT, float_val=[accuracy], tensor_shape=TensorShapeProto())
        evaluation.add_event(Event(wall_time=base + i, step=step, summary=Summary(value=[
            Summary.Value(tag="accuracy", metadata=scalar_plugin, tensor=tensor)])))
    evaluation.close()


def test_an_import_logs_tensorboard_scalars_as_late_metrics(reg: Registry, tmp_path: Path) -> None:
    from registry.integrations.tensorboard import import_tensorboard
    for step in (100, 200, 300):
        reg.publish("demo", step, make_state(step))
    write_foreign_events(tmp_path / "logs")

    imported = import_tensorboard(reg, "demo", tmp_path / "logs")
    assert imported.keys == ["eval/accuracy", "loss"]
    assert imported.points == 6 and imported.unchanged == 0
    assert set(imported.skipped) == {"lr rate", "loss"}  # a tag with a space; a NaN, left out
    assert [(p.step, p.value) for p in reg.metrics("demo", "loss")] == [(100, f32(0.01)), (200, f32(0.005)),
                                                                      (300, 0.25)]
    assert [(p.step, p.value) for p in reg.metrics("demo", "eval/accuracy")] == [
        (100, 0.5), (200, f32(0.8)), (300, f32(0.7))]
    assert reg.resolve("demo@best:eval/accuracy:max").step == 200  # durable and ranked at once

    again = import_tensorboard(reg, "demo", tmp_path / "logs")
    assert (again.points, again.unchanged) == (0, 6)
    assert len(reg.metrics("demo", history=True)) == 6  # nothing superseded


def test_an_exported_run_imports_into_another_as_the_same_points(reg: Registry, tmp_path: Path) -> None:
    from registry.integrations.tensorboard import export_tensorboard, import_tensorboard
    publish_run(reg, "demo")
    export_tensorboard(reg, "demo", tmp_path / "tb")
    imported = import_tensorboard(reg, "copy", tmp_path / "tb" / "demo")
    assert imported.keys == ["eval/loss", "train/loss"]  # the checkpoint marks are not metrics
    assert [(p.step, p.key, p.value) for p in reg.metrics("copy")] == [
        (p.step, p.key, f32(p.value)) for p in reg.metrics("demo")]
    # importing back into the run exported: its 64-bit values round to what TensorBoard holds, so none changes
    assert import_tensorboard(reg, "demo", tmp_path / "tb" / "demo").points == 0


def test_the_metrics_command_writes_and_imports(cli: Any, reg: Registry, tmp_path: Path) -> None:
    publish_run(reg, "demo")
    wrote = cli("metrics", "demo", "--tensorboard", str(tmp_path / "tb"))
    assert wrote.exit_code == 0 and "wrote 7 points and 3 checkpoint marks" in wrote.output, wrote.output
    assert scalars(accumulator(tmp_path / "tb" / "demo"), "eval/loss")[0] == (100, f32(0.9))

    imported = cli("metrics", "copy", "--import-tensorboard", str(tmp_path / "tb" / "demo"), "--json")
    assert imported.exit_code == 0, imported.output
    assert json.loads(imported.output)["points"] == 7

    both = cli("metrics", "demo", "--tensorboard", str(tmp_path / "tb"), "--plot")
    assert both.exit_code == 2 and "--tensorboard and --plot cannot be combined" in both.output
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = cli("metrics", "demo", "--import-tensorboard", str(empty))
    assert nothing.exit_code == 1 and "no TensorBoard event files under" in nothing.output
