"""Shared fixtures: a temporary root, and a catalog on SQLite and on PostgreSQL.

Every catalog test runs on both backends through the ``catalog_url`` fixture.
PostgreSQL tests get a database made for this test run and a schema of their
own per test. Without a reachable server they are skipped, and say so; with
``CI=true`` a missing server is an error instead, so CI cannot pass by
skipping them.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from registry import Registry

PG_ADMIN = os.environ.get("REGISTRY_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
REPO = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment for a child Python: this checkout first on its path, the caller's path kept after it."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


_schema_counter = itertools.count()


def _pg_connect(dsn: str):  # type: ignore[no-untyped-def]
    import psycopg
    return psycopg.connect(dsn, autocommit=True, connect_timeout=5)


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A PostgreSQL database of this test run's own, dropped at the end."""
    try:
        admin = _pg_connect(PG_ADMIN)
    except Exception as exc:  # noqa: BLE001 - any failure means "no server here"
        if IN_CI:
            pytest.fail(f"PostgreSQL is required in CI but unreachable at {PG_ADMIN}: {exc}")
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN}; PostgreSQL catalog tests skipped")
    name = f"regtest_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    yield base
    with _pg_connect(PG_ADMIN) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_schema_url(pg_database: str) -> str:
    schema = f"t{next(_schema_counter)}_{uuid.uuid4().hex[:6]}"
    with _pg_connect(pg_database) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return pg_database.replace("postgresql://", "postgresql+psycopg://") + f"?options=-csearch_path%3D{schema}"


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    return pg_schema_url(request.getfixturevalue("pg_database"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def reg(catalog_url: str, root: Path) -> Iterator[Registry]:
    with Registry.open(url=catalog_url, root=root) as registry:
        yield registry


@pytest.fixture
def sqlite_reg(tmp_path: Path) -> Iterator[Registry]:
    with Registry.open(url=f"sqlite:///{tmp_path / 'catalog.db'}", root=tmp_path / "ckpt") as registry:
        yield registry


@pytest.fixture
def cli(catalog_url: str, root: Path):  # type: ignore[no-untyped-def]
    """``cli("ls", "run")``: the command line through click's runner, on this test's catalog and root."""
    from click.testing import CliRunner

    from registry.cli import main
    runner = CliRunner()

    def invoke(*args: str):  # type: ignore[no-untyped-def]
        return runner.invoke(main, ["--url", catalog_url, "--root", str(root), *args], catch_exceptions=False)
    return invoke


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
