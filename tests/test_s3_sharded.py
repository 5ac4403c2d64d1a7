"""Sharded (DCP) publish and ``load_into`` on an ``s3://`` root, with real 2-rank gloo groups and a real S3 server.

Every rank uploads its own shards to the step's attempt prefix, rank 0 the
``.metadata`` and the manifest last, and the catalog commit makes the step
visible; a load fetches on each rank only the byte ranges its shards need,
every piece checked. The steps a group publishes are loaded back at world
size 2 (in the group) and 1 (here, into full tensors), and a step saved at
world size 1 is resharded onto the group, bit for bit.
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
from registry.errors import CorruptCheckpointError
from registry.fs import multipart
from registry.records import Status
from tests._s3_sharded_worker import fingerprint, full_state
from tests.helpers import run_ranks

pytestmark = pytest.mark.distributed


def launch(tmp_path: Path, url: str, root: str, scenarios: list[dict[str, Any]]) -> tuple[list[dict[str, Any]],
                                                                                          list[int]]:
    out = tmp_path / f"out-{time.monotonic_ns()}"
    out.mkdir()
    spec = out / "spec.json"
    spec.write_text(json.dumps({"url": url, "root": root, "out": str(out), "scenarios": scenarios,
                                "pg_timeout": 15}))
    codes = run_ranks("tests._s3_sharded_worker", 2, spec, deadline_s=120)
    results = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else {} for r in range(2)]
    return results, codes


def template(seed: int) -> dict[str, Any]:
    """World size 1: full tensors of the right shapes holding zeros, and the non-tensor values to replace."""
    return {**{k: torch.zeros_like(v) for k, v in full_state(seed).items()}, "extra": {"lr": 0.0, "names": []}}


def leftovers(reg: Registry, run: str) -> tuple[list[str], list[str]]:
    """Every key under ``run`` and every incomplete multipart upload under the root."""
    objects = reg.root.object_store()
    assert objects is not None
    keys = [e.rel for e in objects.list(run)]
    prefix = objects.key() + "/" if objects.key() else ""
    return keys, [u.key for u in multipart.list_uploads(objects.config, prefix)]


def test_publish_and_load_in_one_process(catalog_url: str, s3_root: str) -> None:
    """Without a process group the same sequence runs in one process: publish, verify, load, fsck."""
    with Registry.open(catalog_url, root=s3_root) as reg:
        info = reg.publish("solo", 1, full_state(3), sharded=True, config={"c": 1})
        assert info.status == Status.VERIFIED and info.url is not None and info.url.startswith("s3://")
        assert [r.ok for r in reg.verify("solo@1")] == [True]
        into = template(3)
        del into["extra"]
        got = reg.load_into("solo@1", into)
        assert got.step == 1 and got.config == {"c": 1}
        assert fingerprint(into) == fingerprint(full_state(3))
        assert not reg.fsck(repair=False).problems


def test_two_ranks_publish_then_load_at_world_size_two_and_one(catalog_url: str, s3_root: str,
                                                               tmp_path: Path) -> None:
    with Registry.open(catalog_url, root=s3_root) as reg:  # a step saved at world size 1, resharded onto 2 below
        reg.publish("one", 1, {**full_state(7), "extra": {"lr": 0.1, "names": ["a", "b"]}}, sharded=True)
    results, codes = launch(tmp_path, catalog_url, s3_root, [
        {"name": "reshard", "op": "load", "ref": "one@1", "seed": 7},
        {"name": "publish", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "async", "op": "publish", "run": "main", "step": 2, "seed": 2, "async": True},
        {"name": "load", "op": "load", "ref": "main@1", "seed": 1},
        {"name": "latest", "op": "load", "ref": "main@latest", "seed": 2},
        {"name": "unverified", "op": "load", "ref": "main@1", "seed": 1, "verify": False},
        {"name": "bad-upload", "op": "publish", "run": "main", "step": 3, "seed": 3, "bad_rank": 1},
        {"name": "after", "op": "publish", "run": "main", "step": 4, "seed": 4},
    ])
    assert codes == [0, 0], results
    for name in ("publish", "async", "after"):
        got = [r[name] for r in results]
        assert all(g["ok"] for g in got), got
        assert got[0] == got[1] and got[0]["status"] == "verified" and got[0]["url"].startswith(s3_root)
    for name, seed, step in (("load", 1, 1), ("latest", 2, 2), ("unverified", 1, 1), ("reshard", 7, 1)):
        got = [r[name] for r in results]
        assert all(g["ok"] for g in got), got
        assert {g["fp"] for g in got} == {fingerprint(full_state(seed))} and {g["step"] for g in got} == {step}
        assert all(g["extra"] == {"lr": 0.1, "names": ["a", "b"]} for g in got)
        assert got[0]["config"] == ({} if name == "reshard" else {"rank": 0})
    failed = [r["bad-upload"] for r in results]
    assert [g["ok"] for g in failed] == [False, False] and {g["type"] for g in failed} == {"PublishError"}, failed
    assert failed[0]["msg"] == failed[1]["msg"] and "rank 1" in failed[0]["msg"] and "\n" not in failed[0]["msg"]
    with Registry.open(catalog_url, root=s3_root) as reg:
        row = reg.catalog.get("main", 3)
        assert row is not None and row.status == Status.FAILED
        assert [c.step for c in reg.checkpoints("main")] == [1, 2, 4]
        keys, uploads = leftovers(reg, "main/step-00000003")
        assert keys == [] and uploads == []
        for seed, step in ((1, 1), (2, 2), (4, 4)):  # world size 1, full tensors
            into = template(seed)
            assert reg.load_into(f"main@{step}", into).step == step
            assert fingerprint(into) == fingerprint(full_state(seed)) and into["extra"]["names"] == ["a", "b"]
        assert [r.ok for r in reg.verify("main")] == [True, True, True]
        report = reg.fsck(repair=True)
        assert all(p.kind != "damaged-payload" for p in report.problems), report.problems

        # a damaged piece is found by the rank that reads it, and a step named by number is not loaded
        objects = reg.root.object_store()
        assert objects is not None
        rel = reg.resolve("main@1").path.as_posix()
        data = sorted(e.rel for e in objects.list(rel) if e.rel.endswith(".distcp"))[0]
        raw = bytearray(objects.get(data))
        raw[len(raw) // 2] ^= 0xFF
        obstore.put(objects.store, data, bytes(raw))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            reg.load_into("main@1", template(1))
        assert reg.catalog.get("main", 1).status == Status.CORRUPT  # type: ignore[union-attr]


def test_a_rank_killed_mid_upload_leaves_nothing_after_fsck_repair(catalog_url: str, s3_root: str,
                                                                   tmp_path: Path) -> None:
    results, codes = launch(tmp_path, catalog_url, s3_root, [
        {"name": "kill", "op": "publish", "run": "k", "step": 1, "seed": 5, "big": 6 << 10, "timeout": 10,
         "crash": {"rank": 1, "at": "sharded-upload-midway"}},
    ])
    assert codes[1] == -9 and codes[0] == 0, (codes, results)
    assert results[0]["kill"]["ok"] is False, results
    with Registry.open(catalog_url, root=s3_root) as reg:
        assert reg.checkpoints("k") == []
        assert leftovers(reg, "k")[1], "the killed rank's multipart upload was never started"
        reg.fsck(repair=True)
        assert leftovers(reg, "k") == ([], [])
        assert not reg.fsck(repair=False).problems
        row = reg.catalog.get("k", 1)
        assert row is None or row.status == Status.FAILED
