"""Benchmark: resolving refs on a large catalog, on SQLite and on PostgreSQL.

Builds a catalog of N checkpoints (default 100,000) across R runs (default
100) with K metrics per step (default 10) by bulk-inserting rows through
SQLAlchemy Core (publishing 100k real checkpoints would measure the disk, not
the catalog), then times ``Catalog.resolve`` for ``@latest``,
``@latest-published``, ``@best:METRIC`` (min and max) and a tag: the whole
call a user makes (a connection, the run lookup, the query, the metrics and
tags of the answer). It also times the bare SELECT, and prints the query plans
so one can see the indexes at work.

The catalog is realistic rather than tidy: ~1% of steps deleted, ~1% corrupt,
the newest steps of each run still ``published`` or ``staging``, ~2% of
metric points superseded by a newer point at the same step, and metric
points at steps without a checkpoint (train loss logged every half step).

Usage: ./scripts/bench queries [--checkpoints N] [--runs R] [--metrics K]
       [--rounds 7] [--iterations 200] [--backends sqlite,postgresql]
PostgreSQL: a throwaway database on $REGISTRY_BENCH_PG (default
postgresql://postgres@127.0.0.1:5432/postgres), created and dropped here.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from registry.catalog import Catalog, CommitRecord, PayloadRecord  # noqa: E402
from registry.catalog.models import CheckpointRow, Metric, Run, Tag  # noqa: E402
from registry.catalog.session import write_connection  # noqa: E402
from registry.errors import CheckpointNotFoundError  # noqa: E402
from registry.ops.follow import POLL_MAX_S  # noqa: E402
from registry.format.refs import Ref, parse_ref  # noqa: E402

CHUNK = 20_000
BEST_KEY = "eval/loss"


def metric_keys(k: int) -> list[str]:
    return [BEST_KEY] + [f"eval/m{i}" for i in range(1, k)]


def build(catalog: Catalog, *, checkpoints: int, runs: int, metrics: int, seed: int = 0) -> dict[str, int]:
    """Bulk-load the catalog; returns row counts."""
    rng = random.Random(seed)
    now = datetime.now(timezone.utc)
    per_run = checkpoints // runs
    keys = metric_keys(metrics)
    counts = {"checkpoints": 0, "metrics": 0, "tags": 0}
    with write_connection(catalog.engine) as conn:
        conn.execute(insert(Run), [{"name": f"run{r:03d}", "created_at": now} for r in range(runs)])
        run_ids = dict(conn.execute(select(Run.c.name, Run.c.id)).all())

    def rows() -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
        ckpts: list[dict[str, Any]] = []
        points: list[dict[str, Any]] = []
        for r in range(runs):
            run_id = run_ids[f"run{r:03d}"]
            for i in range(per_run):
                step = (i + 1) * 100
                status = "verified"
                if i >= per_run - 2:
                    status = "staging" if i == per_run - 1 else "published"
                elif rng.random() < 0.01:
                    status = "deleted"
                elif rng.random() < 0.01:
                    status = "corrupt"
                ckpts.append({"run_id": run_id, "step": step, "status": status,
                              "path": f"run{r:03d}/step-{step:08d}", "writer": "bench:1", "epoch": 0,
                              "consumed_samples": step * 64, "policy_version": step // 1000,
                              "total_bytes": 1 << 20, "created_at": now, "updated_at": now})
                for key in keys:
                    value = rng.random()
                    if rng.random() < 0.02:  # an older point this step's current one superseded
                        points.append({"run_id": run_id, "step": step, "key": key, "value": value / 10,
                                       "superseded": True, "logged_at": now})
                    points.append({"run_id": run_id, "step": step, "key": key, "value": value,
                                   "superseded": False, "logged_at": now})
                points.append({"run_id": run_id, "step": step - 50, "key": "train/loss",
                               "value": rng.random(), "superseded": False, "logged_at": now})
                if len(points) >= CHUNK:
                    yield ckpts, points
                    ckpts, points = [], []
        yield ckpts, points

    for ckpts, points in rows():
        with write_connection(catalog.engine) as conn:
            if ckpts:
                conn.execute(insert(CheckpointRow), ckpts)
            if points:
                conn.execute(insert(Metric), points)
        counts["checkpoints"] += len(ckpts)
        counts["metrics"] += len(points)
    with write_connection(catalog.engine) as conn:
        tags = []
        for run_id in run_ids.values():
            ids = conn.scalars(select(CheckpointRow.c.id).where(CheckpointRow.c.run_id == run_id,
                                                              CheckpointRow.c.status == "verified")).all()
            for t, cid in enumerate(rng.sample(list(ids), min(5, len(ids)))):
                tags.append({"run_id": run_id, "name": f"tag{t}", "checkpoint_id": cid, "updated_at": now})
        conn.execute(insert(Tag), tags)
        counts["tags"] = len(tags)
    if catalog.dialect == "postgresql":
        with catalog.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))  # what autovacuum does soon after a bulk load anyway
    return counts


def timed(fn: Callable[[], Any], *, rounds: int, iterations: int) -> tuple[float, float, float]:
    """Median, min and max over ``rounds`` of the per-call median (ms), after a warm-up round."""
    for _ in range(max(10, iterations // 10)):
        fn()
    medians = []
    for _ in range(rounds):
        samples = []
        for _ in range(iterations):
            t0 = time.perf_counter_ns()
            fn()
            samples.append(time.perf_counter_ns() - t0)
        medians.append(statistics.median(samples) / 1e6)
    return statistics.median(medians), min(medians), max(medians)


def explain(catalog: Catalog, ref: Ref) -> list[str]:
    with catalog.engine.connect() as conn:
        query, _ = Catalog.resolve_query(ref)
        sql = str(query.compile(dialect=catalog.engine.dialect, compile_kwargs={"literal_binds": True}))
        if catalog.dialect == "sqlite":
            return [f"{r[3]}" for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql)]
        return [r[0] for r in conn.exec_driver_sql("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + sql)]


def bare_query(catalog: Catalog, ref: Ref) -> Callable[[], Any]:
    """The resolve SELECT alone, on one open connection (what the indexes decide)."""
    conn = catalog.engine.connect()
    query, _ = Catalog.resolve_query(ref)

    def fn() -> Any:
        row = conn.execute(query).first()
        conn.rollback()
        return row
    fn.close = conn.close  # type: ignore[attr-defined]
    return fn


def follower_wakeups(catalog: Catalog, samples: int) -> list[tuple[float, float]]:
    """Milliseconds from the start of a publish's commit transaction, and from its end (negative: the
    follower returned before the publisher's call did), to a waiting follower returning.

    The follower waits in a thread for the next step; the "trainer" commits it
    after a random 50-300 ms, as a catalog-only publish (this measures the
    wake-up path, not the payload write).
    """
    from registry.ops.follow import Follower
    run = "follow-bench"
    rng = random.Random(2)
    out = []
    with Follower(catalog, run) as follower:
        for i in range(samples):
            woke: list[float] = []
            waiter = threading.Thread(target=lambda after=(i - 1 if i else None), woke=woke: (
                follower.wait(after, timeout=60), woke.append(time.perf_counter())))
            waiter.start()
            time.sleep(rng.uniform(0.05, 0.3))
            claim = catalog.claim(run, i, path=f"{run}/step-{i:08d}", writer="bench:1", overwrite=False)
            t0 = time.perf_counter()
            record = CommitRecord(payload=PayloadRecord(status="verified", manifest_sha256="0" * 64, files=(),
                                                        total_bytes=0))
            catalog.commit_publish(claim, record, writer="bench:1")
            t1 = time.perf_counter()
            waiter.join()
            out.append(((woke[0] - t0) * 1000, (woke[0] - t1) * 1000))
    return out


@contextmanager
def backend(name: str, workdir: Path) -> Iterator[str]:
    if name == "sqlite":
        yield f"sqlite:///{workdir / 'bench.db'}"
        return
    import psycopg
    admin = os.environ.get("REGISTRY_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
    db = f"regbench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}"')
    try:
        yield admin.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{db}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def main() -> None:
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=int(env("REGISTRY_BENCH_CHECKPOINTS", "100000")))
    ap.add_argument("--runs", type=int, default=int(env("REGISTRY_BENCH_RUNS", "100")))
    ap.add_argument("--metrics", type=int, default=10, help="metric keys per step")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--no-explain", action="store_true")
    ap.add_argument("--follow-samples", type=int, default=20, help="follower wake-ups to time (0: skip)")
    args = ap.parse_args()
    if args.runs < 1 or args.checkpoints < args.runs * 3 or args.metrics < 1 or args.rounds < 5:
        ap.error("need runs >= 1, checkpoints >= 3 * runs, metrics >= 1, rounds >= 5")
    targets = {"sqlite": 2.0, "postgresql": 5.0}
    refs = {"@latest": "latest", "@latest-published": "latest-published", f"@best:{BEST_KEY}": f"best:{BEST_KEY}",
            f"@best:{BEST_KEY}:max": f"best:{BEST_KEY}:max", "@tag3": "tag3",
            # worst case: every train/loss point is at a step without a checkpoint, so best: probes them all
            "@best:train/loss (miss)": "best:train/loss"}
    results: list[list[str]] = []
    plans: dict[str, dict[str, list[str]]] = {}
    wakeups: dict[str, tuple[float, float, float]] = {}
    for name in args.backends.split(","):
        with tempfile.TemporaryDirectory(prefix="regbench-") as tmp, backend(name, Path(tmp)) as url:
            catalog = Catalog.open(url)
            try:
                t0 = time.perf_counter()
                counts = build(catalog, checkpoints=args.checkpoints, runs=args.runs, metrics=args.metrics)
                load_s = time.perf_counter() - t0
                print(f"{name}: loaded {counts['checkpoints']:,} checkpoints, {counts['metrics']:,} metric points, "
                      f"{counts['tags']} tags in {load_s:.1f} s", flush=True)
                rng = random.Random(1)
                run_names = [f"run{r:03d}" for r in range(args.runs)]
                for label, selector in refs.items():
                    parsed = [parse_ref(f"{run}@{selector}") for run in run_names]
                    it = iter(range(10**12))
                    def call(catalog: Catalog = catalog, parsed: list[Ref] = parsed, it: Iterator[int] = it) -> None:
                        try:
                            catalog.resolve(parsed[next(it) % len(parsed)])
                        except CheckpointNotFoundError:
                            pass  # the "(miss)" row: finding nothing is its answer
                    api = timed(call, rounds=args.rounds, iterations=args.iterations)
                    bare = bare_query(catalog, parsed[rng.randrange(len(parsed))])
                    sel = timed(bare, rounds=args.rounds, iterations=args.iterations)
                    bare.close()  # type: ignore[attr-defined]
                    ok = "yes" if api[0] < targets[name] else "NO"
                    if "(miss)" in label:
                        ok = "(no target)"
                    results.append([name, label, f"{api[0]:.3f}", f"{api[1]:.3f}-{api[2]:.3f}", f"{sel[0]:.3f}",
                                    f"< {targets[name]:g}", ok])
                    print("  " + "  ".join(results[-1]), flush=True)
                    if not args.no_explain:
                        plans.setdefault(name, {})[label] = explain(catalog, parsed[0])
                if args.follow_samples:
                    wake = follower_wakeups(catalog, args.follow_samples)
                    start, end = [w[0] for w in wake], [w[1] for w in wake]
                    wakeups[name] = (statistics.median(start), max(start), statistics.median(end))
                    print(f"  follower wake-up: median {wakeups[name][0]:.1f} ms, max {wakeups[name][1]:.1f} ms",
                          flush=True)
            finally:
                catalog.close()
    headers = ["backend", "ref", "resolve median ms", "round medians", "SELECT only ms", "target", "met"]
    widths = [max(len(h), *(len(r[i]) for r in results)) for i, h in enumerate(headers)]
    print(f"\n{args.checkpoints:,} checkpoints, {args.runs} runs, {args.metrics} metrics per step; median of "
          f"{args.rounds} rounds x {args.iterations} calls after a warm-up (runs rotate per call)\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in results:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    if wakeups:
        print(f"\nfollower wake-up ({args.follow_samples} samples): from the start of the publish's commit "
              "transaction to wait_for_new returning, and from the commit call returning")
        for name, (median, worst, after) in wakeups.items():
            how = "LISTEN/NOTIFY" if name == "postgresql" else f"polling, backoff to {POLL_MAX_S * 1000:.0f} ms"
            print(f"  {name:<10} median {median:.1f} ms, max {worst:.1f} ms; after the call returned: median "
                  f"{after:.1f} ms  ({how})")
    for name, by_ref in plans.items():
        print(f"\nquery plans, {name}:")
        for label, lines in by_ref.items():
            print(f"  {label}")
            for line in lines:
                print(f"    {line}")
    print(f"\ncommand: ./scripts/bench queries --checkpoints {args.checkpoints} --runs {args.runs} "
          f"--metrics {args.metrics} --rounds {args.rounds} --iterations {args.iterations} --backends {args.backends}")


if __name__ == "__main__":
    main()
