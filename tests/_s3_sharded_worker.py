"""One rank of a real gloo group publishing sharded steps to an ``s3://`` root and loading them back.

Run as ``python -m tests._s3_sharded_worker RANK WORLD PORT SPEC``. Every
rank opens the same catalog and the same bucket (each uploads its own
shards); the state is DTensors sharded over the ranks plus a replicated
counter and a non-tensor value. Each scenario's outcome (an info, a
fingerprint of the full tensors, or the error) goes to ``OUT/rank<N>.json``
after it ran, so the parent can compare ranks even when one was killed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SHAPES = {"model.embed": (96, 16), "model.w": (64, 48), "model.head": (40, 8)}


def full_state(seed: int, *, big: int = 0) -> dict[str, Any]:
    """The full (unsharded) tensors of seed ``seed``: what every rank shards and what a load must give back.

    ``big`` adds a ``model.big`` tensor of that many float32 rows of 1024 (a multipart upload per rank)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {k: torch.randn(*shape, generator=g) for k, shape in SHAPES.items()}
    out["model.half"] = torch.randn(30, 6, generator=g).to(torch.bfloat16)
    if big:
        out["model.big"] = torch.randn(big, 1024, generator=g)
    out["counter"] = torch.tensor([seed], dtype=torch.int64)
    return out


def fingerprint(flat: dict[str, Any]) -> str:
    """A digest of the tensors' bytes, in key order (full tensors, on any rank)."""
    h = hashlib.sha256()
    for key in sorted(flat):
        value = flat[key]
        if isinstance(value, torch.Tensor):
            h.update(key.encode())
            h.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sharded(full: dict[str, Any], world: int) -> dict[str, Any]:
    """``full`` as every rank passes it: model tensors as DTensors sharded on dim 0, the counter replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    model = {k.split(".", 1)[1]: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()
             if k.startswith("model.")}
    return {"model": model, "counter": full["counter"].clone(), "extra": {"lr": 0.1, "names": ["a", "b"]}}


def gathered(state: dict[str, Any]) -> dict[str, Any]:
    """The full tensors of a nested sharded state (a collective for the DTensors)."""
    from torch.distributed.tensor import DTensor
    flat = {f"model.{k}": (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state["model"].items()}
    flat["counter"] = state["counter"]
    return flat


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    """A template of the same layout holding zeros (so a load that did nothing shows)."""
    from torch.distributed.tensor import DTensor
    model = {k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, shape=v.shape,
                                   stride=v.stride()) for k, v in state["model"].items()}
    return {"model": model, "counter": torch.zeros_like(state["counter"]), "extra": {"lr": 0.0, "names": []}}


def bad_credentials(reg: Any) -> Any:
    """Give this rank's object root a store whose secret the server refuses; returns the store to put back."""
    from registry.fs.objects import ObjectRoot
    objects = reg.root.object_store()
    good = objects.store
    objects.store = ObjectRoot(objects.location, dataclasses.replace(objects.config,
                                                                     secret_access_key="not-the-secret")).store
    return good


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(Path(sys.argv[4]).read_text())
    out = Path(spec["out"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.get("pg_timeout", 20)))
    warnings.simplefilter("ignore")
    from registry import Registry
    from registry.crashpoints import arm

    results: dict[str, Any] = {}
    with Registry.open(url=spec["url"], root=spec["root"]) as reg:
        for sc in spec["scenarios"]:
            name = sc["name"]
            good = None
            try:
                if sc.get("crash", {}).get("rank") == rank:
                    arm(sc["crash"]["at"])
                if sc.get("bad_rank") == rank:
                    good = bad_credentials(reg)
                state = sharded(full_state(sc.get("seed", 0), big=sc.get("big", 0)), world)
                if sc["op"] == "publish":
                    info = reg.publish(sc["run"], sc["step"], state, sharded=True, timeout=sc.get("timeout", 20),
                                       metrics={"loss": 1.0 + rank}, config={"rank": rank},
                                       blocking=not sc.get("async"))
                    if sc.get("async"):
                        info = info.result(timeout=120)
                    results[name] = {"ok": True, "step": info.step, "status": str(info.status),
                                     "path": info.path.as_posix(), "url": info.url}
                elif sc["op"] == "load":
                    template = zeros_like(state)
                    got = reg.load_into(sc["ref"], template, timeout=sc.get("timeout", 20),
                                        verify=sc.get("verify", True))
                    results[name] = {"ok": True, "step": got.step, "fp": fingerprint(gathered(template)),
                                     "extra": template["extra"], "config": got.config}
            except Exception as exc:  # recorded for the parent to compare across ranks
                results[name] = {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
            finally:
                if good is not None:
                    reg.root.object_store().store = good
            (out / f"rank{rank}.json").write_text(json.dumps(results))
            if sc.get("crash") is not None:
                break  # the group lost a rank
    sys.stdout.flush()
    os._exit(0)  # a group that lost a rank cannot be torn down cleanly


if __name__ == "__main__":
    main()
