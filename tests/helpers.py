"""Helpers shared by the tests: states to publish and compare, child-process environments, PostgreSQL schemas.

Fixtures live in ``conftest.py``; everything here is a plain function that a
test imports by name (``from tests.helpers import make_state``).
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PG_ADMIN = os.environ.get("REGISTRY_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
REPO = Path(__file__).resolve().parents[1]
# the format's reference module, in shared/ beside the checkout (as CI lays it out)
REFERENCE_MODULE = REPO.parent / "shared" / "seed" / "checkpoint_reference.py"


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(module: str, world: int, spec_path: Path, *, deadline_s: float,
              wrap: dict[int, list[str]] | None = None, quiet: bool = False) -> list[int]:
    """Start ``python -m module RANK WORLD PORT SPEC`` for every rank of a gloo group; their exit codes.

    ``deadline_s`` is a hang detector for the whole group: past it the test fails
    and every rank still running is killed. ``wrap`` prefixes one rank's command
    line; ``quiet`` drops the ranks' stderr. A rank without ``wrap`` is forked from
    the kill harness's forkserver, which imported torch once: a fresh interpreter
    spends seconds importing it, per rank and per group.
    """
    port = free_port()
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    env.pop("REGISTRY_CRASH_AT", None)
    logs = spec_path.parent / f"ranks-{time.monotonic_ns()}"
    logs.mkdir()
    procs: list[Any] = []
    for r in range(world):
        argv = [str(r), str(world), str(port), str(spec_path)]
        if r in (wrap or {}):
            procs.append(subprocess.Popen([*(wrap or {})[r], sys.executable, "-m", module, *argv], cwd=REPO, env=env,
                                          stderr=subprocess.DEVNULL if quiet else None))
        else:
            procs.append(forked(module, argv, env, None if quiet else logs / f"rank{r}.log"))
    try:
        return exit_codes(procs, deadline_s=deadline_s, what=f"a {world}-rank group")
    finally:
        for log_path in sorted(logs.iterdir()):  # what the ranks wrote, into this test's captured stderr
            sys.stderr.write(log_path.read_text(errors="replace"))


def forked(module: str, argv: list[str], env: dict[str, str], log: Path | None, *, daemon: bool = True) -> Any:
    """Start ``python -m module *argv`` with ``env``, forked from the kill harness's forkserver, which imported
    torch, the registry, DCP and Lightning once (a fresh interpreter spends seconds on each, per process); its
    output into ``log``. The process: ``exitcode`` (negative: the signal that ended it), ``join``, ``kill``."""
    from tests.killharness import context
    proc = context().Process(target=_forked_rank, args=(module, argv, env, None if log is None else str(log)),
                             daemon=daemon)
    proc.start()
    return proc


def exit_codes(procs: list[Any], *, deadline_s: float, what: str) -> list[int]:
    """The exit codes of ``procs`` (``subprocess.Popen`` objects or forked processes); past ``deadline_s`` (a hang
    detector for them all) the test fails and every one still running is killed."""
    import pytest
    end = time.monotonic() + deadline_s
    codes: list[int] = []
    try:
        for p in procs:
            codes.append(_wait(p, max(1.0, end - time.monotonic())))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} was still running after {deadline_s}s: a process hung")
    finally:
        for p in procs:
            if _running(p):
                p.kill()
                _wait(p, None)
    return codes


def _wait(proc: subprocess.Popen[bytes] | Any, timeout: float | None) -> int:
    """A rank's exit code (negative: the signal that ended it); ``subprocess.TimeoutExpired`` past ``timeout``."""
    if isinstance(proc, subprocess.Popen):
        return proc.wait(timeout=timeout)
    proc.join(timeout)
    if proc.exitcode is None:
        raise subprocess.TimeoutExpired(str(proc), timeout or 0)
    return int(proc.exitcode)


def _running(proc: subprocess.Popen[bytes] | Any) -> bool:
    return proc.poll() is None if isinstance(proc, subprocess.Popen) else bool(proc.is_alive())


def _forked_rank(module: str, argv: list[str], env: dict[str, str], log: str | None) -> None:
    """In a child of the forkserver: become ``python -m module *argv`` started with ``env`` in the checkout."""
    import random
    import runpy

    from registry.crashpoints import arm
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    out = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    random.seed()  # every child of the forkserver starts from its state; a fresh interpreter would not
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read when torch was imported, in the forkserver
    arm(env.get("REGISTRY_CRASH_AT"))  # likewise
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def child_env() -> dict[str, str]:
    """The environment for a child Python: this checkout first on its path, the caller's path kept after it."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


_schema_counter = itertools.count()


def pg_connect(dsn: str):  # type: ignore[no-untyped-def]
    import psycopg
    return psycopg.connect(dsn, autocommit=True, connect_timeout=5)


def pg_schema_url(pg_database: str, *, conn: Any = None) -> str:
    """A new, empty schema of ``pg_database`` and the URL of a catalog in it; ``conn``: an open connection to that
    database to make it with (else one is opened for it)."""
    schema = f"t{next(_schema_counter)}_{uuid.uuid4().hex[:6]}"
    if conn is not None:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    else:
        with pg_connect(pg_database) as opened:
            opened.execute(f'CREATE SCHEMA "{schema}"')
    return pg_database.replace("postgresql://", "postgresql+psycopg://") + f"?options=-csearch_path%3D{schema}"


def optimizer_state() -> dict[str, object]:
    """A real AdamW state dict after one step: nested dicts of tensors and plain numbers."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return opt.state_dict()


def write_hf_sharded(path: Path, *, size: int = 4, layers: int = 5) -> dict[str, torch.Tensor]:
    """A Hugging Face style directory: two safetensors shards, their index and a config.json."""
    import json

    import safetensors.torch as st
    state = {f"model.layers.{i}.weight": torch.randn(size, size) for i in range(layers)}
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate((list(state)[:2], list(state)[2:]), start=1):
        shard = f"model-{i:05d}-of-00002.safetensors"
        st.save_file({k: state[k] for k in names}, str(path / shard))
        weight_map.update({k: shard for k in names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"hidden_size": size}))
    return state


def make_state(seed: int = 0, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {f"layer{i}.weight": torch.randn(8, 8, generator=g) for i in range(n)}
    state["embed"] = torch.randn(16, 4, generator=g).to(torch.bfloat16)
    state["count"] = torch.tensor(seed, dtype=torch.int64)
    state["mask"] = torch.rand(5, generator=g) > 0.5
    return state


def assert_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


def write_raw_safetensors(path: Path, parts: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file laid out exactly as ``parts`` say, in that order, with no alignment padding
    between tensors: layouts no writer of ours makes (interleaved dtypes, a tensor off its element size)."""
    import json
    import struct

    from registry.format.safetensors import dtype_names
    header: dict[str, object] = {}
    data = b""
    for name, tensor in parts:
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": dtype_names()[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the data area starts aligned; what is inside it is as given
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def fail_commits(monkeypatch: Any, *, before: Callable[[], None] | None = None) -> Callable[..., None]:
    """Make every publish commit fail as a full disk under the database makes it fail: the real
    transaction runs and is rolled back at COMMIT. ``before`` runs first (say, to fill the disk
    for the undo as well). Returns the real ``Catalog.commit_publish``, to put back."""
    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError

    from registry.catalog import Catalog
    real_commit = Catalog.commit_publish

    def failing_commit(self: Catalog, *args: Any, **kwargs: Any) -> None:
        if before is not None:
            before()

        def boom(conn: Any) -> None:
            raise OperationalError("COMMIT", {}, Exception("database or disk is full"))
        event.listen(self.engine, "commit", boom)
        try:
            real_commit(self, *args, **kwargs)
        finally:
            event.remove(self.engine, "commit", boom)

    monkeypatch.setattr(Catalog, "commit_publish", failing_commit)
    return real_commit


def write_dcp(path: Path, state: dict[str, Any], *, threads: int = 1) -> None:
    """``state`` saved by plain ``torch.distributed.checkpoint`` in this process, as a trainer's ``dcp.save``
    would (``threads`` > 1 writes that many ``__0_N.distcp`` data files)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))


def dcp_state(seed: int = 1) -> dict[str, Any]:
    """A trainer's state as DCP saves it: nested model and optimizer state, tensors and plain values."""
    gen = torch.Generator().manual_seed(seed)
    model = {"embed.weight": torch.randn(16, 8, generator=gen), "head.bias": torch.zeros(3, dtype=torch.bfloat16),
             "head.weight": torch.randn(3, 8, generator=gen).t()}
    optim = {"state": {"embed.weight": {"step": torch.tensor(7.0), "exp_avg": torch.randn(16, 8, generator=gen)}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": ["embed.weight"]}]}
    return {"model": model, "optim": optim, "train_state": {"step": 7, "name": "run-a"}}


def stored_file(reg: Any, info: Any, name: str) -> bytes:
    """The bytes of file ``name`` of the step ``info`` as the root stores them (a directory or a bucket)."""
    if reg.objects is not None:
        return bytes(reg.objects.get(f"{info.path.as_posix()}/{name}"))
    return (info.path / name).read_bytes()


def store_file(reg: Any, info: Any, name: str, data: bytes) -> None:
    """Replace file ``name`` of the step ``info`` behind the registry's back (damage it, or put it back)."""
    if reg.objects is not None:
        reg.objects.put(f"{info.path.as_posix()}/{name}", data, create_only=False)
    else:
        (info.path / name).write_bytes(data)


def flip_stored_byte(reg: Any, info: Any, name: str, offset: int = -1) -> None:
    data = bytearray(stored_file(reg, info, name))
    data[offset] ^= 0xFF
    store_file(reg, info, name, bytes(data))


def stored_steps(reg: Any, run: str) -> list[str]:
    """The step directories (or step prefixes, each with one attempt) the root holds for ``run``."""
    if reg.objects is not None:
        attempts = sorted({e.rel.split("/")[1] + "/" + e.rel.split("/")[2] for e in reg.objects.list(run)})
        steps = [a.split("/")[0] for a in attempts]
        assert len(steps) == len(set(steps)), f"a step with more than one attempt prefix: {attempts}"
        return steps
    return sorted(p.name for p in (reg.store.root / run).iterdir())


def mark_corrupt(reg: Any, info: Any, reason: str) -> bool:
    """Condemn ``info`` as a scrub would have: compare-and-set on the payload it describes."""
    from registry.records import LIVE, Status
    return bool(reg.catalog.set_status(info.run, info.step, Status.CORRUPT, kind="corrupt", actor=reg.writer,
                                       only_from=LIVE, manifest_sha256=info.manifest_sha256, reason=reason))


def durable_keys(reg: Any, prefix: str = "") -> list[str]:
    """Every key under ``prefix`` of a tiered registry's durable tier."""
    assert reg.tiers is not None
    return sorted(e.rel for e in reg.tiers.durable.list(prefix))
