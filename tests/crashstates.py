"""Crash states, not only kills: what a power cut can leave of a publish, an overwrite, a gc and an fsck.

A SIGKILL keeps the page cache, so a kill test never sees a file whose
contents were not fsync'd, nor a rename whose directory was not. Here the
file-system operations of one real operation are recorded (in a child
process, which then exits, so its writer is really gone), and every on-disk
state a crash could leave is built and handed to ``fsck --repair``.

Recording. ``os.open``/``os.write``/``os.fsync``/``os.close``/``os.mkdir``/
``os.replace``/``os.rename``/``os.unlink``/``os.rmdir``/``os.link`` and ``shutil.rmtree``
are wrapped while the operation runs; every call on a path under the root
becomes an event on an inode model of the root (a file descriptor is mapped
to the inode ``os.open`` gave it, so ``HashingWriter``'s ``os.write`` on a
raw fd is seen). ``shutil.rmtree`` is recorded as the unlinks and rmdirs it
makes, children first. The SQLite catalog is copied with the ``sqlite3``
backup API before every file-system event, at every catalog commit and at
the end; a copy that differs from the previous one is a ``catalog`` event.
The catalog runs in WAL mode with ``synchronous = FULL``, so a commit is
durable when it returns: the catalog of a crash state is the last copy
before the crash point. (Heartbeats and reader leases commit without the
WAL fsync; none happens inside the operations recorded here.) SQLite only:
PostgreSQL's own durability is the server's business, and a file copy of it
cannot be taken mid-operation. The tree before the operation counts as
durable (for ``fsck`` it is what a SIGKILLed overwrite left).

Operations (``SCENARIOS``): a publish of a new step into an existing run,
the first publish of a run, an overwrite, an overwrite whose catalog commit
fails (its renames are undone), a gc deleting two of three steps, and an
fsck repairing an overwrite killed between its two renames.

Crash model (the usual one, kept simple):

* a crash happens after any prefix of the events;
* a file's contents are durable up to its size at its last ``fsync``; bytes
  written after that are either all lost (the file is truncated to that
  size) or all kept, both tried;
* a directory entry change (create, mkdir, rename, unlink, rmdir) is durable
  once its parent directory is fsync'd after it; the changes not yet durable
  in one directory survive as a prefix of their order (metadata is journaled
  in order per directory), independently of other directories' changes;
  a rename counts as a change of its destination's directory;
* a directory whose own entry is lost takes everything under it along.

Each combination of prefixes (at most ``limit`` per crash point, sampled with
a fixed seed beyond that, the two extremes always kept) is one crash state;
identical states (same tree, same catalog) are explored once.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pickle
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FILE, DIR = "f", "d"


@dataclass
class Node:
    kind: str
    entries: dict[str, int] = field(default_factory=dict)  # a directory's names -> inode


@dataclass
class Recording:
    """One operation's events: ``("link", dir, name, ino)``, ``("rename", sdir, sname, ddir, dname)``,
    ``("unlink", dir, name)``, ``("write", ino, bytes)``, ``("fsync", ino)``, ``("catalog", index)``."""

    initial: dict[int, Node]  # the tree before the operation; the root is inode 0
    data: dict[int, bytes]  # the initial contents of its files, all durable
    kinds: dict[int, str]  # every inode the operation saw, and whether it is a file or a directory
    events: list[tuple[Any, ...]]
    catalogs: list[bytes]


# --------------------------------------------------------------------------- recording


class Recorder:
    """Wraps the ``os`` calls named in the module docstring while it is entered."""

    NAMES = ("open", "write", "fsync", "close", "mkdir", "replace", "rename", "unlink", "rmdir", "link")

    def __init__(self, root: Path, catalog: Path) -> None:
        self.root = root.resolve()
        self.catalog = catalog
        self.lock = threading.RLock()
        self.nodes: dict[int, Node] = {}
        self.data: dict[int, bytes] = {}
        self.events: list[tuple[Any, ...]] = []
        self.catalogs: list[bytes] = []
        self.fds: dict[int, int] = {}
        self.quiet = 0
        self.originals: dict[str, Any] = {}
        self._scan(self.root)
        self.initial = {ino: Node(n.kind, dict(n.entries)) for ino, n in self.nodes.items()}
        self.initial_data = dict(self.data)

    def _scan(self, path: Path) -> int:
        ino = len(self.nodes)
        if path.is_dir() and not path.is_symlink():
            self.nodes[ino] = Node(DIR)
            for child in sorted(path.iterdir()):
                self.nodes[ino].entries[child.name] = self._scan(child)
        else:
            self.nodes[ino] = Node(FILE)
            self.data[ino] = path.read_bytes()
        return ino

    def _new(self, kind: str) -> int:
        ino = len(self.nodes)
        self.nodes[ino] = Node(kind)
        return ino

    def _where(self, path: Any, dir_fd: int | None = None) -> tuple[int, str] | None:
        """(parent inode, name) of ``path`` under the root, or None for a path elsewhere."""
        if dir_fd is not None or isinstance(path, int):
            return None
        p = Path(os.path.abspath(os.fsdecode(path)))
        try:
            rel = p.relative_to(self.root)
        except ValueError:
            return None
        parts = rel.parts
        if not parts:
            return None
        ino = 0
        for part in parts[:-1]:
            nxt = self.nodes[ino].entries.get(part)
            if nxt is None or self.nodes[nxt].kind != DIR:
                return None
            ino = nxt
        return ino, parts[-1]

    def _ino(self, path: Any) -> int | None:
        if Path(os.path.abspath(os.fsdecode(path))) == self.root:
            return 0
        where = self._where(path)
        return None if where is None else self.nodes[where[0]].entries.get(where[1])

    def snapshot_catalog(self) -> None:
        src = sqlite3.connect(f"file:{self.catalog}?mode=ro", uri=True)
        dst = sqlite3.connect(":memory:")
        try:
            src.backup(dst)
            raw = dst.serialize()
        finally:
            src.close()
            dst.close()
        if not self.catalogs or raw != self.catalogs[-1]:
            self.catalogs.append(raw)
            self.events.append(("catalog", len(self.catalogs) - 1))

    def _event(self, event: tuple[Any, ...]) -> None:
        self.snapshot_catalog()
        self.events.append(event)

    def __enter__(self) -> Recorder:
        from sqlalchemy import event
        from sqlalchemy.engine import Engine
        self.snapshot_catalog()
        self._on_commit = lambda _conn: self._locked(self.snapshot_catalog)
        event.listen(Engine, "commit", self._on_commit)
        for name in self.NAMES:
            self.originals[name] = getattr(os, name)
            setattr(os, name, getattr(self, f"_{name}"))
        self.originals["rmtree"] = shutil.rmtree
        shutil.rmtree = self._rmtree  # type: ignore[assignment]
        return self

    def __exit__(self, *_: object) -> None:
        from sqlalchemy import event
        from sqlalchemy.engine import Engine
        for name in self.NAMES:
            setattr(os, name, self.originals[name])
        shutil.rmtree = self.originals["rmtree"]
        event.remove(Engine, "commit", self._on_commit)
        self.snapshot_catalog()

    def _locked(self, fn: Callable[[], Any]) -> Any:
        with self.lock:
            return fn()

    def recording(self) -> Recording:
        return Recording(initial=self.initial, data=self.initial_data,
                         kinds={ino: n.kind for ino, n in self.nodes.items()}, events=self.events,
                         catalogs=self.catalogs)

    # the wrappers: call the real function first, record only what happened
    def _open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        with self.lock:
            where = None if self.quiet else self._where(path, dir_fd)
            existed = where is not None and where[1] in self.nodes[where[0]].entries
            fd = self.originals["open"](path, flags, mode, dir_fd=dir_fd)
            if where is not None and not existed and flags & os.O_CREAT:
                ino = self._new(FILE)
                self.data[ino] = b""
                self.nodes[where[0]].entries[where[1]] = ino
                self._event(("link", where[0], where[1], ino))
            ino_now = None if self.quiet or dir_fd is not None or isinstance(path, int) else self._ino(path)
            if ino_now is not None:
                self.fds[fd] = ino_now
                if flags & os.O_TRUNC and self.nodes[ino_now].kind == FILE and self.data[ino_now]:
                    raise NotImplementedError("O_TRUNC of an existing file is not modelled")
            return fd

    def _write(self, fd: int, data: Any) -> int:
        n: int = self.originals["write"](fd, data)
        with self.lock:
            ino = self.fds.get(fd)
            if ino is not None and n:
                chunk = bytes(memoryview(data).cast("B")[:n])
                self.data[ino] += chunk
                self._event(("write", ino, chunk))
        return n

    def _fsync(self, fd: int) -> None:
        self.originals["fsync"](fd)
        with self.lock:
            ino = self.fds.get(fd)
            if ino is not None:
                self._event(("fsync", ino))

    def _close(self, fd: int) -> None:
        with self.lock:
            self.fds.pop(fd, None)
        self.originals["close"](fd)

    def _mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        with self.lock:
            self.originals["mkdir"](path, mode, dir_fd=dir_fd)
            where = None if self.quiet else self._where(path, dir_fd)
            if where is not None:
                ino = self._new(DIR)
                self.nodes[where[0]].entries[where[1]] = ino
                self._event(("link", where[0], where[1], ino))

    def _replace(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None,
                 _fn: str = "replace") -> None:
        with self.lock:
            self.originals[_fn](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            a, b = self._where(src, src_dir_fd), self._where(dst, dst_dir_fd)
            if self.quiet or a is None or b is None:
                return
            ino = self.nodes[a[0]].entries.pop(a[1])
            self.nodes[b[0]].entries[b[1]] = ino
            self._event(("rename", a[0], a[1], b[0], b[1]))

    def _link(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None,
              follow_symlinks: bool = True) -> None:
        """A hard link (dedup, ``import --move``): a new entry for an existing inode, a ``link`` event
        like any create; a source outside the root becomes a file with its bytes, durable as they are."""
        with self.lock:
            self.originals["link"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd,
                                   follow_symlinks=follow_symlinks)
            b = None if self.quiet else self._where(dst, dst_dir_fd)
            if b is None:
                return
            ino = self._ino(src) if src_dir_fd is None else None
            if ino is None:
                ino = self._new(FILE)
                self.data[ino] = Path(os.fsdecode(dst)).read_bytes()
                self.initial_data[ino] = self.data[ino]
            self.nodes[b[0]].entries[b[1]] = ino
            self._event(("link", b[0], b[1], ino))

    def _rename(self, src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        self._replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, _fn="rename")

    def _remove(self, fn: str, path: Any, dir_fd: int | None) -> None:
        with self.lock:
            self.originals[fn](path, dir_fd=dir_fd)
            where = None if self.quiet else self._where(path, dir_fd)
            if where is not None and self.nodes[where[0]].entries.pop(where[1], None) is not None:
                self._event(("unlink", where[0], where[1]))

    def _unlink(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._remove("unlink", path, dir_fd)

    def _rmdir(self, path: Any, *, dir_fd: int | None = None) -> None:
        self._remove("rmdir", path, dir_fd)

    def _rmtree(self, path: Any, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            where = self._where(path)
            self.quiet += 1
            try:
                self.originals["rmtree"](path, *args, **kwargs)
            finally:
                self.quiet -= 1
            if where is None or os.path.lexists(path):
                return  # outside the root, or not (wholly) removed: nothing durable to model
            ino = self.nodes[where[0]].entries.pop(where[1], None)
            if ino is not None:
                self._unlink_tree(ino)
                self._event(("unlink", where[0], where[1]))

    def _unlink_tree(self, ino: int) -> None:
        node = self.nodes[ino]
        for name, child in sorted(node.entries.items()):
            if self.nodes[child].kind == DIR:
                self._unlink_tree(child)
            self._event(("unlink", ino, name))
        node.entries.clear()


# --------------------------------------------------------------------------- enumerating


@dataclass(frozen=True)
class CrashState:
    position: int  # the crash happened after events[:position]
    catalog: int  # index into Recording.catalogs
    keep: tuple[tuple[int, int], ...]  # (directory inode, how many of its pending entry changes survive)
    torn: bool = True  # bytes written since a file's last fsync are lost (False: they all reached the disk)


def _dir_of(event: tuple[Any, ...]) -> int | None:
    if event[0] in ("link", "unlink"):
        return int(event[1])
    if event[0] == "rename":
        return int(event[3])
    return None


def crash_states(rec: Recording, *, limit: int, seed: int = 0) -> Iterator[CrashState]:
    """Every crash state of the model, at most ``limit`` per crash point."""
    rng = random.Random(seed)
    catalog = 0
    for position in range(len(rec.events) + 1):
        if position and rec.events[position - 1][0] == "catalog":
            catalog = rec.events[position - 1][1]
        pending = _pending(rec, position)
        dirs = sorted(pending)
        sizes = [len(pending[d]) + 1 for d in dirs]
        total = 1
        for s in sizes:
            total *= s
        if total <= limit:
            combos: list[tuple[int, ...]] = list(itertools.product(*(range(s) for s in sizes)))
        else:
            chosen = {tuple(0 for _ in sizes), tuple(s - 1 for s in sizes)}
            while len(chosen) < limit:
                chosen.add(tuple(rng.randrange(s) for s in sizes))
            combos = sorted(chosen)
        for combo in combos:
            for torn in (True, False):
                yield CrashState(position=position, catalog=catalog, keep=tuple(zip(dirs, combo)), torn=torn)


def _pending(rec: Recording, position: int) -> dict[int, list[int]]:
    """Per directory, the indexes of its entry changes in ``events[:position]`` not yet made durable."""
    pending: dict[int, list[int]] = {}
    for i, event in enumerate(rec.events[:position]):
        d = _dir_of(event)
        if d is not None:
            pending.setdefault(d, []).append(i)
        elif event[0] == "fsync":
            pending.pop(event[1], None)  # an fsync'd directory: everything before is durable
    return pending


def build(rec: Recording, state: CrashState) -> tuple[dict[int, Node], dict[int, bytes]]:
    """The tree and file contents of ``state``."""
    pending = _pending(rec, state.position)
    lost = {i for d, kept in state.keep for i in pending[d][kept:]}
    nodes = {ino: Node(n.kind, dict(n.entries)) for ino, n in rec.initial.items()}
    written: dict[int, bytearray] = {ino: bytearray(raw) for ino, raw in rec.data.items()}
    durable: dict[int, int] = {ino: len(raw) for ino, raw in written.items()}
    for i, event in enumerate(rec.events[:state.position]):
        kind = event[0]
        if kind == "write":
            written.setdefault(event[1], bytearray()).extend(event[2])
        elif kind == "fsync":
            durable[event[1]] = len(written.get(event[1], b""))
        elif i in lost:
            continue
        elif kind == "link":
            nodes.setdefault(event[3], Node(rec.kinds[event[3]]))
            nodes.setdefault(event[1], Node(DIR)).entries[event[2]] = event[3]
        elif kind == "rename":
            ino = nodes.setdefault(event[1], Node(DIR)).entries.pop(event[2], None)
            if ino is not None:
                nodes.setdefault(event[3], Node(DIR)).entries[event[4]] = ino
        elif kind == "unlink":
            nodes.setdefault(event[1], Node(DIR)).entries.pop(event[2], None)
    data = {ino: bytes(raw[:durable.get(ino, 0)] if state.torn else raw) for ino, raw in written.items()}
    return nodes, data


def materialise(nodes: dict[int, Node], data: dict[int, bytes], dest: Path, ino: int = 0) -> None:
    dest.mkdir()
    for name, child in sorted(nodes[ino].entries.items()):
        if nodes.get(child, Node(FILE)).kind == DIR:
            materialise(nodes, data, dest / name, child)
        else:
            (dest / name).write_bytes(data.get(child, b""))


def fingerprint(nodes: dict[int, Node], data: dict[int, bytes], ino: int = 0) -> str:
    h = hashlib.sha256()

    def walk(i: int, prefix: str) -> None:
        for name, child in sorted(nodes[i].entries.items()):
            if nodes.get(child, Node(FILE)).kind == DIR:
                h.update(f"d {prefix}{name}\n".encode())
                walk(child, f"{prefix}{name}/")
            else:
                h.update(f"f {prefix}{name} {hashlib.sha256(data.get(child, b'')).hexdigest()}\n".encode())
    walk(ino, "")
    return h.hexdigest()


# --------------------------------------------------------------------------- scenarios


RUN = "crash"
OLD, NEW = 1, 101  # make_state seeds of a step's old and new payloads


@dataclass(frozen=True)
class Scenario:
    """How to set up and run one operation, and which payloads each step may hold after repair.

    ``allowed[step]``: the make_state seeds a step may load as. A step in
    ``must_live`` has to be live after repair whatever the crash; any step
    live in the crash state's catalog has to stay live.
    """

    name: str
    allowed: dict[int, tuple[int, ...]]
    must_live: frozenset[int]


SCENARIOS = {
    "publish": Scenario("publish", {1: (1,), 2: (2,)}, frozenset({1})),
    "new-run": Scenario("new-run", {1: (OLD,)}, frozenset()),  # the first publish of a run: its directory is new
    "overwrite": Scenario("overwrite", {1: (OLD, NEW), 2: (2,)}, frozenset({1, 2})),
    # the overwrite's catalog commit fails (a full disk under the database): the renames are undone;
    # a crash before the failure is reported may still roll the new payload forward
    "overwrite-failed-commit": Scenario("overwrite-failed-commit", {1: (OLD, NEW), 2: (2,)}, frozenset({1, 2})),
    "gc": Scenario("gc", {1: (1,), 2: (2,), 3: (3,)}, frozenset({3})),
    "fsck": Scenario("fsck", {1: (OLD,), 2: (2,)}, frozenset({1, 2})),
}


def _more(rich: bool) -> dict[str, Any]:
    import torch
    return {"max_shard_size": 600, "extra": {"rng": torch.arange(4)}} if rich else {}


def _overwrite(url: str, root: str, rich: bool) -> None:
    from registry import Registry
    from tests.helpers import make_state
    with Registry.open(url=url, root=root) as reg:
        reg.publish(RUN, 1, make_state(NEW), overwrite=True, **_more(rich))


def _failed_overwrite(reg: Any, state: dict[str, Any], more: dict[str, Any]) -> None:
    import pytest

    from registry.errors import CatalogError
    from tests.helpers import fail_commits
    with pytest.MonkeyPatch.context() as mp:
        fail_commits(mp)
        try:
            reg.publish(RUN, 1, state, overwrite=True, **more)
        except CatalogError:
            return
    raise RuntimeError("the overwrite's commit was meant to fail")


def _child_main(name: str, workdir: str, rich: bool = False) -> None:
    """In a child process: set up ``name``'s registry, record its operation, pickle the recording.

    ``rich`` publishes every payload as several safetensors shards, their
    index and a ``.pt`` extra (more files, so more crash states).
    """
    from registry import Registry
    from registry.retention import KeepLast
    from tests.helpers import child_env, make_state
    more = _more(rich)
    work = Path(workdir)
    root, db = work / "root", work / "catalog.db"
    url = f"sqlite:///{db}"
    with Registry.open(url=url, root=root) as reg:
        if name == "new-run":
            pass
        elif name == "gc":
            for step in (1, 2, 3):
                reg.publish(RUN, step, make_state(step), **more)
        else:
            reg.publish(RUN, 1, make_state(OLD), **more)
            if name != "publish":
                reg.publish(RUN, 2, make_state(2), **more)
    if name == "fsck":  # an overwrite killed between its two renames, by a process that is gone
        code = f"from tests.crashstates import _overwrite; _overwrite({url!r}, {str(root)!r}, {rich!r})"
        proc = subprocess.run([sys.executable, "-c", code], env={**child_env(), "REGISTRY_CRASH_AT": "after-retire"},
                              cwd=str(Path(__file__).resolve().parents[1]), capture_output=True, timeout=120)
        if proc.returncode != -9:
            raise RuntimeError(f"the overwrite was meant to die at after-retire: rc {proc.returncode} "
                               f"{proc.stderr.decode()[-2000:]}")
    with Registry.open(url=url, root=root) as reg:
        state = make_state(NEW) if name.startswith("overwrite") else make_state(2)
        with Recorder(root, db) as recorder:
            if name == "publish":
                reg.publish(RUN, 2, state, **more)
            elif name == "new-run":
                reg.publish(RUN, 1, make_state(OLD), **more)
            elif name == "overwrite":
                reg.publish(RUN, 1, state, overwrite=True, **more)
            elif name == "overwrite-failed-commit":
                _failed_overwrite(reg, state, more)
            elif name == "gc":
                result = reg.apply_retention(RUN, KeepLast(1))
                if result.deleted != (1, 2):
                    raise RuntimeError(f"gc deleted {result.deleted}, expected (1, 2)")
            else:
                report = reg.fsck(repair=True)
                if not any(p.kind == "interrupted-overwrite" for p in report.repaired):
                    raise RuntimeError(f"fsck did not repair an interrupted overwrite: {report.problems}")
    with open(work / "recording.pkl", "wb") as f:
        pickle.dump(recorder.recording(), f)


def _forked_child(name: str, workdir: str, rich: bool, env: dict[str, str], log: str) -> None:
    """``_child_main`` in a child of the kill harness's forkserver, with the caller's environment and its
    stderr in ``log``."""
    from registry.crashpoints import arm
    from tests.helpers import REPO
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    arm(env.get("REGISTRY_CRASH_AT"))  # read from the forkserver's environment when it imported the registry
    _child_main(name, workdir, rich)


def record(name: str, workdir: Path, *, rich: bool = False) -> Recording:
    """Run scenario ``name`` in a child process that records it and exits; its recording.

    The child is forked from the kill harness's forkserver (torch and the registry already imported): the
    recorder patches ``os`` for the whole process, so it gets one of its own, without seconds of imports.
    """
    from tests.helpers import child_env
    from tests.killharness import context
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "child.log"
    proc = context().Process(target=_forked_child, args=(name, str(workdir), rich, child_env(), str(log)),
                             daemon=True)
    proc.start()
    proc.join(300)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    if proc.exitcode != 0:
        stderr = log.read_text(errors="replace") if log.exists() else ""
        raise RuntimeError(f"recording {name} failed (exit code {proc.exitcode}): {stderr[-3000:]}")
    with open(workdir / "recording.pkl", "rb") as f:
        rec: Recording = pickle.load(f)
    return rec


# --------------------------------------------------------------------------- checking


HIDDEN = (".tmp-", ".retired-")


def check(scenario: Scenario, rec: Recording, state: CrashState, nodes: dict[int, Node], data: dict[int, bytes],
          where: Path) -> list[str]:
    """Materialise ``state`` at ``where``, repair it, and list every invariant it breaks (empty: none)."""
    import torch

    from registry import Registry
    from registry.records import LIVE
    from tests.helpers import make_state
    root, db = where / "root", where / "catalog.db"
    materialise(nodes, data, root)
    db.write_bytes(rec.catalogs[state.catalog])
    problems: list[str] = []
    with Registry.open(url=f"sqlite:///{db}", root=root) as reg:
        live_before = {c.step for c in reg.checkpoints(RUN) if c.status in LIVE} if _has_run(reg) else set()
        report = reg.fsck(repair=True)
        if report.failures or report.unrepaired or report.in_progress:
            problems.append(f"fsck --repair left: failures {list(report.failures)} "
                            f"unrepaired {[str(p) for p in report.unrepaired]} in progress {list(report.in_progress)}")
        rows = {c.step: c for c in reg.checkpoints(RUN, include_deleted=True)} if _has_run(reg) else {}
        for step in sorted(set(scenario.must_live) | live_before):
            if step not in rows or rows[step].status not in LIVE:
                status = rows[step].status.value if step in rows else "no row"
                problems.append(f"step {step} lost: {status} after repair")
        for step, info in sorted(rows.items()):
            if info.status not in LIVE:
                continue
            try:
                loaded = reg.load(f"{RUN}@{step}", verify=True, fallback=False).state_dict
            except Exception as exc:  # noqa: BLE001 - any failure to load a live step is the finding
                problems.append(f"step {step} is {info.status.value} but does not load: {exc}")
                continue
            seeds = [s for s in scenario.allowed.get(step, ()) if _equal(loaded, make_state(s), torch)]
            if not seeds:
                problems.append(f"step {step} loads, but as none of the payloads {scenario.allowed.get(step)}")
        hidden = sorted(str(p.relative_to(root)) for p in root.rglob("*") if any(h in p.name for h in HIDDEN))
        if hidden:
            problems.append(f"hidden directories left after repair: {hidden}")
        second = reg.fsck(checksums=True)
        if not second.clean or second.in_progress or second.failures:
            problems.append(f"second fsck --checksums not clean: {[str(p) for p in second.problems]} "
                            f"{list(second.failures)}")
    return problems


def _has_run(reg: Any) -> bool:
    return any(r.name == RUN for r in reg.runs())


def _equal(a: dict[str, Any], b: dict[str, Any], torch: Any) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@dataclass(frozen=True)
class Outcome:
    name: str
    events: int
    crash_points: int
    states: int  # distinct (tree, catalog) states checked
    combinations: int  # crash states enumerated before removing duplicates
    failures: tuple[tuple[CrashState, tuple[str, ...]], ...]


def explore(name: str, workdir: Path, *, limit: int, stride: int = 1, rec: Recording | None = None,
            rich: bool = False, log: Callable[[str], None] | None = None) -> Outcome:
    """Record scenario ``name`` (or take ``rec``) and check every distinct crash state.

    Only every ``stride``-th crash point is tried, the last one always.
    """
    scenario = SCENARIOS[name]
    if rec is None:
        rec = record(name, workdir / "recording", rich=rich)
    seen: set[tuple[str, int]] = set()
    failures = []
    combinations = 0
    last = len(rec.events)
    for state in crash_states(rec, limit=limit):
        if state.position % stride and state.position != last:
            continue
        combinations += 1
        nodes, data = build(rec, state)
        key = (fingerprint(nodes, data), state.catalog)
        if key in seen:
            continue
        seen.add(key)
        where = workdir / f"state-{len(seen):05d}"
        where.mkdir()
        problems = check(scenario, rec, state, nodes, data, where)
        shutil.rmtree(where)
        if problems:
            failures.append((state, tuple(problems)))
            if log is not None:
                log(f"{name}: {state}: {problems}")
    return Outcome(name=name, events=len(rec.events), crash_points=last + 1, states=len(seen),
                   combinations=combinations, failures=tuple(failures))


def main(argv: list[str]) -> int:
    """``scripts/crashstates``: the full enumeration, one line per operation; 1 if any state loses anything."""
    import argparse
    import tempfile
    import time
    parser = argparse.ArgumentParser(prog="scripts/crashstates", description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4096, help="crash states per crash point (default 4096)")
    parser.add_argument("--plain", action="store_true",
                        help="one safetensors file per payload instead of shards, an index and an extra")
    parser.add_argument("--only", choices=sorted(SCENARIOS), action="append", help="one operation (repeatable)")
    args = parser.parse_args(argv)
    lost = 0
    for name in args.only or list(SCENARIOS):
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"crashstates-{name}-") as tmp:
            outcome = explore(name, Path(tmp), limit=args.limit, rich=not args.plain, log=print)
        lost += len(outcome.failures)
        label = name + ("" if args.plain else " (shards)")
        print(f"{label:<34} events {outcome.events:>4}  crash points {outcome.crash_points:>4}  "
              f"crash states {outcome.combinations:>6}  distinct states checked {outcome.states:>5}  "
              f"failing {len(outcome.failures)}  ({time.monotonic() - started:.0f}s)", flush=True)
    return 1 if lost else 0
