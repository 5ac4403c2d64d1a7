"""Publish and load on an ``s3://`` root against obstore's own requests for the same bytes, same server.

Runs a private SeaweedFS on loopback (or the server ``REGISTRY_TEST_S3_ENDPOINT`` names, with its credentials in
the AWS environment), so only ratios mean anything: client and server share the machine's cores. Each round, in
an order that rotates round by round so that load from other processes hits every variant alike:

- ``publish``: a blocking, verified ``Registry.publish`` of the state dict (safetensors serialised from the
  tensors' memory, sha256 and xxh3 pieces computed while uploading, sizes and headers checked on the server,
  manifest last, catalog commit), against ``raw put``: ``obstore.put`` of the same safetensors bytes, already in
  memory, as one parallel multipart upload with the same part size and concurrency;
- ``raw put, no checksum``: the same put from a store with ``checksum_algorithm: none``, no
  ``x-amz-checksum-sha256`` on its bodies: what the server-checked body checksum costs;
- ``load``: a verified ``Registry.load`` (parallel ranged gets, every piece checked, tensors parsed), against
  ``raw get``: ``obstore.get_range`` of the same 16 MiB ranges of the same object, as many at once, into one
  uninitialised CPU buffer, nothing checked or parsed;
- ``async``: the time ``publish(blocking=False)`` blocks the trainer (the snapshot), against the blocking publish
  of the same round.

Reported: the median over ``--runs`` rounds (after one warm-up round) of each time, and of each ratio taken within
its round.

    ./scripts/bench s3 [--mib 1024] [--runs 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import obstore
import safetensors.torch as st
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_rates, s3_bench_server, settle, transformer_state  # noqa: E402
from registry import Registry  # noqa: E402
from registry.fs.objectread import READ_CONCURRENCY  # noqa: E402
from registry.fs.objects import PART_SIZE, UPLOAD_CONCURRENCY, ObjectRoot  # noqa: E402
from registry.format.pieces import PIECE_SIZE  # noqa: E402
from tests import s3server  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def raw_put(root: ObjectRoot, key: str, data: bytes) -> None:
    obstore.put(root.store, key, data, use_multipart=True, chunk_size=PART_SIZE, max_concurrency=UPLOAD_CONCURRENCY)


def raw_get(root: ObjectRoot, key: str, size: int, pool: ThreadPoolExecutor) -> torch.Tensor:
    out = torch.empty(size, dtype=torch.uint8)  # the same kind of buffer a load fills (no zero-fill)
    view = out.numpy().data.cast("B")

    def one(start: int) -> None:
        end = min(size, start + PIECE_SIZE)
        view[start:end] = obstore.get_range(root.store, key, start=start, end=end)

    list(pool.map(one, range(0, size, PIECE_SIZE)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=int(os.environ.get("REGISTRY_BENCH_MIB", 1024)))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the server's data and the catalog go")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=args.dir))
    server = None
    try:
        server = s3_bench_server(work)
        bucket = s3server.new_bucket(server)
        state = transformer_state(args.mib)
        blob = st.save(state, {"format": "pt"})
        size = len(blob)
        times: dict[str, list[float]] = {k: [] for k in ("publish", "raw put", "raw put, no checksum", "load",
                                                           "raw get", "async")}
        ratios: dict[str, list[float]] = {"publish / raw put": [], "publish / raw put, no checksum": [],
                                          "load / raw get": [], "async / publish": []}
        pool = ThreadPoolExecutor(READ_CONCURRENCY)
        with Registry.open(f"sqlite:///{work / 'catalog.db'}", root=f"s3://{bucket}/bench",
                           storage_options=server.storage_options) as reg:
            assert reg.objects is not None
            root = reg.objects
            # the same store without x-amz-checksum-sha256 on its bodies: what the server-checked checksum costs
            bare = ObjectRoot.open(f"s3://{bucket}/bench",
                                   storage_options={**server.storage_options, "checksum_algorithm": "none"})
            for rnd in range(args.runs + 1):
                got: dict[str, float] = {}
                step = 2 * rnd + 1

                def publish(step: int = step, got: dict[str, float] = got) -> None:
                    t = time.perf_counter()
                    info = reg.publish("bench", step, state)
                    got["publish"] = time.perf_counter() - t
                    t = time.perf_counter()
                    ck = reg.load(f"bench@{step}")
                    got["load"] = time.perf_counter() - t
                    assert torch.equal(ck.state_dict["lm_head.weight"], state["lm_head.weight"])
                    del ck
                    key = f"{info.path.as_posix()}/model.safetensors"
                    t = time.perf_counter()
                    head = root.head(key)
                    assert head is not None
                    raw_get(root, key, head.size, pool)
                    got["raw get"] = time.perf_counter() - t
                    root.delete(e.rel for e in root.list(info.path.as_posix()))

                def put(rnd: int = rnd, got: dict[str, float] = got) -> None:
                    key = f"raw/{rnd}/model.safetensors"
                    t = time.perf_counter()
                    raw_put(root, key, blob)
                    got["raw put"] = time.perf_counter() - t
                    root.delete([key])

                def put_bare(rnd: int = rnd, got: dict[str, float] = got) -> None:
                    key = f"raw/{rnd}/bare.safetensors"
                    t = time.perf_counter()
                    raw_put(bare, key, blob)
                    got["raw put, no checksum"] = time.perf_counter() - t
                    root.delete([key])

                def background(step: int = step + 1, got: dict[str, float] = got) -> None:
                    t = time.perf_counter()
                    future = reg.publish("bench", step, state, blocking=False)
                    got["async"] = time.perf_counter() - t
                    info = future.result()
                    root.delete(e.rel for e in root.list(info.path.as_posix()))

                order = [publish, put, put_bare, background]
                shift = rnd % len(order)
                for fn in order[shift:] + order[:shift]:
                    settle()
                    fn()
                if rnd == 0:
                    continue  # warm-up
                for k, v in got.items():
                    times[k].append(v)
                ratios["publish / raw put"].append(got["publish"] / got["raw put"])
                ratios["publish / raw put, no checksum"].append(got["publish"] / got["raw put, no checksum"])
                ratios["load / raw get"].append(got["load"] / got["raw get"])
                ratios["async / publish"].append(got["async"] / got["publish"])
        mib = size / 2**20
        print(f"s3 root on SeaweedFS (loopback), {mib:.0f} MiB safetensors, median of {args.runs} rounds "
              f"after a warm-up; {os.cpu_count()} CPUs")
        print_rates(times, ratios, mib=mib, no_rate=("async",))
        print(f"command: ./scripts/bench s3 --mib {args.mib} --runs {args.runs}")
    finally:
        if server is not None and server.process is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
