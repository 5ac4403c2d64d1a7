"""One rank of a plain DCP training loop (no framework) that publishes sharded steps and resumes from ``@latest``.

Run as ``python -m tests._dcp_loop_worker RANK WORLD PORT SPEC``. A tiny
model sharded with FSDP2 over a gloo group trains on batches drawn from the
step number and the rank, so a run's losses depend only on its weights and
optimizer state. Every ``every`` steps every rank publishes the state
(``get_state_dict``: the model and AdamW's moments as DTensors, the step
counter) with ``publish(..., sharded=True)``; ``kill_after`` SIGKILLs every
rank right after that step's update (between two publishes, so work is lost);
``resume`` first loads ``RUN@latest`` into the live model's own state with
``load_into`` and goes on from its step counter. Each rank writes its losses
and a fingerprint of the full weights and optimizer state to ``OUT/rank<N>.json``
(before a kill, too).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": torch.tensor(step)}


def fingerprint(state: dict[str, Any]) -> str:
    """A digest of every tensor's full bytes (a collective for the DTensors), in key order."""
    import hashlib

    from torch.distributed.tensor import DTensor
    h = hashlib.sha256()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}.{key}", value[key])
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        elif isinstance(value, torch.Tensor):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            h.update(prefix.encode())
            h.update(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={value!r}".encode())

    walk("", state)
    return h.hexdigest()


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(Path(sys.argv[4]).read_text())
    out = Path(spec["out"]) / f"rank{rank}.json"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    warnings.simplefilter("ignore")
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from registry import Registry

    reg = Registry.open(url=spec["url"], root=spec["root"], durable=spec.get("durable"))
    results: dict[str, Any] = {}
    for sc in spec["runs"]:
        run, every, total = sc["run"], sc["every"], sc["total"]
        model, opt = build(world)
        start, resumed = 0, None
        if sc.get("resume"):
            state = state_of(model, opt, 0)
            got = reg.load_into(f"{run}@latest", state, timeout=30)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            start = resumed = int(state["step"])
            assert got.step == start
        losses: dict[int, float] = {}
        for step in range(start, total):
            x, y = batch(step, rank)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[step] = float(loss.detach())
            done = step + 1
            if done % every == 0:
                reg.publish(run, done, state_of(model, opt, done), sharded=True, timeout=30,
                            metrics={"loss": losses[step]})
            if done == sc.get("kill_after"):
                results[run] = {"losses": losses, "resumed_at": resumed, "killed_after": done}
                out.write_text(json.dumps(results))
                dist.barrier()  # both ranks got this far: the group dies together, mid-run
                os.kill(os.getpid(), signal.SIGKILL)
        results[run] = {"losses": losses, "resumed_at": resumed, "fp": fingerprint(state_of(model, opt, total))}
        out.write_text(json.dumps(results))
    reg.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
