"""Lineage, diff and dedup: what they cost.

- ``diff`` of two steps of ``--mib`` MiB (fp32 tensors of ``--tensor-mib``
  MiB each) that differ in one element of one tensor, against a full verified
  ``load`` of one of them: each round times one load, then five diffs; shown
  are the median load, the median first diff after a load (and its ratio to
  the median load), the median over rounds of (median of the round's five
  diffs / the round's load), and the bytes diff read (of both steps).
- ``lineage`` of a chain ``--depth`` hops deep (rows inserted directly, as
  a long resume history leaves them), timed on the catalog: median ms and
  the number of SQL statements one call runs.
- ``dedup``: at ``--dedup-mib`` (default 512), a publish whose weights a
  live step holds (a hit: linked, nothing written), one whose weights
  differ from every live step's (a miss) and one that differs only in its
  last piece, each against a publish with dedup off, in the same rounds.

Reads come from the page cache for every variant alike (the files were just
written); medians of ``--runs`` rounds after one warm-up round.

    ./scripts/bench lineage [--mib 1024] [--depth 1000] [--runs 5] [--dedup-mib 512] [--url URL] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import settle  # noqa: E402
from registry import Registry  # noqa: E402
from registry.catalog.lineage import LineageCatalog  # noqa: E402
from registry.retention import KeepLast  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def state_of(mib: int, tensor_mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, mib // tensor_mib)
    return {f"layers.{i:04d}.weight": torch.randn(tensor_mib << 18, generator=g) for i in range(n)}


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def publish_diff_pair(reg: Registry, mib: int, tensor_mib: int) -> str:
    """Publish ``diff@1`` and ``diff@2``, which differ in one element of one tensor; that tensor's name."""
    a = state_of(mib, tensor_mib)
    b = dict(a)
    name = sorted(a)[len(a) // 2]
    b[name] = a[name].clone()
    b[name][12345] += 1.0
    reg.publish("diff", 1, a)
    reg.publish("diff", 2, b)
    return name


def bench_diff(reg: Registry, mib: int, tensor_mib: int, runs: int) -> list[str]:
    name = publish_diff_pair(reg, mib, tensor_mib)
    diffs, loads, ratios, read = [], [], [], []
    for r in range(runs + 1):
        load = timed(lambda: reg.load("diff@2", verify=True))
        once = [timed(lambda: reg.diff("diff@1", "diff@2")) for _ in range(5)]
        d = reg.diff("diff@1", "diff@2")
        assert [t.name for t in d.tensors] == [name], d.tensors
        if r == 0:
            continue  # warm-up
        diffs.append(once[0])
        loads.append(load)
        ratios.append(statistics.median(once) / load)
        read.append(d.bytes_read / d.bytes_total)
    values = timed(lambda: reg.diff("diff@1", "diff@2", values=True))
    total = reg.resolve("diff@1").total_bytes
    return ["", f"### diff: two {total / 2**20:.0f} MiB steps, one tensor of {tensor_mib} MiB differs in one element",
            "", "| variant | median s | x verified load |", "|---|---:|---:|",
            f"| load(verify=True) of one step | {statistics.median(loads):.3f} | 1 |",
            f"| diff, first call after the load | {statistics.median(diffs):.4f} | "
            f"{statistics.median(diffs) / statistics.median(loads):.4f} |",
            f"| diff, median of 5 calls | | {statistics.median(ratios):.4f} |",
            f"| diff --values (one run) | {values:.3f} | |",
            "", f"diff read {statistics.median(read) * 100:.2f}% of the bytes of both steps "
            f"({max(read) * 100:.2f}% at most over the rounds)."]


def build_chain(reg: Registry, depth: int) -> None:
    """``depth`` steps of run ``deep``, each resumed from the one before: the rows a long history leaves."""
    from sqlalchemy import insert, select

    from registry.catalog.models import Attempt, CheckpointRow, Lineage, Run
    now = datetime.now(timezone.utc)

    def fn(conn):  # type: ignore[no-untyped-def]
        run_id = conn.execute(insert(Run).values(name="deep", created_at=now).returning(Run.c.id)).scalar_one()
        conn.execute(insert(Attempt), [{"id": 10_000 + s, "run_id": run_id, "writer": "bench",
                                        "resumed_from": s - 1 if s else None, "started_at": now}
                                       for s in range(depth + 1)])
        conn.execute(insert(CheckpointRow), [
            {"run_id": run_id, "step": s, "status": "verified", "path": f"deep/step-{s:08d}", "writer": "bench",
             "attempt_id": 10_000 + s, "epoch": 0, "consumed_samples": 0, "manifest_sha256": f"{s:064x}",
             "total_bytes": 0, "created_at": now, "updated_at": now, "published_at": now}
            for s in range(depth + 1)])
        ids = dict(conn.execute(select(CheckpointRow.c.step, CheckpointRow.c.id)
                                .where(CheckpointRow.c.run_id == run_id)).all())
        conn.execute(insert(Lineage), [
            {"checkpoint_id": ids[s], "how": "resumed" if s else "started", "parent_run": "deep" if s else None,
             "parent_step": s - 1 if s else None, "parent_manifest_sha256": f"{s - 1:064x}" if s else None,
             "parent_checkpoint_id": ids[s - 1] if s else None}
            for s in range(depth + 1)])
    reg.catalog.write(fn)


def bench_lineage(reg: Registry, depth: int, runs: int) -> list[str]:
    from sqlalchemy import event
    build_chain(reg, depth)
    chain = LineageCatalog(reg.catalog)
    statements: list[str] = []

    def count(*args: object) -> None:
        statements.append(str(args[2]))
    engines = {reg.catalog.engine, reg.catalog._read_engine}
    for engine in engines:
        event.listen(engine, "before_cursor_execute", count)
    hops = chain.chain("deep", depth)
    for engine in engines:
        event.remove(engine, "before_cursor_execute", count)
    assert len(hops) == depth + 1, len(hops)
    statements = [s for s in statements if not s.lstrip().upper().startswith(("BEGIN", "PRAGMA"))]
    times = [timed(lambda: reg.lineage(f"deep@{depth}")) for _ in range(max(runs, 20) + 1)][1:]
    return ["", f"### lineage: a chain {depth} hops deep ({reg.catalog.dialect})", "",
            f"`reg.lineage('deep@{depth}')`: median {statistics.median(times) * 1e3:.1f} ms, "
            f"max {max(times) * 1e3:.1f} ms over {len(times)} calls; the chain itself is "
            f"{len(statements)} SQL statement(s)."]


def bench_dedup(reg: Registry, mib: int, tensor_mib: int, runs: int) -> list[str]:
    """Same-run ratios of dedup hits and misses against a publish with dedup off (fresh bytes, same size).

    Run ``dd`` holds the weights ``same`` at step 0; each round publishes
    into it, in this order, a *late miss* (only the last tensor of the file
    differs from ``same``: every piece but the last matches, so the whole
    file is hashed in memory before the miss is known), a *miss* (every
    tensor differs from every live step's, as after a training step: told by
    the first piece) and a *hit* (``same`` again; its fallback neighbour is
    the miss, so it links to the previous hit's copy). ``plain`` (dedup off,
    fresh bytes) runs before or after that group, alternately. Wall and CPU
    seconds (the process, all threads: the work done, whatever the machine's
    load) are both reported, each as the median of per-round ratios.
    """
    same = state_of(mib, tensor_mib)
    names = sorted(same)  # one dtype: the file holds the tensors in name order
    miss = {k: v.clone() for k, v in same.items()}
    plain = {k: v.clone() for k, v in same.items()}
    late = {**same, names[-1]: same[names[-1]].clone()}
    reg.publish("dd", 0, same, dedup=True)
    wall: dict[str, list[float]] = {"plain": [], "late": [], "miss": [], "hit": []}
    cpu: dict[str, list[float]] = {k: [] for k in wall}
    probe: dict[str, list[float]] = {k: [] for k in wall}  # seconds spent looking for the file before writing
    steps = iter(range(1, 1_000_000))
    looked: list[float] = []
    try:
        from registry.ops.protocol import HeldSources
    except ImportError:  # a tree from before dedup looked before writing
        HeldSources = None  # type: ignore[assignment,misc]  # noqa: N806
    if HeldSources is not None:
        real_link = HeldSources.link

        def timed_link(self: Any, *args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real_link(self, *args)
            finally:
                looked.append(time.perf_counter() - t0)
        HeldSources.link = timed_link  # type: ignore[method-assign,assignment]

    def measured(fn: Callable[[], object]) -> tuple[float, float, float]:
        looked.clear()
        settle()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0, sum(looked)

    def group(r: int) -> dict[str, tuple[float, float, float]]:
        late[names[-1]][-1] = 1e6 + r
        for t in miss.values():
            t[0] = 2e6 + r
        out = {"late": measured(lambda: reg.publish("dd", next(steps), late, dedup=True)),
               "miss": measured(lambda: reg.publish("dd", next(steps), miss, dedup=True))}
        step = next(steps)
        out["hit"] = measured(lambda: reg.publish("dd", step, same, dedup=True))
        linked = reg.events("dd", step=step)[-1].detail.get("linked_bytes", 0)
        assert linked, f"dd@{step} was not linked"
        return out

    def fresh(r: int) -> dict[str, tuple[float, float, float]]:
        for t in plain.values():
            t[0] = 3e6 + r
        return {"plain": measured(lambda: reg.publish("plain", r, plain))}

    for r in range(runs + 1):
        found = {**fresh(r), **group(r)} if r % 2 == 0 else {**group(r), **fresh(r)}
        reg.apply_retention("plain", KeepLast(2))
        reg.apply_retention("dd", KeepLast(4))  # the last hit keeps the linked copy; the next hit links it
        if r:
            for k, (w, c, p) in found.items():
                wall[k].append(w)
                cpu[k].append(c)
                probe[k].append(p)
    if HeldSources is not None:
        HeldSources.link = real_link  # type: ignore[method-assign]

    def ratio(times: dict[str, list[float]], a: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times["plain"]))
    nlink = os.stat(reg.resolve("dd@latest").path / "model.safetensors").st_nlink
    rows = [("plain", "publish, dedup off (fresh bytes)"), ("miss", "dedup on, a miss (every tensor changed)"),
            ("late", "dedup on, a late miss (only the last piece differs)"),
            ("hit", "dedup on, a hit (linked, nothing written)")]
    return ["", f"### dedup: publishing {mib} MiB of weights ({len(same)} tensors), {runs} rounds", "",
            "| variant | median s | / publish, dedup off | CPU s | CPU / publish, dedup off | looking, ms |",
            "|---|---:|---:|---:|---:|---:|",
            *(f"| {label} | {statistics.median(wall[k]):.3f} | {ratio(wall, k):.3f} | "
              f"{statistics.median(cpu[k]):.3f} | {ratio(cpu, k):.3f} | {statistics.median(probe[k]) * 1e3:.1f} |"
              for k, label in rows), "",
            "(looking: the time spent finding and comparing a candidate before writing, inside the publish; "
            "on a miss, what dedup adds to it)", "",
            f"dedup hit / fresh publish {ratio(wall, 'hit'):.3f} (goal <= 0.5); dedup miss / dedup off "
            f"{ratio(wall, 'miss'):.3f} (goal <= 1.02); what a miss adds, looking / publish with dedup off: "
            f"{statistics.median(p / w for p, w in zip(probe['miss'], wall['plain'])):.2%} (a late miss "
            f"{statistics.median(p / w for p, w in zip(probe['late'], wall['plain'])):.2%}); "
            f"the last hit's weights file has {nlink} links."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=int(os.environ.get("REGISTRY_BENCH_MIB", "1024")))
    parser.add_argument("--tensor-mib", type=int, default=16)
    parser.add_argument("--depth", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--url", default=None, help="catalog URL for the lineage part (default: SQLite)")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--dedup-mib", type=int, default=512)
    parser.add_argument("--only", choices=("diff", "lineage", "dedup"), default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-lineage-", dir=args.dir))
    lines = [f"machine: {os.cpu_count()} cores, torch {torch.__version__}; medians of {args.runs} rounds after "
             "a warm-up"]
    try:
        with Registry.open(url=f"sqlite:///{work / 'catalog.db'}", root=work / "root") as reg:
            if args.only in (None, "diff"):
                lines += bench_diff(reg, args.mib, args.tensor_mib, args.runs)
            if args.only in (None, "dedup"):
                lines += bench_dedup(reg, args.dedup_mib, args.tensor_mib, args.runs)
        if args.only in (None, "lineage"):
            url = args.url or f"sqlite:///{work / 'lineage.db'}"
            with Registry.open(url=url, root=work / "lineage-root") as reg:
                lines += bench_lineage(reg, args.depth, args.runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    print(f"\n(./scripts/bench lineage --mib {args.mib} --depth {args.depth} --runs {args.runs} "
          f"--dedup-mib {args.dedup_mib})")


if __name__ == "__main__":
    main()
