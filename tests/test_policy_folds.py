"""Policy folds follow their steps: retention and fsck remove a fold whose step is gone, a damaged fold is marked
corrupt and never used, and folds live on every kind of root (a directory, ``s3://``, a tiered root's durable
tier)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from registry import CheckpointNotFoundError, Registry
from registry.catalog.policy import folds
from registry.catalog.retention import RetentionCatalog
from registry.format import delta as deltas
from registry.retention import KeepLast
from tests.test_policy_publish import assert_same, policy_state, step_of

FOLD = "rl/.policy-folds/20-40.delta.safetensors"


def _publish_four(reg: Registry, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Versions 1..4 of ``rl`` at steps 10..40: a full, then three deltas."""
    states = {1: policy_state(seed)}
    reg.publish("rl", 10, states[1], policy_version=1, delta="auto")
    for v in (2, 3, 4):
        states[v] = step_of(states[v - 1], 0.02, v)
        reg.publish("rl", v * 10, states[v], policy_version=v, delta="auto")
    return states


def _statuses(reg: Registry) -> list[tuple[int, int, str]]:
    return [(f.from_step, f.to_step, f.status) for f in folds(reg.catalog, "rl")]


def _kinds(report: object) -> list[tuple[str, int]]:
    return [(p.kind, p.step) for p in report.problems]  # type: ignore[attr-defined]


def _stored(reg: Registry) -> list[str]:
    return reg.root.aside().names("rl/.policy-folds")


def test_retention_deletes_a_fold_with_its_step(reg: Registry) -> None:
    _publish_four(reg, 30)
    reg.fold("rl", 2, 4)
    reg.fold("rl", 3, 4)
    five = policy_state(31)
    reg.publish("rl", 50, five, policy_version=5, delta=False)  # a full: the old chain is no one's base
    reg.publish("rl", 60, step_of(five, 0.02, 6), policy_version=6, delta="auto")
    reg.fold("rl", 5, 6)
    assert reg.plan_retention("rl", KeepLast(2)).execute().deleted == (10, 20, 30, 40)
    assert _statuses(reg) == [(20, 40, "deleted"), (30, 40, "deleted"), (50, 60, "verified")]
    assert _stored(reg) == ["rl/.policy-folds/50-60.delta.safetensors"]
    assert not reg.fsck().problems


def test_a_deletion_killed_before_the_fold_went_leaves_an_orphan_fsck_removes(reg: Registry) -> None:
    _publish_four(reg, 32)
    reg.fold("rl", 2, 4)
    reg.publish("rl", 50, policy_state(33), policy_version=5, delta=False)
    # the marking transaction alone, as a gc killed right after it leaves things
    RetentionCatalog(reg.catalog).mark_deleted("rl", lambda snap: {40: "test"}, actor="test")
    assert _statuses(reg) == [(20, 40, "deleted")] and _stored(reg) == [FOLD]
    report = reg.fsck()
    assert ("orphan-fold", 20) in _kinds(report) and not report.repaired
    assert _stored(reg) == [FOLD]  # plain fsck changes nothing
    repaired = reg.fsck(repair=True)
    assert ("orphan-fold", 20) in [(p.kind, p.step) for p in repaired.repaired]
    assert _stored(reg) == [] and not reg.fsck().problems


def test_a_step_deleted_other_than_by_retention_orphans_its_fold(reg: Registry) -> None:
    _publish_four(reg, 34)
    reg.fold("rl", 2, 4)
    reg.catalog.set_status("rl", 20, "deleted", kind="delete", actor="test")
    assert _statuses(reg) == [(20, 40, "verified")]
    assert ("orphan-fold", 20) in _kinds(reg.fsck())
    reg.fsck(repair=True)
    assert _statuses(reg) == [(20, 40, "deleted")] and _stored(reg) == []


def test_a_damaged_fold_is_marked_corrupt_and_never_used(reg: Registry, tmp_path: Path) -> None:
    states = _publish_four(reg, 36)
    dest = tmp_path / "serve"
    reg.materialize("rl@pv:2", dest)
    reg.fold("rl", 2, 4)
    aside = reg.root.aside()
    data = bytearray(aside.get(FOLD))
    data[-1] ^= 0xFF
    aside.put(FOLD, bytes(data))
    reg.materialize("rl@pv:4", dest)  # from the chain: the fold is not trusted
    assert hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest() == deltas.full_sha256(states[4])
    assert _statuses(reg) == [(20, 40, "corrupt")]
    with pytest.raises(CheckpointNotFoundError, match="no stored fold"):
        reg.fold_bytes("rl", 2, 4)
    assert ("orphan-fold", 20) in _kinds(reg.fsck())
    reg.fsck(repair=True)
    assert _stored(reg) == []


def test_a_fold_that_cannot_be_read_is_not_corrupt(reg: Registry, tmp_path: Path) -> None:
    states = _publish_four(reg, 38)
    dest = tmp_path / "serve"
    reg.materialize("rl@pv:2", dest)
    reg.fold("rl", 2, 4)
    assert reg.root.aside().delete(FOLD)
    reg.materialize("rl@pv:4", dest)
    assert hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest() == deltas.full_sha256(states[4])
    assert _statuses(reg) == [(20, 40, "verified")]


def _fold_is_used(reg: Registry, states: dict[int, dict[str, torch.Tensor]], dest: Path) -> None:
    """A materialize from version 2 to 4 that can only have gone through the fold: step 30's delta is damaged."""
    from tests.helpers import flip_stored_byte
    flip_stored_byte(reg, reg.resolve("rl@30"), "delta.safetensors")
    reg.materialize("rl@pv:4", dest)
    assert hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest() == deltas.full_sha256(states[4])
    assert reg.catalog.get("rl", 30).status == "verified"  # type: ignore[union-attr]


def test_a_fold_is_used_from_the_version_dest_holds(reg: Registry, tmp_path: Path) -> None:
    states = _publish_four(reg, 40)
    dest = tmp_path / "serve"
    reg.materialize("rl@pv:2", dest)
    reg.fold("rl", 2, 4)
    _fold_is_used(reg, states, dest)


def test_folds_on_an_object_store(migrated_url: str, s3_root: str, tmp_path: Path) -> None:
    with Registry.open(migrated_url, s3_root) as reg:
        states = _publish_four(reg, 42)
        dest = tmp_path / "serve"
        reg.materialize("rl@pv:2", dest)
        got = reg.fold("rl", 2, 4)
        assert got.path is None and got.url == f"{s3_root}/{FOLD}"
        data = reg.root.aside().get(FOLD)
        assert len(data) == got.size and hashlib.sha256(data).hexdigest() == got.sha256
        assert_same(deltas.decode(states[2], data), states[4])
        assert reg.fold("rl", 2, 4).sha256 == got.sha256  # folding again: the same object, kept
        assert reg.fold_bytes("rl", 2, 4) == data
        assert not reg.fsck().problems
        _fold_is_used(reg, states, dest)
        reg.publish("rl", 50, policy_state(43), policy_version=5, delta=False)
        assert 20 in reg.plan_retention("rl", KeepLast(1)).execute().deleted
        assert _stored(reg) == [] and _statuses(reg) == [(20, 40, "deleted")]
        # an orphan object (a fold whose write died before its row) is found and removed
        reg.root.aside().put("rl/.policy-folds/30-40.delta.safetensors", b"half a fold")
        assert ("orphan-fold", 30) in _kinds(reg.fsck())
        reg.fsck(repair=True)
        assert _stored(reg) == []


def test_folds_on_a_tiered_root_live_on_its_durable_tier(treg: Registry, tmp_path: Path) -> None:
    states = _publish_four(treg, 44)
    got = treg.fold("rl", 2, 4)
    assert got.url == treg.root.tiered().durable.url + "/" + FOLD  # type: ignore[union-attr]
    assert not (treg.root.local_dir / FOLD).exists()  # type: ignore[operator]
    dest = tmp_path / "serve"
    treg.materialize("rl@pv:2", dest)
    treg.materialize("rl@pv:4", dest)
    assert hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest() == deltas.full_sha256(states[4])


def test_a_fold_of_a_step_deleted_meanwhile_is_not_recorded(reg: Registry) -> None:
    from registry.catalog.policy import FoldRecord, record_fold
    _publish_four(reg, 46)
    reg.fold("rl", 2, 4)
    assert reg.fold_bytes("rl", 2, 4) == reg.root.aside().get(FOLD)
    reg.catalog.set_status("rl", 30, "deleted", kind="delete", actor="test")
    with pytest.raises(CheckpointNotFoundError, match="deleted while being folded"):
        record_fold(reg.catalog, FoldRecord(run="rl", from_step=30, to_step=40, path="rl/.policy-folds/30-40.x",
                                            size=1, sha256="0" * 64, status="verified", created_at=None))
    assert _statuses(reg) == [(20, 40, "verified")]


def test_retention_on_a_tiered_root_deletes_the_durable_fold(treg: Registry) -> None:
    _publish_four(treg, 48)
    treg.fold("rl", 2, 4)
    assert _stored(treg) == [FOLD]
    treg.publish("rl", 50, policy_state(49), policy_version=5, delta=False)
    treg.replicate("rl", wait=True)
    for tier in ("fast", "durable"):
        treg.plan_tier_retention("rl", KeepLast(1), tier=tier).execute()
    assert _statuses(treg) == [(20, 40, "deleted")] and _stored(treg) == []


def test_fsck_on_a_tiered_root_finds_an_orphan_fold_on_the_durable_tier(treg: Registry) -> None:
    """A fold object on the durable tier that no row names (its write died before its row) is an ``orphan-fold``
    of the tiered root's fsck, removed by ``--repair``; a usable fold is left alone."""
    _publish_four(treg, 50)
    treg.fold("rl", 2, 4)
    treg.root.aside().put("rl/.policy-folds/30-40.delta.safetensors", b"half a fold")
    report = treg.fsck()
    assert ("orphan-fold", 30) in _kinds(report)
    assert [p.url for p in report.problems if p.kind == "orphan-fold"] == [
        treg.root.tiered().durable.url + "/rl/.policy-folds/30-40.delta.safetensors"]  # type: ignore[union-attr]
    treg.fsck(repair=True)
    assert _stored(treg) == [FOLD] and not [p for p in treg.fsck().problems if p.kind == "orphan-fold"]
