"""Distributed load benchmark: 2 ranks on gloo (127.0.0.1), all variants in one run.

Cases: a transformer-shaped fp32 state dict (~1 GiB by default, a few hundred
tensors) and 2,000 small tensors. Variants, each timed from a barrier to a
barrier (so the slowest rank counts), median of --repeats after one warm-up:

* ours/broadcast: ``reg.load(ref, broadcast=True, strategy="broadcast")``,
  with and without ``verify`` (catalog lookup and lease included);
* reference: the reference module's algorithm, written out here: rank 0 loads
  with ``safetensors.torch.load_file``, ``broadcast_object_list`` for
  meta/config and the tensor specs, then one ``dist.broadcast`` per tensor;
* floor: rank 0 memory-maps the weights file and sends its bytes in ONE flat
  broadcast into a buffer the other rank allocated ahead;
* ours/shared-fs vs a plain local mmap load (each rank maps the file and
  views the tensors): both then copy every tensor into a preallocated model
  (what ``load_state_dict`` does), since a lazy map alone touches no bytes.

The page cache is warm for every variant (the files were just written).
Variants run round-robin (one of each per repetition) so that load from other
users of a shared machine falls on all of them alike. Peak RSS growth of each
rank during one ``ours/broadcast`` load of the big case
is read from ``/proc/self/status`` (VmHWM after resetting it).

Usage: ./scripts/bench distributed [--size-mib 1024] [--small 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import free_port, rss_kib, small_state, transformer_state  # noqa: E402

from registry import Registry  # noqa: E402

WORK = Path(__file__).resolve().parents[1] / ".bench" / "distributed"


# --------------------------------------------------------------------------- baselines


def reference_load(path: Path) -> dict[str, torch.Tensor]:
    """The reference module's broadcast load: rank 0 loads, one collective per tensor."""
    import safetensors.torch as st
    rank = dist.get_rank()
    meta_config = [json.loads((path / "meta.json").read_text()), json.loads((path / "config.json").read_text())] \
        if rank == 0 else [None, None]
    dist.broadcast_object_list(meta_config, src=0)
    if rank == 0:
        state = st.load_file(str(path / "model.safetensors"))
        specs = [(k, list(state[k].shape), str(state[k].dtype).split(".")[-1]) for k in sorted(state)]
    else:
        state, specs = {}, []
    box = [specs]
    dist.broadcast_object_list(box, src=0)
    for key, shape, dtype_name in box[0]:
        tensor = state[key].contiguous() if rank == 0 else torch.empty(shape, dtype=getattr(torch, dtype_name))
        dist.broadcast(tensor, src=0)
        state[key] = tensor
    return state


def floor_load(path: Path) -> torch.Tensor:
    """One flat broadcast of the weights file's bytes from an mmap on rank 0."""
    size = torch.tensor([(path / "model.safetensors").stat().st_size if dist.get_rank() == 0 else 0])
    dist.broadcast(size, src=0)
    if dist.get_rank() == 0:
        with open(path / "model.safetensors", "rb") as f:
            buf = torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return buf


def plain_mmap_load(path: Path) -> dict[str, torch.Tensor]:
    """What any single process can do: map the file, view each tensor in it."""
    from registry.format.safetensors import read_safetensors_header
    file = path / "model.safetensors"
    with open(file, "rb") as f:
        header = read_safetensors_header(f, os.fstat(f.fileno()).st_size, file)
        buf = torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    start = header.data_start
    return {e.name: buf[start + e.begin:start + e.end].view(e.dtype).reshape(e.shape) for e in header.entries}


# --------------------------------------------------------------------------- ranks


def peak_rss_reset() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rank_main(rank: int, port: int, args: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    url = args["url"] if rank == 0 else f"sqlite:///{WORK / f'empty-{rank}.db'}"
    results: dict[str, Any] = {}
    root = args["root"] if rank == 0 else str(WORK / f"empty-root-{rank}")  # a root belongs to one catalog
    with Registry.open(url=url, root=root) as reg:
        for case in ("small", "big"):
            ref, path = f"{case}@1", Path(args["paths"][case])
            repeats = args["repeats"]
            model = {k: v.clone().zero_() for k, v in plain_mmap_load(path).items()}

            def consume(state: dict[str, torch.Tensor], model: dict[str, torch.Tensor] = model) -> None:
                for k, v in state.items():
                    model[k].copy_(v)

            variants: dict[str, Callable[[], Any]] = {
                "ours/broadcast": lambda ref=ref: reg.load(ref, broadcast=True, strategy="broadcast", verify=False),
                "ours/broadcast+verify": lambda ref=ref: reg.load(ref, broadcast=True, strategy="broadcast"),
                "reference (per tensor)": lambda path=path: reference_load(path),
                "floor (flat broadcast)": lambda path=path: floor_load(path),
                "ours/shared-fs": lambda ref=ref, consume=consume: consume(
                    reg.load(ref, broadcast=True, strategy="shared-fs", verify=False).state_dict),
                "ours/shared-fs+verify": lambda ref=ref, consume=consume: consume(
                    reg.load(ref, broadcast=True, strategy="shared-fs").state_dict),
                "plain local mmap": lambda path=path, consume=consume: consume(plain_mmap_load(path)),
            }
            # round-robin over the variants, so that load from other users of the machine
            # falls on all of them alike rather than on whichever ran during a busy spell
            times: dict[str, list[float]] = {name: [] for name in variants}
            for i in range(repeats + 1):
                for name, fn in variants.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    out = fn()
                    dist.barrier()
                    elapsed = time.perf_counter() - t0
                    del out
                    gc.collect()
                    if i:
                        times[name].append(elapsed)
            results.update({f"{case}:{name}": t for name, t in times.items()})
            if case == "big":
                gc.collect()
                base = rss_kib("VmRSS")
                ok = peak_rss_reset()
                dist.barrier()
                out = reg.load(ref, broadcast=True, strategy="broadcast", verify=False)
                dist.barrier()
                results["peak_rss_growth_kib"] = (rss_kib("VmHWM") - base) if ok else None
                results["rss_anon_kib"] = rss_kib("RssAnon")
                del out
            del model
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(args["out"]).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def measure(*, size_mib: int, small: int, repeats: int) -> tuple[list[dict[str, Any]], dict[str, tuple[int, int]]]:
    """Publish both cases, run the two ranks; each rank's results (``case:variant`` -> seconds per round) and
    each case's (tensors, bytes)."""
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    url, root = f"sqlite:///{WORK / 'catalog.db'}", WORK / "ckpt"
    sizes = {}
    with Registry.open(url=url, root=root) as reg:
        paths = {}
        for case, state in (("small", small_state(small)), ("big", transformer_state(size_mib))):
            info = reg.publish(case, 1, state, config={"case": case})
            paths[case] = str(info.path)
            sizes[case] = (len(state), sum(t.numel() * t.element_size() for t in state.values()))
            del state
    out = WORK / "results.json"
    args = {"url": url, "root": str(root), "paths": paths, "repeats": repeats, "out": str(out)}
    try:
        mp.start_processes(rank_main, args=(free_port(), args), nprocs=2, start_method="spawn")
        return json.loads(out.read_text()), sizes
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=int(os.environ.get("BENCH_DIST_MIB", "1024")))
    parser.add_argument("--small", type=int, default=int(os.environ.get("BENCH_DIST_SMALL", "2000")))
    parser.add_argument("--repeats", type=int, default=int(os.environ.get("BENCH_DIST_REPEATS", "5")))
    opts = parser.parse_args()
    ranks, sizes = measure(size_mib=opts.size_mib, small=opts.small, repeats=opts.repeats)
    cmd = (f"./scripts/bench distributed --size-mib {opts.size_mib} --small {opts.small} "
           f"--repeats {opts.repeats}")
    print(f"\n{cmd}\n2 ranks, gloo on 127.0.0.1, median of {opts.repeats} after a warm-up, seconds "
          "(slowest rank, barrier to barrier)\n")
    for case in ("small", "big"):
        n, nbytes = sizes[case]
        times = {k.split(":", 1)[1]: statistics.median(v) for k, v in ranks[0].items() if k.startswith(case + ":")}
        ref, floor, ours = times["reference (per tensor)"], times["floor (flat broadcast)"], times["ours/broadcast"]
        print(f"### {case}: {n} tensors, {nbytes / 2**20:.1f} MiB\n")
        print("| variant | median s | vs reference | vs floor |")
        print("|---|---:|---:|---:|")
        for name, t in times.items():
            print(f"| {name} | {t:.4f} | {ref / t:.2f}x faster | {t / floor:.2f}x floor |")
        plain = times["plain local mmap"]
        print(f"\nours/broadcast: {ref / ours:.2f}x faster than reference, {ours / floor:.2f}x the floor; "
              f"ours/shared-fs: {times['ours/shared-fs'] / plain:.2f}x a plain local mmap load\n")
    big_bytes = sizes["big"][1]
    for r, res in enumerate(ranks):
        growth = res.get("peak_rss_growth_kib")
        if growth is not None:
            print(f"rank {r}: peak RSS growth during one big ours/broadcast load: {growth / 1024:.0f} MiB "
                  f"({growth * 1024 / big_bytes:.2f}x the state dict; rank 0's are page-cache pages of its "
                  f"private map), RssAnon after: {res['rss_anon_kib'] / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
