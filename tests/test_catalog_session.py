"""Transactions on SQLite: durable commits for the record, cheap ones for reader leases."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from registry import Registry
from registry.catalog.session import make_engine, upgrade, write_connection
from tests.conftest import make_state

FULL, NORMAL = 2, 1


def test_only_non_durable_writes_skip_the_wal_fsync(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        upgrade(engine)
        with write_connection(engine) as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == FULL
        with write_connection(engine, durable=False) as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == NORMAL
        with write_connection(engine) as conn:  # the setting ends with its connection
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == FULL
    finally:
        engine.dispose()


def test_leases_taken_cheaply_still_protect_and_release(sqlite_reg: Registry) -> None:
    reg = sqlite_reg
    reg.publish("run", 1, make_state(1))
    lease = reg.catalog.acquire_lease("run", 1, holder="reader", ttl=timedelta(minutes=5))
    assert lease is not None
    with Registry.open(url=reg.url, root=reg.store.root) as other:  # another connection sees it committed
        assert other.catalog.leased_steps("run") == {1}
    reg.catalog.release_lease(lease)
    assert reg.catalog.leased_steps("run") == set()
