"""The copies of a step on a root with tiers: the last verified copy goes only as the deletion of the step.

Fast-tier and durable-tier retention at once, a forced fast gc during replication, a durable copy deleted on
purpose, and a condemned fast copy. Real SeaweedFS, both catalog backends, real threads.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry
from registry.errors import RegistryError
from registry.catalog.replicas import DURABLE
from registry.format.manifest import MANIFEST, digest_bytes
from registry.ops.tierretention import TierPlan, TierResult
from registry.records import CheckpointInfo, Status
from registry.retention import KeepBest, KeepLast
from tests.test_retention import BAD_PLAN_OPTIONS
from tests.helpers import assert_state_equal, durable_keys, make_state, mark_corrupt, pg_connect


def real_copies(reg: Registry, run: str, step: int) -> list[str]:
    """The locations of ``run@step``'s verified copies of its payload that are really on storage."""
    info = reg.catalog.get(run, step)
    assert info is not None and reg.tiers is not None
    found = []
    for r in reg.replicas(run, step):
        if r.status != "verified" or r.manifest_sha256 != info.manifest_sha256:
            continue
        try:
            if r.location == DURABLE:
                raw = bytes(reg.tiers.durable.get(f"{r.path}/{MANIFEST}"))
            else:
                raw = (reg.tiers.fast.root / r.path / MANIFEST).read_bytes()
        except Exception:  # noqa: BLE001 - not on storage, whatever the tier says
            continue
        if digest_bytes(raw) == info.manifest_sha256:
            found.append(r.location)
    return found


def assert_deleted_or_readable(reg: Registry, run: str, step: int) -> None:
    """The step is ``deleted``, or has a verified copy on storage that loads."""
    info = reg.catalog.get(run, step)
    assert info is not None
    if info.status == Status.DELETED:
        return
    assert info.status == Status.VERIFIED
    assert real_copies(reg, run, step), reg.replicas(run, step)
    assert_state_equal(reg.load(f"{run}@{step}").state_dict, make_state(step))


def damage(path: Path) -> None:
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))


def copy_plans(a: Registry, b: Registry) -> tuple[TierPlan, TierPlan]:
    """Steps 1 and 2 durable; a fast-tier plan on ``a`` and a durable-tier plan on ``b``, both deleting step 1's
    copy only (each sees the other tier's copy), both made before either runs."""
    for step in (1, 2):
        a.publish("run", step, make_state(step), durable=True)
    fast_plan = a.plan_tier_retention("run", KeepLast(1), tier="fast")
    durable_plan = b.plan_tier_retention("run", KeepLast(1), tier="durable")
    for plan in (fast_plan, durable_plan):
        assert [(d.step, d.ends_step) for d in plan.decisions if d.action == "delete"] == [(1, False)]
    return fast_plan, durable_plan


# --------------------------------------------------------------------------- two retentions at once


def test_fast_and_durable_retention_one_after_the_other_leave_a_copy(catalog_url: str, fast: Path,
                                                                      durable: str) -> None:
    with Registry.open(catalog_url, root=fast, durable=durable) as a, \
            Registry.open(catalog_url, root=fast, durable=durable) as b:
        fast_plan, durable_plan = copy_plans(a, b)
        assert fast_plan.execute().deleted == (1,)
        result = durable_plan.execute()
        assert result.deleted == () and "no other good copy" in result.skipped[1], result
        assert real_copies(a, "run", 1) == [DURABLE]
        assert_deleted_or_readable(a, "run", 1)
        assert a.fsck().clean


@contextmanager
def overlapping(catalog_url: str) -> Iterator[threading.Event]:
    """On PostgreSQL, hold every write to the events table (each marking ends with one) until two transactions
    wait on a lock: both retentions are then inside their marking transactions at once, whichever of them
    checks first. Set the event yielded once the threads are started. On SQLite the write lock serialises."""
    started = threading.Event()
    if not catalog_url.startswith("postgresql"):
        yield started
        return
    dsn, _, options = catalog_url.replace("postgresql+psycopg://", "postgresql://").partition("?")
    schema = options.rpartition("%3D")[2]
    with pg_connect(dsn) as conn, conn.transaction():
        conn.execute(f'LOCK TABLE "{schema}".events IN EXCLUSIVE MODE')
        yield started
        assert started.wait(60)
        deadline = time.monotonic() + 120  # a bound on a hang, not a timing the outcome depends on
        while conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()").fetchone()[0] < 2:
            assert time.monotonic() < deadline, "the two retentions never both waited"
            time.sleep(0.01)


@pytest.mark.both_backends
def test_fast_and_durable_retention_at_once_never_take_both_copies(catalog_url: str, fast: Path,
                                                                   durable: str) -> None:
    with Registry.open(catalog_url, root=fast, durable=durable) as a, \
            Registry.open(catalog_url, root=fast, durable=durable) as b:
        fast_plan, durable_plan = copy_plans(a, b)
        barrier = threading.Barrier(2)

        def execute(plan: TierPlan) -> TierResult:
            barrier.wait(timeout=60)
            return plan.execute()
        with ThreadPoolExecutor(2) as pool:
            with overlapping(catalog_url) as started:
                futures = [pool.submit(execute, p) for p in (fast_plan, durable_plan)]
                started.set()
            results = [f.result(timeout=120) for f in futures]
        assert sorted(s for r in results for s in r.deleted) == [1]  # exactly one of the two copies went
        assert [s for r in results for s in r.skipped] == [1]
        assert len(real_copies(a, "run", 1)) == 1
        assert_deleted_or_readable(a, "run", 1)
        assert a.fsck().clean


# --------------------------------------------------------------------------- forced fast gc during replication


@pytest.mark.both_backends
def test_a_step_deleted_while_it_replicates_leaves_no_durable_copy(treg: Registry,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from registry.ops import replicator

    uploaded, proceed = threading.Event(), threading.Event()
    real_upload = replicator.upload_directory

    def upload_then_wait(*args: object, **kwargs: object) -> object:
        out = real_upload(*args, **kwargs)  # type: ignore[arg-type]
        uploaded.set()
        assert proceed.wait(60)
        return out

    monkeypatch.setattr(replicator, "upload_directory", upload_then_wait)
    treg.publish("run", 1, make_state(1))
    assert uploaded.wait(60)  # step 1's objects are on the durable tier, its copy still pending
    monkeypatch.setattr(replicator, "upload_directory", real_upload)
    treg.publish("run", 2, make_state(2))
    plan = treg.plan_tier_retention("run", KeepLast(1), tier="fast", force=True)
    assert [(d.step, d.ends_step) for d in plan.decisions if d.action == "delete"] == [(1, True)]
    assert plan.execute().ended == (1,)
    proceed.set()
    treg.wait_durable("run", 2, timeout=60)
    treg._replication().idle(timeout=60)
    assert treg.catalog.get("run", 1).status == Status.DELETED  # type: ignore[union-attr]
    assert [r.status for r in treg.replicas("run", 1) if r.location == DURABLE] in ([], ["deleted"])
    assert durable_keys(treg, "run/step-00000001") == []
    assert treg.fsck().clean


def test_a_step_deleted_just_after_it_became_durable_takes_its_durable_copy_with_it(treg: Registry) -> None:
    """The other order: the plan saw no durable copy (force), the replication committed before the plan ran."""
    with treg._replication()._drain_lock:
        treg.publish("run", 1, make_state(1))
        treg.publish("run", 2, make_state(2))
        plan = treg.plan_tier_retention("run", KeepLast(1), tier="fast", force=True)
    assert [(d.step, d.ends_step) for d in plan.decisions if d.action == "delete"] == [(1, True)]
    treg.wait_durable("run", 1, timeout=60)
    assert plan.execute().ended == (1,)
    assert treg.catalog.get("run", 1).status == Status.DELETED  # type: ignore[union-attr]
    assert [r.status for r in treg.replicas("run", 1) if r.status != "deleted"] == []
    assert durable_keys(treg, "run/step-00000001") == []
    assert treg.fsck().clean


# --------------------------------------------------------------------------- a durable copy deleted on purpose


def test_a_step_whose_durable_copy_was_deleted_is_not_waiting_for_replication(treg: Registry) -> None:
    for step in (1, 2, 3):
        treg.publish("run", step, make_state(step), durable=True)
    assert treg.plan_tier_retention("run", KeepLast(1), tier="durable").execute().deleted == (1, 2)
    plan = treg.plan_tier_retention("run", KeepLast(1), tier="fast")
    assert [(d.step, d.ends_step) for d in plan.decisions if d.action == "delete"] == [(1, True), (2, True)], plan
    result = plan.execute()
    assert result.ended == (1, 2) and result.deleted == (1, 2)
    for step in (1, 2):
        assert treg.catalog.get("run", step).status == Status.DELETED  # type: ignore[union-attr]
        assert not (treg.store.root / "run" / f"step-{step:08d}").exists()
    assert_deleted_or_readable(treg, "run", 3)
    assert treg.fsck().clean


# --------------------------------------------------------------------------- a condemned fast copy


def test_fsck_repair_removes_a_corrupt_fast_copy_and_copies_it_again(treg: Registry) -> None:
    info = treg.publish("run", 1, make_state(1), durable=True)
    damage(info.path)
    first = treg.fsck(repair=True, checksums=True)
    assert [p.kind for p in first.problems] == ["damaged-payload"] and first.repaired, first
    second = treg.fsck(repair=True, checksums=True)
    assert second.clean and not second.repaired, second
    assert treg.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
    assert sorted(real_copies(treg, "run", 1)) == sorted([DURABLE, treg.tiers.cache_location])  # type: ignore[union-attr]
    assert_state_equal(treg.load("run@1").state_dict, make_state(1))


def condemn(reg: Registry, info: CheckpointInfo) -> None:
    """Damage this host's copy of ``info``; verify marks the copy corrupt, the step stands on its durable copy."""
    damage(info.path)
    assert [r.status for r in reg.verify(f"{info.run}@{info.step}")] == ["corrupt-copy"]
    assert [r.status for r in reg.replicas(info.run, info.step) if r.location != DURABLE] == ["corrupt"]


def test_fsck_repair_removes_a_fast_copy_verify_condemned(treg: Registry) -> None:
    info = treg.publish("run", 1, make_state(1), durable=True)
    condemn(treg, info)
    first = treg.fsck(repair=True)
    assert [p.kind for p in first.problems] == ["corrupt-fast-copy"] and first.repaired, first
    assert treg.fsck(repair=True, checksums=True).clean
    assert treg.tiers is not None and treg.tiers.cache_location in real_copies(treg, "run", 1)


def test_gc_removes_a_corrupt_fast_copy_whatever_the_policy_keeps(treg: Registry) -> None:
    info = treg.publish("run", 1, make_state(1), durable=True)
    treg.publish("run", 2, make_state(2), durable=True)
    condemn(treg, info)
    plan = treg.plan_tier_retention("run", KeepLast(5), tier="fast")
    assert [(d.step, d.ends_step) for d in plan.decisions if d.action == "delete"] == [(1, False)], plan
    assert plan.execute().deleted == (1,)
    assert not info.path.exists()
    assert treg.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
    assert_state_equal(treg.load("run@1").state_dict, make_state(1))
    assert treg.fsck(repair=True, checksums=True).clean


# --------------------------------------------------------------------------- a delta step's chain


def test_tier_retention_keeps_the_base_of_a_delta_step_it_keeps(treg: Registry) -> None:
    """A kept delta step loads only through its base: no tier's retention may end the base, as plain retention
    never does, whichever tier's copies go first."""
    from tests.test_policy_publish import policy_state, step_of
    one = policy_state(1)
    two = step_of(one, 0.02, 2)
    treg.publish("rl", 1, one, policy_version=1, delta=False, durable=True)
    treg.publish("rl", 2, two, policy_version=2, delta=True, durable=True)
    for tier in ("fast", "durable"):
        plan = treg.plan_tier_retention("rl", KeepLast(1), tier=tier)
        assert plan.keep[1] == "base of delta step 2", plan
        plan.execute()
    assert treg.catalog.get("rl", 1).status == Status.VERIFIED  # type: ignore[union-attr]
    assert_state_equal(treg.load("rl@pv:2").state_dict, two)
    assert treg.fsck().clean


def test_a_stale_tier_plan_never_ends_the_base_of_a_delta_published_since(treg: Registry) -> None:
    """The chain is checked again when the step is marked: here version 1 became a base after the plan was made
    (version 2 was found corrupt, so the next delta is made against version 1)."""
    from tests.test_policy_publish import policy_state, step_of
    one = policy_state(1)
    treg.publish("rl", 1, one, policy_version=1, delta=False, durable=True)
    two = treg.publish("rl", 2, policy_state(2), policy_version=2, delta=False, durable=True)
    assert treg.plan_tier_retention("rl", KeepLast(1), tier="fast").execute().deleted == (1,)  # a copy only
    plan = treg.plan_tier_retention("rl", KeepLast(1), tier="durable")
    assert [(d.step, d.ends_step) for d in plan.decisions if d.action == "delete"] == [(1, True)], plan
    assert mark_corrupt(treg, two, "found corrupt by the test")
    three = step_of(one, 0.02, 3)
    treg.publish("rl", 3, three, policy_version=3, delta=True, durable=True)
    result = plan.execute()
    assert result.ended == () and list(result.skipped) == [1], result
    assert treg.catalog.get("rl", 1).status == Status.VERIFIED  # type: ignore[union-attr]
    assert_state_equal(treg.load("rl@pv:3").state_dict, three)


def test_a_late_metric_since_a_tier_plan_keeps_the_step_it_makes_best(treg: Registry) -> None:
    """As plain retention: the policy is evaluated again when a copy goes alone and when a step's last copy goes."""
    for step, loss in ((1, 0.5), (2, 0.9), (3, 0.7)):
        treg.publish("run", step, make_state(step), metrics={"eval/loss": loss}, durable=True)
    fast_plan = treg.plan_tier_retention("run", KeepBest(1, "eval/loss"), tier="fast")
    assert [(d.step, d.ends_step) for d in fast_plan.decisions if d.action == "delete"] == [(2, False)]
    treg.log_metrics("run", 2, {"eval/loss": 0.1}, flush=True)
    result = fast_plan.execute()
    assert result.deleted == () and "now kept by the policy" in result.skipped[2], result
    assert treg.plan_tier_retention("run", KeepLast(1), tier="fast").execute().deleted == (1, 2)
    durable_plan = treg.plan_tier_retention("run", KeepBest(1, "eval/loss"), tier="durable")
    assert [(d.step, d.ends_step) for d in durable_plan.decisions if d.action == "delete"] == [(1, True)]
    treg.log_metrics("run", 1, {"eval/loss": 0.01}, flush=True)
    result = durable_plan.execute()
    assert result.ended == () and "now kept by the policy" in result.skipped[1], result
    assert_state_equal(treg.load("run@1").state_dict, make_state(1))
    assert treg.fsck().clean


def test_tier_retention_ending_a_step_keeps_the_runs_fallback_apart(migrated_url: str, fast: Path,
                                                                     durable: str) -> None:
    """With dedup, as on a plain root: when a step's last copy goes, the two newest verified steps left share no
    inode (here step 3 had linked step 1's weights, and step 2 stood between them)."""
    def inodes(path: Path) -> set[int]:
        return {p.stat().st_ino for p in path.rglob("*") if p.is_file()}

    def state(seed: int) -> dict[str, torch.Tensor]:
        return {"w": torch.full((1 << 18,), float(seed)), "b": torch.full((4,), float(seed))}  # 1 MiB: linked

    with Registry.open(migrated_url, root=fast, durable=durable, dedup=True) as reg:
        with reg._replication()._drain_lock:  # no durable copy yet: the fast tier holds each step's last copy
            one = reg.publish("run", 1, state(1), tags=["keep"])
            reg.publish("run", 2, state(2))
            three = reg.publish("run", 3, state(1))
            assert inodes(one.path) & inodes(three.path)  # linked: step 2 is step 3's fallback
            result = reg.plan_tier_retention("run", KeepLast(1), tier="fast", force=True).execute()
        assert result.ended == (2,)
        assert not inodes(one.path) & inodes(three.path)  # step 1 is the fallback now: its own inodes
        assert_state_equal(reg.load("run@3").state_dict, state(1))
        for step in (1, 3):
            reg.wait_durable("run", step, timeout=60)
        assert reg.fsck(checksums=True).clean


# --------------------------------------------------------------------------- a tier's retention killed


def retain_then_die(url: str, fast: str, durable: str, env: dict[str, str], tier: str) -> None:
    """In a child: three durable steps (on the durable tier's turn, their fast copies gone first, so the durable
    copies are the last ones), then ``KeepLast(1)`` on ``tier`` with ``env["REGISTRY_CRASH_AT"]`` armed."""
    from registry.crashpoints import arm
    os.environ.update(env)  # a forkserver's child inherits the server's environment, not the test's of the moment
    arm(None)
    with Registry.open(url, root=fast, durable=durable) as reg:
        for step in (1, 2, 3):
            reg.publish("run", step, make_state(step), durable=True)
        if tier == "durable":
            assert reg.plan_tier_retention("run", KeepLast(1), tier="fast").execute().deleted == (1, 2)
        arm(env["REGISTRY_CRASH_AT"])
        reg.plan_tier_retention("run", KeepLast(1), tier=tier).execute()


def killed_retaining(url: str, fast: Path, durable: str, tier: str, point: str) -> None:
    """:func:`retain_then_die` in a child, SIGKILLed at ``point``; returns once its catalog sessions are gone."""
    from tests import killharness
    from tests.helpers import child_env
    proc = killharness.context().Process(
        target=retain_then_die, daemon=True,
        args=(killharness.worker_url(url), str(fast), durable, {**child_env(), "REGISTRY_CRASH_AT": point}, tier))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -9, f"the retention to be killed at {point} ended with {proc.exitcode}"
    with Registry.open(url, root=fast, durable=durable) as reg:
        killharness.settle(reg)


@pytest.mark.parametrize("point", ["gc-after-mark", "gc-after-retire"])
@pytest.mark.parametrize("tier", ["fast", "durable"])
def test_a_tier_retention_killed_at_a_crash_point_loses_nothing_and_fsck_finishes_it(
        migrated_url: str, fast: Path, durable: str, tier: str, point: str) -> None:
    killed_retaining(migrated_url, fast, durable, tier, point)
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        # a copy going alone leaves its step live; the durable tier's ends steps 1 and 2 in one transaction
        live = [i.step for i in reg.checkpoints("run")]
        assert live == ([1, 2, 3] if tier == "fast" else [3]), live
        for step in live:  # before any repair, every live step loads from a copy that is whole
            assert_state_equal(reg.load(f"run@{step}").state_dict, make_state(step))
        found = reg.fsck()
        # what the killed retention marked, named as such (a copy's retired directory is no interrupted overwrite)
        assert found.problems and {p.kind for p in found.problems} == {"unfinished-copy-deletion"}, found
        assert reg.fsck(repair=True).repaired
        assert reg.fsck(checksums=True).clean
        for step in live:
            assert_state_equal(reg.load(f"run@{step}").state_dict, make_state(step))


@pytest.mark.parametrize("point", ["gc-after-mark", "gc-after-retire"])
@pytest.mark.parametrize("tier", ["fast", "durable"])
def test_the_next_retention_on_a_tier_finishes_a_killed_one(migrated_url: str, fast: Path, durable: str, tier: str,
                                                           point: str) -> None:
    """As on a plain root, the next gc finishes what a killed one marked (no fsck needed): the copy it marked
    deleted, or the steps it ended, leave no bytes behind, and fsck is clean after it."""
    killed_retaining(migrated_url, fast, durable, tier, point)
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        assert not reg.fsck().clean  # the killed one left bytes of what it marked
        result = reg.plan_tier_retention("run", KeepLast(1), tier=tier).execute()
        assert result.healed and not result.errors, result
        report = reg.fsck(checksums=True)
        assert report.clean, report.to_json()
        assert [i.step for i in reg.checkpoints("run")] == ([1, 2, 3] if tier == "fast" else [3])
        for step in [i.step for i in reg.checkpoints("run")]:
            assert_state_equal(reg.load(f"run@{step}").state_dict, make_state(step))


def test_a_tiers_retention_reclaims_expired_checkouts_first(treg: Registry) -> None:
    """As plain retention: an expired registry-owned checkout made of hard links would keep an ended step's bytes
    on the fast disk, so a tier's retention removes it before deciding."""
    from datetime import timedelta
    for step in (1, 2):
        treg.publish("run", step, make_state(step))
    live = treg.checkout("run@2", ttl=timedelta(hours=1))
    dead = treg.checkout("run@1", ttl=timedelta(0), link="hardlink")
    weights = treg.resolve("run@1").path / "model.safetensors"
    ino = os.stat(weights).st_ino
    result = treg.plan_tier_retention("run", KeepLast(1), tier="fast", force=True).execute()
    assert result.deleted == (1,) and result.checkouts_removed == (dead.path,), result
    assert not dead.path.exists() and live.path.is_dir()
    assert ino not in {os.stat(p).st_ino for p in treg.store.root.rglob("*") if p.is_file()}
    live.close()
    treg.wait_durable("run", 2, timeout=60)
    assert treg.fsck().clean


@pytest.mark.parametrize(("options", "says"), BAD_PLAN_OPTIONS)
def test_bad_tier_plan_options_are_the_same_one_line_errors(treg: Registry, options: dict[str, Any],
                                                             says: str) -> None:
    treg.publish("run", 1, make_state(1))
    with pytest.raises(RegistryError, match=says) as raised:
        treg.plan_tier_retention("run", KeepLast(1), tier="fast", **options)
    assert "\n" not in str(raised.value)


def test_a_tier_keeps_the_parent_of_a_fork_unless_released(migrated_url: str, fast: Path, durable: str) -> None:
    """As plain retention, and ``gc --release-fork-parents`` says the same on a tiered root."""
    from click.testing import CliRunner

    from registry.cli import main
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        for step in (1, 2, 3):
            reg.publish("base", step, make_state(step), durable=True)
        reg.begin_attempt("ft", fork_from="base@1")
        reg.publish("ft", 10, make_state(10))
        for tier in ("fast", "durable"):
            plan = reg.plan_tier_retention("base", KeepLast(1), tier=tier)
            assert "parent of fork ft@10" in plan.keep[1] and list(plan.delete) == [2], plan
    args = ["--url", migrated_url, "--root", str(fast), "--durable", durable, "gc", "base", "--keep-last", "1",
            "--yes", "--json"]
    for tier in ("fast", "durable"):
        out = CliRunner().invoke(main, [*args, "--tier", tier, "--release-fork-parents"], catch_exceptions=False)
        assert out.exit_code == 0, out.output
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        assert [i.step for i in reg.checkpoints("base")] == [3]
        assert [(h.ref, h.status) for h in reg.lineage("ft@10")] == [("ft@10", "verified"), ("base@1", "deleted")]
        assert_state_equal(reg.load("ft@10").state_dict, make_state(10))  # the fork is whole without its parent
