"""An RL rollout worker on vLLM's CPU build, run with ``.venv-vllm/bin/python`` (vLLM lives in a venv of its own).

``python tests/_vllm_worker.py SPEC.json RESULT.json``. ``SPEC["mode"]``:

- ``follow``: start ``LLM`` on ``SPEC["model"]`` (a ``save_pretrained``
  directory) and score ``SPEC["prompts"]``; subscribe to ``SPEC["run"]``'s
  policy versions in the registry at ``SPEC["root"]`` as consumer
  ``SPEC["consumer"]`` and print ``READY``; for each version the subscription
  yields, materialize it (``lease.materialize()``, through
  ``Registry.materialize``), ``reload_weights`` from that directory, set the
  engine's weight version to ``N``, record ``lease.applied()`` and score the
  prompts again; after ``max(SPEC["versions"])``, keep serving it until
  stdin closes.
- ``bench``: time ``reload_weights`` from each directory of
  ``SPEC["dirs"]`` (``{label: path}``), ``SPEC["runs"]`` rounds after a
  warm-up, the labels in a rotating order: wall and CPU seconds.

A score is each prompt's ``prompt_logprobs`` (the top ``SPEC["logprobs"]``
tokens at each position, plus the prompt's own token) as
``[[{token_id: logprob}, ...], ...]``: the CPU backend repacks linear
weights, so the parameters are not comparable to a checkpoint's tensors,
while the logits are. Writes ``RESULT.json``; vLLM logs to stdout and stderr.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

READY = "vllm-worker: subscribed"


def start(model: str, spec: dict[str, Any]) -> Any:
    from vllm import LLM
    # No tokenizer: prompts are token ids, and nothing is detokenized.
    return LLM(model=model, skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"),
               max_model_len=int(spec.get("max_len", 64)), enforce_eager=True, max_num_seqs=4,
               max_logprobs=int(spec.get("logprobs", 8)), seed=0, gpu_memory_utilization=0.1)


def score(llm: Any, prompts: list[list[int]], logprobs: int) -> list[list[dict[str, float]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(max_tokens=1, prompt_logprobs=logprobs, detokenize=False, temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [[{str(tok): lp.logprob for tok, lp in pos.items()} for pos in out.prompt_logprobs[1:]] for out in outs]


def reload(llm: Any, path: str, cpu: list[float] | None = None) -> float:
    """``reload_weights`` from ``path``: its wall seconds; its CPU seconds (every thread) appended to ``cpu``."""
    c0, t0 = time.process_time(), time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return time.perf_counter() - t0


def follow(spec: dict[str, Any]) -> dict[str, Any]:
    """Serve ``spec["model"]``, then each policy version the subscription yields, up to ``max(spec["versions"])``."""
    from registry import Registry
    prompts, k = spec["prompts"], int(spec["logprobs"])
    llm = start(spec["model"], spec)
    result: dict[str, Any] = {"initial": {"version": llm.get_weight_version(), "scores": score(llm, prompts, k)}}
    with Registry.open(root=spec["root"]) as reg, reg.subscribe(spec["run"], consumer=spec["consumer"], ttl=60) as sub:
        print(READY, flush=True)  # the consumer is registered: the trainer's wait_lag now waits for it
        for lease in sub.versions(timeout=float(spec.get("timeout", 120))):
            path = lease.materialize()
            seconds = reload(llm, str(path))
            llm.update_weight_version(str(lease.policy_version))
            lease.applied()
            result[str(lease.policy_version)] = {"version": llm.get_weight_version(), "scores": score(llm, prompts, k),
                                                 "files": sorted(p.name for p in path.iterdir()), "reload_s": seconds}
            if lease.policy_version >= max(spec["versions"]):
                break
        sys.stdin.read()  # serve (the consumer live) until the trainer closes this pipe
    return result


def bench(spec: dict[str, Any]) -> dict[str, Any]:
    dirs: dict[str, str] = spec["dirs"]
    labels = list(dirs)
    llm = start(dirs[labels[0]], spec)
    for label in labels:
        reload(llm, dirs[label])
    times: dict[str, list[float]] = {label: [] for label in labels}
    cpu: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(int(spec["runs"])):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            gc.collect()  # as the benches' settle(): no variant is billed for the other's garbage or dirty pages
            os.sync()
            times[label].append(reload(llm, dirs[label], cpu[label]))
    return {"times": times, "cpu": cpu}


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no engine core child
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a share of the machine's memory
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = follow(spec) if spec["mode"] == "follow" else bench(spec)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
