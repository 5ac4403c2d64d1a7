"""GPU checks that the CPU machines cannot run: publish from CUDA tensors.

Publishes a transformer-shaped state dict and 2,000 small tensors that live on
the GPU, blocking and asynchronously (``blocking=False`` snapshots into pinned
memory), and reports how long the trainer is held up, then loads each back
onto the GPU with ``map_location="cuda"`` and checks every tensor bit for bit.
Run on a machine with CUDA: ``python scripts/gpu_check.py --mib 1024 --small 2000 --runs 5``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from registry import Registry


def make_state(mib: int, device: str) -> dict[str, torch.Tensor]:
    hidden = 2048
    per_layer = 4 * hidden * hidden * 2  # bf16 bytes: qkv-ish + mlp-ish blocks
    layers = max(1, (mib << 20) // per_layer)
    state = {}
    g = torch.Generator(device=device).manual_seed(0)
    for i in range(layers):
        state[f"layers.{i}.attn.weight"] = torch.randn(2 * hidden, hidden, generator=g, device=device).bfloat16()
        state[f"layers.{i}.mlp.weight"] = torch.randn(2 * hidden, hidden, generator=g, device=device).bfloat16()
        state[f"layers.{i}.norm.weight"] = torch.ones(hidden, device=device)
    return state


def small_state(count: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1)
    return {f"small.{i}": torch.randn(4096, generator=g, device=device) for i in range(count)}


def measure(reg: Registry, run: str, state: dict[str, torch.Tensor], runs: int) -> tuple[float, float, float, bool]:
    """Medians of blocking publish, async return and async commit; and whether the async copy reloads bit-exact."""
    blocking, returns, async_total = [], [], []
    step = 0
    for i in range(runs + 1):
        step += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reg.publish(run, step, state)
        t_block = time.perf_counter() - t0
        step += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        future = reg.publish(run, step, state, blocking=False)
        t_return = time.perf_counter() - t0
        for t in state.values():  # the trainer goes on at once
            t.add_(1)
        future.result()
        t_total = time.perf_counter() - t0
        for t in state.values():
            t.sub_(1)
        if i:  # the first round is the warm-up
            blocking.append(t_block)
            returns.append(t_return)
            async_total.append(t_total)
    ckpt = reg.load(f"{run}@{step}", map_location="cuda")
    same = all(torch.equal(ckpt.state_dict[k], v) for k, v in state.items())
    on_gpu = all(v.is_cuda for v in ckpt.state_dict.values())
    med = statistics.median
    return med(blocking), med(returns), med(async_total), same and on_gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--small", type=int, default=2000, help="also this many 16 KiB tensors (0: skip)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    workloads = {"transformer": make_state(args.mib, "cuda")}
    if args.small:
        workloads["small"] = small_state(args.small, "cuda")
    ok = True
    print(f"device: {torch.cuda.get_device_name()}; medians of {args.runs} rounds after a warm-up")
    print(f"{'workload':<34}{'variant':<34}{'median s':>10}{'ratio':>8}")
    with tempfile.TemporaryDirectory() as tmp, Registry.open(root=Path(tmp) / "ckpt") as reg:
        for name, state in workloads.items():
            size = sum(t.numel() * t.element_size() for t in state.values())
            label = f"{name}: {len(state)} tensors, {size / 2**20:.0f} MiB"
            block, ret, total, exact = measure(reg, name, state, args.runs)
            print(f"{label:<34}{'publish blocking (from CUDA)':<34}{block:>10.4f}{1.0:>8.2f}")
            print(f"{'':<34}{'publish async: returns after':<34}{ret:>10.4f}{ret / block:>8.2f}")
            print(f"{'':<34}{'publish async: committed after':<34}{total:>10.4f}{total / block:>8.2f}")
            print(f"{'':<34}async copy reloaded to cuda bit-exact: {exact}")
            ok = ok and exact
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
