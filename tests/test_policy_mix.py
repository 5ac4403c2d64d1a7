"""A random mix of policy publishes (full and delta, retention after each, folds), consumers and SIGKILLs of both.

Each round a trainer process publishes the next versions while a consumer process leases the newest one; either
may be killed at a point drawn from a seeded generator (the trainer at a crash point of the publish or of its
retention, the consumer after its lease, its materialize or its ``applied``). Killed consumers keep their rows
alive (a long ttl), so what they leased or served must stay. After every round:

- no version that a live consumer leases or serves was deleted, nor any member of its delta chain from its
  newest anchored member on (the trainer re-anchors kept deltas now and then, and may be killed doing it);
- every live policy version loads as exactly the weights it was published with (its chain is whole);
- no load was recorded ``applied`` without having verified (each consumer compared every byte it materialized
  with the version's weights, and exits 3 when they differ).

``REGISTRY_POLICY_MIX_ROUNDS`` sets the number of rounds (CI: the default, small); on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch

from registry import Registry
from registry.records import LIVE
from tests._policy_mix_worker import RUN, weights
from tests.helpers import _forked_rank, child_env
from tests.killharness import context

ROUNDS = int(os.environ.get("REGISTRY_POLICY_MIX_ROUNDS", "6"))
VERSIONS_PER_ROUND = 3
TRAINER_POINTS = ("after-claim", "after-write", "after-rename", "after-commit", "gc-after-mark", "gc-after-retire",
                  "reanchor-after-store")
CONSUMER_DEATHS = ("leased", "materialized", "applied", "never", "never")
DEADLINE_S = 120.0


def start(argv: list[str], log: Path) -> Any:
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    env.pop("REGISTRY_CRASH_AT", None)
    proc = context().Process(target=_forked_rank, args=("tests._policy_mix_worker", argv, env, str(log)),
                             daemon=True)
    proc.start()
    return proc


def finish(proc: Any, log: Path) -> tuple[int, list[dict[str, Any]]]:
    proc.join(DEADLINE_S)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"a mix process hung past {DEADLINE_S}s:\n{log.read_text(errors='replace')}")
    said = [json.loads(line) for line in log.read_text(errors="replace").splitlines() if line.startswith("{")]
    return int(proc.exitcode), said


def chain_of(reg: Registry, step: int) -> list[int]:
    from registry.catalog.policy import chain_steps
    return list(chain_steps(reg.catalog, RUN, step))


def check(reg: Registry, held: dict[str, int]) -> None:
    """The invariants, on the catalog and the root as they are now (``held``: a killed consumer -> its version)."""
    if not any(r.name == RUN for r in reg.runs()):
        assert not held
        return
    from registry.ops.policy import anchors
    steps = {c.step: c for c in reg.checkpoints(RUN, include_deleted=True)}
    live = {c.policy_version: c for c in steps.values() if c.status in LIVE and c.policy_version is not None}
    anchored = {f.to_step for f in anchors(reg.catalog, RUN)}
    for name, version in held.items():
        row = next((c for c in steps.values() if c.policy_version == version), None)
        assert row is not None and row.status in LIVE, (name, version, row)
        chain = chain_of(reg, row.step)  # what it reads: from its newest anchored member (or its full) on
        start = max((i for i, s in enumerate(chain) if s in anchored), default=0)
        for member in chain[start:]:
            assert steps[member].status in LIVE, (name, version, "chain", member, steps[member].status)
    for version, info in live.items():
        got = reg.load(f"{RUN}@pv:{version}").state_dict
        want = weights(version)
        assert set(got) == set(want), version
        for key, tensor in want.items():
            assert torch.equal(got[key].view(torch.uint8), tensor.view(torch.uint8)), (version, key, info.step)
    for load in reg.loads(RUN):
        assert load.applied_at is None or load.verified, load


def test_a_random_mix_of_publishes_consumers_retention_and_kills_keeps_every_promise(
        catalog_url: str, tmp_path: Path) -> None:
    rng = random.Random(20261206)
    root = tmp_path / "root"
    with Registry.open(catalog_url, root) as first:
        first.publish(RUN, 0, weights(0), policy_version=0, delta="auto")  # a version for the first consumer
    held: dict[str, int] = {}
    kills = {"trainer": 0, "consumer": 0}
    end = 1
    with Registry.open(catalog_url, root, create=False) as reg:
        for rnd in range(ROUNDS):
            end += VERSIONS_PER_ROUND
            kill_version = rng.randrange(end - VERSIONS_PER_ROUND, end) if rng.random() < 0.6 else -1
            point = rng.choice(TRAINER_POINTS)
            death = rng.choice(CONSUMER_DEATHS)
            name = f"rollout-{rnd}"
            logs = tmp_path / f"round-{rnd}"
            logs.mkdir()
            trainer = start(["trainer", catalog_url, str(root), str(end), str(kill_version), point],
                            logs / "trainer.log")
            consumer = start(["consumer", catalog_url, str(root), name, death], logs / "consumer.log")
            t_code, _ = finish(trainer, logs / "trainer.log")
            c_code, c_said = finish(consumer, logs / "consumer.log")
            assert t_code in (0, -9), (logs / "trainer.log").read_text(errors="replace")
            assert c_code in (0, -9), (c_code, (logs / "consumer.log").read_text(errors="replace"))
            kills["trainer"] += t_code == -9
            kills["consumer"] += c_code == -9
            version = c_said[0].get("version") if c_said else None
            if c_code == -9 and version is not None:
                held[name] = version  # leased, or applied and not released: a live consumer keeps it
            if rnd % 3 == 2:
                reg.fsck(repair=True)  # what kills left behind; never a version anyone holds
            check(reg, held)
    assert sum(kills.values()) >= min(ROUNDS, 2) // 2, kills  # the mix killed something
    with Registry.open(catalog_url, root, create=False) as reg:
        assert not reg.fsck(repair=True).unrepaired
        check(reg, held)

