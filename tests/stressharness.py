"""Concurrency stress: several real processes overlap every operation on one catalog and root.

The kill harness kills one actor at a time; what it cannot find are two
actors overlapping. Here ``workers`` processes loop for ``seconds`` over a mix
that makes them collide on purpose: publishes of the same few steps,
overwrites, re-publishes of steps retention just deleted, tags with fresh
names, retention gc, ``fsck --repair``, ``verify``, loads by every kind of
ref, checkouts written into, and publishes with dedup on that share a frozen
shard. Nothing is injected: every step written is intact, so

* every load must be bit-exact (its tensors are the ones its own ``meta.json``
  seed names);
* no step may ever be marked ``corrupt`` (a "corrupt" verdict or event is a
  false accusation) and no published step may vanish other than by a
  recorded deletion or overwrite;
* an operation may fail only with the errors the contract allows for it
  (``ALLOWED``); anything else, a raw ``OSError`` or a SQLAlchemy error
  included, is a violation;
* afterwards ``fsck`` (and ``fsck --checksums``) is clean, no ``staging`` row
  or hidden directory is left, every run still has a ``@latest``, and its two
  newest verified steps (``@latest`` and its fallback) share no inode.

``python -m tests.stressharness --seconds 300`` (what ``scripts/stresstest``
runs) prints the tally; ``tests/test_stress.py`` runs a short one.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from registry import Registry
from registry.errors import CheckpointNotFoundError, StepExistsError
from registry.fs.inodes import inodes
from tests.killharness import _exists as stored_exists
from tests.killharness import _pg_url_factory, context, leftovers, settle, state, worker_url

RUNS = ("s0", "s1")
STEPS = tuple(range(10, 90, 10))  # few steps, so publishers collide
TAGS = 6  # tag names drawn from tag0..tag5 plus fresh ones


def _rows(reg: Registry, run: str) -> list[Any]:
    try:
        return reg.checkpoints(run, include_deleted=True)
    except CheckpointNotFoundError:
        return []


def _live(reg: Registry, run: str) -> list[int]:
    return [i.step for i in _rows(reg, run) if i.status in ("published", "verified")]


# A frozen base shard (1 MiB, the size dedup starts linking at) that every dedup publish carries.
FROZEN = torch.arange(1 << 18, dtype=torch.float32)


def _check_loaded(ckpt: Any, what: str) -> None:
    seed = ckpt.meta.get("seed")
    want = {**state(seed), "frozen": FROZEN} if ckpt.meta.get("frozen") else state(seed)
    got = ckpt.state_dict
    if set(got) != set(want) or not all(torch.equal(got[k], want[k]) for k in want):
        raise Violation(f"{what} (step {ckpt.step}) loaded tensors that are not the ones published with seed {seed}")
    if "opt" in ckpt.extra and not torch.equal(ckpt.extra["opt"]["m"], torch.full((8,), float(seed % 97))):
        raise Violation(f"{what} (step {ckpt.step}): optimizer extra does not belong to its weights")


class Violation(AssertionError):
    pass


def op_publish(reg: Registry, rng: random.Random, run: str) -> None:
    seed = rng.randrange(1 << 30)
    extra = {"opt": {"m": torch.full((8,), float(seed % 97))}} if rng.random() < 0.3 else None
    free = [s for s in STEPS if s not in _live(reg, run)]
    step = rng.choice(free) if free and rng.random() < 0.5 else rng.choice(STEPS)  # else: most likely a collision
    reg.publish(run, step, state(seed), meta={"seed": seed}, extra=extra,
                metrics={"loss": rng.random()}, verify=rng.random() < 0.8)


def op_dedup_publish(reg: Registry, rng: random.Random, run: str) -> None:
    """A publish with dedup on whose frozen shard other steps hold: links, then the fallback rule keeps copies."""
    seed = rng.randrange(1 << 30)
    free = [s for s in STEPS if s not in _live(reg, run)]
    step = rng.choice(free) if free else rng.choice(STEPS)
    reg.publish(run, step, {**state(seed), "frozen": FROZEN}, meta={"seed": seed, "frozen": True},
                metrics={"loss": rng.random()}, dedup=True, overwrite=rng.random() < 0.2)


def op_overwrite(reg: Registry, rng: random.Random, run: str) -> None:
    steps = _live(reg, run)
    seed = rng.randrange(1 << 30)
    reg.publish(run, rng.choice(steps or STEPS), state(seed), meta={"seed": seed}, overwrite=True,
                metrics={"loss": rng.random()})


def op_republish_deleted(reg: Registry, rng: random.Random, run: str) -> None:
    gone = [i.step for i in _rows(reg, run) if i.status in ("deleted", "failed")]
    if not gone:
        return op_publish(reg, rng, run)
    seed = rng.randrange(1 << 30)
    reg.publish(run, rng.choice(gone), state(seed), meta={"seed": seed})


def op_tag(reg: Registry, rng: random.Random, run: str) -> None:
    steps = _live(reg, run)
    if steps:
        name = f"tag{rng.randrange(TAGS)}" if rng.random() < 0.7 else f"new-{rng.randrange(1 << 30)}"
        reg.tag(run, rng.choice(steps), name)


def op_gc(reg: Registry, rng: random.Random, run: str) -> None:
    from registry.retention import KeepBest, KeepLast
    if _live(reg, run):
        reg.apply_retention(run, KeepLast(rng.choice((1, 2, 3))) | KeepBest(1, "loss"))


def op_fsck(reg: Registry, rng: random.Random, run: str) -> None:
    reg.fsck(repair=True)


def op_verify(reg: Registry, rng: random.Random, run: str) -> None:
    if _rows(reg, run):
        for result in reg.verify(run):
            if result.status == "corrupt":
                raise Violation(f"verify condemned {run}@{result.step}: {result.problems}")


def op_load(reg: Registry, rng: random.Random, run: str) -> None:
    steps = _live(reg, run)
    tags = sorted({t for i in _rows(reg, run) for t in i.tags})
    refs = [f"{run}@latest", f"{run}@latest-published", f"{run}@best:loss"]
    refs += [f"{run}@{s}" for s in steps[:2]] + [f"{run}@{t}" for t in tags[:2]]
    ref = rng.choice(refs)
    with reg_warnings():
        _check_loaded(reg.load(ref, verify=rng.random() < 0.7), ref)


def op_checkout(reg: Registry, rng: random.Random, run: str) -> None:
    """A reader that writes into its checkout (reaching no step), or leaks one for gc and fsck to reclaim."""
    from datetime import timedelta
    if not _live(reg, run):
        return
    if rng.random() < 0.3:
        with reg_warnings():
            reg.checkout(f"{run}@latest", ttl=timedelta(0))  # never closed, its lease already expired
        return
    with reg_warnings(), reg.checkout(f"{run}@latest") as co:
        with open(Path(co) / "model.safetensors", "r+b") as f:
            f.write(b"\xff" * 16)
        (Path(co) / "config.json").write_text("{}")


def reg_warnings() -> Any:
    """A fallback from a corrupt @latest warns; there is no corrupt step here, so a warning is a violation."""
    import warnings
    ctx = warnings.catch_warnings()

    class _Ctx:
        def __enter__(self) -> None:
            ctx.__enter__()
            warnings.simplefilter("error", RuntimeWarning)

        def __exit__(self, *exc: object) -> None:
            ctx.__exit__(*exc)
    return _Ctx()


OPS: dict[str, Callable[[Registry, random.Random, str], None]] = {
    "publish": op_publish, "overwrite": op_overwrite, "republish-deleted": op_republish_deleted, "tag": op_tag,
    "gc": op_gc, "fsck": op_fsck, "verify": op_verify, "load": op_load, "checkout": op_checkout,
    "dedup-publish": op_dedup_publish}
MIX = ("publish", "publish", "overwrite", "republish-deleted", "tag", "gc", "fsck", "verify", "load", "load",
       "load", "checkout", "dedup-publish")
#: on an ``s3://`` root: no dedup (refused there) and no registry-owned checkouts (downloads are the caller's)
OBJECT_MIX = tuple(m for m in MIX if m not in ("checkout", "dedup-publish"))

# What the contract lets each operation raise when another actor got there first.
_NOT_FOUND = (CheckpointNotFoundError,)
ALLOWED: dict[str, tuple[type[BaseException], ...]] = {
    "publish": (StepExistsError,),
    "overwrite": (StepExistsError,),  # another live writer holds the step's claim
    "republish-deleted": (StepExistsError,),
    "tag": _NOT_FOUND,  # gc deleted the step after we listed it
    "gc": (),
    "fsck": (),
    "verify": _NOT_FOUND,
    "load": _NOT_FOUND,  # @N or @TAG deleted by gc, or no verified step yet
    "checkout": _NOT_FOUND,
    "dedup-publish": (StepExistsError,),
}


def worker(url: str, root: str, seconds: float, seed: int, out: Any, mix: tuple[str, ...] = MIX,
           env: dict[str, str] | None = None) -> None:
    """Run random operations until ``seconds`` pass (then each one not yet completed, a few tries each); put the
    tally (and intervals) on ``out``.

    ``env``: an ``s3://`` root's AWS environment (a forkserver's children do not get the parent's).
    """
    os.environ.update(env or {})
    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    allowed: collections.Counter[str] = collections.Counter()
    violations: list[str] = []
    intervals: list[tuple[float, float, str]] = []
    try:
        with Registry.open(url=url, root=root) as reg:
            deadline = time.monotonic() + seconds
            # past the deadline, the operations this worker has not yet completed, a few tries each: a loaded
            # machine slows a run down, never shrinks what it exercises
            extra = 5 * len(set(mix))
            while len(violations) < 20:
                if time.monotonic() < deadline:
                    name = rng.choice(mix)
                else:
                    missing = sorted(set(mix) - set(counts))
                    if not missing or extra == 0:
                        break
                    extra -= 1
                    name = rng.choice(missing)
                run = rng.choice(RUNS)
                start = time.monotonic()
                try:
                    OPS[name](reg, rng, run)
                    counts[name] += 1
                except ALLOWED[name] as exc:
                    allowed[f"{name}: {type(exc).__name__}"] += 1
                except Violation as exc:
                    violations.append(f"{name} {run}: {exc}")
                except Exception as exc:  # noqa: BLE001 - anything else reached a caller: that is the finding
                    violations.append(f"{name} {run}: {type(exc).__name__}: {exc}".splitlines()[0]
                                      + f" [{traceback.extract_tb(exc.__traceback__)[-1].name}]")
                intervals.append((start, time.monotonic(), name))
    except Exception as exc:  # noqa: BLE001
        violations.append(f"worker: {type(exc).__name__}: {exc}".splitlines()[0])
    out.put({"counts": counts, "allowed": allowed, "violations": violations, "intervals": intervals})


@dataclass(kw_only=True)
class StressTally:
    """What the run did and found, for RELIABILITY.md."""

    operations: collections.Counter[str] = field(default_factory=collections.Counter)
    allowed_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    overlaps: int = 0  # pairs of operations of different processes that ran at the same time
    violations: list[str] = field(default_factory=list)
    condemned: int = 0  # "corrupt" verdicts written: every step here is intact
    lost: int = 0  # live steps whose payload is gone without a recorded deletion or overwrite

    def summary(self) -> str:
        return (f"operations={sum(self.operations.values())} {dict(sorted(self.operations.items()))} "
                f"overlaps={self.overlaps} allowed-errors={dict(sorted(self.allowed_errors.items()))} "
                f"condemned={self.condemned} lost={self.lost} violations={len(self.violations)}")


def _overlaps(per_worker: list[list[tuple[float, float, str]]]) -> int:
    """Pairs of operations from different workers whose run times intersect (a sweep over start times)."""
    events = sorted((s, e, w) for w, ivs in enumerate(per_worker) for s, e, _ in ivs)
    count = 0
    active: list[tuple[float, int]] = []
    for start, end, w in events:
        active = [(e, aw) for e, aw in active if e > start]
        count += sum(1 for _, aw in active if aw != w)
        active.append((end, w))
    return count


def check_after(reg: Registry, tally: StressTally) -> None:
    """Everything the product promises once the actors have stopped."""
    settle(reg)
    for run in RUNS:
        rows = _rows(reg, run)
        if any(i.status == "staging" for i in rows):
            tally.violations.append(f"{run}: staging rows left: {[i.step for i in rows if i.status == 'staging']}")
        corrupt = [i.step for i in rows if i.status == "corrupt"]
        if corrupt:
            tally.violations.append(f"{run}: intact steps marked corrupt: {corrupt}")
        accusations = [e for e in reg.events(run) if e.kind == "corrupt" or e.detail.get("status") == "corrupt"]
        tally.condemned += len(accusations)
        for i in rows:
            if i.status in ("published", "verified") and not stored_exists(reg, i):
                tally.lost += 1
                tally.violations.append(f"{run}@{i.step} is {i.status} but its payload is gone")
        if rows and not any(i.status == "verified" for i in rows):
            tally.violations.append(f"{run} has no verified step left")
        newest = sorted((i for i in rows if i.status == "verified"), key=lambda i: -i.step)[:2]
        if len(newest) == 2 and reg.objects is None:  # objects share nothing
            shared = set(inodes(reg.store.root / newest[0].path)) & set(inodes(reg.store.root / newest[1].path))
            if shared:
                tally.violations.append(f"{run}@{newest[0].step} and @{newest[1].step}, the fallback pair, share "
                                        f"{len(shared)} inode(s): one bad byte would take both")
    if reg.objects is None:
        from registry.ops.checkouts import owned, reclaim
        reclaim(reg.catalog, reg.store.root)  # what the leaked checkouts left, as gc and fsck --repair remove it
        if owned(reg.store.root):
            tally.violations.append(f"checkouts left after reclaiming: {[str(c.path) for c in owned(reg.store.root)]}")
    left = leftovers(reg)  # nobody was killed: not one orphan prefix or open upload may be left
    if left:
        tally.violations.append(f"left behind: {left}")
    for checksums in (False, True):
        report = reg.fsck(checksums=checksums)
        if not report.clean or report.in_progress:
            tally.violations.append(f"fsck(checksums={checksums}) not clean: "
                                    f"{[str(p) for p in report.problems + report.in_progress]}")
    for run in RUNS:
        if _rows(reg, run):
            try:
                _check_loaded(reg.load(f"{run}@latest"), f"{run}@latest")
            except Exception as exc:  # noqa: BLE001
                tally.violations.append(f"final load of {run}@latest: {type(exc).__name__}: {exc}")
    if tally.condemned:
        tally.violations.append(f"{tally.condemned} corrupt verdicts were written about intact steps")


def stress(url: str, root: Path | str, *, seconds: float, workers: int = 4, seed: int = 0,
           mix: tuple[str, ...] = MIX, env: dict[str, str] | None = None) -> StressTally:
    """``workers`` processes overlap every operation for ``seconds``; returns the tally after the checks."""
    ctx = context()
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(worker_url(url), str(root), seconds, seed * 1000 + w, out, mix, env),
                         daemon=True) for w in range(workers)]
    with Registry.open(url=url, root=root) as reg:  # create and migrate once, before the workers race
        for p in procs:
            p.start()
        results = []
        tally = StressTally()
        for _ in procs:
            try:
                results.append(out.get(timeout=seconds + 300))
            except Exception:  # noqa: BLE001 - queue.Empty: a worker hung or died
                tally.violations.append("a worker did not report: hung or died")
                break
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                tally.violations.append("a worker hung after reporting")
        for r in results:
            tally.operations.update(r["counts"])
            tally.allowed_errors.update(r["allowed"])
            tally.violations.extend(r["violations"])
        tally.overlaps = _overlaps([r["intervals"] for r in results])
        check_after(reg, tally)
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Overlap every registry operation in several processes.")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the workers run, per backend")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--pg", default=os.environ.get("REGISTRY_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--mix", default=None, help=f"operations to draw from (known: {', '.join(OPS)})")
    parser.add_argument("--s3", action="store_true", help="an s3:// root on a SeaweedFS started here (weed on PATH)")
    args = parser.parse_args(argv)
    mix = tuple(args.mix.split(",")) if args.mix else (OBJECT_MIX if args.s3 else MIX)
    if unknown := [m for m in mix if m not in OPS]:
        parser.error(f"unknown operations {unknown}; known: {sorted(OPS)}")
    print(f"seed {args.seed}")
    failed = False
    for backend in ("sqlite", "postgresql") if args.backend == "both" else (args.backend,):
        with tempfile.TemporaryDirectory(prefix="stresstest-") as tmp:
            if backend == "sqlite":
                url = f"sqlite:///{Path(tmp) / 'catalog.db'}"

                def drop() -> None:
                    """Nothing to drop: the catalog file goes with the temporary directory."""
            else:
                make, drop = _pg_url_factory(args.pg)
                url = make()
            server = None
            try:
                root: Path | str = Path(tmp) / "root"
                env = None
                if args.s3:
                    from tests import s3server
                    server = s3server.start(Path(tmp) / "weed")
                    env = server.env
                    os.environ.update(env)
                    root = f"s3://{s3server.new_bucket(server)}/root"
                tally = stress(url, root, seconds=args.seconds, workers=args.workers, seed=args.seed, mix=mix,
                               env=env)
            finally:
                if server is not None:
                    server.stop()
                drop()
            print(f"{backend:<10} {tally.summary()}")
            for v in tally.violations:
                print(f"  violation: {v}")
            failed |= bool(tally.violations)
            sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
