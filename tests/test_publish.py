"""Publish and load through the catalog, on SQLite and PostgreSQL."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import registry.fs.payloadfiles as payloadfiles
import registry.fs.store as store_mod
from registry import (CheckpointNotFoundError, CorruptCheckpointError, InvalidStateError, PublishError,
                      Registry, StepExistsError)
from tests.helpers import (assert_state_equal, flip_stored_byte, make_state, optimizer_state, store_file, stored_file,
                           stored_steps)


def test_round_trip(reg: Registry) -> None:
    state = make_state(1)
    opt = optimizer_state()
    info = reg.publish("run", 1000, state, extra={"optimizer": opt}, config={"hidden": 8},
                       meta={"note": "hi"}, metrics={"eval/loss": 1.25}, epoch=3, consumed_samples=4096,
                       policy_version=7)
    assert info.status == "verified"
    assert info.path == reg.store.root / "run" / "step-00001000"
    assert info.metrics == {"eval/loss": 1.25}
    assert info.total_bytes == sum(p.stat().st_size for p in info.path.iterdir())

    ckpt = reg.load("run@1000")
    assert_state_equal(ckpt.state_dict, state)
    assert ckpt.step == 1000 and ckpt.epoch == 3 and ckpt.consumed_samples == 4096
    assert ckpt.policy_version == 7
    assert ckpt.config == {"hidden": 8}
    assert ckpt.meta["note"] == "hi"
    assert ckpt.info is not None and ckpt.info.step == 1000
    loaded_opt = ckpt.extra["optimizer"]
    assert loaded_opt["param_groups"] == opt["param_groups"]
    for key, value in opt["state"][0].items():
        assert torch.equal(loaded_opt["state"][0][key], value)


def test_latest_is_newest_verified(any_reg: Registry) -> None:
    reg = any_reg
    for step in (10, 30, 20):
        reg.publish("run", step, make_state(step))
    reg.publish("run", 40, make_state(40), verify=False)
    assert reg.resolve("run").step == 30
    assert reg.resolve("run@latest").step == 30
    assert reg.resolve("run@latest-published").step == 40
    assert_state_equal(reg.load("run").state_dict, make_state(30))
    assert [i.step for i in reg.checkpoints("run")] == [10, 20, 30, 40]


def test_staging_is_invisible_until_publish(reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    reg.publish("run", 1, make_state(1))
    seen: dict[str, object] = {}
    real_write = store_mod.write_payload

    def spy(staging: Path, payload: payloadfiles.Payload, **options: Any) -> payloadfiles.Written:
        written = real_write(staging, payload, **options)
        seen["latest"] = reg.resolve("run@latest-published").step
        seen["listing"] = sorted(p.name for p in (reg.store.root / "run").iterdir())
        seen["row"] = reg.catalog.get("run", 2)
        with pytest.raises(CheckpointNotFoundError):
            reg.resolve("run@2")
        return written

    monkeypatch.setattr("registry.roots.directory.write_payload", spy)
    reg.publish("run", 2, make_state(2))
    assert seen["latest"] == 1
    visible = [n for n in seen["listing"] if not n.startswith(".")]  # type: ignore[union-attr]
    assert visible == ["step-00000001"]
    assert any(n.startswith(".step-00000002.tmp-") for n in seen["listing"])  # type: ignore[union-attr]
    assert seen["row"].status == "staging"  # type: ignore[union-attr]
    assert reg.resolve("run").step == 2


def test_failed_write_leaves_no_trace(reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    reg.publish("run", 1, make_state(1))
    real_fsync = os.fsync
    calls = {"n": 0}

    def failing_fsync(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(PublishError) as info:
        reg.publish("run", 2, make_state(2))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert info.value.errno == errno.EIO
    assert sorted(p.name for p in (reg.store.root / "run").iterdir()) == ["step-00000001"]
    assert reg.resolve("run").step == 1
    assert reg.catalog.get("run", 2).status == "failed"  # type: ignore[union-attr]
    assert_state_equal(reg.load("run").state_dict, make_state(1))
    # the step can be published again after a failure
    assert reg.publish("run", 2, make_state(2)).status == "verified"


def test_duplicate_step_and_overwrite(any_reg: Registry) -> None:
    reg = any_reg
    reg.publish("run", 5, make_state(1), metrics={"loss": 2.0})
    with pytest.raises(StepExistsError):
        reg.publish("run", 5, make_state(2))
    assert_state_equal(reg.load("run@5").state_dict, make_state(1))
    info = reg.publish("run", 5, make_state(2), overwrite=True, metrics={"loss": 1.0})
    assert info.metrics == {"loss": 1.0}
    assert_state_equal(reg.load("run@5").state_dict, make_state(2))
    assert stored_steps(reg, "run") == ["step-00000005"]
    kinds = [e.kind for e in reg.events("run")]
    assert kinds.count("publish") == 2


def test_failed_overwrite_keeps_old_payload(any_reg: Registry) -> None:
    reg = any_reg
    reg.publish("run", 5, make_state(1))
    with pytest.raises(InvalidStateError):
        reg.publish("run", 5, make_state(2), config={"bad": object()}, overwrite=True)
    assert reg.catalog.get("run", 5).status == "verified"  # type: ignore[union-attr]
    assert_state_equal(reg.load("run@5").state_dict, make_state(1))


def _flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_latest_falls_back(any_reg: Registry) -> None:
    reg = any_reg
    reg.publish("run", 1, make_state(1))
    info = reg.publish("run", 2, make_state(2))
    flip_stored_byte(reg, info, "model.safetensors")
    with pytest.warns(RuntimeWarning, match="corrupt"):
        ckpt = reg.load("run@latest")
    assert ckpt.step == 1
    assert_state_equal(ckpt.state_dict, make_state(1))
    assert reg.catalog.get("run", 2).status == "corrupt"  # type: ignore[union-attr]
    assert reg.resolve("run").step == 1
    assert "corrupt" in [e.kind for e in reg.events("run", step=2)]


def test_corrupt_named_step_raises(any_reg: Registry) -> None:
    reg = any_reg
    reg.publish("run", 1, make_state(1))
    info = reg.publish("run", 2, make_state(2))
    flip_stored_byte(reg, info, "config.json", 0)
    with pytest.raises(CorruptCheckpointError):
        reg.load("run@2")
    assert reg.catalog.get("run", 2).status == "corrupt"  # type: ignore[union-attr]
    with pytest.raises(CorruptCheckpointError):
        reg.load("run@2")


def test_truncated_file_detected_without_verify(any_reg: Registry) -> None:
    reg = any_reg
    reg.publish("run", 1, make_state(1))
    info = reg.publish("run", 2, make_state(2))
    store_file(reg, info, "model.safetensors", stored_file(reg, info, "model.safetensors")[:-3])
    with pytest.warns(RuntimeWarning):
        assert reg.load("run", verify=False).step == 1


def test_verify_marks_and_recovers(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1), verify=False)
    info = reg.publish("run", 2, make_state(2))
    assert reg.catalog.get("run", 1).status == "published"  # type: ignore[union-attr]
    original = (info.path / "model.safetensors").read_bytes()
    _flip_byte(info.path / "model.safetensors")
    results = {r.step: r for r in reg.verify("run")}
    assert results[1].ok and results[1].status == "verified"
    assert not results[2].ok and "checksum" in results[2].problems[0]
    assert reg.catalog.get("run", 2).status == "corrupt"  # type: ignore[union-attr]
    (info.path / "model.safetensors").write_bytes(original)
    assert reg.verify("run@2")[0].ok
    assert reg.resolve("run").step == 2


def test_log_metrics_become_durable_with_publish(reg: Registry, catalog_url: str, root: Path) -> None:
    reg.log_metrics("run", 10, {"train/loss": 3.0})
    reg.log_metrics("run", 25, {"train/loss": 2.0})
    reg.publish("run", 20, make_state(1), metrics={"eval/loss": 1.0})
    with Registry.open(url=catalog_url, root=root) as other:
        points = {(p.step, p.key) for p in other.metrics("run")}
    assert points == {(10, "train/loss"), (20, "eval/loss")}
    reg.flush()
    assert (25, "train/loss") in {(p.step, p.key) for p in reg.metrics("run")}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "high", None, True])
def test_bad_metric_values(reg: Registry, bad: object) -> None:
    with pytest.raises(InvalidStateError):
        reg.publish("run", 1, make_state(1), metrics={"loss": bad})
    with pytest.raises(InvalidStateError):
        reg.log_metrics("run", 1, {"loss": bad})
    with pytest.raises(CheckpointNotFoundError):
        reg.resolve("run")


class Weird:
    """Not a tensor container: loading it needs full unpickling."""


def test_unpicklable_extra_is_a_clear_error(reg: Registry) -> None:
    with pytest.raises(InvalidStateError, match="extra 'opt'"):
        reg.publish("run", 1, make_state(1), extra={"opt": {"f": lambda: 1}})
    assert reg.catalog.get("run", 1) is None  # refused before the claim
    assert not (reg.store.root / "run").exists()


def test_extras_refuse_code_pickles(reg: Registry) -> None:
    from registry import UnsafePickleError
    with pytest.raises(UnsafePickleError, match="trust_pickle=True"):
        reg.publish("run", 1, make_state(1), extra={"obj": {"x": Weird()}})
    reg.publish("run", 1, make_state(1), extra={"obj": {"x": Weird()}}, trust_pickle=True)
    with pytest.raises(UnsafePickleError):
        reg.load("run@1")
    assert reg.catalog.get("run", 1).status == "verified"  # type: ignore[union-attr]
    assert isinstance(reg.load("run@1", trust_pickle=True).extra["obj"]["x"], Weird)


def test_sharded_publish_round_trip(reg: Registry) -> None:
    state = {f"w{i}": torch.randn(64, 64) for i in range(10)}
    info = reg.publish("run", 1, state, max_shard_size=40_000)
    names = sorted(p.name for p in info.path.iterdir())
    assert "model.safetensors.index.json" in names
    assert sum(n.endswith(".safetensors") for n in names) >= 3
    assert_state_equal(reg.load("run@1").state_dict, state)
