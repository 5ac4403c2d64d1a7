"""Fault injection: every write, fsync, directory fsync, rename and catalog commit of publish fails in turn.

A dry run counts the calls a publish makes (only those touching the
checkpoint root); then each one is made to fail, one at a time, with each
errno. Every failure must give a typed error, leave no staging or retired
directory, never retry an fsync, and leave the previous latest (and, for an
overwrite, the old payload of the step) intact and loadable.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from registry import CatalogError, PublishError, Registry
from registry.catalog import Catalog
from tests.helpers import assert_state_equal, fail_commits, make_state

ERRNOS = {"write": (errno.ENOSPC, errno.EIO), "fsync-file": (errno.EIO, errno.ENOSPC),
          "fsync-dir": (errno.EIO,), "replace": (errno.EXDEV, errno.EIO, errno.ENOSPC)}


class Injector:
    """Wraps os.write/os.fsync/os.replace; counts calls under ``root`` and fails the chosen one."""

    def __init__(self, root: Path) -> None:
        self.root = str(root.resolve())
        self.calls: list[str] = []
        self.targets: list[object] = []  # what each call acted on: (device, inode) of an fd, or a path
        self.fail: tuple[str, int, int] | None = None  # (kind, index within kind, errno)
        self.failed_at: int | None = None  # position in self.calls of the injected failure

    def _under_root(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.root)
        except OSError:
            return False

    def _hit(self, kind: str, target: object = None) -> None:
        index = sum(1 for c in self.calls if c == kind)
        self.calls.append(kind)
        self.targets.append(target)
        if self.fail is not None and self.fail[:2] == (kind, index):
            self.failed_at = len(self.calls) - 1
            raise OSError(self.fail[2], os.strerror(self.fail[2]))

    @contextmanager
    def active(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[Injector]:
        real_write, real_fsync, real_replace = os.write, os.fsync, os.replace

        def write(fd: int, data: Any) -> int:
            if self._under_root(fd):
                self._hit("write")
            return real_write(fd, data)

        def fsync(fd: Any) -> None:
            fd_num = fd if isinstance(fd, int) else fd.fileno()
            if self._under_root(fd_num):
                st = os.fstat(fd_num)
                self._hit("fsync-dir" if stat.S_ISDIR(st.st_mode) else "fsync-file", (st.st_dev, st.st_ino))
            return real_fsync(fd)

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            if os.fspath(dst).startswith(self.root) or str(Path(dst).resolve()).startswith(self.root):
                self._hit("replace")
            return real_replace(src, dst, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(os, "write", write)
            m.setattr(os, "fsync", fsync)
            m.setattr(os, "replace", replace)
            yield self


def hidden_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*/.*"))


def scenario(reg: Registry, kind: str) -> Callable[[], Any]:
    """Steps 1 and 2 published; the publish under test adds step 3 or overwrites step 2."""
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2), metrics={"loss": 2.0}, tags=("release",))
    if kind == "new":
        return lambda: reg.publish("run", 3, make_state(3), extra={"opt": {"m": make_state(9)["count"]}})
    return lambda: reg.publish("run", 2, make_state(20), overwrite=True, metrics={"loss": 0.5})


def check_intact(reg: Registry, kind: str) -> None:
    assert hidden_dirs(reg.store.root) == []
    assert reg.resolve("run").step == 2
    assert reg.resolve("run@release").step == 2 and reg.resolve("run@2").status == "verified"
    assert_state_equal(reg.load("run", verify=True).state_dict, make_state(2))
    assert reg.resolve("run@2").metrics == {"loss": 2.0}
    if kind == "new":
        row = reg.catalog.get("run", 3)
        assert row is None or row.status == "failed"
        assert not reg.store.step_dir("run", 3).exists()
    report = reg.fsck(checksums=True)
    assert report.clean and not report.in_progress, report.to_json()


@pytest.mark.parametrize("kind", ["new", "overwrite"])
def test_every_os_call_of_publish_fails_in_turn(reg: Registry, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    publish = scenario(reg, kind)
    injector = Injector(reg.store.root)
    # dry run on a throwaway copy of the situation: count the calls the publish makes
    with Registry.open(url=f"sqlite:///{reg.store.root.parent / 'dry.db'}", root=reg.store.root.parent / "dry") as dry:
        dry_publish = scenario(dry, kind)
        dry_injector = Injector(dry.store.root)
        with dry_injector.active(monkeypatch):
            dry_publish()
    counts = {k: dry_injector.calls.count(k) for k in ERRNOS}
    assert counts["write"] >= 4 and counts["fsync-file"] >= 4 and counts["fsync-dir"] >= 2
    # the install (two renames when overwriting); dedup is off by default (its rename: tests/test_dedup_fate.py)
    assert counts["replace"] == (2 if kind == "overwrite" else 1)
    injected = 0
    for call_kind, n in counts.items():
        for index in range(n):
            for code in ERRNOS[call_kind]:
                injector.calls.clear()
                injector.targets.clear()
                injector.fail = (call_kind, index, code)
                with injector.active(monkeypatch), pytest.raises(PublishError) as info:
                    publish()
                assert info.value.errno == code, (call_kind, index)
                assert "\n" not in str(info.value)
                assert injector.failed_at is not None
                if call_kind.startswith("fsync"):
                    # never retried: the file or directory whose fsync failed is never fsync'd again
                    # (other files' fsyncs already in flight on the helper threads may still finish)
                    failed = injector.targets[injector.failed_at]
                    assert failed not in injector.targets[injector.failed_at + 1:], (call_kind, index)
                check_intact(reg, kind)
                injected += 1
    assert injected == sum(n * len(ERRNOS[k]) for k, n in counts.items())
    print(f"\nfaults injected into a {kind} publish: {injected} ({counts})")  # figures for RELIABILITY.md
    # and the registry still works: the same publish succeeds once the disk behaves
    info = publish()
    assert info.status == "verified" and reg.fsck(checksums=True).clean


@pytest.mark.parametrize("kind", ["new", "overwrite"])
def test_catalog_commit_fails(reg: Registry, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The publish transaction itself fails (disk full under the database): a real rollback."""
    publish = scenario(reg, kind)
    real_commit = fail_commits(monkeypatch)
    with pytest.raises(CatalogError, match="nothing was published"):
        publish()
    monkeypatch.setattr(Catalog, "commit_publish", real_commit)
    check_intact(reg, kind)
    assert any(e.kind == "publish-failed" for e in reg.events("run"))
    assert publish().status == "verified"
    assert_state_equal(reg.load("run@latest").state_dict, make_state(3 if kind == "new" else 20))
