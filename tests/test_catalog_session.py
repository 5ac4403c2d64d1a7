"""Transactions on SQLite: durable commits for the record, cheap ones for reader leases."""

from __future__ import annotations

import sqlite3
import threading
from datetime import timedelta
from pathlib import Path

from registry import Registry
from registry.catalog.session import _sqlite_pragmas, make_engine, upgrade, write_connection
from tests.helpers import make_state

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


def test_connections_switching_a_fresh_file_to_wal_at_once_all_succeed(tmp_path: Path) -> None:
    # Without a retry SQLite refuses one of two simultaneous switches to WAL at
    # once ("database is locked"): about one round in eight fails here.
    rounds, threads = 60, 8
    for index in range(rounds):
        path = tmp_path / f"catalog{index}.db"
        barrier = threading.Barrier(threads)
        failures: list[BaseException] = []

        def connect(path: Path = path, barrier: threading.Barrier = barrier,
                    failures: list[BaseException] = failures) -> None:
            conn = sqlite3.connect(path, check_same_thread=False)
            try:
                barrier.wait()
                _sqlite_pragmas(conn, None)
                assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)
            finally:
                conn.close()

        workers = [threading.Thread(target=connect) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not failures, f"round {index}: {failures[0]}"
