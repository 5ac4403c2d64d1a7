"""Everything a publish can refuse is refused at the door: no row, no event, no run, no file.

And what it accepts loads back: ``meta`` cannot make the step's own manifest
invalid, and an ``extra`` that ``torch.load(weights_only=True)`` would refuse
needs ``trust_pickle=True`` at publish.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from registry import (Checkpoint, InvalidNameError, InvalidStateError, ManifestError, Registry, RegistryError,
                      UnsafePickleError)
from tests.helpers import assert_state_equal, make_state, optimizer_state


class Opaque:
    """A plain user object: pickles fine, but only full unpickling can rebuild it."""

    def __init__(self) -> None:
        self.value = 3


class Armed:
    """Creates a file when unpickled: proof that checking it ran no code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _nested(depth: int) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for _ in range(depth):
        doc = {"x": doc}
    return doc


# (keyword arguments of publish, the error expected, a piece of its message)
BAD: list[tuple[dict[str, Any], type[RegistryError], str]] = [
    # meta that would make the manifest invalid, or contradict the catalog
    ({"meta": {"optimizer_step": 2000.0}}, InvalidStateError, "optimizer_step"),
    ({"meta": {"policy_version": "v3"}}, InvalidStateError, "policy_version"),
    ({"meta": {"timestamp": 1700000000}}, InvalidStateError, "timestamp"),
    ({"meta": {"epoch": 9}, "epoch": 3}, InvalidStateError, "epoch=3"),
    ({"meta": {"epoch": True}}, InvalidStateError, "epoch"),
    ({"meta": {"consumed_samples": 5}}, InvalidStateError, "consumed_samples"),
    ({"meta": {"optimizer_step": 7}}, InvalidStateError, "pass optimizer_step="),
    ({"meta": {"policy_version": 4}, "policy_version": 5}, InvalidStateError, "policy_version=5"),
    ({"meta": "note"}, InvalidStateError, "meta must be a mapping"),
    # keyword arguments that reach the catalog's 64-bit columns
    ({"epoch": 1.5}, InvalidStateError, "epoch"),
    ({"epoch": -1}, InvalidStateError, "epoch"),
    ({"consumed_samples": 2**64}, InvalidStateError, "consumed_samples"),
    ({"optimizer_step": 2.0}, InvalidStateError, "optimizer_step"),
    ({"optimizer_step": 2**63}, InvalidStateError, "optimizer_step"),
    ({"policy_version": "v3"}, InvalidStateError, "policy_version"),
    # config and meta that are not JSON, or not the JSON the reader gets back
    ({"config": {"a": {1, 2}}}, InvalidStateError, "config"),
    ({"config": {"lr": float("nan")}}, InvalidStateError, "config"),
    ({"config": {"lr": float("inf")}}, InvalidStateError, "config"),
    ({"config": {1: "one"}}, InvalidStateError, "key 1"),
    ({"config": {"layers": [{(1, 2): "x"}]}}, InvalidStateError, "config"),
    ({"config": {"w": torch.ones(2)}}, InvalidStateError, "config"),
    ({"config": [("a", 1)]}, InvalidStateError, "config must be a mapping"),
    ({"config": _nested(300)}, InvalidStateError, "nested"),
    ({"config": {"big": "x" * (64 << 20)}}, InvalidStateError, "bytes"),
    ({"meta": {"loss": torch.tensor(1.0)}}, InvalidStateError, "meta"),
    ({"meta": {"n": np.int64(3)}}, InvalidStateError, "meta"),
    # extras: names, picklability, and loadability without trust_pickle
    ({"extra": {"rng": np.random.get_state()}}, UnsafePickleError, "'rng'"),
    ({"extra": {"opt": {"state": Opaque()}}}, UnsafePickleError, "Opaque"),
    ({"extra": {"opt": {"f": lambda: 1}}}, InvalidStateError, "cannot be saved"),
    ({"extra": {"~home": 1}}, InvalidStateError, "extra name"),
    ({"extra": {"a\\b": 1}}, InvalidStateError, "extra name"),
    ({"extra": {"a/b": 1}}, InvalidStateError, "extra name"),
    ({"extra": {".hidden": 1}}, InvalidStateError, "extra name"),
    ({"extra": {"": 1}}, InvalidStateError, "extra name"),
    ({"extra": {3: 1}}, InvalidStateError, "extra name"),
    ({"extra": {"x" * 300: 1}}, InvalidStateError, "too long"),
    ({"extra": [1]}, InvalidStateError, "extra must be a mapping"),
    # the state dict and the options
    ({"state_dict": {"w": torch.empty(3, device="meta")}}, InvalidStateError, "meta device"),
    ({"state_dict": {"w": 1.0}}, InvalidStateError, "not a tensor"),
    ({"max_shard_size": True}, InvalidStateError, "max_shard_size"),
    ({"max_shard_size": 0}, InvalidStateError, "max_shard_size"),
    ({"overwrite": "yes"}, InvalidStateError, "overwrite"),
    ({"verify": None}, InvalidStateError, "verify"),
    ({"trust_pickle": 1}, InvalidStateError, "trust_pickle"),
    ({"tags": ["latest"]}, InvalidNameError, "tag"),
    ({"tags": "release"}, InvalidStateError, "tags=['release']"),
    ({"tags": 5}, InvalidStateError, "tags"),
    ({"metrics": {"loss": float("nan")}}, InvalidStateError, "loss"),
]


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def _world(reg: Registry) -> tuple[Any, ...]:
    """Everything a refused publish could have changed, on both sides."""
    return (sorted(r.name for r in reg.runs()),
            [(i.step, i.status, i.created_at) for i in reg.checkpoints("run", include_deleted=True)],
            [(e.kind, e.step) for e in reg.events()], _files(reg.store.root))


@pytest.mark.parametrize("blocking", [True, False])
def test_refused_at_the_door_leaves_nothing(reg: Registry, blocking: bool) -> None:
    reg.publish("run", 1, make_state(1), meta={"note": "kept"})
    before = _world(reg)
    for kwargs, error, words in BAD:
        kwargs = dict(kwargs)
        state = kwargs.pop("state_dict", make_state(2))
        for run, step, overwrite in (("run", 2, False), ("run", 1, True), ("fresh", 1, False)):
            call = {"overwrite": overwrite, "blocking": blocking, **kwargs}
            with pytest.raises(error) as caught:  # raised by publish itself, never only on a future
                reg.publish(run, step, state, **call)
            assert words in str(caught.value), (kwargs, str(caught.value))
            assert "\n" not in str(caught.value)
    assert reg.pending_publishes() == 0
    reg.wait()  # no background failure was left behind either
    assert _world(reg) == before
    assert reg.load("run@1").meta["note"] == "kept"


def test_meta_may_repeat_what_the_publish_records_and_nothing_else(reg: Registry) -> None:
    for meta in ({"optimizer_step": 2000.0}, {"policy_version": "v3"}, {"timestamp": 1700000000}):
        with pytest.raises(InvalidStateError):  # each of these used to publish a step no load could read
            reg.publish("run", 10, make_state(1), meta=meta)
    info = reg.publish("run", 10, make_state(1), epoch=2, consumed_samples=640, policy_version=3,
                       optimizer_step=2000,
                       meta={"epoch": 2, "consumed_samples": 640, "optimizer_step": 2000, "policy_version": 3,
                             "seed": [1, 2]})
    assert (info.epoch, info.consumed_samples, info.policy_version, info.status) == (2, 640, 3, "verified")
    manifest = json.loads((info.path / "manifest.json").read_bytes())
    meta = json.loads((info.path / "meta.json").read_bytes())
    assert (manifest["optimizer_step"], manifest["policy_version"]) == (2000, 3)
    assert manifest["created_at"] == meta["timestamp"]
    ckpt = reg.load("run@10", verify=True)
    assert ckpt.meta["seed"] == [1, 2] and ckpt.epoch == 2 and ckpt.policy_version == 3
    # a loaded checkpoint's meta can be passed on with the same arguments; its timestamp is replaced
    old = {**ckpt.meta, "timestamp": "2020-01-01T00:00:00+00:00"}
    copy = reg.publish("copy", 10, ckpt.state_dict, meta=old, epoch=2, consumed_samples=640, policy_version=3,
                       optimizer_step=2000)
    copied = reg.load("copy@10")
    assert copied.meta["seed"] == [1, 2]
    assert copied.meta["timestamp"] != old["timestamp"]
    assert json.loads((copy.path / "manifest.json").read_bytes())["created_at"] == copied.meta["timestamp"]


def test_extras_are_checked_against_weights_only_loading(reg: Registry) -> None:
    with pytest.raises(UnsafePickleError, match=r"extra 'rng' holds a numpy\.ndarray at rng\[1\]"):
        reg.publish("run", 1, make_state(1), extra={"rng": np.random.get_state()})
    module_state = torch.nn.Linear(3, 2).state_dict()  # an OrderedDict with _metadata
    extra = {
        "optimizer": optimizer_state(),
        "ema": module_state,
        "rng": {"torch": torch.get_rng_state(), "seed": 7},
        "misc": {"shape": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"),
                 "pair": (1, 2.5), "set": {1, 2}, "z": 1 + 2j, "raw": b"\x00", "none": None,
                 "counts": collections.Counter("aab"), "param": torch.nn.Parameter(torch.ones(2))},
    }
    reg.publish("run", 1, make_state(1), extra=extra)
    loaded = reg.load("run@1").extra  # trust_pickle=False
    assert loaded["misc"]["shape"] == torch.Size([2, 3]) and loaded["misc"]["counts"]["a"] == 2
    assert_state_equal(dict(loaded["ema"]), dict(module_state))
    assert torch.equal(loaded["rng"]["torch"], extra["rng"]["torch"])
    # torch's own allow-list decides: a type the caller allowed passes, as it will load
    with torch.serialization.safe_globals([Opaque]):
        reg.publish("run", 2, make_state(2), extra={"obj": Opaque()})
        assert reg.load("run@2").extra["obj"].value == 3


def test_trust_pickle_at_publish_accepts_and_loads_need_it_too(reg: Registry, tmp_path: Path) -> None:
    fired = tmp_path / "fired"
    with pytest.raises(UnsafePickleError, match="trust_pickle=True"):
        reg.publish("run", 1, make_state(1), extra={"rng": np.random.get_state(), "armed": Armed(fired)})
    assert not fired.exists()  # checking an extra never runs its code
    state = np.random.get_state()
    reg.publish("run", 1, make_state(1), extra={"rng": state}, trust_pickle=True)
    with pytest.raises(UnsafePickleError):
        reg.load("run@1")
    assert reg.resolve("run@1").status == "verified"
    loaded = reg.load("run@1", trust_pickle=True).extra["rng"]
    assert loaded[0] == state[0] and np.array_equal(loaded[1], state[1])


def test_catalog_free_save_refuses_an_invalid_manifest(tmp_path: Path) -> None:
    ckpt = Checkpoint(state_dict=make_state(1), meta={"optimizer_step": 2000.0})
    with pytest.raises(InvalidStateError, match="optimizer_step"):
        ckpt.save(tmp_path / "c")
    assert not (tmp_path / "c").exists() and list(tmp_path.iterdir()) == []


def test_import_refuses_numbers_the_catalog_cannot_hold(reference, reg: Registry,  # noqa: F811
                                                        tmp_path: Path) -> None:
    src = tmp_path / "src"
    reference.Checkpoint(state_dict=make_state(1), meta={"optimizer_step": 2**70}).save(str(src))
    with pytest.raises(ManifestError, match="64-bit"):
        reg.import_checkpoint(src, run="run", step=1)
    good = tmp_path / "good"
    reference.Checkpoint(state_dict=make_state(1)).save(str(good))
    with pytest.raises(InvalidStateError, match=r"tags=\['release'\]"):
        reg.import_checkpoint(good, run="run", step=1, tags="release")
    with pytest.raises(InvalidStateError, match="move"):
        reg.import_checkpoint(good, run="run", step=1, move="no")  # type: ignore[arg-type]
    assert reg.runs() == [] and not (reg.store.root / "run").exists()
    legacy = tmp_path / "legacy"
    reference.Checkpoint(state_dict=make_state(2), epoch=2**70).save(str(legacy))
    (legacy / "manifest.json").unlink()
    info = reg.import_checkpoint(legacy, run="run", step=2)  # an unusable epoch is ignored, as a non-integer is
    assert info.epoch == 0 and info.status == "verified"
