"""``load(broadcast=True)`` in a real 2-rank gloo group from an ``s3://`` root: rank 0 downloads, every rank gets it.

Only rank 0 has the catalog and the bucket (the worker hands the other rank
an empty catalog and an empty filesystem root), so a rank that read the
bucket or the catalog itself would fail; the tensors it ends with can only
have come over the wire.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import obstore
import pytest
import torch

from registry import Registry
from registry.records import Status
from tests._dist_worker import checkpoint_fingerprint
from tests.helpers import run_ranks

pytestmark = pytest.mark.distributed


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(seed, seed + 5)}


SCENARIOS = [
    {"name": "broadcast", "ref": "main@2", "strategy": "broadcast"},
    {"name": "auto-latest", "ref": "main", "strategy": "auto", "bucket": 1 << 20},
    {"name": "unverified", "ref": "main@1", "strategy": "broadcast", "verify": False},
    {"name": "fallback", "ref": "fb@latest", "strategy": "auto"},
    {"name": "corrupt-one-step", "ref": "bad@1", "strategy": "broadcast"},
    {"name": "shared-fs", "ref": "main@2", "strategy": "shared-fs"},
    {"name": "after-errors", "ref": "main@1", "strategy": "auto"},
]


def test_broadcast_from_a_bucket_on_every_rank(catalog_url: str, s3_root: str, tmp_path: Path) -> None:
    opt = {"state": {0: {"m": torch.ones(16)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    with Registry.open(catalog_url, root=s3_root) as reg:
        for step in (1, 2):
            reg.publish("main", step, state(step), extra={"optimizer": opt}, config={"s": step})
        for step in (1, 2):
            reg.publish("fb", step, state(10 + step))
        reg.publish("bad", 1, state(20))
        assert reg.objects is not None
        for ref in ("fb@2", "bad@1"):
            key = f"{reg.resolve(ref).path.as_posix()}/model.safetensors"
            raw = bytearray(reg.objects.get(key))
            raw[-2] ^= 0xFF
            obstore.put(reg.objects.store, key, bytes(raw))
        expected = {ref: checkpoint_fingerprint(reg.load(ref)) for ref in ("main@1", "main@2", "fb@1")}
    out = tmp_path / f"out-{time.monotonic_ns()}"
    out.mkdir()
    spec = {"root": s3_root, "url": catalog_url, "out": str(out), "scenarios": SCENARIOS, "pg_timeout": 30}
    (out / "spec.json").write_text(json.dumps(spec))
    assert run_ranks("tests._dist_worker", 2, out / "spec.json", deadline_s=180) == [0, 0]
    results: list[dict[str, Any]] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    def loaded(name: str, ref: str, step: int) -> None:
        got = [r[name] for r in results]
        assert all(g["ok"] for g in got), got
        assert {g["fp"] for g in got} == {expected[ref]}, f"{name}: a rank differs from a local load"
        assert {g["step"] for g in got} == {step}
        assert {g["strategy"] for g in got} == {"broadcast"}, got  # nothing to map: the bytes travel

    loaded("broadcast", "main@2", 2)
    loaded("auto-latest", "main@2", 2)
    loaded("unverified", "main@1", 1)
    loaded("fallback", "fb@1", 1)
    assert all(any("falling back" in w for w in r["fallback"]["warnings"]) for r in results)
    for name, error in (("corrupt-one-step", "CorruptCheckpointError"), ("shared-fs", "InvalidStateError")):
        got = [r[name] for r in results]
        assert [g["ok"] for g in got] == [False, False] and {g["type"] for g in got} == {error}, got
        assert len({g["msg"] for g in got}) == 1 and "\n" not in got[0]["msg"]
    assert "s3://" in results[1]["corrupt-one-step"]["msg"]  # rank 1 hears the step's URL from rank 0
    loaded("after-errors", "main@1", 1)
    with Registry.open(catalog_url, root=s3_root) as reg:
        assert [reg.catalog.get(run, step).status for run, step in (("fb", 2), ("bad", 1))] == [Status.CORRUPT] * 2
        assert reg.catalog.get("main", 2).status == Status.VERIFIED
        assert all(not reg.catalog.leased_steps(run) for run in ("main", "fb", "bad"))
