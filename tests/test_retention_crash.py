"""SIGKILL a real gc subprocess mid-deletion, on SQLite and PostgreSQL.

The child plans and executes retention and dies at a named crashpoint
(``gc-after-mark``, ``gc-after-retire``), inside the marking transaction
(while it holds its locks), or at a random filesystem operation
(``os.replace``/``rename``/``unlink``/``rmdir`` are wrapped to count calls and
SIGKILL the process at the k-th). Whatever the moment, every kept checkpoint
must still load with verified checksums, no live row may lack its directory,
and the only leftovers may be ``deleted`` rows whose final or retired
directory still exists; a second gc then finishes the job.

Knobs: ``REGISTRY_TEST_GC_KILLS`` random kills per backend (default 2),
``REGISTRY_TEST_GC_SEED`` to draw other kill points (fixed by default; the
seed is in every message, so a failure replays with it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest

from registry import Registry
from registry.format.layout import parse_step_dirname, step_dirname
from registry.retention import KeepBest, KeepEvery, KeepLast, Policy  # noqa: F401 - used by eval
from tests.helpers import assert_state_equal, child_env, make_state

POLICY = 'KeepLast(2) | KeepBest(1, "eval/loss") | KeepEvery(40)'
STEPS = tuple(range(10, 101, 10))
KILLS = int(os.environ.get("REGISTRY_TEST_GC_KILLS", "2"))
SEED = int(os.environ.get("REGISTRY_TEST_GC_SEED", "20261201"))  # fixed: a CI run is replayable as it ran

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from registry import Registry
    from registry.retention import KeepBest, KeepEvery, KeepLast, Policy
    url, root, run, policy, kill_after = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])

    class DieInsideTransaction(Policy):
        # execute() runs the policy again inside the marking transaction: die there, locks held
        def __init__(self, inner):
            self.inner, self.calls = inner, 0
        def keep(self, checkpoints, context):
            self.calls += 1
            if self.calls == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return self.inner.keep(checkpoints, context)

    reg = Registry.open(url=url, root=root)
    plan = reg.plan_retention(run, DieInsideTransaction(eval(policy)) if kill_after < 0 else eval(policy))
    if kill_after > 0:
        calls = [0]
        def counting(fn):
            def wrapper(*args, **kwargs):
                calls[0] += 1
                if calls[0] >= kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                return fn(*args, **kwargs)
            return wrapper
        for name in ("replace", "rename", "unlink", "rmdir"):
            setattr(os, name, counting(getattr(os, name)))
    print(json.dumps(plan.execute().to_json()), flush=True)
""")


def cases() -> list[tuple[str, int]]:
    rng = random.Random(SEED)
    # 4 deletions of ~7 filesystem operations each: k past the end lets the child finish
    return ([("in-transaction", -1), ("gc-after-mark", 0), ("gc-after-retire", 0)]
            + [("random", rng.randint(1, 32)) for _ in range(KILLS)])


def populate(reg: Registry, run: str) -> None:
    for step in STEPS:
        reg.publish(run, step, make_state(step), metrics={"eval/loss": 0.001 if step == 50 else 1.0 / step})
    reg.tag(run, 30, "release")


def check_consistent(reg: Registry, run: str, keep: set[int], delete: set[int], why: str) -> None:
    """Kept steps load verified; live rows have directories; leftovers are only of deleted rows."""
    rows = {i.step: i.status for i in reg.checkpoints(run, include_deleted=True)}
    assert {s for s, st in rows.items() if st == "deleted"} <= delete, why
    assert all(rows[s] == "verified" for s in keep), why
    for step in keep:
        assert_state_equal(reg.load(f"{run}@{step}", verify=True).state_dict, make_state(step))
    for step, st in rows.items():
        if st in ("published", "verified"):
            assert reg.store.step_dir(run, step).is_dir(), f"{why}: live {step} lost its directory"
    for entry in (reg.store.root / run).iterdir():
        parsed = parse_step_dirname(entry.name)
        assert parsed is not None and entry.is_dir(), f"{why}: stray {entry.name}"
        step, kind = parsed
        assert kind != "tmp", f"{why}: stray {entry.name}"
        assert rows[step] in (("deleted",) if kind == "retired" else ("verified", "deleted")), f"{why}: {entry.name}"


def repair(reg: Registry, run: str) -> None:
    """Repair what the killed gc left with fsck, then check a second gc has nothing left to heal."""
    report = reg.fsck(repair=True)
    assert not report.unrepaired and not report.failures, report.to_json()
    assert not reg.fsck().problems
    result = reg.plan_retention(run, eval(POLICY)).execute()
    assert not result.errors and not result.healed


@pytest.mark.parametrize("point,kill_after", cases(), ids=lambda v: str(v))
def test_sigkill_during_gc(reg: Registry, catalog_url: str, point: str, kill_after: int) -> None:
    run = "crash"
    populate(reg, run)
    plan = reg.plan_retention(run, eval(POLICY))
    keep, delete = set(plan.keep), set(plan.delete)
    assert delete == {10, 20, 60, 70} and keep == {30, 40, 50, 80, 90, 100}
    env = child_env()
    env.pop("REGISTRY_CRASH_AT", None)
    if point.startswith("gc-"):
        env["REGISTRY_CRASH_AT"] = point
    child = subprocess.run([sys.executable, "-c", CHILD, catalog_url, str(reg.store.root), run, POLICY,
                            str(kill_after)], env=env, capture_output=True, text=True, timeout=300)
    why = f"{point} kill_after={kill_after} seed={SEED}"
    if point != "random":
        assert child.returncode == -signal.SIGKILL, f"{why}: {child.stderr[-2000:]}"
    else:
        assert child.returncode in (0, -signal.SIGKILL), f"{why}: {child.stderr[-2000:]}"
        if child.returncode == 0:
            assert set(json.loads(child.stdout)["deleted"]) == delete, why

    check_consistent(reg, run, keep, delete, why)
    if point == "in-transaction":  # rolled back: nothing marked, nothing touched
        assert all(reg.catalog.get(run, s).status == "verified" for s in delete)  # type: ignore[union-attr]
        assert all(reg.store.step_dir(run, s).is_dir() for s in delete), why
    if point == "gc-after-mark":  # every doomed row is marked, every directory still there
        assert all(reg.catalog.get(run, s).status == "deleted" for s in delete)  # type: ignore[union-attr]
        assert all(reg.store.step_dir(run, s).is_dir() for s in delete), why
    if point == "gc-after-retire":
        assert any(".retired-" in p.name for p in (reg.store.root / run).iterdir()), why

    repair(reg, run)
    check_consistent(reg, run, keep, delete, why + " after repair")
    assert {i.step for i in reg.checkpoints(run, include_deleted=True) if i.status == "deleted"} == delete
    assert sorted(p.name for p in (reg.store.root / run).iterdir()) == [step_dirname(s) for s in sorted(keep)]
