"""Sharded steps on a tiered root: what the trainer waits for, and a fresh host's resume from the durable tier.

Two gloo ranks (``--world``) on this host, FSDP2 + AdamW on CPU (``bench_sharded.build``: about ``--size-mib``
of model and optimizer state, half per rank), a SeaweedFS server on loopback (or ``REGISTRY_TEST_S3_ENDPOINT``).
Each round, in a rotating order, timed from a barrier to a barrier (the slowest rank counts):

* ``fast publish``: ``publish(run, step, state, sharded=True)`` to a plain directory root (its own catalog);
* ``tiered publish``: the same publish to a directory root with a durable ``s3://`` tier: the time the call
  blocks the trainer (the step committed on the fast tier; replication then runs in the background and is
  waited for, untimed, before the next variant);
* ``resume``: a fresh host (a new, empty fast directory for the ranks, the same catalog and durable tier)
  ``load_into(run@step)``: every rank fetches the byte ranges it loads from the durable copy, each piece
  checked as it lands, DCP reshards into the template;
* ``raw resume``: what a job without the registry does on a fresh host: every rank downloads its share of the
  durable copy's files (16 MiB ranged GETs, eight at once) into one local directory, then ``dcp.load`` from
  there (no checks);
* ``hosts publish``: the same publish with each rank on a "host" of its own (its own fast directory of the same
  tiered root): each host keeps its part, the ranks replicate together in the background (waited for, untimed);
* ``hosts resume``: those same hosts ``load_into`` that step: each rank maps its host's part, the replicated
  values another host holds are sent over the group, every piece checked;
* ``local dcp.load``: ``dcp.load`` of the plain directory root's copy of the step (no registry, no checks): what a
  job that kept its shards on its own disk reads.

Ratios are the medians of per-round ratios: ``tiered / fast publish`` (goal <= 1.05), ``resume / raw resume``
(goal <= 1.15), ``hosts publish / fast publish`` and ``hosts resume / local dcp.load``.

    ./scripts/bench tiered_sharded [--size-mib 256] [--runs 5] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, s3_bench_server, settle  # noqa: E402
from bench_sharded import build  # noqa: E402

from registry import Registry  # noqa: E402

NAMES = ("fast publish", "tiered publish", "resume", "raw resume", "hosts publish", "hosts resume", "local dcp.load")
PIECE = 16 << 20


def rank_main(rank: int, port: int, args: dict[str, Any]) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(args["env"])
    world = args["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    import obstore
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = build(args["size_mib"], world)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    work = Path(args["work"])
    options = args["storage_options"]
    times: dict[str, list[float]] = {k: [] for k in NAMES}
    pool = ThreadPoolExecutor(8)

    def timed(fn: Any) -> float:
        settle()
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    with Registry.open(f"sqlite:///{work / 'plain.db'}", root=work / "plain") as plain, \
            Registry.open(f"sqlite:///{work / 'catalog.db'}", root=work / "fast", durable=args["durable"],
                          storage_options=options) as reg, \
            Registry.open(f"sqlite:///{work / 'hosts.db'}", root=work / f"host-of-rank-{rank}",
                          durable=args["durable"] + "-hosts", storage_options=options) as hosts:
        assert reg.tiers is not None
        objects = reg.tiers.durable
        for rnd in range(args["runs"] + 1):
            step = rnd + 1
            got: dict[str, float] = {}

            def fast(step: int = step) -> None:
                plain.publish("bench", step, state, sharded=True, timeout=600)

            def tiered(step: int = step) -> None:
                reg.publish("bench", step, state, sharded=True, timeout=600)

            def resume(step: int = step, rnd: int = rnd) -> None:
                with Registry.open(f"sqlite:///{work / 'catalog.db'}", root=work / f"host-{rnd}",
                                   durable=args["durable"], storage_options=options) as fresh:
                    fresh.load_into(f"bench@{step}", state, timeout=600)

            def raw(step: int = step, rnd: int = rnd) -> None:
                dest = work / f"raw-{rnd}"
                copy = reg.replicas("bench", step)
                prefix = next(c.path for c in copy if c.location == "durable" and c.status == "verified")
                listed = sorted((e.rel, e.size) for e in objects.list(prefix))
                dest.mkdir(exist_ok=True)
                fds = {key: os.open(dest / key.rsplit("/", 1)[-1], os.O_WRONLY | os.O_CREAT, 0o644)
                       for key, _ in listed[rank::world]}

                def one(job: tuple[str, int, int]) -> None:
                    key, start, end = job
                    os.pwrite(fds[key], bytes(obstore.get_range(objects.store, key, start=start, end=end)), start)
                try:  # 16 MiB ranged GETs in parallel, as the registry's reader fetches
                    list(pool.map(one, [(key, start, min(size, start + PIECE)) for key, size in listed[rank::world]
                                        for start in range(0, size, PIECE)]))
                finally:
                    for fd in fds.values():
                        os.close(fd)
                dist.barrier()  # every rank's files are there before any reads them
                dcp.load(state, checkpoint_id=dest)

            def on_hosts(step: int = step) -> None:
                hosts.publish("bench", step, state, sharded=True, timeout=600)

            def hosts_resume(step: int = step) -> None:
                hosts.load_into(f"bench@{step}", state, timeout=600)

            def local(step: int = step) -> None:
                dcp.load(state, checkpoint_id=plain.resolve(f"bench@{step}").path)

            order = [("fast publish", fast), ("tiered publish", tiered), ("hosts publish", on_hosts)]
            order = order[rnd % 3:] + order[:rnd % 3]
            for name, fn in order:
                got[name] = timed(fn)
                if name in ("tiered publish", "hosts publish"):
                    if rank == 0:
                        (reg if name == "tiered publish" else hosts).wait_durable("bench", step, timeout=600)
                    dist.barrier()
            reads = [("resume", resume), ("raw resume", raw), ("hosts resume", hosts_resume),
                     ("local dcp.load", local)]
            for name, fn in reads[rnd % 4:] + reads[:rnd % 4]:
                got[name] = timed(fn)
            if rank == 0:
                shutil.rmtree(work / f"raw-{rnd}", ignore_errors=True)
                shutil.rmtree(work / f"host-{rnd}", ignore_errors=True)
            dist.barrier()
            if rnd > 0:  # the first round warms up
                for name, seconds in got.items():
                    times[name].append(seconds)
    (work / f"rank{rank}.json").write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="model + optimizer state, all ranks together")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--world", type=int, default=2, help="ranks on this host")
    parser.add_argument("--dir", default=None, help="where the server's data, the roots and the catalogs go")
    opts = parser.parse_args()
    from tests import s3server
    work = Path(tempfile.mkdtemp(prefix="bench-tiered-sharded-", dir=opts.dir))
    server = None
    load0 = os.getloadavg()
    try:
        server = s3_bench_server(work)
        bucket = s3server.new_bucket(server)
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        args = {"size_mib": opts.size_mib, "runs": opts.runs, "world": opts.world, "work": str(work),
                "durable": f"s3://{bucket}/bench", "storage_options": server.storage_options, "env": env}
        mp.start_processes(rank_main, args=(free_port(), args), nprocs=opts.world, start_method="spawn")
        times = json.loads((work / "rank0.json").read_text())
    finally:
        if server is not None and getattr(server, "process", None) is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n./scripts/bench tiered_sharded --size-mib {opts.size_mib} --runs {opts.runs} --world {opts.world}")
    print(f"{opts.world} gloo ranks on one host, FSDP2 + AdamW, about {opts.size_mib} MiB of state; SeaweedFS on "
          f"loopback; median of {opts.runs} rounds after a warm-up; load average {load0[0]:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end\n")
    print("| variant | median s |")
    print("|---|---:|")
    for name in NAMES:
        print(f"| {name} | {statistics.median(times[name]):.3f} |")
    print("\n| ratio (within each round) | median | goal |")
    print("|---|---:|---:|")
    for (a, b), goal in ((("tiered publish", "fast publish"), "<= 1.05x"), (("resume", "raw resume"), "<= 1.15x"),
                         (("hosts publish", "fast publish"), "-"), (("hosts resume", "local dcp.load"), "-")):
        ratio = statistics.median(x / y for x, y in zip(times[a], times[b]))
        print(f"| {a} / {b} | {ratio:.2f}x | {goal} |")


if __name__ == "__main__":
    main()
