"""One rank of a real gloo group for sharded publish and load, run as ``python -m tests._sharded_worker``.

It joins the group on 127.0.0.1, builds a small transformer sharded with
FSDP2 (``fully_shard``) over every rank and an AdamW, and runs the scenarios
of a JSON spec in order, writing what each produced (an info, a fingerprint
of the full model and optimizer state, or the error) to ``OUT/rank<N>.json``
after each one, so the parent can compare ranks even when one was killed.
Only rank 0 gets the real catalog; the others open an empty catalog with a
root of their own, so a lookup they made would fail, while DCP writes into
the staging directory rank 0 names (the real root is shared).
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests._dist_worker import fingerprint


class Tiny(nn.Module):
    """A small transformer: embedding, two encoder layers, a head."""

    def __init__(self, *, width: int = 16, vocab: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True)
                                    for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build(seed: int, *, fsdp: bool, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer after one training step from ``seed`` (same on every rank before sharding)."""
    torch.manual_seed(seed)
    model = Tiny()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, seed)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One training step: changes every parameter and the optimizer's moments in place."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 24, (4, 6), generator=g)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def full_fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[str | None, dict[str, Any] | None]:
    """(digest, flat tensors) of the full model and optimizer state on rank 0 (a collective)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None, None
    flat, _ = flatten_state_dict({"model": msd, "optim": osd})
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    return fingerprint(flat), tensors


def gate(release: Path, *, deadline_s: float) -> Any:
    """A retention policy whose evaluation waits until ``release`` appears, then fails: a gc that outlasts
    the collectives' timeout (the file comes from a rank once its publish returned), then errs."""
    from registry.retention import Policy

    class _Gate(Policy):
        def keep(self, checkpoints: Any, context: Any) -> Any:
            end = time.monotonic() + deadline_s  # a hang detector: the file comes from another rank
            while not release.exists():
                if time.monotonic() > end:
                    raise TimeoutError(f"{release} never appeared")
                time.sleep(0.01)
            raise RuntimeError("retention refused by the test")
    return _Gate()


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(Path(sys.argv[4]).read_text())
    out = Path(spec["out"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.get("pg_timeout", 30)))
    warnings.simplefilter("ignore")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from registry import Registry
    from registry.crashpoints import arm

    url = spec["url"] if rank == 0 else f"sqlite:///{out / f'empty-{rank}.db'}"
    root = spec["root"] if rank == 0 else str(out / f"empty-root-{rank}")
    results: dict[str, Any] = {}
    with Registry.open(url=url, root=root) as reg:
        for sc in spec["scenarios"]:
            name = sc["name"]
            try:
                if sc.get("crash", {}).get("rank") == rank:
                    arm(sc["crash"]["at"])
                group = dist.new_group(list(range(world))) if sc.get("group") else None
                timeout = sc.get("timeouts", {}).get(str(rank), sc.get("timeout", 20))
                model, opt = build(sc.get("seed", 0), fsdp=sc.get("fsdp", True), world=world)
                msd, osd = get_state_dict(model, opt)
                state: dict[str, Any] = {"model": msd, "optim": osd, "counter": torch.tensor([sc.get("seed", 0)])}
                if sc.get("add_key"):
                    state["new"] = torch.zeros(3)
                if sc.get("drop_counter"):
                    del state["counter"]
                if sc.get("bad_rank") == rank:
                    state["bad"] = lambda: None  # cannot be pickled: this rank's write fails
                if sc["op"] == "publish-async":  # publishes in a row, each followed by a training step
                    futures, fps = [], []
                    for i, step in enumerate(sc["steps"]):
                        # rank 0 holds the catalog's write lock until every rank has trained: the background
                        # claim waits for it, so no rank writes a byte before its state changed
                        lock = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
                        if rank == 0:
                            lock.execute("BEGIN IMMEDIATE")
                        futures.append(reg.publish(sc["run"], step, state, sharded=True, blocking=False,
                                                   timeout=timeout, group=group, metrics={"loss": 1.0 + rank}))
                        fp, full = full_fingerprint(model, opt)  # FSDP's collectives while the publish runs
                        if full is not None:
                            torch.save(full, out / f"full-{sc['run']}-{step}.pt")
                        fps.append(fp)
                        train(model, opt, 100 + i)
                        dist.barrier()
                        lock.close()  # rolls back: the claim goes ahead
                    outcomes: list[dict[str, Any]] = []
                    for future in futures:
                        try:
                            outcomes.append({"ok": True, "step": future.result(timeout=120).step})
                        except Exception as exc:
                            outcomes.append({"ok": False, "type": type(exc).__name__, "msg": str(exc)})
                    try:
                        reg.wait()
                        waited = "ok"
                    except Exception as exc:
                        waited = type(exc).__name__
                    results[name] = {"ok": True, "futures": outcomes, "fps": fps, "wait": waited}
                elif sc["op"] == "publish":
                    release = out / f"release-{name}"
                    retention = gate(release, deadline_s=120) if sc.get("gate") else None
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        try:
                            info = reg.publish(sc["run"], sc["step"], state, sharded=True, timeout=timeout,
                                               group=group, metrics={"loss": 1.0 + rank}, tags=sc.get("tags", ()),
                                               config={"rank": rank}, epoch=rank, policy_version=sc.get("policy"),
                                               blocking=not sc.get("async"), retention=retention)
                            if sc.get("async"):
                                try:
                                    info = info.result(timeout=120)
                                finally:
                                    try:
                                        reg.wait()
                                    except Exception:  # the future's error, once more
                                        pass
                        finally:
                            if retention is not None and rank != 0:
                                release.touch()  # this rank's publish returned: rank 0's gc may end
                    results[name + ":warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                                                   if w.category.__name__ == "RetentionWarning"]
                    fp, full = full_fingerprint(model, opt)
                    if full is not None:
                        torch.save(full, out / f"full-{sc['run']}-{sc['step']}.pt")
                    results[name] = {"ok": True, "step": info.step, "status": str(info.status),
                                     "path": str(info.path), "metrics": info.metrics, "fp": fp}
                elif sc["op"] == "full-broadcast":  # the whole state on every rank, through the full-load path
                    ckpt = reg.load(sc["ref"], broadcast=True, strategy=sc.get("strategy", "auto"), timeout=20)
                    results[name] = {"ok": True, "step": ckpt.step, "fp": fingerprint(ckpt.state_dict)}
                elif sc["op"] == "load":
                    ref = sc.get("refs", {}).get(str(rank), sc.get("ref"))
                    got = reg.load_into(ref, state, timeout=timeout, strict=sc.get("strict", True),
                                        keys=sc.get("keys"), group=group)
                    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                    fp, _ = full_fingerprint(model, opt)
                    counter = int(state["counter"][0]) if "counter" in state else None
                    results[name] = {"ok": True, "step": got.step, "fp": fp, "counter": counter,
                                     "missing": list(got.missing_keys), "unexpected": list(got.unexpected_keys),
                                     "config": got.config, "fallback": got.fallback is not None}
            except Exception as exc:  # recorded for the parent to compare across ranks
                results[name] = {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
            (out / f"rank{rank}.json").write_text(json.dumps(results))
            if sc.get("crash") is not None or (sc.get("gate") and not results[name]["ok"]):
                break  # a gated publish that failed here leaves the peers mid-collective: end the group
    sys.stdout.flush()
    os._exit(0)  # a group that lost a rank cannot be torn down cleanly


if __name__ == "__main__":
    main()
