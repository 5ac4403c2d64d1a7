"""A child process for the Lightning tests: a tiny regression model, trained on the CPU.

``python tests/_lightning_worker.py PLACES.json first``: on each root of the
JSON list (see ``roots_one_process``), trains run ``full`` for four epochs;
then run ``crash`` on each, which ends right after epoch 2's publish
committed, SIGKILLing itself there on the last root. ``... PLACES.json
resume``: resumes ``crash`` from ``registry:crash@latest`` and ``full`` (whose
newest step the test corrupted) on each. ``fsdp-first`` / ``fsdp-resume``: the
same for runs ``shard-full`` and ``shard-crash``, as one rank of a two-rank
FSDP2 job (``ModelParallelStrategy``; the test sets the environment). ``...
ROOT ddp``: one rank of a two-rank gloo job that trains, then resumes from the
registry. Each prints JSON lines of results.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from registry import Registry
from registry.integrations.lightning import RegistryCheckpoint
from registry.retention import KeepBest, KeepLast

warnings.filterwarnings("ignore")


class Model(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(8, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.losses[self.trainer.global_step] = float(loss.detach())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, idx: int) -> None:
        x, y = batch
        self.log("val_loss", ((self.net(x) - y) ** 2).mean(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)}


def data() -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 4, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(24, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True), DataLoader(TensorDataset(x, y), batch_size=12)


class KillAfterEpoch(pl.Callback):
    """SIGKILL after ``epoch``'s publish; with ``stop`` the fit just ends there instead (the step it resumes
    from is the same: the publish precedes this hook), for a process that goes on to another root."""

    def __init__(self, epoch: int, *, stop: bool = False) -> None:
        self.epoch = epoch
        self.stop = stop

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:  # after RegistryCheckpoint's hook: the publish has committed
            if self.stop:
                trainer.should_stop = True
                return
            os.kill(os.getpid(), signal.SIGKILL)


def fit(reg: Registry, run: str, *, epochs: int = 4, kill: int | None = None, stop: bool = False,
        **trainer_args: Any) -> dict[str, Any]:
    torch.manual_seed(1)
    ckpt = RegistryCheckpoint(reg, run, every_n_epochs=1, keep=KeepLast(2) | KeepBest(1, "val_loss"))
    callbacks: list[pl.Callback] = [ckpt] + ([KillAfterEpoch(kill, stop=stop)] if kill is not None else [])
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=callbacks, deterministic=True, **trainer_args)
    model = Model()
    train, val = data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train, val, ckpt_path=ckpt.resume_path())
    return {"losses": model.losses, "resumed_at": ckpt.io.loaded_step,
            "fell_back": [str(w.message) for w in caught if "falling back" in str(w.message)],
            "weights": float(sum(p.double().sum() for p in model.parameters())), "rank": trainer.global_rank,
            "epoch": trainer.current_epoch}


class ShardedModel(Model):
    """``Model`` with FSDP2: every Linear and the whole net sharded over the data-parallel ranks."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def fit_sharded(reg: Registry, run: str, *, kill: int | None = None, stop: bool = False) -> dict[str, Any]:
    """Three epochs of two steps a rank under ModelParallelStrategy (FSDP2), publishing every epoch."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    torch.manual_seed(1)
    ckpt = RegistryCheckpoint(reg, run, every_n_epochs=1, keep=KeepLast(2))
    callbacks: list[pl.Callback] = [ckpt] + ([KillAfterEpoch(kill, stop=stop)] if kill is not None else [])
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                         strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=callbacks, deterministic=True)
    model = ShardedModel()
    train, _ = data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train, ckpt_path=ckpt.resume_path())
    return {"losses": model.losses, "resumed_at": ckpt.io.loaded_step, "rank": trainer.global_rank,
            "fell_back": [str(w.message) for w in caught if "falling back" in str(w.message)]}


def main(root: str, mode: str) -> None:
    if mode == "ddp":
        with Registry.open(root=root) as reg:
            first = fit(reg, "ddp", epochs=2, devices=2, strategy="ddp")
            again = fit(reg, "ddp", epochs=3, devices=2, strategy="ddp")
            print(json.dumps({"first": first, "again": again}), flush=True)
        return
    roots_one_process(root, mode)


def roots_one_process(spec: str, mode: str) -> None:
    """``first``/``resume`` (or ``fsdp-first``/``fsdp-resume``) on each root of ``spec`` (a JSON list of
    ``Registry.open``'s ``url``, ``root`` and ``durable``, each with a ``name``), in one process: the crash run
    ends after epoch 2's publish on every root but the last, and is SIGKILLed there. One JSON line: by name."""
    with open(spec) as f:
        places = json.load(f)
    sharded = mode.startswith("fsdp-")
    train = fit_sharded if sharded else fit

    def opened(place: dict[str, Any]) -> Registry:
        return Registry.open(place["url"], root=place["root"], durable=place["durable"])

    if mode.endswith("first"):
        full = {}
        for place in places:
            with opened(place) as reg:
                full[place["name"]] = train(reg, "shard-full" if sharded else "full")
        print(json.dumps({"full": full}), flush=True)
        for i, place in enumerate(places):
            with opened(place) as reg:
                train(reg, "shard-crash" if sharded else "crash", kill=1, stop=i < len(places) - 1)
        return
    done = {}
    for place in places:
        with opened(place) as reg:
            crash = train(reg, "shard-crash" if sharded else "crash")
            done[place["name"]] = {"crash": crash, "full": train(reg, "shard-full" if sharded else "full")}
    print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
