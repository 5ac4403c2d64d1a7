"""``publish(..., blocking=False)``: snapshot before return, commit in the background, in order."""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

import registry.fs.payloadfiles as payloadfiles
import registry.fs.store as store_mod
from registry import (AsyncPublishError, CheckpointInfo, CheckpointNotFoundError, InvalidNameError, PublishError,
                      Registry, StepExistsError)
from registry.fs.snapshot import Snapshotter
from tests.helpers import assert_state_equal, child_env, make_state, optimizer_state

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
WAIT = 60  # seconds: a hang guard on every wait, so a regression fails instead of blocking the run


def clone_tree(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    return obj


def test_returns_future_and_commits(reg: Registry) -> None:
    state = make_state(1)
    future = reg.publish("run", 10, state, metrics={"loss": 0.5}, blocking=False)
    assert isinstance(future, Future)
    info = future.result(timeout=WAIT)
    assert isinstance(info, CheckpointInfo)
    assert info.step == 10 and info.status == "verified" and info.metrics == {"loss": 0.5}
    assert_state_equal(reg.load("run@10").state_dict, state)


def test_mutating_right_after_return_does_not_change_what_is_published(reg: Registry) -> None:
    state = make_state(2)
    opt = optimizer_state()
    expected_state = {k: v.clone() for k, v in state.items()}
    expected_opt = clone_tree(opt)
    future = reg.publish("run", 1, state, extra={"optimizer": opt}, config={"lr": [1, 2]}, blocking=False)
    for tensor in state.values():  # the trainer goes on at once
        tensor.zero_() if tensor.dtype != torch.bool else tensor.logical_not_()
    for per_param in opt["state"].values():  # type: ignore[union-attr]
        for value in per_param.values():
            value.add_(100)
    opt["param_groups"][0]["lr"] = 123.0  # type: ignore[index]
    future.result(timeout=WAIT)
    ckpt = reg.load("run@1")
    assert_state_equal(ckpt.state_dict, expected_state)
    loaded = ckpt.extra["optimizer"]
    assert loaded["param_groups"] == expected_opt["param_groups"]  # type: ignore[index]
    for pid, per_param in expected_opt["state"].items():  # type: ignore[union-attr]
        for key, value in per_param.items():
            assert torch.equal(loaded["state"][pid][key], value)
    assert ckpt.config == {"lr": [1, 2]}


def test_publishes_commit_in_call_order(reg: Registry) -> None:
    futures = [reg.publish("run", step, make_state(step), blocking=False) for step in range(1, 6)]
    reg.publish("run", 6, make_state(6))  # a blocking publish goes after the queued ones
    assert all(f.done() for f in futures)
    published = [e.step for e in reg.events("run") if e.kind == "publish"]
    assert published == [1, 2, 3, 4, 5, 6]
    assert reg.resolve("run@latest").step == 6


def test_validation_and_existing_steps_raise_before_return(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    with pytest.raises(StepExistsError):
        reg.publish("run", 1, make_state(1), blocking=False)
    with pytest.raises(InvalidNameError):
        reg.publish("bad name!", 1, make_state(1), blocking=False)
    assert reg.pending_publishes() == 0


class GatedWriter:
    """Holds the background publisher inside ``write_payload`` until ``gate`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()
        self.real = store_mod.write_payload
        self._monkeypatch = monkeypatch
        monkeypatch.setattr("registry.roots.directory.write_payload", self)

    def __call__(self, staging: Path, payload: payloadfiles.Payload, **options: Any) -> payloadfiles.Written:
        self.entered.set()
        assert self.gate.wait(WAIT), "the test never released the held publish"
        return self.real(staging, payload, **options)

    def wait_entered(self) -> None:
        assert self.entered.wait(WAIT), "the background publisher never reached write_payload"

    def ungated(self) -> None:
        """Later publishes write at once (the one held stays held until ``gate`` is set)."""
        self._monkeypatch.setattr("registry.roots.directory.write_payload", self.real)


def test_pending_publish_is_invisible_until_committed(sqlite_reg: Registry,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    reg = sqlite_reg
    held = GatedWriter(monkeypatch)
    future = reg.publish("run", 7, make_state(7), blocking=False)
    try:
        held.wait_entered()
        assert not future.done() and reg.pending_publishes() == 1
        with pytest.raises(CheckpointNotFoundError):
            reg.resolve("run@latest-published")
        with pytest.raises(StepExistsError):  # queued here, claimed in the background
            reg.publish("run", 7, make_state(7), blocking=False)
    finally:
        held.gate.set()  # a failed assertion must not leave the writer blocked
    reg.wait()
    assert future.done() and reg.pending_publishes() == 0
    assert reg.resolve("run@latest").step == 7


def test_a_step_claimed_elsewhere_while_queued_fails_on_the_future(sqlite_reg: Registry,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    reg = sqlite_reg
    held = GatedWriter(monkeypatch)
    first = reg.publish("run", 4, make_state(4), blocking=False)
    try:
        held.wait_entered()  # the background thread is busy with step 4; step 5 waits behind it, unclaimed
        queued = reg.publish("run", 5, make_state(5), meta={"by": "queued"}, blocking=False)
        held.ungated()
        with Registry.open(url=reg.url, root=reg.store.root) as other:
            other.publish("run", 5, make_state(50), meta={"by": "other"})
    finally:
        held.gate.set()
    assert first.result(timeout=WAIT).step == 4
    with pytest.raises(StepExistsError):
        queued.result(timeout=WAIT)
    with pytest.raises(AsyncPublishError, match="run@5"):
        reg.wait()
    ckpt = reg.load("run@5")
    assert ckpt.meta["by"] == "other"
    assert_state_equal(ckpt.state_dict, make_state(50))


class FailingOsCall:
    """``os.NAME`` fails with ``err`` on files under the checkpoint root, on the background publisher's thread only.

    A real failure of the kernel call the publish makes (the writer code runs
    unchanged); ``threads`` records where it struck, so a test can tell it
    struck in the background and not in the caller.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, name: str, err: int) -> None:
        self.root, self.name, self.err = str(root.resolve()), name, err
        self.threads: list[str] = []
        self._real = getattr(os, name)
        self._monkeypatch = monkeypatch
        monkeypatch.setattr(os, name, self)

    def __call__(self, fd: int, *args: Any) -> Any:
        thread = threading.current_thread().name
        if thread.startswith("registry-publish") and os.readlink(f"/proc/self/fd/{fd}").startswith(self.root):
            self.threads.append(thread)
            raise OSError(self.err, os.strerror(self.err))
        return self._real(fd, *args)

    def undo(self) -> None:
        self._monkeypatch.setattr(os, self.name, self._real)


def test_error_surfaces_on_future_and_once_on_next_call(reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    reg.log_metrics("run", 3, {"loss": 1.0})
    full = FailingOsCall(monkeypatch, reg.store.root, "write", errno.ENOSPC)
    future = reg.publish("run", 3, make_state(3), blocking=False)
    with pytest.raises(PublishError, match="No space left"):
        future.result(timeout=WAIT)
    assert full.threads  # the disk filled up under the background writer, not under the caller
    full.undo()
    with pytest.raises(AsyncPublishError, match="run@3") as caught:
        reg.publish("run", 4, make_state(4))
    assert isinstance(caught.value.__cause__, PublishError)
    assert reg.catalog.get("run", 3).status == "failed"  # type: ignore[union-attr]
    assert not reg.store.step_dir("run", 3).exists()
    assert [p.name for p in (reg.store.root / "run").iterdir() if p.name.startswith(".")] == []
    # reported once: the next call goes through, and the metrics were kept for it
    reg.publish("run", 4, make_state(4), blocking=False).result(timeout=WAIT)
    reg.wait()
    assert [(m.step, m.key, m.value) for m in reg.metrics("run")] == [(3, "loss", 1.0)]
    assert_state_equal(reg.load("run@4").state_dict, make_state(4))


def test_wait_raises_a_background_failure(reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = FailingOsCall(monkeypatch, reg.store.root, "fsync", errno.EIO)
    reg.publish("run", 1, make_state(1), blocking=False)
    with pytest.raises(AsyncPublishError, match="Input/output error"):
        reg.wait()
    assert len(broken.threads) == 1  # a failed fsync is not retried: the page cache may have dropped the data
    reg.wait()  # once only
    broken.undo()
    assert reg.catalog.get("run", 1).status == "failed"  # type: ignore[union-attr]
    with pytest.raises(CheckpointNotFoundError):
        reg.resolve("run@latest")


def test_close_waits_for_pending_publishes(catalog_url: str, root: Path) -> None:
    reg = Registry.open(url=catalog_url, root=root)
    states = {step: make_state(step) for step in (1, 2, 3)}
    for step, state in states.items():
        reg.publish("run", step, state, blocking=False)
    reg.close()
    with Registry.open(url=catalog_url, root=root) as again:
        assert [(i.step, i.status) for i in again.checkpoints("run")] == [
            (1, "verified"), (2, "verified"), (3, "verified")]
        assert_state_equal(again.load("run@2").state_dict, states[2])


def test_close_raises_unreported_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry.open(url=f"sqlite:///{tmp_path / 'c.db'}", root=tmp_path / "ckpt")
    broken = FailingOsCall(monkeypatch, reg.store.root, "fsync", errno.EIO)
    reg.publish("run", 1, make_state(1), blocking=False)
    with pytest.raises(AsyncPublishError, match="Input/output error"):
        reg.close()
    assert broken.threads
    reg.close()  # closed; nothing left to report


def test_snapshot_arena_is_reused_and_independent() -> None:
    snaps = Snapshotter()
    state = {"w": torch.randn(64, 32).t(), "scalar": torch.tensor(2, dtype=torch.int16),
             "empty": torch.empty(0, 3), "mask": torch.rand(9) > 0.5, "half": torch.randn(5).to(torch.bfloat16)}
    shared = torch.randn(4)
    extra = {"opt": {"state": {0: {"m": shared, "v": shared}}, "groups": [{"lr": 0.1, "params": [0]}]}}
    first = snaps.take(state, extra)
    assert all(not t.requires_grad and t.device.type == "cpu" for t in first.state_dict.values())
    assert_state_equal(first.state_dict, {k: v.contiguous() for k, v in state.items()})
    copied = first.extra["opt"]["state"][0]
    assert copied["m"] is copied["v"] and torch.equal(copied["m"], shared)
    shared.add_(1)
    assert not torch.equal(copied["m"], shared)
    ptr = first.state_dict["w"].data_ptr()
    first.release()
    assert snaps.idle_bytes >= first.nbytes
    second = snaps.take(state, extra)
    assert second.state_dict["w"].data_ptr() == ptr  # no new allocation for a same-sized state
    assert snaps.idle_bytes == 0
    second.release()
    snaps.clear()
    assert snaps.idle_bytes == 0


def test_snapshot_reused_arena_follows_a_changed_layout() -> None:
    snaps = Snapshotter()
    big = {"a": torch.randn(8, 8), "b": torch.arange(10, dtype=torch.int64)}
    snaps.take(big, {}).release()
    cached = snaps.take(big, {})  # same layout: the views of the last snapshot are reused
    assert_state_equal(cached.state_dict, big)
    cached.release()
    smaller = {"b": torch.arange(3, dtype=torch.int16), "a": torch.randn(2, 5).bfloat16(), "c": torch.tensor(True)}
    second = snaps.take(smaller, {})  # fits in the same arena, cut differently
    assert second.state_dict["b"].data_ptr() == cached.state_dict["a"].data_ptr()
    assert_state_equal(second.state_dict, smaller)
    second.release()
    third = snaps.take(big, {})
    assert_state_equal(third.state_dict, big)
    third.release()
    empty = snaps.take({}, {"note": "no tensors"})
    assert empty.state_dict == {} and empty.extra == {"note": "no tensors"}


def test_snapshot_of_many_small_tensors_copies_on_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    import registry.fs.snapshot as snapshot_mod
    monkeypatch.setattr(snapshot_mod, "PARALLEL_COPY_FROM", 0)
    monkeypatch.setattr(snapshot_mod, "_COPY_THREADS", 3)
    threads: set[str] = set()
    real = snapshot_mod._copy_run

    def spy(views: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        threads.add(threading.current_thread().name)
        real(views, sources)
    monkeypatch.setattr(snapshot_mod, "_copy_run", spy)
    state = {f"p{i}": torch.randn(i % 7 + 1, 3, requires_grad=i % 2 == 0) for i in range(50)}
    state["mask"] = torch.rand(11) > 0.5
    state["half"] = torch.randn(5, 2).to(torch.bfloat16).t()
    snap = Snapshotter().take(state, {})
    assert threads and all(name.startswith("registry-snapshot") for name in threads)
    assert not any(t.requires_grad for t in snap.state_dict.values())
    assert_state_equal(snap.state_dict, {k: v.detach().contiguous() for k, v in state.items()})


def test_snapshot_keeps_one_idle_arena() -> None:
    snaps = Snapshotter(keep=1)
    a = snaps.take({"x": torch.randn(100)}, {})
    b = snaps.take({"x": torch.randn(1000)}, {})
    a.release()
    b.release()
    assert snaps.idle_bytes == b.nbytes  # the larger one, which fits both shapes


@pytest.mark.cuda
@needs_cuda
def test_cuda_state_is_snapshotted_to_pinned_memory(reg: Registry) -> None:
    state = {k: v.cuda() for k, v in make_state(5).items()}
    expected = {k: v.cpu().clone() for k, v in state.items()}
    snaps = Snapshotter()
    snap = snaps.take(state, {})
    assert all(t.is_pinned() for t in snap.state_dict.values())
    snap.release()
    future = reg.publish("run", 1, state, blocking=False)
    for tensor in state.values():
        tensor.zero_() if tensor.dtype != torch.bool else tensor.logical_not_()
    future.result(timeout=WAIT)
    assert_state_equal(reg.load("run@1").state_dict, expected)


def _publish_in_forked_child(reg: Registry) -> None:
    # the inherited registry's background worker, and every module-level pool, must work here
    reg.publish("run", 3, make_state(3), meta={"seed": 3}, blocking=False).result(timeout=WAIT)
    reg.wait()
    assert_state_equal(reg.load("run@3", verify=True).state_dict, make_state(3))
    with Registry.open(url=reg.url, root=reg.store.root) as fresh:
        fresh.publish("run", 4, make_state(4), meta={"seed": 4})
        assert_state_equal(fresh.load("run@2", verify=True).state_dict, make_state(2))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_publishes_and_verifies_after_its_parent_did(sqlite_reg: Registry,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread pools created before a fork are dead in the child; ours are re-created there."""
    import multiprocessing

    import registry.format.pieces as pieces_mod
    import registry.fs.snapshot as snapshot_mod
    monkeypatch.setattr(pieces_mod, "PIECE_SIZE", 4096)  # verification fans out to the verify pool
    monkeypatch.setattr(snapshot_mod, "PARALLEL_COPY_FROM", 0)  # snapshots fan out to the copy pool
    reg = sqlite_reg
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2), blocking=False).result(timeout=WAIT)
    assert_state_equal(reg.load("run@1", verify=True).state_dict, make_state(1))
    child = multiprocessing.get_context("fork").Process(target=_publish_in_forked_child, args=(reg,))
    child.start()
    child.join(timeout=120)  # a hang guard, not a speed check: a broken pool never returns
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, "the forked child hung or failed"
    assert [i.step for i in reg.checkpoints("run")] == [1, 2, 3, 4]
    assert_state_equal(reg.load("run@4", verify=True).state_dict, make_state(4))


CRASH_CHILD = r"""
import sys, torch
from registry import Registry
from registry.crashpoints import arm
reg = Registry.open(url=sys.argv[1], root=sys.argv[2])
reg.publish("run", 1, {"w": torch.ones(3)})
arm(sys.argv[3])
reg.publish("run", 2, {"w": torch.full((3,), 2.0)}, blocking=False)
reg.wait()
print("survived")
"""


@pytest.mark.parametrize("point", ["after-write", "after-rename", "after-commit"])
def test_kill_during_background_publish(tmp_path: Path, point: str) -> None:
    """SIGKILL at each crashpoint on the background thread: the catalog never shows a half-written step."""
    import signal
    import subprocess
    import sys

    url, root = f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", CRASH_CHILD, url, str(root), point], capture_output=True,
                          text=True, env=child_env(), timeout=120)
    assert proc.returncode == -signal.SIGKILL and "survived" not in proc.stdout, proc.stderr[-2000:]
    with Registry.open(url=url, root=root) as reg:
        row = reg.catalog.get("run", 2)
        assert row is not None
        if point == "after-commit":
            assert row.status == "verified"
            assert torch.equal(reg.load("run@2").state_dict["w"], torch.full((3,), 2.0))
        else:
            assert row.status == "staging"  # fsck's to repair; never visible as published
            assert reg.resolve("run@latest-published").step == 1
            info = reg.publish("run", 2, {"w": torch.full((3,), 2.0)}, overwrite=True)  # dead writer: taken over
            assert info.status == "verified"


PRIORITIES = r"""
import json, os, sys, tempfile, threading, torch
import registry.ops.background
from registry import Registry
registry.ops.background.NICE = 10  # opt in
with tempfile.TemporaryDirectory() as tmp, Registry.open(root=tmp) as reg:
    seen = {}
    noted = threading.Event()
    def note():
        try:
            for t in threading.enumerate():
                seen[t.name.rsplit("_", 1)[0]] = os.getpriority(os.PRIO_PROCESS, t.native_id)
        finally:
            noted.set()
    # 64 MiB: big enough that the hash pool's workers are started, by the background publisher's thread
    future = reg.publish("run", 1, {"w": torch.ones(16 << 20)}, blocking=False)
    future.add_done_callback(lambda _: note())  # on the publisher's thread, with the pool workers alive
    future.result(timeout=60)
    noted.wait(60)  # a Future wakes its waiters before it runs its callbacks
    print(json.dumps({"process": os.getpriority(os.PRIO_PROCESS, os.getpid()), **seen}))
"""


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="per-thread priorities are Linux's")
def test_background_publisher_runs_below_the_trainer_and_pools_do_not_inherit_it() -> None:
    """Opted in: a busy machine's cores go to the trainer first; a blocking publish or load later gets full priority."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PRIORITIES], capture_output=True, text=True, env=child_env(),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    base = seen["process"]
    assert seen["MainThread"] == base and seen["registry-publish"] == min(19, base + 10), seen
    assert "registry-hash" in seen and "registry-fsync" in seen, seen
    if os.geteuid() == 0:  # raising a priority back needs privilege (or RLIMIT_NICE)
        assert seen["registry-hash"] == base and seen["registry-fsync"] == base, seen
