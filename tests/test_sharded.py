"""Sharded (DCP) publish and load with real gloo groups of 2 and 4 ranks, FSDP2 and AdamW on CPU.

Process start-up dominates on a small machine, so each group is started once
per module and runs a list of scenarios (see ``tests/_sharded_worker.py``);
a rank killed at a named phase ends its group, so each kill gets a group of
its own that first does useful work (the 4 -> 2 load). The tests compare
ranks with each other, with the full state gathered at publish time, and
with a load in this process without a process group.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry
from registry.errors import CheckpointNotFoundError
from registry.records import Status
from tests.helpers import pg_schema_url, run_ranks

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 240  # a hang detector for a whole group, far above the per-collective timeouts
KILLS = (("sharded-rank-after-write", 1, "k1"), ("sharded-after-gather", 0, "k2"), ("after-rename", 0, "k3"),
         ("after-claim", 0, "k4"))
ASYNC_KILL = ("sharded-rank-after-write", 1, "k5")
# rank 0's retention after the commit ends only once rank 1's publish has returned, then fails
SLOW_GC = [{"name": "slow-gc", "op": "publish", "run": "gc", "step": 1, "seed": 12, "gate": True, "timeout": 8},
           {"name": "slow-gc-async", "op": "publish", "run": "gc", "step": 2, "seed": 13, "gate": True,
            "timeout": 8, "async": True}]


def launch(base: Path, world: int, scenarios: list[dict[str, Any]], *,
           where: tuple[str, Path] | None = None) -> tuple[list[dict[str, Any]], list[int], Path]:
    out = base / f"out-{world}-{time.monotonic_ns()}"
    out.mkdir()
    url, root = where or (f"sqlite:///{base / 'catalog.db'}", base / "ckpt")
    spec = {"url": url, "root": str(root), "out": str(out), "scenarios": scenarios}
    (out / "spec.json").write_text(json.dumps(spec))
    codes = run_ranks("tests._sharded_worker", world, out / "spec.json", deadline_s=DEADLINE_S, quiet=True)
    results = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else {} for r in range(world)]
    return results, codes, out


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("sharded")
    try:  # the last kill's group publishes and loads on PostgreSQL first, when there is one
        pg: tuple[str, Path] | None = (pg_schema_url(request.getfixturevalue("pg_database")), base / "ckpt-pg")
    except pytest.skip.Exception:
        pg = None
    two, _, out2 = launch(base, 2, [
        {"name": "publish", "op": "publish", "run": "f", "step": 1, "seed": 1, "tags": ["release"], "policy": 3},
        {"name": "round-trip", "op": "load", "ref": "f@latest", "seed": 2},
        {"name": "raise-rank1", "op": "publish", "run": "h", "step": 1, "bad_rank": 1},
        {"name": "raise-rank0", "op": "publish", "run": "h", "step": 2, "bad_rank": 0},
        {"name": "mismatched-refs", "op": "load", "ref": "f@1", "refs": {"1": "f@release"}},
        {"name": "exists", "op": "publish", "run": "f", "step": 1},
        {"name": "bad-timeout", "op": "publish", "run": "t", "step": 1, "timeouts": {"1": -1}},
        {"name": "partial", "op": "load", "ref": "f@1", "seed": 2, "keys": ["model", "counter", "new"],
         "strict": False, "add_key": True, "drop_counter": True},
        {"name": "strict-mismatch", "op": "load", "ref": "f@1", "seed": 2, "add_key": True},
        {"name": "async", "op": "publish-async", "run": "a", "steps": [1, 2], "seed": 11},
        {"name": "async-load-1", "op": "load", "ref": "a@1", "seed": 2},
        {"name": "async-load-2", "op": "load", "ref": "a@2", "seed": 2},
        {"name": "async-raise-rank1", "op": "publish-async", "run": "ha", "steps": [1], "bad_rank": 1},
        {"name": "after-errors", "op": "publish", "run": "h", "step": 3, "seed": 4},
        {"name": "full-broadcast", "op": "full-broadcast", "ref": "f@1", "strategy": "broadcast"},
        {"name": "group-publish", "op": "publish", "run": "grp", "step": 1, "seed": 8, "group": True},
        {"name": "group-load", "op": "load", "ref": "grp@1", "seed": 9, "group": True},
    ])
    four, _, out4 = launch(base, 4, [
        {"name": "reshard-2-4", "op": "load", "ref": "f@1", "seed": 5},
        {"name": "publish-4", "op": "publish", "run": "g", "step": 1, "seed": 3},
    ])
    kills = {}
    for i, (at, rank, run) in enumerate(KILLS):
        first = [{"name": "reshard-4-2", "op": "load", "ref": "g@1", "seed": 6}] if i == 0 else []
        where = pg if i == len(KILLS) - 1 else None
        if where is not None:
            first = [{"name": "publish", "op": "publish", "run": "f", "step": 1, "seed": 1},
                     {"name": "round-trip", "op": "load", "ref": "f@latest", "seed": 2}]
        got, codes, _ = launch(base, 2, [*first, {"name": "kill", "op": "publish", "run": run, "step": 1,
                                                  "seed": 7, "crash": {"rank": rank, "at": at}}], where=where)
        kills[at] = {"results": got, "codes": codes, "rank": rank, "run": run, "where": where, "at": at}
    at, rank, run = ASYNC_KILL  # the same kill inside a background publish
    got, codes, _ = launch(base, 2, [{"name": "kill", "op": "publish", "run": run, "step": 1, "seed": 7,
                                      "async": True, "crash": {"rank": rank, "at": at}}])
    kills["async"] = {"results": got, "codes": codes, "rank": rank, "run": run, "where": None, "at": at}
    return {"base": base, "two": two, "four": four, "kills": kills, "outs": (out2, out4), "pg": pg}


def _open(base: Path, where: tuple[str, Path] | None = None) -> Registry:
    url, root = where or (f"sqlite:///{base / 'catalog.db'}", base / "ckpt")
    return Registry.open(url=url, root=root)


def test_publish_from_every_rank_returns_the_same_info(groups: dict[str, Any]) -> None:
    got = [r["publish"] for r in groups["two"]]
    assert all(g["ok"] for g in got), got
    assert {(g["step"], g["status"], g["path"]) for g in got} == {(1, "verified", got[0]["path"])}
    assert [g["metrics"] for g in got] == [{"loss": 1.0}] * 2  # rank 0's metrics, on every rank
    with _open(groups["base"]) as reg:
        info = reg.resolve("f@release")
        assert (info.step, info.policy_version, info.epoch) == (1, 3, 0)
        names = sorted(p.name for p in info.path.iterdir())
        assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "config.json", "manifest.json", "meta.json"]
        doc = json.loads((info.path / "manifest.json").read_text())
        assert doc["format_version"] == 2
        assert doc["layout"] == {"kind": "dcp", "world_size": 2,
                                 "files_per_rank": {"0": ["__0_0.distcp"], "1": ["__1_0.distcp"]}}
        assert set(doc["files"]) == set(names) - {"manifest.json"}
        assert all("xxh3_128_pieces" in e for e in doc["files"].values())
        assert json.loads((info.path / "config.json").read_text()) == {"rank": 0}


def test_publish_and_load_in_a_group_on_postgresql(groups: dict[str, Any]) -> None:
    if groups["pg"] is None:
        pytest.skip("PostgreSQL unreachable; its group ran on SQLite")
    got = groups["kills"][KILLS[-1][0]]["results"]
    assert [r["publish"]["ok"] for r in got] == [True, True], got
    assert got[0]["round-trip"]["fp"] == got[0]["publish"]["fp"]
    assert got[0]["publish"]["fp"] == groups["two"][0]["publish"]["fp"]  # same seed as the SQLite group's f@1
    with _open(groups["base"], groups["pg"]) as reg:
        assert reg.url.startswith("postgresql") and reg.resolve("f@latest").status == Status.VERIFIED


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_retention_outlasting_the_timeout_never_fails_a_committed_publish(
        tmp_path: Path, request: pytest.FixtureRequest, backend: str) -> None:
    """Rank 0's retention waits for rank 1 to have its outcome (beyond ``timeout``, had rank 1 waited for
    it), then fails: every rank has the committed step, and rank 0 a RetentionWarning; blocking and not."""
    where = None
    if backend == "postgresql":
        where = (pg_schema_url(request.getfixturevalue("pg_database")), tmp_path / "ckpt")
    got, codes, _ = launch(tmp_path, 2, SLOW_GC, where=where)
    assert codes == [0, 0], codes
    for name, step in (("slow-gc", 1), ("slow-gc-async", 2)):
        outcomes = [r.get(name) for r in got]
        assert [(o["ok"], o.get("step"), o.get("status")) for o in outcomes] == [(True, step, "verified")] * 2, \
            outcomes
        assert outcomes[0]["path"] == outcomes[1]["path"]
        warned = [r[f"{name}:warnings"] for r in got]
        assert len(warned[0]) == 1 and f"retention after publishing gc@{step} failed" in warned[0][0], warned
        assert "retention refused by the test" in warned[0][0] and warned[1] == []
    with _open(tmp_path, where) as reg:
        assert [(i.step, i.status) for i in reg.checkpoints("gc")] == [(1, Status.VERIFIED), (2, Status.VERIFIED)]


def test_an_explicit_group_works_like_the_default_one(groups: dict[str, Any]) -> None:
    published = [r["group-publish"] for r in groups["two"]]
    loaded = [r["group-load"] for r in groups["two"]]
    assert all(g["ok"] for g in published + loaded), (published, loaded)
    assert loaded[0]["fp"] == published[0]["fp"]


def test_round_trip_is_bit_exact_for_model_and_optimizer(groups: dict[str, Any]) -> None:
    published = groups["two"][0]["publish"]["fp"]
    loaded = [r["round-trip"] for r in groups["two"]]
    assert all(g["ok"] for g in loaded), loaded
    assert loaded[0]["fp"] == published  # the full state gathered after the load, of a model built from another seed
    assert [g["counter"] for g in loaded] == [1, 1]  # a plain tensor beside the DTensors


def test_resharding_2_to_4_and_4_to_2(groups: dict[str, Any]) -> None:
    four = [r["reshard-2-4"] for r in groups["four"]]
    assert all(g["ok"] for g in four), four
    assert four[0]["fp"] == groups["two"][0]["publish"]["fp"]
    published4 = groups["four"][0]["publish-4"]
    assert published4["ok"], published4
    back = [r["reshard-4-2"] for r in groups["kills"]["sharded-rank-after-write"]["results"]]
    assert all(g["ok"] for g in back), back
    assert back[0]["fp"] == published4["fp"]
    with _open(groups["base"]) as reg:
        doc = json.loads((reg.resolve("g@1").path / "manifest.json").read_text())
        assert doc["layout"]["world_size"] == 4


@pytest.mark.parametrize("ref,run", [("f@1", "f"), ("g@latest", "g")])
def test_load_without_a_process_group_gives_the_full_state(groups: dict[str, Any], ref: str, run: str) -> None:
    out = groups["outs"][0 if run == "f" else 1]
    full = torch.load(out / f"full-{run}-1.pt")
    with _open(groups["base"]) as reg:
        ckpt = reg.load(ref)
    assert set(ckpt.state_dict) == set(full) | {"counter"}
    for key, tensor in full.items():
        assert torch.equal(ckpt.state_dict[key], tensor), key
        assert ckpt.state_dict[key].dtype == tensor.dtype
    assert ckpt.extra["optim.param_groups.0.lr"] == 1e-2  # non-tensor values, under their flat keys
    assert ckpt.step == 1 and ckpt.meta["epoch"] == 0


def test_load_into_a_plain_model_in_one_process(groups: dict[str, Any]) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests._sharded_worker import build
    model, opt = build(11, fsdp=False, world=1)  # no process group: full tensors, another initialisation
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "counter": torch.zeros(1, dtype=torch.int64)}
    with _open(groups["base"]) as reg:
        got = reg.load_into("f@1", state)
    assert (got.step, got.missing_keys, got.unexpected_keys) == (1, (), ())
    full = torch.load(groups["outs"][0] / "full-f-1.pt")
    flat, _ = flatten_state_dict(state)
    for key, tensor in full.items():
        assert torch.equal(flat[key], tensor), key


def test_a_full_load_in_a_group_gives_every_rank_the_full_state(groups: dict[str, Any]) -> None:
    from tests._dist_worker import fingerprint
    got = [r["full-broadcast"] for r in groups["two"]]
    assert all(g["ok"] for g in got), got
    with _open(groups["base"]) as reg:
        local = fingerprint(reg.load("f@1").state_dict)
    assert [g["fp"] for g in got] == [local, local]


@pytest.mark.parametrize("name,bad", [("raise-rank1", 1), ("raise-rank0", 0)])
def test_a_rank_raising_mid_write_fails_every_rank_alike(groups: dict[str, Any], name: str, bad: int) -> None:
    got = [r[name] for r in groups["two"]]
    assert [g["ok"] for g in got] == [False, False], got
    assert {g["type"] for g in got} == {"PublishError"}
    assert all(f"failed on rank {bad}" in g["msg"] for g in got)
    with _open(groups["base"]) as reg:
        step = 1 if bad == 1 else 2
        row = reg.catalog.get("h", step)
        assert row is not None and row.status == Status.FAILED
        run_dir = groups["base"] / "ckpt" / "h"
        assert not any(p.name.startswith(f".step-{step:08d}") or p.name == f"step-{step:08d}"
                       for p in run_dir.iterdir())
        # the group carried on: a publish after the failures worked
        assert [r["after-errors"]["ok"] for r in groups["two"]] == [True, True]


def test_async_publishes_commit_the_state_of_each_call(groups: dict[str, Any]) -> None:
    """The trainer takes a step right after each publish returns: the steps hold the states of the calls."""
    got = [r["async"] for r in groups["two"]]
    assert all(g["ok"] for g in got), got
    assert [g["futures"] for g in got] == [[{"ok": True, "step": 1}, {"ok": True, "step": 2}]] * 2
    assert [g["wait"] for g in got] == ["ok", "ok"]
    fps = got[0]["fps"]
    assert fps[0] != fps[1]
    loaded = [[r[f"async-load-{step}"] for r in groups["two"]] for step in (1, 2)]
    assert all(g["ok"] for g in loaded[0] + loaded[1]), loaded
    assert [loaded[0][0]["fp"], loaded[1][0]["fp"]] == fps
    with _open(groups["base"]) as reg:
        assert [i.step for i in reg.checkpoints("a")] == [1, 2]
        first, second = reg.resolve("a@1"), reg.resolve("a@2")
        assert first.status == second.status == Status.VERIFIED and first.created_at <= second.created_at


def test_a_background_failure_on_one_rank_reaches_every_rank(groups: dict[str, Any]) -> None:
    got = [r["async-raise-rank1"] for r in groups["two"]]
    assert all(g["ok"] for g in got), got
    futures = [g["futures"][0] for g in got]
    assert [f["type"] for f in futures] == ["PublishError"] * 2, futures
    assert futures[0]["msg"] == futures[1]["msg"] and "failed on rank 1" in futures[0]["msg"]
    assert [g["wait"] for g in got] == ["AsyncPublishError"] * 2  # raised once more by the next call
    with _open(groups["base"]) as reg:
        row = reg.catalog.get("ha", 1)
        assert row is not None and row.status == Status.FAILED
        assert [p for p in (groups["base"] / "ckpt" / "ha").iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("name,error", [("mismatched-refs", "DistributedError"), ("exists", "StepExistsError"),
                                        ("strict-mismatch", "InvalidStateError"),
                                        ("bad-timeout", "InvalidStateError")])
def test_refused_calls_raise_on_every_rank_alike(groups: dict[str, Any], name: str, error: str) -> None:
    got = [r[name] for r in groups["two"]]
    assert [g["ok"] for g in got] == [False, False], got
    assert {g["type"] for g in got} == {error}
    assert got[0]["msg"] == got[1]["msg"]


def test_partial_load_reports_missing_and_unexpected_keys(groups: dict[str, Any]) -> None:
    got = [r["partial"] for r in groups["two"]]
    assert all(g["ok"] for g in got), got
    assert [(g["missing"], g["unexpected"]) for g in got] == [(["new"], ["counter"])] * 2
    assert "missing 'new'" in groups["two"][0]["strict-mismatch"]["msg"]


@pytest.mark.parametrize("key", [*(k[0] for k in KILLS), "async"])
def test_a_rank_killed_at_a_phase_leaves_nothing_half_visible(groups: dict[str, Any], key: str) -> None:
    kill = groups["kills"][key]
    at = kill["at"]
    results, codes, dead, run = kill["results"], kill["codes"], kill["rank"], kill["run"]
    assert codes[dead] == -9, codes
    survivor = results[1 - dead]["kill"]
    if at != "after-rename":  # the rename happened: the others were only waiting for the outcome
        assert survivor["ok"] is False and survivor["type"] == "DistributedError", survivor
    with _open(groups["base"], kill["where"]) as reg:
        row = reg.catalog.get(run, 1)
        final = reg.store.step_dir(run, 1)
        if row is not None and row.status == Status.STAGING:
            with pytest.raises(CheckpointNotFoundError):  # a staging row is never loadable
                reg.load(f"{run}@1")
        report = reg.fsck(repair=True)
        assert not report.unrepaired, report
        assert reg.fsck().clean, reg.fsck()
        row = reg.catalog.get(run, 1)
        hidden = [p for p in final.parent.iterdir() if p.name.startswith(".")] if final.parent.exists() else []
        assert hidden == []
        if at == "after-rename":  # a complete payload in place: rolled forward, and it loads in full
            assert row is not None and row.status in (Status.PUBLISHED, Status.VERIFIED)
            assert set(reg.load(f"{run}@latest-published").state_dict) >= {"counter"}
        else:
            assert row is None or row.status == Status.FAILED
            assert not final.exists()
        assert reg.load("f@latest").step == 1  # the PostgreSQL group published its own f@1 first


def test_reference_module_refuses_a_sharded_step(groups: dict[str, Any], reference: Any) -> None:
    with _open(groups["base"]) as reg:
        path = reg.resolve("f@1").path
    with pytest.raises(ValueError, match="Unsupported checkpoint format version: 2"):
        reference.Checkpoint.load(str(path), verify_checksums=True)


def _cli(base: Path, *args: str) -> Any:
    from click.testing import CliRunner

    from registry.cli import main
    return CliRunner().invoke(main, ["--url", f"sqlite:///{base / 'catalog.db'}", "--root", str(base / "ckpt"),
                                     *args], catch_exceptions=False)


def test_fsck_verify_and_show_on_sharded_steps(groups: dict[str, Any]) -> None:
    base = groups["base"]
    with _open(base) as reg:
        assert all(r.ok for r in reg.verify("f", "g")), reg.verify("f", "g")
        assert reg.fsck(checksums=True).clean
    shown = _cli(base, "show", "g@1")
    assert shown.exit_code == 0, shown.output
    assert "layout:   dcp, world size 4, 1 file(s) per rank, " in shown.output
    doc = json.loads(_cli(base, "show", "g@1", "--json").output)
    layout = doc["manifest"]["layout"]
    assert (layout["kind"], layout["world_size"], layout["files_per_rank"]) == ("dcp", 4, [1, 1, 1, 1])
    assert layout["bytes"] == sum(f["size"] for f in doc["files"] if f["name"].endswith(".distcp"))
    # damage one shard: verify condemns the step, and a load of it refuses rather than loading garbage
    with _open(base) as reg:
        shard = reg.resolve("h@3").path / "__1_0.distcp"
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
        assert [r.ok for r in reg.verify("h@3")] == [False]
        assert reg.catalog.get("h", 3).status == Status.CORRUPT  # type: ignore[union-attr]


def test_hostile_dcp_metadata_is_never_unpickled_without_the_manifest(tmp_path: Path) -> None:
    from registry.errors import CorruptCheckpointError
    from registry.fs.dcpfiles import checked_metadata
    from registry.format.manifest import FileEntry, Manifest
    from registry.format.sharding import ShardedLayout
    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))
    import pickle
    raw = pickle.dumps(Boom())
    entry = FileEntry(name=".metadata", size=len(raw), sha256="0" * 64)
    manifest = Manifest(files={".metadata": entry}, layout=ShardedLayout(world_size=1, files_per_rank=((),)))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        checked_metadata(tmp_path, manifest, raw)
    assert not marker.exists()
