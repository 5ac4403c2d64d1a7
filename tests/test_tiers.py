"""A fast root with a durable ``s3://`` tier: background replication, the queue across processes, the nearest
copy on load, two hosts sharing one catalog and one durable root. Real SeaweedFS, both catalog backends."""

from __future__ import annotations

import json
import shutil
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import obstore
import pytest
import torch

from registry import Registry
from registry.catalog.replicas import DURABLE, ReplicaCatalog, ReplicaInfo
from registry.errors import CheckpointNotFoundError, InvalidStateError, RootError, RootMismatchError
from registry.format.manifest import MANIFEST
from registry.records import Status
from tests import s3proxy, s3server
from tests._tiers_worker import group_rank_load, in_child, load_latest, publish_three
from tests.helpers import assert_state_equal, child_env, durable_keys, make_state
from tests.killharness import context


def durable_copy(reg: Registry, run: str, step: int) -> ReplicaInfo | None:
    info = reg.catalog.get(run, step)
    assert info is not None
    return ReplicaCatalog(reg.catalog).copy(run, step, DURABLE, manifest_sha256=info.manifest_sha256)


def damage_durable(reg: Registry, run: str, step: int) -> str:
    """Flip a byte of the step's durable copy of its weights; returns the key."""
    copy = reg.wait_durable(run, step)
    assert reg.tiers is not None
    key = f"{copy.path}/model.safetensors"
    raw = bytearray(reg.tiers.durable.get(key))
    raw[-2] ^= 0xFF
    obstore.put(reg.tiers.durable.store, key, bytes(raw))
    return key


@pytest.fixture(scope="module", autouse=True)
def warm_forkserver() -> None:
    """The forkserver's imports (seconds) begin now, beside the tests before the first that forks a child."""
    from multiprocessing import forkserver
    context()
    forkserver.ensure_running()


def start_child(fn: Callable[..., None], *args: str, log: Path, env: dict[str, str] | None = None) -> Any:
    """A process running ``fn(*args)`` with this process's environment (and ``env``), its output into ``log``.

    Forked from the kill harness's forkserver, which imported torch and the registry once: a fresh interpreter
    spends seconds importing them, per child."""
    proc = context().Process(target=in_child, args=(fn, args, {**child_env(), **(env or {})}, str(log)), daemon=True)
    proc.start()
    return proc


def finish_child(proc: Any, log: Path, *, timeout: float = 120) -> tuple[int, str]:
    """The exit code of a child from :func:`start_child` (negative: the signal that ended it), and its output."""
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        pytest.fail(f"a child still ran after {timeout} s:\n{log.read_text(errors='replace')}")
    return int(proc.exitcode), log.read_text(errors="replace") if log.exists() else ""


def run_child(fn: Callable[..., None], *args: str, log: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    return finish_child(start_child(fn, *args, log=log, env=env), log)


# --------------------------------------------------------------------------- publish and replicate


def test_publish_returns_before_replication_then_the_durable_copy_matches(treg: Registry) -> None:
    sd = make_state(1)
    replicator = treg._replication()
    with replicator._drain_lock:  # the thread cannot replicate while we hold this: publish must not wait for it
        info = treg.publish("run", 10, sd, extra={"opt": {"lr": 0.1}}, metrics={"loss": 1.0})
        assert info.status == Status.VERIFIED
        assert durable_copy(treg, "run", 10) is None
        assert [q.step for q in ReplicaCatalog(treg.catalog).queue()] == [10]
    copy = treg.wait_durable("run", 10, timeout=60)
    assert copy.status == "verified" and copy.durable_at is not None and copy.manifest_sha256 == info.manifest_sha256
    assert ReplicaCatalog(treg.catalog).queue() == []
    assert treg.tiers is not None
    for name in sorted(p.name for p in info.path.iterdir()):
        assert bytes(treg.tiers.durable.get(f"{copy.path}/{name}")) == (info.path / name).read_bytes(), name
    assert durable_keys(treg) == sorted([f"{copy.path}/{p.name}" for p in info.path.iterdir()]
                                        + [".registry/root.json"])
    kinds = [(r.location.split(":")[0], r.status) for r in treg.replicas("run", 10)]
    assert kinds == [("durable", "verified"), ("fast", "verified")]
    assert "replicate" in [e.kind for e in treg.events("run", step=10)]


def test_publish_durable_true_waits_and_steps_replicate_in_order(treg: Registry) -> None:
    for step in (3, 1, 2):
        treg.publish("run", step, make_state(step))
    last = treg.publish("run", 4, make_state(4), durable=True)
    assert durable_copy(treg, "run", 4) is not None
    assert treg.resolve("run@latest-durable").step == 4 == last.step
    events = [e.step for e in treg.events("run") if e.kind == "replicate"]
    assert sorted(events) == [1, 2, 3, 4] and events[-1] == 4
    with pytest.raises(InvalidStateError, match="durable=True"):
        treg.publish("run", 5, make_state(5), durable=True, blocking=False)


def test_latest_durable_is_the_newest_step_with_a_durable_copy(treg: Registry) -> None:
    treg.publish("run", 1, make_state(1), durable=True)
    replicator = treg._replication()
    with replicator._drain_lock:
        treg.publish("run", 2, make_state(2))
        assert treg.resolve("run@latest").step == 2
        assert treg.resolve("run@latest-durable").step == 1
        assert treg.load("run@latest-durable").step == 1
    treg.wait_durable("run", 2, timeout=60)
    assert treg.resolve("run@latest-durable").step == 2


def test_plain_root_has_no_latest_durable_and_refuses_durable_calls(migrated_url: str, tmp_path: Path) -> None:
    with Registry.open(migrated_url, root=tmp_path / "plain") as reg:
        reg.publish("run", 1, make_state())
        with pytest.raises(CheckpointNotFoundError, match="durable copy"):
            reg.resolve("run@latest-durable")
        with pytest.raises(InvalidStateError, match="no durable tier"):
            reg.wait_durable("run", 1)
        with pytest.raises(InvalidStateError, match="durable=True"):
            reg.publish("run", 2, make_state(), durable=True)


@pytest.mark.both_backends
def test_two_registries_of_one_process_never_take_over_each_others_live_claims(
        migrated_url: str, fast: Path, durable: str) -> None:
    """Each registry is a writer of its own: while one holds a step's durable claim, another registry of
    the same process leaves the step alone, and takes the claim over once the first is closed."""
    from registry.format.layout import attempt_relpath
    from registry.ops.writers import writer_alive
    with Registry.open(migrated_url, root=fast, durable=durable) as a, \
            Registry.open(migrated_url, root=fast, durable=durable) as b:
        assert a.writer != b.writer
        replicas = ReplicaCatalog(a.catalog)
        with b._replication()._drain_lock:  # a claims the step before b's replicator looks
            b.publish("run", 1, make_state(1))
            [item] = replicas.queue(run="run")
            assert replicas.claim_durable(item, path=attempt_relpath("run", 1), writer=a.writer,
                                          writer_alive=writer_alive) is not None
        assert b.replicate("run") == 0 and durable_copy(b, "run", 1) is None  # a's claim, and a is open
        a.close()
        b.replicate("run", wait=True, timeout=120)
        copy = durable_copy(b, "run", 1)
        assert copy is not None and copy.status == "verified"
        assert b.load("run@latest-durable").step == 1


def test_durable_tier_is_not_a_root_of_its_own(migrated_url: str, fast: Path, durable: str,
                                               tmp_path: Path) -> None:
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        reg.publish("run", 1, make_state(), durable=True)
    with pytest.raises(RootError, match="durable tier of this catalog"):
        Registry.open(migrated_url, root=durable)
    with pytest.raises(RootError, match="must be an s3:// root"):
        Registry.open(migrated_url, root=fast, durable=str(tmp_path / "elsewhere"))
    other = f"sqlite:///{tmp_path / 'other.db'}"
    with pytest.raises(RootMismatchError):  # the durable root is bound to the first catalog
        Registry.open(other, root=tmp_path / "fast-x", durable=durable)


def test_a_corrupt_fast_copy_is_marked_and_never_replicated(treg: Registry) -> None:
    replicator = treg._replication()
    with replicator._drain_lock:
        info = treg.publish("run", 1, make_state(1))
        target = info.path / "model.safetensors"
        raw = bytearray(target.read_bytes())
        raw[-2] ^= 0xFF
        target.write_bytes(bytes(raw))
    replicator.idle(timeout=60)
    assert treg.catalog.get("run", 1).status == Status.CORRUPT
    assert durable_copy(treg, "run", 1) is None
    assert not [k for k in durable_keys(treg) if k.endswith(MANIFEST)]


def test_the_env_and_the_cli_name_the_durable_tier(migrated_url: str, fast: Path, durable: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from registry.cli import main
    monkeypatch.setenv("REGISTRY_DURABLE", durable)
    with Registry.open(migrated_url, root=fast) as reg:
        assert reg.tiers is not None
        replicator = reg._replication()
        with replicator._drain_lock:
            reg.publish("run", 1, make_state())
        replicator.close(wait=False)
        reg._replicator = None
    monkeypatch.delenv("REGISTRY_DURABLE")
    runner = CliRunner()
    out = runner.invoke(main, ["--url", migrated_url, "--root", str(fast), "--durable", durable, "replicate",
                               "--wait"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        assert durable_copy(reg, "run", 1) is not None


# --------------------------------------------------------------------------- kills


@pytest.mark.parametrize("point", ["replicate-after-claim", "replicate-after-upload"])
def test_a_kill_mid_replication_and_the_next_process_finishes_the_queue(
        migrated_url: str, fast: Path, durable: str, point: str) -> None:
    code, out = run_child(publish_three, migrated_url, str(fast), durable, log=fast.parent / "child.log",
                          env={"REGISTRY_CRASH_AT": point})
    assert code == -signal.SIGKILL, out
    with Registry.open(migrated_url, root=fast, durable=durable, create=False) as reg:
        assert [c.step for c in reg.checkpoints("run")] == [1, 2, 3]
        pending = [r for r in reg.replicas("run") if r.location == DURABLE]
        assert [r.status for r in pending] == ["pending"]  # killed holding step 1's claim
        for step in (1, 2, 3):
            copy = reg.wait_durable("run", step, timeout=120)
            assert copy.status == "verified"
        reg._replication().idle(timeout=60)
        live = {r.path for r in reg.replicas("run") if r.location == DURABLE}
        manifests = {k.rsplit("/", 1)[0] for k in durable_keys(reg, "run") if k.endswith(MANIFEST)}
        assert manifests == live
        ck = reg.load("run@latest-durable")
        assert ck.step == 3 and torch.equal(ck.state_dict["w"], torch.full((300_000,), 3.0))


@pytest.mark.parametrize(("point", "kind"), [("replicate-after-claim", "abandoned-replication"),
                                           ("replicate-after-upload", "uncommitted-replication")])
def test_fsck_judges_a_killed_replication_as_the_one_judge_judges_a_killed_publish(
        migrated_url: str, fast: Path, durable: str, point: str, kind: str) -> None:
    """A replication's claim is a publish's claim on the durable tier: killed with its upload whole, it is rolled
    forward (no second upload); killed before, it is given up, its objects go, and the step is replicated again."""
    code, out = run_child(publish_three, migrated_url, str(fast), durable, log=fast.parent / "child.log",
                          env={"REGISTRY_CRASH_AT": point})
    assert code == -signal.SIGKILL, out
    with Registry.open(migrated_url, root=fast, durable=durable, create=False) as reg:
        (claim,) = [r for r in reg.replicas("run") if r.location == DURABLE]
        assert (claim.step, claim.status) == (1, "pending")
        report = reg.fsck()
        assert [(p.kind, p.step) for p in report.problems if p.step == 1] == [(kind, 1)], report.problems
        repaired = reg.fsck(repair=True)
        assert kind in {p.kind for p in repaired.repaired}, repaired
        copies = {r.step: r for r in reg.replicas("run") if r.location == DURABLE}
        assert sorted(copies) == [1, 2, 3] and {r.status for r in copies.values()} == {"verified"}
        if kind == "uncommitted-replication":
            assert copies[1].path == claim.path  # the upload the dead writer finished, recorded as it was
        manifests = {k.rsplit("/", 1)[0] for k in durable_keys(reg, "run") if k.endswith(MANIFEST)}
        assert manifests == {r.path for r in copies.values()}
        assert reg.fsck(checksums=True).clean
        fresh = fast.parent / "fresh"
    with Registry.open(migrated_url, root=fresh, durable=durable) as other:
        assert torch.equal(other.load("run@1").state_dict["w"], torch.full((300_000,), 1.0))


def test_a_kill_mid_download_leaves_a_staging_directory_fsck_removes(migrated_url: str, fast: Path, durable: str,
                                                                     tmp_path: Path) -> None:
    from registry.ops.tiercache import abandoned_downloads, cache_relpath, host_lock, lock_path
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        info = reg.publish("run", 4, {"w": torch.arange(1000.0)}, durable=True)
    host_b = tmp_path / "host-b"
    with Registry.open(migrated_url, root=host_b, durable=durable):
        pass
    code, out = run_child(load_latest, migrated_url, str(host_b), durable, str(tmp_path / "o.json"),
                          log=tmp_path / "child.log", env={"REGISTRY_CRASH_AT": "cache-after-download"})
    assert code == -signal.SIGKILL, out
    cached = host_b / cache_relpath(info)
    leftovers = [d for d in cached.parent.iterdir() if ".tmp-" in d.name]
    assert len(leftovers) == 1 and not cached.exists()
    with Registry.open(migrated_url, root=host_b, durable=durable) as b:
        assert b.tiers is not None
        with host_lock(lock_path(cached)):  # a download under way holds this lock: its staging is not abandoned
            assert abandoned_downloads(b.tiers) == []
        report = b.fsck()
        assert [(p.kind, p.step, p.path) for p in report.problems] == [("abandoned-download", 4, leftovers[0])]
        assert b.fsck(repair=True).repaired and not leftovers[0].exists() and b.fsck().clean
        assert torch.equal(b.load("run@4").state_dict["w"], torch.arange(1000.0))


def test_a_download_evicts_the_cached_copies_no_load_reads_again(migrated_url: str, durable: str,
                                                                  tmp_path: Path) -> None:
    """Host B cached step 1; host A published step 1 again: B's cached copy holds a payload nobody reads any more.
    fsck on B reports it; B's next download evicts it (its row marked deleted) and keeps the copies still live."""
    from registry.ops.tiercache import cache_relpath
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    with Registry.open(migrated_url, root=host_a, durable=durable) as a:
        old = a.publish("run", 1, make_state(1), durable=True)
        a.publish("run", 2, make_state(2), durable=True)
        a.publish("run", 3, make_state(3), durable=True)
        with Registry.open(migrated_url, root=host_b, durable=durable) as b:
            b.load("run@1")
            b.load("run@2")
            two = a.catalog.get("run", 2)
            assert two is not None
            stale, kept = host_b / cache_relpath(old), host_b / cache_relpath(two)
            assert stale.is_dir() and kept.is_dir()
            assert b.fsck().clean
            new = a.publish("run", 1, make_state(11), overwrite=True, durable=True)
            assert [(p.kind, p.step, p.path) for p in b.fsck().problems] == [("stale-cached-copy", 1, stale)]
            assert_state_equal(b.load("run@3").state_dict, make_state(3))  # a download: evicts the stale copy
            assert not stale.exists() and kept.is_dir() and b.fsck().clean
            assert b.tiers is not None
            rows = {r.path: r.status for r in b.replicas("run") if r.location == b.tiers.cache_location}
            assert rows[str(stale.relative_to(host_b))] == "deleted"
            assert rows[str(kept.relative_to(host_b))] == "verified"
            assert_state_equal(b.load("run@1").state_dict, make_state(11))  # the new payload, downloaded anew
            assert (host_b / cache_relpath(new)).is_dir()


@pytest.mark.parametrize("point", ["cache-evict-after-mark", "gc-after-retire"])
def test_a_kill_mid_eviction_leaves_a_marked_copy_fsck_removes(migrated_url: str, durable: str,
                                                                tmp_path: Path, point: str) -> None:
    """Killed after the mark (the copy's directory still in place) or after the rename (a retired sibling holds
    it): fsck names the leftover once, as the unfinished deletion of the copy marked deleted, and removes it."""
    from registry.ops.tiercache import cache_relpath
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    with Registry.open(migrated_url, root=host_a, durable=durable) as a:
        old = a.publish("run", 1, {"w": torch.arange(10.0)}, durable=True)
        with Registry.open(migrated_url, root=host_b, durable=durable) as b:
            b.load("run@1")
        a.publish("run", 1, {"w": torch.arange(11.0)}, overwrite=True, durable=True)
        a.publish("run", 2, {"w": torch.arange(12.0)}, durable=True)
    code, out = run_child(load_latest, migrated_url, str(host_b), durable, str(tmp_path / "o.json"),
                          log=tmp_path / "child.log", env={"REGISTRY_CRASH_AT": point})
    assert code == -signal.SIGKILL, out
    stale = host_b / cache_relpath(old)
    left = [stale] if point == "cache-evict-after-mark" else [
        p for p in stale.parent.iterdir() if p.name.startswith(f".{stale.name}.retired-")]
    assert len(left) == 1 and left[0].is_dir()  # its row says deleted: the kill came before the removal
    with Registry.open(migrated_url, root=host_b, durable=durable) as b:
        report = b.fsck()
        assert [(p.kind, p.step, p.path) for p in report.problems] == [("unfinished-copy-deletion", 1, left[0])]
        repaired = b.fsck(repair=True)
        assert repaired.repaired and not repaired.failures, repaired.to_json()
        assert not left[0].exists() and b.fsck().clean
        assert torch.equal(b.load("run@1").state_dict["w"], torch.arange(11.0))


# --------------------------------------------------------------------------- loads


def test_a_corrupt_fast_copy_loads_the_same_step_from_the_durable_tier(treg: Registry) -> None:
    from registry.ops.tiercache import cache_relpath
    treg.publish("run", 1, make_state(1), durable=True)
    sd = make_state(2)
    info = treg.publish("run", 2, sd, durable=True)
    target = info.path / "model.safetensors"
    raw = bytearray(target.read_bytes())
    raw[-2] ^= 0xFF
    target.write_bytes(bytes(raw))
    ck = treg.load("run@latest")
    assert ck.step == 2 and ck.fallback is None
    assert_state_equal(ck.state_dict, sd)
    assert treg.catalog.get("run", 2).status == Status.VERIFIED  # the step is fine: one copy of it is not
    assert "replica-corrupt" in [e.kind for e in treg.events("run", step=2)]
    assert treg.tiers is not None  # the fast copy stays marked corrupt; the cached copy has a row of its own
    rows = {r.location: (r.status, r.path) for r in treg.replicas("run", 2) if r.location != DURABLE}
    assert rows == {treg.tiers.location: ("corrupt", "run/step-00000002"),
                    treg.tiers.cache_location: ("verified", cache_relpath(info))}
    assert treg.load("run@latest").step == 2  # this host's good copy is the cached one now


def test_a_fresh_disk_resumes_from_the_durable_tier(migrated_url: str, fast: Path, durable: str,
                                                    tmp_path: Path) -> None:
    sd = make_state(3)
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        reg.publish("run", 5, sd, extra={"opt": {"lr": 0.5}}, durable=True)
    shutil.rmtree(fast)  # the machine is gone, and its disk with it
    fresh = tmp_path / "fast-new"
    with Registry.open(migrated_url, root=fresh, durable=durable) as reg:
        ck = reg.load("run@latest")
        assert ck.step == 5 and ck.extra["opt"]["lr"] == 0.5
        assert_state_equal(ck.state_dict, sd)
        again = reg.load("run@latest")  # from this host's cache now
        assert_state_equal(again.state_dict, sd)
        assert reg.tiers is not None
        cached = [r for r in reg.replicas("run", 5) if r.location == reg.tiers.cache_location]
        assert [r.status for r in cached] == ["verified"] and cached[0].path.startswith(".registry/cache/")


def test_latest_falls_back_past_a_step_no_host_here_can_read(migrated_url: str, fast: Path, durable: str,
                                                             tmp_path: Path) -> None:
    with Registry.open(migrated_url, root=fast, durable=durable) as a:
        a.publish("run", 1, make_state(1), durable=True)
        replicator = a._replication()
        with replicator._drain_lock:
            a.publish("run", 2, make_state(2))
            with Registry.open(migrated_url, root=tmp_path / "fast-b", durable=durable) as b:
                b._replication()._drain_lock.acquire()  # b has nothing of its own to replicate anyway
                ck = b.load("run@latest")
                assert ck.step == 1 and ck.fallback is not None and [s.step for s in ck.fallback.skipped] == [2]
                with pytest.raises(CheckpointNotFoundError, match="no copy this host can read"):
                    b.load("run@2")
                b._replication()._drain_lock.release()
            assert a.catalog.get("run", 2).status == Status.VERIFIED


def test_two_hosts_a_step_from_a_resumes_on_b_downloaded_once_for_two_ranks(
        migrated_url: str, durable: str, tmp_path: Path) -> None:
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    w = torch.arange(2_000_000, dtype=torch.float32)
    with Registry.open(migrated_url, root=host_a, durable=durable) as a:
        a.publish("run", 7, {"w": w}, durable=True)
    with Registry.open(migrated_url, root=host_b, durable=durable) as b:
        assert b.tiers is not None and a.tiers is not None and b.tiers.tier_id != a.tiers.tier_id
    outs = [tmp_path / f"rank{i}.json" for i in range(2)]
    logs = [tmp_path / f"rank{i}.log" for i in range(2)]
    procs = [start_child(load_latest, migrated_url, str(host_b), durable, str(out), log=log)
             for out, log in zip(outs, logs)]
    for p, log in zip(procs, logs):
        code, err = finish_child(p, log)
        assert code == 0, err
    import hashlib
    for out in outs:
        assert json.loads(out.read_text()) == {"step": 7, "sha256": hashlib.sha256(w.numpy().tobytes()).hexdigest()}
    cache = host_b / ".registry" / "cache" / "run"
    assert len([d for d in cache.iterdir() if d.is_dir() and not d.name.startswith(".")]) == 1
    assert not [d for d in cache.iterdir() if ".tmp-" in d.name]
    with Registry.open(migrated_url, root=host_b, durable=durable) as b:
        assert b.tiers is not None
        assert len([e for e in b.events("run", step=7) if e.kind == "cached"]) == 1  # one download, two ranks
        rows = [r for r in b.replicas("run", 7) if r.location == b.tiers.cache_location]
        assert len(rows) == 1 and rows[0].status == "verified"
    assert not (host_a / ".registry" / "cache").exists()


def test_a_corrupt_durable_copy_is_marked_and_latest_goes_on_to_an_older_step(treg: Registry) -> None:
    treg.publish("run", 1, make_state(1), durable=True)
    info = treg.publish("run", 2, make_state(2), durable=True)
    damage_durable(treg, "run", 2)
    shutil.rmtree(info.path)  # the fast copy is gone: only the damaged durable copy is left
    ck = treg.load("run@latest")
    assert ck.step == 1 and ck.fallback is not None
    assert [r.status for r in treg.replicas("run", 2) if r.location == DURABLE] == ["corrupt"]
    assert treg.catalog.get("run", 2).status == Status.VERIFIED  # another host's fast copy may still be good
    with pytest.raises(CheckpointNotFoundError, match="no copy this host can read"):
        treg.load("run@2")


def test_verify_rehashes_the_durable_copy_of_a_step_this_host_holds_no_copy_of(treg: Registry) -> None:
    """Fast retention removed the fast copies: verify re-hashes the durable copy. Its damage is the step's, since
    no other copy of the payload stands, and verify says so and records it."""
    from registry.retention import KeepLast
    for step in (1, 2, 3):
        treg.publish("run", step, make_state(step), durable=True)
    assert treg.plan_tier_retention("run", KeepLast(1), tier="fast").execute().deleted == (1, 2)
    assert [(r.step, r.status) for r in treg.verify("run")] == [(1, Status.VERIFIED), (2, Status.VERIFIED),
                                                               (3, Status.VERIFIED)]
    assert sum(e.kind == "verify" for e in treg.events("run", step=1)) == 1
    damage_durable(treg, "run", 2)
    [result] = treg.verify("run@2")
    assert result.status == Status.CORRUPT and "durable copy s3://" in result.problems[0], result
    assert treg.catalog.get("run", 2).status == Status.CORRUPT  # type: ignore[union-attr]
    assert [r.status for r in treg.replicas("run", 2) if r.location == DURABLE] == ["corrupt"]
    assert treg.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]


def test_verify_on_another_host_condemns_only_a_damaged_durable_copy_while_the_fast_copy_stands(
        migrated_url: str, durable: str, tmp_path: Path) -> None:
    with Registry.open(migrated_url, root=tmp_path / "host-a", durable=durable) as a:
        a.publish("run", 1, make_state(1), durable=True)
        damage_durable(a, "run", 1)
    with Registry.open(migrated_url, root=tmp_path / "host-b", durable=durable) as b:
        [result] = b.verify("run@1")
        assert result.status == "corrupt-copy" and not result.ok and "durable copy" in result.problems[0]
        assert b.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
        assert [r.status for r in b.replicas("run", 1) if r.location == DURABLE] == ["corrupt"]
        [again] = b.verify("run@1")  # the copy marked corrupt is read again: still damaged, it stays so
        assert again.status == "corrupt-copy" and "durable copy" in again.problems[0]
        assert [r.status for r in b.replicas("run", 1) if r.location == DURABLE] == ["corrupt"]
    with Registry.open(migrated_url, root=tmp_path / "host-a", durable=durable) as a:
        assert [r.status for r in a.verify("run@1")] == [Status.VERIFIED]  # host A's own copy is good


# --------------------------------------------------------------------------- fsck


def test_fsck_reports_one_tier_steps_and_bad_durable_copies_and_repairs_them(treg: Registry) -> None:
    assert treg.tiers is not None
    durable = treg.tiers.durable
    treg.publish("run", 1, make_state(1), durable=True)
    treg.publish("run", 2, make_state(2), durable=True)
    replicator = treg._replication()
    with replicator._drain_lock:
        treg.publish("run", 3, make_state(3))
        gone = treg.wait_durable("run", 1, timeout=5)
        durable.delete([f"{gone.path}/{MANIFEST}"])  # a durable copy lost
        damaged = ReplicaCatalog(treg.catalog).copy("run", 2, DURABLE,
                                                    manifest_sha256=treg.catalog.get("run", 2).manifest_sha256)
        assert damaged is not None
        key = f"{damaged.path}/model.safetensors"
        obstore.put(durable.store, key, bytes(durable.get(key))[:-1])  # one byte short
        obstore.put(durable.store, "run/step-00000009/a-0123456789abcdef/model.safetensors", b"x")  # an orphan
        report = treg.fsck()
        kinds = sorted((p.kind, p.step) for p in report.problems)
        assert kinds == [("damaged-durable-copy", 2), ("missing-durable-copy", 1), ("only-on-fast-tier", 3),
                         ("orphan-durable-prefix", 9)], report.problems
    report = treg.fsck(repair=True)
    assert {p.kind for p in report.repaired} >= {"damaged-durable-copy", "missing-durable-copy",
                                                 "orphan-durable-prefix"}, (report.repaired, report.failures)
    replicator.idle(timeout=60)
    assert treg.fsck().clean
    for step in (1, 2, 3):
        assert durable_copy(treg, "run", step) is not None


def test_fsck_records_a_whole_durable_copy_no_row_names_and_removes_one_of_no_live_payload(
        migrated_url: str, durable: str, tmp_path: Path) -> None:
    """A catalog restored from a backup taken before replication knows no durable copy; the bucket holds them.
    fsck on a host that holds no fast copy records the whole copy of the live payload instead of deleting it,
    and removes the copy of a payload the step no longer holds."""
    with Registry.open(migrated_url, root=tmp_path / "host-a", durable=durable) as a:
        assert a.tiers is not None
        store = a.tiers.durable
        a.publish("run", 1, make_state(1), durable=True)
        a.publish("run", 2, make_state(2), durable=True)
        first = durable_copy(a, "run", 2)
        assert first is not None
        old = {e.rel: bytes(store.get(e.rel)) for e in store.list(first.path)}
        a.publish("run", 2, make_state(20), durable=True, overwrite=True)
        a._replication().idle(timeout=60)  # the old payload's copy is deleted once the new one committed
        for key, data in old.items():  # back, as a catalog restored from a backup would find the bucket
            obstore.put(store.store, key, data)
        one, two = durable_copy(a, "run", 1), durable_copy(a, "run", 2)
        assert one is not None and two is not None and first.path != two.path
        replicas = ReplicaCatalog(a.catalog)
        for copy in (one, two):
            assert replicas.forget("run", copy.step, DURABLE, path=copy.path, status="verified")
    with Registry.open(migrated_url, root=tmp_path / "host-b", durable=durable) as b:
        report = b.fsck()
        kinds = sorted((p.kind, p.step, str(p.path)) for p in report.problems)
        assert kinds == [("orphan-durable-prefix", 2, first.path), ("unrecorded-durable-copy", 1, one.path),
                         ("unrecorded-durable-copy", 2, two.path)], report.problems
        assert len(b.fsck(repair=True).repaired) == 3
        assert [(c.step, c.path, c.status) for c in b.replicas("run") if c.location == DURABLE] == [
            (1, one.path, "verified"), (2, two.path, "verified")]
        assert b.fsck(checksums=True).clean
        assert_state_equal(b.load("run@2").state_dict, make_state(20))


def test_fsck_on_another_host_does_not_condemn_steps_it_does_not_hold(migrated_url: str, durable: str,
                                                                       tmp_path: Path) -> None:
    with Registry.open(migrated_url, root=tmp_path / "host-a", durable=durable) as a:
        a.publish("run", 1, make_state(1), durable=True)
    with Registry.open(migrated_url, root=tmp_path / "host-b", durable=durable) as b:
        report = b.fsck(repair=True)
        assert report.clean, report.problems
        assert b.catalog.get("run", 1).status == Status.VERIFIED


def test_follow_durable_yields_only_durable_steps(treg: Registry) -> None:
    replicator = treg._replication()
    with replicator._drain_lock:
        treg.publish("run", 1, make_state(1))
        assert [i.step for i in treg.follow("run", timeout=0)] == [1]
        assert list(treg.follow("run", timeout=0, durable=True)) == []
    treg.wait_durable("run", 1, timeout=60)
    assert [i.step for i in treg.follow("run", timeout=0, durable=True)] == [1]


# --------------------------------------------------------------------------- retention per tier


def test_fast_retention_keeps_what_is_not_durable_and_deletes_only_copies(treg: Registry) -> None:
    from registry.retention import KeepLast
    for step in (1, 2, 3):
        treg.publish("run", step, make_state(step), durable=True)
    replicator = treg._replication()
    with replicator._drain_lock:
        treg.publish("run", 4, make_state(4))
        treg.publish("run", 5, make_state(5))
        plan = treg.plan_tier_retention("run", KeepLast(1), tier="fast")
        assert sorted(plan.delete) == [1, 2, 3] and not any(d.ends_step for d in plan.decisions)
        assert "not durable yet" in plan.keep[4]
        result = plan.execute()
        assert result.deleted == (1, 2, 3) and result.ended == ()
    treg.wait_durable("run", 5, timeout=60)  # else fsck rightly finds 4 or 5 only on the fast tier
    for step in (1, 2, 3):
        assert treg.catalog.get("run", step).status == Status.VERIFIED  # the step lives on, on the durable tier
        assert not (treg.store.root / "run" / f"step-{step:08d}").exists()
    assert treg.load("run@2").step == 2  # from the durable tier, into this host's cache
    assert treg.fsck().clean
    with pytest.raises(InvalidStateError, match="per tier"):
        treg.plan_retention("run", KeepLast(1))


def test_durable_retention_and_the_last_copy_ends_the_step(treg: Registry) -> None:
    from registry.retention import KeepEvery, KeepLast
    for step in (1, 2, 3, 4):
        treg.publish("run", step, make_state(step), durable=True)
    treg.plan_tier_retention("run", KeepLast(1), tier="fast").execute()  # fast copies of 1-3 gone
    plan = treg.plan_tier_retention("run", KeepEvery(2), tier="durable")
    assert sorted(plan.delete) == [1, 3]
    assert [d.ends_step for d in plan.decisions if d.action == "delete"] == [True, True]
    assert "@latest-durable" in plan.keep[4]
    result = plan.execute()
    assert result.ended == (1, 3) and result.deleted == (1, 3)
    assert treg.catalog.get("run", 1).status == Status.DELETED
    assert treg.catalog.get("run", 2).status == Status.VERIFIED
    assert treg.tiers is not None
    assert not [k for k in durable_keys(treg, "run/step-00000001")]
    assert treg.fsck().clean


@pytest.mark.both_backends
def test_a_durable_plan_made_while_the_fast_copy_existed_never_deletes_the_last_copy(treg: Registry) -> None:
    """The plan saw two copies and planned a copy-only deletion; the fast copy went before it ran (a trainer's
    fast retention): deleting the durable copy now would leave a live step with no copy, so it is skipped."""
    from registry.retention import KeepLast
    for step in (1, 2, 3):
        treg.publish("run", step, make_state(step), durable=True)
    plan = treg.plan_tier_retention("run", KeepLast(1), tier="durable")
    assert sorted(plan.delete) == [1, 2] and not any(d.ends_step for d in plan.decisions)
    assert treg.plan_tier_retention("run", KeepLast(2), tier="fast").execute().deleted == (1,)
    result = plan.execute()
    assert result.deleted == (2,) and "no other good copy" in result.skipped[1], result
    assert treg.catalog.get("run", 1).status == Status.VERIFIED
    assert_state_equal(treg.load("run@1").state_dict, make_state(1))  # from its durable copy, still there


def test_force_deletes_a_copy_not_yet_durable_and_the_step_with_it(treg: Registry) -> None:
    from registry.retention import KeepLast
    replicator = treg._replication()
    with replicator._drain_lock:
        treg.publish("run", 1, make_state(1))
        treg.publish("run", 2, make_state(2))
        plan = treg.plan_tier_retention("run", KeepLast(1), tier="fast", force=True)
        assert [(d.step, d.ends_step) for d in plan.decisions if d.action == "delete"] == [(1, True)]
        assert plan.execute().ended == (1,)
    assert treg.catalog.get("run", 1).status == Status.DELETED
    replicator.idle(timeout=60)
    assert durable_copy(treg, "run", 1) is None


def test_gc_dry_run_shows_the_plan_per_tier(migrated_url: str, fast: Path, durable: str) -> None:
    from click.testing import CliRunner

    from registry.cli import main
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        for step in (1, 2):
            reg.publish("run", step, make_state(step), durable=True)
    out = CliRunner().invoke(main, ["--url", migrated_url, "--root", str(fast), "--durable", durable, "gc", "run",
                                    "--keep-last", "1", "--dry-run"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "(fast tier)" in out.output and "(durable tier)" in out.output and "DELETE" in out.output


def test_gc_json_on_tiers_says_what_it_did(migrated_url: str, fast: Path, durable: str) -> None:
    """As plain ``gc --json``: the plans, then the chosen tier's result (None for a dry run), so a script can tell
    what was deleted, skipped or failed."""
    import json

    from click.testing import CliRunner

    from registry.cli import main
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        for step in (1, 2, 3):
            reg.publish("run", step, make_state(step), durable=True)
    args = ["--url", migrated_url, "--root", str(fast), "--durable", durable, "gc", "run", "--keep-last", "1",
            "--tier", "fast", "--json"]
    dry = json.loads(CliRunner().invoke(main, [*args, "--dry-run"], catch_exceptions=False).output)
    assert dry["dry_run"] and dry["result"] is None and dry["executed"] == "fast"
    assert [d["step"] for d in dry["tiers"][0]["decisions"] if d["action"] == "delete"] == [1, 2]
    out = CliRunner().invoke(main, args, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["result"]["tier"] == "fast" and doc["result"]["deleted"] == [1, 2] and not doc["result"]["errors"]
    assert doc["result"]["ended"] == [] and doc["result"]["bytes_freed"] > 0


# --------------------------------------------------------------------------- faults


def test_durable_tier_down_the_trainer_goes_on_and_the_queue_catches_up(
        migrated_url: str, tmp_path: Path, s3_env: object, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from registry.retention import KeepLast
    from tests.test_s3_faults import FAST, Private
    met_outage = threading.Event()

    class Outage(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "is failing" in record.getMessage():
                met_outage.set()
    handler = Outage()
    server = Private(tmp_path / "weed")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    logging.getLogger("registry.ops.replicator").addHandler(handler)
    try:
        from tests import s3server
        bucket = s3server.new_bucket(s3server.Server(endpoint=server.endpoint))
        caplog.set_level(logging.INFO, logger="registry.ops.replicator")
        with Registry.open(migrated_url, root=tmp_path / "fast", durable=f"s3://{bucket}/ckpt",
                           storage_options=FAST) as reg:
            reg.publish("run", 1, make_state(1), durable=True)
            server.kill()
            for step in (2, 3, 4):  # the fast tier's commit is all a publish waits for
                assert reg.publish("run", step, make_state(step)).status == Status.VERIFIED
            assert met_outage.wait(120), "the replicator never reported the durable tier down"
            with pytest.raises(TimeoutError, match="cannot"):  # the tier is down: no wait is long enough
                reg.wait_durable("run", 4, timeout=0.1)
            result = reg.plan_tier_retention("run", KeepLast(1), tier="fast").execute()
            assert result.deleted == (1,)  # durable already; 2 and 3 are not, and stay
            assert all((reg.store.root / "run" / f"step-{s:08d}").is_dir() for s in (2, 3, 4))
            assert_state_equal(reg.load("run@3").state_dict, make_state(3))  # loads go on from the fast tier
            server.restart()
            for step in (2, 3, 4):
                assert reg.wait_durable("run", step, timeout=120).status == "verified"
            assert [c.status for c in reg.checkpoints("run")] == [Status.VERIFIED] * 4
        outages = [r for r in caplog.records if "is failing" in r.getMessage()]
        assert len(outages) == 1, [r.getMessage() for r in outages]
        assert any("answers again" in r.getMessage() for r in caplog.records)
    finally:
        logging.getLogger("registry.ops.replicator").removeHandler(handler)
        server.kill()



def test_a_process_group_on_a_fresh_host_loads_through_the_cache(migrated_url: str, durable: str,
                                                                 tmp_path: Path) -> None:
    from tests.helpers import free_port
    w = torch.arange(100_000, dtype=torch.float32)
    with Registry.open(migrated_url, root=tmp_path / "host-a", durable=durable) as a:
        a.publish("run", 3, {"w": w}, durable=True)
    host_b = tmp_path / "host-b"
    with Registry.open(migrated_url, root=host_b, durable=durable):
        pass  # the fresh host's fast root, empty but for its tier marker
    outs = [tmp_path / f"g{r}.json" for r in range(2)]
    logs = [tmp_path / f"g{r}.log" for r in range(2)]

    def group(fast: Path = host_b) -> list[object]:
        port = str(free_port())
        procs = [start_child(group_rank_load, str(r), port, migrated_url, str(fast), durable, str(outs[r]),
                             log=logs[r], env={"OMP_NUM_THREADS": "1"}) for r in range(2)]
        for p, log in zip(procs, logs):
            code, err = finish_child(p, log, timeout=180)
            log.unlink(missing_ok=True)
            assert code == 0, err
        return [json.loads(o.read_text()) for o in outs]

    import hashlib
    expected = {"step": 3, "sha256": hashlib.sha256(w.numpy().tobytes()).hexdigest()}
    assert group() == [expected] * 2
    cached = [d for d in (host_b / ".registry" / "cache" / "run").iterdir() if not d.name.startswith(".")]
    assert len(cached) == 1
    weights = cached[0] / "model.safetensors"  # a bad byte in this host's cache is this host's to repair
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert group() == [expected] * 2
    with Registry.open(migrated_url, root=host_b, durable=durable) as b:
        assert b.catalog.get("run", 3).status == Status.VERIFIED  # type: ignore[union-attr]
        assert len([e for e in b.events("run", step=3) if e.kind == "cached"]) == 2  # downloaded again, once
    assert weights.read_bytes() != bytes(data)

    # host A's own fast copy damaged: the group reads the durable copy of the same step, never an older one,
    # and the step stays verified (one host's disk is that host's copy's trouble)
    host_a = tmp_path / "host-a"
    fast_weights = host_a / "run" / "step-00000003" / "model.safetensors"
    data = bytearray(fast_weights.read_bytes())
    data[-10] ^= 0xFF
    fast_weights.write_bytes(bytes(data))
    assert group(host_a) == [expected] * 2
    with Registry.open(migrated_url, root=host_a, durable=durable) as a:
        assert a.catalog.get("run", 3).status == Status.VERIFIED  # type: ignore[union-attr]
        kinds = [e.kind for e in a.events("run", step=3)]
        assert "replica-corrupt" in kinds and "corrupt" not in kinds, kinds


def test_a_read_only_reader_on_a_fresh_host_loads_from_the_durable_tier(migrated_url: str, durable: str,
                                                                        tmp_path: Path) -> None:
    with Registry.open(migrated_url, root=tmp_path / "host-a", durable=durable) as a:
        a.publish("run", 1, make_state(1), durable=True)
    with Registry.open(migrated_url, root=tmp_path / "host-b", durable=durable):
        pass
    with Registry.open(migrated_url, root=tmp_path / "host-b", durable=durable, read_only=True) as b:
        assert_state_equal(b.load("run@latest").state_dict, make_state(1))
        with pytest.raises(Exception, match="read-only"):
            b.replicate()


def test_show_lists_each_copy_and_when_it_became_durable(migrated_url: str, fast: Path, durable: str) -> None:
    from click.testing import CliRunner

    from registry.cli import main
    with Registry.open(migrated_url, root=fast, durable=durable) as reg:
        reg.publish("run", 1, make_state(1), durable=True)
        with reg._replication()._drain_lock:  # step 2 stays fast-only while show looks at it
            reg.publish("run", 2, make_state(2))
            # read-only: a writer's open would start replicating the queue (step 2) itself
            args = ["--url", migrated_url, "--root", str(fast), "--durable", durable, "--read-only"]
            one = CliRunner().invoke(main, [*args, "show", "run@1"])
            assert one.exit_code == 0, one.output
            copies = [line for line in one.output.splitlines() if line.startswith("copy:")]
            assert len(copies) == 2 and any("durable verified, durable since" in c for c in copies), one.output
            doc = json.loads(CliRunner().invoke(main, [*args, "show", "run@1", "--json"]).output)
            assert sorted(c["location"].split(":")[0] for c in doc["copies"]) == ["durable", "fast"]
            assert all(c["durable_at"] for c in doc["copies"] if c["location"] == DURABLE)
            two = json.loads(CliRunner().invoke(main, [*args, "show", "run@2", "--json"]).output)
            assert [c["location"].split(":")[0] for c in two["copies"]] == ["fast"]


def test_a_manifest_the_durable_server_stored_wrong_is_its_fault_not_the_steps(migrated_url: str, fast: Path,
                                                                               s3_env: s3server.Server) -> None:
    """The fast copy matched its manifest as it was read, so a manifest stored differently on the server (here a
    byte flipped on the wire, with body checksums off) is the tier's trouble: retried, never a verdict."""
    bucket = s3server.new_bucket(s3_env)
    with s3proxy.running(s3_env.endpoint) as proxy:
        options = {"endpoint": proxy.endpoint, "checksum_algorithm": "none", "max_retries": 0}
        with Registry.open(migrated_url, root=fast, durable=f"s3://{bucket}/ckpt", storage_options=options) as reg:
            proxy.flip_put_suffix = "/manifest.json"
            info = reg.publish("run", 1, make_state(1))
            copy = reg.wait_durable("run", 1, timeout=120)  # the first attempt fails its check; the next one holds
            assert proxy.flip_put_suffix == ""
            assert copy.manifest_sha256 == info.manifest_sha256
            assert reg.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
            assert "corrupt" not in [e.kind for e in reg.events("run", step=1)]
            assert_state_equal(reg.load("run@latest-durable").state_dict, make_state(1))



def test_verify_on_a_damaged_fast_copy_marks_the_copy_when_a_durable_copy_stands(treg: Registry) -> None:
    """One host's bad disk is that host's copy's trouble: the step stands on its durable copy. With no durable
    copy yet, the fast copy is the step's only one, and the step is condemned as on a plain root."""
    good = treg.publish("run", 1, make_state(1), durable=True)
    with treg._replication()._drain_lock:
        bare = treg.publish("run", 2, make_state(2))
        for info in (good, bare):
            weights = info.path / "model.safetensors"
            data = bytearray(weights.read_bytes())
            data[-5] ^= 0xFF
            weights.write_bytes(bytes(data))
        results = {r.step: r for r in treg.verify("run")}
    assert (results[1].status, results[1].ok) == ("corrupt-copy", False) and results[1].problems
    assert results[2].status == Status.CORRUPT
    assert treg.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
    assert treg.catalog.get("run", 2).status == Status.CORRUPT  # type: ignore[union-attr]
    assert [(r.location.split(":")[0], r.status) for r in treg.replicas("run", 1)] == [
        ("durable", "verified"), ("fast", "corrupt")]
    assert_state_equal(treg.load("run@latest").state_dict, make_state(1))  # from the durable copy


def test_fsck_repairs_a_damaged_fast_copy_by_marking_the_copy_when_a_durable_copy_stands(treg: Registry) -> None:
    info = treg.publish("run", 1, make_state(1), durable=True)
    weights = info.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    report = treg.fsck(repair=True, checksums=True)
    assert [p.kind for p in report.problems] == ["damaged-payload"] and report.repaired
    assert treg.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
    assert treg.tiers is not None
    copies = {r.location: r.status for r in treg.replicas("run", 1) if r.location != DURABLE}
    assert copies == {treg.tiers.location: "deleted", treg.tiers.cache_location: "verified"}
    assert not info.path.exists()  # condemned, removed, copied again into this host's cache
    assert_state_equal(treg.load("run@latest").state_dict, make_state(1))


def test_an_older_payload_left_on_another_host_is_never_a_verdict_on_the_step(migrated_url: str, durable: str,
                                                                               tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Host B published step 2, host A published it again: B's directory holds B's older payload. Loads on B
    do not read it, and neither a load, verify nor fsck there condemns the step, whose only good copy is A's
    until it is durable; fsck --repair removes B's leftover (its row marked first: a removal that fails leaves
    a deleted row over the files, which the next repair finishes)."""
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    with Registry.open(migrated_url, root=host_b, durable=durable) as b:
        b.publish("run", 1, make_state(1), durable=True)
        b.publish("run", 2, make_state(2), durable=True)
    with Registry.open(migrated_url, root=host_a, durable=durable) as a:
        with a._replication()._drain_lock:
            new = a.publish("run", 2, make_state(22), overwrite=True)
            with Registry.open(migrated_url, root=host_b, durable=durable) as b:
                assert b.load("run@latest").step == 1  # step 2 has no copy B can read yet
                [result] = b.verify("run@2")  # B holds no copy of A's payload, which is not durable yet
                assert result.status == "unreadable" and "no verified durable copy" in result.problems[0]
                from registry.retention import KeepLast
                assert [d.step for d in b.plan_tier_retention("run", KeepLast(1), tier="fast").decisions] == [1]
                report = b.fsck()
                assert [(p.kind, p.step) for p in report.problems] == [("superseded-fast-copy", 2)]
                assert b.catalog.get("run", 2).status == Status.VERIFIED  # type: ignore[union-attr]
                assert not [e for e in b.events("run") if e.kind == "corrupt"]
                from registry.ops import tierfsck

                def refused(*_: object) -> bool:
                    raise PermissionError(13, "refused by the test")
                with monkeypatch.context() as m:
                    m.setattr(tierfsck, "remove_checkpoint_dir", refused)
                    failed = b.fsck(repair=True)
                assert not failed.repaired and "refused by the test" in failed.failures[0]
                assert (host_b / "run" / "step-00000002").is_dir()
                # marked first: the files left are that row's unfinished deletion, never damage to the step
                assert [(p.kind, p.step) for p in b.fsck().problems] == [("unfinished-copy-deletion", 2)]
                assert b.fsck(repair=True).repaired
                assert not (host_b / "run" / "step-00000002").exists() and b.fsck().clean
                assert (host_b / "run" / "step-00000001").is_dir()
                older = [r for r in b.replicas("run", 2) if r.location == b.tiers.location]  # type: ignore[union-attr]
                assert [r.status for r in older] == ["deleted"]
        a.wait_durable("run", 2, timeout=60)
        assert (new.path / MANIFEST).is_file()
    with Registry.open(migrated_url, root=host_b, durable=durable) as b:
        assert [r.status for r in b.verify("run@2")] == [Status.VERIFIED]  # its durable copy, re-hashed
        assert_state_equal(b.load("run@latest").state_dict, make_state(22))  # the new payload, from the durable tier


def test_a_long_upload_keeps_its_claim_fresh_for_other_hosts(treg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replication that takes longer than a writer's staleness window must not look abandoned: its pending
    row is refreshed while it uploads, as a publish refreshes its staging row."""
    from registry.ops import protocol, replicator
    monkeypatch.setattr(protocol, "HEARTBEAT", timedelta(milliseconds=5))
    beat = threading.Event()
    real_touch, real_upload = ReplicaCatalog.touch_durable, replicator.upload_directory

    def touch(self: ReplicaCatalog, claim: object, *, writer: str) -> None:
        real_touch(self, claim, writer=writer)  # type: ignore[arg-type]
        beat.set()

    def pending_updated_at() -> object:
        rows = [r for r in treg.replicas("run", 1) if r.location == DURABLE and r.status == "pending"]
        assert len(rows) == 1
        return rows[0].updated_at

    seen: list[object] = []

    def slow_upload(*args: object, **kwargs: object) -> object:
        seen.append(pending_updated_at())
        for _ in range(2):  # two beats: at least one whole refresh after the first read
            beat.clear()
            assert beat.wait(60)
        seen.append(pending_updated_at())
        return real_upload(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ReplicaCatalog, "touch_durable", touch)
    monkeypatch.setattr(replicator, "upload_directory", slow_upload)
    treg.publish("run", 1, make_state(1), durable=True)
    assert len(seen) == 2 and seen[1] > seen[0]  # type: ignore[operator]
    assert [r.status for r in treg.replicas("run", 1) if r.location == DURABLE] == ["verified"]


def test_a_copy_deletion_that_failed_is_finished_by_fsck(treg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention marks copies deleted, then cannot remove their files (an I/O error; a kill is the same): fsck
    finds the files of each deleted copy, on either tier, and --repair removes them; every step stays live."""
    import errno
    from collections.abc import Mapping, Sequence

    from registry.ops import tierretention
    from registry.records import CheckpointInfo
    from registry.retention import KeepLast, Policy, RetentionContext

    class AllBut4(Policy):
        def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
            return {c.step: "not 4" for c in checkpoints if c.step != 4}

    for step in (1, 2, 3, 4, 5):
        treg.publish("run", step, make_state(step), durable=True)
    real_remove = tierretention._remove

    def failing(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(tierretention, "_remove", failing)
    fast = treg.plan_tier_retention("run", KeepLast(2), tier="fast").execute()
    # marked deleted (as plain retention says it), their files' removal failed: the errors say so
    assert fast.deleted == (1, 2, 3) and sorted(fast.errors) == [1, 2, 3]
    durable = treg.plan_tier_retention("run", AllBut4(), tier="durable").execute()
    assert durable.deleted == (4,) and durable.ended == () and sorted(durable.errors) == [4]  # its fast copy stays
    monkeypatch.setattr(tierretention, "_remove", real_remove)
    report = treg.fsck()
    assert sorted((p.kind, p.step) for p in report.problems) == [("unfinished-copy-deletion", s) for s in (1, 2, 3, 4)]
    assert len(treg.fsck(repair=True).repaired) == 4
    assert treg.fsck().clean
    assert treg.tiers is not None
    assert not durable_keys(treg, "run/step-00000004") and durable_keys(treg, "run/step-00000001")
    assert [s for s in (1, 2, 3, 4, 5) if (treg.store.root / "run" / f"step-{s:08d}").exists()] == [4, 5]
    assert {treg.catalog.get("run", s).status for s in (1, 2, 3, 4, 5)} == {Status.VERIFIED}  # type: ignore[union-attr]
    for step in (1, 4):
        assert_state_equal(treg.load(f"run@{step}").state_dict, make_state(step))


def test_fsck_aborts_a_multipart_upload_no_live_replication_claims(treg: Registry) -> None:
    """A replication killed mid-file leaves an incomplete multipart upload on the durable tier (invisible to
    listings, still billed): fsck reports it and --repair aborts it; the durable copies stay."""
    from registry.format.layout import attempt_relpath
    from registry.fs import multipart
    treg.publish("run", 1, make_state(1), durable=True)
    assert treg.tiers is not None
    durable = treg.tiers.durable
    rel = attempt_relpath("run", 2)
    multipart.start_upload(durable.config, durable.key(f"{rel}/model.safetensors"))
    report = treg.fsck()
    assert [(p.kind, p.step, str(p.path)) for p in report.problems] == [("incomplete-upload", 2, rel)]
    assert len(treg.fsck(repair=True).repaired) == 1
    assert list(multipart.list_uploads(durable.config, durable.key() + "/")) == []
    assert treg.fsck().clean and durable_copy(treg, "run", 1) is not None


def test_a_step_the_durable_tier_refuses_never_holds_back_the_steps_after_it(
        migrated_url: str, fast: Path, s3_env: s3server.Server, caplog: pytest.LogCaptureFixture) -> None:
    """A bucket policy denies one step's keys: the steps after it still become durable, the refused step is
    retried on its own, reported by name, marked nothing, and becomes durable once the server takes it."""
    import logging

    from registry.errors import StorageError
    bucket = s3server.new_bucket(s3_env)
    caplog.set_level(logging.WARNING, logger="registry.ops.replicator")
    with s3proxy.running(s3_env.endpoint) as proxy:
        denied = threading.Event()
        denied.set()
        proxy.deny = lambda seen: denied.is_set() and "/step-00000002/" in seen.path and seen.method != "GET"
        options = {"endpoint": proxy.endpoint, "max_retries": 0}
        with Registry.open(migrated_url, root=fast, durable=f"s3://{bucket}/ckpt", storage_options=options) as reg:
            with reg._replication()._drain_lock:  # the three are queued before the replicator looks
                for step in (1, 2, 3):
                    reg.publish("run", step, make_state(step))
            for step in (1, 3):
                assert reg.wait_durable("run", step, timeout=120).status == "verified"
            assert [q.step for q in reg.replication_queue("run")] == [2]
            with pytest.raises(TimeoutError, match=r"run@2 has no durable copy .*access denied"):
                reg.wait_durable("run", 2, timeout=0.1)
            with pytest.raises(StorageError, match=r"run@2 was not replicated: .*access denied") as refused:
                reg.replicate("run")
            assert (refused.value.run, refused.value.step) == ("run", 2)
            assert reg.catalog.get("run", 2).status == Status.VERIFIED  # type: ignore[union-attr]
            assert "corrupt" not in [e.kind for e in reg.events("run")]
            reg.publish("run", 4, make_state(4))  # a later step is not held back by the refused one either
            assert reg.wait_durable("run", 4, timeout=120).status == "verified"
            denied.clear()
            reg.replicate("run")  # now, not at the end of its backoff (the thread may take it first)
            assert reg.wait_durable("run", 2, timeout=120).status == "verified"
            assert reg.replication_queue("run") == []
            assert_state_equal(reg.load("run@2", verify=True).state_dict, make_state(2))
    messages = [r.getMessage() for r in caplog.records]
    assert not any("is failing" in m for m in messages), messages  # one step's refusal is not an outage
    assert sum("run@2 was not replicated" in m for m in messages) == 1, messages


@pytest.mark.parametrize(("call", "says"), [
    (lambda reg: reg.wait_durable("run", 1, timeout=-1), "timeout must be"),
    (lambda reg: reg.wait_durable("run", 1, timeout=float("nan")), "timeout must be"),
    (lambda reg: reg.wait_durable("run", 1, timeout="1"), "timeout must be"),
    (lambda reg: reg.replicate("run", wait=True, timeout=-5), "timeout must be"),
    (lambda reg: reg.replicate("run", wait="no"), "wait must be True or False"),
    (lambda reg: reg.replicas("run", "1"), "invalid step"),
])
def test_the_tier_calls_refuse_bad_arguments_in_one_line(treg: Registry, call: Callable[[Registry], object],
                                                         says: str) -> None:
    from registry.errors import RegistryError
    treg.publish("run", 1, make_state(1))
    with pytest.raises(RegistryError, match=says) as raised:
        call(treg)
    assert "\n" not in str(raised.value)


def test_a_wait_for_a_durable_copy_that_times_out_is_a_registry_error(treg: Registry) -> None:
    from registry.errors import DurableTimeoutError, RegistryError
    with treg._replication()._drain_lock:  # nothing replicates meanwhile
        treg.publish("run", 1, make_state(1))
        with pytest.raises(DurableTimeoutError, match="run@1 has no durable copy after 0 s") as raised:
            treg.wait_durable("run", 1, timeout=0)
    assert isinstance(raised.value, RegistryError) and isinstance(raised.value, TimeoutError)
    treg.wait_durable("run", 1, timeout=60)
