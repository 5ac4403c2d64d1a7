"""The Hugging Face ``Trainer`` with :class:`registry.integrations.transformers.RegistryCallback`.

Training runs in child processes (``tests/_hf_worker.py``), on a directory
root and an ``s3://`` root in turn: one trains run ``full`` to the end and run
``crash`` until step 4's publish committed (then it SIGKILLs itself, on the
last root); the other resumes both from the registry (the
newest step of ``full`` corrupted first), runs a late evaluation, and loads a
checkout with ``from_pretrained``. Everything is a tiny Llama built from a
config on the CPU; nothing is downloaded.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from registry import Registry
from tests.helpers import REPO, child_env, flip_stored_byte

pytest.importorskip("transformers")


def worker(spec: Path, mode: str, *, work: Path) -> tuple[int, list[dict[str, Any]]]:
    env = {**child_env(), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(REPO / "tests" / "_hf_worker.py"), str(spec), mode, str(work)],
                         capture_output=True, text=True, env=env, timeout=300)
    docs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"')]
    assert docs or out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    return out.returncode, docs


def test_trainer_publishes_resumes_after_sigkill_and_falls_back_past_a_corrupt_step(tmp_path: Path,
                                                                                    s3_root: str) -> None:
    """On a directory root and on an ``s3://`` root, each with a SQLite catalog, in one process a run: the crash
    run stops after step 4's publish on the directory root and is SIGKILLed after it on the ``s3://`` root; the
    resume is the same either way."""
    places = [{"name": "fs", "url": f"sqlite:///{tmp_path / 'catalog-fs.db'}", "root": str(tmp_path / "ckpt")},
              {"name": "s3", "url": f"sqlite:///{tmp_path / 'catalog-s3.db'}", "root": s3_root}]
    spec = tmp_path / "places.json"
    spec.write_text(json.dumps(places))
    code, docs = worker(spec, "first", work=tmp_path)
    assert code == -signal.SIGKILL  # killed mid-fit, right after step 4 committed on the last root
    for place in places:
        doc = docs[0][place["name"]]
        place["full"] = {int(k): v for k, v in doc["full"].items()}
        assert doc["trainer_dirs"] == []  # each checkpoint-N went into the registry and was removed
        with Registry.open(url=place["url"], root=place["root"]) as reg:
            assert [i.step for i in reg.checkpoints("crash")] == [2, 4]
            assert [i.step for i in reg.checkpoints("full")] == [2, 4, 6]  # two runs in one root, each its own
            info = reg.resolve("full@4")
            assert info.metrics["eval_loss"] > 0  # evaluation metrics committed with the step
            assert {"optimizer.pt", "scheduler.pt", "rng_state.pt", "model.safetensors", "config.json"} <= {
                f.name for f in reg.catalog.files("full", 4)}
            flip_stored_byte(reg, reg.resolve("full@6"), "model.safetensors")

    code, docs = worker(spec, "resume", work=tmp_path)
    assert code == 0
    for place in places:
        full, result = place["full"], docs[-1][place["name"]]
        assert result["crash_resumed_at"] == 4
        crash = {int(k): v for k, v in result["crash"].items()}
        assert crash == {5: full[5], 6: full[6]}  # bit-exact continuation of the uninterrupted run
        assert result["full_resumed_at"] == 4 and result["warnings"]  # the corrupt step 6 skipped, with a warning
        assert {int(k): v for k, v in result["full"].items()} == {5: full[5], 6: full[6]}
        assert result["best_before"] != result["best_after"] == 6  # the late evaluation re-ranked best:
        assert result["logits_equal"] and result["own_files"]
        with Registry.open(url=place["url"], root=place["root"]) as reg:
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
