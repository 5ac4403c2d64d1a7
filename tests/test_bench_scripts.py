"""The benchmarks and ``scripts/gpu_check.py`` run: they are outside mypy's files, so a rename breaks them silently.

Nothing here times anything: the benches' figures belong in BENCHMARKS.md.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, child_env

BENCHES = sorted(p.stem for p in (REPO / "benchmarks").glob("bench_*.py"))


def run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_every_bench_imports() -> None:
    assert "bench_headline" in BENCHES
    code = "import sys; sys.path.insert(0, 'benchmarks'); " + "; ".join(f"import {b}" for b in BENCHES)
    done = run("-c", code)
    assert done.returncode == 0, done.stderr


def test_headline_table_end_to_end_on_its_smallest_group() -> None:
    done = run("benchmarks/bench_headline.py", "--only", "resolve", "--checkpoints", "300", "--runs", "1")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| resolve")]
    assert len(rows) == 2 and all("x**" in r and "./scripts/bench headline" in r for r in rows), done.stdout
    assert "load average at start" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the checks run instead")
def test_gpu_check_skips_every_check_without_cuda() -> None:
    done = run("scripts/gpu_check.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{name}: skipped (no CUDA device)" for name in
                                        ("pinned snapshot", "async sharded publish", "FSDP1 under Lightning")]


@pytest.mark.slow
def test_gpu_check_cpu_halves_pass() -> None:
    done = run("scripts/gpu_check.py", "--device", "cpu", "--mib", "4", "--small", "10", "--runs", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    statuses = [line for line in done.stdout.splitlines() if line and not line.startswith((" ", "device:"))]
    assert len(statuses) == 3 and all(s.endswith(": ok") for s in statuses), done.stdout
