"""A fast root with a durable ``s3://`` tier: what the trainer waits for, replication, and a fresh host's resume.

Runs a private SeaweedFS on loopback (or the server ``REGISTRY_TEST_S3_ENDPOINT`` names), so only ratios mean
anything: client and server share the machine's cores. Each round, in an order that rotates round by round:

- ``fast publish``: a blocking, verified ``Registry.publish`` to a plain directory root (no tier);
- ``tiered publish``: the same publish to a directory root with a durable tier: the time the call blocks the
  trainer (it returns after the fast tier's commit), and ``replication``, from its return until the step's
  durable copy is verified (every file streamed from the fast copy, hashed and compared with the manifest while
  uploaded, sizes and headers checked on the server, catalog commit), against ``raw put``: ``obstore.put`` of the
  same safetensors bytes, already in memory, as one parallel multipart upload with the same part size and
  concurrency;
- ``resume``: ``Registry.load("bench@latest")`` on a fresh, empty fast root (download into the host's cache, every
  piece checked, parsed), against ``raw resume``: ranged ``obstore.get_range`` of the same object into memory,
  written to a file and fsync'd, then ``safetensors.torch.load_file``.

Reported: the median over ``--runs`` rounds (after one warm-up round) of each time, and of each ratio taken
within its round (replication as throughput: raw put time / replication time).

    ./scripts/bench tiers [--mib 512] [--runs 5] [--dir DIR]
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


def raw_resume(root: ObjectRoot, key: str, size: int, dest: Path, pool: ThreadPoolExecutor) -> dict[str, torch.Tensor]:
    out = torch.empty(size, dtype=torch.uint8)
    view = out.numpy().data.cast("B")

    def one(start: int) -> None:
        end = min(size, start + PIECE_SIZE)
        view[start:end] = obstore.get_range(root.store, key, start=start, end=end)

    list(pool.map(one, range(0, size, PIECE_SIZE)))
    with open(dest, "wb") as f:
        f.write(view)
        f.flush()
        os.fsync(f.fileno())
    return st.load_file(dest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=int(os.environ.get("REGISTRY_BENCH_MIB", 512)))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the server's data, the roots and the catalog go")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir))
    server = None
    try:
        server = s3_bench_server(work)
        bucket = s3server.new_bucket(server)
        durable = f"s3://{bucket}/bench"
        state = transformer_state(args.mib)
        blob = st.save(state, {"format": "pt"})
        size = len(blob)
        names = ("fast publish", "tiered publish", "replication", "raw put", "resume", "raw resume")
        times: dict[str, list[float]] = {k: [] for k in names}
        ratios: dict[str, list[float]] = {"tiered / fast publish": [], "replication / raw put (MiB/s)": [],
                                          "resume / raw resume": []}
        pool = ThreadPoolExecutor(READ_CONCURRENCY)
        url = f"sqlite:///{work / 'catalog.db'}"
        with Registry.open(f"sqlite:///{work / 'plain.db'}", root=work / "plain") as plain, \
                Registry.open(url, root=work / "fast", durable=durable,
                              storage_options=server.storage_options) as reg:
            assert reg.tiers is not None
            root = reg.tiers.durable
            for rnd in range(args.runs + 1):
                got: dict[str, float] = {}
                step = rnd + 1

                def fast(step: int = step, got: dict[str, float] = got) -> None:
                    t = time.perf_counter()
                    info = plain.publish("bench", step, state)
                    got["fast publish"] = time.perf_counter() - t
                    shutil.rmtree(info.path)

                def tiered(step: int = step, got: dict[str, float] = got) -> None:
                    t = time.perf_counter()
                    reg.publish("bench", step, state)
                    returned = time.perf_counter()
                    got["tiered publish"] = returned - t
                    reg.wait_durable("bench", step)
                    got["replication"] = time.perf_counter() - returned

                def put(rnd: int = rnd, got: dict[str, float] = got) -> None:
                    key = f"raw/{rnd}/model.safetensors"
                    t = time.perf_counter()
                    obstore.put(root.store, key, blob, use_multipart=True, chunk_size=PART_SIZE,
                                max_concurrency=UPLOAD_CONCURRENCY)
                    got["raw put"] = time.perf_counter() - t
                    root.delete([key])

                order = [fast, tiered, put]
                shift = rnd % len(order)
                for fn in order[shift:] + order[:shift]:
                    settle()
                    fn()
                copy = reg.wait_durable("bench", step)
                key = f"{copy.path}/model.safetensors"

                def resume(rnd: int = rnd, got: dict[str, float] = got) -> None:
                    with Registry.open(url, root=work / f"host-{rnd}", durable=durable,
                                       storage_options=server.storage_options) as fresh:
                        t = time.perf_counter()
                        ck = fresh.load("bench@latest")
                        got["resume"] = time.perf_counter() - t
                    assert torch.equal(ck.state_dict["lm_head.weight"], state["lm_head.weight"])
                    shutil.rmtree(work / f"host-{rnd}")

                def raw(rnd: int = rnd, got: dict[str, float] = got, key: str = key) -> None:
                    dest = work / f"raw-{rnd}.safetensors"
                    t = time.perf_counter()
                    raw_resume(root, key, size, dest, pool)
                    got["raw resume"] = time.perf_counter() - t
                    dest.unlink()

                for fn in ([resume, raw] if rnd % 2 else [raw, resume]):
                    settle()
                    fn()
                if rnd == 0:
                    continue  # warm-up
                for k, v in got.items():
                    times[k].append(v)
                ratios["tiered / fast publish"].append(got["tiered publish"] / got["fast publish"])
                ratios["replication / raw put (MiB/s)"].append(got["raw put"] / got["replication"])
                ratios["resume / raw resume"].append(got["resume"] / got["raw resume"])
        mib = size / 2**20
        print(f"tiers: fast directory root + s3:// durable tier on SeaweedFS (loopback), {mib:.0f} MiB safetensors, "
              f"median of {args.runs} rounds after a warm-up; {os.cpu_count()} CPUs")
        print_rates(times, ratios, mib=mib)
        print(f"command: ./scripts/bench tiers --mib {args.mib} --runs {args.runs}")
    finally:
        if server is not None and server.process is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
