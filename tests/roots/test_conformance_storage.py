"""Conformance, what storage does to steps and what the registry does about it: damage, retention, fsck and
verify, the same cases with the same answers on a directory, an ``s3://`` and a tiered root, each on SQLite and
PostgreSQL (see ``tests/roots/conftest.py``)."""

from __future__ import annotations

import pytest

from registry import Registry
from registry.errors import CorruptCheckpointError
from registry.ops.fsck import FsckReport
from registry.records import Status
from registry.retention import KeepLast
from tests.helpers import assert_state_equal, make_state
from tests.roots.kinds import copies, damage_everywhere, orphans, present, settle
from tests.test_fsck import DEAD, claim, payload


def kinds(report: FsckReport) -> list[tuple[str, int, str]]:
    return sorted((p.run, p.step, p.kind) for p in report.problems)


def test_damaged_bytes_in_storage_make_latest_fall_back_and_the_step_corrupt(kind_reg: Registry) -> None:
    reg = kind_reg
    reg.publish("run", 1, make_state(1))
    info = reg.publish("run", 2, make_state(2))
    settle(reg, "run")
    damaged = damage_everywhere(reg, reg.resolve("run@2"))
    assert len(damaged) == (2 if reg.root.can.tiers else 1)
    with pytest.warns(RuntimeWarning):
        ck = reg.load("run@latest")
    assert ck.step == 1 and ck.fallback is not None and [s.step for s in ck.fallback.skipped] == [2]
    assert_state_equal(ck.state_dict, make_state(1))
    row = reg.catalog.get("run", 2)
    assert row is not None and row.status == Status.CORRUPT and row.manifest_sha256 == info.manifest_sha256
    assert reg.resolve("run@latest").step == 1
    with pytest.raises(CorruptCheckpointError):
        reg.load("run@2")


def test_retention_keeps_the_invariants_and_what_it_deletes_leaves_storage(kind_reg: Registry) -> None:
    reg = kind_reg
    for step in (1, 2, 3, 4):
        reg.publish("run", step, make_state(step), tags=("keep",) if step == 1 else ())
    settle(reg, "run")
    where = {step: copies(reg, reg.resolve(f"run@{step}")) for step in (1, 2, 3, 4)}
    if reg.root.can.tiers:  # retention is per tier: the durable copy first, then the fast one, the step's last
        durable = reg.plan_tier_retention("run", KeepLast(2), tier="durable").execute()
        assert durable.deleted == (2,) and durable.ended == () and not durable.errors
        assert reg.catalog.get("run", 2).status == Status.VERIFIED  # type: ignore[union-attr]
        fast = reg.plan_tier_retention("run", KeepLast(2), tier="fast").execute()
        assert fast.deleted == (2,) and fast.ended == (2,) and not fast.errors
    else:
        result = reg.apply_retention("run", KeepLast(2))
        assert result.deleted == (2,) and not result.errors
    assert [(i.step, i.status) for i in reg.checkpoints("run", include_deleted=True)] == [
        (1, Status.VERIFIED), (2, Status.DELETED), (3, Status.VERIFIED), (4, Status.VERIFIED)]
    assert [str(c) for c in where[2] if present(reg, c)] == []
    for step in (1, 3, 4):
        assert all(present(reg, c) for c in where[step]), step
    assert reg.resolve("run@latest").step == 4 and reg.resolve("run@keep").step == 1
    assert_state_equal(reg.load("run@keep").state_dict, make_state(1))
    assert orphans(reg, "run") == []
    assert reg.fsck(checksums=True).clean


def abandon_publish(reg: Registry, run: str, step: int) -> None:
    """What a writer killed mid-publish leaves: its claim, and part of its payload where it was writing."""
    relpath = reg.root.new_relpath(run, step)
    local = reg.root.local_dir
    if local is None:  # an attempt prefix with every file but the manifest
        from registry.fs.objectwrite import upload_payload
        claim(reg, run, step, path=relpath)
        assert reg.objects is not None
        upload_payload(reg.objects, relpath, payload(step))
        reg.objects.delete([f"{relpath}/manifest.json"])
    else:  # a staging directory with half a file
        from registry.fs.store import new_staging
        claim(reg, run, step, path=relpath)
        (new_staging(local / relpath) / "model.safetensors").write_bytes(b"half a file")
    row = reg.catalog.get(run, step)
    assert row is not None and row.status == Status.STAGING and row.writer == DEAD


def test_fsck_is_clean_after_publishes_and_repairs_a_dead_writers_claim(kind_reg: Registry) -> None:
    reg = kind_reg
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2), verify=False)
    settle(reg, "run")
    report = reg.fsck(checksums=True)
    assert report.clean and report.rows_checked >= 2, report.to_json()
    abandon_publish(reg, "run", 3)
    found = reg.fsck()
    assert ("run", 3, "abandoned-publish") in kinds(found) and not found.repaired
    assert reg.catalog.get("run", 3).status == Status.STAGING  # type: ignore[union-attr]
    repaired = reg.fsck(repair=True)
    assert ("run", 3, "abandoned-publish") in [(p.run, p.step, p.kind) for p in repaired.repaired]
    assert not repaired.unrepaired, repaired.to_json()
    again = reg.fsck(checksums=True)
    assert again.clean, again.to_json()
    assert reg.catalog.get("run", 3).status == Status.FAILED  # type: ignore[union-attr]
    assert orphans(reg, "run") == []
    assert reg.publish("run", 3, make_state(3)).status == Status.VERIFIED
    settle(reg, "run")
    assert reg.fsck(checksums=True).clean


def test_verify_marks_intact_steps_verified(kind_reg: Registry) -> None:
    reg = kind_reg
    for step in (1, 2):
        assert reg.publish("run", step, make_state(step), verify=False).status == Status.PUBLISHED
    results = reg.verify("run")
    assert [(r.step, r.ok, r.status, r.problems) for r in results] == [(1, True, Status.VERIFIED, ()),
                                                                       (2, True, Status.VERIFIED, ())]
    assert [(i.step, i.status) for i in reg.checkpoints("run")] == [(1, Status.VERIFIED), (2, Status.VERIFIED)]
    assert all(i.verified_at is not None for i in reg.checkpoints("run"))
    assert sum(e.kind == "verify" for e in reg.events("run")) == 2
    assert reg.resolve("run@latest").step == 2


def test_a_file_beside_the_steps_streams_in_and_out_whole_or_not_at_all(kind_reg: Registry) -> None:
    aside = kind_reg.root.aside()
    data = bytes(range(256)) * (40 << 10)  # 10 MiB: more than one part of an object store's upload
    out = aside.writer("run/.policy-folds/1-1.full.safetensors")
    for start in range(0, len(data), 3 << 20):
        out.write(data[start:start + (3 << 20)])
    assert aside.names("run/.policy-folds") == []  # nothing is stored before the commit
    out.commit()
    assert aside.names("run/.policy-folds") == ["run/.policy-folds/1-1.full.safetensors"]
    assert b"".join(bytes(b) for b in aside.chunks("run/.policy-folds/1-1.full.safetensors")) == data
    assert bytes(aside.whole("run/.policy-folds/1-1.full.safetensors", len(data))) == data  # one buffer, whole
    for wrong in (len(data) - 1, len(data) + 1):
        with pytest.raises(CorruptCheckpointError):
            aside.whole("run/.policy-folds/1-1.full.safetensors", wrong)
    dropped = aside.writer("run/.policy-folds/1-1.full.safetensors")  # a second write, aborted: the first stays
    dropped.write(b"other bytes" * (1 << 20))
    dropped.abort()
    assert aside.get("run/.policy-folds/1-1.full.safetensors") == data
    # an object store's upload of the aborted write may stay incomplete (the client cannot abort it): fsck's
    assert [u.rel for u in aside.unfinished("run/.policy-folds")] in ([], ["run/.policy-folds/1-1.full.safetensors"])
    kind_reg.publish("run", 1, make_state(1))
    kind_reg.fsck(repair=True)
    assert aside.unfinished("run/.policy-folds") == []
    with pytest.raises(FileNotFoundError):
        b"".join(bytes(b) for b in aside.chunks("run/.policy-folds/2-2.full.safetensors"))
    with pytest.raises(FileNotFoundError):
        aside.whole("run/.policy-folds/2-2.full.safetensors", 1)
