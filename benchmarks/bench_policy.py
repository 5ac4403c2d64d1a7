"""Policy deltas (``registry.format.delta``): their size against a full file, and what they cost.

A bf16 state of ``--mib`` MiB (a decoder's tensors, hidden size 1024, values
``0.02 * randn``) takes one optimizer-like step per change rate: at
``--rates`` percent of each tensor's elements, drawn at random, the value
becomes ``value * (1 + 1e-3 * randn)``, and where bf16 rounds that back to
the same value it moves one unit in the last place the same way (so exactly
that share of elements changes, as in RL fine-tuning, where most changed
bf16 weights move by one unit). Sizes, as a share of the full
``model.safetensors`` a publish writes:

- this format: gap-coded positions and XOR-coded values, byte planes, zstd;
- XOR + zstd: each tensor's bytes XOR the base's, zstd of the whole tensor;
- int32 + raw + zstd: the changed elements' int32 flat indices and their new
  raw values, each zstd'd.

Then the positions alone in three codings of the gaps (LEB128 varints, a
bit-packed width per tensor, byte planes of a byte width per tensor, the
one the format uses), each zstd'd, to show why; and, where the rates include
3, the fold of ``--fold`` consecutive 3 % steps (independent positions, the
worst case for a fold) against the sum of their deltas.

Times, medians of ``--runs`` rounds after a warm-up, the variants of a round
in a rotating order: ``encode`` and ``decode`` with the base's full digest
known (a publish's manifest and a consumer's verified copy have it), writing
the full file (page cache, no fsync) and its sha256 (which a publish
computes, and which encode or decode add when the base's digest is not
known). "full write" is the two together, what a full publish does before
its fsync; the ratios are medians of per-round ratios.

    ./scripts/bench policy [--mib 64] [--rates 1,3,20] [--runs 5] [--fold 8] [--level 3] [--dir DIR]
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

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import settle  # noqa: E402
from registry.format import delta  # noqa: E402
from registry.format.safetensors import PUBLISH_METADATA, Encoded, tensor_bytes  # noqa: E402

HIDDEN = 1024


def policy_state(mib: int) -> dict[str, torch.Tensor]:
    """bf16 weights of about ``mib`` MiB: an 8192-row embedding and as many decoder layers as fit."""
    g = torch.Generator().manual_seed(0)
    h = HIDDEN
    embed_rows = min(8192, max(1, (mib << 20) // (2 * h)))
    shapes = {"embed.weight": (embed_rows, h)}
    per_layer = 12 * h * h * 2
    for i in range(max(0, round(((mib << 20) - embed_rows * h * 2) / per_layer))):
        p = f"layers.{i}."
        shapes.update({p + "attn.qkv.weight": (3 * h, h), p + "attn.out.weight": (h, h),
                       p + "mlp.up.weight": (4 * h, h), p + "mlp.down.weight": (h, 4 * h),
                       p + "norm1.weight": (h,), p + "norm2.weight": (h,)})
    return {name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) if len(shape) > 1
            else torch.ones(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}


def step(state: dict[str, torch.Tensor], rate: float, seed: int) -> dict[str, torch.Tensor]:
    """``state`` after an optimizer-like step that changes ``rate`` of each tensor's elements (see the docstring)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        flat = t.reshape(-1)
        k = round(rate * flat.numel())
        where = torch.randperm(flat.numel(), generator=g)[:k]
        noise = torch.randn(k, generator=g)
        old = flat[where]
        new = (old.float() * (1 + 1e-3 * noise)).to(torch.bfloat16)
        old_bits, new_bits = old.view(torch.int16), new.view(torch.int16)
        # a bf16 bit pattern + 1 is one unit further from zero, whatever the sign
        away = (noise > 0).to(torch.int16) * 2 - 1
        new_bits = torch.where(old_bits == new_bits, old_bits + away, new_bits)
        changed = flat.clone()
        changed[where] = new_bits.view(torch.bfloat16)
        out[name] = changed.reshape(t.shape)
    return out


def ints(t: torch.Tensor) -> np.ndarray:
    return np.frombuffer(tensor_bytes(t), dtype={1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[t.element_size()])


def xor_zstd(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], level: int) -> int:
    c = zstandard.ZstdCompressor(level=level)
    return sum(len(c.compress((ints(base[n]) ^ ints(target[n])).data)) for n in target)


def int32_raw_zstd(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], level: int) -> int:
    c = zstandard.ZstdCompressor(level=level)
    total = 0
    for n in target:
        t = ints(target[n])
        index = np.flatnonzero(ints(base[n]) ^ t)
        if index.size:
            total += len(c.compress(index.astype(np.int32).data)) + len(c.compress(t[index].data))
    return total


def leb128(values: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 varints: 7 bits a byte, the high bit set on every byte but a value's last."""
    v = values.astype(np.uint64)
    length = np.ones(v.size, dtype=np.int64)
    rest = v >> np.uint64(7)
    while rest.any():
        length += rest > 0
        rest >>= np.uint64(7)
    out = np.empty(int(length.sum()), dtype=np.uint8)
    start = np.cumsum(length) - length
    for j in range(int(length.max())):
        sel = length > j
        byte = ((v[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        out[start[sel] + j] = byte | np.where(length[sel] > j + 1, 0x80, 0).astype(np.uint8)
    return out


def bitpacked(values: np.ndarray) -> np.ndarray:
    """Each value in the fewest bits that hold the largest, packed end to end."""
    width = max(1, int(values.max()).bit_length())
    bits = (values.astype(np.uint64)[:, None] >> np.arange(width, dtype=np.uint64)) & np.uint64(1)
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little")


def byte_planes(values: np.ndarray) -> np.ndarray:
    width = next(w for w in (1, 2, 4, 8) if int(values.max()) < 1 << (8 * w))
    return np.ascontiguousarray(values.astype(f"<u{width}").view(np.uint8).reshape(-1, width).T)


def position_codings(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], level: int) -> dict[str, int]:
    c = zstandard.ZstdCompressor(level=level)
    sizes = {"LEB128": 0, "bit-packed": 0, "byte planes": 0}
    for n in target:
        index = np.flatnonzero(ints(base[n]) ^ ints(target[n]))
        if index.size:
            gaps = np.diff(index, prepend=-1) - 1
            for name, code in (("LEB128", leb128), ("bit-packed", bitpacked), ("byte planes", byte_planes)):
                sizes[name] += len(c.compress(code(gaps).tobytes()))
    return sizes


def rounds(variants: dict[str, Callable[[], object]], runs: int) -> dict[str, list[tuple[float, float]]]:
    """Wall and CPU seconds (the process, all threads: the work, whatever the machine's load) of each variant in
    each of ``runs`` rounds after a warm-up round, the variants in a rotating order."""
    names = list(variants)
    out: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(runs + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            settle()
            c0, t0 = time.process_time(), time.perf_counter()
            variants[name]()
            if r:
                out[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return out


def seconds(times: list[tuple[float, float]]) -> str:
    """Median wall seconds (median CPU seconds)."""
    return f"{statistics.median(w for w, _ in times):.3f} ({statistics.median(c for _, c in times):.3f})"


def ratio(times: dict[str, list[tuple[float, float]]], a: str, *over: str) -> float:
    """The median over rounds of ``a``'s wall time / the sum of those of ``over``."""
    return statistics.median(row[0][0] / sum(t[0] for t in row[1:]) for row in zip(times[a], *(times[b] for b in over)))


def write_full(state: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        Encoded(state, PUBLISH_METADATA).write(f)
    path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=int(os.environ.get("REGISTRY_BENCH_MIB", "64")))
    parser.add_argument("--rates", default="1,3,20", help="percent of elements changed, comma-separated")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--fold", type=int, default=8, help="consecutive 3%% steps folded into one delta (0: none)")
    parser.add_argument("--level", type=int, default=delta.LEVEL, help="zstd level, for every variant")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    base = policy_state(args.mib)
    full = Encoded(base, PUBLISH_METADATA).size
    base_sha = delta.full_sha256(base)
    work = Path(tempfile.mkdtemp(prefix="bench-policy-", dir=args.dir))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"machine: {os.cpu_count()} cores, load average {load} at the start, torch {torch.__version__}, "
             f"zstandard {zstandard.__version__} (level {args.level}); {len(base)} bf16 tensors, "
             f"full model.safetensors {full / 2**20:.1f} MiB; "
             f"medians of {args.runs} rounds after a warm-up",
             "", "| % changed | this format | XOR + zstd | int32 + raw + zstd | encode s (CPU s) | decode s (CPU s) "
             "| encode / full write | decode / full write |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    codings: list[str] = []
    baselines: list[dict[str, list[tuple[float, float]]]] = []
    fold_line = ""
    try:
        for rate in rates:
            target = step(base, rate / 100, seed=int(rate * 1000))
            data = delta.encode(base, target, base_sha256=base_sha, level=args.level)
            decoded = delta.decode(base, data, base_sha256=base_sha)
            assert all(torch.equal(decoded[n].view(torch.int16), target[n].view(torch.int16)) for n in target)
            header = delta.read_header(data)
            share = header.changed / sum(t.numel() for t in base.values())
            assert abs(share * 100 - rate) < 0.01, share
            times = rounds({
                "encode": lambda t=target: delta.encode(base, t, base_sha256=base_sha, level=args.level),
                "decode": lambda d=data: delta.decode(base, d, base_sha256=base_sha),
                "write": lambda: write_full(base, work / "model.safetensors"),
                "sha256": lambda: delta.full_sha256(base)}, args.runs)
            baselines.append(times)
            lines.append(f"| {rate:g} | {len(data) / full:.2%} | {xor_zstd(base, target, args.level) / full:.2%} | "
                         f"{int32_raw_zstd(base, target, args.level) / full:.2%} | {seconds(times['encode'])} | "
                         f"{seconds(times['decode'])} | {ratio(times, 'encode', 'write', 'sha256'):.2f} | "
                         f"{ratio(times, 'decode', 'write', 'sha256'):.2f} |")
            sizes = position_codings(base, target, args.level)
            codings.append(f"| {rate:g} | " + " | ".join(f"{v / full:.3%}" for v in sizes.values()) + " |")
            if rate == 3 and args.fold > 1:
                states = [base, target]
                deltas = [data]
                for i in range(1, args.fold):
                    states.append(step(states[-1], 0.03, seed=3000 + i))
                    deltas.append(delta.encode(states[-2], states[-1], level=args.level))
                folded = deltas[0]
                for d in deltas[1:]:
                    folded = delta.fold(folded, d, base, base_sha256=base_sha, level=args.level)
                fold_line = (f"fold of {args.fold} consecutive 3 % steps: {len(folded) / full:.2%} of full, "
                             f"{len(folded) / sum(map(len, deltas)):.3f} x the sum of their deltas "
                             f"({sum(map(len, deltas)) / full:.2%} of full); "
                             f"{delta.read_header(folded).changed / sum(t.numel() for t in base.values()):.1%} "
                             "of elements differ from the base.")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write = [t for times in baselines for t in times["write"]]
    digest = [t for times in baselines for t in times["sha256"]]
    lines += ["", f"writing the full file (page cache, no fsync), over all rounds: {seconds(write)} s; its sha256 "
              f"(full_sha256, what a publish computes and what encode or decode add without the base's digest): "
              f"{seconds(digest)} s; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
              "", "positions alone, gaps zstd'd, share of full:", "",
              "| % changed | LEB128 | bit-packed width | byte planes (used) |", "|---:|---:|---:|---:|", *codings]
    if fold_line:
        lines += ["", fold_line]
    print("\n".join(lines))
    print(f"\n(./scripts/bench policy --mib {args.mib} --rates {args.rates} --runs {args.runs} --fold {args.fold} "
          f"--level {args.level})")


if __name__ == "__main__":
    main()
