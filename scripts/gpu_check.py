"""GPU checks that the CPU machines cannot run: publish from CUDA tensors.

Publishes a transformer-shaped state dict that lives on the GPU, blocking and
asynchronously (``blocking=False`` snapshots into pinned memory), and reports
how long the trainer is held up, then loads it back onto the GPU with
``map_location="cuda"`` and checks every tensor bit for bit. Run on a machine
with CUDA: ``python scripts/gpu_check.py --mib 1024 --runs 5``.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    state = make_state(args.mib, "cuda")
    size = sum(t.numel() * t.element_size() for t in state.values())
    blocking, returns, async_total = [], [], []
    with tempfile.TemporaryDirectory() as tmp, Registry.open(root=Path(tmp) / "ckpt") as reg:
        step = 0
        for i in range(args.runs + 1):
            step += 1
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            reg.publish("gpu", step, state)
            t_block = time.perf_counter() - t0
            step += 1
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            future = reg.publish("gpu", step, state, blocking=False)
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
        ckpt = reg.load(f"gpu@{step}", map_location="cuda")
        same = all(torch.equal(ckpt.state_dict[k], v) for k, v in state.items())
        on_gpu = all(v.is_cuda for v in ckpt.state_dict.values())
    med = statistics.median
    print(f"state: {len(state)} CUDA tensors, {size / 2**20:.0f} MiB on {torch.cuda.get_device_name()}")
    print(f"{'variant':<34}{'median s':>10}{'ratio':>8}")
    print(f"{'publish blocking (from CUDA)':<34}{med(blocking):>10.3f}{1.0:>8.2f}")
    print(f"{'publish async: returns after':<34}{med(returns):>10.3f}{med(returns) / med(blocking):>8.2f}")
    print(f"{'publish async: committed after':<34}{med(async_total):>10.3f}{med(async_total) / med(blocking):>8.2f}")
    print(f"async snapshot unaffected by later in-place updates, reloaded to cuda bit-exact: {same and on_gpu}")
    if not (same and on_gpu):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
