"""Rank-consistent loading with real gloo process groups of 2, 3 and 4 ranks on 127.0.0.1.

Each group is started once per module (process start-up dominates on a
2-core machine) and runs a list of scenarios; every rank records a
fingerprint of what it loaded, or the error it raised, and the tests below
compare ranks with each other and with a plain local load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Checkpoint, Registry
from registry.distributed.collectives import buckets
from tests._dist_worker import checkpoint_fingerprint
from tests.helpers import REFERENCE_MODULE, run_ranks, write_hf_sharded

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
SEED = REFERENCE_MODULE
DEADLINE_S = 180  # a hang detector for the whole group, far above the per-collective timeouts


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"blocks.{i}.weight": torch.randn(24, 24, generator=g) for i in range(6)}
    out["embed"] = torch.randn(50, 8, generator=g).to(torch.bfloat16)
    out["norm.half"] = torch.randn(7, generator=g).to(torch.float16)
    out["step"] = torch.tensor(seed, dtype=torch.int64)
    out["mask"] = torch.rand(13, generator=g) > 0.5
    out["empty"] = torch.zeros(0, 3)
    out["ids"] = torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8)
    return out


def damage(path: Path, *, grow: bool = False) -> None:
    """Flip one byte in the middle of a file (checksum failure), or grow it (size mismatch).

    This step's copy only: the file is replaced, not written in place, since dedup may have linked
    identical files of other steps (an optimizer state the runs share) to the same inode.
    """
    raw = bytearray(path.read_bytes())
    if grow:
        raw += b"\0"
    else:
        raw[len(raw) // 2] ^= 0xFF
    fresh = path.with_name(path.name + ".damaged")
    fresh.write_bytes(bytes(raw))
    os.replace(fresh, path)


def reference_module() -> Any:
    spec = importlib.util.spec_from_file_location("checkpoint_reference", SEED)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["checkpoint_reference"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def build(base: Path) -> dict[str, Any]:
    """Publish the runs every session loads; return the expected fingerprints."""
    root, url = base / "ckpt", f"sqlite:///{base / 'catalog.db'}"
    opt = {"state": {0: {"exp_avg": torch.randn(40, 8), "step": torch.tensor(3.0)}},
           "param_groups": [{"lr": 0.1, "params": [0]}]}
    expected: dict[str, str] = {}
    with Registry.open(url=url, root=root) as reg:
        for step in (1, 2, 3):
            reg.publish("main", step, state(step), extra={"optimizer": opt, "rng": {"seed": step}},
                        config={"d": step}, meta={"who": "test"}, epoch=step, policy_version=step)
        for step in (1, 2, 3, 4):
            reg.publish("fb", step, state(10 + step), extra={"optimizer": opt})
        for step in (1, 2):
            reg.publish("fb2", step, state(20 + step))
        reg.publish("bad", 1, state(30))
        reg.publish("shard", 1, state(40), extra={"optimizer": opt}, max_shard_size=1500)
        # bytes that match their checksums and still do not parse (the writer hashed what it wrote, garbage
        # included): only parsing finds it, after every rank has the files
        for step in (1, 2):
            reg.publish("pf", step, state(60 + step), extra={"optimizer": opt})
        garbage = base / "garbage"
        shutil.copytree(reg.resolve("pf@2").path, garbage)
        (garbage / "manifest.json").unlink()
        (garbage / "optimizer.pt").write_bytes(b"PK\x03\x04 not a zip archive" * 8)
        reg.import_checkpoint(garbage, run="pf", step=3)
        damage(reg.resolve("fb@3").path / "model.safetensors")                 # seen after the transfer
        damage(reg.resolve("fb@4").path / "optimizer.pt", grow=True)           # seen before any byte moves
        damage(reg.resolve("fb2@2").path / "model.safetensors")
        damage(reg.resolve("bad@1").path / "model.safetensors")
        for ref in ("main@1", "main@2", "main@3", "fb@2", "fb2@1", "shard@1", "pf@2"):
            expected[ref] = checkpoint_fingerprint(reg.load(ref))
        assert len(list((root / "shard" / "step-00000001").glob("model-*.safetensors"))) > 3
    dirs = base / "dirs"
    if SEED.exists():
        ref = reference_module()
        ref.Checkpoint(state_dict=state(50), epoch=2, extra={"sched": {"last_epoch": 3}},
                       config={"c": 1}).save(str(dirs / "reference"))
        ref.Checkpoint(state_dict=state(51), epoch=1).save(str(dirs / "legacy"))
        (dirs / "legacy" / "manifest.json").unlink()
    write_hf_sharded(dirs / "hf", size=16)
    for name in ("reference", "legacy", "hf"):
        if (dirs / name).is_dir():
            expected[f"dir:{name}"] = checkpoint_fingerprint(Checkpoint.load(dirs / name))
    return {"root": str(root), "url": url, "dirs": str(dirs), "expected": expected}


def launch(base: Path, world: int, scenarios: list[dict[str, Any]], data: dict[str, Any],
           *, pg_timeout: int = 30, wrap: dict[int, list[str]] | None = None) -> tuple[list[dict[str, Any]], list[int]]:
    out = base / f"out-{world}-{time.monotonic_ns()}"
    out.mkdir()
    spec = {**data, "out": str(out), "scenarios": scenarios, "pg_timeout": pg_timeout}
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    codes = run_ranks("tests._dist_worker", world, spec_path, deadline_s=DEADLINE_S, wrap=wrap)
    results = []
    for r in range(world):
        path = out / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return results, codes


def scenarios(world: int, dirs: str) -> list[dict[str, Any]]:
    last = str(world - 1)
    plan: list[dict[str, Any]] = [
        {"name": "broadcast", "ref": "main@2", "strategy": "broadcast"},
        {"name": "shared-fs", "ref": "main@2", "strategy": "shared-fs"},
        {"name": "auto-latest", "ref": "main", "strategy": "auto", "bucket": 1 << 20},
        {"name": "fallback-broadcast", "ref": "fb@latest", "strategy": "broadcast"},
        {"name": "fallback-shared-fs", "ref": "fb2@latest", "strategy": "shared-fs"},
        {"name": "corrupt-one-step", "ref": "bad@1", "strategy": "broadcast"},
        {"name": "missing-run", "ref": "nope@latest", "strategy": "broadcast"},
        {"name": "missing-step", "ref": "main@99", "strategy": "shared-fs"},
        {"name": "mismatched-refs", "ref": "main@2", "refs": {last: "main@1"}, "strategy": "auto"},
        {"name": "bad-map-location", "ref": "main@2", "map_locations": {last: "nonsense"}, "strategy": "auto"},
        {"name": "bad-timeout", "ref": "main@2", "timeouts": {last: -1}, "strategy": "broadcast"},
        {"name": "sharded-broadcast", "ref": "shard@1", "strategy": "broadcast"},
        {"name": "sharded-shared-fs", "ref": "shard@1", "strategy": "shared-fs"},
        {"name": "fallback-parse", "ref": "pf@latest", "strategy": "broadcast"},
        {"name": "unverified-broadcast", "ref": "main@2", "strategy": "broadcast", "verify": False},
        {"name": "unverified-shared-fs", "ref": "main@2", "strategy": "shared-fs", "verify": False},
        {"name": "bug-while-planning", "ref": "main@2", "strategy": "broadcast", "inject": "map_checkpoint"},
        {"name": "bug-while-checking", "ref": "main@2", "strategy": "shared-fs", "inject": "check_mapped"},
        {"name": "after-errors", "ref": "main@1", "strategy": "broadcast", "timeout": 20},
    ]
    if world == 2:
        plan += [{"name": f"dir-{d}-{s}", "dir": f"{dirs}/{d}", "strategy": s}
                 for d in ("reference", "legacy", "hf") for s in ("broadcast", "shared-fs")
                 if (Path(dirs) / d).is_dir()]
    return plan


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def session(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    world = request.param
    base = tmp_path_factory.mktemp(f"dist{world}")
    data = build(base)
    results, codes = launch(base, world, scenarios(world, data["dirs"]), data)
    assert codes == [0] * world, f"ranks exited with {codes}"
    with Registry.open(url=data["url"], root=data["root"]) as reg:
        statuses = {f"{run}@{step}": reg.catalog.get(run, step).status  # type: ignore[union-attr]
                    for run, step in (("fb", 2), ("fb", 3), ("fb", 4), ("fb2", 1), ("fb2", 2), ("bad", 1),
                                      ("pf", 2), ("pf", 3))}
        leases = {run: reg.catalog.leased_steps(run) for run in ("main", "fb", "fb2", "bad", "shard", "pf")}
    assert leases == {run: set() for run in leases}, f"reader leases left behind: {leases}"
    return {"world": world, "results": results, "expected": data["expected"], "statuses": statuses}


def outcomes(session: dict[str, Any], name: str) -> list[dict[str, Any]]:
    got = [r.get(name) for r in session["results"]]
    assert all(g is not None for g in got), f"{name}: some rank recorded nothing: {got}"
    return got  # type: ignore[return-value]


def assert_loaded(session: dict[str, Any], name: str, expected_key: str, step: int | None) -> None:
    got = outcomes(session, name)
    assert all(g["ok"] for g in got), got
    assert {g["fp"] for g in got} == {session["expected"][expected_key]}, \
        f"{name}: ranks differ from each other or from a local load"
    assert {g["step"] for g in got} == {step}


@pytest.mark.parametrize("name", ["broadcast", "shared-fs"])
def test_every_rank_gets_the_identical_checkpoint(session: dict[str, Any], name: str) -> None:
    assert_loaded(session, name, "main@2", 2)


def test_auto_latest_resolves_once_for_everyone(session: dict[str, Any]) -> None:
    assert_loaded(session, "auto-latest", "main@3", 3)
    # every rank sees rank 0's files here, so auto must not send them over the network
    assert {g["strategy"] for g in outcomes(session, "auto-latest")} == {"shared-fs"}
    assert {g["strategy"] for g in outcomes(session, "broadcast")} == {"broadcast"}


def test_sharded_checkpoint_loads_on_every_rank(session: dict[str, Any]) -> None:
    assert_loaded(session, "sharded-broadcast", "shard@1", 1)
    assert_loaded(session, "sharded-shared-fs", "shard@1", 1)


def test_corrupt_latest_falls_back_on_every_rank(session: dict[str, Any]) -> None:
    assert_loaded(session, "fallback-broadcast", "fb@2", 2)
    assert_loaded(session, "fallback-shared-fs", "fb2@1", 1)
    for g in outcomes(session, "fallback-broadcast"):
        assert sorted(w.split(" is corrupt")[0] for w in g["warnings"]) == ["fb@3", "fb@4"], g["warnings"]
    assert session["statuses"]["fb@3"] == session["statuses"]["fb@4"] == "corrupt"
    # logged once per load, by rank 0, which resolved it
    logged = [g["fell_back"] for g in outcomes(session, "fallback-broadcast")]
    assert len(logged[0]) == 1 and logged[0][0].startswith("fb@latest fell back 2 steps") and \
        "step 4 -> 2" in logged[0][0], logged
    assert all(lines == [] for lines in logged[1:]), logged
    assert session["statuses"]["fb2@2"] == "corrupt"
    assert session["statuses"]["fb@2"] == session["statuses"]["fb2@1"] == "verified"


def test_bytes_that_pass_their_checksums_but_do_not_parse_fall_back_on_every_rank(session: dict[str, Any]) -> None:
    assert_loaded(session, "fallback-parse", "pf@2", 2)
    for g in outcomes(session, "fallback-parse"):
        assert [w.split(" is corrupt")[0] for w in g["warnings"]] == ["pf@3"], g["warnings"]
    assert (session["statuses"]["pf@3"], session["statuses"]["pf@2"]) == ("corrupt", "verified")


@pytest.mark.parametrize("name", ["unverified-broadcast", "unverified-shared-fs"])
def test_an_unverified_load_is_the_same_checkpoint(session: dict[str, Any], name: str) -> None:
    assert_loaded(session, name, "main@2", 2)


@pytest.mark.parametrize("name, where", [("bug-while-planning", "map_checkpoint"),
                                         ("bug-while-checking", "check_mapped")])
def test_a_bug_on_rank_0_reaches_every_rank_naming_rank_0(session: dict[str, Any], name: str, where: str) -> None:
    """Not a RegistryError: every rank raises DistributedError, and the message says whose it was."""
    got = outcomes(session, name)
    assert {(g["ok"], g["type"], g["msg"]) for g in got} == {
        (False, "DistributedError", f"rank 0 failed: RuntimeError: injected fault in {where}")}, got


def test_a_one_rank_group_loads_and_falls_back(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 1`` is a group too: it loads as a single process does, fallback included."""
    data = build(tmp_path)
    plan = [{"name": "auto-latest", "ref": "main", "strategy": "auto"},
            {"name": "fallback-broadcast", "ref": "fb@latest", "strategy": "broadcast"},
            {"name": "fallback-parse", "ref": "pf@latest", "strategy": "shared-fs"},
            {"name": "mismatched-nothing", "ref": "main@2", "strategy": "broadcast"}]
    results, codes = launch(tmp_path, 1, plan, data)
    assert codes == [0]
    session = {"world": 1, "results": results, "expected": data["expected"]}
    assert_loaded(session, "auto-latest", "main@3", 3)
    assert_loaded(session, "fallback-broadcast", "fb@2", 2)
    assert_loaded(session, "fallback-parse", "pf@2", 2)
    assert_loaded(session, "mismatched-nothing", "main@2", 2)


@pytest.mark.parametrize("name, error", [
    ("corrupt-one-step", "CorruptCheckpointError"),
    ("missing-run", "CheckpointNotFoundError"),
    ("missing-step", "CheckpointNotFoundError"),
    ("mismatched-refs", "DistributedError"),
    ("bad-map-location", "InvalidStateError"),
    ("bad-timeout", "InvalidStateError"),
])
def test_failures_are_raised_on_every_rank_alike(session: dict[str, Any], name: str, error: str) -> None:
    got = outcomes(session, name)
    assert [g["ok"] for g in got] == [False] * session["world"], got
    assert {g["type"] for g in got} == {error}, got
    assert len({g["msg"] for g in got}) == 1, got


@pytest.mark.parametrize("name, run, step, path_end", [
    ("corrupt-one-step", None, None, "bad/step-00000001/model.safetensors"),
    ("missing-step", "main", 99, None),
])
def test_failures_keep_run_step_and_path_on_every_rank(session: dict[str, Any], name: str, run: str | None,
                                                       step: int | None, path_end: str | None) -> None:
    got = outcomes(session, name)
    assert {(g["run"], g["step"], g["path"]) for g in got} == {(got[0]["run"], got[0]["step"], got[0]["path"])}, got
    assert (got[1]["run"], got[1]["step"]) == (run, step), got[1]
    if path_end is None:
        assert got[1]["path"] is None, got[1]
    else:
        assert got[1]["path"] is not None and got[1]["path"].endswith(path_end), got[1]


def test_the_group_stays_usable_after_failures(session: dict[str, Any]) -> None:
    assert_loaded(session, "after-errors", "main@1", 1)


@pytest.mark.parametrize("layout", ["reference", "legacy", "hf"])
@pytest.mark.parametrize("strategy", ["broadcast", "shared-fs"])
def test_catalog_free_directories_broadcast(session: dict[str, Any], layout: str, strategy: str,
                                           request: pytest.FixtureRequest) -> None:
    if session["world"] != 2:
        pytest.skip("directory loads run in the 2-rank group only")
    if layout != "hf":
        request.getfixturevalue("reference_path")  # skipped without it, and an error in CI
    got = outcomes(session, f"dir-{layout}-{strategy}")
    assert all(g["ok"] for g in got), got
    assert {g["fp"] for g in got} == {session["expected"][f"dir:{layout}"]}


@pytest.mark.parametrize("dead", [0, 1])
def test_a_killed_rank_does_not_hang_the_others(tmp_path: Path, dead: int) -> None:
    data = build(tmp_path)
    world = 3
    results, codes = launch(tmp_path, world, [
        {"name": "killed", "ref": "main@2", "strategy": "broadcast", "bucket": 1024, "timeout": 10,
         "crash_rank": dead}], data, pg_timeout=15)
    assert codes[dead] == -9, codes
    for rank in range(world):
        if rank == dead:
            continue
        assert codes[rank] == 0, codes
        got = results[rank].get("killed")
        assert got is not None and not got["ok"], got
        assert got["type"] == "DistributedError", got


def private_mounts_work() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_rank_without_the_files_gets_them_by_broadcast(tmp_path: Path) -> None:
    """Rank 1 runs in its own mount namespace with an empty tmpfs over the root: not a shared filesystem."""
    if not private_mounts_work():
        pytest.skip("cannot create a private mount namespace here (needs unshare -m)")
    data = build(tmp_path)
    hide = ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs none "{data["root"]}" && exec "$0" "$@"']
    results, codes = launch(tmp_path, 2, [
        {"name": "auto", "ref": "main@2", "strategy": "auto", "timeout": 20},
        {"name": "shared-fs", "ref": "main@2", "strategy": "shared-fs", "timeout": 20},
        {"name": "after", "ref": "main@1", "strategy": "auto", "timeout": 20},
    ], data, wrap={1: hide})
    assert codes == [0, 0], codes
    auto = [r["auto"] for r in results]
    assert all(g["ok"] and g["strategy"] == "broadcast" for g in auto), auto
    assert {g["fp"] for g in auto} == {data["expected"]["main@2"]}
    shared = [r["shared-fs"] for r in results]
    assert [g["type"] for g in shared] == ["DistributedError"] * 2 and "not shared" in shared[0]["msg"], shared
    assert {g["fp"] for g in (r["after"] for r in results)} == {data["expected"]["main@1"]}
    with Registry.open(url=data["url"], root=data["root"]) as reg:
        assert reg.resolve("main@2").status == "verified", "a rank that cannot see the files must not mark them corrupt"


def test_buckets_pack_small_files_and_split_big_ones() -> None:
    plan = buckets([10, 0, 100, 5, 7, 40], limit=64)
    assert plan == [[(0, 0, 10)], [(2, 0, 64)], [(2, 64, 36)], [(3, 0, 5), (4, 0, 7)], [(5, 0, 40)]]
    flat = [(i, start) for pieces in plan for i, start, _ in pieces]
    assert flat == sorted(flat), "bytes go out in order, so rank 0 can hash each file as it sends it"
    covered: dict[int, int] = {}
    for pieces in plan:
        assert sum(p[2] for p in pieces) <= 64
        for i, start, length in pieces:
            assert start == covered.get(i, 0)
            covered[i] = start + length
    assert covered == {0: 10, 2: 100, 3: 5, 4: 7, 5: 40}


def cuda_scenarios(where: str) -> list[dict[str, Any]]:
    return [{"name": f"{s}-{where}", "ref": "main@2", "strategy": s, "bucket": 1 << 20,
             "map_locations": {"0": where, "1": where}} for s in ("broadcast", "shared-fs")]


@pytest.mark.cuda
def test_map_location_cuda_over_gloo(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    data = build(tmp_path)
    results, codes = launch(tmp_path, 2, cuda_scenarios("cuda"), data)
    assert codes == [0, 0]
    for name in ("broadcast-cuda", "shared-fs-cuda"):
        got = [r.get(name) for r in results]
        assert all(g and g["ok"] and g["devices"] == ["cuda"] for g in got), got
        assert {g["fp"] for g in got} == {data["expected"]["main@2"]}  # type: ignore[index]


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_nccl_buckets_travel_on_the_device(tmp_path: Path, where: str) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one CUDA device per rank (2 ranks)")
    data = build(tmp_path)
    results, codes = launch(tmp_path, 2, cuda_scenarios(where), {**data, "backend": "nccl"})
    assert codes == [0, 0]
    for name in (f"broadcast-{where}", f"shared-fs-{where}"):
        got = [r.get(name) for r in results]
        assert all(g and g["ok"] and g["devices"] == [where] for g in got), got
        assert {g["fp"] for g in got} == {data["expected"]["main@2"]}  # type: ignore[index]
