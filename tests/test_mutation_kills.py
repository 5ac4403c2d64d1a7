"""Tests written to kill the mutants that survived the matching test files (scripts/mutants).

Each test names the behaviour a surviving mutant broke; the mutant itself is listed in RELIABILITY.md.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import registry.fs.payloadfiles as payloadfiles
import registry.fs.store as store_mod
import registry.roots.directory as directory_root
from registry import CatalogError, CorruptCheckpointError, PublishError, Registry
from registry.checkpoint import Checkpoint
from registry.ops.retention import Decision, RetentionPlan, RetentionResult
from registry.retention import KeepLast, KeepPolicyVersions
from registry.errors import InvalidNameError, InvalidRefError, InvalidStateError, PolicyError, RootError
from registry.format.layout import hidden_sibling
from registry.format.manifest import MANIFEST, WEIGHTS, WEIGHTS_INDEX
from registry.format.refs import MAX_STEP, Ref, check_run_name, check_step, parse_ref
from registry.fs.payloadfiles import json_bytes
from registry.fs.store import Store
from registry.fs.payloadfiles import Written
from registry.ops.writers import writer_alive
from tests.helpers import assert_state_equal, fail_commits, make_state


# --- registry/format/refs.py ---------------------------------------------------------------------------------

def test_steps_stop_at_the_largest_64_bit_integer() -> None:
    assert MAX_STEP == 2**63 - 1
    assert check_step(2**63 - 1) == 2**63 - 1
    with pytest.raises(InvalidNameError, match="64-bit"):
        check_step(2**63)
    assert parse_ref(f"run@{2**63 - 1}").step == 2**63 - 1
    with pytest.raises(InvalidRefError, match="does not fit in 64 bits"):
        parse_ref(f"run@{2**63}")


@pytest.mark.parametrize("name", ["catalog.db", "CATALOG.DB", "catalog.db-wal", "Catalog.db-journal"])
def test_the_catalogs_file_names_are_refused_as_run_names_with_one_line(name: str) -> None:
    with pytest.raises(InvalidNameError) as info:
        check_run_name(name)
    message = str(info.value)
    assert "\n" not in message
    assert "'catalog.db-*'" in message and "reserved for the catalog" in message


def test_a_ref_is_frozen_and_keyword_only() -> None:
    ref = parse_ref("run@7")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.step = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        Ref("run", "latest")  # type: ignore[misc]


# --- registry/fs/store.py ------------------------------------------------------------------------------------

def test_a_zombie_writer_is_not_alive() -> None:
    """A writer that exited but was not reaped holds its pid and its /proc entry, yet writes nothing."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # wait for the exit but leave the child unreaped: a zombie, state "Z" in /proc/PID/stat
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        assert writer_alive(f"{socket.gethostname()[:128]}:{proc.pid}") is False
    finally:
        proc.wait()
    assert writer_alive(f"{socket.gethostname()[:128]}:{os.getpid()}") is True


def test_a_stale_staging_directory_that_cannot_be_removed_does_not_stop_a_publish(
        reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Removing a dead writer's staging leftovers is best effort: fsck removes what the next publish could not."""
    final = reg.store.step_dir("run", 1)
    final.parent.mkdir(parents=True)
    stale = hidden_sibling(final, "tmp")
    stale.mkdir()
    real_rmdir = os.rmdir

    def rmdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if os.fspath(path) == os.fspath(stale):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        real_rmdir(path, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "rmdir", rmdir)
    assert reg.publish("run", 1, make_state(1)).status == "verified"
    assert stale.is_dir()


@pytest.mark.parametrize("doc,why", [
    ({"lr": float("nan")}, "not JSON-serialisable"),
    ({"lr": float("inf")}, "not JSON-serialisable"),
    ({"layers": [{"1": 1}, {1: 2}]}, "is not a string"),  # a key checked through a list
    ({"x": [[[[{2: 0}]]]]}, "is not a string"),
])
def test_json_that_would_not_read_back_as_written_is_refused(doc: dict[str, object], why: str) -> None:
    with pytest.raises(InvalidStateError, match=why):
        json_bytes(doc, "meta")


def test_json_nested_too_deeply_is_refused_with_one_line() -> None:
    shallow: object = []  # the dict is level 1, each list one more
    for _ in range(payloadfiles.MAX_JSON_DEPTH - 2):
        shallow = [shallow]
    json_bytes({"x": shallow}, "meta")
    too_deep: object = []
    for _ in range(payloadfiles.MAX_JSON_DEPTH - 1):
        too_deep = [too_deep]
    with pytest.raises(InvalidStateError, match="nested more than"):
        json_bytes({"x": too_deep}, "meta")
    past_the_stack: object = []
    for _ in range(sys.getrecursionlimit() * 2):
        past_the_stack = [past_the_stack]
    with pytest.raises(InvalidStateError, match="nested too deeply"):
        json_bytes({"x": past_the_stack}, "meta")


def test_json_over_the_size_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payloadfiles, "MAX_JSON_BYTES", 100)
    assert json_bytes({"x": "a" * 50}, "meta")
    with pytest.raises(InvalidStateError, match="at most 100 can be stored"):
        json_bytes({"x": "a" * 100}, "meta")


def test_shards_are_filled_up_to_the_bound_and_none_is_empty(reg: Registry) -> None:
    """16 KiB tensors under a 40,000-byte bound go two to a shard; a tensor over the bound gets one of its own."""
    state = {f"w{i}": torch.randn(64, 64) for i in range(6)}
    state["big"] = torch.randn(64, 256)  # 64 KiB, sorts first
    info = reg.publish("run", 1, state, max_shard_size=40_000)
    weight_map = json.loads((info.path / WEIGHTS_INDEX).read_text())["weight_map"]
    groups: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        groups.setdefault(file, set()).add(name)
    assert sorted(map(sorted, groups.values())) == [["big"], ["w0", "w1"], ["w2", "w3"], ["w4", "w5"]]
    assert sorted(p.name for p in info.path.glob("*.safetensors")) == sorted(groups)
    assert_state_equal(reg.load("run@1").state_dict, state)


@pytest.mark.parametrize("create", [True, False])
def test_a_root_that_is_a_file_is_named_as_such(tmp_path: Path, create: bool) -> None:
    root = tmp_path / "root"
    root.write_text("not a directory")
    with pytest.raises(RootError, match="checkpoint root is not a directory"):
        Store(root, create=create)
    assert root.read_text() == "not a directory"


def test_saving_over_a_directory_replaces_it_and_leaves_no_retired_copy(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    Checkpoint(state_dict=make_state(1), epoch=1).save(target)
    Checkpoint(state_dict=make_state(2), epoch=2).save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    loaded = Checkpoint.load(target, verify_checksums=True)
    assert loaded.epoch == 2
    assert_state_equal(loaded.state_dict, make_state(2))


def test_a_root_marker_that_cannot_be_read_is_a_root_error(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    store.marker.mkdir(parents=True)  # EISDIR on read
    with pytest.raises(RootError, match="cannot read .*Is a directory"):
        store.read_marker()


# --- registry/ops/protocol.py --------------------------------------------------------------------------------

def test_a_failed_read_back_names_the_file_and_publishes_nothing(reg: Registry,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The filesystem loses the tail of the weights between the write and the read-back check."""
    real_check = directory_root.check_written

    def truncate_then_check(directory: Path, written: Written) -> list[store_mod.FileProblem]:
        victim = directory / WEIGHTS
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size - 1)
        return real_check(directory, written)
    monkeypatch.setattr(directory_root, "check_written", truncate_then_check)
    with pytest.raises(CorruptCheckpointError, match=f"read-back of .* failed: {WEIGHTS}: "):
        reg.publish("run", 1, make_state(1))
    info = reg.catalog.get("run", 1)
    assert info is None or info.status == "failed"
    run_dir = reg.store.run_dir("run")
    assert not run_dir.exists() or list(run_dir.iterdir()) == []


def test_an_overwrite_that_fails_over_a_vanished_payload_leaves_the_step_failed(
        reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row returns to ``verified`` only with its old payload still in place; here it was removed meanwhile."""
    info = reg.publish("run", 1, make_state(1))
    shutil.rmtree(info.path)
    real_mkdir = os.mkdir

    def mkdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if ".tmp-" in os.path.basename(os.fspath(path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "mkdir", mkdir)
    # the error names the file it concerns when that is not the step's own directory
    with pytest.raises(PublishError, match=rf"No space left on device: \S*/\.{info.path.name}\.tmp-"):
        reg.publish("run", 1, make_state(2), overwrite=True)
    assert reg.catalog.get("run", 1).status == "failed"  # type: ignore[union-attr]
    [failed] = [e for e in reg.events("run", step=1) if e.kind == "publish-failed"]
    assert "No space left on device" in failed.detail["reason"] and failed.detail["restored"] is False


def test_an_overwrite_that_fails_where_the_old_payload_cannot_be_seen_leaves_the_step_failed(
        reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fails: the staging directory gets ENOSPC, then the old payload answers EIO: not presumed intact."""
    info = reg.publish("run", 1, make_state(1))
    final = os.fspath(info.path)
    real_mkdir, real_stat = os.mkdir, os.stat
    failing: list[bool] = []

    def mkdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if ".tmp-" in os.path.basename(os.fspath(path)):
            failing.append(True)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if failing and isinstance(path, (str, os.PathLike)) and os.fspath(path) == final:
            raise OSError(errno.EIO, os.strerror(errno.EIO), final)
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(PublishError, match="No space left"):
        reg.publish("run", 1, make_state(2), overwrite=True)
    assert failing
    monkeypatch.undo()
    assert reg.catalog.get("run", 1).status == "failed"  # type: ignore[union-attr]


def test_a_failed_commit_records_why_and_puts_the_old_payload_back(reg: Registry,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    reg.publish("run", 1, make_state(1))
    fail_commits(monkeypatch)
    with pytest.raises(CatalogError, match="database or disk is full"):
        reg.publish("run", 1, make_state(2), overwrite=True)
    monkeypatch.undo()
    assert reg.catalog.get("run", 1).status == "verified"  # type: ignore[union-attr]
    [failed] = [e for e in reg.events("run", step=1) if e.kind == "publish-failed"]
    assert "database or disk is full" in failed.detail["reason"] and failed.detail["restored"] is True
    assert_state_equal(reg.load("run@1").state_dict, make_state(1))


def test_a_failed_commit_whose_undo_fails_too_says_so_and_leaves_the_step_failed(
        reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit fails, then every rename fails (EIO): the old payload is not back, so the row is not restored."""
    reg.publish("run", 1, make_state(1))
    failing: list[bool] = []
    real_replace = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str], **kwargs: object) -> None:
        if failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(src))
        real_replace(src, dst, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "replace", replace)
    fail_commits(monkeypatch, before=lambda: failing.append(True))
    with pytest.raises(PublishError, match="nor undo its rename: Input/output error.*fsck --repair"):
        reg.publish("run", 1, make_state(2), overwrite=True)
    monkeypatch.undo()
    assert reg.catalog.get("run", 1).status == "failed"  # type: ignore[union-attr]
    [failed] = [e for e in reg.events("run", step=1) if e.kind == "publish-failed"]
    assert failed.detail["restored"] is False



@pytest.mark.parametrize("raised", ["bug", "registry"])
def test_a_commit_that_raises_something_else_is_undone_and_reported_as_what_it_was(
        reg: Registry, monkeypatch: pytest.MonkeyPatch, raised: str) -> None:
    """A bug in the commit (not a database error) is a CatalogError naming the step; a RegistryError stays itself."""
    from registry.catalog import Catalog
    from registry.errors import InvalidStateError
    reg.publish("run", 1, make_state(1))

    def commit_publish(self: Catalog, *args: object, **kwargs: object) -> None:
        if raised == "bug":
            raise RuntimeError("driver bug")
        raise InvalidStateError("refused by the catalog", run="run", step=1)
    monkeypatch.setattr(Catalog, "commit_publish", commit_publish)
    if raised == "bug":
        with pytest.raises(CatalogError, match=r"could not record run@1 in the catalog, nothing was published: "
                                               r"driver bug"):
            reg.publish("run", 1, make_state(2), overwrite=True)
    else:
        with pytest.raises(InvalidStateError, match="refused by the catalog") as caught:
            reg.publish("run", 1, make_state(2), overwrite=True)
        assert not isinstance(caught.value, CatalogError)
    monkeypatch.undo()
    assert reg.catalog.get("run", 1).status == "verified"  # type: ignore[union-attr]
    assert_state_equal(reg.load("run@1").state_dict, make_state(1))


# --- registry/ops/fsck.py ------------------------------------------------------------------------------------

def test_fsck_names_the_step_it_could_not_read_and_condemns_nothing(reg: Registry,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO on one step's manifest is a local failure: reported as ``RUN@STEP: cannot check``, not corruption."""
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2))
    bad = reg.store.step_dir("run", 2) / MANIFEST
    real_open = os.open

    def open_(path: str | os.PathLike[str], flags: int, *args: object, **kwargs: object) -> int:
        dir_fd = kwargs.get("dir_fd")
        full = os.fspath(path) if dir_fd is None else os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"),
                                                                   os.fspath(path))
        if full == os.fspath(bad):
            raise OSError(errno.EIO, os.strerror(errno.EIO), full)
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "open", open_)
    report = reg.fsck(repair=True)
    monkeypatch.undo()
    assert [f.split(": ")[:2] for f in report.failures] == [["run@2", "cannot check"]]
    assert report.problems == ()
    assert [reg.catalog.get("run", s).status for s in (1, 2)] == ["verified", "verified"]  # type: ignore[union-attr]



# --- registry/catalog/queries.py -----------------------------------------------------------------------------

def test_timestamps_read_back_from_the_catalog_are_utc_aware(reg: Registry) -> None:
    """SQLite hands timestamps back naive; every one the catalog returns is aware, in UTC, on both backends."""
    reg.publish("run", 1, make_state(1), metrics={"eval/loss": 1.0})
    stamps = [r.created_at for r in reg.runs()]
    stamps += [p.logged_at for p in reg.metrics("run")]
    stamps += [e.created_at for e in reg.events("run")]
    assert stamps and all(t is not None and t.utcoffset() == timedelta(0) for t in stamps)



def test_a_status_change_records_its_event_and_a_refused_one_records_none(reg: Registry) -> None:
    info = reg.publish("run", 1, make_state(1))
    assert not reg.catalog.set_status("run", 1, "corrupt", kind="scrub", actor="tester", manifest_sha256="0" * 64,
                                      reason="a payload that is not there any more")
    assert reg.catalog.set_status("run", 1, "corrupt", kind="scrub", actor="tester",
                                  manifest_sha256=info.manifest_sha256, reason="bytes differ")
    [event] = [e for e in reg.events("run", step=1) if e.kind == "scrub"]
    assert (event.actor, event.detail["status"], event.detail["reason"]) == ("tester", "corrupt", "bytes differ")
    assert reg.catalog.get("run", 1).status == "corrupt"  # type: ignore[union-attr]



# --- registry/retention.py, registry/ops/retention.py -----------------------------------------------------

@pytest.mark.parametrize("versions", [[-1], [True], ["3"], [1, -2]])
def test_policy_versions_must_be_non_negative_integers(versions: list[object]) -> None:
    with pytest.raises(PolicyError, match="non-negative integers"):
        KeepPolicyVersions(versions=versions)  # type: ignore[arg-type]


def test_retention_plans_and_results_are_frozen_and_keyword_only(reg: Registry) -> None:
    for step in (1, 2):
        reg.publish("run", step, make_state(step))
    plan = reg.plan_retention("run", KeepLast(1))
    result = reg.apply_retention("run", KeepLast(1))
    assert result.deleted == (1,)
    for obj, field in ((plan, "run"), (plan.decisions[0], "action"), (result, "run")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, None)
    for cls in (Decision, RetentionResult, RetentionPlan):
        fields = [f.name for f in dataclasses.fields(cls)]
        with pytest.raises(TypeError):
            cls(*[None] * len(fields))



def test_a_plan_for_an_invalid_run_name_is_refused(reg: Registry) -> None:
    with pytest.raises(InvalidNameError, match="invalid run name"):
        reg.plan_retention("no such/run", KeepLast(1))
