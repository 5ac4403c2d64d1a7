"""A child process for the Hugging Face Trainer tests: trains a tiny Llama built from a config.

``python tests/_hf_worker.py PLACES.json first WORK``: on each root of the
JSON list, trains run ``full`` to the end; then run ``crash`` on each, which
stops right after step 4's publish committed, and SIGKILLs itself there on the
last root. ``... PLACES.json resume WORK``: on each root, resumes ``crash``
and ``full`` (whose newest step the test corrupted) from the registry, runs a
late evaluation, and checks ``from_pretrained`` on a checkout. Prints one JSON
line of results, by root.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

from registry import Registry  # noqa: E402
from registry.integrations.transformers import RegistryCallback  # noqa: E402
from registry.retention import KeepBest, KeepLast  # noqa: E402

STEPS = 6
VOCAB = 32


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def datasets() -> tuple[Tokens, Tokens]:
    pattern = torch.arange(16) % 4  # a sequence the model learns quickly
    train = Tokens(torch.stack([(pattern + i) % VOCAB for i in range(12)]))
    noise = Tokens(torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1)))
    return train, noise  # uniform noise: no model's loss on it falls below log(VOCAB)


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=16))


class Losses(TrainerCallback):  # type: ignore[misc]
    """The losses by step; at ``kill_at`` a SIGKILL, or with ``stop`` the end of training (the step a resume
    starts from is the same: the publish precedes this hook), for a process that goes on to another root."""

    def __init__(self, kill_at: int | None = None, *, stop: bool = False) -> None:
        self.losses: dict[int, float] = {}
        self.kill_at = kill_at
        self.stop = stop

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.kill_at:  # after the registry's callback: its publish has committed
            if self.stop:
                control.should_training_stop = True
                return
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(reg: Registry, run: str, out: Path, *, kill_at: int | None = None,
            stop: bool = False) -> tuple[Trainer, RegistryCallback, Losses]:
    train, noise = datasets()
    args = TrainingArguments(output_dir=str(out / run), max_steps=STEPS, per_device_train_batch_size=2,
                             learning_rate=3e-2, save_strategy="steps", save_steps=2, eval_strategy="steps",
                             eval_steps=2, logging_steps=1, report_to="none", use_cpu=True, seed=7,
                             dataloader_num_workers=0, disable_tqdm=True)
    cb = RegistryCallback(reg, run, keep=KeepLast(2) | KeepBest(1, "eval_loss"))
    losses = Losses(kill_at, stop=stop)
    return Trainer(model=model(), args=args, train_dataset=train, eval_dataset=noise,
                   callbacks=[cb, losses]), cb, losses


def places_of(spec: str) -> list[dict[str, Any]]:
    """The roots to run on: a JSON list of ``Registry.open``'s ``url`` and ``root``, each with a ``name``."""
    with open(spec) as f:
        places: list[dict[str, Any]] = json.load(f)
    return places


def first(spec: str, work: Path) -> None:
    """On each root in turn: ``full`` to the end; then ``crash`` to step 4 on each, SIGKILLed on the last one."""
    places = places_of(spec)
    full = {}
    for place in places:
        with Registry.open(place["url"], root=place["root"]) as reg:
            out = work / place["name"] / "out"
            t, cb, losses = trainer(reg, "full", out)
            t.train(resume_from_checkpoint=cb.resume_from())
            full[place["name"]] = {"full": losses.losses, "trainer_dirs": sorted(os.listdir(out / "full"))}
    print(json.dumps(full), flush=True)
    for i, place in enumerate(places):
        with Registry.open(place["url"], root=place["root"]) as reg:
            t, cb, losses = trainer(reg, "crash", work / place["name"] / "out", kill_at=4, stop=i < len(places) - 1)
            t.train(resume_from_checkpoint=cb.resume_from())


def resume(spec: str, work: Path) -> None:
    results = {}
    for place in places_of(spec):
        with Registry.open(place["url"], root=place["root"]) as reg:
            results[place["name"]] = resume_one(reg, work / place["name"])
    print(json.dumps(results), flush=True)


def resume_one(reg: Registry, work: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    t, cb, losses = trainer(reg, "crash", work / "out2")
    path = cb.resume_from()
    result["crash_resumed_at"] = cb.checkout.step if cb.checkout else None
    t.train(resume_from_checkpoint=path)
    result["crash"] = losses.losses
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t2, cb2, losses2 = trainer(reg, "full", work / "out2")
        path = cb2.resume_from()
    result["full_resumed_at"] = cb2.checkout.step if cb2.checkout else None
    result["warnings"] = [str(w.message) for w in caught if "falling back" in str(w.message)]
    t2.train(resume_from_checkpoint=path)
    result["full"] = losses2.losses
    # a late evaluation of the newest step of "crash", on data the model has learnt
    result["best_before"] = reg.resolve("crash@best:eval_loss").step
    train, _ = datasets()
    t.evaluate(eval_dataset=train)
    result["best_after"] = reg.resolve("crash@best:eval_loss").step
    result["kept"] = [i.step for i in reg.checkpoints("crash")]
    from transformers import AutoModelForCausalLM
    ids = torch.arange(12)[None] % VOCAB
    with reg.checkout("crash@latest") as co:
        loaded = AutoModelForCausalLM.from_pretrained(co)
        t.model.eval()
        result["logits_equal"] = bool(torch.equal(loaded(ids).logits, t.model(ids).logits))
        result["own_files"] = co.kind in ("copy", "reflink")
    return result


if __name__ == "__main__":
    {"first": first, "resume": resume}[sys.argv[2]](sys.argv[1], Path(sys.argv[3]))
