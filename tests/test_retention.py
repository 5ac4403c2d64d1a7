"""Retention policies, plans and execution, on SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from registry import CheckpointNotFoundError, InvalidStateError, PolicyError, Registry
from registry.errors import CheckpointDeletedError, InvalidNameError, RegistryError
from registry.records import CheckpointInfo
from registry.retention import (AnyOf, KeepBest, KeepEvery, KeepLast, KeepNewerThan, KeepPolicyVersions,
                                KeepTagged, MaxBytes, Policy, RetentionContext, RetentionWarning)
from registry.ops.reading import read_checked
from tests.helpers import assert_state_equal, child_env, make_state, mark_corrupt, pg_schema_url



class KeepNothing(Policy):
    """A user-defined policy: only the invariants keep anything."""

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        return {}


def publish(reg: Registry, run: str, steps: Sequence[int], **kwargs: object) -> None:
    for step in steps:
        reg.publish(run, step, make_state(step), **kwargs)  # type: ignore[arg-type]


def live(reg: Registry, run: str) -> list[int]:
    return [i.step for i in reg.checkpoints(run) if i.status in ("published", "verified")]


def stored_steps(reg: Registry, run: str) -> list[int]:
    """The steps whose payload is in the root: every entry of the run's directory, or each attempt prefix."""
    if reg.objects is not None:
        from registry.fs.prefixes import scan
        return sorted(p.step for p in scan(reg.objects, run).values())
    names = sorted(p.name for p in (reg.store.root / run).iterdir())
    assert all(n.startswith("step-") for n in names), f"not only final step directories: {names}"
    return [int(n.removeprefix("step-")) for n in names]


def status(reg: Registry, run: str, step: int) -> str:
    info = reg.catalog.get(run, step)
    assert info is not None
    return info.status


def test_keep_last_plan_changes_nothing_then_execute(any_reg: Registry) -> None:
    reg = any_reg  # a directory or an s3:// root
    publish(reg, "run", [10, 20, 30, 40, 50, 60], metrics={"eval/loss": 1.0})
    before_events = len(reg.events("run"))
    sizes = {i.step: i.total_bytes for i in reg.checkpoints("run")}
    plan = reg.plan_retention("run", KeepLast(2))
    assert list(plan.keep) == [50, 60] and list(plan.delete) == [10, 20, 30, 40]
    assert "last 2" in plan.keep[50] and "@latest" in plan.keep[60]
    assert plan.bytes_freed == sum(sizes[s] for s in (10, 20, 30, 40)) > 0
    # planning changed nothing
    assert live(reg, "run") == [10, 20, 30, 40, 50, 60]
    assert stored_steps(reg, "run") == sorted(sizes)
    assert len(reg.events("run")) == before_events

    result = plan.execute()
    assert result.deleted == (10, 20, 30, 40) and not result.skipped and not result.errors
    assert result.bytes_freed == plan.bytes_freed
    assert live(reg, "run") == [50, 60]
    assert stored_steps(reg, "run") == [50, 60]
    # rows, metrics and events stay as history
    rows = {i.step: i.status for i in reg.checkpoints("run", include_deleted=True)}
    assert rows == {10: "deleted", 20: "deleted", 30: "deleted", 40: "deleted", 50: "verified", 60: "verified"}
    assert {p.step for p in reg.metrics("run", "eval/loss")} == {10, 20, 30, 40, 50, 60}
    deletes = [e for e in reg.events("run") if e.kind == "delete"]
    assert [e.step for e in deletes] == [10, 20, 30, 40]
    assert deletes[0].detail["total_bytes"] == sizes[10] and deletes[0].detail["previous_status"] == "verified"
    with pytest.raises(CheckpointNotFoundError):
        reg.resolve("run@10")
    # executing the same plan again is harmless
    again = plan.execute()
    assert again.deleted == () and set(again.skipped) == {10, 20, 30, 40}
    assert all("no longer a candidate" in why for why in again.skipped.values())


def test_keep_best_ranks_like_the_best_ref(any_reg: Registry) -> None:
    reg = any_reg  # a directory or an s3:// root
    losses = {10: 0.5, 20: 0.2, 30: 0.9, 40: 0.2, 50: 0.7, 60: 0.8}
    for step, loss in losses.items():
        reg.publish("run", step, make_state(step), metrics={"eval/loss": loss, "eval/acc": 1 - loss})
    plan = reg.plan_retention("run", KeepBest(1, "eval/loss"))
    assert reg.resolve("run@best:eval/loss").step == 40  # ties go to the newer step
    assert list(plan.keep) == [40, 60]
    assert "eval/loss=0.2" in plan.keep[40]
    assert list(reg.plan_retention("run", KeepBest(2, "eval/loss")).keep) == [20, 40, 60]
    plan_max = reg.plan_retention("run", KeepBest(2, "eval/acc", mode="max"))
    assert list(plan_max.keep) == [20, 40, 60]
    assert list(reg.plan_retention("run", KeepBest(1, "eval/loss", mode="max")).keep) == [30, 60]
    # steps without the metric are never "best"; a metric no step has keeps nothing only when asked to
    assert list(reg.plan_retention("run", KeepBest(3, "no/such", missing_ok=True)).keep) == [60]


def test_keep_every_tagged_newer_policy_versions(any_reg: Registry) -> None:
    reg = any_reg  # a directory or an s3:// root
    for step in (10, 20, 30, 40, 50, 60):
        reg.publish("run", step, make_state(step), policy_version=(step + 10) // 20)  # 1,1,2,2,3,3
    reg.tag("run", 10, "release")
    reg.tag("run", 30, "paper")

    assert list(reg.plan_retention("run", KeepEvery(20)).keep) == [10, 20, 30, 40, 60]  # 10, 30: tagged
    assert list(reg.plan_retention("run", KeepEvery(20)).delete) == [50]

    tagged = reg.plan_retention("run", KeepTagged("release"))
    assert "tagged release" in tagged.keep[10] and "tagged paper" in tagged.keep[30]
    assert list(reg.plan_retention("run", KeepTagged()).delete) == [20, 40, 50]

    created = {i.step: i.created_at for i in reg.checkpoints("run")}
    assert all(created[a] < created[b] for a, b in zip((10, 20, 30, 40, 50), (20, 30, 40, 50, 60)))
    now = created[40] + timedelta(hours=1)  # type: ignore[operator]
    assert list(reg.plan_retention("run", KeepNewerThan(timedelta(hours=1)), now=now).delete) == [20]
    assert list(reg.plan_retention("run", KeepNewerThan(timedelta(minutes=1)), now=now).delete) == [20, 40, 50]

    assert list(reg.plan_retention("run", KeepPolicyVersions(1)).delete) == [20, 40]
    assert list(reg.plan_retention("run", KeepPolicyVersions(2)).delete) == [20]
    assert list(reg.plan_retention("run", KeepPolicyVersions(versions=[1])).delete) == [40, 50]


def test_byte_budget_deletes_oldest_first(any_reg: Registry) -> None:
    reg = any_reg  # a directory or an s3:// root
    publish(reg, "run", [10, 20, 30, 40, 50, 60], metrics={"eval/loss": 1.0})
    reg.log_metrics("run", 20, {"eval/loss": 0.1})
    reg.flush()
    size = {i.step: i.total_bytes for i in reg.checkpoints("run")}
    budget = size[60] + size[50] + size[40] + size[30] // 2
    plan = reg.plan_retention("run", MaxBytes(budget))
    assert list(plan.keep) == [40, 50, 60] and list(plan.delete) == [10, 20, 30]
    assert plan.bytes_kept <= budget
    # protected steps count first and are kept even when they alone exceed the budget
    assert list(reg.plan_retention("run", MaxBytes(0)).keep) == [60]
    # a budget over another policy: keep what it keeps, minus its oldest steps while over budget
    best_or_last = KeepLast(3) | KeepBest(1, "eval/loss")
    capped = reg.plan_retention("run", MaxBytes(size[60] + size[50] + size[40], keep=best_or_last))
    assert list(capped.keep) == [40, 50, 60]
    roomy = reg.plan_retention("run", MaxBytes(10 * sum(size.values()), keep=best_or_last))
    assert list(roomy.keep) == [20, 40, 50, 60]
    # in a union the budget only adds what fits
    union = KeepBest(1, "eval/loss") | MaxBytes(size[60] + size[50])
    assert list(reg.plan_retention("run", union).keep) == [20, 50, 60]
    assert roomy.execute().deleted == (10, 30)


def test_union_merges_keeps_and_reasons(any_reg: Registry) -> None:
    reg = any_reg  # a directory or an s3:// root
    for step in (10, 20, 30, 40, 50):
        reg.publish("run", step, make_state(step), metrics={"eval/loss": 1.0 / step if step != 30 else 0.0})
    policy = KeepLast(1) | KeepBest(1, "eval/loss") | KeepEvery(20)
    assert isinstance(policy, AnyOf) and len(policy.policies) == 3  # flattened
    assert repr(policy) == "KeepLast(1) | KeepBest(1, 'eval/loss') | KeepEvery(20)"
    plan = reg.plan_retention("run", policy)
    assert list(plan.keep) == [20, 30, 40, 50] and list(plan.delete) == [10]
    assert "last 1" in plan.keep[50] and "@latest" in plan.keep[50]
    assert "best 1/1" in plan.keep[30]
    assert plan.keep[40] == "every 20"
    with pytest.raises(TypeError):
        KeepLast(1) | 3  # type: ignore[operator]
    doc = plan.to_json()
    assert doc["keep"] == [20, 30, 40, 50] and doc["delete"] == [10] and doc["bytes_freed"] == plan.bytes_freed
    assert {d["step"]: d["action"] for d in doc["decisions"]}[10] == "delete"


def test_invariants_hold_whatever_the_policy(any_reg: Registry) -> None:
    reg = any_reg  # a directory or an s3:// root
    publish(reg, "run", [10, 20, 25, 30, 40, 50], metrics={"eval/loss": 0.5})
    reg.publish("run", 60, make_state(60), verify=False)            # newest, only published
    reg.tag("run", 30, "release")
    mark_corrupt(reg, reg.resolve("run@40"), "test")                 # corrupt: a candidate
    lease = reg.catalog.acquire_lease("run", 25, holder="reader", ttl=timedelta(hours=1))
    assert lease is not None
    reg.catalog.claim("run", 70, path="run/step-00000070", writer=reg.writer, overwrite=False)  # staging
    plan = reg.plan_retention("run", KeepNothing())
    assert list(plan.delete) == [10, 20, 40]
    assert set(plan.keep) == {25, 30, 50, 60, 70}
    assert "leased" in plan.keep[25] and "tagged release" in plan.keep[30]
    assert plan.keep[50] == "@latest" and plan.keep[60] == "@latest-published"
    assert "staging" in plan.keep[70]
    assert all(d.protected for d in plan.decisions if d.action == "keep")

    result = plan.execute()
    assert result.deleted == (10, 20, 40)
    for step in (25, 30, 50, 60):
        assert status(reg, "run", step) in ("published", "verified")
    assert stored_steps(reg, "run") == [25, 30, 50, 60]
    assert status(reg, "run", 70) == "staging" and status(reg, "run", 40) == "deleted"
    # a released lease no longer protects
    reg.catalog.release_lease(lease)
    assert reg.plan_retention("run", KeepNothing()).execute().deleted == (25,)


def test_expired_lease_does_not_protect(any_reg: Registry) -> None:
    reg = any_reg  # a directory or an s3:// root
    publish(reg, "run", [10, 20, 30])
    assert reg.catalog.acquire_lease("run", 10, holder="crashed-reader", ttl=timedelta(seconds=-1)) is not None
    assert reg.catalog.acquire_lease("run", 20, holder="reader", ttl=timedelta(hours=1)) is not None
    plan = reg.plan_retention("run", KeepNothing())
    assert list(plan.delete) == [10]
    assert plan.execute().deleted == (10,)


def test_execute_rechecks_a_changed_catalog(any_reg: Registry) -> None:
    reg = any_reg  # a directory or an s3:// root
    losses = {5: 0.9, 10: 0.9, 20: 0.9, 30: 0.9, 40: 0.9, 50: 0.1, 60: 0.5}
    for step, loss in losses.items():
        reg.publish("run", step, make_state(step), metrics={"eval/loss": loss})
    policy = KeepLast(1) | KeepBest(1, "eval/loss")
    plan = reg.plan_retention("run", policy)
    assert list(plan.delete) == [5, 10, 20, 30, 40]

    # the world moves on between plan and execute
    reg.catalog.set_status("run", 10, "deleted", kind="delete", only_from=("verified",))  # another gc won
    reg.tag("run", 20, "release")                                                       # a new tag
    assert reg.catalog.acquire_lease("run", 30, holder="reader", ttl=timedelta(hours=1))  # a new reader
    reg.log_metrics("run", 40, {"eval/loss": 0.01})                                     # a late evaluation
    reg.flush()
    reg.publish("run", 70, make_state(70))                                              # latest moves

    result = plan.execute()
    assert result.deleted == (5,)
    assert set(result.skipped) == {10, 20, 30, 40}
    assert "no longer a candidate" in result.skipped[10]
    assert "tagged release" in result.skipped[20]
    assert "leased" in result.skipped[30]
    assert "kept by the policy" in result.skipped[40] and "best" in result.skipped[40]
    # steps the plan did not mean to delete are untouched, even if no longer kept
    assert live(reg, "run") == [20, 30, 40, 50, 60, 70]


def test_publish_with_retention(any_reg: Registry) -> None:
    reg = any_reg  # a directory or an s3:// root
    for step in (10, 20, 30, 40, 50):
        reg.publish("run", step, make_state(step), retention=KeepLast(2))
        assert live(reg, "run") == [s for s in (10, 20, 30, 40, 50) if step - 10 <= s <= step]
    assert live(reg, "run") == [40, 50]
    # the step just published is never deleted, even when it is neither latest nor kept
    reg.publish("run", 5, make_state(5), retention=KeepLast(1))
    assert live(reg, "run") == [5, 50]
    assert_state_equal(reg.load("run@5").state_dict, make_state(5))


class Exploding(Policy):
    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        raise ZeroDivisionError("bad policy")


def test_publish_survives_a_failing_retention(any_reg: Registry) -> None:
    reg = any_reg  # a directory or an s3:// root
    publish(reg, "run", [10, 20])
    with pytest.warns(RetentionWarning, match="bad policy"):
        info = reg.publish("run", 30, make_state(30), retention=Exploding())
    assert info.status == "verified" and live(reg, "run") == [10, 20, 30]
    with pytest.raises(InvalidStateError, match="retention must be"):
        reg.publish("run", 40, make_state(40), retention="KeepLast(1)")
    assert reg.catalog.get("run", 40) is None and 40 not in stored_steps(reg, "run")


def test_bad_policies_are_clear_errors(reg: Registry) -> None:
    publish(reg, "run", [10, 20])
    for make in (lambda: KeepLast(0), lambda: KeepLast(True), lambda: KeepBest(0, "m"),  # type: ignore[arg-type]
                 lambda: KeepBest(1, "m", mode="median"), lambda: KeepEvery(-5),  # type: ignore[arg-type]
                 lambda: KeepNewerThan(timedelta(0)), lambda: KeepPolicyVersions(), lambda: MaxBytes(-1),
                 lambda: AnyOf(KeepLast(1), "x")):  # type: ignore[arg-type]
        with pytest.raises(PolicyError):
            make()
    with pytest.raises(InvalidNameError):
        KeepBest(1, "bad key!")

    class ReturnsNames(Policy):
        def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
            return {"step-10": "x"}  # type: ignore[dict-item]

    class ReturnsSet(Policy):
        def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
            return {10, 999}  # type: ignore[return-value]

    with pytest.raises(PolicyError, match="not an integer"):
        reg.plan_retention("run", ReturnsNames())
    assert list(reg.plan_retention("run", ReturnsSet()).keep) == [10, 20]  # a set of steps is fine
    with pytest.raises(PolicyError, match="ZeroDivisionError: bad policy"):
        reg.plan_retention("run", Exploding())
    with pytest.raises(PolicyError):
        reg.plan_retention("run", "KeepLast(1)")  # type: ignore[arg-type]
    with pytest.raises(CheckpointNotFoundError):
        reg.plan_retention("nope", KeepLast(1))
    assert live(reg, "run") == [10, 20]


@pytest.mark.usefixtures("migrated_url")
def test_reader_resolves_again_when_gc_wins_the_race(catalog_url: str, root: Path) -> None:
    """A reader resolves @latest, a publish moves latest and gc deletes the old step before the
    reader takes its lease: the reader must load the new step, not a directory being deleted."""
    with Registry.open(url=catalog_url, root=root) as reader, Registry.open(url=catalog_url, root=root) as trainer:
        publish(trainer, "run", [10, 20])
        real_resolve_leased = reader.catalog.resolve_leased
        raced: list[int] = []

        def lease_after_gc(ref: Any, **kwargs: Any) -> Any:
            # the resolve, then gc's commit, then the lease statement: an order both catalogs allow
            if raced:
                return real_resolve_leased(ref, **kwargs)
            info = reader.catalog.resolve(ref, below=kwargs.get("below"))
            raced.append(info.step)
            trainer.publish("run", 30, make_state(30), retention=KeepLast(1))
            return info, reader.catalog.acquire_lease(info.run, info.step, holder=kwargs["holder"], ttl=kwargs["ttl"])

        reader.catalog.resolve_leased = lease_after_gc  # type: ignore[method-assign]
        ckpt = reader.load("run")
        assert raced == [20] and ckpt.step == 30
        assert_state_equal(ckpt.state_dict, make_state(30))
        assert status(reader, "run", 20) == "deleted"  # not marked corrupt by the reader
        assert not any(e.kind == "corrupt" for e in reader.events("run"))

        # a ref that names the deleted step: a clean not-found, never a read of a vanishing directory
        info = reader.resolve("run@30")
        trainer.publish("run", 40, make_state(40), retention=KeepLast(1))
        with pytest.raises(CheckpointDeletedError):
            read_checked(reader._reader(), info, verify=True, map_location="cpu", trust_pickle=False)
        with pytest.raises(CheckpointNotFoundError):
            reader.load("run@30")


LEASE_HOLDER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    from registry.catalog import Catalog
    url, run, step, ttl = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    catalog = Catalog.open(url)
    lease = catalog.acquire_lease(run, step, holder="lease-holder", ttl=timedelta(seconds=ttl))
    print("leased" if lease is not None else "refused", flush=True)
    sys.stdin.readline()      # hold the lease until the test says so
    if lease is not None:
        catalog.release_lease(lease)
    catalog.close()
""")


def test_lease_held_by_another_process(reg: Registry, catalog_url: str) -> None:
    publish(reg, "run", [10, 20, 30, 40])
    env = child_env()
    holders = [subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, catalog_url, "run", str(step), ttl],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
               for step, ttl in ((20, "3600"), (30, "-1"))]
    try:
        assert [h.stdout.readline().strip() for h in holders] == ["leased", "leased"]  # type: ignore[union-attr]
        result = reg.plan_retention("run", KeepLast(1)).execute()
        assert result.deleted == (10, 30)  # 30's lease had expired: a crashed reader protects nothing
        assert status(reg, "run", 20) == "verified" and reg.store.step_dir("run", 20).is_dir()
        assert_state_equal(reg.load("run@20").state_dict, make_state(20))
    finally:
        for h in holders:
            h.communicate("done\n", timeout=60)
    assert [h.returncode for h in holders] == [0, 0]
    assert reg.plan_retention("run", KeepLast(1)).execute().deleted == (20,)


class Gated(Policy):
    """A policy whose ``keep`` blocks, once armed, inside gc's marking transaction."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.armed, self.inside, self.release = threading.Event(), threading.Event(), threading.Event()

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        if self.armed.is_set():
            self.inside.set()
            assert self.release.wait(120)
        return self.inner.keep(checkpoints, context)


def wait_for_lock_waiter(reg: Registry, deadline: float = 120.0) -> None:
    """On PostgreSQL, poll until some backend waits on a row lock (proves the serialisation)."""
    if reg.catalog.dialect != "postgresql":
        return
    start = time.monotonic()
    with reg.catalog.engine.connect() as conn:
        while time.monotonic() - start < deadline:
            waiting = conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                        "AND datname = current_database()")).scalar_one()
            conn.rollback()
            if waiting:
                return
            time.sleep(0.01)
    raise AssertionError("no backend ever waited on the lock")


@pytest.mark.usefixtures("migrated_url")
def test_lease_taken_while_gc_marks_gets_refused(catalog_url: str, root: Path) -> None:
    """gc holds its marking transaction open; a reader asks for a lease meanwhile: the reader
    waits (PostgreSQL row lock, SQLite write lock) and then gets None, never a lease on a doomed step."""
    with Registry.open(url=catalog_url, root=root) as gc, Registry.open(url=catalog_url, root=root) as reader:
        publish(gc, "run", [10, 20, 30])
        policy = Gated(KeepLast(1))
        plan = gc.plan_retention("run", policy)
        assert list(plan.delete) == [10, 20]
        policy.armed.set()
        with ThreadPoolExecutor(2) as pool:
            gc_done = pool.submit(plan.execute)
            assert policy.inside.wait(120)
            lease = pool.submit(reader.catalog.acquire_lease, "run", 20, holder="reader", ttl=timedelta(hours=1))
            wait_for_lock_waiter(gc)
            policy.release.set()
            assert gc_done.result(120).deleted == (10, 20)
            assert lease.result(120) is None
        # the same holds for a tag: it waits for gc, then finds the step gone
        publish(gc, "run", [40, 50])
        plan = gc.plan_retention("run", policy := Gated(KeepNothing()))
        assert list(plan.delete) == [30, 40]
        policy.armed.set()
        with ThreadPoolExecutor(2) as pool:
            gc_done = pool.submit(plan.execute)
            assert policy.inside.wait(120)
            tagged = pool.submit(reader.tag, "run", 40, "keep-me")
            wait_for_lock_waiter(gc)
            policy.release.set()
            assert gc_done.result(120).deleted == (30, 40)
            with pytest.raises(CheckpointNotFoundError):
                tagged.result(120)


def test_gc_waits_for_a_lease_being_taken_on_postgresql(pg_database: str, tmp_path: Path) -> None:
    """The other order: a reader's lease transaction is open (row held FOR SHARE, lease inserted);
    gc must wait for it and then see the lease. (SQLite: BEGIN IMMEDIATE serialises every writer.)"""
    with Registry.open(url=pg_schema_url(pg_database), root=tmp_path / "ckpt") as reg:
        publish(reg, "run", [10, 20, 30])
        plan = reg.plan_retention("run", KeepLast(1))
        with reg.catalog.engine.connect() as conn:
            txn = conn.begin()
            cid = conn.execute(text("SELECT c.id FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                                    "WHERE r.name = 'run' AND c.step = 20 FOR SHARE")).scalar_one()
            conn.execute(text("INSERT INTO leases (checkpoint_id, holder, expires_at) "
                              "VALUES (:c, 'reader', now() + interval '1 hour')"), {"c": cid})
            with ThreadPoolExecutor(1) as pool:
                gc_done = pool.submit(plan.execute)
                wait_for_lock_waiter(reg)
                txn.commit()
                result = gc_done.result(120)
        assert result.deleted == (10,) and "leased" in result.skipped[20]
        assert status(reg, "run", 20) == "verified"


@pytest.mark.usefixtures("migrated_url")
def test_a_step_republished_while_gc_removes_it_survives(catalog_url: str, root: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``deleted`` row may be claimed again. If a trainer re-publishes the step between gc's mark
    and gc's rename, gc must not remove the new payload (it checks the manifest digest)."""
    with Registry.open(url=catalog_url, root=root) as gc, Registry.open(url=catalog_url, root=root) as trainer:
        publish(gc, "run", [10, 20, 30])
        import registry.ops.retention as retention_mod
        real = retention_mod.crashpoint

        def republish_between(name: str) -> None:
            if name == "gc-after-mark":
                trainer.publish("run", 10, make_state(99))
            real(name)

        monkeypatch.setattr(retention_mod, "crashpoint", republish_between)
        result = gc.plan_retention("run", KeepLast(1)).execute()
        assert result.deleted == (10, 20)
        assert status(gc, "run", 10) == "verified" and status(gc, "run", 20) == "deleted"
        assert_state_equal(gc.load("run@10").state_dict, make_state(99))
        assert not reg_hidden(gc, "run")
        monkeypatch.undo()
        again = gc.plan_retention("run", KeepEvery(10)).execute()  # heals nothing: 10 is live again
        assert again.healed == () and again.deleted == ()
        assert_state_equal(gc.load("run@10").state_dict, make_state(99))


def reg_hidden(reg: Registry, run: str) -> list[str]:
    return [p.name for p in (reg.store.root / run).iterdir() if p.name.startswith(".")]


class KeepSteps(Policy):
    def __init__(self, steps: frozenset[int]) -> None:
        self.steps = steps

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        return {s: "chosen" for s in self.steps}


def test_no_policy_can_break_the_invariants(any_reg: Registry) -> None:
    """Property: whatever steps a policy keeps, the plan deletes exactly the unprotected,
    unkept candidates, and execute() deletes only planned, still-unprotected ones."""
    reg = any_reg  # a directory or an s3:// root
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    steps = list(range(10, 130, 10))
    for step in steps[:-1]:
        reg.publish("run", step, make_state(step), metrics={"eval/loss": 1.0 / step})
    reg.publish("run", steps[-1], make_state(0), verify=False)
    reg.tag("run", 30, "release")
    mark_corrupt(reg, reg.resolve("run@50"), "test")
    assert reg.catalog.acquire_lease("run", 70, holder="reader", ttl=timedelta(hours=1))
    reg.catalog.claim("run", 200, path="run/step-00000200", writer=reg.writer, overwrite=False)
    protected = {30, 70, 110, 120, 200}   # tagged, leased, @latest, @latest-published, staging

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(kept=st.frozensets(st.sampled_from(steps + [200, 999])))
    def check(kept: frozenset[int]) -> None:
        plan = reg.plan_retention("run", KeepSteps(kept))
        assert set(plan.delete) == set(steps) - protected - kept
        assert set(plan.keep) | set(plan.delete) == set(steps) | {200}
        assert plan.bytes_freed == sum(d.total_bytes for d in plan.decisions if d.step in plan.delete)

    check()
    plan = reg.plan_retention("run", KeepSteps(frozenset({20})))
    reg.tag("run", 40, "late")
    result = plan.execute()
    assert set(result.deleted) == set(steps) - protected - {20, 40} and set(result.skipped) == {40}


def test_gc_leaves_a_symlink_with_a_retired_name_alone(reg: Registry, tmp_path: Path) -> None:
    """Finishing a deletion removes only real retired directories: a symlink is not followed, not an error."""
    publish(reg, "run", [1, 2, 3])
    assert reg.apply_retention("run", KeepLast(1)).deleted == (1, 2)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the registry's")
    (reg.store.run_dir("run") / ".step-00000001.retired-planted").symlink_to(outside, target_is_directory=True)
    result = reg.apply_retention("run", KeepLast(1))
    assert result.errors == {} and result.healed == ()
    assert (outside / "keep.txt").read_text() == "not the registry's"


def test_retention_and_fsck_do_not_import_the_facade() -> None:
    """They take a catalog, a root and an actor, so the facade can import them and not the other way round."""
    import ast

    import registry
    package = Path(registry.__file__).parent
    for module in ("retention.py", "ops/retention.py", "fs/removal.py", "ops/fsck.py", "format/layout.py",
                   "catalog/retention.py", "catalog/fsck.py"):
        tree = ast.parse((package / module).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "registry.api" not in imported, module


@pytest.mark.usefixtures("migrated_url")
def test_gc_finishes_a_deletion_interrupted_after_the_retire_and_says_so(catalog_url: str, root: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A gc stopped between hiding a payload and removing it leaves a ``.retired-`` copy; the next gc
    removes it and lists the step as healed (as it does for a final directory left behind)."""
    import registry.fs.removal as removal_mod

    class Stop(Exception):
        pass

    with Registry.open(url=catalog_url, root=root) as reg:
        publish(reg, "run", [10, 20, 30])
        real = removal_mod.crashpoint

        def stop_after_retire(name: str) -> None:
            if name == "gc-after-retire":
                raise Stop(name)
            real(name)
        monkeypatch.setattr(removal_mod, "crashpoint", stop_after_retire)
        with pytest.raises(Stop):
            reg.plan_retention("run", KeepLast(2)).execute()
        monkeypatch.undo()
        assert status(reg, "run", 10) == "deleted"
        assert [n.split("-")[1].split(".")[0] for n in reg_hidden(reg, "run")] == ["00000010"]
        again = reg.plan_retention("run", KeepLast(2)).execute()
        assert again.healed == (10,) and again.deleted == () and not again.errors
        assert reg_hidden(reg, "run") == []
        assert [s for s in (10, 20, 30) if status(reg, "run", s) != "deleted"] == [20, 30]


BAD_PLAN_OPTIONS = [({"protect": {1: 5}}, "say why"), ({"protect": {"x": "y"}}, "invalid step"),
                    ({"protect": {-1: "r"}}, "invalid step"), ({"protect": {True: "r"}}, "invalid step"),
                    ({"protect": [1]}, "must map steps"), ({"now": "2026-01-01"}, "timezone-aware"),
                    ({"now": datetime(2026, 1, 1)}, "timezone-aware")]


@pytest.mark.parametrize(("options", "says"), BAD_PLAN_OPTIONS)
def test_bad_plan_options_are_one_line_and_change_nothing(reg: Registry, options: dict[str, Any], says: str) -> None:
    publish(reg, "run", [10, 20])
    with pytest.raises(RegistryError, match=says) as raised:
        reg.plan_retention("run", KeepLast(1), **options)
    assert "\n" not in str(raised.value)
    assert live(reg, "run") == [10, 20]
