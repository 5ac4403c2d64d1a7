"""The integrations say what matters and nothing else: no Lightning default notice per publish, no Trainer
timings stored as metrics, a resume that names what it resumed."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from registry import Registry
from tests.helpers import REPO, child_env, make_state

LIGHTNING_FIT = """
import sys, warnings
warnings.filterwarnings("ignore")
import lightning.pytorch as pl, torch
from torch.utils.data import DataLoader, TensorDataset
from registry import Registry
from registry.integrations.lightning import RegistryCheckpoint

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
    def training_step(self, batch, idx):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

x = torch.randn(8, 2)
with Registry.open(root=sys.argv[1], create=True) as reg:
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[RegistryCheckpoint(reg, "quiet", every_n_epochs=1)])
    trainer.fit(Model(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
    print("published", [i.step for i in reg.checkpoints("quiet")])
"""


def test_lightning_publishes_without_the_weights_only_notice(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    out = subprocess.run([sys.executable, "-c", LIGHTNING_FIT, str(tmp_path / "root")], capture_output=True,
                         text=True, env=child_env(), cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "published [2, 4]" in out.stdout
    assert "weights_only" not in out.stdout + out.stderr


def hf_callback(reg: Registry, **options: object):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    from registry.integrations.transformers import RegistryCallback
    return RegistryCallback(reg, "hf", **options)  # type: ignore[arg-type]


def evaluate(cb, step: int) -> None:  # type: ignore[no-untyped-def]
    from transformers import TrainerControl, TrainerState, TrainingArguments
    state = TrainerState(global_step=step)
    args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    cb.on_evaluate(args, state, TrainerControl(), metrics={
        "eval_loss": 0.5, "eval_accuracy": 0.9, "eval_runtime": 0.12, "eval_samples_per_second": 330.1,
        "eval_steps_per_second": 41.3, "epoch": 1.0})


def test_hf_callback_stores_no_trainer_timings_by_default(reg: Registry) -> None:
    reg.publish("hf", 2, make_state(2))
    evaluate(hf_callback(reg), 2)
    reg.flush("hf")
    assert {p.key for p in reg.metrics("hf")} == {"eval_loss", "eval_accuracy"}
    evaluate(hf_callback(reg, speed_metrics=True), 4)
    reg.flush("hf")
    assert "eval_runtime" in {p.key for p in reg.metrics("hf", history=True) if p.step == 4}


def test_hf_resume_says_what_it_resumed(reg: Registry, caplog: pytest.LogCaptureFixture) -> None:
    reg.publish("hf", 6, make_state(6))
    cb = hf_callback(reg)
    with caplog.at_level(logging.INFO, logger="registry.integrations.transformers"):
        path = cb.resume_from()
    assert path is not None and cb.checkout is not None
    cb.checkout.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "registry.integrations.transformers"]
    assert lines == ["resuming hf from hf@6 (verified; asked for hf@latest)"]
