"""PyTorch Lightning with :class:`registry.integrations.lightning.RegistryCheckpoint`.

Training runs in child processes (``tests/_lightning_worker.py``): one trains
run ``full`` for four epochs and run ``crash`` until it SIGKILLs itself right
after epoch 2's publish committed; the next resumes both from
``registry:RUN@latest`` (``full``'s newest step corrupted first). The model
has dropout and the data is shuffled, so only a resume that restores the RNG
states as well continues bit-exactly. A two-rank gloo job checks DDP.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry
from registry.errors import UnsafePickleError
from tests.helpers import REPO, child_env

pytest.importorskip("lightning")

WORKER = str(REPO / "tests" / "_lightning_worker.py")


def env() -> dict[str, str]:
    return {k: v for k, v in child_env().items() if not k.startswith("PL_")} | {"CUDA_VISIBLE_DEVICES": ""}


def worker(root: Path, mode: str) -> tuple[int, dict[str, Any]]:
    out = subprocess.run([sys.executable, WORKER, str(root), mode], capture_output=True, text=True, env=env(),
                         timeout=300)
    docs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"')]
    assert docs, out.stderr[-3000:]
    return out.returncode, docs[0]


def steps(reg: Registry, run: str) -> list[int]:
    return [i.step for i in reg.checkpoints(run)]


def losses(doc: dict[str, Any]) -> dict[int, float]:
    return {int(k): v for k, v in doc["losses"].items()}


def test_kill_resume_retention_and_corrupt_fallback(tmp_path: Path) -> None:
    root = tmp_path / "root"
    code, first = worker(root, "first")
    assert code == -signal.SIGKILL  # killed mid-fit, right after the second epoch's publish
    full = losses(first["full"])
    assert sorted(full) == list(range(16))  # 4 epochs of 4 steps
    with Registry.open(root=root) as reg:
        val = {p.step: p.value for p in reg.metrics("full", "val_loss")}
        assert sorted(val) == [4, 8, 12, 16]  # callback_metrics committed with each step
        best = min(val, key=lambda s: val[s])
        assert set(steps(reg, "full")) == {12, 16, best}  # KeepLast(2) | KeepBest(1, "val_loss"), nothing else
        assert steps(reg, "crash") == [4, 8]
        meta = json.loads((reg.resolve("full@16").path / "meta.json").read_text())["lightning"]
        assert {"loops", "lr_schedulers", "hyper_parameters", "global_step", "epoch"} <= set(meta)  # plain JSON
        full_live = steps(reg, "full")
        newest = reg.resolve("full@16").path / "model.safetensors"
    raw = bytearray(newest.read_bytes())
    raw[-1] ^= 0xFF
    os.chmod(newest, 0o644)
    newest.write_bytes(bytes(raw))

    code, again = worker(root, "resume")
    assert code == 0
    crash = again["crash"]
    assert crash["resumed_at"] == 8
    assert losses(crash) == {s: full[s] for s in range(8, 16)}  # bit-exact: weights, optimizer, loops, RNG
    resumed = again["full"]
    assert resumed["fell_back"] and resumed["resumed_at"] == 12  # the corrupt step 16 was skipped
    assert losses(resumed) == {s: full[s] for s in range(12, 16)}
    with Registry.open(root=root) as reg:
        assert reg.catalog.get("full", 16).status == "verified"  # type: ignore[union-attr] - retrained, replaced
        assert "corrupt" in [e.kind for e in reg.events("full", step=16)]
        assert set(steps(reg, "full")) == set(full_live)  # the other run's retention never touched it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ddp_rank_zero_publishes_and_every_rank_resumes_the_same_step(tmp_path: Path) -> None:
    root = tmp_path / "root"
    Registry.open(root=root).close()  # the catalog exists before two ranks open it
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(root), "ddp"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                                           "NODE_RANK": "0", "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    docs = [json.loads(next(line for line in out.splitlines() if line.startswith('{"'))) for out, _ in outs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert [d["again"]["rank"] for d in docs] == [0, 1]
    assert [d["again"]["resumed_at"] for d in docs] == [4, 4]  # both ranks restored the newest step
    with Registry.open(root=root) as reg:
        assert steps(reg, "ddp")[-1] == 6
        publishes = [e for e in reg.events("ddp") if e.kind == "publish"]
        assert sorted(e.step for e in publishes) == [2, 4, 6]  # once per step: rank 0 alone publishes


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
