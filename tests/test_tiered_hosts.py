"""A sharded publish to a tiered root from ranks on several hosts, each writing to a fast directory of its own.

Real 2-rank gloo groups on 127.0.0.1, each rank its own "host" (its own fast
directory and tier id), a real S3 server, both catalogs. No host holds the
step: each holds its part (its ranks' shards and the small files), recorded
per host with its files, and the ranks replicate the parts into one durable
copy in the background. A fresh pair of hosts, or one process, resumes from
the durable copy at world size 2 and 1, bit for bit. Hosts lost before the
replication ran leave the step not durable: ``@latest`` falls back on every
rank, and the hosts restarted replicate it at their next publish.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from registry import Registry
from registry.catalog.replicas import DURABLE
from registry.distributed.parts import Hosts, unreplicated
from registry.errors import NoCopyError
from registry.format.manifest import MANIFEST
from registry.format.sharding import DCP_METADATA
from registry.records import Status
from tests._s3_sharded_worker import fingerprint, full_state
from tests.helpers import durable_keys, run_ranks
from tests.test_tiered_sharded import loaded, same_on_both, template

pytestmark = pytest.mark.distributed


def launch(tmp_path: Path, url: str, roots: list[Path], durable: str,
           scenarios: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """One gloo group of ``len(roots)`` ranks, rank r on the host whose fast directory is ``roots[r]``."""
    out = tmp_path / f"out-{time.monotonic_ns()}"
    out.mkdir()
    spec = out / "spec.json"
    spec.write_text(json.dumps({"url": url, "root": [str(r) for r in roots], "durable": durable, "out": str(out),
                                "scenarios": scenarios, "pg_timeout": 15}))
    world = len(roots)
    codes = run_ranks("tests._tiered_sharded_worker", world, spec, deadline_s=120)
    results = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else {} for r in range(world)]
    return results, codes


def tier_id(root: Path) -> str:
    return str(json.loads((root / ".registry" / "tier.json").read_text())["tier_id"])


def test_each_host_holds_its_part_and_the_ranks_make_one_durable_copy(
        catalog_url: str, durable: str, tmp_path: Path) -> None:
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "two", "op": "publish", "run": "main", "step": 2, "seed": 2},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 2},
        {"name": "load", "op": "load", "ref": "main@latest", "seed": 2},
        {"name": "fsck", "op": "fsck"},
    ])
    assert codes == [0, 0], results
    assert same_on_both(results, "two")["ok"] and results[0]["durable"]["ok"], results
    loaded(results, "load", seed=2, step=2)  # the same hosts, from the durable copy
    assert [r["fsck"] for r in results] == [{"ok": True, "problems": []}] * 2, results
    with Registry.open(catalog_url, root=tmp_path / "fresh", durable=durable) as reg:
        for step in (1, 2):
            info = reg.resolve(f"main@{step}")
            copy = reg.wait_durable("main", step, timeout=60)
            parts = {r.location: r for r in reg.replicas("main", step) if r.location.startswith("part:")}
            assert sorted(parts) == sorted(f"part:{tier_id(h)}" for h in hosts)
            assert {r.location for r in reg.replicas("main", step)} == {*parts, DURABLE}  # no fast copy anywhere
            data: list[str] = []
            for host in hosts:
                part = parts[f"part:{tier_id(host)}"]
                assert part.status == "verified" and part.manifest_sha256 == info.manifest_sha256
                assert part.files and all(f.endswith(".distcp") for f in part.files)
                on_disk = sorted(p.name for p in (host / part.path).iterdir())
                assert on_disk == sorted({*part.files, DCP_METADATA, MANIFEST, "meta.json", "config.json"})
                assert not (host / info.path.relative_to(reg.root.directory)).exists()
                data += part.files
            assert sorted(data) == sorted(n for n in json.loads(
                (hosts[0] / parts[f"part:{tier_id(hosts[0])}"].path / MANIFEST).read_text())["files"]
                if n.endswith(".distcp"))
            assert durable_keys(reg, copy.path) == sorted(f"{copy.path}/{n}" for n in
                                                          {*data, DCP_METADATA, MANIFEST, "meta.json", "config.json"})
        into = template(1)  # world size 1, another host: from the durable copy, resharded
        assert reg.load_into("main@1", into).step == 1
        assert fingerprint(into) == fingerprint(full_state(1))
        assert [r.ok for r in reg.verify("main")] == [True, True]
    fresh = [tmp_path / "host-c", tmp_path / "host-d"]
    results, codes = launch(tmp_path, catalog_url, fresh, durable, [
        {"name": "latest", "op": "load", "ref": "main@latest", "seed": 2},
        {"name": "one", "op": "load", "ref": "main@1", "seed": 1},
    ])
    assert codes == [0, 0], results
    loaded(results, "latest", seed=2, step=2)
    loaded(results, "one", seed=1, step=1)


def test_hosts_lost_before_replicating_fall_back_and_replicate_when_back(
        catalog_url: str, durable: str, tmp_path: Path) -> None:
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 1},
        {"name": "two", "op": "publish", "run": "main", "step": 2, "seed": 2, "hold": True},
    ])
    assert codes == [0, 0] and same_on_both(results, "two")["ok"], results
    fresh = [tmp_path / "host-c", tmp_path / "host-d"]
    results, codes = launch(tmp_path, catalog_url, fresh, durable, [
        {"name": "latest", "op": "load", "ref": "main@latest", "seed": 1},
        {"name": "lost", "op": "load", "ref": "main@2", "seed": 2},
    ])
    assert codes == [0, 0], results
    assert loaded(results, "latest", seed=1, step=1)["fell_back"] is True
    lost = same_on_both(results, "lost")
    assert not lost["ok"] and lost["type"] == "NoCopyError", lost
    for host in (tmp_path / "host-e", hosts[0]):  # a fresh host, and one holding a part
        with Registry.open(catalog_url, root=host, durable=durable) as reg:
            with pytest.raises(NoCopyError):
                reg.load_into("main@2", template(2))
            verdicts = {r.step: r for r in reg.verify("main")}
            assert verdicts[1].ok and not verdicts[2].ok, verdicts
            assert reg.catalog.get("main", 2).status == Status.VERIFIED  # type: ignore[union-attr]  # never condemned
            assert not reg.fsck(repair=False).problems
    # the hosts come back: their next publish's round replicates the step they hold, then the new one
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "fsck", "op": "fsck"},
        {"name": "three", "op": "publish", "run": "main", "step": 3, "seed": 3},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 3},
        {"name": "two", "op": "load", "ref": "main@2", "seed": 2},
    ])
    assert codes == [0, 0], results
    assert [r["fsck"] for r in results] == [{"ok": True, "problems": []}] * 2, results
    loaded(results, "two", seed=2, step=2)
    with Registry.open(catalog_url, root=tmp_path / "host-e", durable=durable) as reg:
        assert reg.wait_durable("main", 2, timeout=1).status == "verified"


def test_a_publish_from_several_hosts_in_the_background(catalog_url: str, durable: str, tmp_path: Path) -> None:
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1, "async": True},
        {"name": "two", "op": "publish", "run": "main", "step": 2, "seed": 2, "async": True},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 2},
        {"name": "latest", "op": "load", "ref": "main@latest", "seed": 2},
        {"name": "fsck", "op": "fsck"},
    ])
    assert codes == [0, 0], results
    assert same_on_both(results, "one")["ok"] and same_on_both(results, "two")["status"] == "verified", results
    loaded(results, "latest", seed=2, step=2)
    assert [r["fsck"] for r in results] == [{"ok": True, "problems": []}] * 2, results
    with Registry.open(catalog_url, root=tmp_path / "host-e", durable=durable) as reg:
        for step in (1, 2):  # each host its part, one durable copy (the first one's round waited for it)
            reg.wait_durable("main", step, timeout=60)
            assert sorted(r.location for r in reg.replicas("main", step)) == sorted(
                [DURABLE, *(f"part:{tier_id(h)}" for h in hosts)])
        into = template(1)
        assert reg.load_into("main@1", into).step == 1 and fingerprint(into) == fingerprint(full_state(1))


def test_a_step_published_again_from_several_hosts_replaces_every_copy(
        catalog_url: str, durable: str, tmp_path: Path) -> None:
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 1},
        {"name": "again", "op": "publish", "run": "main", "step": 1, "seed": 2, "overwrite": True},
        {"name": "redurable", "op": "wait_durable", "run": "main", "step": 1},
        {"name": "load", "op": "load", "ref": "main@1", "seed": 2},
    ])
    assert codes == [0, 0] and same_on_both(results, "again")["ok"], results
    loaded(results, "load", seed=2, step=1)
    first, second = results[0]["durable"]["path"], results[0]["redurable"]["path"]
    assert first != second
    for host in hosts:
        with Registry.open(catalog_url, root=host, durable=durable) as reg:
            part = next(r for r in reg.replicas("main", 1) if r.location == f"part:{tier_id(host)}")
            older = [p for p in (host / part.path).parent.iterdir() if p.name != Path(part.path).name]
            assert len(older) == 1  # the first payload's part, which no row names now
            report = reg.fsck(repair=True)
            assert [(p.kind, p.step, p.path) for p in report.problems] == [("leftover-part", 1, older[0])]
            assert not older[0].exists() and not reg.fsck(repair=False).problems
            assert durable_keys(reg, first) == []  # the first payload's durable copy went with its claim
    with Registry.open(catalog_url, root=tmp_path / "host-e", durable=durable) as reg:
        into = template(1)  # another host, world size 1: the new payload's durable copy
        assert reg.load_into("main@1", into).step == 1 and fingerprint(into) == fingerprint(full_state(2))


def test_a_host_killed_after_installing_its_part_leaves_nothing_fsck_does_not_remove(
        catalog_url: str, durable: str, tmp_path: Path) -> None:
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1,
         "crash": {"rank": 1, "at": "parts-after-install"}},
    ])
    assert codes[1] != 0 and results[0]["one"]["ok"] is False, results  # rank 0 lost its peer: nothing committed
    with Registry.open(catalog_url, root=hosts[1], durable=durable) as reg:
        assert reg.catalog.get("main", 1).status == Status.FAILED  # type: ignore[union-attr]
        left = [p for p in (hosts[1] / ".registry" / "parts" / "main").rglob("a-*") if p.is_dir()]
        assert len(left) == 1 and (left[0] / MANIFEST).is_file()  # host b's part, installed before rank 0 heard
        report = reg.fsck(repair=True)
        assert [(p.kind, p.step, p.path) for p in report.problems] == [("leftover-part", 1, left[0])]
        assert not left[0].exists() and not reg.fsck(repair=False).problems
    with Registry.open(catalog_url, root=hosts[0], durable=durable) as reg:
        assert not reg.fsck(repair=False).problems
        assert not [p for p in (hosts[0] / ".registry" / "parts").rglob("*") if p.is_dir() and "a-" in p.name]


def test_each_host_retains_its_own_parts_and_an_ended_step_takes_them_all(
        catalog_url: str, durable: str, tmp_path: Path) -> None:
    from registry.retention import KeepLast
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "two", "op": "publish", "run": "main", "step": 2, "seed": 2},
        # before the hosts go: a round still uploading step 2 would die with them
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 2},
        {"name": "three", "op": "publish", "run": "main", "step": 3, "seed": 3, "hold": True},
    ])
    assert codes == [0, 0] and same_on_both(results, "three")["ok"], results

    def parts(step: int) -> dict[str, str]:
        return {r.location: r.status for r in reg.replicas("main", step) if r.location.startswith("part:")}

    with Registry.open(catalog_url, root=hosts[0], durable=durable) as reg:
        reg.wait_durable("main", 2, timeout=60)
        plan = reg.plan_tier_retention("main", KeepLast(1), tier="fast")
        assert sorted(plan.delete) == [1, 2]  # durable: their parts may go from this host
        plan.execute()
        a, b = f"part:{tier_id(hosts[0])}", f"part:{tier_id(hosts[1])}"
        for step in (1, 2):
            assert parts(step) == {a: "deleted", b: "verified"}  # this host's part only; host b's is host b's
            assert not any((hosts[0] / ".registry" / "parts" / "main").glob(f"step-0000000{step}/*"))
        assert parts(3) == {a: "verified", b: "verified"}  # never durable: kept whatever the policy says
        assert reg.catalog.get("main", 1).status == Status.VERIFIED  # type: ignore[union-attr]
        into = template(1)
        assert reg.load_into("main@1", into).step == 1 and fingerprint(into) == fingerprint(full_state(1))
        ended = reg.plan_tier_retention("main", KeepLast(1), tier="durable")
        assert sorted(ended.delete) == [1]
        ended.execute()  # its durable copy was its last: the step ends, every host's part with it
        assert reg.catalog.get("main", 1).status == Status.DELETED  # type: ignore[union-attr]
        assert parts(1) == {a: "deleted", b: "deleted"}
    with Registry.open(catalog_url, root=hosts[1], durable=durable) as reg:
        report = reg.fsck(repair=True)
        assert [(p.kind, p.step) for p in report.problems] == [("unfinished-copy-deletion", 1)], report.problems
        assert not reg.fsck(repair=False).problems
        left = [p for p in (hosts[1] / ".registry" / "parts" / "main").glob("step-00000001/*")]
        assert left == []


def test_the_same_hosts_read_their_own_parts_before_and_after_the_step_is_durable(
        catalog_url: str, durable: str, tmp_path: Path) -> None:
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 1},
        {"name": "two", "op": "publish", "run": "main", "step": 2, "seed": 2, "stall": True},
        {"name": "latest", "op": "load", "ref": "main@latest", "seed": 2},
        {"name": "one", "op": "load", "ref": "main@1", "seed": 1},
    ])
    assert codes == [0, 0] and same_on_both(results, "two")["ok"], results
    got = loaded(results, "latest", seed=2, step=2)  # not durable: each host's part, the replicated values sent
    assert not got["fell_back"] and not got["warned"], got
    assert not loaded(results, "one", seed=1, step=1)["warned"]
    with Registry.open(catalog_url, root=tmp_path / "host-e", durable=durable) as reg:
        assert {r.location for r in reg.replicas("main", 2)} == {f"part:{tier_id(h)}" for h in hosts}
        copy = reg.wait_durable("main", 1, timeout=1)
        data = [k for k in durable_keys(reg, copy.path) if k.endswith(".distcp")]
        assert len(data) == 2
        assert reg.tiers is not None
        reg.tiers.durable.delete(data)  # behind the catalog's back: only a read of the durable copy would notice
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "load", "ref": "main@1", "seed": 1},
        {"name": "two", "op": "load", "ref": "main@2", "seed": 2},
    ])
    assert codes == [0, 0], results
    assert not loaded(results, "one", seed=1, step=1)["warned"]  # every byte from the hosts' own disks
    assert not loaded(results, "two", seed=2, step=2)["warned"]
    with Registry.open(catalog_url, root=tmp_path / "host-e", durable=durable) as reg:
        assert reg.wait_durable("main", 1, timeout=1).status == "verified"  # nothing read it, nothing marked


def test_a_damaged_part_is_read_around_and_condemns_nothing(
        catalog_url: str, durable: str, tmp_path: Path) -> None:
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 1},
        {"name": "two", "op": "publish", "run": "main", "step": 2, "seed": 2, "stall": True},
    ])
    assert codes == [0, 0] and same_on_both(results, "two")["ok"], results
    with Registry.open(catalog_url, root=tmp_path / "host-e", durable=durable) as reg:
        for step in (1, 2):  # one byte flipped in host b's data file of each step
            part = next(r for r in reg.replicas("main", step) if r.location == f"part:{tier_id(hosts[1])}")
            assert part.files
            shard = hosts[1] / part.path / part.files[0]
            raw = bytearray(shard.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            shard.write_bytes(bytes(raw))
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "load", "ref": "main@1", "seed": 1},
        {"name": "latest", "op": "load", "ref": "main@latest", "seed": 1},
    ])
    assert codes == [0, 0], results
    got = loaded(results, "one", seed=1, step=1)  # durable: host b's share read from the durable copy instead
    assert any("a host's part of it could not be read" in w for w in got["warned"]), got
    got = loaded(results, "latest", seed=1, step=1)  # not durable: step 2 has no readable copy, step 1 does
    assert got["fell_back"], got
    with Registry.open(catalog_url, root=tmp_path / "host-e", durable=durable) as reg:
        for step in (1, 2):
            assert reg.catalog.get("main", step).status == Status.VERIFIED  # type: ignore[union-attr]
            assert {r.status for r in reg.replicas("main", step)} == {"verified"}


def test_parts_of_a_step_published_again_from_one_host_are_removed_by_each_hosts_fsck(
        catalog_url: str, durable: str, tmp_path: Path) -> None:
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 1},
    ])
    assert codes == [0, 0] and same_on_both(results, "one")["ok"], results
    with Registry.open(catalog_url, root=hosts[0], durable=durable) as reg:
        old = {r.location: r for r in reg.replicas("main", 1) if r.location.startswith("part:")}
        assert len(old) == 2
        again = full_state(3)
        reg.publish("main", 1, {**again, "extra": {"lr": 0.1, "names": ["a", "b"]}}, sharded=True, overwrite=True)
        reg.wait_durable("main", 1, timeout=60)  # the new payload's (the old one's copy was superseded)
        into = template(1)
        assert reg.load_into("main@1", into).step == 1 and fingerprint(into) == fingerprint(again)
    for host in hosts:
        part = old[f"part:{tier_id(host)}"]
        assert (host / part.path).is_dir()
        with Registry.open(catalog_url, root=host, durable=durable) as reg:
            report = reg.fsck(repair=True)
            assert [(p.kind, p.step, p.path) for p in report.problems] == [
                ("superseded-part", 1, host / part.path)], report.problems
            assert not (host / part.path).exists()
            assert not reg.fsck(repair=False).problems
            now = {r.location: r.status for r in reg.replicas("main", 1) if r.location.startswith("part:")}
            assert now[f"part:{tier_id(host)}"] == "deleted"
    with Registry.open(catalog_url, root=tmp_path / "host-e", durable=durable) as reg:
        into = template(1)  # another host: the new payload's durable copy
        assert reg.load_into("main@1", into).step == 1 and fingerprint(into) == fingerprint(again)


def test_verify_knows_each_hosts_part_of_a_step_not_durable_yet(
        catalog_url: str, durable: str, tmp_path: Path) -> None:
    hosts = [tmp_path / "host-a", tmp_path / "host-b"]
    results, codes = launch(tmp_path, catalog_url, hosts, durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1, "stall": True},
        {"name": "load", "op": "load", "ref": "main@1", "seed": 1},  # and no rank leaves before the other is done
    ])
    assert codes == [0, 0] and same_on_both(results, "one")["ok"], results
    loaded(results, "load", seed=1, step=1)
    with Registry.open(catalog_url, root=hosts[0], durable=durable) as reg:
        [got] = reg.verify("main@1")
        assert (got.ok, got.status) == (False, "unreadable") and "is intact" in got.problems[0], got
    with Registry.open(catalog_url, root=hosts[1], durable=durable) as reg:
        part = next(r for r in reg.replicas("main", 1) if r.location == f"part:{tier_id(hosts[1])}")
        assert part.files
        shard = hosts[1] / part.path / part.files[0]
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
        [got] = reg.verify("main@1")
        assert (got.ok, got.status) == (False, "corrupt-part") and part.files[0] in got.problems[0], got
        statuses = {r.location: r.status for r in reg.replicas("main", 1)}
        assert statuses == {f"part:{tier_id(hosts[0])}": "verified", f"part:{tier_id(hosts[1])}": "corrupt"}
        assert reg.catalog.get("main", 1).status == Status.VERIFIED  # type: ignore[union-attr]  # never the step's
        group = Hosts(ids=(tier_id(hosts[0]), tier_id(hosts[1])), rank=0, root=hosts[0])
        assert unreplicated(reg.catalog, "main", group) == []  # no round uploads a step it cannot make whole
        raw[len(raw) // 2] ^= 0xFF  # put back: the next verify finds it intact and says so
        shard.write_bytes(bytes(raw))
        [got] = reg.verify("main@1")
        assert got.status == "unreadable" and "is intact" in got.problems[0], got
        assert {r.status for r in reg.replicas("main", 1)} == {"verified"}
        assert [s.item.step for s in unreplicated(reg.catalog, "main", group)] == [1]


def test_two_ranks_per_host_publish_replicate_and_resume_on_the_same_hosts_at_any_world_size(
        catalog_url: str, durable: str, tmp_path: Path) -> None:
    a, b = tmp_path / "host-a", tmp_path / "host-b"
    results, codes = launch(tmp_path, catalog_url, [a, a, b, b], durable, [
        {"name": "one", "op": "publish", "run": "main", "step": 1, "seed": 1, "stall": True},
        {"name": "four", "op": "load", "ref": "main@1", "seed": 1},  # not durable: each host's part, four ranks
    ])
    assert codes == [0] * 4, results
    assert all(r["one"] == results[0]["one"] and r["four"] == results[0]["four"] for r in results), results
    loaded(results[:2], "four", seed=1, step=1)
    with Registry.open(catalog_url, root=tmp_path / "host-e", durable=durable) as reg:
        parts = {r.location: r.files for r in reg.replicas("main", 1) if r.location.startswith("part:")}
        assert sorted(parts) == sorted(f"part:{tier_id(h)}" for h in (a, b))
        assert all(len(files or ()) == 2 for files in parts.values())  # each host its two ranks' files
    results, codes = launch(tmp_path, catalog_url, [a, b], durable, [
        {"name": "two", "op": "load", "ref": "main@1", "seed": 1},  # the same hosts, half the ranks: resharded
        {"name": "next", "op": "publish", "run": "main", "step": 2, "seed": 2},
        {"name": "durable", "op": "wait_durable", "run": "main", "step": 2},
    ])
    assert codes == [0, 0], results
    loaded(results, "two", seed=1, step=1)
    with Registry.open(catalog_url, root=tmp_path / "host-e", durable=durable) as reg:
        reg.wait_durable("main", 1, timeout=60)  # the round after step 2 took step 1 too: both hosts' parts
        into = template(1)
        assert reg.load_into("main@1", into).step == 1 and fingerprint(into) == fingerprint(full_state(1))
