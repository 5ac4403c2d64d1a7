"""What a checkout costs, per filesystem: time and bytes, against a plain copy of the same files.

For each ``--dir`` (default: the temporary directory and ``/dev/shm``; add
loop-mounted XFS or btrfs mounts to see reflinks) a root with one step of
``--mib`` MiB is published, then each variant runs ``--runs`` times after
one warm-up:

- ``copyfile``: ``shutil.copyfile`` of the step's files into a directory on
  the same filesystem (the baseline: in-kernel, no hashing);
- ``checkout``: the default, a reflink where the filesystem clones and a
  copy otherwise, every file hashed (sha256) as it is copied and checked;
- ``checkout --no-verify``: the same without hashing;
- ``checkout --link hardlink``: the opt-in that aliases the step.

Shown: median seconds, the ratio to ``copyfile``'s median, and the bytes the
filesystem lost while the checkout existed (``statvfs`` before and after; on
a shared filesystem other writers add noise). Reads come from the page cache
for every variant alike.

    ./scripts/bench checkout [--mib 256] [--runs 5] [--dir DIR ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from registry import Registry  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def free_bytes(path: Path) -> int:
    os.sync()
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def fs_type(path: Path) -> str:
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def measure(make: Callable[[], Callable[[], None]], where: Path, runs: int) -> tuple[float, int]:
    """Median seconds of ``make()`` (which returns its undo) and median bytes it held on disk."""
    times: list[float] = []
    held: list[int] = []
    for i in range(runs + 1):
        before = free_bytes(where)
        start = time.perf_counter()
        undo = make()
        elapsed = time.perf_counter() - start
        used = before - free_bytes(where)
        undo()
        if i:  # the first round warms up
            times.append(elapsed)
            held.append(used)
    return statistics.median(times), int(statistics.median(held))


def bench_dir(base: Path, mib: int, runs: int) -> list[str]:
    work = Path(tempfile.mkdtemp(prefix="bench-checkout-", dir=base))
    try:
        g = torch.Generator().manual_seed(0)
        state = {f"layers.{i}.weight": torch.randn(16 << 18, generator=g) for i in range(max(1, mib // 16))}
        with Registry.open(url=f"sqlite:///{work / 'catalog.db'}", root=work / "root") as reg:
            info = reg.publish("run", 1, state, config={"model_type": "toy"})
            files = sorted(p for p in info.path.iterdir() if p.is_file())
            size = sum(p.stat().st_size for p in files)

            def copyfile() -> Callable[[], None]:
                out = Path(tempfile.mkdtemp(dir=work))
                for p in files:
                    shutil.copyfile(p, out / p.name)
                return lambda: shutil.rmtree(out)

            def checkout(**kw: object) -> Callable[[], Callable[[], None]]:
                def make() -> Callable[[], None]:
                    co = reg.checkout("run@1", **kw)  # type: ignore[arg-type]
                    kinds.add(co.kind)
                    return co.close
                return make

            rows: list[tuple[str, float, int]] = [("copyfile", *measure(copyfile, work, runs))]
            for label, kw in (("checkout", {}), ("checkout --no-verify", {"verify": False}),
                              ("checkout --link hardlink", {"link": "hardlink"})):
                kinds: set[str] = set()
                seconds, held = measure(checkout(**kw), work, runs)
                rows.append((f"{label} ({'/'.join(sorted(kinds))})", seconds, held))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base_t = rows[0][1]
    lines = [f"### {base} ({fs_type(base)}): one step, {size / 2**20:.1f} MiB in {len(files)} files", "",
             "| variant | median s | x copyfile | bytes held on disk |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {t:.3f} | {t / base_t:.2f} | {held / 2**20:.1f} MiB |" for name, t, held in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", action="append", type=Path, default=None)
    args = parser.parse_args()
    dirs = args.dir or [Path(tempfile.gettempdir()), Path("/dev/shm")]
    print(f"load average {os.getloadavg()[0]:.1f}; medians of {args.runs} after one warm-up")
    for d in dirs:
        if d.is_dir():
            print("\n".join(bench_dir(d, args.mib, args.runs)) + "\n")
    print(f"reproduce: ./scripts/bench checkout --mib {args.mib} --runs {args.runs} "
          + " ".join(f"--dir {d}" for d in dirs))


if __name__ == "__main__":
    main()
