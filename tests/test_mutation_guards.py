"""Guards against mutations that once survived the whole relevant test files.

Each test here fails when one promise is quietly dropped from the code:
a hostile ``.pt`` extra unpickled on the distributed path, ``shared-fs``
trusting a rank that sees a different checkpoint, a PostgreSQL follower
that polls instead of listening, and a rename made durable by fsyncing the
renamed directory instead of its parent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import registry.ops.follow as follow
from registry import Registry
from registry.format.layout import hidden_sibling
from registry.ops.follow import Follower
from registry.retention import KeepLast
from registry.records import CheckpointInfo
from tests._dist_worker import checkpoint_fingerprint
from tests.helpers import make_state, pg_schema_url
from tests.test_distributed import launch, state
from tests.test_hostile import Sentinel

# --------------------------------------------------------------------------- distributed loads


def listing(directory: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in directory.iterdir())


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank gloo group running every distributed scenario of this module."""
    base = tmp_path_factory.mktemp("guards")
    root, url = base / "ckpt", f"sqlite:///{base / 'catalog.db'}"
    refused, trusted = base / "pwned-refused", base / "pwned-trusted"
    other_root = base / "other"
    with Registry.open(url=url, root=root) as reg:
        reg.publish("hostile", 1, state(1), extra={"optimizer": Sentinel(refused)}, trust_pickle=True)
        reg.publish("hostile", 2, state(2), extra={"optimizer": Sentinel(trusted)}, trust_pickle=True)
        for step in (1, 2):
            reg.publish("twin", step, state(step), extra={"rng": {"seed": step}})
        expected = {"twin@2": checkpoint_fingerprint(reg.load("twin@2"))}
        paths = {step: reg.resolve(f"twin@{step}").path for step in (1, 2)}
    # what rank 1 will see at rank 0's path: another checkpoint, same file names and sizes
    with Registry.open(url=f"sqlite:///{base / 'other.db'}", root=other_root) as other:
        for step in (1, 2):
            other.publish("twin", step, state(100 + step), extra={"rng": {"seed": 100 + step}})
        swaps = {step: other.resolve(f"twin@{step}").path for step in (1, 2)}
        expected["other@2"] = checkpoint_fingerprint(other.load("twin@2"))
    for step in (1, 2):
        assert listing(swaps[step]) == listing(paths[step]), "rank 1's copy must differ in bytes only"
        assert (swaps[step] / "manifest.json").read_bytes() != (paths[step] / "manifest.json").read_bytes()
    assert expected["twin@2"] != expected["other@2"]
    assert not refused.exists() and not trusted.exists()
    results, codes = launch(base, 2, [
        {"name": "hostile-broadcast", "ref": "hostile@1", "strategy": "broadcast", "timeout": 20},
        {"name": "hostile-shared-fs", "ref": "hostile@1", "strategy": "shared-fs", "timeout": 20},
        {"name": "split-shared-fs", "ref": "twin@1", "strategy": "shared-fs", "timeout": 20,
         "swap": {"1": str(swaps[1])}},
        {"name": "split-auto", "ref": "twin@2", "strategy": "auto", "timeout": 20, "swap": {"1": str(swaps[2])}},
        {"name": "hostile-trusted", "ref": "hostile@2", "strategy": "broadcast", "timeout": 20,
         "trust_pickle": True},
    ], {"root": str(root), "url": url})
    assert codes == [0, 0], f"ranks exited with {codes}"
    with Registry.open(url=url, root=root) as reg:
        statuses = {ref: reg.resolve(ref).status for ref in ("hostile@1", "twin@1", "twin@2")}
    return {"results": results, "expected": expected, "statuses": statuses,
            "refused": refused, "trusted": trusted}


def on_every_rank(group: dict[str, Any], name: str) -> list[dict[str, Any]]:
    got = [r.get(name) for r in group["results"]]
    assert all(g is not None for g in got), f"{name}: some rank recorded nothing: {got}"
    return got  # type: ignore[return-value]


@pytest.mark.distributed
def test_a_hostile_pickle_never_runs_on_any_rank(group: dict[str, Any]) -> None:
    for name in ("hostile-broadcast", "hostile-shared-fs"):
        got = on_every_rank(group, name)
        assert [g["ok"] for g in got] == [False, False], got
        assert {g["type"] for g in got} == {"UnsafePickleError"}, got
        assert all("trust_pickle" in g["msg"] for g in got), got
    assert not group["refused"].exists(), "a rank ran the pickle's code"
    assert group["statuses"]["hostile@1"] == "verified", "refusing a pickle is not damage"
    trusted = on_every_rank(group, "hostile-trusted")
    assert all(g["ok"] for g in trusted) and len({g["fp"] for g in trusted}) == 1, trusted
    assert group["trusted"].exists(), "the payload was armed: the refusal is what protected the other ranks"


@pytest.mark.distributed
def test_shared_fs_refuses_a_rank_that_sees_another_checkpoint(group: dict[str, Any]) -> None:
    got = on_every_rank(group, "split-shared-fs")
    assert [g["ok"] for g in got] == [False, False], got
    assert {g["type"] for g in got} == {"DistributedError"}, got
    assert all("rank 1 sees a different checkpoint" in g["msg"] for g in got), got
    assert group["statuses"]["twin@1"] == "verified", "another rank's view does not condemn rank 0's files"


@pytest.mark.distributed
def test_auto_broadcasts_to_a_rank_that_sees_another_checkpoint(group: dict[str, Any]) -> None:
    got = on_every_rank(group, "split-auto")
    assert all(g["ok"] and g["strategy"] == "broadcast" for g in got), got
    assert {g["fp"] for g in got} == {group["expected"]["twin@2"]}, "every rank must get rank 0's bytes"
    assert group["statuses"]["twin@2"] == "verified"


# --------------------------------------------------------------------------- PostgreSQL followers


def test_a_postgresql_follower_is_woken_by_notify(pg_database: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With every poll 600 s apart, only a notification can end a 60 s wait before its deadline."""
    url, root = pg_schema_url(pg_database), tmp_path / "ckpt"
    monkeypatch.setattr(follow, "POLL_MIN_S", 600.0)
    monkeypatch.setattr(follow, "POLL_MAX_S", 600.0)
    monkeypatch.setattr(follow, "PG_RECHECK_S", 600.0)
    timeout = 60.0
    with Registry.open(url=url, root=root) as reg, Registry.open(url=url, root=root) as trainer:
        reg.publish("run", 1, make_state(1))
        real_query = Follower._query
        queries: list[CheckpointInfo | None] = []

        def query_then_publish(self: Follower, after_step: int | None) -> CheckpointInfo | None:
            found = real_query(self, after_step)
            queries.append(found)
            if len(queries) == 1:  # the follower found nothing and is about to wait: publish now
                trainer.publish("run", 2, make_state(2))
            return found

        monkeypatch.setattr(Follower, "_query", query_then_publish)
        start = time.monotonic()
        info = reg.wait_for_new("run", after_step=1, timeout=timeout)
        waited = time.monotonic() - start
    assert info is not None and info.step == 2
    assert [q.step if q else None for q in queries] == [None, 2], "one query before the wait, one after the wake-up"
    assert waited < timeout / 2, f"woken after {waited:.1f}s: by the deadline or a poll, not by the notification"


# --------------------------------------------------------------------------- durable renames


@pytest.fixture
def durability(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str, str]]]:
    """Every ``os.replace`` and every directory ``os.fsync``, in order: (kind, src or dir, dst)."""
    events: list[tuple[str, str, str]] = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src: Any, dst: Any, **kw: Any) -> None:
        real_replace(src, dst, **kw)
        events.append(("replace", os.fspath(src), os.fspath(dst)))

    def fsync(fd: int) -> None:
        real_fsync(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            events.append(("fsync-dir", path, ""))

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    yield events


def assert_parent_fsynced_after(events: list[tuple[str, str, str]], *, src: Path | None = None,
                                dst: Path | None = None) -> None:
    """The first directory fsync after the (last) rename from ``src`` / into ``dst`` is of its parent."""
    def matches(e: tuple[str, str, str]) -> bool:
        return e[0] == "replace" and (src is None or e[1] == str(src)) and (dst is None or e[2] == str(dst))
    renames = [i for i, e in enumerate(events) if matches(e)]
    assert renames, f"no rename from {src} to {dst}: {events}"
    after = [e[1] for e in events[renames[-1] + 1:] if e[0] == "fsync-dir"]
    parent = os.path.realpath((src or dst).parent)  # type: ignore[union-attr]
    assert after and after[0] == parent, f"after the rename, directories fsync'd: {after}; expected {parent} first"


def test_publish_fsyncs_the_run_directory_after_the_rename(sqlite_reg: Registry,
                                                           durability: list[tuple[str, str, str]]) -> None:
    final = sqlite_reg.store.step_dir("run", 1)
    sqlite_reg.publish("run", 1, make_state(1))
    assert_parent_fsynced_after(durability, dst=final)
    durability.clear()
    sqlite_reg.publish("run", 1, make_state(2), overwrite=True)
    assert [e[0] for e in durability].count("replace") >= 2, "an overwrite retires the old payload first"
    assert_parent_fsynced_after(durability, dst=final)


def test_gc_fsyncs_the_run_directory_after_retiring(sqlite_reg: Registry,
                                                    durability: list[tuple[str, str, str]]) -> None:
    for step in (1, 2):
        sqlite_reg.publish("run", step, make_state(step))
    final = sqlite_reg.store.step_dir("run", 1)
    durability.clear()
    assert sqlite_reg.apply_retention("run", KeepLast(1)).deleted == (1,)
    assert not final.exists()
    assert_parent_fsynced_after(durability, src=final)


def test_fsck_fsyncs_the_run_directory_after_restoring(sqlite_reg: Registry,
                                                       durability: list[tuple[str, str, str]]) -> None:
    sqlite_reg.publish("run", 1, make_state(1))
    final = sqlite_reg.store.step_dir("run", 1)
    retired = hidden_sibling(final, "retired")
    os.rename(final, retired)  # a crash between an overwrite's two renames
    durability.clear()
    report = sqlite_reg.fsck(repair=True)
    assert final.is_dir() and not retired.exists(), report
    assert_parent_fsynced_after(durability, src=retired, dst=final)
