"""What the child processes of ``tests/test_tiers.py`` run, forked from the kill harness's forkserver.

A module of its own, importing nothing the forkserver has not imported already: a child that imported the test
module would import pytest and the S3 test servers first.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable
from pathlib import Path

import torch

from registry import Registry
from registry.crashpoints import arm


def in_child(fn: Callable[..., None], args: tuple[str, ...], env: dict[str, str], log: str) -> None:
    """In a child of the forkserver: ``fn(*args)`` as a fresh process started with ``env`` would run it."""
    os.environ.clear()
    os.environ.update(env)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    random.seed()  # every child of the forkserver starts from its state; a fresh interpreter would not
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read when torch was imported, in the forkserver
    arm(env.get("REGISTRY_CRASH_AT"))  # likewise
    fn(*args)


def publish_three(url: str, fast: str, durable: str) -> None:
    """Publish steps 1-3 before replication begins, then wait for step 3's durable copy."""
    with Registry.open(url, root=fast, durable=durable) as reg:
        with reg._replication()._drain_lock:  # all three published before replication begins
            for step in (1, 2, 3):
                reg.publish("run", step, {"w": torch.full((300_000,), float(step))})
        reg.wait_durable("run", 3, timeout=120)
    print("not killed")


def load_latest(url: str, fast: str, durable: str, out: str) -> None:
    """One rank of a host: load ``run@latest``; its step and the digest of its ``w`` into ``out``."""
    with Registry.open(url, root=fast, durable=durable) as reg:
        ck = reg.load("run@latest")
        digest = hashlib.sha256(ck.state_dict["w"].numpy().tobytes()).hexdigest()
        Path(out).write_text(json.dumps({"step": ck.step, "sha256": digest}))


def group_rank_load(rank: str, port: str, url: str, fast: str, durable: str, out: str) -> None:
    """One rank of a gloo group of two: load ``run@latest`` broadcast; its step and digest into ``out``."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=2)
    with Registry.open(url, root=fast, durable=durable, create=rank == "0") as reg:
        ck = reg.load("run@latest", broadcast=True, strategy="broadcast", timeout=60)
    digest = hashlib.sha256(ck.state_dict["w"].numpy().tobytes()).hexdigest()
    Path(out).write_text(json.dumps({"step": ck.step, "sha256": digest}))
    dist.destroy_process_group()
