"""Sharded publish and load benchmark: 2 ranks (``--world``) on gloo (127.0.0.1), FSDP2 + AdamW on CPU, one run.

The state is a stack of ``Linear(d, d)`` layers sharded with ``fully_shard``
over both ranks, plus AdamW's two moments after one step: about
``--size-mib`` of model and optimizer in total, half per rank. Variants,
each timed from a barrier to a barrier (the slowest rank counts), run
round-robin in an order rotated every round, median of ``--repeats`` after
one warm-up:

* publish/ours: ``reg.publish(run, step, state, sharded=True)`` (claim, hashed
  and fsync'd DCP files, manifest, rename, commit);
* publish/async: the same with ``blocking=False``, timed until the call
  returns (the copy into the reused arena; the publish then completes before
  the next variant);
* publish/dcp: ``dcp.save`` of the same state with DCP's own writer and
  ``sync_files=True`` into a fresh directory (no catalog, no checksums);
* publish/dcp-async: ``dcp.async_save`` of the same, timed until the call
  returns (its collectives run on a group of their own; the save completes
  before the next variant);
* hash/sha256: every rank computes the sha256 of its own shard's bytes on
  one core (one thread per rank, both ranks at once), the other half of the
  publish floor: a publish must hash every byte, so it can be no faster than
  max(publish/dcp, hash/sha256);
* publish/gather: the way without sharding: ``get_state_dict`` with
  ``full_state_dict=True, cpu_offload=True`` onto rank 0, then a full
  ``reg.publish`` of the flat tensors (non-tensor values as an extra);
* load/ours: ``reg.load_into(ref, template)`` (rank 0 resolves and leases,
  every rank checks half the pieces, DCP reshards into the template);
* load/ours-unverified: the same with ``verify=False`` (``.metadata`` is still checked);
* load/dcp: ``dcp.load(template, checkpoint_id=...)`` of the same files.

The page cache is warm (the files were just written). Peak RSS growth of
each rank during one publish/ours is read from ``/proc/self/status`` (VmHWM
after resetting it) and compared with the rank's shard of the state.

Each rank writes (and hashes) as many files at once as it has cores to
itself (``write_threads``: cores // ranks on the host, at most 8); the
header says how many. ``--world 1`` runs one rank alone (all cores its own),
``--only publish`` keeps only the publish variants and the sha256 floor (no
loads or gather between them), which separates what two ranks on two cores
cost from what the other variants leave behind.

Usage: ./scripts/bench sharded [--size-mib 1024] [--repeats 5] [--world 2] [--only publish]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import free_port, rss_kib, settle  # noqa: E402

from registry import Registry  # noqa: E402

WORK = Path(__file__).resolve().parents[1] / ".bench" / "sharded"
D = 1024


def build(size_mib: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    layers = max(1, (size_mib << 20) // (3 * 4 * (D * D + D)))  # params, exp_avg, exp_avg_sq in fp32
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(D, D) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, D)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def local_bytes(state: Any) -> int:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor
    flat, _ = flatten_state_dict(state)
    total = 0
    for v in flat.values():
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def rank_main(rank: int, port: int, args: dict[str, Any]) -> None:
    warnings.simplefilter("ignore")
    world = args["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from registry.fs.dcpfiles import write_threads
    here = os.environ.get("LOCAL_WORLD_SIZE", "")  # how the publish counts the ranks sharing this host's cores
    async_group = dist.new_group(backend="gloo")  # dcp.async_save's collectives run beside the barriers
    model, opt = build(args["size_mib"], world)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    root = Path(args["work"])
    counter = iter(range(1, 10**6))
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # this rank's CPU seconds (all its threads), which load does not inflate
    pending: list[Any] = []  # a dcp.async_save future, waited for after its timed call returned

    with Registry.open(url=f"sqlite:///{root / 'catalog.db'}", root=root / "ckpt") as reg:
        def clean(path: Path) -> None:
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)

        def publish_ours() -> Callable[[], None]:
            step = next(counter)
            return lambda: reg.publish("ours", step, state, sharded=True, timeout=600)

        def publish_async() -> Callable[[], None]:
            step = next(counter)
            return lambda: reg.publish("ours", step, state, sharded=True, timeout=600, blocking=False) and None

        def publish_dcp() -> Callable[[], None]:
            path = root / f"dcp-{next(counter)}"
            return lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))

        def publish_dcp_async() -> Callable[[], None]:
            path = root / f"dcp-{next(counter)}"
            return lambda: pending.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(
                path, sync_files=True), process_group=async_group))

        def hash_sha256() -> Callable[[], None]:
            from torch.distributed.tensor import DTensor
            flat, _ = flatten_state_dict(state)
            local = [(v.to_local() if isinstance(v, DTensor) else v) for v in flat.values()]
            views = [memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")
                     for t in local if isinstance(t, torch.Tensor) and t.numel()]

            def run() -> None:
                digest = hashlib.sha256()
                for view in views:
                    digest.update(view)
            return run

        def publish_gather() -> Callable[[], None]:
            step = next(counter)

            def run() -> None:
                m, o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if rank == 0:
                    flat, _ = flatten_state_dict({"model": m, "optim": o})
                    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
                    rest = {k: v for k, v in flat.items() if k not in tensors}
                    reg.publish("gather", step, tensors, extra={"rest": rest})
            return run

        reg.publish("load", 1, state, sharded=True, timeout=600)
        load_dir = reg.resolve("load@1").path if rank == 0 else None
        shared = [str(load_dir)]
        dist.broadcast_object_list(shared, src=0)
        load_path = Path(shared[0])

        def load_ours() -> Callable[[], None]:
            return lambda: reg.load_into("load@1", state, timeout=600)

        def load_unverified() -> Callable[[], None]:
            return lambda: reg.load_into("load@1", state, timeout=600, verify=False)

        def load_dcp() -> Callable[[], None]:
            return lambda: dcp.load(state, checkpoint_id=load_path)

        variants = {"publish/ours": publish_ours, "publish/async": publish_async, "publish/dcp": publish_dcp,
                    "publish/dcp-async": publish_dcp_async, "hash/sha256": hash_sha256,
                    "publish/gather": publish_gather,
                    "load/ours": load_ours, "load/ours-unverified": load_unverified, "load/dcp": load_dcp}
        if args["only"] == "publish":  # the publish and its floor alone, no loads or gather between them
            variants = {k: v for k, v in variants.items() if k.startswith(("publish/", "hash/"))
                        and k != "publish/gather"}
        names = list(variants)
        for i in range(args["repeats"] + 1):
            # rotate the order each round: no variant always runs right after the biggest allocation or deletion
            for name in names[i % len(names):] + names[:i % len(names)]:
                make = variants[name]
                fn = make()
                settle()
                dist.barrier()
                t0, cpu0 = time.perf_counter(), time.process_time()
                fn()
                dist.barrier()
                if i > 0:
                    times.setdefault(name, []).append(time.perf_counter() - t0)
                    cpu.setdefault(name, []).append(time.process_time() - cpu0)
                reg.wait()  # a background publish commits before the next variant runs
                while pending:
                    pending.pop().result()
                dist.barrier()
                for old in (root / "ckpt" / "ours", root / "ckpt" / "gather"):
                    clean(old)
                for old in root.glob("dcp-*"):
                    clean(old)
                dist.barrier()

        Path("/proc/self/clear_refs").write_text("5")
        base = rss_kib("VmRSS")
        reg.publish("ours", next(counter), state, sharded=True, timeout=600)
        growth = rss_kib("VmHWM") - base
    (root / f"rank{rank}.json").write_text(json.dumps({
        "times": {k: statistics.median(v) for k, v in times.items()}, "rounds": times,
        "cpu": {k: statistics.median(v) for k, v in cpu.items()}, "peak_kib": growth,
        "shard_bytes": local_bytes(state), "write_threads": write_threads(int(here) if here.isdigit() else world),
        "torch_threads": torch.get_num_threads(), "cores": len(os.sched_getaffinity(0))}))
    dist.barrier()
    dist.destroy_process_group()


def measure(*, size_mib: int, repeats: int, world: int = 2, only: str | None = None) -> list[dict[str, Any]]:
    """Run ``world`` ranks; each rank's medians (``times``), seconds per round (``rounds``) and setup."""
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    args = {"size_mib": size_mib, "repeats": repeats, "work": str(WORK), "world": world, "only": only}
    try:
        mp.start_processes(rank_main, args=(free_port(), args), nprocs=world, start_method="spawn")
        return [json.loads((WORK / f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024, help="model + optimizer state, all ranks together")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--world", type=int, default=2, help="ranks on this host (1: one rank alone)")
    parser.add_argument("--only", choices=["publish"], default=None,
                        help="publish: only the publish variants and the sha256 floor (no loads, no gather)")
    opts = parser.parse_args()
    load0 = os.getloadavg()
    ranks = measure(size_mib=opts.size_mib, repeats=opts.repeats, world=opts.world, only=opts.only)
    t = ranks[0]["times"]
    only = f" --only {opts.only}" if opts.only else ""
    print(f"\n./scripts/bench sharded --size-mib {opts.size_mib} --repeats {opts.repeats} --world {opts.world}{only}")
    print(f"{opts.world} rank(s), gloo on 127.0.0.1, FSDP2 + AdamW, {sum(r['shard_bytes'] for r in ranks) / 2**20:.0f} "
          f"MiB of model and optimizer state; median of {opts.repeats} after a warm-up, seconds")
    print(f"{ranks[0]['cores']} cores; per rank: {ranks[0]['write_threads']} file(s) written and hashed at once, "
          f"{ranks[0]['torch_threads']} torch threads; load average {load0[0]:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end\n")
    print("| variant | median s | ratio |")
    print("|---|---:|---:|")
    print(f"| publish/ours | {t['publish/ours']:.3f} | |")
    print(f"| publish/async (blocking=False: until the call returns) | {t['publish/async']:.3f} | "
          f"{t['publish/async'] / t['publish/ours']:.2f}x of a blocking publish |")
    print(f"| publish/dcp (dcp.save + fsync) | {t['publish/dcp']:.3f} | ours = "
          f"{t['publish/ours'] / t['publish/dcp']:.2f}x dcp (goal <= 1.10x) |")
    print(f"| publish/dcp-async (dcp.async_save: until the call returns) | {t['publish/dcp-async']:.3f} | "
          f"ours async = {t['publish/async'] / t['publish/dcp-async']:.2f}x |")
    floor = max(t["publish/dcp"], t["hash/sha256"])
    print(f"| hash/sha256 (each rank its shard, one core) | {t['hash/sha256']:.3f} | |")
    print(f"| floor = max(dcp.save + fsync, sha256) | {floor:.3f} | ours = {t['publish/ours'] / floor:.2f}x "
          "the floor |")
    if "publish/gather" in t:
        print(f"| publish/gather (full state on rank 0 + full publish) | {t['publish/gather']:.3f} | ours "
              f"{t['publish/gather'] / t['publish/ours']:.2f}x faster (goal >= 1.5x) |")
    if "load/ours" in t:
        print(f"| load/ours (load_into) | {t['load/ours']:.3f} | |")
        print(f"| load/ours-unverified (load_into, verify=False) | {t['load/ours-unverified']:.3f} | "
              f"{t['load/ours-unverified'] / t['load/dcp']:.2f}x dcp |")
        print(f"| load/dcp (dcp.load) | {t['load/dcp']:.3f} | ours = {t['load/ours'] / t['load/dcp']:.2f}x dcp "
              "(goal <= 1.10x) |")
    print("\nCPU seconds per rank, median (all of a rank's threads; with fewer free cores than busy threads a "
          "publish costs the sum of its parts):")
    for name in ("publish/ours", "publish/dcp", "hash/sha256", "publish/async", "publish/dcp-async"):
        print(f"  {name}: " + ", ".join(f"rank {r} {got['cpu'][name]:.2f}" for r, got in enumerate(ranks)))
    rounds = ranks[0]["rounds"]
    print("\nper-round publish/ours / publish/dcp: " + " ".join(
        f"{a / b:.2f}" for a, b in zip(rounds["publish/ours"], rounds["publish/dcp"])))
    for r, got in enumerate(ranks):
        print(f"\nrank {r}: peak RSS growth during one publish/ours: {got['peak_kib'] / 1024:.1f} MiB = "
              f"{100 * got['peak_kib'] * 1024 / got['shard_bytes']:.1f}% of its {got['shard_bytes'] / 2**20:.0f} MiB "
              "shard (goal < 10%)")


if __name__ == "__main__":
    main()
