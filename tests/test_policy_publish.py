"""The RL policy channel's data path: delta publishes, rebuilding them, materialize, folds, markers, refs, retention.

Real catalogs (both, through ``catalog_url``), real files, and a real S3 server for the object-store root.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from registry import (CheckpointNotFoundError, CorruptCheckpointError, DeltaBaseError, InvalidRefError,
                      InvalidStateError, PolicyVersionConflictError, Registry, StepExistsError)
from registry.catalog.policy import chain_steps, folds, markers, policy_steps
from registry.format import delta as deltas
from registry.retention import KeepLast

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "f8e4m3": torch.float8_e4m3fn}


def policy_state(seed: int = 0, dtype: torch.dtype = torch.bfloat16, n: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.0.weight": torch.randn(n, generator=g).reshape(64, -1).to(dtype),
            "layer.1.weight": torch.randn(n // 2, generator=g).to(dtype),
            "norm": torch.ones(32, dtype=torch.float32), "step": torch.tensor(seed, dtype=torch.int64)}


def step_of(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """``state`` after an optimizer step that moves ``fraction`` of the elements of its float tensors."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        if t.is_floating_point() and t.numel() > 32:
            flat = t.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[:max(1, int(flat.numel() * fraction))]
            flat[idx] = (flat[idx].float() * 1.01 + 0.003).to(t.dtype)
        out[name] = t
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(sorted(a)) == list(sorted(b))
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert raw(a[name]) == raw(b[name]), name


def kinds(reg: Registry, run: str) -> dict[int, str]:
    return {s: r.kind for s, r in policy_steps(reg.catalog, run).items()}


def files_of(reg: Registry, run: str, step: int) -> set[str]:
    return {f.name for f in reg.catalog.files(run, step)}


# ---------------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fraction", [0.01, 0.03, 0.20])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_delta_loads_bit_exactly_what_a_full_gives(reg: Registry, dtype: str, fraction: float) -> None:
    base = policy_state(1, DTYPES[dtype])
    target = step_of(base, fraction, 2)
    reg.publish("rl", 10, base, policy_version=1, delta="auto")
    info = reg.publish("rl", 20, target, policy_version=2, delta=True)
    assert kinds(reg, "rl") == {10: "full", 20: "delta"}
    assert "delta.safetensors" in files_of(reg, "rl", 20) and "model.safetensors" not in files_of(reg, "rl", 20)
    assert info.status == "verified" and info.policy_version == 2
    assert_same(reg.load("rl@20").state_dict, target)
    assert_same(reg.load("rl@pv:1").state_dict, base)
    row = policy_steps(reg.catalog, "rl")[20]
    assert row.base_step == 10 and row.full_sha256 == deltas.full_sha256(target)


def test_a_trainer_stepping_its_weights_in_place_after_each_publish_gets_exact_deltas(reg: Registry) -> None:
    """The publisher remembers each version as the next delta's base, written into the memory of the version
    before (no fresh allocation): never the trainer's own tensors, which its optimizer steps in place."""
    weights = policy_state(7)
    versions = [{n: t.clone() for n, t in weights.items()}]
    reg.publish("rl", 0, weights, policy_version=0, delta=True)
    held = reg._policy_cache.take("rl")
    assert held is not None
    reg._policy_cache.put("rl", *held)
    memory = {n: t.data_ptr() for n, t in held[1].items()}
    assert all(memory[n] != t.data_ptr() for n, t in weights.items())
    for version in (1, 2, 3):
        for name, t in step_of(weights, 0.03, version).items():
            weights[name].copy_(t)  # the optimizer steps the very tensors it published
        versions.append({n: t.clone() for n, t in weights.items()})
        reg.publish("rl", version, weights, policy_version=version, delta=True)
        held = reg._policy_cache.take("rl")
        assert held is not None
        assert {n: t.data_ptr() for n, t in held[1].items()} == memory  # the same memory, every version
        assert_same(held[1], weights)
        reg._policy_cache.put("rl", *held)
    assert kinds(reg, "rl") == {0: "full", 1: "delta", 2: "delta", 3: "delta"}
    for version, expected in enumerate(versions):
        assert_same(reg.load(f"rl@pv:{version}").state_dict, expected)


def test_a_publish_that_fails_after_planning_leaves_the_next_delta_exact(reg: Registry) -> None:
    """A failed publish may have written its base's memory: the next delta reads its base back."""
    v0 = policy_state(3)
    reg.publish("rl", 0, v0, policy_version=0, delta=True)
    v1 = step_of(v0, 0.03, 1)
    reg.publish("rl", 1, v1, policy_version=1, delta=True)
    with pytest.raises(StepExistsError):
        reg.publish("rl", 1, step_of(v1, 0.03, 2), policy_version=2, delta=True)  # a duplicate step
    assert reg._policy_cache.take("rl") is None  # planned (its base's memory written), then refused
    v2 = step_of(v1, 0.03, 2)
    reg.publish("rl", 2, v2, policy_version=2, delta=True)
    assert kinds(reg, "rl") == {0: "full", 1: "delta", 2: "delta"}
    assert_same(reg.load("rl@pv:2").state_dict, v2)
    assert_same(reg.load("rl@pv:1").state_dict, v1)


def test_materialize_writes_the_bytes_a_full_publish_writes(reg: Registry, tmp_path: Path) -> None:
    base = policy_state(3)
    target = step_of(base, 0.03, 4)
    reg.publish("rl", 1, base, policy_version=1, delta="auto", config={"arch": "toy", "layers": 2})
    reg.publish("rl", 2, target, policy_version=2, delta="auto", config={"arch": "toy", "layers": 2})
    assert kinds(reg, "rl")[2] == "delta"
    full = reg.publish("plain", 2, target, policy_version=2, config={"arch": "toy", "layers": 2})
    out = reg.materialize("rl@pv:2", tmp_path / "serve")
    assert out == tmp_path / "serve"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (full.path / name).read_bytes(), name
    # again over the files it wrote (a consumer's next version): replaced whole
    reg.materialize("rl@pv:1", out)
    assert (out / "model.safetensors").read_bytes() == (reg.resolve("rl@1").path / "model.safetensors").read_bytes()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_export_of_a_delta_step_holds_its_full_tensors(reg: Registry, tmp_path: Path) -> None:
    import safetensors.torch as st
    base = policy_state(5)
    target = step_of(base, 0.01, 6)
    reg.publish("rl", 1, base, policy_version=1, delta="auto")
    reg.publish("rl", 2, target, policy_version=2, delta="auto")
    exported = reg.export("rl@latest-policy", tmp_path / "out")
    assert exported.step == 2
    assert_same(st.load_file(str(tmp_path / "out" / "model.safetensors")), target)


def test_a_chain_of_twenty_stores_a_full_every_full_every(migrated_url: str, tmp_path: Path) -> None:
    with Registry.open(migrated_url, tmp_path / "ckpt", full_every=4) as reg:
        states = {}
        state = policy_state(7)
        for v in range(1, 21):
            state = step_of(state, 0.02, v)
            states[v] = state
            reg.publish("rl", v * 10, state, policy_version=v, delta="auto")
        got = kinds(reg, "rl")
        assert [s for s, k in got.items() if k == "full"] == [10, 50, 90, 130, 170]
        assert chain_steps(reg.catalog, "rl", 80) == [50, 60, 70, 80]
        assert chain_steps(reg.catalog, "rl", 50) == [50]
    with Registry.open(migrated_url, tmp_path / "ckpt") as fresh:  # nothing held in memory: every chain read
        for v in (1, 4, 7, 20):
            assert_same(fresh.load(f"rl@pv:{v}").state_dict, states[v])
        nxt = step_of(states[20], 0.02, 21)  # a delta whose base this process never held: read back
        fresh.publish("rl", 210, nxt, policy_version=21, delta=True)
        assert kinds(fresh, "rl")[210] == "delta" and chain_steps(fresh.catalog, "rl", 210)[0] == 170
        assert_same(fresh.load("rl@latest-policy").state_dict, nxt)


def test_a_changed_tensor_set_publishes_a_full_or_refuses(reg: Registry) -> None:
    base = policy_state(8)
    reg.publish("rl", 1, base, policy_version=1, delta="auto")
    wider = {**base, "layer.1.weight": torch.zeros(4096, dtype=torch.bfloat16)}
    with pytest.raises(DeltaBaseError, match="shape"):
        reg.publish("rl", 2, wider, policy_version=2, delta=True)
    assert reg.checkpoints("rl")[-1].step == 1  # nothing claimed
    held = reg._policy_cache.take("rl")  # the refused publish left version 1 held, as it was
    assert held is not None and held[0] == policy_steps(reg.catalog, "rl")[1].full_sha256
    assert_same(held[1], base)
    reg._policy_cache.put("rl", *held)
    reg.publish("rl", 2, wider, policy_version=2, delta="auto")
    reg.publish("rl", 3, {**wider, "extra": torch.ones(3)}, policy_version=3, delta="auto")
    assert kinds(reg, "rl") == {1: "full", 2: "full", 3: "full"}
    assert_same(reg.load("rl@pv:2").state_dict, wider)


def test_auto_stores_a_full_where_a_delta_would_not_pay(reg: Registry) -> None:
    reg.publish("rl", 1, policy_state(9), policy_version=1, delta="auto")
    reg.publish("rl", 2, policy_state(10), policy_version=2, delta="auto")  # every element changed
    reg.publish("rl", 3, policy_state(10), policy_version=3, delta=False)
    assert kinds(reg, "rl") == {1: "full", 2: "full", 3: "full"}


def test_a_version_names_one_set_of_weights(reg: Registry) -> None:
    base = policy_state(11)
    first = reg.publish("rl", 1, base, policy_version=1, delta="auto")
    nxt = step_of(base, 0.01, 1)
    second = reg.publish("rl", 2, nxt, policy_version=2, delta="auto")
    again = reg.publish("rl", 2, nxt, policy_version=2, delta="auto")  # the same weights: nothing happens
    assert (again.step, again.manifest_sha256, again.path) == (second.step, second.manifest_sha256, second.path)
    assert reg.publish("rl", 7, base, policy_version=1, delta="auto").step == first.step
    assert reg.publish("rl", 8, nxt, policy_version=2, delta="auto", blocking=False).result().step == second.step
    assert [i.step for i in reg.checkpoints("rl")] == [1, 2]
    with pytest.raises(PolicyVersionConflictError, match="policy version 2 .* other weights"):
        reg.publish("rl", 3, base, policy_version=2, delta="auto")
    with pytest.raises(PolicyVersionConflictError):
        reg.publish("rl", 2, base, policy_version=2, delta=False, overwrite=True)
    assert [i.step for i in reg.checkpoints("rl")] == [1, 2]
    assert isinstance(PolicyVersionConflictError("x"), ValueError)


def test_the_delta_option_is_checked(reg: Registry, tmp_path: Path, migrated_url: str) -> None:
    with pytest.raises(InvalidStateError, match="policy_version"):
        reg.publish("rl", 1, policy_state(1), delta="auto")
    with pytest.raises(InvalidStateError, match="delta must be"):
        reg.publish("rl", 1, policy_state(1), policy_version=1, delta="yes")  # type: ignore[call-overload]
    with pytest.raises(InvalidStateError, match="max_shard_size"):
        reg.publish("rl", 1, policy_state(1), policy_version=1, delta="auto", max_shard_size=1000)
    with pytest.raises(InvalidStateError, match="full_every"):
        Registry.open(migrated_url, tmp_path / "other", full_every=0)
    reg.publish("rl", 1, policy_state(1), delta=False)  # no policy version: a plain step
    assert kinds(reg, "rl") == {}


def test_a_plain_policy_publish_is_a_full_a_delta_can_stand_on(reg: Registry) -> None:
    base = policy_state(12)
    reg.publish("rl", 1, base, policy_version=1)  # the default: a plain full, loadable by the reference module
    reg.publish("rl", 2, base, policy_version=1)  # a version may repeat outside the channel
    target = step_of(base, 0.01, 3)
    reg.publish("rl", 3, target, policy_version=2, delta="auto")
    assert kinds(reg, "rl") == {1: "full", 2: "full", 3: "delta"}
    assert_same(reg.load("rl@3").state_dict, target)


def test_a_background_delta_publish(reg: Registry) -> None:
    base = policy_state(13)
    reg.publish("rl", 1, base, policy_version=1, delta="auto")
    target = step_of(base, 0.01, 2)
    future = reg.publish("rl", 2, target, policy_version=2, delta="auto", blocking=False)
    target["layer.0.weight"].zero_()  # the trainer's next step: the publish holds its own copy
    assert future.result().step == 2
    assert kinds(reg, "rl")[2] == "delta"
    assert reg.load("rl@2").state_dict["layer.0.weight"].abs().sum() > 0


# ---------------------------------------------------------------------------------------------------- damage


def test_a_damaged_delta_is_a_corrupt_copy_never_wrong_weights(reg: Registry) -> None:
    base = policy_state(14)
    nxt = step_of(base, 0.03, 1)
    last = step_of(nxt, 0.03, 2)
    reg.publish("rl", 1, base, policy_version=1, delta="auto")
    reg.publish("rl", 2, nxt, policy_version=2, delta="auto")
    info = reg.publish("rl", 3, last, policy_version=3, delta="auto")
    path = info.path / "delta.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="falling back"):
        ck = reg.load("rl@latest-policy")
    assert ck.step == 2
    assert_same(ck.state_dict, nxt)
    assert reg.catalog.get("rl", 3).status == "corrupt"  # type: ignore[union-attr]
    with pytest.raises(CorruptCheckpointError):
        reg.load("rl@3")
    with pytest.raises(CorruptCheckpointError):
        reg.load("rl@pv:3")


def test_a_damaged_delta_that_verifies_is_caught_by_its_own_digests(reg: Registry) -> None:
    """Bytes replaced together with the manifest's record (a writer's bug, not the disk's): the delta's own
    content digest still refuses them."""
    base = policy_state(15)
    reg.publish("rl", 1, base, policy_version=1, delta="auto")
    info = reg.publish("rl", 2, step_of(base, 0.03, 1), policy_version=2, delta="auto")
    data = bytearray((info.path / "delta.safetensors").read_bytes())
    data[-5] ^= 0x01
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        deltas.decode(base, bytes(data))


# ---------------------------------------------------------------------------------------------------- refs


def test_policy_refs_resolve(reg: Registry, catalog_url: str, root: Path) -> None:
    state = policy_state(16)
    reg.publish("rl", 5, state, policy_version=1, delta="auto")
    state = step_of(state, 0.01, 1)
    reg.publish("rl", 6, state, policy_version=2, delta="auto")
    reg.publish("rl", 7, step_of(state, 0.01, 2), verify=False, policy_version=3, delta="auto")
    reg.publish("rl", 8, policy_state(1))  # no policy version: not @latest-policy
    assert reg.resolve("rl@pv:2").step == 6
    assert reg.resolve("rl@pv:3").step == 7  # published, not yet verified: it names that version
    assert reg.resolve("rl@latest-policy").step == 6
    assert reg.resolve("rl@latest").step == 8
    with pytest.raises(CheckpointNotFoundError, match="policy version 9"):
        reg.resolve("rl@pv:9")
    for typo, meant in (("rl@latest-polcy", "rl@latest-policy"), ("rl@pv3", "rl@pv:3"), ("rl@PV:3", "rl@pv:3"),
                        ("rl@pv:x", "rl@pv:N")):
        with pytest.raises(InvalidRefError, match=f"did you mean {meant}"):
            reg.resolve(typo)
    with pytest.raises(Exception, match="reserved"):
        reg.tag("rl", 5, "latest-policy")
    from registry.cli import main
    runner = CliRunner()
    out = runner.invoke(main, ["--url", catalog_url, "--root", str(root), "resolve", "rl@pv:1"])
    assert out.exit_code == 0 and out.output.strip().endswith("step-00000005"), out.output
    out = runner.invoke(main, ["--url", catalog_url, "--root", str(root), "show", "rl@latest-policy", "--json"])
    assert out.exit_code == 0 and '"step": 6' in out.output, out.output


# ---------------------------------------------------------------------------------------------------- retention


def test_retention_keeps_the_chain_of_every_kept_delta(reg: Registry) -> None:
    state = policy_state(17)
    for v in range(1, 6):
        state = step_of(state, 0.01, v)
        reg.publish("rl", v, state, policy_version=v, delta="auto")
    assert kinds(reg, "rl") == {1: "full", 2: "delta", 3: "delta", 4: "delta", 5: "delta"}
    plan = reg.plan_retention("rl", KeepLast(2))
    assert list(plan.keep) == [1, 2, 3, 4, 5] and not plan.delete
    assert "base of delta step 4" in plan.keep[3] and "base of delta step 2" in plan.keep[1]
    assert all(d.protected for d in plan.decisions if d.step in (1, 2, 3))
    assert not plan.execute().deleted
    reg.publish("rl", 6, state, policy_version=6, delta=False)  # a full: the old chain is no one's base now
    state = step_of(state, 0.01, 7)
    reg.publish("rl", 7, state, policy_version=7, delta="auto")
    result = reg.plan_retention("rl", KeepLast(2)).execute()
    assert result.deleted == (1, 2, 3, 4, 5)
    assert_same(reg.load("rl@pv:7").state_dict, state)


# ---------------------------------------------------------------------------------------------------- folds, markers


def test_fold_stores_a_checked_delta_between_two_versions(reg: Registry) -> None:
    states = {1: policy_state(18)}
    reg.publish("rl", 10, states[1], policy_version=1, delta="auto")
    for v in (2, 3, 4):
        states[v] = step_of(states[v - 1], 0.02, v)
        reg.publish("rl", v * 10, states[v], policy_version=v, delta="auto")
    got = reg.fold("rl", 2, 4)
    assert got.path == reg.store.root / "rl" / ".policy-folds" / "20-40.delta.safetensors" and got.path.is_file()
    data = got.path.read_bytes()
    assert len(data) == got.size and got.target_sha256 == deltas.full_sha256(states[4])
    assert_same(deltas.decode(states[2], data), states[4])
    assert [(f.from_step, f.to_step, f.status) for f in folds(reg.catalog, "rl")] == [(20, 40, "verified")]
    report = reg.fsck()
    assert not report.problems, report.problems
    with pytest.raises(CheckpointNotFoundError):
        reg.fold("rl", 2, 9)
    with pytest.raises(InvalidStateError):
        reg.fold("rl", 2, 2)


def test_a_marker_records_a_version_published_elsewhere(reg: Registry) -> None:
    reg.publish("rl", 1, policy_state(19), policy_version=1, delta="auto")
    marker = reg.publish_policy_marker("rl", 2, note="sent over NCCL")
    assert (marker.version, marker.note) == (2, "sent over NCCL")
    assert [(m.version, m.note) for m in markers(reg.catalog, "rl")] == [(2, "sent over NCCL")]
    with pytest.raises(PolicyVersionConflictError, match="stored as step 1"):
        reg.publish_policy_marker("rl", 1)


# ---------------------------------------------------------------------------------------------------- object store


def test_delta_publish_load_and_materialize_on_an_object_store(migrated_url: str, s3_root: str,
                                                               tmp_path: Path) -> None:
    with Registry.open(migrated_url, s3_root) as reg:
        base = policy_state(20)
        target = step_of(base, 0.03, 1)
        reg.publish("rl", 1, base, policy_version=1, delta="auto", config={"a": 1})
        reg.publish("rl", 2, target, policy_version=2, delta="auto", config={"a": 1})
        assert kinds(reg, "rl") == {1: "full", 2: "delta"}
        assert_same(reg.load("rl@latest-policy").state_dict, target)
        out = reg.materialize("rl@pv:2", tmp_path / "serve")
        import hashlib
        assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == deltas.full_sha256(target)
    with Registry.open(migrated_url, s3_root) as fresh:  # the base read back from the bucket
        nxt = step_of(target, 0.03, 2)
        fresh.publish("rl", 3, nxt, policy_version=3, delta=True)
        assert_same(fresh.load("rl@3").state_dict, nxt)


def test_checkout_and_diff_of_a_delta_step(reg: Registry, tmp_path: Path) -> None:
    import safetensors.torch as st
    base = policy_state(21)
    target = step_of(base, 0.02, 1)
    reg.publish("rl", 1, base, policy_version=1, delta="auto", config={"c": 1})
    reg.publish("rl", 2, target, policy_version=2, delta="auto", config={"c": 1})
    full = reg.publish("plain", 2, target, policy_version=2, config={"c": 1})
    with reg.checkout("rl@pv:2", tmp_path / "co") as co:
        names = sorted(p.name for p in Path(co).iterdir())
        assert "delta.safetensors" not in names and "model.safetensors" in names
        assert (Path(co) / "model.safetensors").read_bytes() == (full.path / "model.safetensors").read_bytes()
        assert_same(st.load_file(str(Path(co) / "model.safetensors")), target)
    changed = reg.diff("rl@1", "rl@2")
    assert {t.name for t in changed.tensors} == {"layer.0.weight", "layer.1.weight"}
    assert all(t.change == "content" for t in changed.tensors) and changed.unchanged_tensors == 2
    assert not reg.diff("rl@2", "plain@2").tensors
    assert not reg.diff("plain@2", "rl@2").tensors


def test_a_delta_directory_read_without_the_catalog_is_refused_never_empty(reg: Registry) -> None:
    from registry import Checkpoint
    base = policy_state(22)
    reg.publish("rl", 1, base, policy_version=1, delta="auto")
    info = reg.publish("rl", 2, step_of(base, 0.01, 1), policy_version=2, delta="auto")
    with pytest.raises(InvalidStateError, match="policy delta step"):
        Checkpoint.load(info.path)


def test_delta_steps_on_a_tiered_root(treg: Registry, tmp_path: Path) -> None:
    base = policy_state(23)
    target = step_of(base, 0.02, 1)
    treg.publish("rl", 1, base, policy_version=1, delta="auto")
    treg.publish("rl", 2, target, policy_version=2, delta="auto", durable=True)
    assert kinds(treg, "rl") == {1: "full", 2: "delta"}
    assert_same(treg.load("rl@pv:2").state_dict, target)
    out = treg.materialize("rl@latest-policy", tmp_path / "serve")
    import hashlib
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == deltas.full_sha256(target)


def test_materialize_over_the_version_dest_holds_applies_only_the_newer_deltas(reg: Registry, tmp_path: Path) -> None:
    states = {1: policy_state(24)}
    reg.publish("rl", 1, states[1], policy_version=1, delta="auto")
    for v in (2, 3):
        states[v] = step_of(states[v - 1], 0.02, v)
        reg.publish("rl", v, states[v], policy_version=v, delta="auto")
    full = {v: reg.publish("plain", v, states[v], policy_version=v) for v in (2, 3)}
    dest = tmp_path / "serve"
    reg.materialize("rl@pv:2", dest)
    weights = reg.resolve("rl@1").path / "model.safetensors"  # the chain's full: not needed from here on
    os.chmod(weights, 0o644)
    weights.write_bytes(b"\0" * weights.stat().st_size)
    reg.materialize("rl@pv:3", dest)
    assert (dest / "model.safetensors").read_bytes() == (full[3].path / "model.safetensors").read_bytes()
    assert reg.catalog.get("rl", 1).status == "verified"  # type: ignore[union-attr]
    reg.materialize("rl@pv:3", dest)  # holds it already: nothing to rebuild
    assert (dest / "model.safetensors").read_bytes() == (full[3].path / "model.safetensors").read_bytes()
    (dest / "model.safetensors").write_bytes(b"not a safetensors file")  # whatever it holds, never trusted
    with pytest.raises(CorruptCheckpointError, match="base step 1 is (damaged|corrupt)"):
        reg.materialize("rl@pv:3", dest)  # the chain's full is damaged: now it is read, and caught
    assert reg.catalog.get("rl", 1).status == "corrupt"  # type: ignore[union-attr]


def patch_states(seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Versions 1 to 3 of a state with a bool mask and an int64 counter besides bf16 and fp32, all changing."""
    states = {1: {**policy_state(seed), "mask": torch.zeros(77, dtype=torch.bool)}}
    for v in (2, 3):
        states[v] = step_of(states[v - 1], 0.03, seed + v)
        states[v]["mask"] = states[v - 1]["mask"].clone()
        states[v]["mask"][v::5] = True
        states[v]["step"] = torch.tensor(v, dtype=torch.int64)
    return states


def test_materialize_patches_the_file_dest_holds_into_the_next_version(reg: Registry, tmp_path: Path) -> None:
    from registry.ops.materialize import held_digest, materialize_patched
    states = patch_states(42)
    for v in (1, 2, 3):
        reg.publish("rl", v, states[v], policy_version=v, delta="auto", config={"v": v})
    assert kinds(reg, "rl") == {1: "full", 2: "delta", 3: "delta"}
    full = {v: reg.publish("plain", v, states[v], policy_version=v, config={"v": v}) for v in (2, 3)}
    dest = tmp_path / "serve"
    reg.materialize("rl@pv:1", dest)
    assert held_digest(dest) == deltas.full_sha256(states[1])  # recorded as written: nothing to hash next time
    weights = reg.resolve("rl@1").path / "model.safetensors"  # the chain's full: a patch never reads it
    os.chmod(weights, 0o644)
    weights.write_bytes(b"\0" * weights.stat().st_size)
    assert materialize_patched(reg._reader(), reg.resolve("rl@2"), dest, held_digest(dest) or "") == dest
    for name in ("model.safetensors", "config.json"):
        assert (dest / name).read_bytes() == (full[2].path / name).read_bytes(), name
    assert held_digest(dest) == deltas.full_sha256(states[2])
    reg.materialize("rl@pv:3", dest)
    for name in ("model.safetensors", "config.json"):
        assert (dest / name).read_bytes() == (full[3].path / name).read_bytes(), name
    assert not [p for p in dest.iterdir() if p.name.startswith(".")]
    assert reg.catalog.get("rl", 1).status == "verified"  # type: ignore[union-attr]


@pytest.mark.parametrize("where", ["header", "tensor"])
def test_a_held_file_changed_behind_its_record_is_never_patched_into_the_result(reg: Registry, tmp_path: Path,
                                                                                where: str) -> None:
    """Changed in place with its mtime put back, the file still reads as the version recorded on it: the patch
    path tries it, the copy fails the version's digest (or the layout check) and is dropped, and materialize
    writes the version the full way."""
    from registry.ops.materialize import held_digest, materialize_patched
    states = patch_states(43)
    for v in (1, 2):
        reg.publish("rl", v, states[v], policy_version=v, delta="auto")
    full = reg.publish("plain", 2, states[2], policy_version=2)
    dest = tmp_path / "serve"
    reg.materialize("rl@pv:1", dest)
    held = dest / "model.safetensors"
    before = held.stat()
    with open(held, "r+b") as f:
        f.seek(20 if where == "header" else before.st_size - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    os.utime(held, ns=(before.st_atime_ns, before.st_mtime_ns))
    tampered = held.read_bytes()
    assert held_digest(dest) == deltas.full_sha256(states[1])
    assert materialize_patched(reg._reader(), reg.resolve("rl@2"), dest, deltas.full_sha256(states[1])) is None
    assert held.read_bytes() == tampered and not [p for p in dest.iterdir() if p.name.startswith(".")]
    reg.materialize("rl@pv:2", dest)
    assert held.read_bytes() == (full.path / "model.safetensors").read_bytes()
    assert held_digest(dest) == deltas.full_sha256(states[2])


def test_a_materialize_killed_while_patching_leaves_the_held_file_whole(reg: Registry, migrated_url: str,
                                                                        root: Path, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO, child_env
    states = patch_states(44)
    for v in (1, 2):
        reg.publish("rl", v, states[v], policy_version=v, delta="auto")
    full = reg.publish("plain", 2, states[2], policy_version=2)
    dest = tmp_path / "serve"
    reg.materialize("rl@pv:1", dest)
    old = (dest / "model.safetensors").read_bytes()
    code = ("import sys\nfrom registry import Registry\n"
            "with Registry.open(url=sys.argv[1], root=sys.argv[2]) as reg:\n"
            "    reg.materialize('rl@pv:2', sys.argv[3])")
    proc = subprocess.run([sys.executable, "-c", code, migrated_url, str(root), str(dest)], cwd=REPO,
                          env={**child_env(), "REGISTRY_CRASH_AT": "materialize-patch-midway"},
                          capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert (dest / "model.safetensors").read_bytes() == old
    assert [p for p in dest.iterdir() if p.name.startswith(".model.safetensors.tmp-")]  # its copy, never renamed
    reg.materialize("rl@pv:2", dest)
    assert (dest / "model.safetensors").read_bytes() == (full.path / "model.safetensors").read_bytes()


def test_fsck_adopting_a_delta_step_recovers_its_chain_from_the_manifest(reg: Registry) -> None:
    from sqlalchemy import delete, select

    from registry.catalog.models import CheckpointRow, Run
    base = policy_state(25)
    target = step_of(base, 0.02, 1)
    reg.publish("rl", 1, base, policy_version=1, delta="auto")
    info = reg.publish("rl", 2, target, policy_version=2, delta="auto")
    manifest = (info.path / "manifest.json").read_text()
    assert '"policy_delta"' in manifest
    with reg.catalog.engine.begin() as conn:  # the commit that never happened: the payload is there, no row
        run_id = conn.scalar(select(Run.c.id).where(Run.c.name == "rl"))
        conn.execute(delete(CheckpointRow).where(CheckpointRow.c.run_id == run_id, CheckpointRow.c.step == 2))
    assert 2 not in kinds(reg, "rl")
    report = reg.fsck(repair=True)
    assert [p.kind for p in report.problems] == ["unregistered-checkpoint"], report.problems
    row = policy_steps(reg.catalog, "rl")[2]
    assert (row.kind, row.base_step, row.full_sha256) == ("delta", 1, deltas.full_sha256(target))
    assert_same(reg.load("rl@2").state_dict, target)


def test_the_commit_refuses_a_second_set_of_weights_for_a_version(reg: Registry) -> None:
    """What two racing trainers meet: the check inside the commit transaction, whoever planned first."""
    from sqlalchemy import select

    from registry.catalog.models import CheckpointRow, Run
    from registry.catalog.policy import record_policy_step
    from registry.catalog.records import PolicyRecord
    reg.publish("rl", 1, policy_state(26), policy_version=4, delta=False)
    reg.publish("rl", 2, policy_state(27), policy_version=4)  # a plain publish: versions may repeat there
    with pytest.raises(PolicyVersionConflictError, match="already step 1"), reg.catalog.engine.begin() as conn:
        run_id = conn.scalar(select(Run.c.id).where(Run.c.name == "rl"))
        cid = conn.scalar(select(CheckpointRow.c.id).where(CheckpointRow.c.run_id == run_id,
                                                           CheckpointRow.c.step == 2))
        record_policy_step(conn, checkpoint_id=cid, run_id=run_id,
                           record=PolicyRecord(kind="full", full_sha256="0" * 64, immutable=True))
    assert kinds(reg, "rl") == {1: "full", 2: "full"}  # rolled back with the transaction


def test_materialize_uses_a_fold_from_the_version_dest_holds(reg: Registry, tmp_path: Path) -> None:
    states = {1: policy_state(28)}
    reg.publish("rl", 10, states[1], policy_version=1, delta="auto")
    for v in (2, 3, 4):
        states[v] = step_of(states[v - 1], 0.02, v)
        reg.publish("rl", v * 10, states[v], policy_version=v, delta="auto")
    dest = tmp_path / "serve"
    reg.materialize("rl@pv:2", dest)
    reg.fold("rl", 2, 4)
    damaged = reg.resolve("rl@30").path / "delta.safetensors"  # the chain from 2 to 4 passes through it
    os.chmod(damaged, 0o644)
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    reg.materialize("rl@pv:4", dest)  # one decode of the fold from what dest holds: step 30 never read
    import hashlib
    assert hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest() == deltas.full_sha256(states[4])
    assert reg.catalog.get("rl", 30).status == "verified"  # type: ignore[union-attr]


def test_a_broadcast_load_of_a_delta_step_gives_every_rank_the_full_tensors(catalog_url: str, tmp_path: Path) -> None:
    """Two real gloo ranks (``tests._dist_worker``): rank 0 rebuilds the chain and sends the tensors; a damaged
    delta at ``@latest-policy`` falls back for everyone alike; a delta directory without the catalog is refused."""
    import json

    from tests._dist_worker import checkpoint_fingerprint
    from tests.helpers import run_ranks
    root = tmp_path / "ckpt"
    expected = {}
    with Registry.open(catalog_url, root) as reg:
        state = policy_state(29)
        for v in range(1, 5):
            state = step_of(state, 0.02, v)
            reg.publish("rl", v, state, policy_version=v, delta="auto", config={"v": v})
        for ref in ("rl@pv:3", "rl@3"):
            expected[ref] = checkpoint_fingerprint(reg.load(ref))
        delta_dir = str(reg.resolve("rl@4").path)
        damaged = reg.resolve("rl@4").path / "delta.safetensors"
        os.chmod(damaged, 0o644)
    out = tmp_path / "out"
    out.mkdir()
    scenarios = [{"name": "broadcast", "ref": "rl@pv:3", "strategy": "broadcast"},
                 {"name": "shared-fs", "ref": "rl@pv:3", "strategy": "shared-fs"}]
    spec = {"url": catalog_url, "root": str(root), "out": str(out), "scenarios": scenarios}
    (out / "spec.json").write_text(json.dumps(spec))
    assert run_ranks("tests._dist_worker", 2, out / "spec.json", deadline_s=120) == [0, 0]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["broadcast"]["ok"] and r["broadcast"]["fp"] == expected["rl@pv:3"], r
        assert r["shared-fs"]["ok"] and r["shared-fs"]["fp"] == expected["rl@pv:3"], r
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    scenarios = [{"name": "fallback", "ref": "rl@latest-policy", "strategy": "broadcast"},
                 {"name": "dir", "dir": delta_dir, "strategy": "broadcast"}]
    spec["scenarios"] = scenarios
    (out / "spec.json").write_text(json.dumps(spec))
    for r in range(2):
        (out / f"rank{r}.json").unlink()
    assert run_ranks("tests._dist_worker", 2, out / "spec.json", deadline_s=120) == [0, 0]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["fallback"]["ok"] and r["fallback"]["step"] == 3 and r["fallback"]["fp"] == expected["rl@3"], r
        assert not r["dir"]["ok"] and r["dir"]["type"] in ("InvalidStateError", "CorruptCheckpointError"), r
