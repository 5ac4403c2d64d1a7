"""Conformance, crashes and read faults: a writer SIGKILLed at every crash point of a publish (and, on a tiered
root, of its replication), and a read that fails under a load, with the same answers on a directory, an ``s3://``
and a tiered root, each on SQLite and PostgreSQL (see ``tests/roots/conftest.py``).

After a kill the step is either not there or whole, ``fsck --repair`` leaves a
clean root and no orphan, and the step can be published again. A read that
fails is the reader's trouble: one line, nothing marked corrupt, and the next
load works.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from registry import Registry
from registry.format.layout import step_dirname
from registry.errors import CheckpointNotFoundError, CheckpointReadError, StorageError
from registry.records import Status
from tests import s3proxy
from tests.helpers import assert_state_equal, make_state
from tests.roots.kinds import (WEIGHTS, Kind, copies, failing_reads, killed_publishing, killed_retaining,
                               one_line_registry_error, orphans, retain, settle, stored)

LIVE = (Status.PUBLISHED, Status.VERIFIED)
PUBLISH_POINTS = ("after-claim", "after-write", "after-rename", "after-commit")
REPLICATE_POINTS = ("replicate-after-claim", "replicate-after-upload")
# where the kill leaves step 2 before any repair: "live" (committed, loads) or "absent" (not committed; fsck may
# then roll a complete payload forward, as it does after an s3:// after-write or a directory's after-rename)
BEFORE_REPAIR = {"after-claim": "absent", "after-write": "absent", "after-rename": "absent",
                 "after-commit": "live", "replicate-after-claim": "live", "replicate-after-upload": "live"}


def step_two(reg: Registry) -> str:
    """``run@2`` either loads bit-identical to what the killed writer published ("live"), or is no step any
    reader sees ("absent"); ``run@1``, committed before, loads whole either way."""
    assert_state_equal(reg.load("run@1").state_dict, make_state(1))
    row = reg.catalog.get("run", 2)
    if row is not None and row.status in LIVE:
        ck = reg.load("run@2")
        assert ck.step == 2 and reg.resolve("run@latest").step == 2
        assert_state_equal(ck.state_dict, make_state(2))
        return "live"
    assert row is None or row.status in (Status.STAGING, Status.FAILED), row
    with pytest.raises(CheckpointNotFoundError):
        reg.resolve("run@2")
    assert reg.resolve("run@latest").step == 1
    return "absent"


def applying(point: str) -> Any:
    """``point`` as a parameter, marked with the kinds of root whose publish passes it."""
    if point in REPLICATE_POINTS:  # only a root with a durable tier replicates
        return pytest.param(point, marks=pytest.mark.kinds("tiered"))
    if point == "after-rename":  # an object store has no rename: an s3:// publish never reaches it
        return pytest.param(point, marks=pytest.mark.kinds("directory", "tiered"))
    return point


@pytest.mark.parametrize("point", [applying(p) for p in PUBLISH_POINTS + REPLICATE_POINTS])
def test_a_writer_killed_at_a_crash_point_leaves_a_whole_step_or_none_and_fsck_repairs_the_rest(
        kind: Kind, point: str) -> None:
    code = killed_publishing(kind, point)
    assert code == -signal.SIGKILL, f"the writer was not killed at {point} (exit code {code})"
    with kind.open() as reg:
        before = step_two(reg)
        assert before == BEFORE_REPAIR[point]
        found = reg.fsck()
        if before == "absent":  # the killed writer's claim is left: fsck finds it, and nothing else
            assert found.problems and {p.step for p in found.problems} == {2}, found.to_json()
        repaired = reg.fsck(repair=True)
        assert not repaired.unrepaired, repaired.to_json()
        assert {(p.step, p.kind) for p in found.problems} <= {(p.step, p.kind) for p in repaired.repaired}
        after = step_two(reg)
        assert before == "absent" or after == "live"  # a repair never takes a committed step away
        report = reg.fsck()
        assert report.clean, report.to_json()
        settle(reg, "run")  # on a tiered root: every live step reaches the durable tier, killed claims and all
        assert orphans(reg, "run") == []

        again = reg.publish("run", 2, make_state(22), overwrite=after == "live")
        assert again.status == Status.VERIFIED
        assert_state_equal(reg.load("run@2").state_dict, make_state(22))
        settle(reg, "run")
        if reg.root.can.tiers:
            assert sorted(reg.wait_durable("run", s, timeout=60).step for s in (1, 2)) == [1, 2]
            assert_state_equal(reg.load("run@latest-durable").state_dict, make_state(22))
        assert orphans(reg, "run") == []
        final = reg.fsck(checksums=True)
        assert final.clean, final.to_json()


OVERWRITE_POINTS = ("after-claim", "after-write", "after-retire", "after-rename", "after-commit")


@pytest.mark.parametrize("point", [pytest.param(p, marks=pytest.mark.kinds("directory", "tiered"))
                                   if p in ("after-retire", "after-rename") else p for p in OVERWRITE_POINTS])
def test_an_overwrite_killed_at_a_crash_point_leaves_the_old_payload_or_the_new_one_whole(
        kind: Kind, point: str) -> None:
    """One judge on every kind: whatever the kill left (a claim over the old payload, a new payload not committed,
    the old one retired and the new not in place), ``run@2`` loads whole, before and after ``fsck --repair``, as
    the old state or the new one (never none, never a mix), and the repair leaves nothing behind."""
    code = killed_publishing(kind, point, overwrite=True)
    assert code == -signal.SIGKILL, f"the overwrite was not killed at {point} (exit code {code})"

    def step_two(reg: Registry) -> int:
        state = reg.load("run@2").state_dict
        seed = int(state["count"])
        assert seed in (2, 22), seed
        assert_state_equal(state, make_state(seed))
        return seed

    with kind.open() as reg:
        before: int | None = None
        try:
            before = step_two(reg)
        except CheckpointNotFoundError:  # a dead claim hides the step (never shows wrong bytes) until fsck
            assert point != "after-commit"
        repaired = reg.fsck(repair=True)
        assert not repaired.unrepaired and not repaired.failures, repaired.to_json()
        after = step_two(reg)
        assert before is None or after == before, (before, after)
        assert reg.resolve("run@latest").step == 2
        report = reg.fsck(checksums=True)
        assert report.clean, report.to_json()
        settle(reg, "run")
        assert orphans(reg, "run") == []
        again = reg.publish("run", 2, make_state(23), overwrite=True)
        assert again.status == Status.VERIFIED
        assert_state_equal(reg.load("run@2").state_dict, make_state(23))
        settle(reg, "run")
        assert orphans(reg, "run") == [] and reg.fsck(checksums=True).clean


@pytest.mark.parametrize("point", ["gc-after-mark", "gc-after-retire"])
def test_a_retention_killed_at_a_crash_point_is_finished_by_the_next_one(kind: Kind, point: str) -> None:
    """Every kind keeps plain retention's promise: a retention killed after its mark, or after its first removal
    began, loses no step it keeps (each loads whole before any repair), and the next retention finishes what the
    killed one marked, with no fsck: nothing of the deleted step is left in storage, nothing is orphaned, and
    fsck is clean."""
    code = killed_retaining(kind, point)
    assert code == -signal.SIGKILL, f"the retention was not killed at {point} (exit code {code})"
    with kind.open() as reg:
        for step in (3, 4):  # what KeepLast(2) keeps, whole before any repair
            assert_state_equal(reg.load(f"run@{step}").state_dict, make_state(step))
        results = retain(reg, "run", 2)
        assert not any(r.errors for r in results), results
        assert any(r.healed for r in results), results  # the killed one's mark was finished, not redone
        assert [i.step for i in reg.checkpoints("run")] == [3, 4]
        for step in (3, 4):
            assert_state_equal(reg.load(f"run@{step}").state_dict, make_state(step))
        left = [name for name, _size in stored(reg) if not any(f"/{step_dirname(s)}/" in name for s in (3, 4))]
        assert left == [], left  # nothing of steps 1 and 2, on any tier
        assert orphans(reg, "run") == []
        report = reg.fsck(checksums=True)
        assert report.clean, report.to_json()


# --------------------------------------------------------------------------- read faults


Marks = tuple[list[tuple[int, str]], dict[tuple[int, str], str], list[int | None]]


def marks(reg: Registry) -> Marks:
    """What a load could have condemned: the rows' statuses, the copies' statuses and the corrupt events."""
    return ([(i.step, str(i.status)) for i in reg.checkpoints("run", include_deleted=True)],
            {(r.step, r.location): r.status for r in reg.replicas("run")} if reg.root.can.tiers else {},
            [e.step for e in reg.events("run") if e.kind == "corrupt"])


def unmarked(reg: Registry, before: Marks) -> None:
    """Nothing condemned since ``before``: the same rows, each copy as it was (a reader's cached copy may join)."""
    now = marks(reg)
    assert now[0] == before[0] and now[2] == before[2] == []
    assert {k: now[1].get(k) for k in before[1]} == before[1]


def published(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2))
    settle(reg, "run")


@pytest.mark.kinds("directory", "tiered")  # an s3:// root reads nothing from a local disk: see the refused GET
@pytest.mark.parametrize("name", ["manifest.json", "meta.json"])
def test_a_local_read_failing_with_eio_is_one_line_marks_nothing_and_the_next_load_works(
        kind_reg: Registry, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    reg = kind_reg
    published(reg)
    before = marks(reg)
    assert before[0] == [(1, "verified"), (2, "verified")]
    local = [c.directory for c in copies(reg, reg.resolve("run@2")) if c.directory is not None]
    assert len(local) == 1
    with failing_reads(local[0] / name, monkeypatch) as hit, pytest.raises(CheckpointReadError) as caught:
        reg.load("run@latest")
    assert hit, "nothing was read from the step's files: the fault was not injected"
    one_line_registry_error(caught.value)
    assert caught.value.step == 2  # the latest step's error, not a fall-back to step 1
    unmarked(reg, before)
    assert_state_equal(reg.load("run@latest").state_dict, make_state(2))
    unmarked(reg, before)
    assert reg.fsck().clean


@pytest.mark.kinds("s3", "tiered")  # a directory root makes no request: see the failing local read
@pytest.mark.parametrize("name", ["manifest.json", WEIGHTS])
def test_a_refused_get_is_one_line_marks_nothing_and_the_next_load_works(kind: Kind, kind_reg: Registry,
                                                                        tmp_path: Path, name: str) -> None:
    reg = kind_reg
    published(reg)
    before = marks(reg)
    assert before[0] == [(1, "verified"), (2, "verified")]
    prefixes = [c.prefix for c in copies(reg, reg.resolve("run@2")) if c.prefix is not None]
    assert len(prefixes) == 1
    with s3proxy.running(os.environ["AWS_ENDPOINT_URL"]) as proxy:
        proxy.deny = lambda seen: seen.method == "GET" and seen.path.endswith(f"/{prefixes[0]}/{name}")
        options = {"endpoint": proxy.endpoint, "max_retries": 1, "retry_timeout": 5}
        # a tiered root reads its durable copy only on a host with no fast copy: a second host's
        elsewhere = kind if kind.durable is None else Kind(name=kind.name, url=kind.url, root=str(tmp_path / "host-b"),
                                                            durable=kind.durable)
        with elsewhere.open(storage_options=options) as reader:
            with pytest.raises((StorageError, CheckpointReadError)) as caught:
                reader.load("run@latest")
            assert proxy.count(lambda seen: proxy.deny is not None and proxy.deny(seen)) > 0
            one_line_registry_error(caught.value)
            unmarked(reg, before)
            proxy.deny = None
            assert_state_equal(reader.load("run@latest").state_dict, make_state(2))
            assert reader.fsck().clean  # the failed read left nothing behind (a part of a download, say)
    unmarked(reg, before)
