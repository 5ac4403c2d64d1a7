"""A trainer or a consumer of ``tests/test_policy_mix.py``, run as ``python -m tests._policy_mix_worker ROLE ...``.

``trainer URL ROOT END KILL_VERSION KILL_POINT``: publishes policy versions from the one after the run's newest
live version up to ``END`` (exclusive), each as ``delta="auto"`` with ``KeepLast(2)`` after it and a fold now and
then, arming the crash point ``KILL_POINT`` just before version ``KILL_VERSION`` (``-1``: none).

``consumer URL ROOT NAME DIE_AT``: subscribes as ``NAME``, takes a lease on the newest version, materializes it,
checks every byte against :func:`weights`, applies it and releases it; SIGKILLs itself after ``DIE_AT``
(``leased``, ``materialized``, ``applied`` or ``never``). Prints one JSON line of what it did; exits 3 if the
materialized weights differ from the version's.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

RUN = "mix"
STEP = 10  # version v is step v * STEP


def weights(version: int) -> dict[str, torch.Tensor]:
    """Version ``version``'s tensors: a seeded start, then per version one unit in the last place on a seeded
    tenth of each tensor's elements (as an optimizer step of RL fine-tuning moves bf16 weights)."""
    g = torch.Generator().manual_seed(1234)
    state = {"embed": (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16),
             "mlp.up": (torch.randn(32, 96, generator=g) * 0.02).to(torch.bfloat16),
             "norm": torch.randn(32, generator=g)}
    for v in range(1, version + 1):
        g = torch.Generator().manual_seed(v)
        for t in state.values():
            flat = t.reshape(-1)
            where = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 10)]
            bits = flat.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)
            bits[where] += 1
    return state


def trainer(url: str, root: str, end: int, kill_version: int, kill_point: str) -> None:
    from registry import Registry
    from registry.crashpoints import arm
    from registry.errors import CheckpointNotFoundError, RegistryError
    from registry.records import LIVE
    from registry.retention import KeepLast
    with Registry.open(url=url, root=root, full_every=3) as reg:
        try:
            rows = reg.checkpoints(RUN)
        except CheckpointNotFoundError:  # the first round: no run yet
            rows = []
        live = [c.policy_version for c in rows if c.status in LIVE and c.policy_version is not None]
        start = max(live) + 1 if live else 0
        for version in range(start, end):
            if version == kill_version:
                arm(kill_point)
            reg.publish(RUN, version * STEP, weights(version), policy_version=version, delta="auto",
                        retention=KeepLast(2))
            if version % 3 == 2:  # kept deltas stored whole, so their chains' older steps go
                reg.apply_retention(RUN, KeepLast(2), reanchor=True)
            if version % 4 == 3:
                try:
                    reg.fold(RUN, version - 2, version)
                except RegistryError:  # version - 2 was deleted, or never published (a kill): no fold
                    pass
    print(json.dumps({"published": list(range(start, end))}))


def consumer(url: str, root: str, name: str, die_at: str) -> None:
    from safetensors.torch import load_file

    from registry import Registry

    def die(phase: str) -> None:
        if die_at == phase:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    with Registry.open(url=url, root=root, create=False) as reg, reg.subscribe(RUN, consumer=name, ttl=3600) as sub:
        lease = next(sub.versions(timeout=60), None)
        if lease is None:
            print(json.dumps({"version": None}))
            return
        print(json.dumps({"version": lease.policy_version, "step": lease.step}), flush=True)
        die("leased")
        path = lease.materialize()
        got = load_file(str(path / "model.safetensors"))
        want = weights(lease.policy_version)
        if set(got) != set(want) or any(not torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
                                        for k in want):
            sys.exit(3)
        die("materialized")
        lease.applied()
        die("applied")
        lease.release()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "trainer":
        trainer(args[0], args[1], int(args[2]), int(args[3]), args[4])
    else:
        consumer(args[0], args[1], args[2], args[3])
