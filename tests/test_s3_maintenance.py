"""gc/retention, fsck and verify on an ``s3://`` root against a real S3 server (SeaweedFS), both catalogs.

Each crash state is built the way an interrupted publish, overwrite or gc
leaves it in the bucket (a claim of a dead writer, an attempt prefix with or
without its manifest, a deleted row whose objects are still there, an
incomplete multipart upload); fsck must name it, change nothing without
``repair``, and fix it with ``repair``, leaving no orphan.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from registry import Registry
from registry.catalog.retention import RetentionCatalog
from registry.fs import multipart
from registry.fs.objectwrite import upload_payload
from registry.fs.prefixes import scan
from registry.ops.fsck import FsckReport
from registry.retention import KeepLast
from tests.helpers import assert_state_equal, make_state
from tests.test_fsck import dead_claim, payload


@pytest.fixture
def s3reg(migrated_url: str, s3_root: str) -> Iterator[Registry]:
    with Registry.open(url=migrated_url, root=s3_root) as registry:
        yield registry


def prefixes(reg: Registry) -> dict[tuple[str, int], list[str]]:
    assert reg.objects is not None
    out: dict[tuple[str, int], list[str]] = {}
    for found in scan(reg.objects).values():
        out.setdefault((found.run, found.step), []).append(found.prefix)
    return out


def uploads(reg: Registry) -> list[multipart.Upload]:
    assert reg.objects is not None
    return list(multipart.list_uploads(reg.objects.config, reg.objects.key() + "/"))


def kinds(report: FsckReport) -> list[tuple[str, int, str]]:
    return sorted((p.run, p.step, p.kind) for p in report.problems)


def status(reg: Registry, run: str, step: int) -> str:
    return str(next(i.status for i in reg.checkpoints(run, include_deleted=True) if i.step == step))


def repaired_clean(reg: Registry) -> None:
    """fsck --repair, then a second fsck finds nothing, and no orphan prefix or upload is left."""
    reg.fsck(repair=True)
    again = reg.fsck(checksums=True)
    assert again.clean, again.to_json()
    named = {i.path.as_posix() for r in reg.runs() for i in reg.checkpoints(r.name)}
    assert {p for ps in prefixes(reg).values() for p in ps} <= named
    assert uploads(reg) == []


# ---------------------------------------------------------------------------------------------- retention


def test_gc_deletes_keys_and_keeps_the_plan_shape(s3reg: Registry) -> None:
    for step in (1, 2, 3, 4):
        s3reg.publish("run", step, make_state(step))
    plan = s3reg.plan_retention("run", KeepLast(2))
    doc = plan.to_json()
    assert doc["delete"] == [1, 2] and doc["keep"] == [3, 4] and doc["bytes_freed"] > 0
    first = doc["decisions"][0]
    assert set(first) == {"step", "status", "action", "reasons", "protected", "total_bytes", "path", "url"}
    assert first["url"] == s3reg.objects.url(first["path"]) if s3reg.objects else False
    assert prefixes(s3reg).keys() == {("run", 1), ("run", 2), ("run", 3), ("run", 4)}  # a plan changes nothing

    result = plan.execute()
    assert result.deleted == (1, 2) and not result.errors and result.bytes_freed == doc["bytes_freed"]
    assert prefixes(s3reg).keys() == {("run", 3), ("run", 4)}
    assert status(s3reg, "run", 1) == "deleted"
    assert_state_equal(s3reg.load("run@3").state_dict, make_state(3))
    assert s3reg.fsck(checksums=True).clean


def test_gc_killed_after_marking_is_finished_by_the_next_gc(s3reg: Registry) -> None:
    for step in (1, 2, 3):
        s3reg.publish("run", step, make_state(step))
    # what a gc killed at gc-after-mark leaves: rows deleted, every key still there
    RetentionCatalog(s3reg.catalog).mark_deleted("run", lambda snap: {1: "test"}, actor="test")
    assert ("run", 1) in prefixes(s3reg)
    report = s3reg.fsck()
    assert kinds(report) == [("run", 1, "unfinished-deletion")]
    assert ("run", 1) in prefixes(s3reg)  # without repair nothing changes

    result = s3reg.apply_retention("run", KeepLast(3))
    assert result.healed == (1,) and result.deleted == ()
    assert ("run", 1) not in prefixes(s3reg)
    repaired_clean(s3reg)


def test_half_deleted_prefix_without_manifest_is_finished_by_fsck(s3reg: Registry) -> None:
    for step in (1, 2):
        s3reg.publish("run", step, make_state(step))
    rel = s3reg.resolve("run@1").path.as_posix()
    RetentionCatalog(s3reg.catalog).mark_deleted("run", lambda snap: {1: "test"}, actor="test")
    assert s3reg.objects is not None
    s3reg.objects.delete([f"{rel}/manifest.json"])  # gc killed at gc-after-retire
    report = s3reg.fsck(repair=True)
    assert kinds(report) == [("run", 1, "unfinished-deletion")] and len(report.repaired) == 1
    repaired_clean(s3reg)


# ---------------------------------------------------------------------------------------------- fsck


def test_abandoned_publish_fails_and_its_objects_and_uploads_go(s3reg: Registry) -> None:
    s3reg.publish("run", 1, make_state(1))
    rel = dead_claim(s3reg, "run", 2, upload=22, manifest=False)
    assert s3reg.objects is not None
    multipart.start_upload(s3reg.objects.config, s3reg.objects.key(f"{rel}/extra.pt"))
    report = s3reg.fsck()
    assert kinds(report) == [("run", 2, "abandoned-publish")]  # the claim's prefix is its own until repaired
    report = s3reg.fsck(repair=True)
    assert ("run", 2, "abandoned-publish") in kinds(report)
    assert status(s3reg, "run", 2) == "failed"
    assert ("run", 2) not in prefixes(s3reg) and uploads(s3reg) == []
    repaired_clean(s3reg)


def test_overwrite_killed_before_its_commit_restores_the_old_payload(s3reg: Registry) -> None:
    s3reg.publish("run", 1, make_state(1))
    old = s3reg.resolve("run@1")
    new = dead_claim(s3reg, "run", 1, overwrite=True, upload=11, manifest=False)
    report = s3reg.fsck(repair=True)
    assert ("run", 1, "interrupted-overwrite") in kinds(report)
    now = s3reg.resolve("run@1")
    assert now.path == old.path and now.manifest_sha256 == old.manifest_sha256 and now.status == "verified"
    assert_state_equal(s3reg.load("run@1").state_dict, make_state(1))
    assert new not in prefixes(s3reg).get(("run", 1), [])
    repaired_clean(s3reg)


def test_overwrite_killed_after_its_commit_leaves_an_orphan_that_fsck_deletes(s3reg: Registry) -> None:
    s3reg.publish("run", 1, make_state(1))
    orphan_rel = s3reg.resolve("run@1").path.as_posix()
    s3reg.publish("run", 1, make_state(11), overwrite=True)
    assert s3reg.objects is not None
    # the old prefix as a crash between the commit and deleting it leaves it
    upload_payload(s3reg.objects, orphan_rel, payload(1))
    report = s3reg.fsck()
    assert kinds(report) == [("run", 1, "orphan-prefix")]
    assert orphan_rel in prefixes(s3reg)[("run", 1)]
    s3reg.fsck(repair=True)
    assert prefixes(s3reg)[("run", 1)] == [s3reg.resolve("run@1").path.as_posix()]
    repaired_clean(s3reg)


def test_live_claims_prefix_and_uploads_are_left_alone(s3reg: Registry) -> None:
    from registry.ops.writers import writer_id
    from registry.format.layout import attempt_relpath
    rel = attempt_relpath("run", 5)
    s3reg.catalog.claim("run", 5, path=rel, writer=writer_id(), overwrite=False)
    assert s3reg.objects is not None
    s3reg.objects.put(f"{rel}/model.safetensors", b"partial")
    upload = multipart.start_upload(s3reg.objects.config, s3reg.objects.key(f"{rel}/big.safetensors"))
    report = s3reg.fsck(repair=True)
    assert report.clean and [p.step for p in report.in_progress] == [5]
    assert prefixes(s3reg) == {("run", 5): [rel]} and [u.upload_id for u in uploads(s3reg)] == [upload.upload_id]


def test_deleted_objects_behind_the_registrys_back(s3reg: Registry) -> None:
    for step in (1, 2, 3):
        s3reg.publish("run", step, make_state(step))
    assert s3reg.objects is not None
    two, three = (s3reg.resolve(f"run@{s}").path.as_posix() for s in (2, 3))
    s3reg.objects.delete([f"{three}/manifest.json"])
    s3reg.objects.delete([f"{two}/model.safetensors"])
    report = s3reg.fsck()
    assert kinds(report) == [("run", 2, "damaged-payload"), ("run", 3, "missing-payload")]
    assert all(p.url is not None and p.url.startswith("s3://") for p in report.problems)
    assert status(s3reg, "run", 3) == "verified"  # without repair nothing changes
    s3reg.fsck(repair=True)
    assert status(s3reg, "run", 2) == status(s3reg, "run", 3) == "corrupt"
    assert s3reg.load("run@latest").step == 1
    report = s3reg.fsck()
    assert kinds(report) == [("run", 2, "corrupt-step"), ("run", 3, "corrupt-step")]


def test_unregistered_prefix_is_adopted_and_a_rowless_partial_one_deleted(s3reg: Registry) -> None:
    from registry.format.layout import attempt_relpath
    s3reg.publish("run", 1, make_state(1))
    assert s3reg.objects is not None
    good, partial = attempt_relpath("run", 7), attempt_relpath("run", 8)
    upload_payload(s3reg.objects, good, payload(7))
    upload_payload(s3reg.objects, partial, payload(8))
    s3reg.objects.delete([f"{partial}/manifest.json"])
    report = s3reg.fsck(repair=True)
    assert kinds(report) == [("run", 7, "unregistered-checkpoint"), ("run", 8, "orphan-prefix")]
    assert s3reg.resolve("run@7").path.as_posix() == good and status(s3reg, "run", 7) == "verified"
    repaired_clean(s3reg)


def test_fsck_json_has_urls_and_no_credentials(s3reg: Registry, s3_env: object) -> None:
    from tests import s3server
    s3reg.publish("run", 1, make_state(1))
    dead_claim(s3reg, "run", 2, upload=2, manifest=False)
    text = json.dumps(s3reg.fsck().to_json())
    assert "s3://" in text and s3server.SECRET_KEY not in text and s3server.ACCESS_KEY not in text


# ---------------------------------------------------------------------------------------------- verify


def test_verify_rehashes_objects_and_condemns_only_read_bytes(s3reg: Registry) -> None:
    s3reg.publish("run", 1, make_state(1))
    s3reg.publish("run", 2, make_state(2), verify=False)
    results = s3reg.verify("run")
    assert [(r.step, r.status) for r in results] == [(1, "verified"), (2, "verified")]
    assert s3reg.objects is not None
    rel = s3reg.resolve("run@2").path.as_posix()
    key = f"{rel}/model.safetensors"
    data = bytearray(s3reg.objects.get(key))
    data[-1] ^= 0xFF  # same size: only a re-hash can tell
    s3reg.objects.put(key, bytes(data), create_only=False)
    assert s3reg.fsck().clean  # sizes and the manifest digest still match
    assert kinds(s3reg.fsck(checksums=True)) == [("run", 2, "damaged-payload")]
    (result,) = s3reg.verify("run@2")
    assert result.status == "corrupt" and "checksum mismatch" in result.problems[0]
    assert s3reg.load("run@latest").step == 1


def test_cli_gc_fsck_verify(catalog_url: str, s3reg: Registry) -> None:
    from click.testing import CliRunner

    from registry.cli import main
    from tests import s3server
    for step in (1, 2, 3):
        s3reg.publish("run", step, make_state(step))
    root = s3reg.root_url

    def cli(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["--url", catalog_url, "--root", root, *args], catch_exceptions=False)
        assert s3server.SECRET_KEY not in result.output and s3server.ACCESS_KEY not in result.output
        return result.exit_code, result.output

    code, out = cli("gc", "run", "--keep-last", "1", "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["delete"] == [1, 2] and doc["shared_bytes"] == 0 and doc["dry_run"]
    assert all(d["url"].startswith(root + "/run/step-") for d in doc["decisions"])
    assert prefixes(s3reg).keys() == {("run", 1), ("run", 2), ("run", 3)}
    code, out = cli("gc", "run", "--keep-last", "1", "--yes")
    assert code == 0 and prefixes(s3reg).keys() == {("run", 3)}
    code, out = cli("verify", "run")
    assert code == 0 and out.splitlines()[1].split() == ["run", "3", "ok"]
    code, out = cli("fsck", "--checksums")
    assert code == 0 and "0 problems" in out


def test_verify_of_a_step_overwritten_meanwhile_condemns_nothing(s3reg: Registry) -> None:
    """verify listed the step at its old prefix; an overwrite committed and deleted that prefix before the
    read. The new payload (another prefix) must not be judged by the old prefix's absence."""
    from registry.ops.scrub import scrub
    s3reg.publish("run", 1, make_state(1))
    listed = s3reg.resolve("run@1")
    s3reg.publish("run", 1, make_state(11), overwrite=True)
    (result,) = scrub(s3reg.catalog, [listed], actor="test", home=s3reg.root)
    assert result.status == "changed" and status(s3reg, "run", 1) == "verified"
    assert_state_equal(s3reg.load("run@1").state_dict, make_state(11))
