"""The catalog under overlapping actors and local faults: verdicts tied to what was read, tag races,
a catalog file that vanishes or is not a database, metrics of a step published again."""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

import registry.fs.store
import registry.ops.scrub
from registry import CatalogError, Registry
from registry.cli import main
from registry.format.manifest import MANIFEST
from registry.retention import KeepLast
from registry.ops.scrub import scrub
from tests.helpers import assert_state_equal, make_state


def once(action: Any) -> Any:
    """``action`` the first time the returned function is called, nothing after."""
    done: list[bool] = []

    def run() -> None:
        if not done:
            done.append(True)
            action()
    return run


# ---------------------------------------------------------------------- verify

@pytest.mark.parametrize("moment", ["before-hashing", "after-hashing"])
def test_verify_records_nothing_about_a_step_overwritten_while_it_hashed(
        reg: Registry, catalog_url: str, root: Path, monkeypatch: pytest.MonkeyPatch, moment: str) -> None:
    reg.publish("run", 1, make_state(1), verify=moment == "before-hashing")
    real = registry.fs.store.verify_directory
    with Registry.open(url=catalog_url, root=root) as other:
        # the new payload is left unhashed (published) so that a verdict on the old one could promote it
        overwrite = once(lambda: other.publish("run", 1, make_state(2), overwrite=True, verify=False))

        def hashing(*args: Any, **kwargs: Any) -> Any:
            if moment == "before-hashing":
                overwrite()
            found = real(*args, **kwargs)
            if moment == "after-hashing":
                overwrite()
            return found

        monkeypatch.setattr(registry.fs.store, "verify_directory", hashing)
        [result] = reg.verify("run@1")
        monkeypatch.setattr(registry.fs.store, "verify_directory", real)
        new_digest = other.resolve("run@1").manifest_sha256
    info = reg.resolve("run@1")
    assert not [e for e in reg.events("run", step=1) if e.kind == "corrupt"]  # the old payload: no verdict
    if moment == "before-hashing":
        # the files changed under the hash, so they were read again from storage: that second read is of the
        # new payload whole, against its own manifest, and the verdict is on the digest it read
        assert (result.status, result.ok) == ("verified", True), result
        assert info.status == "verified" and info.manifest_sha256 == new_digest
        [verdict] = [e for e in reg.events("run", step=1) if e.kind == "verify"]
        assert verdict.detail.get("manifest_sha256") in (None, new_digest)
    else:
        assert (result.status, result.ok) == ("changed", False), result
        assert info.status == "published" and info.manifest_sha256 == new_digest  # neither condemned nor promoted
        assert not [e for e in reg.events("run", step=1) if e.kind == "verify"]
    assert_state_equal(reg.load("run@1").state_dict, make_state(2))
    [again] = reg.verify("run@1")  # verifying again hashes the new payload and records it
    assert again.status == "verified" and reg.resolve("run@1").status == "verified"


def test_verify_follows_a_step_re_published_before_its_manifest_was_read(
        reg: Registry, catalog_url: str, root: Path) -> None:
    reg.publish("run", 1, make_state(1))
    listed = reg.resolve("run@1")
    with Registry.open(url=catalog_url, root=root) as other:
        other.publish("run", 1, make_state(2), overwrite=True, verify=False)
    [result] = scrub(reg.catalog, [listed], actor="test", home=reg.root)  # the listing predates the overwrite
    assert result.status == "verified", result
    assert reg.resolve("run@1").status == "verified"


def test_damage_and_a_foreign_manifest_still_condemn(reg: Registry) -> None:
    for step in (1, 2, 3):
        reg.publish("run", step, make_state(step))
    weights = next(p for p in reg.resolve("run@1").path.iterdir() if p.suffix == ".safetensors")
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    two, three = reg.resolve("run@2").path, reg.resolve("run@3").path
    shutil.rmtree(two)
    shutil.copytree(three, two)  # an intact payload, but not the one the catalog recorded
    results = {r.step: r for r in reg.verify("run")}
    assert results[1].status == "corrupt" and "checksum mismatch" in results[1].problems[0]
    assert results[2].status == "corrupt" and results[2].problems == ("manifest does not match the catalog",)
    assert results[3].status == "verified"
    assert [i.status for i in reg.checkpoints("run")] == ["corrupt", "corrupt", "verified"]


def test_a_wrong_root_is_unreadable_not_corrupt(reg: Registry, root: Path, tmp_path: Path) -> None:
    for step in (1, 2):
        reg.publish("run", step, make_state(step))
    empty = tmp_path / "empty-mount-point"
    empty.mkdir()
    elsewhere = [replace(i, path=empty / i.path.relative_to(root)) for i in reg.checkpoints("run")]
    results = scrub(reg.catalog, elsewhere, actor="test", home=reg.root)
    assert [(r.status, r.ok) for r in results] == [("unreadable", False)] * 2
    assert all("directory missing" in r.problems[0] for r in results)
    assert [i.status for i in reg.checkpoints("run")] == ["verified", "verified"]
    assert not [e for e in reg.events("run") if e.kind == "corrupt"]


@pytest.mark.parametrize("fault", ["manifest-eacces", "weights-emfile"])
def test_a_local_read_failure_is_unreadable_not_corrupt(reg: Registry, monkeypatch: pytest.MonkeyPatch,
                                                        fault: str) -> None:
    reg.publish("run", 1, make_state(1))
    step_dir = reg.resolve("run@1").path
    real_os_open, real_open = os.open, builtins.open

    def os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        if Path(path) == step_dir / MANIFEST:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_os_open(path, *args, **kwargs)

    def open_(path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(path, (str, Path)) and Path(path).parent == step_dir and Path(path).name != MANIFEST:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(path))
        return real_open(path, *args, **kwargs)

    if fault == "manifest-eacces":
        monkeypatch.setattr(os, "open", os_open)
    else:
        monkeypatch.setattr(builtins, "open", open_)
    [result] = reg.verify("run@1")
    monkeypatch.undo()
    assert (result.status, result.ok) == ("unreadable", False), result
    assert os.strerror(errno.EACCES if fault == "manifest-eacces" else errno.EMFILE) in result.problems[0]
    assert reg.resolve("run@1").status == "verified"
    assert reg.verify("run@1")[0].status == "verified"


def test_cli_verify_names_the_outcome(cli, reg: Registry, root: Path) -> None:  # type: ignore[no-untyped-def]
    reg.publish("run", 1, make_state(1))
    shutil.rmtree(reg.resolve("run@1").path)
    out = cli("verify", "run")
    assert out.exit_code == 1 and "UNREADABLE" in out.output and "CORRUPT" not in out.output
    assert reg.resolve("run@1").status == "verified"


# ---------------------------------------------------------------------- tags

def _second_actor_at(reg: Registry, dialect: str, action: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Run ``action`` (another Registry's write) right after ``reg``'s catalog looked a tag up.

    On PostgreSQL it runs to its commit at that moment. SQLite's write lock
    serialises the two (the second waits for the first's commit), so there it
    runs in a thread, joined by the caller; either way it must succeed.
    """
    real = reg.catalog._tagged
    threads: list[Any] = []

    def second() -> None:
        if dialect == "postgresql":
            action()
        else:
            errors: list[BaseException] = []

            def guarded() -> None:
                try:
                    action()
                except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
                    errors.append(exc)
            worker = threading.Thread(target=guarded)
            worker.start()
            threads.append((worker, errors))

    fire = once(second)

    def looked_up(conn: Any, run_id: int, name: str) -> Any:
        found = real(conn, run_id, name)
        fire()
        return found

    monkeypatch.setattr(reg.catalog, "_tagged", looked_up)
    return threads


def _join(threads: list[Any]) -> None:
    for worker, errors in threads:
        worker.join()
        if errors:
            raise errors[0]


def test_first_creation_of_a_tag_name_by_two_writers(reg: Registry, catalog_url: str, root: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (1, 2):
        reg.publish("run", step, make_state(step))
    with Registry.open(url=catalog_url, root=root) as other:
        threads = _second_actor_at(reg, reg.catalog.dialect, lambda: other.tag("run", 2, "release"), monkeypatch)
        reg.tag("run", 1, "release")
        monkeypatch.undo()
        _join(threads)
    last = 1 if reg.catalog.dialect == "postgresql" else 2  # whoever committed last holds the name
    assert reg.resolve("run@release").step == last
    moves = [(e.detail["old_step"], e.detail["new_step"]) for e in reg.events("run") if e.kind == "tag"]
    assert moves == [(None, 3 - last), (3 - last, last)]


def test_publish_with_a_tag_another_writer_creates_meanwhile(reg: Registry, catalog_url: str, root: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (1, 2):
        reg.publish("run", step, make_state(step))
    with Registry.open(url=catalog_url, root=root) as other:
        threads = _second_actor_at(reg, reg.catalog.dialect, lambda: other.tag("run", 2, "best"), monkeypatch)
        info = reg.publish("run", 3, make_state(3), tags=["best"])
        monkeypatch.undo()
        _join(threads)
    assert info.status == "verified"
    assert reg.resolve("run@best").step == (3 if reg.catalog.dialect == "postgresql" else 2)
    assert_state_equal(reg.load("run@3").state_dict, make_state(3))


# ---------------------------------------------------------------------- the catalog itself

@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_sqlite_catalog_file_deleted_under_an_open_registry(tmp_path: Path, how: str) -> None:
    db = tmp_path / "catalog.db"
    url = f"sqlite:///{db}"
    with Registry.open(url=url, root=tmp_path / "ckpt") as reg:
        reg.publish("run", 1, make_state(1))
        assert reg.resolve("run@1").step == 1  # a pooled read connection now holds the file open
        for path in tmp_path.glob("catalog.db*"):
            path.unlink()
        if how == "replaced":
            Registry.open(url=url, root=tmp_path / "other").close()
        for attempt in (lambda: reg.resolve("run@1"), lambda: reg.publish("run", 2, make_state(2)),
                        lambda: reg.tag("run", 1, "x")):
            with pytest.raises(CatalogError, match=f"catalog file {db} was {how}") as info:
                attempt()
            assert "\n" not in str(info.value)
        assert db.exists() == (how == "replaced")  # no empty catalog was created in its place
        assert not (tmp_path / "ckpt" / "run" / "step-00000000000000000002").exists()


def test_a_catalog_that_is_not_a_database(tmp_path: Path) -> None:
    db = tmp_path / "catalog.db"
    db.write_text("these are my notes, not a database\n")
    (tmp_path / "ckpt").mkdir()  # a reader refuses a missing root first; here the root is fine
    with pytest.raises(CatalogError, match=f"^cannot open catalog {db}: file is not a database$") as info:
        Registry.open(url=f"sqlite:///{db}", root=tmp_path / "ckpt")
    assert isinstance(info.value.__cause__, DBAPIError)
    out = CliRunner().invoke(main, ["--url", f"sqlite:///{db}", "--root", str(tmp_path / "ckpt"), "runs"])
    assert out.exit_code == 1
    assert out.output.strip().splitlines() == [f"registry: error: cannot open catalog {db}: file is not a database"]
    assert db.read_text() == "these are my notes, not a database\n"


def test_a_catalog_directory_that_cannot_be_made_or_opened(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CatalogError, match="cannot create the catalog's directory .*file: it exists and is not"):
        Registry.open(url=f"sqlite:///{tmp_path / 'file' / 'catalog.db'}", root=tmp_path / "ckpt")
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(CatalogError, match=f"^cannot open catalog {tmp_path / 'dir.db'}: unable to open"):
        Registry.open(url=f"sqlite:///{tmp_path / 'dir.db'}", root=tmp_path / "ckpt")


def test_an_unreachable_postgresql_catalog_is_one_line_without_its_password(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="^cannot reach catalog postgresql") as info:
        Registry.open(url="postgresql://someone:s3cr3t@127.0.0.1:1/nothing", root=tmp_path / "ckpt")
    assert "s3cr3t" not in str(info.value) and "\n" not in str(info.value)


def test_database_errors_from_catalog_methods_are_catalog_errors(reg: Registry, catalog_url: str) -> None:
    reg.publish("run", 1, make_state(1))
    with reg.catalog.engine.begin() as conn:
        conn.execute(text("DROP TABLE leases"))
    with pytest.raises(CatalogError, match="leases") as info:
        reg.catalog.leased_steps("run")
    assert "\n" not in str(info.value) and isinstance(info.value.__cause__, DBAPIError)
    assert reg.resolve("run@1").step == 1


# ---------------------------------------------------------------------- metrics of a step published again

def test_publishing_a_deleted_step_again_supersedes_its_old_scores(reg: Registry, catalog_url: str,
                                                                   root: Path) -> None:
    for step, loss in ((10, 0.1), (20, 0.5), (30, 0.9)):
        reg.publish("run", step, make_state(step), metrics={"eval/loss": loss})
    reg.apply_retention("run", KeepLast(1))
    assert [i.step for i in reg.checkpoints("run")] == [30]
    reg.log_metrics("run", 20, {"train/loss": 2.0}, flush=True)  # logged for the coming step 20
    reg.publish("run", 10, make_state(11))
    assert reg.resolve("run@best:eval/loss").step == 30  # step 10's old score no longer ranks it
    assert reg.resolve("run@10").metrics == {}
    reg.log_metrics("run", 20, {"eval/loss": 0.3})  # buffered for the new step 20: it stays
    reg.publish("run", 20, make_state(21))
    assert reg.resolve("run@20").metrics == {"train/loss": 2.0, "eval/loss": 0.3}
    assert reg.resolve("run@best:eval/loss").step == 20
    with Registry.open(url=catalog_url, root=root) as other:  # another attempt, over a deleted step
        reg.apply_retention("run", KeepLast(1))
        other.publish("run", 20, make_state(22))
    history = [(p.step, p.key, p.value, p.current) for p in reg.metrics("run", history=True)]
    assert history == [(10, "eval/loss", 0.1, False), (20, "eval/loss", 0.5, False), (20, "eval/loss", 0.3, False),
                       (20, "train/loss", 2.0, False), (30, "eval/loss", 0.9, True)]
    superseded = [e.detail.get("superseded_points") for e in reg.events("run") if e.kind == "publish"]
    assert superseded == [None, None, None, 1, 1, 2]


# ---------------------------------------------------------------------- leases on the driver connection


def test_a_lease_the_sqlite_driver_refuses_is_a_one_line_catalog_error(sqlite_reg: Registry, tmp_path: Path) -> None:
    import sqlite3
    state = make_state()
    sqlite_reg.publish("r", 1, state)
    lease = sqlite_reg.catalog.acquire_lease("r", 1, holder="t", ttl=sqlite_reg.lease_ttl)
    assert lease is not None
    with sqlite3.connect(tmp_path / "catalog.db") as conn:  # a schema damaged under the registry
        conn.execute("ALTER TABLE leases RENAME TO leases_gone")
    with pytest.raises(CatalogError, match="no such table: leases") as err:
        sqlite_reg.load("r@1")
    assert "\n" not in str(err.value)
    with pytest.raises(CatalogError, match="no such table: leases"):
        sqlite_reg.catalog.release_lease(lease)
    with sqlite3.connect(tmp_path / "catalog.db") as conn:
        conn.execute("ALTER TABLE leases_gone RENAME TO leases")
    assert_state_equal(sqlite_reg.load("r@1").state_dict, state)  # nothing published was touched
    sqlite_reg.catalog.release_lease(lease)
    assert not sqlite_reg.catalog.lease_live(lease)


def test_a_resolve_the_sqlite_driver_refuses_is_a_one_line_catalog_error(sqlite_reg: Registry, tmp_path: Path) -> None:
    import sqlite3
    state = make_state()
    sqlite_reg.publish("r", 1, state, metrics={"loss": 0.5})
    with sqlite3.connect(tmp_path / "catalog.db") as conn:  # a schema damaged under the registry
        conn.execute("ALTER TABLE metrics RENAME TO metrics_gone")
    with pytest.raises(CatalogError, match="no such table: metrics") as err:
        sqlite_reg.load("r@latest")
    assert "\n" not in str(err.value)
    with sqlite3.connect(tmp_path / "catalog.db") as conn:
        conn.execute("ALTER TABLE metrics_gone RENAME TO metrics")
    ck = sqlite_reg.load("r@latest")  # the pooled connection that failed mid-read is usable again
    assert_state_equal(ck.state_dict, state)
    assert ck.info is not None and ck.info.metrics == {"loss": 0.5}
