"""fsck: every row of the recovery table in docs/reference/protocol.md, on SQLite and PostgreSQL.

Each crash state is built with the store's own functions exactly as an
interrupted publish or retention run leaves it (a staging row owned by a dead
writer, a renamed payload, a half-written staging directory), then fsck must
name it, change nothing without ``repair``, and fix it with ``repair``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from registry import Checkpoint, Registry
from registry.catalog import Claim
from registry.cli import main
from registry.ops.fsck import FsckReport
from registry.records import CheckpointInfo
from registry.fs.store import install, new_staging, now_timestamp, write_payload
from registry.fs.payloadfiles import Payload
from tests.helpers import assert_state_equal, make_state

DEAD = f"{socket.gethostname()}:4194399"  # above Linux's pid_max: provably not running


def payload(seed: int) -> Payload:
    return Payload(state_dict=make_state(seed), meta={"epoch": 2, "consumed_samples": 64, "seed": seed,
                                                      "timestamp": now_timestamp(), "optimizer_step": seed})


def claim(reg: Registry, run: str, step: int, *, writer: str = DEAD, overwrite: bool = False,
          path: str | None = None) -> Claim:
    return reg.catalog.claim(run, step, path=path or f"{run}/step-{step:08d}", writer=writer, overwrite=overwrite)


def dead_claim(reg: Registry, run: str, step: int, *, overwrite: bool = False, upload: int | None = None,
               manifest: bool = True) -> str:
    """On an s3:// root, a publish whose writer died after claiming: its attempt prefix, fully uploaded
    with ``upload`` (a seed; what a writer killed before its commit leaves), or every file but the
    manifest (``manifest=False``: killed mid-upload)."""
    from registry.format.layout import attempt_relpath
    from registry.fs.objectwrite import upload_payload
    rel = attempt_relpath(run, step)
    claim(reg, run, step, overwrite=overwrite, path=rel)
    if upload is not None:
        assert reg.objects is not None
        upload_payload(reg.objects, rel, payload(upload))
        if not manifest:
            reg.objects.delete([f"{rel}/manifest.json"])
    return rel


def crash_before_commit(reg: Registry, run: str, step: int, seed: int) -> None:
    """A publish whose payload is in place and whose writer died before the catalog commit, on either root."""
    if reg.objects is None:
        crash_after_rename(reg, run, step, seed)
    else:
        dead_claim(reg, run, step, upload=seed)


def stored_bytes(reg: Registry, info: CheckpointInfo) -> int:
    if reg.objects is not None:
        return sum(e.size for e in reg.objects.list(info.path.as_posix()))
    return sum(p.stat().st_size for p in info.path.iterdir())


def crash_after_rename(reg: Registry, run: str, step: int, seed: int) -> Path:
    """A publish whose writer died between the rename and the catalog commit."""
    claim(reg, run, step)
    final = reg.store.step_dir(run, step)
    staging = new_staging(final)
    write_payload(staging, payload(seed))
    install(staging, final)
    return final


def disk_state(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.name.startswith("catalog.db"):
            out[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            out[path.relative_to(root).as_posix() + "/"] = ""
    return out


def catalog_state(reg: Registry) -> list[tuple[str, int, str, str | None]]:
    return [(i.run, i.step, i.status, i.manifest_sha256) for r in reg.runs()
            for i in reg.catalog.checkpoints(r.name, statuses=("staging", "published", "verified", "failed",
                                                               "corrupt", "deleted"))]


def kinds(report: FsckReport) -> list[tuple[str, int, str]]:
    return sorted((p.run, p.step, p.kind) for p in report.problems)


def test_clean_registry_is_clean(any_reg: Registry) -> None:
    reg = any_reg
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2), verify=False)
    report = reg.fsck(checksums=True)
    assert report.clean and report.rows_checked == 2 and not report.in_progress


def test_uncommitted_publish_rolls_forward(any_reg: Registry) -> None:
    reg = any_reg
    reg.publish("run", 1, make_state(1))
    crash_before_commit(reg, "run", 2, seed=22)
    assert reg.resolve("run").step == 1  # not visible while pending
    report = reg.fsck()
    assert kinds(report) == [("run", 2, "uncommitted-publish")] and not report.repaired
    assert reg.catalog.get("run", 2).status == "staging"  # type: ignore[union-attr]
    report = reg.fsck(repair=True)
    assert report.repaired == report.problems and not report.unrepaired
    info = reg.resolve("run")
    assert info.step == 2 and info.status == "verified"
    assert info.epoch == 2 and info.consumed_samples == 64 and info.optimizer_step == 22
    assert info.total_bytes == stored_bytes(reg, info)
    assert_state_equal(reg.load("run").state_dict, make_state(22))
    assert {f.name for f in reg.catalog.files("run", 2)} >= {"model.safetensors", "meta.json"}
    assert reg.fsck(checksums=True).clean
    assert any(e.kind == "repair" and e.detail["problem"] == "uncommitted-publish" for e in reg.events("run"))


def test_abandoned_publish_is_failed_and_cleaned(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    claim(reg, "run", 2)
    staging = new_staging(reg.store.step_dir("run", 2))
    (staging / "model.safetensors").write_bytes(b"half a file")
    report = reg.fsck()
    assert kinds(report) == [("run", 2, "abandoned-publish"), ("run", 2, "abandoned-staging")]
    assert staging.exists()
    reg.fsck(repair=True)
    assert not staging.exists()
    assert reg.catalog.get("run", 2).status == "failed"  # type: ignore[union-attr]
    assert reg.fsck().clean
    assert reg.publish("run", 2, make_state(2)).status == "verified"


def test_abandoned_staging_without_row(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    orphan = new_staging(reg.store.step_dir("run", 7))
    (orphan / "meta.json").write_text("{}")
    assert kinds(reg.fsck()) == [("run", 7, "abandoned-staging")]
    reg.fsck(repair=True)
    assert not orphan.exists() and reg.fsck().clean


def test_live_writer_is_left_alone(reg: Registry) -> None:
    claim(reg, "run", 3, writer=reg.writer)  # our own pid: alive
    staging = new_staging(reg.store.step_dir("run", 3))
    report = reg.fsck(repair=True)
    assert report.clean and [p.step for p in report.in_progress] == [3]
    assert staging.exists() and reg.catalog.get("run", 3).status == "staging"  # type: ignore[union-attr]


def test_interrupted_overwrite_restores_old_payload(reg: Registry) -> None:
    reg.publish("run", 5, make_state(1), tags=("release",))
    claim(reg, "run", 5, overwrite=True)
    final = reg.store.step_dir("run", 5)
    retired = final.parent / ".step-00000005.retired-abc"
    final.rename(retired)  # the crash between the two renames
    staging = new_staging(final)
    write_payload(staging, payload(9))
    report = reg.fsck()
    assert kinds(report) == [("run", 5, "abandoned-staging"), ("run", 5, "interrupted-overwrite"),
                             ("run", 5, "uncommitted-publish")]
    reg.fsck(repair=True)
    assert final.is_dir() and not retired.exists() and not staging.exists()
    info = reg.resolve("run@release")
    assert info.step == 5 and info.status == "verified"
    assert_state_equal(reg.load("run@5").state_dict, make_state(1))
    assert reg.fsck(checksums=True).clean


def test_leftover_retired_is_removed(reg: Registry) -> None:
    info = reg.publish("run", 5, make_state(1))
    leftover = info.path.parent / ".step-00000005.retired-xyz"
    shutil.copytree(info.path, leftover)
    assert kinds(reg.fsck()) == [("run", 5, "leftover-retired")]
    reg.fsck(repair=True)
    assert not leftover.exists() and info.path.is_dir() and reg.fsck().clean
    assert_state_equal(reg.load("run@5").state_dict, make_state(1))


def test_unfinished_deletion_is_finished(reg: Registry) -> None:
    a = reg.publish("run", 1, make_state(1))
    b = reg.publish("run", 2, make_state(2))
    reg.publish("run", 3, make_state(3))
    for info in (a, b):
        reg.catalog.set_status("run", info.step, "deleted", kind="delete")
    retired = b.path.parent / ".step-00000002.retired-q"
    b.path.rename(retired)  # retention crashed after retiring step 2, before removing it
    assert kinds(reg.fsck()) == [("run", 1, "unfinished-deletion"), ("run", 2, "unfinished-deletion")]
    reg.fsck(repair=True)
    assert not a.path.exists() and not retired.exists()
    assert [i.status for i in reg.checkpoints("run", include_deleted=True)] == ["deleted", "deleted", "verified"]
    assert reg.fsck().clean


def test_unregistered_checkpoint_is_adopted(reg: Registry, root: Path) -> None:
    Checkpoint(state_dict=make_state(4), epoch=1, consumed_samples=8).save(root / "run" / "step-00000040")
    legacy = root / "run" / "step-00000050"
    legacy.mkdir(parents=True)
    (legacy / "meta.json").write_text("{}")  # no manifest: cannot be adopted safely
    report = reg.fsck()
    assert kinds(report) == [("run", 40, "unregistered-checkpoint"), ("run", 50, "unregistered-checkpoint")]
    report = reg.fsck(repair=True)
    assert [(p.step, p.repair) for p in report.unrepaired] == [(50, None)]
    info = reg.resolve("run@40")
    assert info.status == "verified" and info.epoch == 1 and info.consumed_samples == 8
    assert_state_equal(reg.load("run@40").state_dict, make_state(4))
    assert legacy.is_dir()  # reported, never touched
    assert [p.step for p in reg.fsck().problems] == [50]


def test_an_unregistered_checkpoint_says_whether_a_failed_row_stands_for_it(
        reg: Registry, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from registry.errors import CatalogError
    from tests.helpers import fail_commits
    fail_commits(monkeypatch)
    with pytest.raises(CatalogError):
        reg.publish("run", 60, make_state(6))
    monkeypatch.undo()
    assert reg.catalog.get("run", 60).status == "failed"  # type: ignore[union-attr]
    Checkpoint(state_dict=make_state(6)).save(root / "run" / "step-00000060")
    Checkpoint(state_dict=make_state(7)).save(root / "run" / "step-00000070")
    details = {p.step: p.detail for p in reg.fsck().problems}
    assert details == {60: "valid checkpoint with a failed catalog row",
                       70: "valid checkpoint with no catalog row"}, details


def test_missing_and_damaged_payloads_become_corrupt(reg: Registry) -> None:
    one = reg.publish("run", 1, make_state(1))
    two = reg.publish("run", 2, make_state(2))
    three = reg.publish("run", 3, make_state(3))
    four = reg.publish("run", 4, make_state(4))
    shutil.rmtree(two.path)
    with open(three.path / "model.safetensors", "r+b") as f:
        f.truncate(100)
    weights = four.path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0x01
    weights.write_bytes(bytes(raw))
    assert kinds(reg.fsck()) == [("run", 2, "missing-payload"), ("run", 3, "damaged-payload")]
    assert kinds(reg.fsck(checksums=True)) == [("run", 2, "missing-payload"), ("run", 3, "damaged-payload"),
                                               ("run", 4, "damaged-payload")]
    reg.fsck(repair=True, checksums=True)
    assert [i.status for i in reg.checkpoints("run")] == ["verified", "corrupt", "corrupt", "corrupt"]
    assert reg.resolve("run").step == one.step
    # corrupt is a recorded state that needs a person: listed, never repaired away
    again = reg.fsck(repair=True, checksums=True)
    assert kinds(again) == [("run", s, "corrupt-step") for s in (2, 3, 4)] and not again.repaired
    assert all(p.repair is None and "registry verify" in p.detail for p in again.problems)


def test_invalid_staged_payload_is_marked_corrupt(reg: Registry) -> None:
    final = crash_after_rename(reg, "run", 2, seed=2)
    (final / "manifest.json").write_text("not json")
    assert kinds(reg.fsck()) == [("run", 2, "invalid-staged-payload")]
    reg.fsck(repair=True)
    assert reg.catalog.get("run", 2).status == "corrupt"  # type: ignore[union-attr]
    assert final.is_dir() and kinds(reg.fsck()) == [("run", 2, "corrupt-step")]


def test_without_repair_nothing_changes(reg: Registry, root: Path) -> None:
    """Every kind of problem at once: a read-only fsck must leave disk and catalog byte-identical."""
    reg.publish("a", 1, make_state(1))
    gone = reg.publish("a", 2, make_state(2))
    shutil.rmtree(gone.path)
    crash_after_rename(reg, "a", 3, seed=3)
    claim(reg, "b", 1)
    new_staging(reg.store.step_dir("b", 1))
    reg.publish("b", 2, make_state(2))
    claim(reg, "b", 2, overwrite=True)
    reg.store.step_dir("b", 2).rename(root / "b" / ".step-00000002.retired-z")
    Checkpoint(state_dict=make_state(5)).save(root / "c" / "step-00000009")
    disk, cat = disk_state(root), catalog_state(reg)
    report = reg.fsck(checksums=True)
    assert len(report.problems) == 7 and not report.repaired
    assert disk_state(root) == disk and catalog_state(reg) == cat
    repaired = reg.fsck(repair=True)
    assert not repaired.unrepaired and not repaired.failures
    assert kinds(reg.fsck(checksums=True)) == [("a", 2, "corrupt-step")]  # the missing payload, now recorded
    assert reg.resolve("a@latest").step == 3 and reg.resolve("b@2").status == "verified"
    assert reg.resolve("c").step == 9


def test_publish_and_load_work_while_problems_pend(any_reg: Registry) -> None:
    reg = any_reg
    reg.publish("run", 1, make_state(1))
    crash_before_commit(reg, "run", 2, seed=2)      # pending roll-forward
    if reg.objects is None:                         # pending abandoned publish
        claim(reg, "run", 3)
        new_staging(reg.store.step_dir("run", 3))
    else:
        dead_claim(reg, "run", 3, upload=3, manifest=False)
    assert_state_equal(reg.load("run").state_dict, make_state(1))
    # a resumed trainer re-publishes both steps: the dead writer's claims are taken over
    assert reg.publish("run", 2, make_state(20)).status == "verified"
    assert reg.publish("run", 3, make_state(30)).status == "verified"
    assert_state_equal(reg.load("run").state_dict, make_state(30))
    assert_state_equal(reg.load("run@2").state_dict, make_state(20))
    if reg.objects is not None:  # the dead writers' attempt prefixes: no rename replaced them
        assert kinds(reg.fsck(repair=True)) == [("run", 2, "orphan-prefix"), ("run", 3, "orphan-prefix")]
    assert reg.fsck(checksums=True).clean


def test_cli_fsck(catalog_url: str, any_root: str) -> None:
    with Registry.open(url=catalog_url, root=any_root) as reg:
        reg.publish("run", 1, make_state(1))
        crash_before_commit(reg, "run", 2, seed=2)
    runner = CliRunner()

    def cli(*args: str):  # type: ignore[no-untyped-def]
        return runner.invoke(main, ["--url", catalog_url, "--root", any_root, "fsck", *args],
                             catch_exceptions=False)

    result = cli()
    assert result.exit_code == 1 and "uncommitted-publish" in result.output
    doc = json.loads(cli("--json").output)
    assert [p["kind"] for p in doc["unrepaired"]] == ["uncommitted-publish"] and not doc["clean"]
    result = cli("--repair", "--json")
    assert result.exit_code == 0 and json.loads(result.output)["repaired"][0]["step"] == 2
    result = cli("--checksums")
    assert result.exit_code == 0 and "0 problems" in result.output


@pytest.mark.parametrize("kill_at", ["fsck-after-restore"])
def test_fsck_is_itself_crash_safe(sqlite_reg: Registry, kill_at: str) -> None:
    """An fsck killed mid-repair leaves a state that the next fsck repairs (see test_kill for the kill)."""
    reg = sqlite_reg
    reg.publish("run", 5, make_state(1))
    claim(reg, "run", 5, overwrite=True)
    final = reg.store.step_dir("run", 5)
    final.rename(final.parent / ".step-00000005.retired-k")
    # the state fsck-after-restore leaves: payload restored, row still staging with a dead writer
    (final.parent / ".step-00000005.retired-k").rename(final)
    assert kinds(reg.fsck()) == [("run", 5, "uncommitted-publish")]
    reg.fsck(repair=True)
    assert reg.fsck().clean and reg.resolve("run").step == 5


def test_open_never_repairs(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("run", 1, make_state(1))
        crash_after_rename(reg, "run", 2, seed=2)
        new_staging(reg.store.step_dir("run", 3))
        disk, cat = disk_state(root), catalog_state(reg)
    with Registry.open(url=catalog_url, root=root) as reg:
        assert disk_state(root) == disk and catalog_state(reg) == cat
        assert len(reg.fsck().problems) == 2
