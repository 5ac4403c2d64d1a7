"""Real processes racing on one catalog (SQLite and PostgreSQL): nothing lost, no lock error leaks.

Eight worker processes start together on a barrier. Every error a worker
meets is sent back as text, so "database is locked" or a serialization
failure reaching the user fails the test with its message.
``REGISTRY_RACE_ROUNDS`` repeats the same-step race (default 1).
"""

from __future__ import annotations

import os
import random
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry, StepExistsError
from tests.helpers import pg_schema_url
from tests.killharness import context, state

WORKERS = 8
ROUNDS = int(os.environ.get("REGISTRY_RACE_ROUNDS", "1"))


def _run(target: Callable[..., Any], args_for: Callable[[int], tuple[Any, ...]], n: int = WORKERS) -> list[Any]:
    """Start ``n`` workers that wait on one barrier, and collect what each returned (or raised)."""
    ctx = context()
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(target, i, barrier, results, *args_for(i))) for i in range(n)]
    for p in procs:
        p.start()
    out = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return [r for _, r in sorted(out)]


def _worker(target: Callable[..., Any], index: int, barrier: Any, results: Any, *args: Any) -> None:
    try:
        result: Any = target(index, barrier, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails on it
        result = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    results.put((index, result))


def publish_many(index: int, barrier: Any, url: str, root: str, steps: int) -> Any:
    with Registry.open(url=url, root=root) as reg:
        barrier.wait()
        for j in range(steps):
            seed = index * 1000 + j
            reg.publish("shared", index * 100 + j, state(seed), meta={"seed": seed}, metrics={"loss": 1.0 / (j + 1)})
            reg.publish(f"own{index}", j, state(seed), meta={"seed": seed})
            reg.log_metrics("shared", index * 100 + j, {"late": float(j)})
        reg.flush()
    return "ok"


def race_step(index: int, barrier: Any, url: str, root: str, step: int) -> Any:
    with Registry.open(url=url, root=root) as reg:
        barrier.wait()
        try:
            reg.publish("race", step, state(index), meta={"seed": index})
        except StepExistsError:
            return "exists"
    return ("won", index)


def open_fresh(index: int, barrier: Any, url: str, root: str) -> Any:
    import alembic.command
    runs = []
    real = alembic.command.upgrade
    alembic.command.upgrade = lambda *a, **k: (runs.append(1), real(*a, **k))[1]  # count, in this process only
    barrier.wait()
    with Registry.open(url=url, root=root) as reg:
        reg.publish(f"fresh{index}", 1, state(index), meta={"seed": index})
    return len(runs)


def read_while_publishing(index: int, barrier: Any, url: str, root: str, iterations: int) -> Any:
    rng = random.Random(index)
    with Registry.open(url=url, root=root) as reg:
        barrier.wait()
        if index == 0:  # overwriter: replaces whatever step is newest, under the readers' feet
            for j in range(iterations):
                seed = 500_000 + j
                step = reg.resolve("hot@latest-published").step
                reg.publish("hot", step, state(seed), meta={"seed": seed}, overwrite=True)
            return ("wrote", 0)
        if index % 2 == 0:  # writers: new steps
            for j in range(iterations):
                seed = index * 1000 + j
                reg.publish("hot", 1000 + index * 100 + j, state(seed), meta={"seed": seed})
            return ("wrote", iterations)
        loads = 0
        for _ in range(iterations * 2):  # reader: every load is one whole, verified, self-consistent step
            ckpt = reg.load(rng.choice(["hot", "hot@latest-published"]), verify=True)
            want = state(ckpt.meta["seed"])
            if not all(torch.equal(ckpt.state_dict[k], want[k]) for k in want):
                return ("error", f"torn read of step {ckpt.step}", "")
            loads += 1
        return ("read", loads)


def errors(results: list[Any]) -> list[str]:
    return [f"{r[1]}\n{r[2]}" for r in results if isinstance(r, tuple) and r and r[0] == "error"]


def test_parallel_publishers(catalog_url: str, root: Path) -> None:
    steps = 2
    results = _run(publish_many, lambda i: (catalog_url, str(root), steps))
    assert not errors(results), errors(results)[0]
    with Registry.open(url=catalog_url, root=root) as reg:
        shared = reg.checkpoints("shared")
        assert len(shared) == WORKERS * steps and all(i.status == "verified" for i in shared)
        assert len({r.name for r in reg.runs()}) == WORKERS + 1
        for info in shared:
            ckpt = reg.load(f"shared@{info.step}")
            assert torch.equal(ckpt.state_dict["w"], state(ckpt.meta["seed"])["w"])
        assert len(reg.metrics("shared", "late")) == WORKERS * steps
        assert reg.fsck(checksums=True).clean


def test_racing_for_one_step(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("race", 0, state(0), meta={"seed": 0})  # the run exists: the race is on the step row
    for step in range(1, ROUNDS + 1):
        results = _run(race_step, lambda i, step=step: (catalog_url, str(root), step))
        assert not errors(results), errors(results)[0]
        winners = [r[1] for r in results if isinstance(r, tuple) and r[0] == "won"]
        assert len(winners) == 1 and results.count("exists") == WORKERS - 1
        with Registry.open(url=catalog_url, root=root) as reg:
            assert reg.load(f"race@{step}").meta["seed"] == winners[0]
            assert sorted(p.name for p in (root / "race").iterdir())[-1] == f"step-{step:08d}"
            assert not [p for p in (root / "race").iterdir() if p.name.startswith(".")]


def test_opening_a_fresh_catalog_at_once(request: pytest.FixtureRequest, catalog_url: str, root: Path) -> None:
    url = catalog_url if catalog_url.startswith("sqlite") else pg_schema_url(request.getfixturevalue("pg_database"))
    results = _run(open_fresh, lambda i: (url, str(root)))
    assert not errors(results), errors(results)[0]
    assert sum(results) == 1  # exactly one process ran the migrations
    with Registry.open(url=url, root=root) as reg:
        assert reg.catalog.revision() == reg.catalog.head()
        assert len(reg.runs()) == WORKERS


def test_readers_during_publishes(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("hot", 1, state(7), meta={"seed": 7})  # never overwritten: something is always loadable
        reg.publish("hot", 2, state(8), meta={"seed": 8})
    iterations = 3
    results = _run(read_while_publishing, lambda i: (catalog_url, str(root), iterations))
    assert not errors(results), errors(results)[0]
    assert sum(r[1] for r in results if r[0] == "read") == (WORKERS // 2) * iterations * 2
    with Registry.open(url=catalog_url, root=root) as reg:
        # nothing a reader saw mid-overwrite was mistaken for corruption
        assert len(reg.checkpoints("hot")) == 2 + (WORKERS // 2 - 1) * iterations
        assert all(i.status == "verified" for i in reg.checkpoints("hot"))
        assert reg.fsck(checksums=True).clean
