"""A host's copy of a new policy version starts from its copy of an older one: one delta applied, not the chain."""

from __future__ import annotations

import torch

from registry import Registry
from registry.ops.hostcopies import HOST_CACHE
from registry.records import Status
from tests.helpers import flip_stored_byte

RUN = "rl"


def version(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16)
    for k in range(1, v + 1):
        where = torch.randperm(w.numel(), generator=torch.Generator().manual_seed(k))[:200]
        w.view(-1).view(torch.int16)[where] += 1
    return {"w": w, "b": torch.arange(8, dtype=torch.float32) * v}


def test_a_new_version_is_built_from_the_hosts_older_copy_and_leaves_it_as_it_was(reg: Registry) -> None:
    reg.publish(RUN, 0, version(0), policy_version=0, delta="auto")
    with reg.subscribe(RUN, consumer="rollout-0", ttl=60) as sub:
        versions = sub.versions(newest_only=False, timeout=0)
        first = next(versions)
        assert first.policy_version == 0
        first.materialize()
        first.applied()
        reg.publish(RUN, 10, version(1), policy_version=1, delta="auto")
        second = next(versions)
        older = second.materialize()
        second.applied()
        held = (older / "model.safetensors").read_bytes()
        reg.publish(RUN, 20, version(2), policy_version=2, delta="auto")
        assert [x.kind for x in reg.policy_versions(RUN)] == ["full", "delta", "delta"]
        # the full base is damaged now: only a rebuild that starts from this host's copy of version 1 succeeds
        flip_stored_byte(reg, reg.resolve(f"{RUN}@0"), "model.safetensors", offset=-3)
        third = next(versions)
        assert third.policy_version == 2
        newest = third.materialize()
        assert (older / "model.safetensors").read_bytes() == held  # version 1's copy is as it was
        third.applied()
    from safetensors.torch import load_file
    got = load_file(str(newest / "model.safetensors"))
    assert all(torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)) for k, t in version(2).items())
    (load,) = reg.loads(RUN, policy_version=2)
    assert load.verified and load.bytes_fetched > 0 and load.source != HOST_CACHE
    assert load.source == str(reg.resolve(f"{RUN}@20").path)  # the delta's copy: the chain's last link
    assert reg.resolve(f"{RUN}@0").status == Status.VERIFIED  # never read: nothing condemned it
