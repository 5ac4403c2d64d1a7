"""Kill harness: run registry operations in a real subprocess, SIGKILL it, check, repair, check.

Two ways to kill (the way SQLite tests itself):

* at a named crash point (``registry/crashpoints.py``): the worker arms the
  point and SIGKILLs itself on reaching it, so every window of the publish
  protocol is hit deterministically;
* at a random moment: the worker loops over random operations and the parent
  SIGKILLs it after a random delay, which also lands inside writes, fsyncs,
  catalog transactions and migrations.

After every kill the parent first checks what a trainer resuming at once would
see, before anyone repairs (:func:`check_before_repair`), then runs ``fsck
--repair`` and checks the invariants again (:func:`check_invariants`).
Workers are forked from a ``forkserver`` that has already imported torch and
the registry, so a kill costs milliseconds of process start-up, not seconds.
Operations are pluggable (:func:`register_op`) so retention gc can join the mix.

``python -m tests.killharness --kills N`` (what ``scripts/killtest`` runs)
prints a summary; the tests in ``tests/test_kill.py`` use the same functions.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from registry import Registry
from registry.catalog.session import head_revision
from registry.crashpoints import arm
from registry.errors import RegistryError
from registry.format.layout import parse_hidden
from registry.format.manifest import read_manifest
from registry.fs.filemaps import read_directory

RUNS = ("r0", "r1")
MAX_STEPS = 6  # per run; beyond it "publish" overwrites, keeping each check cheap
#: the environment workers get (an ``s3://`` root's AWS settings; see :func:`worker`)
WORKER_ENV: dict[str, str] = {}


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(24, 24, generator=g), "b": torch.randn(24, generator=g).to(torch.bfloat16),
            "seed": torch.tensor(seed, dtype=torch.int64)}


def _live_steps(reg: Registry, run: str) -> list[int]:
    try:
        return [i.step for i in reg.checkpoints(run) if i.status in ("published", "verified")]
    except RegistryError:
        return []


def op_publish(reg: Registry, rng: random.Random, run: str) -> None:
    steps = _live_steps(reg, run)
    if len(steps) >= MAX_STEPS:
        return op_overwrite(reg, rng, run)
    step = max(steps) + 10 if steps else 10
    seed = rng.randrange(1 << 30)
    extra = {"opt": {"m": torch.full((8,), float(seed % 97))}} if rng.random() < 0.3 else None
    reg.publish(run, step, state(seed), meta={"seed": seed}, extra=extra, metrics={"loss": rng.random()},
                verify=rng.random() < 0.8)


def op_overwrite(reg: Registry, rng: random.Random, run: str) -> None:
    steps = _live_steps(reg, run)
    if not steps:
        return op_publish(reg, rng, run)
    seed = rng.randrange(1 << 30)
    reg.publish(run, rng.choice(steps), state(seed), meta={"seed": seed}, overwrite=True)


def op_tag(reg: Registry, rng: random.Random, run: str) -> None:
    steps = _live_steps(reg, run)
    if steps:
        reg.tag(run, rng.choice(steps), rng.choice(("best", "release")))


def op_fsck(reg: Registry, rng: random.Random, run: str) -> None:
    reg.fsck(repair=True)


def op_gc(reg: Registry, rng: random.Random, run: str) -> None:
    from registry.retention import KeepEvery, KeepLast
    if _live_steps(reg, run):
        reg.plan_retention(run, KeepLast(rng.choice((1, 2, 3))) | KeepEvery(40)).execute()


def op_publish_killed_mid_upload(reg: Registry, rng: random.Random, run: str) -> None:
    """On an object-store root: publish a state of several multipart parts, SIGKILLed once a multipart
    upload of it is open on the server and parts are in flight (before any completes the object)."""
    import signal

    from registry.fs import multipart
    from registry.fs.objects import PART_SIZE, ObjectWriter
    assert reg.objects is not None, "an s3:// root's operation"
    objects = reg.objects
    sent = [0]
    write = ObjectWriter.write

    def write_then_die(self: ObjectWriter, data: Any) -> int:
        n = write(self, data)
        sent[0] += n
        if sent[0] > 2 * PART_SIZE:
            base = objects.key()
            for _ in range(1000):  # until the server lists the open upload (polling a condition)
                if next(iter(multipart.list_uploads(objects.config, base + "/" if base else "")), None):
                    break
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    ObjectWriter.write = write_then_die  # type: ignore[method-assign]
    steps = _live_steps(reg, run)
    seed = rng.randrange(1 << 30)
    big = {**state(seed), "big": torch.zeros(3 * PART_SIZE // 4)}
    reg.publish(run, max(steps, default=0) + 10, big, meta={"seed": seed})


@dataclass(frozen=True, kw_only=True)
class Op:
    fn: Callable[[Registry, random.Random, str], None]
    deletes: bool = False  # may legitimately make a live step deleted (retention)


OPS: dict[str, Op] = {"publish": Op(fn=op_publish), "overwrite": Op(fn=op_overwrite),
                      "tag": Op(fn=op_tag), "fsck": Op(fn=op_fsck), "gc": Op(fn=op_gc, deletes=True),
                      "publish-killed-mid-upload": Op(fn=op_publish_killed_mid_upload)}
DEFAULT_MIX = ("publish", "publish", "overwrite", "tag", "fsck", "gc")


def register_op(name: str, fn: Callable[[Registry, random.Random, str], None], *, deletes: bool = False) -> None:
    """Add an operation (e.g. retention gc) to what workers may be killed in."""
    OPS[name] = Op(fn=fn, deletes=deletes)


# --------------------------------------------------------------------------- the worker (child process)


def worker(url: str, root: str, mix: tuple[str, ...], seed: int, crash_at: str | None, once: str | None,
           ready: Any = None, runs: tuple[str, ...] = RUNS, env: dict[str, str] | None = None) -> None:
    """Open the registry and run operations: ``once`` one named op, else random ops forever.

    ``env`` (the AWS environment of an ``s3://`` root) is set first: a forkserver's children
    inherit its environment, not the parent's of the moment.
    """
    os.environ.update(env or {})
    arm(crash_at)
    rng = random.Random(seed)
    with Registry.open(url=url, root=root) as reg:
        if ready is not None:
            ready.set()
        if once is not None:
            OPS[once].fn(reg, rng, runs[0])
            return
        while True:
            OPS[rng.choice(mix)].fn(reg, rng, rng.choice(runs))


WORKER_APP = "registry-killworker"


def worker_url(url: str) -> str:
    """The catalog URL a worker uses: on PostgreSQL its sessions are named, so the parent can find them."""
    if not url.startswith("postgresql"):
        return url
    return url + ("&" if "?" in url else "?") + f"application_name={WORKER_APP}"


def settle(reg: Registry) -> None:
    """Wait until a killed worker's PostgreSQL sessions are gone.

    The server notices a dead client only when it next reads from it, so a
    COMMIT the worker sent just before SIGKILL may still be completing; fsck
    (like an operator) must look at the state after it. Terminating the
    sessions aborts whatever was not yet committed, as the server would anyway.
    """
    if reg.catalog.dialect != "postgresql":
        return
    from sqlalchemy import text
    query = "FROM pg_stat_activity WHERE application_name = :app AND datname = current_database()"
    deadline = time.monotonic() + 60
    with reg.catalog.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        while conn.execute(text(f"SELECT count(*) {query}"), {"app": WORKER_APP}).scalar():
            conn.execute(text(f"SELECT pg_terminate_backend(pid) {query}"), {"app": WORKER_APP})
            if time.monotonic() > deadline:
                _fail("a killed worker's database session does not go away")
            time.sleep(0.01)  # polling for a condition, not a wait for luck


_CTX: Any = None


def context() -> Any:
    """A forkserver that has imported torch and the registry once, for cheap workers (and the ranks of
    ``tests.helpers.run_ranks``: DCP and FSDP take seconds more to import; the Lightning trainers of
    ``tests.helpers.forked``: Lightning takes five, torchmetrics and transformers with it, where installed)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "registry.api", "registry.ops.fsck", "tests.killharness", "psycopg",
                                     "sqlalchemy.dialects.postgresql.psycopg", "sqlalchemy.dialects.sqlite",
                                     "torch.distributed.checkpoint", "torch.distributed.fsdp",
                                     "registry.distributed.sharded", "lightning.pytorch"])
    return _CTX


# --------------------------------------------------------------------------- the parent


@dataclass(kw_only=True)
class Tally:
    """What the kills did, for RELIABILITY.md."""

    kills: int = 0
    not_reached: int = 0  # crash point not on this operation's path: the worker finished
    repairs: collections.Counter[str] = field(default_factory=collections.Counter)
    checked_steps: int = 0
    checked_before_repair: int = 0  # kills after which the unrepaired state was checked
    loaded_before_repair: int = 0  # @latest / @latest-published loads, verified and bit-exact, before repair
    lost: int = 0  # stays 0, or check_invariants raises
    loaded: dict[tuple[str, int], str | None] = field(default_factory=dict, repr=False)

    def merge(self, other: Tally) -> None:
        self.kills += other.kills
        self.not_reached += other.not_reached
        self.repairs.update(other.repairs)
        self.checked_steps += other.checked_steps
        self.checked_before_repair += other.checked_before_repair
        self.loaded_before_repair += other.loaded_before_repair


class InvariantError(AssertionError):
    pass


def hidden_dirs(root: Path) -> list[str]:
    """Staging and retired names left in any directory of ``root``: after a settled fsck there are none."""
    return [f"{d.name}/{n}" for d in sorted(root.iterdir()) if d.is_dir()
            for n in sorted(os.listdir(d)) if parse_hidden(n) is not None]


def _fail(msg: str) -> NoReturn:
    raise InvariantError(msg)


def catalog_view(reg: Registry, runs: tuple[str, ...] = RUNS) -> dict[str, list[Any]]:
    """Every row of ``runs``, deleted and failed included (few queries: each one costs)."""
    names = {r.name for r in reg.runs()}
    return {run: reg.checkpoints(run, include_deleted=True) for run in runs if run in names}


def current_runs(reg: Registry, generation: list[int]) -> tuple[str, ...]:
    """The pair of runs workers use now; a new pair once both are full, so new steps keep coming."""
    while True:
        runs = (f"r{2 * generation[0]}", f"r{2 * generation[0] + 1}")
        view = catalog_view(reg, runs)
        if len(view) < 2 or min(len(_live(v)) for v in view.values()) < MAX_STEPS:
            return runs
        generation[0] += 1


def _live(infos: list[Any]) -> list[Any]:
    return [i for i in infos if i.status in ("published", "verified")]


def snapshot_live(view: dict[str, list[Any]]) -> dict[tuple[str, int], str]:
    return {(run, i.step): i.status for run, infos in view.items() for i in infos
            if i.status in ("published", "verified")}


def latest_verified(view: dict[str, list[Any]]) -> dict[str, int]:
    out = {}
    for run, infos in view.items():
        verified = [i.step for i in infos if i.status == "verified"]
        if verified:
            out[run] = max(verified)
    return out


def check_payload(where: str, meta: dict[str, Any], state_dict: dict[str, torch.Tensor],
                  extra: dict[str, Any]) -> None:
    """The tensors (and optimizer extra) are bit for bit the ones generated from the seed in ``meta``."""
    seed = meta.get("seed")
    if not isinstance(seed, int):
        _fail(f"{where}: meta.json has no seed: {meta}")
    want = state(seed)
    if set(state_dict) != set(want) or not all(torch.equal(state_dict[k], want[k]) for k in want):
        _fail(f"{where} loads but its tensors are not the ones published with seed {seed}")
    if "opt" in extra and not torch.equal(extra["opt"]["m"], torch.full((8,), float(seed % 97))):
        _fail(f"{where} optimizer extra does not belong to its weights")


def check_before_repair(reg: Registry, *, tally: Tally, runs: tuple[str, ...] = RUNS) -> None:
    """What a trainer resuming right after the kill sees, before anyone runs fsck.

    Every live row is whole on disk: its directory is there and holds the
    manifest the catalog recorded, every file at its manifest size (so no
    reader finds a step half-visible; the bytes of every one were hashed when
    it was last checked after a repair). ``@latest`` and ``@latest-published``
    resolve to the newest such step and load through the public API with
    ``verify=True`` and no fallback (a fallback would mean a live step was
    broken), bit for bit what its seed generates.
    """
    for run, infos in catalog_view(reg, runs).items():
        live = _live(infos)
        for info in live:
            where = f"{run}@{info.step} ({info.status}, before repair)"
            try:
                manifest, digest, sizes = stored(reg, info)
            except RegistryError as exc:
                _fail(f"{where} is half-visible: {exc}")
            if digest != info.manifest_sha256:
                _fail(f"{where}: the manifest on disk is not the one the catalog recorded")
            for entry in manifest.files.values():
                size = sizes.get(entry.name)
                if size is None:
                    _fail(f"{where} is half-visible: {entry.name} is missing")
                if size != entry.size:
                    _fail(f"{where}: {entry.name} is {size} bytes, its manifest says {entry.size}")
        loaded: set[int] = set()
        for kind, statuses in (("latest", ("verified",)), ("latest-published", ("published", "verified"))):
            newest = max((i.step for i in live if i.status in statuses), default=None)
            if newest is None:
                continue
            ref = f"{run}@{kind}"
            if newest in loaded:  # both refs name one step, which just loaded: resolving is enough
                if reg.resolve(ref).step != newest:
                    _fail(f"{ref} does not resolve to the newest {' or '.join(statuses)} step {newest}")
                continue
            try:
                ckpt = reg.load(ref, verify=True, fallback=False, resume=False)
            except RegistryError as exc:  # CorruptCheckpointError included: a resolved step must load
                _fail(f"{ref} (step {newest}) does not load before repair: {type(exc).__name__}: {exc}")
            if ckpt.step != newest or ckpt.fallback is not None:
                _fail(f"{ref} loaded step {ckpt.step}, not the newest {' or '.join(statuses)} step {newest}")
            check_payload(f"{ref} (step {newest}, before repair)", ckpt.meta, ckpt.state_dict, ckpt.extra)
            loaded.add(newest)
            tally.loaded_before_repair += 1
    tally.checked_before_repair += 1


def stored(reg: Registry, info: Any) -> tuple[Any, str, dict[str, int]]:
    """A row's manifest as stored now, its digest, and the size of every file stored beside it."""
    if reg.objects is not None:
        from registry.fs.prefixes import read_manifest as read_object_manifest
        rel = info.path.as_posix()
        manifest, digest = read_object_manifest(reg.objects, rel)
        return manifest, digest, {e.rel[len(rel) + 1:]: e.size for e in reg.objects.list(rel)}
    directory = reg.store.root / info.path
    manifest, digest = read_manifest(directory)
    sizes = {}
    for name in manifest.files:
        try:
            sizes[name] = (directory / name).stat().st_size
        except OSError:
            pass  # missing: the caller says so
    return manifest, digest, sizes


def leftovers(reg: Registry) -> list[str]:
    """What a settled fsck leaves nowhere: hidden directories, or on an object store orphan attempt
    prefixes (no row names them) and incomplete multipart uploads."""
    if reg.objects is None:
        return hidden_dirs(reg.store.root)
    from registry.fs import multipart
    from registry.fs.prefixes import scan
    named = {i.path.as_posix() for r in reg.runs()
             for i in reg.checkpoints(r.name, include_deleted=True) if i.status not in ("failed", "deleted")}
    orphans = [p for p in scan(reg.objects) if p not in named]
    base = reg.objects.key()
    return orphans + [f"upload {u.key}" for u in multipart.list_uploads(reg.objects.config,
                                                                        base + "/" if base else "")]


def _read_stored(reg: Registry, info: Any) -> Any:
    if reg.objects is not None:
        from registry.fs.objectread import read_objects
        return read_objects(reg.objects, info.path.as_posix(), verify=True)
    return read_directory(reg.store.root / info.path, verify=True)


def _exists(reg: Registry, info: Any) -> bool:
    if reg.objects is not None:
        return bool(reg.objects.list(info.path.as_posix()))
    return (reg.store.root / info.path).exists()


def check_invariants(reg: Registry, *, before: dict[tuple[str, int], str], latest_before: dict[str, int],
                     may_delete: bool, tally: Tally, runs: tuple[str, ...] = RUNS) -> None:
    """fsck --repair, then everything the product promises after a crash."""
    report = reg.fsck(repair=True)
    if report.failures or report.unrepaired or report.in_progress:
        _fail(f"fsck could not repair: {report.to_json()}")
    tally.repairs.update(p.kind for p in report.repaired)
    # catalog consistent with disk: a second fsck, re-hashing every live step, finds nothing
    again = reg.fsck(checksums=True)
    if not again.clean or again.in_progress:
        _fail(f"second fsck not clean: {again.to_json()}")
    left = leftovers(reg)
    if left:
        _fail(f"left behind: {left}")
    view = catalog_view(reg, runs)
    for run, infos in view.items():
        if any(i.status == "staging" for i in infos):
            _fail(f"staging rows left: {[i.step for i in infos if i.status == 'staging']}")
        live = {i.step: i for i in infos if i.status in ("published", "verified")}
        for step, info in sorted(live.items()):
            # fsck just re-hashed every live step against the catalog; reading the tensors (to check
            # they belong to the seed in their own meta.json) is needed only where the payload changed
            if tally.loaded.get((run, step)) == info.manifest_sha256:
                continue
            loaded = _read_stored(reg, info)  # raises on any checksum mismatch
            if loaded.manifest_sha256 != info.manifest_sha256:
                _fail(f"{run}@{step}: manifest on disk is not the one the catalog recorded")
            check_payload(f"{run}@{step}", loaded.meta, loaded.state_dict, loaded.extra)
            tally.checked_steps += 1
            tally.loaded[(run, step)] = info.manifest_sha256
        for i in infos:
            if i.status in ("failed", "deleted") and _exists(reg, i):
                _fail(f"{run}@{i.step} is {i.status} but its directory exists")
        for (r, step), _status in before.items():
            if r == run and step not in live and not (may_delete and any(
                    i.step == step and i.status == "deleted" for i in infos)):
                _fail(f"{run}@{step} was live before the kill and is now lost")
        if run in latest_before and latest_before[run] not in live and not (
                # gc may delete it only once a newer step has become the latest verified one
                may_delete and any(i.step == latest_before[run] and i.status == "deleted" for i in infos)
                and any(s > latest_before[run] and i.status == "verified" for s, i in live.items())):
            _fail(f"{run}@{latest_before[run]}, the latest verified step before the kill, is gone")
        tagged = collections.Counter(t for i in infos for t in i.tags)
        if any(n != 1 for n in tagged.values()) or any(i.tags and i.step not in live for i in infos):
            _fail(f"tags of {run} do not each name one live step")
    if view:  # through the public API, as a trainer resuming would
        run = sorted(view)[tally.kills % len(view)]
        if run in latest_before or any(i.status == "verified" for i in view[run]):
            ckpt = reg.load(f"{run}@latest", verify=True)
            if ckpt.step < latest_before.get(run, -1):
                _fail(f"{run}@latest went back from {latest_before[run]} to {ckpt.step}")


def kill_once(reg: Registry, url: str, *, rng: random.Random, mix: tuple[str, ...], max_delay: float,
              tally: Tally, crash_at: str | None = None, once: str | None = None,
              runs: tuple[str, ...] = RUNS) -> int:
    """Start a worker, kill it (at ``crash_at``, or after a random delay), repair and check."""
    view = catalog_view(reg, runs)
    before, latest = snapshot_live(view), latest_verified(view)
    ready = context().Event()
    proc = context().Process(target=worker, args=(worker_url(url), reg.root_url, mix,
                                                  rng.randrange(1 << 30), crash_at, once, ready, runs,
                                                  dict(WORKER_ENV)),
                             daemon=True)
    proc.start()
    if crash_at is None:
        # kills while opening are migration_kills' job; here the moment is random within the operations
        while not ready.wait(0.05):
            if not proc.is_alive():
                break
        time.sleep(rng.uniform(0, max_delay))  # the random moment of the kill, not a wait for a result
        proc.kill()
    proc.join(120)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        _fail("worker hung")
    if proc.exitcode == 0:
        tally.not_reached += 1
    elif proc.exitcode != -9:
        _fail(f"worker failed with exit code {proc.exitcode} before it was killed")
    else:
        tally.kills += 1
    settle(reg)
    check_before_repair(reg, tally=tally, runs=runs)
    may_delete = any(OPS[name].deletes for name in (mix if once is None else (once,)))
    check_invariants(reg, before=before, latest_before=latest, may_delete=may_delete, tally=tally, runs=runs)
    return proc.exitcode


def random_kills(url: str, root: Path | str, *, kills: int, seed: int = 0, mix: tuple[str, ...] = DEFAULT_MIX,
                 max_delay: float = 0.15) -> Tally:
    """``kills`` random-moment kills of a worker looping over ``mix`` on one catalog.

    A worker killed within ``max_delay`` of its start may finish no operation at all on a loaded machine
    (then nothing published survives for the next kill to load before repair): past ``kills``, while no
    kill has yet found a step to load, it goes on with the delays doubled, a few times at most.
    """
    rng = random.Random(seed)
    tally = Tally()
    generation = [0]
    longer = 0
    with Registry.open(url=url, root=root) as reg:
        while tally.kills < kills or (tally.loaded_before_repair == 0 and longer < 8):
            if tally.kills >= kills:
                longer += 1
                max_delay = max(2 * max_delay, 0.1)
            kill_once(reg, url, rng=rng, mix=mix, max_delay=max_delay, tally=tally,
                      runs=current_runs(reg, generation))
    return tally


def migration_kills(make_url: Callable[[], str], root: Path, *, kills: int, seed: int = 0) -> Tally:
    """Kill a worker while it creates and migrates a fresh catalog, then open it and publish.

    Every other kill is at the crash point inside the migration transaction
    (all revisions applied, nothing committed), so at least one per call
    certainly lands mid-migration; it also measures how long starting,
    opening and migrating takes. The others come after a random delay up to
    the shortest time measured, so they land anywhere from process start to
    the end of the migration.
    """
    rng = random.Random(seed)
    tally = Tally()
    to_crash_point: list[float] = []  # seconds from start to the crash point, one per crash-point kill
    for i in range(kills):
        url = make_url()
        sub = root / f"m{i}"
        crash_at = "migrate-before-commit" if i % 2 == 0 else None
        proc = context().Process(target=worker, args=(worker_url(url), str(sub), ("publish",), i, crash_at, None),
                                 daemon=True)
        started = time.monotonic()
        proc.start()
        if crash_at is None:
            time.sleep(rng.uniform(0, min(to_crash_point)))  # the random moment of the kill, not a wait for a result
            proc.kill()
        proc.join(120)
        if crash_at is not None:
            to_crash_point.append(time.monotonic() - started)
        if proc.exitcode != -9:
            proc.kill()
            _fail(f"migration worker ended with {proc.exitcode}" + (f" before {crash_at}" if crash_at else ""))
        tally.kills += 1
        from registry.catalog.session import current_revision, make_engine
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                migrated = current_revision(conn) == head_revision()
        finally:
            engine.dispose()
        if crash_at is not None:
            if migrated:
                _fail("a migration killed before its commit left the catalog at head")
            tally.repairs["killed-mid-migration"] += 1
        tally.repairs["killed-before-migration-done" if not migrated else "killed-after-migration"] += 1
        with Registry.open(url=url, root=sub) as reg:
            settle(reg)
            if reg.catalog.revision() != head_revision():
                _fail(f"catalog at {reg.catalog.revision()} after a killed migration")
            check_before_repair(reg, tally=tally)
            check_invariants(reg, before={}, latest_before={}, may_delete=False, tally=tally)
            reg.publish("after", 1, state(1), meta={"seed": 1})
            reg.load("after")
    if kills and not tally.repairs["killed-mid-migration"]:
        _fail("no kill landed mid-migration")
    return tally


# (operation, crash point) -> what must be at the step afterwards: "old", "new" or "absent"
CRASH_TABLE: dict[tuple[str, str], str] = {
    ("publish", "after-claim"): "absent", ("publish", "after-write"): "absent",
    ("publish", "after-rename"): "new", ("publish", "after-commit"): "new",
    ("overwrite", "after-claim"): "old", ("overwrite", "after-write"): "old",
    ("overwrite", "after-retire"): "old", ("overwrite", "after-rename"): "new",
    ("overwrite", "after-commit"): "new",
}


# The same on an ``s3://`` root: no rename, so a publish killed once its manifest was uploaded is rolled
# forward by fsck, as one killed after the rename is on a filesystem.
OBJECT_CRASH_TABLE: dict[tuple[str, str], str] = {
    ("publish", "after-claim"): "absent", ("publish", "after-write"): "new", ("publish", "after-commit"): "new",
    ("overwrite", "after-claim"): "old", ("overwrite", "after-write"): "new", ("overwrite", "after-commit"): "new",
}
GC_POINTS = ("gc-after-mark", "gc-after-retire")


def crashpoint_kill(reg: Registry, url: str, op: str, point: str, *, rng: random.Random, tally: Tally,
                    table: dict[tuple[str, str], str] | None = None) -> None:
    """Kill ``op`` at ``point`` and check the step holds what ``table`` (CRASH_TABLE) says."""
    run = RUNS[0]
    if op == "overwrite" and not _live_steps(reg, run):
        op_publish(reg, rng, run)
    old = {i.step: (i.manifest_sha256, i.status) for i in reg.checkpoints(run)} if run in {
        r.name for r in reg.runs()} else {}
    code = kill_once(reg, url, rng=rng, mix=DEFAULT_MIX, max_delay=0, tally=tally, crash_at=point, once=op)
    if code != -9:
        _fail(f"{op} never reached crash point {point}")
    now = {i.step: (i.manifest_sha256, i.status) for i in reg.checkpoints(run, include_deleted=True)}
    changed = [s for s in now if now[s][0] != old.get(s, (None,))[0] or s not in old]
    live_now = {s for s, (_, st) in now.items() if st in ("published", "verified")}
    expect = (CRASH_TABLE if table is None else table)[(op, point)]
    if expect == "absent" and (set(live_now) - set(old)):
        _fail(f"{op} killed at {point}: a new step became visible: {sorted(set(live_now) - set(old))}")
    if expect == "old" and any(s in live_now and s in old and now[s][0] != old[s][0] for s in now):
        _fail(f"{op} killed at {point}: the old payload was replaced")
    if expect == "new" and not [s for s in changed if s in live_now]:
        _fail(f"{op} killed at {point}: the new payload is not visible after repair")


def crashpoint_kills(url: str, root: Path, *, rounds: int = 1, seed: int = 0) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    with Registry.open(url=url, root=root) as reg:
        for _ in range(rounds):
            for (op, point) in CRASH_TABLE:
                crashpoint_kill(reg, url, op, point, rng=rng, tally=tally)
            _fsck_kill(reg, url, rng=rng, tally=tally)
    return tally


def object_crashpoint_kills(url: str, root: str, *, rounds: int = 1, seed: int = 0) -> tuple[Tally, Tally]:
    """On an ``s3://`` root: every crash point of publish, overwrite and gc, and a writer killed in the
    middle of a multipart upload, ``rounds`` times; returns the crash-point and the mid-upload tallies."""
    rng = random.Random(seed)
    points, mid = Tally(), Tally()
    with Registry.open(url=url, root=root) as reg:
        for r in range(rounds):
            for (op, point) in OBJECT_CRASH_TABLE:
                crashpoint_kill(reg, url, op, point, rng=rng, tally=points, table=OBJECT_CRASH_TABLE)
            for point in GC_POINTS:
                run = f"gc{r}-{point}"
                while len(_live_steps(reg, run)) < 6:  # 10..60: any of op_gc's policies deletes 10, 20 and 30
                    op_publish(reg, rng, run)
                if kill_once(reg, url, rng=rng, mix=DEFAULT_MIX, max_delay=0, tally=points, crash_at=point,
                             once="gc", runs=(run,)) != -9:
                    _fail(f"gc never reached {point}")
            # the op kills itself mid-upload; a crash point it never reaches keeps kill_once from killing it first
            if kill_once(reg, url, rng=rng, mix=DEFAULT_MIX, max_delay=0, tally=mid, crash_at="after-commit",
                         once="publish-killed-mid-upload") != -9:
                _fail("the mid-upload publish was not killed")
    return points, mid


def _fsck_kill(reg: Registry, url: str, *, rng: random.Random, tally: Tally) -> None:
    """An overwrite killed after retiring, then the fsck that restores it killed too."""
    view = catalog_view(reg)
    before, latest = snapshot_live(view), latest_verified(view)
    for crash_at, once in (("after-retire", "overwrite"), ("fsck-after-restore", "fsck")):
        proc = context().Process(target=worker, args=(worker_url(url), str(reg.store.root), DEFAULT_MIX,
                                                      rng.randrange(1 << 30), crash_at, once), daemon=True)
        proc.start()
        proc.join(120)
        if proc.exitcode != -9:
            _fail(f"{once} never reached {crash_at} (exit {proc.exitcode})")
        tally.kills += 1
        settle(reg)
        check_before_repair(reg, tally=tally)
    check_invariants(reg, before=before, latest_before=latest, may_delete=False, tally=tally)


# --------------------------------------------------------------------------- command line


def _pg_url_factory(admin: str) -> tuple[Callable[[], str], Callable[[], None]]:
    import psycopg
    name = f"killtest_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = admin.rsplit("/", 1)[0] + f"/{name}"

    def make() -> str:
        schema = f"s{uuid.uuid4().hex[:10]}"
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        return base.replace("postgresql://", "postgresql+psycopg://") + f"?options=-csearch_path%3D{schema}"

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return make, drop


def _object_runs(make: Callable[[], str], base: Path, args: Any,
                 mix: tuple[str, ...]) -> list[tuple[str, Tally]]:
    """``--s3``: the kills on an ``s3://`` root of a private SeaweedFS in ``base``."""
    from tests import s3server
    server = s3server.start(base / "weed")
    try:
        WORKER_ENV.update(server.env)
        os.environ.update(server.env)
        points, mid = object_crashpoint_kills(make(), f"s3://{s3server.new_bucket(server)}/cp",
                                              rounds=args.crash_rounds, seed=args.seed)
        randomly = random_kills(make(), f"s3://{s3server.new_bucket(server)}/rk", kills=args.kills,
                                seed=args.seed, mix=mix)
        return [("crash points", points), ("mid-upload", mid), ("random moments", randomly)]
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SIGKILL registry operations and check nothing is lost.")
    parser.add_argument("--kills", type=int, default=1000, help="random kills per backend")
    parser.add_argument("--crash-rounds", type=int, default=5, help="rounds over every crash point per backend")
    parser.add_argument("--migration-kills", type=int, default=50, help="kills during migration per backend")
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--pg", default=os.environ.get("REGISTRY_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--mix", default=",".join(DEFAULT_MIX),
                        help=f"operations the random-moment worker draws from (known: {', '.join(OPS)})")
    parser.add_argument("--s3", action="store_true",
                        help="an s3:// root on a SeaweedFS started here (weed on PATH): crash points of publish, "
                             "overwrite and gc, kills mid multipart upload, random kills; no migration kills")
    args = parser.parse_args(argv)
    mix = tuple(args.mix.split(","))
    unknown = [m for m in mix if m not in OPS]
    if unknown:
        parser.error(f"unknown operations {unknown}; known: {sorted(OPS)}")
    backends = ("sqlite", "postgresql") if args.backend == "both" else (args.backend,)
    print(f"seed {args.seed}")
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix="killtest-") as tmp:
            base = Path(tmp)
            counter = iter(range(1 << 30))
            if backend == "sqlite":
                def make(base: Path = base, counter: Iterator[int] = counter) -> str:
                    return f"sqlite:///{base / f'c{next(counter)}.db'}"

                def drop() -> None:
                    """Nothing to drop: the catalog files go with the temporary directory."""
            else:
                make, drop = _pg_url_factory(args.pg)
            try:
                started = time.monotonic()
                total = Tally()
                for name, tally in (_object_runs(make, base, args, mix) if args.s3 else (
                        ("crash points", crashpoint_kills(make(), base / "cp", rounds=args.crash_rounds,
                                                          seed=args.seed)),
                        ("random moments", random_kills(make(), base / "rk", kills=args.kills, seed=args.seed,
                                                          mix=mix)),
                        ("migrations", migration_kills(make, base / "mg", kills=args.migration_kills,
                                                       seed=args.seed)))):
                    print(f"{backend:<10} {name:<15} kills={tally.kills:<6} not-reached={tally.not_reached:<4} "
                          f"steps-checked={tally.checked_steps:<7} "
                          f"checked-before-repair={tally.checked_before_repair:<6} "
                          f"loaded-before-repair={tally.loaded_before_repair:<6} "
                          f"repairs={dict(sorted(tally.repairs.items()))}")
                    total.merge(tally)
                print(f"{backend:<10} {'total':<15} kills={total.kills:<6} "
                      f"checked-before-repair={total.checked_before_repair:<6} lost-or-corrupt=0 "
                      f"({time.monotonic() - started:.0f} s)")
            finally:
                drop()
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
