"""A training loop that applies retention at every publish.

Trains a tiny regression model, publishes every ``--every`` steps with its
eval loss, and passes ``retention=`` to ``publish`` so the run never grows:
it keeps the last few steps (to resume from), the best step by eval loss,
and a sparse long-term history. The step just published is never deleted,
and a retention failure only warns: the checkpoint is already safe.
Run it twice: the second run resumes from ``RUN@latest``.

    python examples/retention_trainer.py --root /tmp/ckpt --steps 200 --every 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from registry import CheckpointNotFoundError, Registry  # noqa: E402
from registry.retention import KeepBest, KeepEvery, KeepLast  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="catalog URL (default $REGISTRY_URL or ROOT/.registry/catalog.db)")
    parser.add_argument("--root", default=None, help="checkpoint root (default $REGISTRY_ROOT or ./checkpoints)")
    parser.add_argument("--run", default="retention-demo")
    parser.add_argument("--steps", type=int, default=200, help="train up to this step")
    parser.add_argument("--every", type=int, default=20, help="publish every N steps")
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--keep-every", type=int, default=100, help="long-term history: keep multiples of N")
    parser.add_argument("--json", action="store_true", help="print the surviving checkpoints as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        parser.error("--steps and --every must be positive")

    policy = KeepLast(args.keep_last) | KeepBest(1, "eval/loss") | KeepEvery(args.keep_every)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, w = torch.randn(256, 8), torch.randn(8, 1)
    y = x @ w + 0.1 * torch.randn(256, 1)
    x_eval, y_eval = x[:64], y[:64]

    with Registry.open(url=args.url, root=args.root) as reg:
        start = 0
        try:
            ckpt = reg.load(args.run)
            model.load_state_dict(ckpt.state_dict)
            opt.load_state_dict(ckpt.extra["optimizer"])
            start = ckpt.step
            print(f"resumed from {args.run}@{start}")
        except CheckpointNotFoundError:
            pass
        for step in range(start + 1, args.steps + 1):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % args.every == 0:
                with torch.no_grad():
                    eval_loss = nn.functional.mse_loss(model(x_eval), y_eval).item()
                reg.publish(args.run, step, model.state_dict(), extra={"optimizer": opt.state_dict()},
                            metrics={"eval/loss": eval_loss, "train/loss": loss.item()},
                            retention=policy)
        kept = reg.checkpoints(args.run)
        if args.json:
            print(json.dumps([i.to_json() for i in kept], indent=2))
        else:
            for info in kept:
                print(f"{info.step:>8}  {info.status:<9}  eval/loss={info.metrics.get('eval/loss', float('nan')):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
