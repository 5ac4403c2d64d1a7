"""The policy channel end to end: a delta publish against a full one, and materialize against a file copy.

A bf16 state of ``--mib`` MiB (``bench_policy.policy_state``) and the same state after an optimizer-like
step that changes ``--rate`` percent of its elements (``bench_policy.step``). Each round, in a rotating order:

- ``delta publish``: ``publish(run, 1, next, policy_version=1, delta=True)`` in a run whose version 0 (the
  base) this process published just before, untimed (a trainer holds its last version in memory);
- ``full publish``: the same version published as a full (``delta=False``) in another such run;

on an ``s3://`` root (a private SeaweedFS on loopback, or ``REGISTRY_TEST_S3_ENDPOINT``) and on a directory
root; then, on the directory root:

- ``materialize``: ``materialize(RUN@pv:1, DIR)`` where ``DIR`` holds version 0 as materialized before (a
  consumer's host copy): one delta applied to it, the result checked against version 1's digest and written;
- ``copy``: ``shutil.copyfile`` of version 1's full ``model.safetensors`` from the root (page cache) and an
  fsync, what a consumer without deltas does at least.

Medians of ``--runs`` rounds after a warm-up; ratios are medians of per-round ratios.

    ./scripts/bench policy_publish [--mib 256] [--rate 3] [--runs 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import s3_bench_server, settle  # noqa: E402
from bench_policy import policy_state, step  # noqa: E402
from registry import Registry  # noqa: E402


def timed(fn: Callable[[], object]) -> float:
    settle()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def publish_pair(reg: Registry, base: dict, target: dict, rnd: int) -> dict[str, float]:
    """One round's delta and full publish of version 1 (each in a run of its own whose version 0 is the base)."""
    out: dict[str, float] = {}
    order = ["delta publish", "full publish"][rnd % 2:] + ["delta publish", "full publish"][:rnd % 2]
    for name in order:
        as_delta = name.startswith("delta")
        run = f"{'d' if as_delta else 'f'}{rnd}"
        reg.publish(run, 0, base, policy_version=0, delta=True)
        out[name] = timed(lambda run=run, as_delta=as_delta: reg.publish(  # type: ignore[misc]
            run, 1, target, policy_version=1, delta=as_delta))
    return out


def materialize_pair(reg: Registry, work: Path, rnd: int) -> dict[str, float]:
    held = work / f"held-{rnd}"
    reg.materialize(f"d{rnd}@pv:0", held)
    full = Path(reg.resolve(f"f{rnd}@pv:1").path) / "model.safetensors"
    copy_to = work / f"copy-{rnd}.safetensors"

    def copy() -> None:
        shutil.copyfile(full, copy_to)
        fd = os.open(copy_to, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    out = {}
    for name in (["materialize", "copy"] if rnd % 2 else ["copy", "materialize"]):
        out[name] = timed((lambda: reg.materialize(f"d{rnd}@pv:1", held)) if name == "materialize" else copy)  # noqa: B023
    shutil.rmtree(held)
    copy_to.unlink()
    return out


def median_ratio(rounds: list[dict[str, float]], a: str, b: str) -> float:
    return statistics.median(r[a] / r[b] for r in rounds)


def report(title: str, rounds: list[dict[str, float]], pairs: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    for name in rounds[0]:
        print(f"  {name:<16} {statistics.median(r[name] for r in rounds):8.3f} s")
    for a, b, goal in pairs:
        print(f"  {a} / {b}: {median_ratio(rounds, a, b):.3f}  (goal {goal})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=int(os.environ.get("REGISTRY_BENCH_MIB", "256")))
    parser.add_argument("--rate", type=float, default=3.0, help="percent of elements changed")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None)
    opts = parser.parse_args()
    from tests import s3server
    work = Path(tempfile.mkdtemp(prefix="bench-policy-publish-", dir=opts.dir))
    server = None
    try:
        base = policy_state(opts.mib)
        target = step(base, opts.rate / 100, seed=1)
        mib = sum(t.numel() * t.element_size() for t in base.values()) / 2**20
        print(f"bf16 state of {mib:.0f} MiB, {opts.rate:g} % of elements changed; {opts.runs} rounds after a warm-up"
              f"; load average {os.getloadavg()[0]:.1f}")
        server = s3_bench_server(work)
        bucket = s3server.new_bucket(server)
        for kind, root in (("s3://", f"s3://{bucket}/bench"), ("directory", str(work / "root"))):
            with Registry.open(f"sqlite:///{work / (kind.strip(':/') + '.db')}", root=root) as reg:
                publish_pair(reg, base, target, -1)  # warm-up
                rounds = [publish_pair(reg, base, target, r) for r in range(opts.runs)]
                report(f"publish of version 1 on a {kind} root", rounds,
                       [("delta publish", "full publish", "<= 0.2 at 1 GiB, 3 %" if kind == "s3://" else "-")])
                if kind == "directory":
                    materialize_pair(reg, work, -1)
                    mats = [materialize_pair(reg, work, r) for r in range(opts.runs)]
                    report("materialize of version 1 over a host copy of version 0", mats,
                           [("materialize", "copy", "<= 1.2")])
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        if server is not None and getattr(server, "process", None) is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
