"""Staging rows of writers on other hosts: alive while they refresh their row, abandoned once they stop.

A preempted node cannot be asked whether its process lives; a job resumed on
another node must still be able to publish the step the dead one was writing.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

import registry.ops.protocol as protocol
import registry.fs.payloadfiles as payloadfiles
import registry.fs.store as store_mod
from registry import Registry, StepExistsError
from registry.catalog import Claim
from registry.catalog.models import CheckpointRow
from registry.fs.store import new_staging
from registry.ops.writers import STALE_AFTER, writer_alive
from tests.helpers import make_state

ELSEWHERE = "another-node:4242"  # a host name that is not this machine's


def foreign_claim(reg: Registry, step: int) -> Claim:
    final = reg.store.step_dir("run", step)
    return reg.catalog.claim("run", step, path=reg.store.relpath(final), writer=ELSEWHERE, overwrite=False)


def row_updated_at(reg: Registry, claim: Claim) -> datetime:
    with reg.catalog.engine.connect() as conn:
        value = conn.scalar(select(CheckpointRow.c.updated_at).where(CheckpointRow.c.id == claim.checkpoint_id))
    assert value is not None
    return value if value.tzinfo is not None else value.replace(tzinfo=timezone.utc)


def age(reg: Registry, claim: Claim, by: timedelta) -> None:
    """Make the row look last refreshed ``by`` ago, as a writer that stopped beating leaves it."""
    with reg.catalog.engine.begin() as conn:
        conn.execute(update(CheckpointRow).where(CheckpointRow.c.id == claim.checkpoint_id)
                     .values(updated_at=datetime.now(timezone.utc) - by))


def test_writer_alive_rule() -> None:
    now = datetime.now(timezone.utc)
    assert writer_alive(ELSEWHERE)  # no row time: presumed alive
    assert writer_alive(ELSEWHERE, now - STALE_AFTER / 2)
    assert not writer_alive(ELSEWHERE, now - STALE_AFTER - timedelta(seconds=1))
    assert not writer_alive(None) and not writer_alive("no-pid")


def test_a_stale_foreign_staging_row_is_taken_over_by_the_next_publish(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    claim = foreign_claim(reg, 2)
    with pytest.raises(StepExistsError, match=ELSEWHERE):  # refreshed just now: a live writer elsewhere
        reg.publish("run", 2, make_state(2))
    age(reg, claim, STALE_AFTER / 2)
    with pytest.raises(StepExistsError, match=ELSEWHERE):
        reg.publish("run", 2, make_state(2), blocking=False)
    age(reg, claim, STALE_AFTER + timedelta(minutes=1))  # the node was preempted mid-publish
    with reg.catalog.engine.begin() as conn:  # and its claim was made long ago
        conn.execute(update(CheckpointRow).where(CheckpointRow.c.id == claim.checkpoint_id)
                     .values(created_at=datetime.now(timezone.utc) - timedelta(days=1)))
    before = datetime.now(timezone.utc) - timedelta(minutes=5)
    info = reg.publish("run", 2, make_state(2))
    assert info.status == "verified" and info.writer == reg.writer
    assert [e.kind for e in reg.events("run") if e.step == 2][-2:] == ["takeover", "publish"]
    created = info.created_at if info.created_at.tzinfo else info.created_at.replace(tzinfo=timezone.utc)
    assert created > before  # the step is this writer's, created now, not when the dead writer claimed it


def test_fsck_repairs_a_stale_foreign_staging_row_and_leaves_a_fresh_one(reg: Registry) -> None:
    foreign_claim(reg, 1)
    stale = foreign_claim(reg, 2)
    tmp_fresh = new_staging(reg.store.step_dir("run", 1))
    tmp_stale = new_staging(reg.store.step_dir("run", 2))
    age(reg, stale, STALE_AFTER + timedelta(minutes=1))
    report = reg.fsck(repair=True)
    assert [(p.kind, p.step) for p in report.in_progress] == [("in-progress", 1)]
    assert {(p.kind, p.step) for p in report.problems} == {("abandoned-staging", 2), ("abandoned-publish", 2)}
    assert tmp_fresh.is_dir() and not tmp_stale.exists()
    assert reg.catalog.get("run", 1).status == "staging"  # type: ignore[union-attr]
    assert reg.catalog.get("run", 2).status == "failed"  # type: ignore[union-attr]


def test_a_publish_refreshes_its_row_while_it_writes(sqlite_reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = sqlite_reg
    monkeypatch.setattr(protocol, "HEARTBEAT", timedelta(milliseconds=5))
    gate, beat = threading.Event(), threading.Condition()
    claims: list[Claim] = []
    started = [0]  # beats begun; the one heartbeat thread runs them one at a time
    real_touch, real_write = reg.catalog.touch_claim, store_mod.write_payload

    def touch(claim: Claim) -> None:
        with beat:
            started[0] += 1
        real_touch(claim)
        with beat:
            claims.append(claim)
            beat.notify_all()

    def slow_write(staging: Path, payload: payloadfiles.Payload, **options: Any) -> payloadfiles.Written:
        gate.wait()  # a write that outlasts several beats
        return real_write(staging, payload, **options)

    monkeypatch.setattr(reg.catalog, "touch_claim", touch)
    monkeypatch.setattr("registry.roots.directory.write_payload", slow_write)
    future = reg.publish("run", 1, make_state(1), blocking=False)
    try:
        with beat:
            assert beat.wait_for(lambda: claims, timeout=60)  # a hang guard: the beat never came
        claim = claims[0]
        first = row_updated_at(reg, claim)
        with beat:
            begun = started[0]  # a beat that begins after the read above stamps a later time
            assert beat.wait_for(lambda: len(claims) > begun, timeout=60)
        assert row_updated_at(reg, claim) > first
        assert reg.catalog.get("run", 1).status == "staging"  # type: ignore[union-attr]
    finally:
        gate.set()
    assert future.result().status == "verified"
