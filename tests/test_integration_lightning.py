"""PyTorch Lightning with :class:`registry.integrations.lightning.RegistryCheckpoint`.

Training runs in child processes (``tests/_lightning_worker.py``): one trains
run ``full`` for four epochs and run ``crash`` until it SIGKILLs itself right
after epoch 2's publish committed; the next resumes both from
``registry:RUN@latest`` (``full``'s newest step corrupted first). The model
has dropout and the data is shuffled, so only a resume that restores the RNG
states as well continues bit-exactly. A two-rank gloo job checks DDP; FSDP2
under ``ModelParallelStrategy`` (sharded steps, every rank resuming) runs on
every kind of root in ``tests/test_sharded_resume_roots.py``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry
from registry.errors import UnsafePickleError
from tests.helpers import child_env, exit_codes, flip_stored_byte, forked, free_port, stored_file

pytest.importorskip("lightning")

MODULE = "tests._lightning_worker"


def env() -> dict[str, str]:
    return {k: v for k, v in child_env().items() if not k.startswith("PL_")} | {"CUDA_VISIBLE_DEVICES": ""}


def launch(args: list[str], envs: list[dict[str, str]], logs: Path) -> tuple[list[int], list[str]]:
    """One ``tests/_lightning_worker.py ARGS`` process per environment of ``envs``, forked from the forkserver
    that imported Lightning once (``tests.helpers.forked``); their exit codes and output."""
    logs.mkdir(parents=True, exist_ok=True)
    paths = [logs / f"worker-{time.monotonic_ns()}-{i}.log" for i in range(len(envs))]
    procs = [forked(MODULE, args, environment, log, daemon=False) for environment, log in zip(envs, paths)]
    codes = exit_codes(procs, deadline_s=300, what="a Lightning worker")
    return codes, [p.read_text(errors="replace") if p.exists() else "" for p in paths]


def json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"')]


def worker(root: Path | str, mode: str, *, logs: Path, url: str | None = None) -> tuple[int, dict[str, Any]]:
    """Run the worker in ``mode``; its return code and first JSON line. Its publishes and resumes print no
    Lightning notice about ``weights_only`` (Lightning logs one per save unless the caller says it)."""
    extra = {"REGISTRY_URL": url} if url else {}
    (code,), (out,) = launch([str(root), mode], [env() | extra], logs)
    docs = json_lines(out)
    assert docs, out[-3000:]
    assert "weights_only" not in out, out[-3000:]
    return code, docs[0]


def steps(reg: Registry, run: str) -> list[int]:
    return [i.step for i in reg.checkpoints(run)]


def losses(doc: dict[str, Any]) -> dict[int, float]:
    return {int(k): v for k, v in doc["losses"].items()}


def test_kill_resume_retention_and_corrupt_fallback(tmp_path: Path, s3_root: str) -> None:
    """On a directory root and on an ``s3://`` root, each with a SQLite catalog, in one process a run (Lightning's
    import is most of a short fit's time): the crash run ends after epoch 2's publish on the directory root and is
    SIGKILLed after the same publish on the ``s3://`` root; the resume is the same either way."""
    places = [{"name": "fs", "url": f"sqlite:///{tmp_path / 'catalog-fs.db'}", "root": str(tmp_path / "ckpt"),
               "durable": None},
              {"name": "s3", "url": f"sqlite:///{tmp_path / 'catalog-s3.db'}", "root": s3_root, "durable": None}]
    spec = tmp_path / "places.json"
    spec.write_text(json.dumps(places))
    code, first = worker(spec, "first", logs=tmp_path / "logs")
    assert code == -signal.SIGKILL  # killed mid-fit, right after the second epoch's publish on the last root
    full_live = {}
    for place in places:
        full = losses(first["full"][place["name"]])
        assert sorted(full) == list(range(16))  # 4 epochs of 4 steps
        with Registry.open(url=place["url"], root=place["root"]) as reg:
            val = {p.step: p.value for p in reg.metrics("full", "val_loss")}
            assert sorted(val) == [4, 8, 12, 16]  # callback_metrics committed with each step
            best = min(val, key=lambda s: val[s])
            assert set(steps(reg, "full")) == {12, 16, best}  # KeepLast(2) | KeepBest(1, "val_loss"), nothing else
            assert steps(reg, "crash") == [4, 8]
            meta = json.loads(stored_file(reg, reg.resolve("full@16"), "meta.json"))["lightning"]
            assert {"loops", "lr_schedulers", "hyper_parameters", "global_step", "epoch"} <= set(meta)  # plain JSON
            full_live[place["name"]] = steps(reg, "full")
            flip_stored_byte(reg, reg.resolve("full@16"), "model.safetensors")
        place["full"] = full

    code, again = worker(spec, "resume", logs=tmp_path / "logs")
    assert code == 0
    for place in places:
        full, done = place["full"], again[place["name"]]
        crash = done["crash"]
        assert crash["resumed_at"] == 8
        assert losses(crash) == {s: full[s] for s in range(8, 16)}  # bit-exact: weights, optimizer, loops, RNG
        resumed = done["full"]
        assert resumed["fell_back"] and resumed["resumed_at"] == 12  # the corrupt step 16 was skipped
        assert losses(resumed) == {s: full[s] for s in range(12, 16)}
        with Registry.open(url=place["url"], root=place["root"]) as reg:
            assert reg.catalog.get("full", 16).status == "verified"  # type: ignore[union-attr] - retrained, replaced
            assert "corrupt" in [e.kind for e in reg.events("full", step=16)]
            assert set(steps(reg, "full")) == set(full_live[place["name"]])  # the other run's retention: untouched


def test_ddp_rank_zero_publishes_and_every_rank_resumes_the_same_step(tmp_path: Path) -> None:
    root = tmp_path / "root"
    Registry.open(root=root).close()  # the catalog exists before two ranks open it
    port = free_port()
    codes, outs = launch([str(root), "ddp"], [env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                                        "WORLD_SIZE": "2", "NODE_RANK": "0", "RANK": str(r),
                                                        "LOCAL_RANK": str(r)} for r in (0, 1)], tmp_path / "logs")
    assert codes == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    docs = [json_lines(out)[0] for out in outs]
    assert [d["again"]["rank"] for d in docs] == [0, 1]
    assert [d["again"]["resumed_at"] for d in docs] == [4, 4]  # both ranks restored the newest step
    with Registry.open(root=root) as reg:
        assert steps(reg, "ddp")[-1] == 6
        publishes = [e for e in reg.events("ddp") if e.kind == "publish"]
        assert sorted(e.step for e in publishes) == [2, 4, 6]  # once per step: rank 0 alone publishes


def test_strategies_that_write_their_own_files_are_refused(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    from registry.errors import InvalidStateError, RegistryError
    from registry.integrations.lightning import RegistryCheckpoint
    from registry.integrations.lightning_sharded import sharded_strategy
    from tests._lightning_worker import Model
    for strategy in (FSDPStrategy(), DeepSpeedStrategy.__new__(DeepSpeedStrategy)):
        with pytest.raises(RegistryError, match=f"cannot publish under {type(strategy).__name__}.*ModelParallel"):
            sharded_strategy(strategy)
    with pytest.raises(InvalidStateError, match="save_distributed_checkpoint=True"):
        sharded_strategy(ModelParallelStrategy(save_distributed_checkpoint=False))
    assert sharded_strategy(ModelParallelStrategy()) and not sharded_strategy(pl.Trainer(logger=False).strategy)
    with Registry.open(root=tmp_path / "root") as reg:
        ckpt = RegistryCheckpoint(reg, "r", blocking=False)
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(), logger=False,
                             callbacks=[ckpt])
        with pytest.raises(InvalidStateError, match="publishes collectively, so blocking=False"):
            ckpt.setup(trainer, Model(), "fit")


class OneRank:
    """What a sharded publish needs of Lightning's strategy, for a group of one: rank 0, broadcast as is."""

    is_global_zero = True

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj


def test_fsdp1_full_state_dict_through_the_checkpoint_io_is_refused(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``FSDPStrategy`` turns the target into a ``Path`` before its ``CheckpointIO`` sees it: refused, not a local
    file named ``registry:...`` (Lightning runs FSDP1 on CUDA only; the strategy's own save is what it calls)."""
    from lightning.pytorch.strategies import FSDPStrategy

    from registry.errors import InvalidStateError
    from registry.integrations.lightning import RegistryCheckpointIO
    monkeypatch.chdir(tmp_path)
    with Registry.open(root=tmp_path / "root") as reg:
        strategy = FSDPStrategy(state_dict_type="full")
        strategy.checkpoint_io = RegistryCheckpointIO(reg)
        with pytest.raises(InvalidStateError, match="ModelParallelStrategy"):
            strategy.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "epoch": 0, "global_step": 1},
                                     "registry:fsdp1@1")
        assert sorted(os.listdir(tmp_path)) == ["root"] and reg.runs() == []
        with pytest.raises(InvalidStateError, match="ModelParallelStrategy"):
            strategy.checkpoint_io.load_checkpoint(Path("registry:fsdp1@latest"))
        strategy.checkpoint_io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "plain.ckpt")  # other paths pass
        assert (tmp_path / "plain.ckpt").is_file()


def test_sharded_publish_refuses_parts_that_need_full_unpickling(tmp_path: Path) -> None:
    from fractions import Fraction

    from registry.integrations.lightning import META_KEY, split_plain
    from registry.integrations.lightning_sharded import publish_checkpoint
    checkpoint = {"epoch": 0, "global_step": 3, "state_dict": {"w": torch.ones(2)}, "loops": {"fit_loop": {"x": 1}},
                  "callbacks": {"Mine": {"obj": Fraction(1, 3)}}, "optimizer_states": []}
    with Registry.open(root=tmp_path / "root") as reg:
        with pytest.raises(UnsafePickleError, match=r"Mine.*obj.*trust_pickle=True"):
            publish_checkpoint(reg, OneRank(), run="p", step=3, checkpoint=checkpoint, split=split_plain,
                               meta_key=META_KEY, trust_pickle=False, options={})
        assert reg.runs() == []  # refused before anything was written
        publish_checkpoint(reg, OneRank(), run="p", step=3, checkpoint=checkpoint, split=split_plain,
                           meta_key=META_KEY, trust_pickle=True, options={})
        got = reg.load("p@3", trust_pickle=True)
        assert got.meta[META_KEY]["loops"] == {"fit_loop": {"x": 1}} and torch.equal(got.state_dict["model.w"],
                                                                                     torch.ones(2))


def test_non_plain_state_needs_trust_pickle(tmp_path: Path) -> None:
    from fractions import Fraction

    from registry.integrations.lightning import RegistryCheckpointIO
    checkpoint = {"epoch": 0, "global_step": 3, "state_dict": {"w": torch.ones(2)},
                  "loops": {"fit_loop": {"x": 1}}, "callbacks": {"Mine": {"obj": Fraction(1, 3), "t": torch.zeros(1)}},
                  "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}]}
    with Registry.open(root=tmp_path / "root") as reg:
        with pytest.raises(UnsafePickleError, match=r"RegistryCheckpoint\(\.\.\., trust_pickle=True\)"):
            RegistryCheckpointIO(reg).save_checkpoint(checkpoint, "registry:run@3")
        assert reg.runs() == []  # refused before anything was written
        RegistryCheckpointIO(reg, trust_pickle=True).save_checkpoint(checkpoint, "registry:run@3")
        with pytest.raises(UnsafePickleError, match="trust_pickle=True"):
            RegistryCheckpointIO(reg).load_checkpoint("registry:run@latest")
        back = RegistryCheckpointIO(reg, trust_pickle=True).load_checkpoint("registry:run@latest")
        assert back["loops"] == checkpoint["loops"] and back["global_step"] == 3
        assert back["callbacks"]["Mine"]["obj"] == Fraction(1, 3)
        assert torch.equal(back["state_dict"]["w"], torch.ones(2))
        meta = json.loads((reg.resolve("run@3").path / "meta.json").read_text())
        assert meta["lightning"]["loops"] == {"fit_loop": {"x": 1}} and "callbacks" not in meta["lightning"]


def test_step_publishes_get_their_own_validation_metrics_late(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from registry.integrations.lightning import RegistryCheckpoint, RegistryCheckpointIO
    from tests._lightning_worker import Model, data
    with Registry.open(root=tmp_path / "root") as reg:
        ckpt = RegistryCheckpoint(reg, "steps", every_n_steps=2, blocking=False)  # published in the background
        trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt])
        train, val = data()
        trainer.fit(Model(), train, val)  # 4 steps an epoch, validation at its end: steps 4 and 8
        assert {i.status for i in reg.checkpoints("steps")} == {"verified"}
        infos = {i.step: i.metrics for i in reg.checkpoints("steps")}
        assert sorted(infos) == [2, 4, 6, 8]
        restored = RegistryCheckpointIO(reg).load_checkpoint("registry:steps@8")  # mixed dtypes: RNG, optimizer
        assert restored["global_step"] == 8 and len(restored["optimizer_states"]) == 1
        assert all("train_loss" in m for m in infos.values())
        # validated after their publish: late metrics; steps 2 and 6 never get an older step's score
        assert "val_loss" in infos[4] and "val_loss" in infos[8]
        assert "val_loss" not in infos[2] and "val_loss" not in infos[6]
        best = min((4, 8), key=lambda s: infos[s]["val_loss"])
        assert reg.resolve("steps@best:val_loss").step == best
