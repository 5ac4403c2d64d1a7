"""Re-anchoring a policy delta step: its version stored whole beside it, so it reads without its chain and
retention may take the chain's older steps, with the step itself (row, payload, tags, metrics, leases) untouched.

Real catalogs (both), real files, a real S3 server for the object-store and tiered roots.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from registry import InvalidStateError, Registry
from registry.catalog.policy import folds
from registry.format import delta as deltas
from registry.format.pieces import PIECE_SIZE, piece_digests
from registry.fs import multipart
from registry.retention import KeepLast
from registry.roots.aside import ObjectAside
from tests.test_policy_publish import assert_same, kinds, policy_state, step_of

ANCHOR = "rl/.policy-folds/50-50.full.safetensors"


def _publish_five(reg: Registry, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Versions 1..5 of ``rl`` at steps 10..50: a full, then four deltas."""
    states = {1: policy_state(seed)}
    reg.publish("rl", 10, states[1], policy_version=1, delta="auto")
    for v in (2, 3, 4, 5):
        states[v] = step_of(states[v - 1], 0.02, v)
        reg.publish("rl", v * 10, states[v], policy_version=v, delta="auto")
    assert kinds(reg, "rl") == {10: "full", 20: "delta", 30: "delta", 40: "delta", 50: "delta"}
    return states


def _full_bytes(state: dict[str, torch.Tensor], tmp: Path) -> bytes:
    """The ``model.safetensors`` a full publish of ``state`` writes."""
    with Registry.open(url=f"sqlite:///{tmp / 'other.db'}", root=tmp / "other") as other:
        info = other.publish("x", 1, state)
        return (info.path / "model.safetensors").read_bytes()


def test_a_reanchored_step_keeps_everything_and_retention_takes_its_chain(reg: Registry, tmp_path: Path) -> None:
    states = _publish_five(reg, 60)
    reg.tag("rl", 50, "serving")
    reg.log_metrics("rl", 50, {"reward": 0.5}, flush=True)
    before = reg.resolve("rl@50")
    lease = reg.catalog.acquire_lease("rl", 50, holder="rollout-1", ttl=timedelta(minutes=5))
    plan = reg.plan_retention("rl", KeepLast(1))
    assert plan.anchorable == (50,) and list(plan.keep) == [10, 20, 30, 40, 50] and not plan.delete
    assert "base of delta step 50" in plan.keep[40]
    plan = reg.plan_retention("rl", KeepLast(1), reanchor=True)
    assert not plan.anchorable and list(plan.keep) == [50] and list(plan.delete) == [10, 20, 30, 40]
    assert [(f.from_step, f.to_step, f.status) for f in folds(reg.catalog, "rl")] == [(50, 50, "verified")]
    assert reg.root.aside().get(ANCHOR) == _full_bytes(states[5], tmp_path)  # the very bytes a full publish writes
    assert plan.execute().deleted == (10, 20, 30, 40)
    after = reg.resolve("rl@50")  # the step itself never moved
    assert (after.manifest_sha256, after.status, after.policy_version) == (before.manifest_sha256, "verified", 5)
    assert after.tags == ("serving",) and [(m.step, m.value) for m in reg.metrics("rl", "reward")] == [(50, 0.5)]
    assert kinds(reg, "rl")[50] == "delta" and lease is not None and reg.catalog.lease_live(lease)
    reg.catalog.release_lease(lease)
    assert_same(reg.load("rl@latest-policy").state_dict, states[5])
    dest = reg.materialize("rl@pv:5", tmp_path / "serve")
    assert hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest() == deltas.full_sha256(states[5])
    six = step_of(states[5], 0.02, 6)  # a delta on the anchored step: its chain starts at the anchor
    reg.publish("rl", 60, six, policy_version=6, delta=True)
    with Registry.open(url=reg.url, root=reg.root_url) as fresh:  # nothing held in memory: the anchor is read
        assert_same(fresh.load("rl@pv:6").state_dict, six)
    assert [r.ok for r in reg.verify("rl")] == [True, True] and not reg.fsck().problems
    reg.publish("rl", 70, policy_state(61), policy_version=7, delta=False)
    assert reg.plan_retention("rl", KeepLast(1)).execute().deleted == (60,)  # 50 is tagged
    reg.untag("rl", "serving")
    assert reg.plan_retention("rl", KeepLast(1)).execute().deleted == (50,)
    assert [(f.to_step, f.status) for f in folds(reg.catalog, "rl")] == [(50, "deleted")]
    assert reg.root.aside().names("rl/.policy-folds") == [] and not reg.fsck().problems


def test_a_damaged_anchor_is_never_used_and_its_chain_is_kept_again(reg: Registry) -> None:
    states = _publish_five(reg, 62)
    anchor = reg.reanchor("rl", 5)
    assert (anchor.step, anchor.path, anchor.sha256) == (50, reg.root.aside().local(ANCHOR),
                                                         deltas.full_sha256(states[5]))
    assert reg.reanchor("rl", 5) == anchor  # stored and readable already: kept
    assert anchor.path is not None
    data = bytearray(anchor.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    anchor.path.write_bytes(bytes(data))
    assert_same(reg.load("rl@50").state_dict, states[5])  # read around, from the chain; the anchor marked
    assert [(f.to_step, f.status) for f in folds(reg.catalog, "rl")] == [(50, "corrupt")]
    assert reg.catalog.get("rl", 50).status == "verified"  # type: ignore[union-attr]
    plan = reg.plan_retention("rl", KeepLast(1))
    assert list(plan.keep) == [10, 20, 30, 40, 50] and plan.anchorable == (50,)
    report = reg.fsck(repair=True)
    assert [(p.kind, p.step) for p in report.problems] == [("orphan-fold", 50)]
    assert reg.plan_retention("rl", KeepLast(1), reanchor=True).execute().deleted == (10, 20, 30, 40)
    assert_same(reg.load("rl@50").state_dict, states[5])


def test_an_anchor_write_killed_midway_is_left_while_its_step_is_leased_then_removed(reg: Registry) -> None:
    states = _publish_five(reg, 67)
    aside = reg.root.aside()
    killed = aside.writer(ANCHOR)  # a re-anchor killed mid-write: neither committed nor aborted
    killed.write(b"part of a model")
    assert aside.names("rl/.policy-folds") == []  # never taken for a stored file
    lease = reg.catalog.acquire_lease("rl", 50, holder="reanchor-in-flight", ttl=timedelta(minutes=5))
    assert lease is not None
    report = reg.fsck(repair=True)  # the writer's lease: a write in flight, left alone
    assert not report.problems and [(p.kind, p.step) for p in report.in_progress] == [("in-progress", 50)]
    assert len(aside.unfinished("rl/.policy-folds")) == 1
    reg.catalog.release_lease(lease)
    report = reg.fsck()
    assert [(p.kind, p.step) for p in report.problems] == [("orphan-fold", 50)] and not report.repaired
    assert "never completed" in report.problems[0].detail and len(aside.unfinished("rl/.policy-folds")) == 1
    assert [(p.kind, p.step) for p in reg.fsck(repair=True).repaired] == [("orphan-fold", 50)]
    assert aside.unfinished("rl/.policy-folds") == [] and not reg.fsck().problems
    killed.abort()  # this test's handle on the removed file
    anchor = reg.reanchor("rl", 5)  # the step, its chain and a new re-anchor are as if nothing happened
    assert aside.names("rl/.policy-folds") == [ANCHOR] and anchor.sha256 == deltas.full_sha256(states[5])
    assert_same(reg.load("rl@50").state_dict, states[5])


def test_an_anchor_that_does_not_hash_to_its_version_is_never_stored(reg: Registry) -> None:
    from registry import CorruptCheckpointError
    from registry.ops.folds import _write_whole
    states = _publish_five(reg, 68)
    aside = reg.root.aside()
    with pytest.raises(CorruptCheckpointError, match="nothing was stored"):
        _write_whole(aside, ANCHOR, states[4], expected=deltas.full_sha256(states[5]), what="version 5", run="rl",
                     step=50)
    assert aside.names("rl/.policy-folds") == [] and aside.unfinished("rl/.policy-folds") == []
    size, digest, pieces = _write_whole(aside, ANCHOR, states[5], expected=deltas.full_sha256(states[5]),
                                        what="version 5", run="rl", step=50)
    assert (size, digest) == (len(aside.get(ANCHOR)), hashlib.sha256(aside.get(ANCHOR)).hexdigest())
    assert pieces == piece_digests(aside.get(ANCHOR), PIECE_SIZE)
    assert aside.get(ANCHOR) == b"".join(bytes(b) for b in aside.chunks(ANCHOR))


def test_a_truncated_anchor_is_read_again_then_marked_corrupt_and_the_chain_read(reg: Registry) -> None:
    states = _publish_five(reg, 69)
    anchor = reg.reanchor("rl", 5)
    assert anchor.path is not None
    with open(anchor.path, "r+b") as f:
        f.truncate(anchor.size - 1)
    assert_same(reg.load("rl@50").state_dict, states[5])
    assert [(f.to_step, f.status) for f in folds(reg.catalog, "rl")] == [(50, "corrupt")]
    assert reg.catalog.get("rl", 50).status == "verified"  # type: ignore[union-attr]


def test_an_anchor_is_checked_by_its_pieces_and_a_row_without_them_by_its_sha256(reg: Registry) -> None:
    from sqlalchemy import update

    from registry.catalog.models import PolicyFold
    states = _publish_five(reg, 70)
    anchor = reg.reanchor("rl", 5)
    (row,) = folds(reg.catalog, "rl")
    assert anchor.path is not None and row.piece_size == PIECE_SIZE
    assert row.xxh3_128_pieces == piece_digests(anchor.path.read_bytes(), PIECE_SIZE)
    for unusable in ('{"piece_size": true, "xxh3_128": ["a"]}', "not json"):  # no pieces: its sha256 checks it
        reg.catalog.write(lambda conn, u=unusable: conn.execute(update(PolicyFold).values(pieces=u)))
        assert folds(reg.catalog, "rl")[0].xxh3_128_pieces is None
    reg.catalog.write(lambda conn: conn.execute(update(PolicyFold).values(pieces=None)))  # a row from before them
    assert folds(reg.catalog, "rl")[0].xxh3_128_pieces is None
    with Registry.open(url=reg.url, root=reg.root_url) as fresh:  # read from the anchor, checked by its sha256
        assert_same(fresh.load("rl@50").state_dict, states[5])
    assert [(f.to_step, f.status) for f in folds(reg.catalog, "rl")] == [(50, "verified")]
    data = bytearray(anchor.path.read_bytes())
    data[-1] ^= 0x01
    anchor.path.write_bytes(bytes(data))
    with Registry.open(url=reg.url, root=reg.root_url) as fresh:
        assert_same(fresh.load("rl@50").state_dict, states[5])  # from the chain
    assert [(f.to_step, f.status) for f in folds(reg.catalog, "rl")] == [(50, "corrupt")]


def test_reanchoring_a_full_is_refused(reg: Registry) -> None:
    reg.publish("rl", 10, policy_state(63), policy_version=1, delta="auto")
    with pytest.raises(InvalidStateError, match="stored whole already"):
        reg.reanchor("rl", 1)
    assert folds(reg.catalog, "rl") == []


def test_anchors_on_an_object_store(migrated_url: str, s3_root: str) -> None:
    with Registry.open(migrated_url, s3_root) as reg:
        states = _publish_five(reg, 64)
        assert reg.apply_retention("rl", KeepLast(1), reanchor=True).deleted == (10, 20, 30, 40)
        aside = reg.root.aside()
        assert aside.names("rl/.policy-folds") == [ANCHOR]
        assert_same(reg.load("rl@latest-policy").state_dict, states[5])
        assert not reg.fsck().problems
        assert b"".join(bytes(b) for b in aside.chunks(ANCHOR)) == aside.get(ANCHOR)
        assert isinstance(aside, ObjectAside)  # a re-anchor killed mid-upload leaves an incomplete upload
        objects = aside.objects
        multipart.start_upload(objects.config, objects.key("rl/.policy-folds/40-40.full.safetensors"))
        assert aside.names("rl/.policy-folds") == [ANCHOR]
        assert [u.rel for u in aside.unfinished("rl/.policy-folds")] == ["rl/.policy-folds/40-40.full.safetensors"]
        report = reg.fsck(repair=True)
        assert [(p.kind, p.step) for p in report.repaired] == [("orphan-fold", 40)]
        assert aside.unfinished("rl/.policy-folds") == [] and not reg.fsck().problems
        assert aside.names("rl/.policy-folds") == [ANCHOR]


def test_anchors_on_a_tiered_root_live_on_its_durable_tier(treg: Registry) -> None:
    states = _publish_five(treg, 65)
    treg.replicate("rl", wait=True)
    plan = treg.plan_tier_retention("rl", KeepLast(1), tier="durable", reanchor=True)
    assert list(plan.delete) == [10, 20, 30, 40]
    plan.execute()
    assert treg.root.aside().names("rl/.policy-folds") == [ANCHOR]
    assert treg.root.aside().local(ANCHOR) is None  # on the durable tier, where every host reads it
    assert_same(treg.load("rl@latest-policy").state_dict, states[5])


def test_gc_reanchor_and_policy_reanchor_on_the_command_line(migrated_url: str, root: Path) -> None:
    import json

    from click.testing import CliRunner

    from registry.cli.main import main
    with Registry.open(url=migrated_url, root=root) as reg:
        states = _publish_five(reg, 66)
    runner = CliRunner()
    base = ["--url", migrated_url, "--root", str(root)]
    out = runner.invoke(main, [*base, "gc", "rl", "--keep-last", "1", "--dry-run"])
    assert out.exit_code == 0 and "the chains of delta steps 50 stay only for them" in out.output, out.output
    out = runner.invoke(main, [*base, "policy", "ls", "rl"])
    assert out.exit_code == 0 and "anchored" not in out.output, out.output
    out = runner.invoke(main, [*base, "policy", "reanchor", "rl", "4", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["step"] == 40
    out = runner.invoke(main, [*base, "policy", "ls", "rl", "--json"])
    assert [(v["step"], v["kind"], v["anchored"]) for v in json.loads(out.output)] == [
        (10, "full", False), (20, "delta", False), (30, "delta", False), (40, "delta", True), (50, "delta", False)]
    out = runner.invoke(main, [*base, "gc", "rl", "--keep-last", "1", "--reanchor", "--yes", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["result"]["deleted"] == [10, 20, 30, 40]
    with Registry.open(url=migrated_url, root=root) as reg:
        assert_same(reg.load("rl@50").state_dict, states[5])
        assert [(f.to_step, f.status) for f in folds(reg.catalog, "rl")] == [(40, "deleted"), (50, "verified")]
