"""The Hugging Face ``Trainer`` with :class:`registry.integrations.transformers.RegistryCallback`.

Training runs in child processes (``tests/_hf_worker.py``): one trains run
``full`` to the end and run ``crash`` until it SIGKILLs itself right after
step 4's publish committed; the other resumes both from the registry (the
newest step of ``full`` corrupted first), runs a late evaluation, and loads a
checkout with ``from_pretrained``. Everything is a tiny Llama built from a
config on the CPU; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from registry import Registry
from tests.helpers import REPO, child_env

pytest.importorskip("transformers")


def worker(root: Path, mode: str) -> tuple[int, list[dict[str, Any]]]:
    env = {**child_env(), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(REPO / "tests" / "_hf_worker.py"), str(root), mode],
                         capture_output=True, text=True, env=env, timeout=300)
    docs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"')]
    assert docs or out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    return out.returncode, docs


def test_trainer_publishes_resumes_after_sigkill_and_falls_back_past_a_corrupt_step(tmp_path: Path) -> None:
    root = tmp_path / "root"
    code, docs = worker(root, "first")
    assert code == -signal.SIGKILL  # killed mid-fit, right after step 4 committed
    full = {int(k): v for k, v in docs[0]["full"].items()}
    assert docs[0]["trainer_dirs"] == []  # each checkpoint-N went into the registry and was removed
    with Registry.open(root=root) as reg:
        assert [i.step for i in reg.checkpoints("crash")] == [2, 4]
        assert [i.step for i in reg.checkpoints("full")] == [2, 4, 6]  # two runs in one root, each its own
        info = reg.resolve("full@4")
        assert info.metrics["eval_loss"] > 0  # evaluation metrics committed with the step
        assert {"optimizer.pt", "scheduler.pt", "rng_state.pt", "model.safetensors", "config.json"} <= {
            p.name for p in info.path.iterdir()}
        newest = reg.resolve("full@6").path / "model.safetensors"
    raw = bytearray(newest.read_bytes())
    raw[-1] ^= 0xFF
    os.chmod(newest, 0o644)
    newest.write_bytes(bytes(raw))

    code, docs = worker(root, "resume")
    assert code == 0
    result = docs[-1]
    assert result["crash_resumed_at"] == 4
    crash = {int(k): v for k, v in result["crash"].items()}
    assert crash == {5: full[5], 6: full[6]}  # bit-exact continuation of the uninterrupted run
    assert result["full_resumed_at"] == 4 and result["warnings"]  # the corrupt step 6 was skipped, with a warning
    assert {int(k): v for k, v in result["full"].items()} == {5: full[5], 6: full[6]}
    assert result["best_before"] != result["best_after"] == 6  # the late evaluation re-ranked best:
    assert result["logits_equal"] and result["own_files"]
    with Registry.open(root=root) as reg:
        # the retrained step 6 replaced the corrupt one (it belonged to the abandoned timeline)
        assert reg.catalog.get("full", 6).status == "verified"  # type: ignore[union-attr]
        assert "corrupt" in [e.kind for e in reg.events("full", step=6)]
        assert reg.resolve("crash@latest").step == 6
        assert reg.catalog.leased_steps("crash") == set()  # every checkout released its lease


def test_importing_registry_imports_no_framework() -> None:
    code = "import registry, registry.api, registry.cli\nimport sys\nprint(sorted(m for m in sys.modules " \
           "if m.split('.')[0] in ('transformers', 'lightning', 'pytorch_lightning')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), cwd=REPO)
    assert out.stdout.strip() == "[]", out.stderr
