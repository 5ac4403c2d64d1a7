"""fsck racing other actors, and fsck on inputs that used to stop it.

Each race is made deterministic by wrapping one of fsck's own steps (its disk
scan, its catalog snapshot, its manifest read): the wrapper calls the original
unchanged and then, at that exact moment, a real second :class:`Registry` on
the same catalog and root publishes, re-publishes or runs gc.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import registry.ops.fsck as fsck_module
import registry.roots.dirscan as scan_module
import registry.ops.verdicts as verdicts_module
from registry import Checkpoint, Registry
from registry.cli import main
from registry.ops.fsck import FsckReport
from registry.format.layout import parse_step_dirname, step_dirname
from registry.format.refs import MAX_STEP
from registry.retention import KeepLast
from tests.helpers import assert_state_equal, make_state


def kinds(report: FsckReport) -> list[tuple[str, int, str]]:
    return sorted((p.run, p.step, p.kind) for p in report.problems)


def after(original: Callable[..., Any], then: Callable[[], None]) -> Callable[..., Any]:
    """``original``, unchanged, followed once by ``then`` (the second actor)."""
    fired: list[bool] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if not fired:
            fired.append(True)
            then()
        return result
    wrapper.fired = fired  # type: ignore[attr-defined]
    return wrapper


@pytest.mark.usefixtures("migrated_url")
def test_repair_keeps_a_step_republished_after_the_snapshot(catalog_url: str, root: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A deleted step re-published (verified) after fsck's snapshot is not removed as an unfinished deletion."""
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("run", 1, make_state(1))
        reg.publish("run", 2, make_state(2))
        reg.catalog.set_status("run", 1, "deleted", kind="delete")  # gc killed after marking, before removing
        assert kinds(reg.fsck()) == [("run", 1, "unfinished-deletion")]

        def republish() -> None:
            with Registry.open(url=catalog_url, root=root) as other:
                assert other.publish("run", 1, make_state(11)).status == "verified"

        wrapped = after(fsck_module.snapshot, republish)
        monkeypatch.setattr(fsck_module, "snapshot", wrapped)
        report = reg.fsck(repair=True)
        monkeypatch.undo()
        assert wrapped.fired and not report.repaired and not report.failures
        info = reg.resolve("run@1")
        assert info.status == "verified" and info.path.is_dir()
        assert_state_equal(reg.load("run@1", verify=True).state_dict, make_state(11))
        assert reg.fsck(checksums=True).clean


@pytest.mark.usefixtures("migrated_url")
def test_repair_puts_back_a_payload_installed_after_the_row_was_read_again(catalog_url: str, root: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The re-publish lands after fsck re-read the deleted row: gc's digest check keeps the new payload."""
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("run", 1, make_state(1))
        reg.publish("run", 2, make_state(2))
        reg.catalog.set_status("run", 1, "deleted", kind="delete")
        calls: list[int] = []
        original = fsck_module.unchanged

        def unchanged(catalog: Any, seen: Any) -> bool:
            result = original(catalog, seen)
            calls.append(seen.step)
            if calls == [1, 1]:  # the repair's own re-read, just before it removes the directory
                with Registry.open(url=catalog_url, root=root) as other:
                    assert other.publish("run", 1, make_state(11)).status == "verified"
            return result

        monkeypatch.setattr(fsck_module, "unchanged", unchanged)
        monkeypatch.setattr(verdicts_module, "unchanged", unchanged)  # the verdict's re-read, FsckPass._found
        report = reg.fsck(repair=True)
        monkeypatch.undo()
        assert calls == [1, 1] and not report.repaired
        assert len(report.failures) == 1 and "holds another payload" in report.failures[0]
        assert_state_equal(reg.load("run@1", verify=True).state_dict, make_state(11))
        assert reg.fsck(checksums=True).clean


@pytest.mark.usefixtures("migrated_url")
def test_repair_does_not_condemn_a_step_published_after_the_scan(catalog_url: str, root: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish that commits between fsck's disk scan and its catalog read is not a missing payload."""
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("run", 1, make_state(1))

        def publish() -> None:
            with Registry.open(url=catalog_url, root=root) as other:
                other.publish("run", 2, make_state(2))

        wrapped = after(scan_module.DirectoryScan.listing, publish)
        monkeypatch.setattr(scan_module.DirectoryScan, "listing", wrapped)
        report = reg.fsck(repair=True)
        monkeypatch.undo()
        assert wrapped.fired and report.clean and not report.failures, report.to_json()
        assert reg.resolve("run").step == 2 and reg.resolve("run@2").status == "verified"
        assert_state_equal(reg.load("run@2", verify=True).state_dict, make_state(2))


@pytest.mark.usefixtures("migrated_url")
def test_overwrite_while_fsck_hashes_a_step_is_not_damage(catalog_url: str, root: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An overwrite lands between fsck's manifest read and its re-hash: no verdict on either payload."""
    with Registry.open(url=catalog_url, root=root) as reg:
        first = reg.publish("run", 1, make_state(1))
        seeds = [8, 9]

        def overwrite() -> None:
            with Registry.open(url=catalog_url, root=root) as other:
                other.publish("run", 1, make_state(seeds.pop(0)), overwrite=True)

        original = scan_module.read_manifest
        gate = after(original, overwrite)
        monkeypatch.setattr(scan_module, "read_manifest",
                            lambda directory: (gate if directory == first.path else original)(directory))
        for repair in (False, True):
            gate.fired.clear()  # type: ignore[attr-defined]
            report = reg.fsck(repair=repair, checksums=True)
            assert gate.fired and report.clean and not report.failures, report.to_json()  # type: ignore[attr-defined]
            assert [p.kind for p in report.in_progress] == ["in-progress"]
        monkeypatch.undo()
        assert reg.resolve("run@1").status == "verified" and reg.fsck(checksums=True).clean
        assert_state_equal(reg.load("run@1", verify=True).state_dict, make_state(9))


@pytest.mark.usefixtures("migrated_url")
@pytest.mark.parametrize("checksums", [False, True])
def test_gc_removing_a_step_fsck_is_checking(catalog_url: str, root: Path, monkeypatch: pytest.MonkeyPatch,
                                            checksums: bool) -> None:
    """gc deletes the step whose files fsck is reading: no crash, no false verdict, later steps still checked."""
    with Registry.open(url=catalog_url, root=root) as reg:
        infos = [reg.publish("run", step, make_state(step)) for step in (1, 2, 3, 4)]
        for path in infos[3].path.iterdir():  # a real problem, checked after the race
            path.unlink()
        infos[3].path.rmdir()

        def gc() -> None:
            with Registry.open(url=catalog_url, root=root) as other:
                assert other.plan_retention("run", KeepLast(3)).execute().deleted == (1,)

        original = scan_module.read_manifest

        def read_manifest(directory: Path) -> Any:
            return (gate if directory == infos[0].path else original)(directory)
        gate = after(original, gc)
        monkeypatch.setattr(scan_module, "read_manifest", read_manifest)
        report = reg.fsck(repair=True, checksums=checksums)
        monkeypatch.undo()
        assert gate.fired and not infos[0].path.exists()  # type: ignore[attr-defined]
        assert kinds(report) == [("run", 4, "missing-payload")] and not report.failures, report.to_json()
        assert [(p.step, p.kind) for p in report.in_progress] == [(1, "in-progress")]
        assert [i.status for i in reg.checkpoints("run", include_deleted=True)] == [
            "deleted", "verified", "verified", "corrupt"]
        assert kinds(reg.fsck(checksums=True)) == [("run", 4, "corrupt-step")]


@pytest.mark.usefixtures("migrated_url")
def test_stray_step_beyond_the_catalog_range_is_reported_and_the_rest_repaired(catalog_url: str,
                                                                              root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        huge = root / "run" / "step-99999999999999999999"
        Checkpoint(state_dict=make_state(1)).save(huge)
        Checkpoint(state_dict=make_state(2)).save(root / "zz" / "step-00000007")  # judged after it
        report = reg.fsck(repair=True)
        assert kinds(report) == [("run", 99999999999999999999, "unregistered-checkpoint"),
                                 ("zz", 7, "unregistered-checkpoint")]
        assert [(p.run, p.repair) for p in report.unrepaired] == [("run", None)]
        assert "beyond the catalog's range" in report.unrepaired[0].detail and not report.failures
        assert_state_equal(reg.load("zz@7").state_dict, make_state(2))
        assert huge.is_dir() and reg.catalog.get("run", 0) is None  # reported, never touched


@pytest.mark.usefixtures("migrated_url")
def test_a_repair_the_catalog_refuses_is_reported_and_the_rest_still_run(catalog_url: str, root: Path) -> None:
    """A stray checkpoint whose manifest holds a 65-bit optimizer_step: SQLite and PostgreSQL refuse the row."""
    with Registry.open(url=catalog_url, root=root) as reg:
        bad = root / "a" / "step-00000001"
        Checkpoint(state_dict=make_state(1)).save(bad)
        doc = json.loads((bad / "manifest.json").read_text())
        doc["optimizer_step"] = 2**64
        (bad / "manifest.json").write_text(json.dumps(doc))
        Checkpoint(state_dict=make_state(2)).save(root / "b" / "step-00000001")
        report = reg.fsck(repair=True)
        assert kinds(report) == [("a", 1, "unregistered-checkpoint"), ("b", 1, "unregistered-checkpoint")]
        assert [p.run for p in report.repaired] == ["b"] and [p.run for p in report.unrepaired] == ["a"]
        assert len(report.failures) == 1 and report.failures[0].startswith("a@1: unregistered-checkpoint")
        assert "repair failed" in report.failures[0] and "\n" not in report.failures[0]
        assert_state_equal(reg.load("b@1").state_dict, make_state(2))
        assert bad.is_dir() and reg.catalog.get("a", 1) is None


@pytest.mark.usefixtures("migrated_url")
def test_corrupt_steps_are_listed_with_what_to_do(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("run", 1, make_state(1))
        info = reg.publish("run", 2, make_state(2))
        weights = info.path / "model.safetensors"
        good = weights.read_bytes()
        flipped = bytearray(good)
        flipped[-1] ^= 0x01
        weights.write_bytes(bytes(flipped))
        assert [r.ok for r in reg.verify("run@2")] == [False]  # the scrub marks it corrupt
        assert reg.catalog.get("run", 2).status == "corrupt"  # type: ignore[union-attr]
        for checksums in (False, True):
            report = reg.fsck(checksums=checksums)
            assert kinds(report) == [("run", 2, "corrupt-step")] and not report.clean
            assert report.problems[0].repair is None and "registry verify run@2" in report.problems[0].detail
        report = reg.fsck(repair=True)  # never deletes data and never un-condemns it by itself
        assert not report.repaired and weights.read_bytes() == bytes(flipped)
        assert reg.catalog.get("run", 2).status == "corrupt"  # type: ignore[union-attr]

    runner = CliRunner()

    def cli(*args: str) -> Any:
        return runner.invoke(main, ["--url", catalog_url, "--root", str(root), *args], catch_exceptions=False)

    result = cli("fsck")
    assert result.exit_code == 1 and "corrupt-step" in result.output and "needs attention" in result.output
    weights.write_bytes(good)  # restored from a backup, as the report says
    assert cli("verify", "run@2").exit_code == 0
    result = cli("fsck", "--checksums")
    assert result.exit_code == 0 and "0 problems" in result.output


def test_one_parser_for_step_directory_names() -> None:
    """fsck and gc read directory names with the inverse of ``step_dirname``, and nothing else."""
    for step in (0, 7, 10**8, MAX_STEP, MAX_STEP + 1, 10**20 - 1):
        name = step_dirname(step)
        assert parse_step_dirname(name) == (step, "final")
        assert parse_step_dirname(f".{name}.tmp-x1y2") == (step, "tmp")
        assert parse_step_dirname(f".{name}.retired-q") == (step, "retired")
    for name in ("step-1", "step-000000001", ".step-00000001", "step-00000001.tmp-x", ".step-00000001.tmp-",
                 ".step-00000001.old-x", "step-0000000\u0661", "step-" + "9" * 300, "catalog.db", "run"):
        assert parse_step_dirname(name) is None, name


def test_fsck_refuses_a_root_that_vanished_and_marks_nothing(reg: Registry) -> None:
    """A root unmounted after the registry opened must not turn every step into a 'missing payload'."""
    import shutil

    from registry.errors import RootError
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2))
    shutil.rmtree(reg.store.root)
    for repair in (False, True):
        with pytest.raises(RootError, match="is not there on this host"):
            reg.fsck(repair=repair)
    assert {i.step: i.status for i in reg.checkpoints("run", include_deleted=True)} == {1: "verified", 2: "verified"}
    assert not any(e.kind not in ("publish",) for e in reg.events("run"))


@pytest.mark.usefixtures("migrated_url")
def test_gc_removing_a_step_between_its_hash_and_its_manifest_stat(catalog_url: str, root: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The last look at a payload finds its manifest gone: the step moved, it is not damaged."""
    with Registry.open(url=catalog_url, root=root) as reg:
        infos = [reg.publish("run", step, make_state(step)) for step in (1, 2, 3, 4)]

        def gc() -> None:
            with Registry.open(url=catalog_url, root=root) as other:
                assert other.plan_retention("run", KeepLast(3)).execute().deleted == (1,)

        original = scan_module.verify_directory

        def verify_directory(directory: Path, manifest: Any, **kwargs: Any) -> Any:
            return (gate if directory == infos[0].path else original)(directory, manifest, **kwargs)
        gate = after(original, gc)
        monkeypatch.setattr(scan_module, "verify_directory", verify_directory)
        report = reg.fsck(repair=True, checksums=True)
        monkeypatch.undo()
        assert gate.fired and not infos[0].path.exists()  # type: ignore[attr-defined]
        assert not report.problems and not report.failures, report.to_json()
        assert [(p.step, p.kind) for p in report.in_progress] == [(1, "in-progress")]
        assert [i.status for i in reg.checkpoints("run", include_deleted=True)] == [
            "deleted", "verified", "verified", "verified"]


@pytest.mark.usefixtures("migrated_url")
@pytest.mark.parametrize("when", ["before-scan", "after-snapshot"])
def test_a_root_unmounted_while_fsck_runs_condemns_nothing(catalog_url: str, root: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """The share goes away mid-run: every step would look missing, so fsck stops and says so."""
    with Registry.open(url=catalog_url, root=root) as reg:
        for step in (1, 2, 3):
            reg.publish("run", step, make_state(step))
        elsewhere = tmp_path / "unmounted"

        def unmount() -> None:
            root.rename(elsewhere)

        if when == "before-scan":  # between fsck's check of the root and its listing of it
            real_scandir = scan_module.os.scandir

            def scandir(path: Any) -> Any:
                if Path(path) == root and not elsewhere.exists():
                    unmount()
                return real_scandir(path)
            monkeypatch.setattr(scan_module.os, "scandir", scandir)
        else:
            monkeypatch.setattr(fsck_module, "snapshot", after(fsck_module.snapshot, unmount))
        report = reg.fsck(repair=True)
        monkeypatch.undo()
        assert elsewhere.is_dir() and not root.exists()
        assert not report.problems and not report.repaired, report.to_json()
        assert len(report.failures) == 1 and "vanished while fsck ran" in report.failures[0], report.failures
        elsewhere.rename(root)
        assert [i.status for i in reg.checkpoints("run", include_deleted=True)] == ["verified"] * 3
        assert {e.kind for e in reg.events("run")} == {"publish"}
        assert not reg.fsck(checksums=True).problems


@pytest.mark.usefixtures("migrated_url")
def test_a_deleted_step_republished_before_fsck_finishes_its_deletion(catalog_url: str, root: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Between fsck's verdict on an unfinished deletion and its repair, a trainer publishes the step again:
    the repair is skipped and reported as such, never counted as done, and the new payload is kept."""
    with Registry.open(url=catalog_url, root=root) as reg:
        for step in (1, 2):
            reg.publish("run", step, make_state(step))
        reg.catalog.set_status("run", 1, "deleted", kind="delete")  # gc died after its mark

        def republish() -> None:
            with Registry.open(url=catalog_url, root=root) as trainer:
                trainer.publish("run", 1, make_state(11))

        real_found = fsck_module.Fsck._found

        def found(self: Any, kind: str, *args: Any, **kwargs: Any) -> Any:
            problem = real_found(self, kind, *args, **kwargs)
            if kind == "unfinished-deletion" and problem is not None:
                republish()
            return problem
        monkeypatch.setattr(fsck_module.Fsck, "_found", found)
        report = reg.fsck(repair=True)
        monkeypatch.undo()
        assert kinds(report) == [("run", 1, "unfinished-deletion")] and not report.repaired, report.to_json()
        assert len(report.failures) == 1 and "skipped" in report.failures[0], report.failures
        assert reg.catalog.get("run", 1).status == "verified"  # type: ignore[union-attr]
        assert_state_equal(reg.load("run@1").state_dict, make_state(11))
        assert reg.fsck(checksums=True).clean
