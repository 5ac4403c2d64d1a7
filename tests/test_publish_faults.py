"""Faults between the claim and the commit of a publish: every claim is undone, and nothing repeats.

A staging directory that cannot be created (a plain file where the run
directory goes, a full or read-only filesystem) must leave the row as it was
before the claim (or ``failed`` for a new step) with a one-line
``PublishError``; a writer id must tell a restarted container's trainer from
its dead predecessor; the old directory of a step may vanish under install
(gc removing it) at any moment; and step directories get the modes the
process umask gives.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

import registry.ops.retention as retention_mod
from registry import CatalogError, PublishError, Registry, StepExistsError
from registry.catalog import Catalog
from registry.catalog.models import CheckpointRow
from registry.errors import AsyncPublishError
from registry.records import CheckpointInfo
from registry.fs.removal import remove_checkpoint_dir
from registry.retention import KeepLast, Policy, RetentionContext
from registry.fs.store import new_staging
from registry.ops.writers import STALE_AFTER, close_writer, open_writer, writer_alive, writer_id
from tests.helpers import assert_state_equal, fail_commits, make_state, write_hf_sharded


def hidden(reg: Registry, run: str = "run") -> list[str]:
    run_dir = reg.store.run_dir(run)
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) if run_dir.is_dir() else []


def status(reg: Registry, step: int, run: str = "run") -> str | None:
    info = reg.catalog.get(run, step)
    return None if info is None else info.status


@pytest.fixture
def failing_mkdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """``errnos.append(E)``: every staging directory made from now on fails with ``E`` (a full or read-only disk)."""
    errnos: list[int] = []
    real_mkdir = os.mkdir

    def mkdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if errnos and ".tmp-" in os.path.basename(os.fspath(path)):
            raise OSError(errnos[-1], os.strerror(errnos[-1]), os.fspath(path))
        real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "mkdir", mkdir)
    yield errnos


# --------------------------------------------------------------------------- a claim with no undo


class KeepSteps(Policy):
    def __init__(self, *steps: int) -> None:
        self.steps = steps

    def keep(self, checkpoints: Sequence[CheckpointInfo], context: RetentionContext) -> Mapping[int, str]:
        return {s: "chosen" for s in self.steps}


def test_a_plain_file_where_the_run_directory_goes(reg: Registry) -> None:
    blocker = reg.store.run_dir("run")
    blocker.write_text("not a directory")
    with pytest.raises(PublishError) as caught:
        reg.publish("run", 1, make_state(1))
    message = str(caught.value)
    assert "\n" not in message and str(blocker) in message and os.strerror(errno.ENOTDIR) in message
    assert status(reg, 1) == "failed"
    with pytest.raises(PublishError):  # the same process may try again at once: the claim was undone
        reg.publish("run", 1, make_state(1))
    assert status(reg, 1) == "failed"
    future = reg.publish("run", 2, make_state(2), blocking=False)
    assert isinstance(future.exception(timeout=120), PublishError)
    with pytest.raises(AsyncPublishError):
        reg.wait()
    assert status(reg, 2) == "failed"
    blocker.unlink()
    assert reg.publish("run", 1, make_state(1)).status == "verified"
    assert reg.publish("run", 2, make_state(2), blocking=False).result(timeout=120).status == "verified"
    assert_state_equal(reg.load("run@latest").state_dict, make_state(2))
    assert hidden(reg) == []


def test_import_into_a_plain_file_is_undone(reg: Registry, tmp_path: Path) -> None:
    source = tmp_path / "hf"
    state = write_hf_sharded(source)
    blocker = reg.store.run_dir("run")
    blocker.write_text("not a directory")
    with pytest.raises(PublishError, match="Not a directory"):
        reg.import_checkpoint(source, run="run", step=5)
    assert status(reg, 5) == "failed"
    blocker.unlink()
    assert reg.import_checkpoint(source, run="run", step=5).status == "verified"
    assert_state_equal(reg.load("run@5").state_dict, state)
    assert hidden(reg) == []


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_a_staging_directory_that_cannot_be_made(reg: Registry, failing_mkdir: list[int], err: int) -> None:
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2), tags=["release"])
    reg.publish("run", 0, make_state(0))
    assert reg.plan_retention("run", KeepSteps(1, 2)).execute().deleted == (0,)
    failing_mkdir.append(err)

    with pytest.raises(PublishError):  # a deleted step published again: it stays deleted
        reg.publish("run", 0, make_state(0))
    assert status(reg, 0) == "deleted"

    with pytest.raises(PublishError, match=os.strerror(err)) as caught:  # a new step: ends failed
        reg.publish("run", 3, make_state(3))
    assert "\n" not in str(caught.value)
    assert status(reg, 3) == "failed"

    with pytest.raises(PublishError, match=os.strerror(err)):  # an overwrite: the old step is back, as it was
        reg.publish("run", 2, make_state(20), overwrite=True, tags=["other"])
    assert status(reg, 2) == "verified"
    for ref in ("run@latest", "run@2", "run@release", "run"):
        assert reg.resolve(ref).step == 2
    assert reg.resolve("run@2").tags == ("release",)
    assert_state_equal(reg.load("run@2").state_dict, make_state(2))
    fsck = reg.fsck()
    assert not fsck.problems and not fsck.in_progress

    failing_mkdir.clear()  # the disk has room again: the same process retries both
    assert reg.publish("run", 2, make_state(20), overwrite=True).status == "verified"
    assert reg.publish("run", 3, make_state(3)).status == "verified"
    assert reg.publish("run", 0, make_state(0)).status == "verified"
    assert_state_equal(reg.load("run@2").state_dict, make_state(20))
    assert reg.resolve("run@latest").step == 3
    assert hidden(reg) == []


@pytest.mark.parametrize("kind", ["new", "overwrite"])
def test_a_failed_commit_on_a_full_disk_is_undone(reg: Registry, failing_mkdir: list[int],
                                                  monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The catalog commit fails while the disk is full: putting the old payload back needs no new directory."""
    reg.publish("run", 2, make_state(2), tags=["release"])
    real_commit = fail_commits(monkeypatch, before=lambda: failing_mkdir.append(errno.ENOSPC))
    step = 3 if kind == "new" else 2
    with pytest.raises(CatalogError, match="nothing was published"):
        reg.publish("run", step, make_state(20), overwrite=True)
    assert status(reg, 2) == "verified" and reg.resolve("run@release").step == 2
    assert_state_equal(reg.load("run@latest").state_dict, make_state(2))
    assert status(reg, 3) == ("failed" if kind == "new" else None)
    assert hidden(reg) == [] and not reg.store.step_dir("run", 3).exists()
    monkeypatch.setattr(Catalog, "commit_publish", real_commit)
    failing_mkdir.clear()
    assert reg.publish("run", step, make_state(20), overwrite=True).status == "verified"
    assert_state_equal(reg.load("run@latest").state_dict, make_state(20))


@pytest.mark.parametrize("how", ["publish", "import"])
def test_an_interrupt_during_the_commit_is_undone(reg: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  how: str) -> None:
    """Ctrl-C while the catalog commits an overwrite: the old payload, its row and the buffered points come back."""
    reg.publish("run", 2, make_state(2), tags=["release"])
    reg.log_metrics("run", 2, {"loss": 0.5})
    source = tmp_path / "hf"
    state = write_hf_sharded(source)
    real_commit = Catalog.commit_publish

    def interrupted(self: Catalog, *args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    def overwrite() -> CheckpointInfo:
        if how == "publish":
            return reg.publish("run", 2, make_state(20), overwrite=True)
        return reg.import_checkpoint(source, run="run", step=2, overwrite=True)
    monkeypatch.setattr(Catalog, "commit_publish", interrupted)
    with pytest.raises(KeyboardInterrupt):
        overwrite()
    assert status(reg, 2) == "verified" and reg.resolve("run@release").step == 2
    assert_state_equal(reg.load("run@2").state_dict, make_state(2))
    assert hidden(reg) == [] and reg.metrics("run") == []
    monkeypatch.setattr(Catalog, "commit_publish", real_commit)
    assert overwrite().status == "verified"
    assert_state_equal(reg.load("run@2").state_dict, make_state(20) if how == "publish" else state)
    reg.flush()
    assert [(m.step, m.key, m.value) for m in reg.metrics("run")] == [(2, "loss", 0.5)]


# --------------------------------------------------------------------------- writer identity


def _claim(reg: Registry, step: int, writer: str) -> None:
    final = reg.store.step_dir("run", step)
    reg.catalog.claim("run", step, path=reg.store.relpath(final), writer=writer, overwrite=False)
    new_staging(final)  # what the dead writer had begun to write


def _age(reg: Registry, step: int, by: timedelta) -> None:
    with reg.catalog.engine.begin() as conn:
        conn.execute(update(CheckpointRow).where(CheckpointRow.c.step == step)
                     .values(updated_at=datetime.now(timezone.utc) - by))


def predecessor(of: str) -> str:
    """The id of a process that had our host name and our pid on this kernel, but started at another time."""
    if of.count(":") == 1:
        return of  # a bare host:pid cannot tell the predecessor from us
    host, pid, boot, start, token = of.split(":")
    assert host == socket.gethostname()[:128] and int(pid) == os.getpid()
    return ":".join((host, pid, boot, str(int(start) + 1) if start.isdigit() else "0", "0" * len(token)))


@pytest.fixture
def live_child() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def test_writer_ids_do_not_repeat_and_say_who_is_alive(live_child: subprocess.Popen[bytes]) -> None:
    me = writer_id()
    assert me == writer_id() and len(me) <= 255
    assert writer_alive(me) and not writer_alive(predecessor(me))
    host, pid, boot, start, _ = me.split(":")
    # a writer of this process is alive while its token is open: a registry's, until it is closed
    assert not writer_alive(f"{host}:{pid}:{boot}:{start}:0123abcd")
    token = open_writer()
    mine = writer_id(token)
    assert mine != me and mine.rsplit(":", 1)[0] == me.rsplit(":", 1)[0] and writer_alive(mine)
    close_writer(token)
    assert not writer_alive(mine) and writer_alive(me)
    # another boot under our host name cannot be asked: its row decides, as for another host
    other_boot = ":".join((host, pid, "f" * 32, start, "0123abcd"))
    now = datetime.now(timezone.utc)
    assert writer_alive(other_boot, now) and not writer_alive(other_boot, now - STALE_AFTER * 2)
    # rows written as host:pid by earlier versions: the pid decides, and a pid that started after the row is reused
    legacy = f"{host}:{live_child.pid}"
    assert writer_alive(legacy) and writer_alive(legacy, now)
    assert not writer_alive(legacy, now - timedelta(hours=1))
    assert not writer_alive(f"{host}:4194399") and not writer_alive(None) and not writer_alive("no-pid")


def test_a_restarted_containers_trainer_takes_over_its_predecessors_claim(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    dead = predecessor(reg.writer)  # same host name, same (live) pid: only the start time differs
    _claim(reg, 2, dead)
    _claim(reg, 3, dead)
    info = reg.publish("run", 2, make_state(2))
    assert info.status == "verified" and info.writer == reg.writer
    assert [e.kind for e in reg.events("run") if e.step == 2][-2:] == ["takeover", "publish"]
    report = reg.fsck(repair=True)
    assert not report.in_progress
    assert {(p.kind, p.step) for p in report.problems} == {("abandoned-staging", 3), ("abandoned-publish", 3)}
    assert status(reg, 3) == "failed" and hidden(reg) == []
    assert reg.publish("run", 3, make_state(3)).status == "verified"


def test_a_legacy_row_of_a_reused_pid_is_taken_over(reg: Registry, live_child: subprocess.Popen[bytes]) -> None:
    """A catalog written by an earlier version: ``host:pid``, and that pid now belongs to a newer process."""
    legacy = f"{socket.gethostname()}:{live_child.pid}"
    _claim(reg, 1, legacy)
    with pytest.raises(StepExistsError):  # refreshed after the process started: it may be the writer
        reg.publish("run", 1, make_state(1))
    _claim(reg, 2, legacy)
    _age(reg, 1, timedelta(hours=1))  # refreshed before the process with that pid started: not its writer
    _age(reg, 2, timedelta(hours=1))
    assert reg.publish("run", 1, make_state(1)).status == "verified"
    report = reg.fsck(repair=True)
    assert {(p.kind, p.step) for p in report.problems} == {("abandoned-staging", 2), ("abandoned-publish", 2)}
    assert status(reg, 2) == "failed" and hidden(reg) == []


# --------------------------------------------------------------------------- the old directory vanishing


@pytest.mark.parametrize("overwrite", [False, True])
def test_republishing_a_step_while_gc_removes_it(catalog_url: str, root: Path, monkeypatch: pytest.MonkeyPatch,
                                                 overwrite: bool) -> None:
    """gc has marked step 10 deleted; the trainer re-publishes it, and gc removes the old directory
    at the moment install is about to retire it."""
    with Registry.open(url=catalog_url, root=root) as gc, Registry.open(url=catalog_url, root=root) as trainer:
        for step in (10, 20, 30):
            trainer.publish("run", step, make_state(step))
        final = trainer.store.step_dir("run", 10)
        old_digest = trainer.catalog.get("run", 10).manifest_sha256  # type: ignore[union-attr]
        real_replace, real_crashpoint = os.replace, retention_mod.crashpoint
        removed: list[bool] = []
        armed: list[bool] = []

        def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            if armed and Path(src) == final:  # install is retiring the old payload: gc removes it first
                armed.clear()
                removed.append(remove_checkpoint_dir(final, old_digest))
            real_replace(src, dst)

        def republish_after_mark(name: str) -> None:
            if name == "gc-after-mark":
                armed.append(True)
                trainer.publish("run", 10, make_state(99), overwrite=overwrite)
            real_crashpoint(name)

        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(retention_mod, "crashpoint", republish_after_mark)
        result = gc.plan_retention("run", KeepLast(1)).execute()
        monkeypatch.undo()
        assert removed == [True]  # the second actor really removed the old directory in the window
        assert result.deleted == (10, 20)
        assert status(gc, 10) == "verified" and status(gc, 20) == "deleted"
        assert_state_equal(gc.load("run@10").state_dict, make_state(99))
        assert hidden(gc) == []
        fsck = gc.fsck()
        assert not fsck.problems and not fsck.in_progress


# --------------------------------------------------------------------------- modes


@pytest.mark.parametrize("umask", [0o002, 0o027])
def test_step_directories_and_files_honour_the_umask(sqlite_reg: Registry, umask: int, tmp_path: Path) -> None:
    reg = sqlite_reg
    source = tmp_path / "hf"
    write_hf_sharded(source)
    previous = os.umask(umask)
    try:
        reg.publish("run", 1, make_state(1), extra={"opt": {"lr": 0.1}})
        reg.publish("run", 1, make_state(2), overwrite=True)
        reg.import_checkpoint(source, run="run", step=2)
    finally:
        os.umask(previous)
    for directory in (reg.store.run_dir("run"), reg.store.step_dir("run", 1), reg.store.step_dir("run", 2)):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o777 & ~umask, directory
        for path in directory.iterdir():
            if path.is_file():
                assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
