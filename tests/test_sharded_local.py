"""Sharded (DCP) steps in one process, on both catalog backends: publish, load, fall-back, retention, follow.

Without a process group a sharded publish and ``load_into`` run the same code
as in a group of one (``registry.distributed.sharded``); the multi-rank behaviour is
in ``tests/test_sharded.py``.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Checkpoint, Registry
from registry.errors import (CorruptCheckpointError, InvalidStateError, ManifestError, StepExistsError,
                             UnsafePickleError)
from registry.records import Status
from registry.retention import KeepLast


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 6)).sum().backward()
    opt.step()
    return model, opt


def state_of(seed: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = trained(seed)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "rng": torch.arange(4) + seed}


def damage(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_publish_and_load_round_trip(reg: Registry) -> None:
    state = state_of(1)
    info = reg.publish("s", 10, state, sharded=True, metrics={"loss": 0.5}, tags=["best"], config={"lr": 1},
                       epoch=2, consumed_samples=64, policy_version=7)
    assert (info.status, info.epoch, info.consumed_samples, info.policy_version) == (Status.VERIFIED, 2, 64, 7)
    assert info.metrics == {"loss": 0.5} and info.tags == ("best",)
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert manifest["layout"]["world_size"] == 1 and "model.0.weight" in manifest["tensors"]

    full = reg.load("s@best")
    assert full.step == 10 and full.config == {"lr": 1} and full.policy_version == 7
    for key, value in state["model"].items():
        assert torch.equal(full.state_dict[f"model.{key}"], value)
    assert torch.equal(full.state_dict["rng"], state["rng"])

    into = state_of(2)
    got = reg.load_into("s", into)
    assert (got.step, got.missing_keys, got.unexpected_keys, got.epoch) == (10, (), (), 2)
    for key, value in state["model"].items():
        assert torch.equal(into["model"][key], value)
    for param, values in state["optim"]["state"].items():
        for name, value in values.items():
            assert torch.equal(into["optim"]["state"][param][name], value)
    assert into["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert torch.equal(into["rng"], state["rng"])


def test_corrupt_latest_falls_back_and_a_named_step_refuses(reg: Registry) -> None:
    for step in (1, 2):
        reg.publish("c", step, state_of(step), sharded=True)
    damage(reg.resolve("c@2").path / "__0_0.distcp")
    into = state_of(9)
    with pytest.warns(RuntimeWarning, match="falling back"):
        got = reg.load_into("c@latest", into)
    assert got.step == 1 and got.fallback is not None and got.fallback.from_step == 2
    assert torch.equal(into["rng"], torch.arange(4) + 1)
    assert reg.catalog.get("c", 2).status == Status.CORRUPT  # type: ignore[union-attr]
    with pytest.raises(CorruptCheckpointError):
        reg.load_into("c@2", state_of(9))
    with pytest.raises(CorruptCheckpointError):
        reg.load("c@2")


def test_a_damaged_shard_is_caught_by_a_full_load(reg: Registry) -> None:
    reg.publish("d", 1, state_of(1), sharded=True)
    damage(reg.resolve("d@1").path / "__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp"):
        reg.load("d@1")


def test_metadata_not_matching_the_catalog_is_never_unpickled(reg: Registry, tmp_path: Path) -> None:
    info = reg.publish("m", 1, state_of(1), sharded=True)
    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))
    (info.path / ".metadata").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CorruptCheckpointError):
        reg.load("m@1")
    with pytest.raises(CorruptCheckpointError):
        reg.load_into("m@1", state_of(1))
    with pytest.raises(CorruptCheckpointError):
        Checkpoint.load(info.path)  # catalog-free: still checked against the manifest
    assert not marker.exists()


class Opaque:
    def __init__(self) -> None:
        self.value = 3


def test_non_tensor_values_need_trust_pickle_beyond_plain_types(reg: Registry) -> None:
    state = state_of(1)
    state["custom"] = Opaque()
    reg.publish("p", 1, state, sharded=True)
    with pytest.raises(UnsafePickleError):
        reg.load("p@1")
    assert reg.load("p@1", trust_pickle=True).extra["custom"].value == 3
    assert reg.catalog.get("p", 1).status == Status.VERIFIED  # type: ignore[union-attr]  # not a corrupt step


def test_partial_and_strict_loads(reg: Registry) -> None:
    reg.publish("k", 1, state_of(1), sharded=True)
    into = {"model": state_of(2)["model"], "extra": torch.zeros(2)}
    with pytest.raises(InvalidStateError, match="missing 'extra'"):
        reg.load_into("k@1", into)
    got = reg.load_into("k@1", into, strict=False)
    assert got.missing_keys == ("extra",) and "rng" in got.unexpected_keys
    assert torch.equal(into["model"]["0.weight"], state_of(1)["model"]["0.weight"])
    only = {"rng": torch.zeros(4, dtype=torch.int64), "model": {"0.weight": torch.zeros(8, 6)}}
    got = reg.load_into("k@1", only, keys=["rng"])
    assert torch.equal(only["rng"], torch.arange(4) + 1) and not only["model"]["0.weight"].any()
    assert got.unexpected_keys == () and got.missing_keys == ()


def test_refused_arguments_touch_nothing(reg: Registry) -> None:
    for bad in ({"state": {}}, {"extra": {"x": 1}}, {"max_shard_size": 10}, {"blocking": "no"}):
        kwargs = {"state": state_of(1), **bad}
        with pytest.raises(InvalidStateError):
            reg.publish("x", 1, kwargs.pop("state"), sharded=True, **kwargs)
    assert [r.name for r in reg.runs()] == []
    reg.publish("y", 1, dict(state_of(1)["model"]))  # a full step
    with pytest.raises(InvalidStateError, match="not a sharded checkpoint"):
        reg.load_into("y@1", state_of(1))


def test_a_background_sharded_publish_without_a_process_group(reg: Registry) -> None:
    first = reg.publish("b", 1, state_of(1), sharded=True, blocking=False)
    with pytest.raises(StepExistsError):  # queued or already committed: refused before anything is copied
        reg.publish("b", 1, state_of(2), sharded=True, blocking=False)
    second = reg.publish("b", 2, state_of(2), sharded=True, blocking=False)
    reg.wait()
    assert [first.result().step, second.result().step] == [1, 2]
    assert reg.resolve("b@latest").step == 2 and reg.fsck(checksums=True).clean
    expected = state_of(1)
    got = reg.load("b@1").state_dict
    assert torch.equal(got["model.0.weight"], expected["model"]["0.weight"])


def test_retention_verify_fsck_and_follow_on_sharded_steps(reg: Registry) -> None:
    for step in (1, 2, 3):
        reg.publish("r", step, state_of(step), sharded=True, metrics={"loss": 1.0 / step})
    assert reg.wait_for_new("r", after_step=1, timeout=5).step == 2  # type: ignore[union-attr]
    result = reg.apply_retention("r", KeepLast(1))
    assert sorted(result.deleted) == [1, 2] and result.bytes_freed > 0
    assert [i.step for i in reg.checkpoints("r")] == [3]
    assert not (reg.store.step_dir("r", 1)).exists()
    assert [v.ok for v in reg.verify("r")] == [True]
    assert reg.fsck(checksums=True).clean
    damage(reg.resolve("r@3").path / ".metadata")
    assert [v.ok for v in reg.verify("r")] == [False]
    assert not reg.fsck(checksums=True).clean


def test_manifest_layout_marker(tmp_path: Path, reference: Any) -> None:
    from registry.format.manifest import parse_manifest
    with Registry.open(url=f"sqlite:///{tmp_path / 'c.db'}", root=tmp_path / "ckpt") as reg:
        info = reg.publish("ref", 1, state_of(1), sharded=True)
    with pytest.raises(ValueError, match="Unsupported checkpoint format version: 2"):
        reference.Checkpoint.load(str(info.path), verify_checksums=True)
    doc = json.loads((info.path / "manifest.json").read_text())
    assert parse_manifest(json.dumps(doc).encode(), path=info.path).layout is not None
    without = {k: v for k, v in doc.items() if k != "layout"}
    with pytest.raises(ManifestError, match="sharded layout"):
        parse_manifest(json.dumps(without).encode(), path=info.path)
    lying = {**doc, "layout": {**doc["layout"], "files_per_rank": {"0": ["__0_9.distcp"]}}}
    with pytest.raises(ManifestError):
        parse_manifest(json.dumps(lying).encode(), path=info.path)
    v1 = {**doc, "format_version": 1}  # a version-1 manifest keeps a field named layout as an unknown field
    assert parse_manifest(json.dumps(v1).encode(), path=info.path).layout is None


def test_overwrite_and_catalog_free_load(reg: Registry) -> None:
    reg.publish("o", 1, dict(state_of(1)["model"]))  # a full step, then replaced by a sharded one
    with pytest.raises(StepExistsError):
        reg.publish("o", 1, state_of(2), sharded=True)
    info = reg.publish("o", 1, state_of(2), sharded=True, overwrite=True, verify=False)
    assert info.status == Status.PUBLISHED
    assert not (info.path / "model.safetensors").exists()
    hidden = [p.name for p in info.path.parent.iterdir() if p.name.startswith(".")]
    assert hidden == []
    ckpt = Checkpoint.load(info.path, verify_checksums=True)  # no catalog: the directory alone
    assert torch.equal(ckpt.state_dict["rng"], torch.arange(4) + 2)
    into = state_of(3)
    assert reg.load_into("o@1", into, verify=False).step == 1
    assert torch.equal(into["rng"], torch.arange(4) + 2)


def test_with_trust_pickle_damage_is_found_before_anything_is_read(reg: Registry) -> None:
    reg.publish("tp", 1, state_of(1), sharded=True)
    damage(reg.resolve("tp@1").path / "__0_0.distcp")
    into = state_of(2)
    before = into["model"]["0.weight"].clone()
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp"):
        reg.load_into("tp@1", into, trust_pickle=True)
    assert torch.equal(into["model"]["0.weight"], before)  # untouched: the check ran first
    assert reg.catalog.get("tp", 1).status == Status.CORRUPT  # type: ignore[union-attr]


def test_load_into_replaces_non_tensor_values(reg: Registry) -> None:
    """Non-tensor values (an optimizer's lr, counters, bytes) come back into the caller's state, not only tensors."""
    state = state_of(1)
    state["optim"]["param_groups"][0]["lr"] = 0.25
    reg.publish("nt", 1, {**state, "count": 7, "blob": b"saved", "nested": {"name": "saved"}}, sharded=True)
    into = {**state_of(2), "count": 0, "blob": b"", "nested": {"name": ""}}
    reg.load_into("nt@1", into)
    assert into["optim"]["param_groups"][0]["lr"] == 0.25
    assert (into["count"], into["blob"], into["nested"]) == (7, b"saved", {"name": "saved"})


def test_a_read_error_is_this_readers_trouble_not_a_corrupt_step(reg: Registry,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO while DCP reads a shard: CheckpointReadError, no fallback, and the shared catalog keeps the step."""
    import errno
    import io

    from registry.errors import CheckpointReadError
    for step in (1, 2):
        reg.publish("e", step, state_of(step), sharded=True)
    real_fdopen = os.fdopen

    class Failing(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return True

        def seek(self, offset: int, whence: int = 0) -> int:
            return offset

        def readinto(self, buf: Any) -> int:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    def fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
            os.close(fd)
            return io.BufferedReader(Failing())
        return real_fdopen(fd, *args, **kwargs)
    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(CheckpointReadError, match="Input/output error"):
        reg.load_into("e@latest", state_of(9), verify=False)
    monkeypatch.undo()
    assert [i.status for i in reg.checkpoints("e")] == [Status.VERIFIED, Status.VERIFIED]
    into = state_of(9)
    assert reg.load_into("e@latest", into).step == 2
