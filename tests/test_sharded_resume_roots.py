"""Sharded training killed mid-run and resumed from ``RUN@latest`` on an ``s3://`` root and on a tiered root.

Two 2-rank gloo jobs on each root: a plain DCP loop (FSDP2, ``publish(...,
sharded=True)`` every few steps, SIGKILL between two publishes, a restart
that loads ``RUN@latest`` with ``load_into``; ``tests/_dcp_loop_worker.py``),
and Lightning's ``ModelParallelStrategy`` with ``RegistryCheckpoint``
(``tests/_lightning_worker.py``: every rank publishes its shard during
``fit``, a new ``fit`` resumes from ``ckpt.resume_path()``; both roots in
one pair of processes, with a directory root's). Both must continue bit for
bit as the uninterrupted run did. The directory root's DCP cases are in
``tests/test_sharded*.py``.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry
from tests._dcp_loop_worker import fingerprint
from tests.helpers import flip_stored_byte, free_port, pg_schema_url, run_ranks, stored_file

pytestmark = pytest.mark.distributed


def layout(reg: Registry, ref: str) -> tuple[str, int]:
    doc = json.loads(stored_file(reg, reg.resolve(ref), "manifest.json"))["layout"]
    return doc["kind"], doc["world_size"]


def unsharded_state() -> dict[str, Any]:
    """The DCP loop's model and optimizer without a process group, as ``get_state_dict`` templates."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    msd, osd = get_state_dict(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    return {"model": msd, "optim": osd, "step": torch.tensor(0)}


def dcp_loop(tmp_path: Path, url: str, where: dict[str, Any], runs: list[dict[str, Any]]) -> tuple[list[int],
                                                                                                  list[dict[str, Any]]]:
    out = tmp_path / f"out-{time.monotonic_ns()}"
    out.mkdir()
    spec = out / "spec.json"
    spec.write_text(json.dumps({"url": url, **where, "out": str(out), "runs": runs}))
    codes = run_ranks("tests._dcp_loop_worker", 2, spec, deadline_s=120)
    return codes, [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else {} for r in range(2)]


@pytest.fixture(params=[("s3", "postgresql"), ("tiered", "sqlite")], ids=["s3-postgresql", "tiered-sqlite"])
def loop_case(request: pytest.FixtureRequest, tmp_path: Path, s3_root: str) -> tuple[dict[str, Any], str]:
    """The DCP loop's root and catalog: each kind of root with one catalog, and both catalogs over the two (each
    case is two launches of two ranks; the other two pairings would double the time for no path these miss)."""
    kind, catalog = request.param
    where = {"root": s3_root, "durable": None} if kind == "s3" else {"root": str(tmp_path / "fast-a"),
                                                                       "durable": s3_root}
    url = (f"sqlite:///{tmp_path / 'catalog.db'}" if catalog == "sqlite"
           else pg_schema_url(request.getfixturevalue("pg_database")))
    return where, url


def test_a_dcp_loop_killed_mid_run_resumes_from_latest_bit_exactly(loop_case: tuple[dict[str, Any], str],
                                                                    tmp_path: Path) -> None:
    where, catalog_url = loop_case
    codes, first = dcp_loop(tmp_path, catalog_url, where, [
        {"run": "ref", "every": 3, "total": 9},
        {"run": "crash", "every": 3, "total": 9, "kill_after": 5},  # step 3 published, 4 and 5 lost
    ])
    assert codes == [-signal.SIGKILL] * 2, first
    assert [d["crash"]["killed_after"] for d in first] == [5, 5]
    with Registry.open(catalog_url, root=where["root"], durable=where["durable"]) as reg:
        assert [c.step for c in reg.checkpoints("ref")] == [3, 6, 9]
        assert [c.step for c in reg.checkpoints("crash")] == [3]
        assert layout(reg, "crash@latest") == ("dcp", 2)

    codes, again = dcp_loop(tmp_path, catalog_url, where, [{"run": "crash", "every": 3, "total": 9,
                                                             "resume": True}])
    assert codes == [0, 0], again
    for rank in (0, 1):
        ref, crash, resumed = first[rank]["ref"], first[rank]["crash"], again[rank]["crash"]
        assert crash["losses"] == {s: v for s, v in ref["losses"].items() if int(s) < 5}
        assert resumed["resumed_at"] == 3
        assert resumed["losses"] == {s: v for s, v in ref["losses"].items() if int(s) >= 3}  # bit-exact
        assert resumed["fp"] == ref["fp"]  # the full weights and AdamW state at the end, bit for bit
    assert first[0]["ref"]["losses"] != first[1]["ref"]["losses"]  # each rank trains on its own batches
    with Registry.open(catalog_url, root=where["root"], durable=where["durable"]) as reg:
        assert [c.step for c in reg.checkpoints("crash")] == [3, 6, 9]
        assert [r.ok for r in reg.verify("crash")] == [True, True, True]
        if where["durable"]:
            reg.wait_durable("crash", 9, timeout=60)
    other = {**where, "root": str(tmp_path / "fast-b")} if where["durable"] else where
    with Registry.open(catalog_url, root=other["root"], durable=other["durable"]) as reg:
        state = unsharded_state()  # another host (on a tiered root, from the durable copy), at world size 1
        assert reg.load_into("crash@latest", state).step == 9
        assert fingerprint(state) == first[0]["ref"]["fp"]


def lightning(tmp_path: Path, places: list[dict[str, Any]], mode: str) -> tuple[list[int], list[dict[str, Any]],
                                                                                str]:
    """Two ranks of ``tests/_lightning_worker.py`` in ``mode`` on each of ``places`` in turn (one process a rank,
    forked from a server that imported Lightning once: its import is most of a short fit's time)."""
    from tests.test_integration_lightning import env, json_lines, launch
    spec = tmp_path / "places.json"
    spec.write_text(json.dumps(places))
    port = free_port()
    extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "NODE_RANK": "0"}
    codes, outs = launch([str(spec), mode], [env() | extra | {"RANK": str(r), "LOCAL_RANK": str(r)} for r in (0, 1)],
                         tmp_path / "logs")
    return codes, [doc for out in outs for doc in json_lines(out)], outs[0][-2000:] + outs[1][-2000:]


def test_lightning_fsdp_publishes_every_shard_and_resumes_from_latest(tmp_path: Path, s3_root: str) -> None:
    """``ModelParallelStrategy`` (FSDP2 over two gloo ranks) on a directory root, an ``s3://`` root and a tiered
    root, each with a SQLite catalog: every rank publishes its shard during ``fit``; the crash run ends after epoch
    2's publish on the first two, then both ranks are SIGKILLed after the same publish on the tiered root (its
    durable copy possibly not made yet); a new ``fit`` resumes each via ``ckpt.resume_path()``
    (``registry:shard-crash@latest``) bit for bit. On the directory root the newest step of the other run is
    damaged first (one byte of rank 1's shard): its resume falls back to the step before, bit for bit too."""
    durable = s3_root.rsplit("/", 1)[0] + "/durable"
    places = [{"name": "directory", "url": f"sqlite:///{tmp_path / 'catalog-dir.db'}",
               "root": str(tmp_path / "root"), "durable": None},
              {"name": "s3", "url": f"sqlite:///{tmp_path / 'catalog-s3.db'}", "root": s3_root, "durable": None},
              {"name": "tiered", "url": f"sqlite:///{tmp_path / 'catalog-tiered.db'}",
               "root": str(tmp_path / "fast-a"), "durable": durable}]
    for place in places:  # before two ranks open them
        Registry.open(place["url"], root=place["root"], durable=place["durable"]).close()
    codes, first, errors = lightning(tmp_path, places, "fsdp-first")
    assert codes == [-signal.SIGKILL] * 2, errors
    assert len(first) == 2, errors
    for place in places:
        name, tiered = place["name"], place["durable"] is not None
        assert [d["full"][name]["rank"] for d in first] == [0, 1]
        full = [{int(k): v for k, v in d["full"][name]["losses"].items()} for d in first]
        assert sorted(full[0]) == list(range(6)) and full[0] != full[1]  # each rank trains on its own half
        kept = [2, 4, 6] if tiered else [4, 6]  # KeepLast(2), applied once by rank 0 (on a tiered root, its fast tier)
        with Registry.open(place["url"], root=place["root"], durable=place["durable"]) as reg:
            assert [c.step for c in reg.checkpoints("shard-full")] == kept, name
            assert [c.step for c in reg.checkpoints("shard-crash")] == [2, 4], name
            # one collective publish a step, not one per rank
            assert sorted(e.step for e in reg.events("shard-full") if e.kind == "publish") == [2, 4, 6]
            manifest = json.loads(stored_file(reg, reg.resolve("shard-full@6"), "manifest.json"))
            assert manifest["format_version"] == 2 and layout(reg, "shard-full@6") == ("dcp", 2)
            assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest["files"])
            meta = json.loads(stored_file(reg, reg.resolve("shard-full@6"), "meta.json"))["lightning"]
            assert {"loops", "lr_schedulers", "hyper_parameters", "global_step", "epoch"} <= set(meta)  # plain JSON
            if name == "directory":
                reshard_to_one_rank(reg)
                flip_stored_byte(reg, reg.resolve("shard-full@6"), "__1_0.distcp")
        place["full"], place["kept"] = full, kept

    codes, again, errors = lightning(tmp_path, places, "fsdp-resume")
    assert codes == [0, 0], errors
    for place in places:
        name, full, kept = place["name"], place["full"], place["kept"]
        for rank, doc in enumerate(again):
            crash, done = doc[name]["crash"], doc[name]["full"]
            assert crash["rank"] == rank and crash["resumed_at"] == 4 and not crash["fell_back"], (name, crash)
            # bit-exact: shards, optimizer, loops, RNG
            assert {int(k): v for k, v in crash["losses"].items()} == {s: full[rank][s] for s in (4, 5)}
            if name == "directory":
                assert done["resumed_at"] == 4 and "shard-full@6 is corrupt" in done["fell_back"][0]
                assert {int(k): v for k, v in done["losses"].items()} == {s: full[rank][s] for s in (4, 5)}
            else:
                assert done["resumed_at"] == 6 and done["losses"] == {}  # resumed at its end: nothing left to train
        with Registry.open(place["url"], root=place["root"], durable=place["durable"]) as reg:
            assert [c.step for c in reg.checkpoints("shard-crash")] == kept, name
            assert [r.ok for r in reg.verify("shard-crash")] == [True] * len(kept), name
            if name == "directory":
                assert reg.catalog.get("shard-full", 6).status == "verified"  # type: ignore[union-attr] - retrained
                assert "corrupt" in [e.kind for e in reg.events("shard-full", step=6)]


def reshard_to_one_rank(reg: Registry) -> None:
    """A 2-rank Lightning FSDP step loads whole without a process group, and into an unsharded model's
    ``get_state_dict`` (resharding 2 -> 1), the optimizer's hyperparameters included."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests._lightning_worker import Model
    whole = reg.load("shard-full@4")
    assert whole.state_dict["model.net.0.weight"].shape == (8, 4)
    model = Model()
    msd, osd = get_state_dict(model, torch.optim.AdamW(model.parameters()))
    got = reg.load_into("shard-full@4", {"model": msd, "optimizer_0": osd}, keys=["model", "optimizer_0"],
                        strict=False)
    assert got.step == 4 and torch.equal(msd["net.0.weight"], whole.state_dict["model.net.0.weight"])
    assert got.unexpected_keys == ("optimizer_0.param_groups.0.initial_lr",)  # the scheduler's; none here
    assert osd["param_groups"][0]["lr"] == 0.05  # hparams.lr, not AdamW's default
