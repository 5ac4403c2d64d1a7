"""Train a tiny Lightning model with the registry as its checkpoint store; run it again to resume.

Publishes every epoch with the logged metrics, keeps the last 3 steps and
the 2 best by ``val_loss``, and resumes from ``registry:RUN@latest`` when the
run already has a step (kill it mid-fit and run it again to see).

    python examples/lightning_example.py --root /tmp/ckpt --epochs 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from registry import Registry  # noqa: E402
from registry.integrations.lightning import RegistryCheckpoint  # noqa: E402
from registry.retention import KeepBest, KeepLast  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch: list[torch.Tensor], i: int) -> torch.Tensor:
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], i: int) -> None:
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="checkpoints")
    parser.add_argument("--run", default="lit-run")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    train = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)
    val = DataLoader(TensorDataset(x[:64], x[:64].sum(1, keepdim=True)), batch_size=64)
    with Registry.open(root=args.root) as reg:
        ckpt = RegistryCheckpoint(reg, args.run, every_n_epochs=1, keep=KeepLast(3) | KeepBest(2, "val_loss"))
        trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", callbacks=[ckpt], enable_checkpointing=False,
                            logger=False, enable_progress_bar=False)
        trainer.fit(Model(), train, val, ckpt_path=ckpt.resume_path())
        for info in reg.checkpoints(args.run):
            print(f"{args.run}@{info.step}: val_loss={info.metrics.get('val_loss')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
