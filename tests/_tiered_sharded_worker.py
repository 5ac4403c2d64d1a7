"""One rank of a real gloo group publishing sharded steps to a tiered root (a fast directory over ``s3://``) and
loading them back, as one host's ranks do.

Run as ``python -m tests._tiered_sharded_worker RANK WORLD PORT SPEC``. Every
rank opens the same catalog, the same fast directory (``root``, the ranks of
one host; a list: each rank's own, ranks on several hosts) and the same durable
tier. A scenario publishes (``hold``: rank 0
keeps its replicator from starting, then the group dies at once, a host lost
before it replicated; ``stall``: the rounds never run, and the ranks go on),
waits for a step's durable copy (rank 0), or loads into zeros and reports a
fingerprint of the full tensors and the warnings the load gave. Outcomes go to
``OUT/rank<N>.json`` after each scenario.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests._s3_sharded_worker import fingerprint, full_state, gathered, sharded, zeros_like


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(Path(sys.argv[4]).read_text())
    out = Path(spec["out"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.get("pg_timeout", 20)))
    warnings.simplefilter("ignore")
    from registry import Registry

    results: dict[str, Any] = {}
    stalled = False
    root = spec["root"][rank] if isinstance(spec["root"], list) else spec["root"]
    reg = Registry.open(url=spec["url"], root=root, durable=spec["durable"])
    for sc in spec["scenarios"]:
        name = sc["name"]
        held = None
        try:
            state = sharded(full_state(sc.get("seed", 0)), world)
            if sc["op"] == "publish":
                if sc.get("crash", {}).get("rank") == rank:
                    from registry.crashpoints import arm
                    arm(sc["crash"]["at"])
                if sc.get("hold") and rank == 0:  # the host dies before its replicator ever runs
                    held = reg._replication()._drain_lock
                    held.acquire()
                if sc.get("hold") or sc.get("stall"):  # several hosts: the rounds queue behind one that never ends
                    from registry.distributed.parts import _ROUNDS
                    _ROUNDS.submit(threading.Event().wait)
                    stalled = True
                info = reg.publish(sc["run"], sc["step"], state, sharded=True, timeout=20,
                                   config={"rank": rank}, blocking=not sc.get("async"),
                                   overwrite=sc.get("overwrite", False))
                if sc.get("async"):
                    info = info.result(timeout=120)
                if sc.get("hold") or sc.get("stall"):  # no rank leaves (taking the store with it) mid-collective
                    dist.barrier()
                results[name] = {"ok": True, "step": info.step, "status": str(info.status),
                                 "path": info.path.as_posix()}
            elif sc["op"] == "fsck":
                report = reg.fsck(repair=sc.get("repair", False))
                results[name] = {"ok": True, "problems": [f"{p.kind} {p.step} {p.path}" for p in report.problems]}
            elif sc["op"] == "wait_durable":
                if rank == 0:
                    copy = reg.wait_durable(sc["run"], sc["step"], timeout=60)
                    results[name] = {"ok": True, "status": copy.status, "path": copy.path}
                dist.barrier()
            elif sc["op"] == "load":
                template = zeros_like(state)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = reg.load_into(sc["ref"], template, timeout=20)
                results[name] = {"ok": True, "step": got.step, "fp": fingerprint(gathered(template)),
                                 "extra": template["extra"], "config": got.config,
                                 "fell_back": got.fallback is not None,
                                 "warned": [str(w.message) for w in caught if w.category is RuntimeWarning]}
        except Exception as exc:  # recorded for the parent to compare across ranks
            results[name] = {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
        (out / f"rank{rank}.json").write_text(json.dumps(results))
        if sc.get("crash") is not None:
            sys.stdout.flush()
            os._exit(0)  # the group lost a rank: it cannot be torn down cleanly
        if held is not None or sc.get("hold"):
            sys.stdout.flush()
            os._exit(0)  # lost with the host: nothing replicated, nothing closed
    if not stalled:  # closing waits for the replication rounds, which a stall keeps from ever running
        reg.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
