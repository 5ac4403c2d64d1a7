"""GPU checks that the CPU machines cannot run: the registry's CUDA paths, each reported ok / FAILED / skipped.

1. pinned snapshot: publish a transformer-shaped state dict and 2,000 small
   tensors that live on the GPU, blocking and with ``blocking=False`` (which
   snapshots into pinned host memory); report how long the trainer is held
   up, check the reused arena is pinned, load each back with
   ``map_location="cuda"`` and compare every tensor bit for bit.
2. async sharded publish: ranks (one per GPU, at most ``--world``; NCCL)
   train an FSDP2 model one step on CUDA, publish with ``sharded=True,
   blocking=False``, change their parameters at once (the trainer goes on),
   then ``load_into`` the live state after the commit must restore the
   values of the publish call, bit for bit.
3. FSDP1 under Lightning: ``FSDPStrategy`` (Lightning runs it on CUDA only)
   must be refused with one line, never write a local ``registry:...`` file:
   a fit with ``RegistryCheckpoint`` is refused at setup, and
   ``trainer.save_checkpoint("registry:RUN@STEP")`` through
   ``RegistryCheckpointIO`` with a full state dict is refused.

Without CUDA every check says "skipped" and the script exits 0.
``--device cpu`` runs the same checks on the CPU (gloo, one rank, the
strategy's save called directly where a fit needs CUDA), so the script itself
is tested on any machine. Exit status 1 if a check failed.

    python scripts/gpu_check.py [--mib 1024] [--small 2000] [--runs 5] [--world 2]
    python scripts/gpu_check.py --device cpu --mib 8 --small 20 --runs 1
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from registry import Registry  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


@dataclass(frozen=True)
class Result:
    name: str
    status: str  # "ok", "FAILED" or "skipped"
    lines: tuple[str, ...] = ()


def make_state(mib: int, device: str) -> dict[str, torch.Tensor]:
    hidden = 2048 if mib >= 64 else 256
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- 1. pinned snapshot


def measure(reg: Registry, run: str, state: dict[str, torch.Tensor], runs: int,
            device: str) -> tuple[float, float, float, bool, bool]:
    """Medians of blocking publish, async return and async commit; whether the async copy reloads bit-exact
    onto the device; whether the snapshot arena is pinned."""
    blocking, returns, async_total = [], [], []
    step = 0
    for i in range(runs + 1):
        step += 1
        synchronize(device)
        t0 = time.perf_counter()
        reg.publish(run, step, state)
        t_block = time.perf_counter() - t0
        step += 1
        synchronize(device)
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
    ckpt = reg.load(f"{run}@{step}", map_location=device)
    same = all(torch.equal(ckpt.state_dict[k], v) for k, v in state.items())
    on_device = all(v.device.type == device for v in ckpt.state_dict.values())
    arenas = reg._snapshots._idle  # the arena the async publish released after its copy was written
    pinned = bool(arenas) and all(a.pinned and a.buffer.is_pinned() for a in arenas)
    med = statistics.median
    return med(blocking), med(returns), med(async_total), same and on_device, pinned


def check_pinned(args: argparse.Namespace, work: Path) -> Result:
    device = args.device
    workloads = {"transformer": make_state(args.mib, device)}
    if args.small:
        workloads["small"] = small_state(args.small, device)
    ok = True
    lines = [f"{'workload':<34}{'variant':<34}{'median s':>10}{'ratio':>8}"]
    with Registry.open(url=f"sqlite:///{work / 'pinned.db'}", root=work / "pinned") as reg:
        for name, state in workloads.items():
            size = sum(t.numel() * t.element_size() for t in state.values())
            label = f"{name}: {len(state)} tensors, {size / 2**20:.0f} MiB"
            block, ret, total, exact, pinned = measure(reg, name, state, args.runs, device)
            lines += [f"{label:<34}{f'publish blocking (from {device})':<34}{block:>10.4f}{1.0:>8.2f}",
                      f"{'':<34}{'publish async: returns after':<34}{ret:>10.4f}{ret / block:>8.2f}",
                      f"{'':<34}{'publish async: committed after':<34}{total:>10.4f}{total / block:>8.2f}",
                      f"{'':<34}async copy reloaded to {device} bit-exact: {exact}; snapshot arena pinned: "
                      f"{pinned} (expected {device == 'cuda'})"]
            ok = ok and exact and pinned == (device == "cuda")
    return Result("pinned snapshot", "ok" if ok else "FAILED", tuple(lines))


# --------------------------------------------------------------------------- 2. async sharded publish


def _sharded_rank(rank: int, world: int, port: int, device: str, root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    warnings.simplefilter("ignore")
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(minutes=5))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4))).to(device)
        mesh = init_device_mesh(device, (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(8, 256, device=device)).sum().backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        expected = {k: v.to_local().clone() for k, v in msd.items()}
        with Registry.open(url=f"sqlite:///{root}/sharded.db", root=f"{root}/sharded") as reg:
            synchronize(device)
            t0 = time.perf_counter()
            future = reg.publish("sharded", 1, state, sharded=True, blocking=False, timeout=300)
            returned = time.perf_counter() - t0
            with torch.no_grad():
                for p in model.parameters():  # the trainer goes on at once
                    p.add_(1.0)
            info = future.result()
            reg.load_into("sharded@1", state, timeout=300)
            synchronize(device)
            same = all(torch.equal(state["model"][k].to_local(), v) for k, v in expected.items())
            on_device = all(state["model"][k].to_local().device.type == device for k in expected)
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "returned": returned, "same": same, "on_device": on_device, "status": info.status}))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def check_sharded_async(args: argparse.Namespace, work: Path) -> Result:
    import torch.multiprocessing as mp
    # on the CPU one rank runs the harness; two CPU ranks are bench sharded's and the tests' job
    world = max(1, min(args.world, torch.cuda.device_count())) if args.device == "cuda" else 1
    out = work / "sharded-out"
    out.mkdir()
    mp.start_processes(_sharded_rank, args=(world, free_port(), args.device, str(work), str(out)), nprocs=world,
                       start_method="spawn")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    ok = all(r["same"] and r["on_device"] and r["status"] == "verified" for r in ranks)
    lines = [f"rank {r}: publish(sharded=True, blocking=False) returned after {got['returned'] * 1e3:.1f} ms; "
             f"committed {got['status']}; load_into restored the call's values bit-exact: {got['same']}, on "
             f"{args.device}: {got['on_device']}" for r, got in enumerate(ranks)]
    return Result(f"async sharded publish ({world} rank(s), {'nccl' if args.device == 'cuda' else 'gloo'})",
                  "ok" if ok else "FAILED", tuple(lines))


# --------------------------------------------------------------------------- 3. FSDP1 under Lightning


def check_fsdp1_lightning(args: argparse.Namespace, work: Path) -> Result:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy

    from registry.errors import InvalidStateError
    from registry.integrations.lightning import RegistryCheckpoint, RegistryCheckpointIO

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(64, 64)

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 64)), batch_size=2)
    cwd = work / "fsdp1-cwd"
    cwd.mkdir()
    lines: list[str] = []
    ok = True
    here = os.getcwd()
    os.chdir(cwd)  # where a misrouted registry: target would land
    try:
        with Registry.open(url=f"sqlite:///{work / 'fsdp1.db'}", root=work / "fsdp1") as reg:
            def refused(what: str, call: Callable[[], object]) -> None:
                nonlocal ok
                try:
                    call()
                except InvalidStateError as exc:
                    lines.append(f"{what}: refused: {str(exc).splitlines()[0]}")
                    return
                ok = False
                lines.append(f"{what}: NOT refused")

            options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, max_steps=1,
                           enable_model_summary=False, default_root_dir=str(cwd))
            if args.device == "cuda":
                trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=FSDPStrategy(),
                                     callbacks=[RegistryCheckpoint(reg, "fsdp1")], **options)
                refused("fit with RegistryCheckpoint under FSDPStrategy", lambda: trainer.fit(Model(), data))
                trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=FSDPStrategy(state_dict_type="full"),
                                     plugins=[RegistryCheckpointIO(reg)], **options)
                trainer.fit(Model(), data)
                refused("trainer.save_checkpoint('registry:fsdp1@1') through RegistryCheckpointIO, full state",
                        lambda: trainer.save_checkpoint("registry:fsdp1@1"))
            else:  # Lightning refuses FSDP on the CPU: call the strategy's own save, as a fit's would run
                from registry.integrations.lightning_sharded import sharded_strategy
                refused("RegistryCheckpoint's setup check under FSDPStrategy", lambda: sharded_strategy(FSDPStrategy()))
                strategy = FSDPStrategy(state_dict_type="full")
                strategy.checkpoint_io = RegistryCheckpointIO(reg)
                refused("FSDPStrategy.save_checkpoint('registry:fsdp1@1') through RegistryCheckpointIO, full state",
                        lambda: strategy.save_checkpoint({"state_dict": Model().state_dict(), "epoch": 0,
                                                          "global_step": 1}, "registry:fsdp1@1"))
            left = sorted(p.name for p in cwd.iterdir() if p.name.startswith("registry:"))
            runs = [r.name for r in reg.runs()]
    finally:
        os.chdir(here)
    lines.append(f"local files named registry:...: {left or 'none'}; runs in the catalog: {runs or 'none'}")
    ok = ok and not left and not runs
    return Result("FSDP1 under Lightning", "ok" if ok else "FAILED", tuple(lines))


# --------------------------------------------------------------------------- main


CHECKS: dict[str, Callable[[argparse.Namespace, Path], Result]] = {
    "pinned snapshot": check_pinned,
    "async sharded publish": check_sharded_async,
    "FSDP1 under Lightning": check_fsdp1_lightning,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--small", type=int, default=2000, help="also this many 16 KiB tensors (0: skip)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--world", type=int, default=2, help="ranks for the sharded check, at most one per GPU")
    parser.add_argument("--only", choices=list(CHECKS), action="append", help="run only these checks")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        for name in args.only or CHECKS:
            print(f"{name}: skipped (no CUDA device)")
        return 0
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    print(f"device: {where}; torch {torch.__version__}; medians of {args.runs} rounds after a warm-up")
    failed = False
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name in args.only or CHECKS:
            work = Path(tmp) / name.replace(" ", "-")
            work.mkdir()
            try:
                result = CHECKS[name](args, work)
            except Exception:  # noqa: BLE001 - a check that crashes is a failed check; the others still run
                result = Result(name, "FAILED", tuple(traceback.format_exc().rstrip().splitlines()))
            failed = failed or result.status == "FAILED"
            print(f"\n{result.name}: {result.status}")
            for line in result.lines:
                print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
