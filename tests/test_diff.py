"""``diff``: structure from headers, content from piece digests, values streamed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from registry import Registry
from registry.format.pieces import PIECE_SIZE
from registry.ops.diff import json_diff
from tests.helpers import make_state, write_raw_safetensors


def test_identical_steps_differ_in_nothing(reg: Registry) -> None:
    state = make_state(1)
    reg.publish("run", 1, state, config={"lr": 0.1}, metrics={"loss": 1.0})
    reg.publish("run", 2, state, config={"lr": 0.1}, metrics={"loss": 1.0})
    d = reg.diff("run@1", "run@2", values=True)
    assert d.identical and d.tensors == () and d.unchanged_tensors == len(state)
    assert [c.key for c in d.files] == ["meta.json"]  # its timestamp; nothing else
    # headers and config only: the file digests say the tensors are the same
    head = 8 + struct.unpack("<Q", (reg.resolve("run@1").path / "model.safetensors").read_bytes()[:8])[0]
    config = (reg.resolve("run@1").path / "config.json").stat().st_size
    assert d.bytes_read == 2 * (head + config)


def test_structure_content_config_and_metrics(reg: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    a = make_state(1)
    b = dict(a)
    b["layer0.weight"] = a["layer0.weight"].to(torch.float64)               # dtype
    b["layer1.weight"] = a["layer1.weight"].reshape(4, 16).contiguous()     # shape
    b["layer2.weight"] = a["layer2.weight"] + 0.5                            # content
    del b["layer3.weight"]                                                   # removed
    b["head"] = torch.ones(3)                                                # added
    reg.publish("run", 1, a, config={"lr": 0.1, "opt": {"betas": [0.9, 0.99]}}, metrics={"loss": 2.0})
    reg.publish("run", 2, b, config={"lr": 0.2, "opt": {"betas": [0.9, 0.95]}, "new": 1},
                metrics={"loss": 1.0, "acc": 0.5}, extra={"optimizer": {"lr": 0.2}})
    d = reg.diff("run@1", "run@2", values=True)
    kinds = {t.name: t.change for t in d.tensors}
    assert kinds == {"layer0.weight": "dtype", "layer1.weight": "shape", "layer2.weight": "content",
                     "layer3.weight": "removed", "head": "added"}
    (content,) = d.of("content")
    assert content.max_abs_diff == pytest.approx(0.5)
    expected = 0.5 * 8 / float(a["layer2.weight"].double().norm())
    assert content.rel_l2 == pytest.approx(expected, rel=1e-6)
    (cast,) = d.of("dtype")
    assert cast.dtype_a == "float32" and cast.dtype_b == "float64" and cast.max_abs_diff == 0.0  # exact widening
    assert d.of("shape")[0].max_abs_diff is None
    assert d.unchanged_tensors == len(a) - 4
    assert {(c.key, c.change) for c in d.config} == {("lr", "changed"), ("opt.betas[1]", "changed"),
                                                     ("new", "added")}
    assert {(c.key, c.a, c.b) for c in d.metrics} == {("loss", 2.0, 1.0), ("acc", None, 0.5)}
    assert ("optimizer.pt", "added") in {(c.key, c.change) for c in d.files}

    doc = json.loads(cli("diff", "run@1", "run@2", "--json").output)
    assert [t["name"] for t in doc["tensors"]["content"]] == ["layer2.weight"]
    assert "max_abs_diff" not in doc["tensors"]["content"][0]  # only with --values
    text = cli("diff", "run@1", "run@2", "--values").output
    assert "layer2.weight  content  max|d|=0.5" in text and "+ head" in text and "- layer3.weight" in text


def test_reordered_keys_are_the_same_tensors(sqlite_reg: Registry, tmp_path: Path) -> None:
    """Another writer's file with the keys in another order: offsets differ, so bytes are compared."""
    state = make_state(3)
    for name, order in (("fwd", sorted(state)), ("rev", sorted(state, reverse=True))):
        directory = tmp_path / name
        directory.mkdir()
        write_raw_safetensors(directory / "model.safetensors", [(k, state[k]) for k in order])
        (directory / "config.json").write_text("{}")
        sqlite_reg.import_checkpoint(directory, run=name, step=1)
    d = sqlite_reg.diff("fwd@1", "rev@1")
    assert d.tensors == () and d.unchanged_tensors == len(state)
    state["count"] = torch.tensor(4)
    directory = tmp_path / "changed"
    directory.mkdir()
    write_raw_safetensors(directory / "model.safetensors", [(k, state[k]) for k in sorted(state, reverse=True)])
    sqlite_reg.import_checkpoint(directory, run="changed", step=1)
    assert [(t.name, t.change) for t in sqlite_reg.diff("fwd@1", "changed@1").tensors] == [("count", "content")]


def test_only_differing_pieces_are_read(sqlite_reg: Registry) -> None:
    """Eight 4 MiB tensors (two 16 MiB pieces); one element changes: only the tensors' bytes inside the
    differing piece are read (t4..t7, to tell t5 from its unchanged neighbours), never those of piece 0."""
    a = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}
    b = dict(a)
    b["t5"] = a["t5"].clone()
    b["t5"][7] = -1.0
    sqlite_reg.publish("big", 1, a)
    sqlite_reg.publish("big", 2, b)
    d = sqlite_reg.diff("big@1", "big@2")
    assert [(t.name, t.change) for t in d.tensors] == [("t5", "content")]
    assert d.unchanged_tensors == 7
    assert d.bytes_read <= 2 * PIECE_SIZE + 8192 < d.bytes_total // 2 + 8192
    v = sqlite_reg.diff("big@1", "big@2", values=True).of("content")[0]
    assert v.max_abs_diff == 6.0 and v.rel_l2 == pytest.approx(6.0 / (5.0 * 1024))


def test_json_diff() -> None:
    assert json_diff({"a": [1, 2]}, {"a": [1, 2]}) == []
    changes = json_diff({"a": [1, 2], "b": {"c": 1}}, {"a": [1], "b": {"c": True}})
    assert [(c.key, c.change) for c in changes] == [("a", "changed"), ("b.c", "changed")]


def test_a_step_deleted_or_replaced_after_resolving(reg: Registry) -> None:
    """diff takes no lease: a gc or an overwrite between resolving and opening is seen, never mixed in."""
    from registry import CheckpointDeletedError
    from registry.ops.diff import diff_checkpoints
    from registry.retention import KeepLast
    a, b = make_state(1), make_state(2)
    reg.publish("run", 1, a)
    reg.publish("run", 2, a)
    one, two = reg.resolve("run@1"), reg.resolve("run@2")
    reg.publish("run", 2, b, overwrite=True)
    d = diff_checkpoints(reg._reader(), one, two)
    assert d.b.manifest_sha256 != two.manifest_sha256 and {t.change for t in d.tensors} == {"content"}
    reg.apply_retention("run", KeepLast(1))
    with pytest.raises(CheckpointDeletedError, match="run@1 was deleted while being compared"):
        diff_checkpoints(reg._reader(), one, reg.resolve("run@2"))
