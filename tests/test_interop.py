"""Both directions of compatibility with the reference module (docs/reference/format.md)."""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch as st
import torch

from registry import Checkpoint, Registry
from tests.helpers import assert_state_equal, make_state, write_hf_sharded


def test_reference_loads_what_we_publish(reference, sqlite_reg: Registry) -> None:  # type: ignore[no-untyped-def]
    state = make_state(3)
    opt = {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    info = sqlite_reg.publish("run", 7, state, extra={"optimizer": opt}, config={"d": 8},
                              meta={"who": "me"}, epoch=2, consumed_samples=99, policy_version=4)
    loaded = reference.Checkpoint.load(str(info.path), verify_checksums=True)
    assert_state_equal(loaded.state_dict, state)
    assert loaded.epoch == 2 and loaded.consumed_samples == 99
    assert loaded.config == {"d": 8} and loaded.meta["who"] == "me"
    assert torch.equal(loaded.extra["optimizer"]["state"][0]["exp_avg"], torch.ones(3))
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["policy_version"] == 4
    assert manifest["tensors"] == sorted(state)


def test_our_safetensors_match_the_library(tmp_path: Path) -> None:
    state = make_state(5)
    Checkpoint(state_dict=state).save(tmp_path / "c")
    assert_state_equal(st.load_file(str(tmp_path / "c" / "model.safetensors")), state)


def test_we_load_what_the_reference_writes(reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    state = make_state(4)
    ref_ckpt = reference.Checkpoint(state_dict=state, epoch=5, consumed_samples=10,
                                    extra={"sched": {"last_epoch": 3}}, meta={"k": "v"}, config={"c": 1})
    ref_ckpt.save(str(tmp_path / "ref"))
    ours = Checkpoint.load(tmp_path / "ref", verify_checksums=True)
    assert_state_equal(ours.state_dict, state)
    assert ours.epoch == 5 and ours.consumed_samples == 10
    assert ours.extra == {"sched": {"last_epoch": 3}}
    assert ours.config == {"c": 1} and ours.meta["k"] == "v"


def test_legacy_directory_without_manifest(reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    state = make_state(6)
    reference.Checkpoint(state_dict=state, epoch=1, config={"x": 2}).save(str(tmp_path / "ref"))
    (tmp_path / "ref" / "manifest.json").unlink()
    ours = Checkpoint.load(tmp_path / "ref", verify_checksums=True)
    assert_state_equal(ours.state_dict, state)
    assert ours.epoch == 1 and ours.config == {"x": 2}


def test_hugging_face_sharded_directory(reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "hf"
    state = write_hf_sharded(d)
    ours = Checkpoint.load_any(d)
    assert ours is not None
    assert_state_equal(ours.state_dict, state)
    assert ours.config == {"hidden_size": 4}
    theirs = reference.Checkpoint.load_any(str(d))
    assert_state_equal(theirs.state_dict, state)
    assert Checkpoint.load_any(tmp_path / "nothing-here") is None


def test_catalog_free_save_then_reference_load(reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    state = make_state(8)
    Checkpoint(state_dict=state, epoch=4, config={"a": 1}, extra={"rng": torch.get_rng_state()}).save(tmp_path / "c")
    loaded = reference.Checkpoint.load(str(tmp_path / "c"), verify_checksums=True)
    assert_state_equal(loaded.state_dict, state)
    assert loaded.epoch == 4
    # saving again replaces the directory atomically
    Checkpoint(state_dict=make_state(9)).save(tmp_path / "c")
    assert_state_equal(Checkpoint.load(tmp_path / "c", verify_checksums=True).state_dict, make_state(9))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
