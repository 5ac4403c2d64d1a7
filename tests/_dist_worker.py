"""One rank of a real gloo process group, run as ``python -m tests._dist_worker``.

It joins the group on 127.0.0.1, runs the scenarios of a JSON spec in order
and writes what every scenario produced (a fingerprint of the checkpoint, or
the error type and message) to ``OUT/rank<N>.json`` after each one, so the
parent can compare ranks even when one of them was killed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def fingerprint(obj: Any) -> str:
    """A digest of everything a load returns: exact bytes, dtypes, shapes, values."""
    sha = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            sha.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                sha.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            sha.update(b"D")
            for k in sorted(x, key=repr):
                sha.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            sha.update(b"L" if isinstance(x, list) else b"U")
            for v in x:
                walk(v)
        else:
            sha.update(f"{type(x).__name__}:{x!r}".encode())

    walk(obj)
    return sha.hexdigest()


def checkpoint_fingerprint(ckpt: Any) -> str:
    return fingerprint({"state": ckpt.state_dict, "extra": ckpt.extra, "meta": ckpt.meta,
                        "config": ckpt.config, "epoch": ckpt.epoch, "consumed": ckpt.consumed_samples,
                        "step": ckpt.step, "policy": ckpt.policy_version})


def replace_files(source: Path, target: Path) -> None:
    """Every file of ``target`` replaced (new inodes, so rank 0's maps keep the old bytes) by ``source``'s."""
    for path in sorted(source.iterdir()):
        staged = target / f".swap-{path.name}"
        shutil.copyfile(path, staged)
        os.replace(staged, target / path.name)


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(Path(sys.argv[4]).read_text())
    out = Path(spec["out"]) / f"rank{rank}.json"
    backend = spec.get("backend", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.get("pg_timeout", 30)))
    from registry import Checkpoint, Registry
    from registry.distributed import loader
    from registry.crashpoints import arm

    chosen: list[str] = []

    class Chosen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            chosen.append(record.getMessage().split(" by ")[-1].split(":")[0])

    loader.log.addHandler(Chosen())
    loader.log.setLevel(logging.DEBUG)

    fell_back: list[str] = []  # what the library logged about fallbacks, on this rank

    class FellBack(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING and " fell back " in record.getMessage():
                fell_back.append(record.getMessage())

    logging.getLogger("registry").addHandler(FellBack())

    # A scenario's "swap" gives this rank a different checkpoint at rank 0's path, at the exact
    # moment between rank 0 mapping its files (it sent the plan) and this rank looking at them.
    from registry.distributed.collectives import Comm
    swap: dict[str, str] = {}
    real_broadcast_object = Comm.broadcast_object

    def broadcast_then_swap(self: Comm, obj: Any, what: str) -> Any:
        got = real_broadcast_object(self, obj, what)
        if isinstance(got, loader.Plan) and swap:
            replace_files(Path(swap.pop("from")), Path(got.path))
        return got

    Comm.broadcast_object = broadcast_then_swap  # type: ignore[method-assign]

    # Only rank 0 may consult the catalog: the others get an empty catalog (and, since a root
    # belongs to one catalog, an empty root) of their own, so any lookup they made would fail
    # with CheckpointNotFoundError.
    url = spec["url"] if rank == 0 else f"sqlite:///{Path(spec['out']) / f'empty-{rank}.db'}"
    root = spec["root"] if rank == 0 else str(Path(spec["out"]) / f"empty-root-{rank}")
    results: dict[str, Any] = {}
    with Registry.open(url=url, root=root) as reg:
        for sc in spec["scenarios"]:
            loader.BUCKET_BYTES = sc.get("bucket", 4096)
            if sc.get("crash_rank") == rank:
                arm("loader-after-bucket")
            ref = sc.get("refs", {}).get(str(rank), sc.get("ref"))
            where = sc.get("map_locations", {}).get(str(rank), "cpu")
            timeout = sc.get("timeouts", {}).get(str(rank), sc.get("timeout"))
            chosen.clear()
            swap.clear()
            fell_back.clear()
            injected = sc.get("inject") if rank == 0 else None
            if injected:  # a bug (not a RegistryError) on rank 0 at one named place in the protocol
                real = getattr(loader, injected)

                def bug(*args: Any, _injected: str = injected, **kwargs: Any) -> Any:
                    raise RuntimeError(f"injected fault in {_injected}")
                setattr(loader, injected, bug)
            if str(rank) in sc.get("swap", {}):
                swap["from"] = sc["swap"][str(rank)]
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if "dir" in sc:
                        ckpt = Checkpoint.load(sc["dir"], broadcast=True, verify_checksums=sc.get("verify", True),
                                               strategy=sc["strategy"], timeout=timeout)
                    else:
                        ckpt = reg.load(ref, broadcast=True, verify=sc.get("verify", True), map_location=where,
                                        strategy=sc["strategy"],
                                        timeout=timeout, trust_pickle=sc.get("trust_pickle", False))
                results[sc["name"]] = {"ok": True, "fp": checkpoint_fingerprint(ckpt), "step": ckpt.step,
                                       "devices": sorted({t.device.type for t in ckpt.state_dict.values()}),
                                       "strategy": chosen[-1] if chosen else None,
                                       "fell_back": list(fell_back),
                                       "warnings": [str(w.message) for w in caught
                                                    if issubclass(w.category, RuntimeWarning)]}
            except Exception as exc:  # recorded for the parent to compare across ranks
                path = getattr(exc, "path", None)
                results[sc["name"]] = {"ok": False, "type": type(exc).__name__, "msg": str(exc),
                                       "run": getattr(exc, "run", None), "step": getattr(exc, "step", None),
                                       "path": str(path) if path is not None else None}
            finally:
                if injected:
                    setattr(loader, injected, real)
            out.write_text(json.dumps(results))
            if sc.get("crash_rank") is not None:
                break
    sys.stdout.flush()
    # a group that lost a rank cannot be torn down cleanly; leave without waiting on it
    os._exit(0)


if __name__ == "__main__":
    main()
