"""Sharded publish and ``load_into`` on an ``s3://`` root against raw obstore requests for the same bytes, 2 ranks.

Two gloo ranks on 127.0.0.1 (``--world``), a private SeaweedFS on loopback (or the server
``REGISTRY_TEST_S3_ENDPOINT`` names), one SQLite catalog both ranks open. The state is ``--mib`` of float32
DTensors sharded on dim 0 over the ranks (half per rank). Each variant is timed from a barrier to a barrier
(the slowest rank counts), round-robin in an order rotated every round, median of ``--runs`` after one warm-up
round, ratios taken within each round:

* ``publish``: ``reg.publish(run, step, state, sharded=True)``: claim, every rank uploads its DCP file as a
  multipart upload hashed on the way (sha256 and xxh3 pieces), rank 0 ``.metadata`` and the manifest last,
  sizes checked on the server, catalog commit;
* ``raw put``: every rank ``obstore.put`` of its shard's bytes (already one buffer in memory, made before the
  clock starts) as one parallel multipart upload with the same part size and concurrency; nothing hashed;
* ``load``: ``reg.load_into(ref, template)`` at the same world size: rank 0 resolves, every rank fetches the
  ranges its shards need by concurrent ranged GETs, each 16 MiB piece checked, DCP fills the template;
* ``load, verify=False``: the same without the piece checks (``.metadata`` still checked), exact ranges;
* ``raw get``: every rank ``obstore.get_range`` of the same data file in 16 MiB ranges, as many at once as the
  load has in flight, into one uninitialised buffer; nothing checked or parsed;
* with ``s3torchconnector[dcp]`` installed: ``s3tc save`` / ``s3tc load``: ``dcp.save`` / ``dcp.load`` of the
  same state through its ``S3StorageWriter`` / ``S3StorageReader`` (no catalog, no checksums).

    ./scripts/bench s3_sharded [--mib 256] [--runs 5]
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, s3_bench_server, settle  # noqa: E402

ROW = 1024  # float32 columns of every tensor
TENSOR_ROWS = 2048  # 8 MiB per tensor


def has_s3tc() -> bool:
    try:
        import s3torchconnector.dcp  # noqa: F401
    except ImportError:
        return False
    return True


def state_for(mib: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    count = max(1, (mib << 20) // (TENSOR_ROWS * ROW * 4))
    return {"model": {f"w{i}": distribute_tensor(torch.randn(TENSOR_ROWS, ROW, generator=g), mesh, [Shard(0)])
                      for i in range(count)}}


def rank_main(rank: int, port: int, args: dict[str, Any]) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(args["env"])
    world = args["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    import obstore
    import torch.distributed.checkpoint as dcp

    from registry import Registry
    from registry.format.pieces import PIECE_SIZE
    from registry.fs.dcpobjects import READ_CONCURRENCY
    from registry.fs.objects import PART_SIZE, UPLOAD_CONCURRENCY

    state = state_for(args["mib"], world)
    template = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    local = torch.cat([v.to_local().reshape(-1) for v in state["model"].values()]).view(torch.uint8)
    blob = local.numpy().tobytes()
    pool = ThreadPoolExecutor(READ_CONCURRENCY)
    s3tc = has_s3tc()
    times: dict[str, list[float]] = {}
    counter = iter(range(2, 10**6))
    with Registry.open(url=args["url"], root=args["root"]) as reg:
        objects = reg.root.object_store()
        assert objects is not None
        reg.publish("load", 1, state, sharded=True, timeout=600)
        rel = reg.resolve("load@1").path.as_posix() if rank == 0 else ""
        shared = [rel]
        dist.broadcast_object_list(shared, src=0)
        data_key = f"{shared[0]}/__{rank}_0.distcp"
        head = objects.head(data_key)
        assert head is not None

        def publish() -> Callable[[], object]:
            step = next(counter)
            return lambda: reg.publish("pub", step, state, sharded=True, timeout=600)

        def raw_put() -> Callable[[], object]:
            key = f"raw/{next(counter)}/{rank}.bin"
            return lambda: obstore.put(objects.store, key, blob, use_multipart=True, chunk_size=PART_SIZE,
                                       max_concurrency=UPLOAD_CONCURRENCY)

        def load() -> Callable[[], object]:
            return lambda: reg.load_into("load@1", template, timeout=600)

        def load_unverified() -> Callable[[], object]:
            return lambda: reg.load_into("load@1", template, timeout=600, verify=False)

        def raw_get() -> Callable[[], object]:
            def run() -> None:
                out = torch.empty(head.size, dtype=torch.uint8)
                view = out.numpy().data.cast("B")

                def one(start: int) -> None:
                    end = min(head.size, start + PIECE_SIZE)
                    view[start:end] = obstore.get_range(objects.store, data_key, start=start, end=end)
                list(pool.map(one, range(0, head.size, PIECE_SIZE)))
            return run

        def s3tc_client() -> Any:
            from s3torchconnector import S3ClientConfig
            from s3torchconnector._s3client import S3Client
            from s3torchconnector.dcp.s3_file_system import S3FileSystem
            config = S3ClientConfig(force_path_style=True, part_size=PART_SIZE)
            return S3FileSystem(args["region"], s3_client=S3Client(args["region"], endpoint=args["endpoint"],
                                                                   s3client_config=config))

        tc_url = f"{args['bucket_url']}/s3tc"

        def s3tc_save() -> Callable[[], object]:
            from s3torchconnector.dcp import S3StorageWriter
            writer = S3StorageWriter(args["region"], f"{tc_url}/{next(counter)}", thread_count=1)
            writer.fs = s3tc_client()
            return lambda: dcp.save(state, storage_writer=writer)

        tc_load_path = f"{tc_url}/load"
        if s3tc:  # the step s3tc loads, written once
            from s3torchconnector.dcp import S3StorageWriter
            first = S3StorageWriter(args["region"], tc_load_path, thread_count=1)
            first.fs = s3tc_client()
            dcp.save(state, storage_writer=first)

        def s3tc_load() -> Callable[[], object]:
            from s3torchconnector.dcp import S3StorageReader
            reader = S3StorageReader(args["region"], tc_load_path)
            reader.fs = s3tc_client()
            return lambda: dcp.load(template, storage_reader=reader)

        variants: dict[str, Callable[[], Callable[[], object]]] = {
            "publish": publish, "raw put": raw_put, "load": load, "load, verify=False": load_unverified,
            "raw get": raw_get}
        if s3tc:
            variants.update({"s3tc save": s3tc_save, "s3tc load": s3tc_load})
        names = list(variants)
        rounds: list[dict[str, float]] = []
        for i in range(args["runs"] + 1):
            got: dict[str, float] = {}
            for name in names[i % len(names):] + names[:i % len(names)]:
                fn = variants[name]()
                settle()
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                got[name] = time.perf_counter() - t0
            if i > 0:
                rounds.append(got)
            dist.barrier()
            if rank == 0:  # what the round wrote goes, outside the clock
                objects.delete(e.rel for e in objects.list("raw"))
                objects.delete(e.rel for e in objects.list("pub"))  # rows left published: nothing reads them
            dist.barrier()
        for name in names:
            times[name] = [r[name] for r in rounds]
    if rank == 0:
        Path(args["out"]).write_text(json.dumps({"rounds": rounds, "times": times, "s3tc": s3tc,
                                                 "shard_mib": len(blob) / 2**20}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="state size, all ranks together")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the server's data and the catalog go")
    opts = parser.parse_args()
    from tests import s3server
    work = Path(tempfile.mkdtemp(prefix="bench-s3-sharded-", dir=opts.dir))
    server = None
    try:
        server = s3_bench_server(work)
        bucket = s3server.new_bucket(server)
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        args = {"mib": opts.mib, "runs": opts.runs, "world": opts.world, "env": env,
                "url": f"sqlite:///{work / 'catalog.db'}", "root": f"s3://{bucket}/bench",
                "bucket_url": f"s3://{bucket}", "out": str(work / "result.json"),
                "endpoint": env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL", ""),
                "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"}
        load0 = os.getloadavg()
        mp.start_processes(rank_main, args=(free_port(), args), nprocs=opts.world, start_method="spawn")
        got = json.loads((work / "result.json").read_text())
        rounds, times = got["rounds"], got["times"]
        ratio = {
            "publish / raw put": [r["publish"] / r["raw put"] for r in rounds],
            "load / raw get": [r["load"] / r["raw get"] for r in rounds],
            "load, verify=False / raw get": [r["load, verify=False"] / r["raw get"] for r in rounds],
        }
        if got["s3tc"]:
            ratio["publish / s3tc save"] = [r["publish"] / r["s3tc save"] for r in rounds]
            ratio["load / s3tc load"] = [r["load"] / r["s3tc load"] for r in rounds]
        total = got["shard_mib"] * opts.world
        print(f"\n./scripts/bench s3_sharded --mib {opts.mib} --runs {opts.runs} --world {opts.world}")
        print(f"{opts.world} gloo ranks, SeaweedFS on loopback, {total:.0f} MiB of float32 DTensors "
              f"({got['shard_mib']:.0f} MiB per rank); median of {opts.runs} rounds after a warm-up; "
              f"{os.cpu_count()} CPUs, load average {load0[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end"
              + ("" if got["s3tc"] else "; s3torchconnector not installed"))
        print("\n| variant | median s | MiB/s (all ranks) |")
        print("|---|---:|---:|")
        for name, values in times.items():
            med = statistics.median(values)
            print(f"| {name} | {med:.3f} | {total / med:.0f} |")
        print("\n| ratio (within each round) | median |")
        print("|---|---:|")
        for name, values in ratio.items():
            print(f"| {name} | {statistics.median(values):.2f}x |")
    finally:
        if server is not None and server.process is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
