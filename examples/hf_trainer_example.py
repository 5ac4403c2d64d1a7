"""Train a tiny Llama (built from a config, nothing downloaded) with the Hugging Face Trainer and the registry.

Each save becomes a registry step with its ``eval_loss``; ``save_total_limit``
is replaced by a retention policy; running it again resumes from the newest
verified step; at the end the best step is checked out as a directory and
loaded with ``from_pretrained``, and exported as a standalone copy.

    python examples/hf_trainer_example.py --root /tmp/ckpt --out /tmp/hf-out --steps 40
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from registry import Registry  # noqa: E402
from registry.integrations.transformers import RegistryCallback  # noqa: E402
from registry.retention import KeepBest, KeepLast  # noqa: E402


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, seed: int) -> None:
        starts = torch.randint(0, 128, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.rows = (torch.arange(32) + starts) % 128  # runs of consecutive tokens: quick to learn

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="checkpoints")
    parser.add_argument("--out", default="hf-out", help="the Trainer's output_dir (its checkpoint-N dirs are removed)")
    parser.add_argument("--run", default="hf-run")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    with Registry.open(root=args.root) as reg:
        cb = RegistryCallback(reg, args.run, keep=KeepLast(2) | KeepBest(1, "eval_loss"))
        targs = TrainingArguments(args.out, max_steps=args.steps, save_steps=10, eval_strategy="steps",
                                  eval_steps=10, per_device_train_batch_size=8, learning_rate=3e-3,
                                  report_to="none", use_cpu=True, disable_tqdm=True)
        trainer = Trainer(model=model, args=targs, train_dataset=Tokens(128, 0), eval_dataset=Tokens(32, 1),
                          callbacks=[cb])
        trainer.train(resume_from_checkpoint=cb.resume_from())
        for info in reg.checkpoints(args.run):
            print(f"{args.run}@{info.step}: eval_loss={info.metrics.get('eval_loss')}")
        with reg.checkout(f"{args.run}@best:eval_loss") as path:
            best = LlamaForCausalLM.from_pretrained(path)
            print(f"loaded {path.info.run}@{path.step} from {path} ({sum(p.numel() for p in best.parameters())} "
                  "parameters)")
        done = reg.export(f"{args.run}@latest", Path(args.out) / "export", format="hf", overwrite=True)
        print(f"exported {done.run}@{done.step} to {done.path}: {', '.join(done.files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
