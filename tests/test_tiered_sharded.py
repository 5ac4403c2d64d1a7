"""Sharded (DCP) checkpoints on a tiered root: real 2-rank gloo groups, a real S3 server, both catalogs.

The ranks of one host publish to its fast directory, and the step is
replicated to the durable tier in the background like any step (its DCP
files and ``.metadata`` by the manifest, every piece checked). A fresh host
(another fast directory sharing the catalog and the durable tier), or the
publishing host once fast retention removed its copy, loads the step from its
durable copy by ranged GETs at world size 2 and 1, bit for bit. A host lost
before it replicated makes ``@latest`` fall back to the newest step with a
copy that can be read, on every rank, and a load of the lost step fail alike.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import obstore
import pytest
import torch

from registry import Registry
from registry.errors import NoCopyError
from registry.format.sharding import DCP_METADATA
from registry.ops.tiercache import CACHE_DIR
from registry.records import Status
from registry.retention import KeepLast
from tests._s3_sharded_worker import fingerprint, full_state
from tests.helpers import durable_keys, run_ranks

pytestmark = pytest.mark.distributed


def launch(tmp_path: Path, url: str, root: Path, durable: str,
           scenarios: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    out = tmp_path / f"out-{time.monotonic_ns()}"
    out.mkdir()
    spec = out / "spec.json"
    spec.write_text(json.dumps({"url": url, "root": str(root), "durable": durable, "out": str(out),
                                "scenarios": scenarios, "pg_timeout": 15}))
    codes = run_ranks("tests._tiered_sharded_worker", 2, spec, deadline_s=120)
    results = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else {} for r in range(2)]
    return results, codes


def template(seed: int) -> dict[str, Any]:
    """World size 1: full tensors of the right shapes holding zeros, and the non-tensor values to replace."""
    return {**{k: torch.zeros_like(v) for k, v in full_state(seed).items()}, "extra": {"lr": 0.0, "names": []}}


def same_on_both(results: list[dict[str, Any]], name: str) -> dict[str, Any]:
    got = [r[name] for r in results]
    assert got[0] == got[1], got
    return got[0]


def loaded(results: list[dict[str, Any]], name: str, *, seed: int, step: int) -> dict[str, Any]:
    got = same_on_both(results, name)
    assert got["ok"] and got["step"] == step and got["fp"] == fingerprint(full_state(seed)), got
    assert got["extra"] == {"lr": 0.1, "names": ["a", "b"]}
    return got


def test_sharded_publish_on_a_tiered_root_is_replicated_verified_and_retained(
        catalog_url: str, fast: Path, durable: str, tmp_path: Path) -> None:
    results, codes = launch(tmp_path, catalog_url, fast, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "two", "op": "publish", "run": "main", "step": 2, "seed": 2, "async": True},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 2},
        {"name": "load", "op": "load", "ref": "main@latest", "seed": 2},
    ])
    assert codes == [0, 0], results
    for name in ("one", "two"):
        got = same_on_both(results, name)
        assert got["ok"] and got["status"] == "verified" and got["path"].startswith(str(fast)), got
    assert results[0]["durable"]["ok"] and results[0]["durable"]["status"] == "verified", results
    loaded(results, "load", seed=2, step=2)
    with Registry.open(catalog_url, root=fast, durable=durable) as reg:
        for step in (1, 2):
            info = reg.resolve(f"main@{step}")
            copy = reg.wait_durable("main", step, timeout=60)
            assert copy.manifest_sha256 == info.manifest_sha256
            names = sorted(p.name for p in info.path.iterdir())
            assert DCP_METADATA in names and any(n.endswith(".distcp") for n in names)
            assert durable_keys(reg, copy.path) == sorted(f"{copy.path}/{n}" for n in names)
            assert reg.tiers is not None
            for name in names:  # byte for byte, the .metadata and every rank's shards
                assert bytes(reg.tiers.durable.get(f"{copy.path}/{name}")) == (info.path / name).read_bytes()
            kinds = sorted((r.location.split(":")[0], r.status) for r in reg.replicas("main", step))
            assert kinds == [("durable", "verified"), ("fast", "verified")]
        assert [r.ok for r in reg.verify("main")] == [True, True]
        assert not reg.fsck(repair=False).problems
        plan = reg.plan_tier_retention("main", KeepLast(1), tier="fast")
        assert sorted(plan.delete) == [1]
        plan.execute()
        assert not reg.resolve("main@2").path.with_name("step-00000001").exists()
        assert reg.catalog.get("main", 1).status == Status.VERIFIED  # type: ignore[union-attr]
        into = template(1)  # the publishing host, its fast copy gone: read from the durable copy
        got = reg.load_into("main@1", into)
        assert got.step == 1 and fingerprint(into) == fingerprint(full_state(1))
        assert into["extra"] == {"lr": 0.1, "names": ["a", "b"]}
        assert not reg.fsck(repair=False).problems


def test_a_fresh_host_resumes_from_the_durable_tier_at_world_size_two_and_one(
        catalog_url: str, fast: Path, durable: str, tmp_path: Path) -> None:
    results, codes = launch(tmp_path, catalog_url, fast, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "two", "op": "publish", "run": "main", "step": 2, "seed": 2},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 2},
    ])
    assert codes == [0, 0] and results[0]["durable"]["ok"], results
    fresh = tmp_path / "fast-b"
    results, codes = launch(tmp_path, catalog_url, fresh, durable, [
        {"name": "latest", "op": "load", "ref": "main@latest", "seed": 2},
        {"name": "older", "op": "load", "ref": "main@1", "seed": 1},
    ])
    assert codes == [0, 0], results
    assert loaded(results, "latest", seed=2, step=2)["config"] == {"rank": 0}
    loaded(results, "older", seed=1, step=1)
    assert not (fresh / "main").exists() and not (fresh / CACHE_DIR).exists()  # ranged reads, no download
    with Registry.open(catalog_url, root=tmp_path / "fast-c", durable=durable) as reg:
        for seed, step in ((2, 2), (1, 1)):
            into = template(seed)
            got = reg.load_into(f"main@{step}", into)
            assert got.step == step and fingerprint(into) == fingerprint(full_state(seed))
            assert into["extra"] == {"lr": 0.1, "names": ["a", "b"]}
        assert [c.location.split(":")[0] for c in reg.replicas("main", 2)].count("cache") == 0
        assert [r.ok for r in reg.verify("main")] == [True, True]  # their durable copies, re-hashed from here


def test_a_host_lost_before_replicating_resumes_from_the_newest_durable_step(
        catalog_url: str, fast: Path, durable: str, tmp_path: Path) -> None:
    results, codes = launch(tmp_path, catalog_url, fast, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 1},
        {"name": "two", "op": "publish", "run": "main", "step": 2, "seed": 2, "hold": True},
    ])
    assert codes == [0, 0] and results[0]["durable"]["ok"], results
    assert same_on_both(results, "two")["ok"], results
    shutil.rmtree(fast)  # the host is gone, and step 2 with it: it was never durable
    fresh = tmp_path / "fast-b"
    results, codes = launch(tmp_path, catalog_url, fresh, durable, [
        {"name": "latest", "op": "load", "ref": "main@latest", "seed": 1},
        {"name": "lost", "op": "load", "ref": "main@2", "seed": 2},
    ])
    assert codes == [0, 0], results
    assert loaded(results, "latest", seed=1, step=1)["fell_back"] is True
    lost = same_on_both(results, "lost")
    assert not lost["ok"] and lost["type"] == "NoCopyError" and "no verified durable copy" in lost["msg"], lost
    with Registry.open(catalog_url, root=tmp_path / "fast-c", durable=durable) as reg:
        into = template(1)
        with pytest.warns(RuntimeWarning, match="falling back"):
            assert reg.load_into("main@latest", into).step == 1
        assert fingerprint(into) == fingerprint(full_state(1))
        with pytest.raises(NoCopyError):
            reg.load_into("main@2", template(2))
        assert reg.catalog.get("main", 2).status == Status.VERIFIED  # type: ignore[union-attr]  # never condemned


def test_a_damaged_fast_copy_is_condemned_alone_and_the_durable_copy_loads(
        catalog_url: str, fast: Path, durable: str) -> None:
    """In one process (world size 1): bad bytes in this host's fast copy of a step with a verified durable copy
    condemn that copy, not the step, and the same step loads from its durable copy."""
    with Registry.open(catalog_url, root=fast, durable=durable) as reg:
        info = reg.publish("main", 1, {**full_state(4), "extra": {"lr": 0.1, "names": ["a", "b"]}}, sharded=True)
        reg.wait_durable("main", 1, timeout=60)
        data = sorted(p for p in info.path.iterdir() if p.name.endswith(".distcp"))[0]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
        into = template(4)
        with pytest.warns(RuntimeWarning, match="durable copy of the same step"):
            assert reg.load_into("main@1", into).step == 1
        assert fingerprint(into) == fingerprint(full_state(4))
        assert reg.catalog.get("main", 1).status == Status.VERIFIED  # type: ignore[union-attr]
        copies = {r.location.split(":")[0]: r.status for r in reg.replicas("main", 1)}
        assert copies == {"durable": "verified", "fast": "corrupt"}


def test_a_damaged_durable_copy_read_by_ranges_is_condemned_alone(
        catalog_url: str, fast: Path, durable: str, tmp_path: Path) -> None:
    """In one process: a fresh host reading a step's durable copy by ranged GETs finds a bad piece; read again
    from storage it still differs, so that copy is marked corrupt, ``@latest`` falls back to the step before, and
    the step itself stands on its fast copy on the host that wrote it."""
    with Registry.open(catalog_url, root=fast, durable=durable) as reg:
        for step in (1, 2):
            reg.publish("main", step, {**full_state(step), "extra": {"lr": 0.1, "names": ["a", "b"]}},
                        sharded=True)
            reg.wait_durable("main", step, timeout=60)
        assert reg.tiers is not None
        objects, copy = reg.tiers.durable, reg.wait_durable("main", 2)
        key = sorted(k for k in durable_keys(reg, copy.path) if k.endswith(".distcp"))[0]
        raw = bytearray(objects.get(key))
        raw[len(raw) // 2] ^= 0xFF
        obstore.put(objects.store, key, bytes(raw))
    with Registry.open(catalog_url, root=tmp_path / "fast-b", durable=durable) as reg:
        into = template(1)
        with pytest.warns(RuntimeWarning, match="durable copy is corrupt"):
            assert reg.load_into("main@latest", into).step == 1
        assert fingerprint(into) == fingerprint(full_state(1))
        with pytest.raises(NoCopyError, match="no copy this host can read"):
            reg.load_into("main@2", template(2))
        copies = {r.location.split(":")[0]: r.status for r in reg.replicas("main", 2)}
        assert copies == {"durable": "corrupt", "fast": "verified"}
        assert reg.catalog.get("main", 2).status == Status.VERIFIED  # type: ignore[union-attr]
    with Registry.open(catalog_url, root=fast, durable=durable) as reg:
        into = template(2)
        assert reg.load_into("main@latest", into).step == 2
        assert fingerprint(into) == fingerprint(full_state(2))


def test_a_sharded_tail_refuses_files_another_host_holds(tmp_path: Path) -> None:
    """Ranks on hosts with fast directories of their own write their shards there, not into rank 0's staging
    directory: the tail refuses to list files it does not hold, so no step commits with shards elsewhere."""
    from registry.errors import PublishError
    from registry.format.manifest import FileEntry
    from registry.format.sharding import layout_of
    from registry.roots.shards import FileShards
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"x")
    entries = {name: FileEntry(name=name, size=1, sha256="0" * 64) for name in ("__0_0.distcp", "__1_0.distcp")}
    with pytest.raises(PublishError, match=r"1 files .* \(first: __1_0.distcp\).* not supported"):
        FileShards().tail(str(staging), entries=entries, layout=layout_of(entries, 2), tensors=(), meta={},
                          meta_raw=b"{}", config_raw=b"{}")
    assert sorted(p.name for p in staging.iterdir()) == ["__0_0.distcp"]
