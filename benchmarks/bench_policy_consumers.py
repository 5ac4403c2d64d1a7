"""Policy consumers at scale: catalog connections and commit -> seen latency with many consumers.

``--hosts`` processes stand for hosts, each holding ``--per-host``
subscriptions in threads (the design: one process per host, its consumers
sharing one catalog pool, one heartbeat thread and one listener). A publisher
(this process) publishes ``--versions`` small policy versions, one every
``--interval`` seconds; every consumer leases each version it sees
(``versions()``, newest only) and releases it. Each figure is the median of
``--runs`` whole runs, each on a fresh catalog.

Reported: the catalog connections held during the run (PostgreSQL:
``pg_stat_activity`` rows of this bench's processes, sampled every 100 ms,
the most seen; the publisher and the sampler included), and the latencies
the catalog recorded for every load after ``--warmup`` versions: commit ->
seen, ``notified_at - committed_at`` (from the timestamp of the transaction
that made the step verified to the query in the consumer's process that
found it: one query per process and notification, shared by its
consumers), the median over versions of the first consumer to see it, and
commit -> leased, ``leased_at - committed_at`` (the lease is one write per
consumer: this is the fan-out's cost). One process per host means one clock: the host
processes share this machine's.

    ./scripts/bench policy_consumers --url postgresql://postgres@127.0.0.1:5432/DB [--hosts 4] [--per-host 50]
    ./scripts/bench policy_consumers [--hosts 2] [--per-host 10]        # SQLite in a temporary directory
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from registry import Registry  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

RUN = "policy-bench"


def host(url: str, root: str, name: str, per_host: int, last: int) -> None:
    """One host: ``per_host`` subscriptions of one registry, each leasing every version up to ``last``."""
    with Registry.open(url=url, root=root, create=False) as reg:
        subs = [reg.subscribe(RUN, consumer=f"{name}-c{i}", ttl=60, host=name) for i in range(per_host)]
        errors: list[BaseException] = []

        def consume(sub: Any) -> None:
            try:
                for lease in sub.versions(timeout=120):
                    lease.release()
                    if lease.policy_version >= last:
                        return
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=consume, args=(s,)) for s in subs]
        print("ready", flush=True)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SystemExit(f"{name}: {errors[0]!r}")


def connections(url: str, tag: str, stop: threading.Event, seen: list[int]) -> None:
    import psycopg
    from sqlalchemy.engine import make_url
    parsed = make_url(url)
    dsn = parsed.set(drivername="postgresql").render_as_string(hide_password=False).split("?")[0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(0.1):
            seen.append(int(conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                                         (tag,)).fetchone()[0]))


def schema_url(url: str, tag: str) -> tuple[str, str]:
    """A schema of this bench's own in the database ``url`` names, and its URL; every connection is ``tag``."""
    import psycopg
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    base = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in url else "?"
    return (url.replace("postgresql://", "postgresql+psycopg://")
            + f"{sep}options=-csearch_path%3D{schema}&application_name={tag}"), schema


def bench(url: str, root: Path, *, hosts: int, per_host: int, versions: int, interval: float, warmup: int,
          tag: str | None) -> dict[str, Any]:
    with Registry.open(url=url, root=root) as reg:
        reg.publish(RUN, 0, {"w": torch.zeros(16)})  # the run exists; no version yet
        children = [subprocess.Popen([sys.executable, __file__, "--host-worker", url, str(root), f"host{h}",
                                      str(per_host), str(versions - 1)], stdout=subprocess.PIPE, text=True)
                    for h in range(hosts)]
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        seen: list[int] = []
        stop = threading.Event()
        sampler = None
        if tag is not None:
            sampler = threading.Thread(target=connections, args=(url, tag, stop, seen))
            sampler.start()
        for version in range(versions):
            reg.publish(RUN, version + 1, {"w": torch.full((16,), float(version))}, policy_version=version)
            time.sleep(interval)
        for child in children:
            if child.wait(timeout=600) != 0:
                raise SystemExit("a host process failed")
        stop.set()
        if sampler is not None:
            sampler.join()
        loads = [x for x in reg.loads(RUN) if x.version >= warmup]
    by_version: dict[int, list[float]] = {}
    leased: list[float] = []
    for x in loads:
        if x.notified_at is not None and x.committed_at is not None:
            by_version.setdefault(x.version, []).append((x.notified_at - x.committed_at).total_seconds() * 1000)
            leased.append((x.leased_at - x.committed_at).total_seconds() * 1000)
    lat = sorted(v for vs in by_version.values() for v in vs)
    leased.sort()
    return {"samples": len(lat), "p50": statistics.median(lat), "p99": p99(lat), "max": lat[-1],
            "first": statistics.median(min(vs) for vs in by_version.values()),
            "leased50": statistics.median(leased), "leased99": p99(leased), "connections": max(seen, default=None)}


def p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a PostgreSQL database (a schema of its own is made there); "
                        "default: SQLite in a temporary directory")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--per-host", type=int, default=50)
    parser.add_argument("--versions", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="versions left out of the latency figures")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two versions")
    parser.add_argument("--runs", type=int, default=5, help="whole runs; each figure is their median")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--host-worker", nargs=5, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.host_worker is not None:
        url, root, name, per_host, last = args.host_worker
        host(url, root, name, int(per_host), int(last))
        return
    load = os.getloadavg()[0]
    results = []
    for r in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="bench-policy-consumers-", dir=args.dir))
        tag = None
        try:
            if args.url is None:
                url = f"sqlite:///{work / 'catalog.db'}"
            else:
                tag = f"bench-policy-{os.getpid()}-{r}"
                url, _ = schema_url(args.url, tag)
            results.append(bench(url, work / "root", hosts=args.hosts, per_host=args.per_host,
                                 versions=args.versions, interval=args.interval, warmup=args.warmup, tag=tag))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result = {k: (None if results[0][k] is None else statistics.median(x[k] for x in results)) for k in results[0]}
    backend = "PostgreSQL" if args.url else "SQLite"
    conns = "-" if result["connections"] is None else f"{result['connections']:.0f}"
    print(f"machine: {os.cpu_count()} cores; {backend}; {args.hosts} host processes x {args.per_host} consumers "
          f"= {args.hosts * args.per_host}; {args.versions} versions every {args.interval} s, first {args.warmup} "
          f"left out; medians of {args.runs} runs; load average at start {load:.1f}")
    print("| catalog | consumers | connections held (max) | first to see it (median) "
          "| commit -> seen p50 | p99 | max | commit -> leased p50 | p99 | samples |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {backend} | {args.hosts} x {args.per_host} | {conns} | {result['first']:.1f} ms | {result['p50']:.1f} ms "
          f"| {result['p99']:.1f} ms | {result['max']:.1f} ms | {result['leased50']:.1f} ms "
          f"| {result['leased99']:.1f} ms | {result['samples']:.0f} per run |")
    print(f"\n(./scripts/bench policy_consumers{' --url URL' if args.url else ''} --hosts {args.hosts} "
          f"--per-host {args.per_host} --versions {args.versions} --interval {args.interval} --runs {args.runs})")


if __name__ == "__main__":
    main()
