"""What the hot paths cost, counted (never timed): SQL statements and transactions per load and publish,
threads started per publish, and Alembic left unimported by opening an up-to-date catalog."""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.pool import Pool

from registry import Registry
from registry.catalog.session import _alembic_head, head_revision
from registry.pools import _POOLS
from tests.helpers import make_state


@contextmanager
def statements() -> Iterator[list[str]]:
    """Every statement the database is handed: on SQLite from its own trace, which also sees the statements
    run on the driver's connection outside SQLAlchemy (a reader lease) and each COMMIT; on PostgreSQL as
    SQLAlchemy sends them."""
    seen: list[str] = []
    traced: list[sqlite3.Connection] = []

    def count(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if conn.dialect.name != "sqlite":
            seen.append(" ".join(statement.split()))

    def trace(statement: str) -> None:
        seen.append(" ".join(statement.split()))

    def checkout(dbapi_conn, record, proxy):  # type: ignore[no-untyped-def]
        if isinstance(dbapi_conn, sqlite3.Connection):
            dbapi_conn.set_trace_callback(trace)
            traced.append(dbapi_conn)
    event.listen(Engine, "before_cursor_execute", count)
    event.listen(Pool, "checkout", checkout)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", count)
        event.remove(Pool, "checkout", checkout)
        for conn in traced:
            with contextlib.suppress(sqlite3.ProgrammingError):  # closed already (the write engine's NullPool)
                conn.set_trace_callback(None)


def test_a_lease_is_one_statement_and_a_lease_on_a_dead_step_is_none(reg: Registry) -> None:
    reg.publish("r", 1, make_state())
    with statements() as seen:
        lease = reg.catalog.acquire_lease("r", 1, holder="t", ttl=reg.lease_ttl)
    work = [s for s in seen if not s.startswith(("BEGIN", "SET", "SELECT pg_"))]
    assert lease is not None and len(work) == 1 and work[0].startswith("INSERT INTO leases"), seen
    assert reg.catalog.lease_live(lease)
    reg.catalog.release_lease(lease)
    assert not reg.catalog.lease_live(lease)
    assert reg.catalog.acquire_lease("r", 2, holder="t", ttl=reg.lease_ttl) is None
    reg.catalog.set_status("r", 1, "deleted", kind="delete", actor="t")
    assert reg.catalog.acquire_lease("r", 1, holder="t", ttl=reg.lease_ttl) is None


def test_a_lease_on_a_missing_run_says_so(reg: Registry) -> None:
    from registry.errors import CheckpointNotFoundError
    with pytest.raises(CheckpointNotFoundError, match="no run named"):
        reg.catalog.acquire_lease("nope", 1, holder="t", ttl=reg.lease_ttl)


def test_a_lazy_load_is_one_read_and_two_lease_statements(sqlite_reg: Registry) -> None:
    sqlite_reg.publish("r", 1, make_state())
    sqlite_reg.load("r@latest", verify=False)
    with statements() as seen:
        sqlite_reg.load("r@latest", verify=False)
    # the resolve in one read transaction; the lease and its release one statement each
    assert [s.split()[0] for s in seen] == ["BEGIN", "SELECT", "SELECT", "COMMIT", "INSERT", "DELETE"], seen


@pytest.mark.parametrize("verify", [False, True])
def test_a_load_maps_the_weights_and_reads_the_small_json_files(sqlite_reg: Registry, verify: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A map of a file of a few hundred bytes costs a page fault and an unmap more than reading it."""
    import mmap
    import os

    state = make_state()
    sqlite_reg.publish("r", 1, state, config={"lr": 0.1}, meta={"note": "x"})
    mapped: list[str] = []
    real = mmap.mmap

    def counting(fd: int, size: int, *args: object, **options: object) -> mmap.mmap:
        mapped.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd, size, *args, **options)  # type: ignore[arg-type]
    monkeypatch.setattr(mmap, "mmap", counting)
    ck = sqlite_reg.load("r@latest", verify=verify)
    monkeypatch.undo()
    assert mapped == ["model.safetensors"]
    assert ck.config == {"lr": 0.1} and ck.meta["note"] == "x" and ck.step == 1
    assert all(torch.equal(ck.state_dict[k], v) for k, v in state.items())


def test_a_publish_is_two_transactions_and_starts_no_thread(sqlite_reg: Registry, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    sqlite_reg.publish("r", 1, make_state())
    started: list[str] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(self.name)
        real(self)
    with statements() as seen:
        monkeypatch.setattr(threading.Thread, "start", start)
        info = sqlite_reg.publish("r", 2, {"w": torch.ones(3)}, metrics={"loss": 0.5}, tags=["best"])
        monkeypatch.undo()
    assert sum(s.startswith("BEGIN") for s in seen) == 2, seen  # the claim and the commit, which reads it back
    # a worker of one of the process's capped pools (fsync, hashing) starts while its pool grows to its size
    pooled = tuple(f"{pool._name}_" for pool in _POOLS)
    assert [name for name in started if not name.startswith(pooled)] == [], started
    again = sqlite_reg.catalog.get("r", 2)
    assert again is not None and info == dataclasses.replace(again, path=sqlite_reg.store.root / again.path)
    assert info.metrics == {"loss": 0.5} and info.tags == ("best",) and info.status == "verified"


def test_the_head_read_from_the_migrations_is_alembics() -> None:
    assert head_revision() == _alembic_head()


def test_opening_an_up_to_date_catalog_imports_no_alembic(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    Registry.open(url, tmp_path / "root", create=True).close()
    code = ("import sys; from registry import Registry; "
            f"r = Registry.open({url!r}, {str(tmp_path / 'root')!r}); r.runs(); r.close(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
