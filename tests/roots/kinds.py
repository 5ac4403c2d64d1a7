"""The three kinds of root the conformance suite runs on, and what a test needs to look at or damage their storage.

A case takes ``kind_reg`` (an open registry) and, when it needs a second
registry on the same root and catalog, ``kind`` (``kind.open()``). The
helpers here are the only places that know how each kind keeps its bytes:
a directory root in files, an ``s3://`` root in objects, a tiered root in
files on the fast tier and objects on the durable one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from registry import Registry
from registry.records import CheckpointInfo

if TYPE_CHECKING:
    from registry.fs.objects import ObjectRoot

KINDS = ("directory", "s3", "tiered")
WEIGHTS = "model.safetensors"


@dataclass(frozen=True, kw_only=True)
class Kind:
    """How to open a registry on one root of one kind, as often as a test needs."""

    name: str
    url: str
    root: str
    durable: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def open(self, **options: Any) -> Registry:
        return Registry.open(self.url, root=self.root, durable=self.durable, **{**self.options, **options})


@dataclass(frozen=True, kw_only=True)
class Copy:
    """One copy of a step's payload in storage: a directory of files, or a key prefix of the object root."""

    directory: Path | None = None
    prefix: str | None = None

    def __str__(self) -> str:
        return str(self.directory) if self.directory is not None else f"objects:{self.prefix}"


def settle(reg: Registry, run: str) -> None:
    """On a root with tiers, wait until every live step of ``run`` has its durable copy (elsewhere a no-op): what
    storage holds stops changing under the test."""
    if not reg.root.can.tiers:
        return
    for info in reg.checkpoints(run):
        if info.status == "verified":
            reg.wait_durable(run, info.step, timeout=60)
    # a durable copy is verified at its commit, and the copy it replaced is removed just after: draining here takes
    # the replicator's drain lock, so the background drain that committed has finished, removal included
    reg.replicate(run, wait=True, timeout=60)


def copies(reg: Registry, info: CheckpointInfo) -> list[Copy]:
    """Every copy of the payload ``info`` names: one on a plain root; the fast and the durable one on a tiered root."""
    local = reg.root.local_dir
    found: list[Copy] = []
    if local is not None:
        found.append(Copy(directory=local / info.path))  # absolute already: the join keeps it
    if reg.root.can.tiers:
        from registry.catalog.replicas import DURABLE
        found += [Copy(prefix=r.path) for r in reg.replicas(info.run, info.step)
                  if r.location == DURABLE and r.manifest_sha256 == info.manifest_sha256]
    elif local is None:
        found.append(Copy(prefix=info.path.as_posix()))
    return found


def objects(reg: Registry) -> ObjectRoot | None:
    """The object root that holds payloads: an ``s3://`` root's own, a tiered root's durable one."""
    if reg.tiers is not None:
        return reg.tiers.durable
    return reg.objects


def present(reg: Registry, copy: Copy) -> bool:
    """Whether storage still holds anything of ``copy``."""
    if copy.directory is not None:
        return copy.directory.exists()
    store = objects(reg)
    assert store is not None and copy.prefix is not None
    return bool(store.list(copy.prefix))


def read_copy(reg: Registry, copy: Copy, name: str) -> bytes:
    if copy.directory is not None:
        return (copy.directory / name).read_bytes()
    store = objects(reg)
    assert store is not None
    return bytes(store.get(f"{copy.prefix}/{name}"))


def write_copy(reg: Registry, copy: Copy, name: str, data: bytes) -> None:
    """Replace a file of ``copy`` behind the registry's back: the damage stays for every later read."""
    if copy.directory is not None:
        (copy.directory / name).write_bytes(data)
    else:
        store = objects(reg)
        assert store is not None
        store.put(f"{copy.prefix}/{name}", data, create_only=False)


def damage_everywhere(reg: Registry, info: CheckpointInfo) -> list[Copy]:
    """Flip one byte of the weights in every copy of ``info``; the copies damaged."""
    damaged = copies(reg, info)
    assert damaged, f"{info.run}@{info.step} has no copy to damage"
    for copy in damaged:
        raw = bytearray(read_copy(reg, copy, WEIGHTS))
        raw[-2] ^= 0xFF
        write_copy(reg, copy, WEIGHTS, bytes(raw))
    return damaged


def stored(reg: Registry) -> list[tuple[str, int]]:
    """Everything the root's storage holds (files and objects, with sizes), the registry's own records aside."""
    out: list[tuple[str, int]] = []
    local = reg.root.local_dir
    if local is not None and local.exists():
        out += [(f"file:{p.relative_to(local).as_posix()}", p.stat().st_size) for p in local.rglob("*")
                if p.is_file() and not p.relative_to(local).as_posix().startswith(".registry/")]
    store = objects(reg)
    if store is not None:
        out += [(f"object:{e.rel}", e.size) for e in store.list("") if not e.rel.startswith(".registry/")]
    return sorted(out)


def orphans(reg: Registry, run: str) -> list[str]:
    """What storage holds under ``run`` that is no copy of a live step of it: files and objects no reader reaches."""
    live = [c for info in reg.checkpoints(run) for c in copies(reg, info)]
    directories = [c.directory for c in live if c.directory is not None]
    prefixes = [f"{c.prefix}/" for c in live if c.prefix is not None]
    out: list[str] = []
    local = reg.root.local_dir
    if local is not None and (local / run).exists():
        out += [str(p) for p in (local / run).rglob("*")
                if p.is_file() and not any(p.is_relative_to(d) for d in directories)]
    store = objects(reg)
    if store is not None:
        out += [f"objects:{e.rel}" for e in store.list(run) if not e.rel.startswith(tuple(prefixes))]
    return sorted(out)


def rows(reg: Registry) -> list[tuple[str, int, str, str | None, tuple[str, ...]]]:
    """Every catalog row of every run, whatever its status, with its payload digest and tags."""
    statuses = ("staging", "published", "verified", "failed", "corrupt", "deleted")
    return [(i.run, i.step, str(i.status), i.manifest_sha256, tuple(i.tags)) for r in reg.runs()
            for i in reg.catalog.checkpoints(r.name, statuses=statuses)]


def one_line_registry_error(exc: BaseException) -> str:
    from registry.errors import RegistryError
    assert isinstance(exc, RegistryError), f"{type(exc).__name__} is not a RegistryError: {exc}"
    text = str(exc)
    assert text and "\n" not in text, f"not one line: {text!r}"
    return text


def publish_then_die(url: str, root: str, durable: str | None, env: dict[str, str]) -> None:
    """The body of a writer that dies at a crash point (run in a child process, see ``killed_publishing``):
    publish ``run@1`` (and, on a root with tiers, wait for its durable copy) with no crash point armed, then arm
    ``env["REGISTRY_CRASH_AT"]`` and publish ``run@2``, waiting for its durable copy too: the point is on one of
    the two paths, and the process SIGKILLs itself there. Returns only when the point was never reached. With
    ``env["OVERWRITE"]``, ``run@2`` is published first unarmed and the armed publish overwrites it (state 22)."""
    from registry.crashpoints import arm
    from tests.helpers import make_state
    os.environ.update(env)  # a forkserver's child inherits the server's environment, not the test's of the moment
    arm(None)
    with Registry.open(url, root=root, durable=durable) as reg:
        reg.publish("run", 1, make_state(1))
        if reg.root.can.tiers:
            reg.wait_durable("run", 1, timeout=60)
        overwrite = bool(env.get("OVERWRITE"))
        if overwrite:
            reg.publish("run", 2, make_state(2))
            if reg.root.can.tiers:
                reg.wait_durable("run", 2, timeout=60)
        arm(env["REGISTRY_CRASH_AT"])
        reg.publish("run", 2, make_state(22 if overwrite else 2), overwrite=overwrite)
        if reg.root.can.tiers:
            reg.wait_durable("run", 2, timeout=60)


def killed_at(kind: Kind, target: Any, point: str, *, what: str, env: dict[str, str] | None = None) -> int | None:
    """Run ``target(url, root, durable, env)`` on ``kind`` in a child process with ``REGISTRY_CRASH_AT=point`` (and
    ``env``); its exit code (``-SIGKILL`` when it died there). On PostgreSQL, returns once the dead child's sessions
    are gone. ``what``: how a hang is named."""
    from tests import killharness
    from tests.helpers import child_env
    ctx = killharness.context()  # forked from a server that imported torch and the registry once
    proc = ctx.Process(target=target, daemon=True,
                       args=(killharness.worker_url(kind.url), kind.root, kind.durable,
                             {**child_env(), "REGISTRY_CRASH_AT": point, **(env or {})}))
    proc.start()
    proc.join(120)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        pytest.fail(f"the {what} to be killed at {point} hung")
    with kind.open() as reg:
        killharness.settle(reg)
    return proc.exitcode


def killed_publishing(kind: Kind, point: str, *, overwrite: bool = False) -> int | None:
    """:func:`publish_then_die` killed at ``point`` (:func:`killed_at`); ``overwrite``: the armed publish overwrites
    a committed ``run@2``."""
    return killed_at(kind, publish_then_die, point, what="writer", env={"OVERWRITE": "1"} if overwrite else None)


def retain(reg: Registry, run: str, keep: int) -> list[Any]:
    """``KeepLast(keep)`` on ``run`` as each kind applies it: once on a plain root; on a root with tiers the
    durable tier first, then the fast one (whose deletion of a step's last copy ends the step). The results."""
    from registry.retention import KeepLast
    if reg.root.can.tiers:
        return [reg.plan_tier_retention(run, KeepLast(keep), tier=tier).execute() for tier in ("durable", "fast")]
    return [reg.apply_retention(run, KeepLast(keep))]


def retain_then_die(url: str, root: str, durable: str | None, env: dict[str, str]) -> None:
    """In a child (see ``killed_retaining``): publish ``run@1..4`` (durable too, on a root with tiers), then arm
    ``env["REGISTRY_CRASH_AT"]`` and apply :func:`retain` with ``KeepLast(2)``; it SIGKILLs itself at the point."""
    from registry.crashpoints import arm
    from tests.helpers import make_state
    os.environ.update(env)  # a forkserver's child inherits the server's environment, not the test's of the moment
    arm(None)
    with Registry.open(url, root=root, durable=durable) as reg:
        for step in (1, 2, 3, 4):
            reg.publish("run", step, make_state(step))
        settle(reg, "run")
        arm(env["REGISTRY_CRASH_AT"])
        retain(reg, "run", 2)


def killed_retaining(kind: Kind, point: str) -> int | None:
    """:func:`retain_then_die` killed at ``point`` (:func:`killed_at`)."""
    return killed_at(kind, retain_then_die, point, what="retention")


@contextmanager
def failing_weights_write(reg: Registry, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """On a root with a local directory (a directory root, a tiered root's fast tier): every ``os.write`` into a
    staged weights file fails with ENOSPC, so a publish dies midway, after its first files. Yields the files hit."""
    import errno
    local = reg.root.local_dir
    assert local is not None
    under = str(local.resolve())
    hit: list[str] = []
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(under) and ".tmp-" in target and target.endswith(WEIGHTS):
            hit.append(target)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    with monkeypatch.context() as patched:
        patched.setattr(os, "write", write)
        yield hit


@contextmanager
def failing_reads(path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every ``os.read``, ``os.readv``, ``os.pread`` and ``os.preadv`` of the file ``path`` (of a file under it, for
    a directory) fails with EIO: a disk that cannot read a sector back. Yields the files hit."""
    import errno
    under = str(path.resolve())
    hit: list[str] = []

    def failing(real: Any) -> Any:
        def call(fd: int, *args: Any) -> Any:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if target == under or target.startswith(under + os.sep):
                hit.append(target)
                raise OSError(errno.EIO, os.strerror(errno.EIO), target)
            return real(fd, *args)
        return call

    with monkeypatch.context() as patched:
        for name in ("read", "readv", "pread", "preadv"):
            patched.setattr(os, name, failing(getattr(os, name)))
        yield hit
