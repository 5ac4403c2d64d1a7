"""Benchmark: the web view's data on a big catalog, server-side, on SQLite and on PostgreSQL.

Builds the catalog of ``bench queries`` (default 100,000 checkpoints across
100 runs, 10 metric keys per step: about 1.1M metric points) with its own
generator, opens it read-only as ``registry ui`` does, and times requests
through the ASGI app in-process (Starlette's TestClient: routing, the
queries, the downsampling and the JSON encoding; no socket, no browser):

- ``run view``: ``/api/runs/RUN/view``, everything the run page draws (every
  checkpoint of the run, the key list, one curve downsampled to ~1200
  points, the events), for the default key and for ``train/loss``;
- ``runs page``: ``/api/runs`` with ``sort_by`` (latest verified and best of
  every run);
- ``step page``: the HTML of one step.

``--runs 1`` puts every checkpoint and metric point into one run: the worst
case for the run page. Each figure is the median over ``--rounds`` of the
median of ``--iterations`` requests, after a warm-up.

Usage: ./scripts/bench ui [--checkpoints N] [--runs R] [--metrics K] [--rounds 5] [--iterations 5]
       [--backends sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from starlette.testclient import TestClient  # noqa: E402

from bench_queries import backend, build, timed  # noqa: E402
from registry import Registry  # noqa: E402
from registry.catalog import Catalog  # noqa: E402
from registry.web import create_app  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--metrics", type=int, default=10, help="metric keys per step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--backends", default="sqlite,postgresql")
    args = ap.parse_args()
    print(f"# bench ui: {args.checkpoints} checkpoints, {args.runs} runs, {args.metrics} keys per step; "
          f"median of {args.rounds} rounds x {args.iterations} requests (ms, server-side, in-process ASGI)")
    print(f"{'backend':<11} {'request':<34} {'median':>8} {'min':>8} {'max':>8} {'points':>14} {'KiB':>7}")
    for name in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp, backend(name, Path(tmp)) as url:
            catalog = Catalog.open(url)
            t0 = time.perf_counter()
            counts = build(catalog, checkpoints=args.checkpoints, runs=args.runs, metrics=args.metrics)
            catalog.close()
            print(f"# {name}: built {counts} in {time.perf_counter() - t0:.0f} s")
            root = Path(tmp) / "root"
            root.mkdir()
            Registry.open(url=url, root=root, rebind_root=True).close()  # a bulk-loaded catalog binds no root
            run = f"run{args.runs // 2:03d}"
            with Registry.open(url=url, root=root, read_only=True, create=False) as reg:
                client = TestClient(create_app(reg), base_url="http://127.0.0.1")
                requests = [("run view (eval/loss)", f"/api/runs/{run}/view"),
                            ("run view (train/loss)", f"/api/runs/{run}/view?key=train/loss"),
                            ("runs page (sort_by eval/loss)", "/api/runs?sort_by=eval/loss"),
                            ("step page (HTML)", f"/runs/{run}/steps/{(args.checkpoints // args.runs // 2) * 100}")]
                for label, path in requests:
                    response = client.get(path)
                    assert response.status_code == 200, (path, response.text[:200])
                    doc = response.json() if path.startswith("/api/") else None
                    shown = (f"{len(doc['curve']['points'])}/{doc['curve']['total_points']}"
                             if isinstance(doc, dict) and "curve" in doc else "")
                    median, low, high = timed(lambda p=path, c=client: c.get(p), rounds=args.rounds,
                                              iterations=args.iterations)
                    print(f"{name:<11} {label:<34} {median:8.1f} {low:8.1f} {high:8.1f} {shown:>14} "
                          f"{len(response.content) / 1024:7.0f}")
    print("# reproduce: ./scripts/bench ui " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
