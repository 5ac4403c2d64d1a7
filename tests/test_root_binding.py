"""A root belongs to one catalog; the registry's own files stay out of the run namespace; readers create
nothing and can open read-only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from registry import InvalidNameError, Registry, RootError
from registry.catalog.session import alembic_config, make_engine
from registry.cli import main
from registry.errors import CatalogError, ReadOnlyError, RootMismatchError
from tests.helpers import assert_state_equal, make_state


def run_cli(url: str | None, root: Path, *args: str):  # type: ignore[no-untyped-def]
    prefix = (["--url", url] if url else []) + ["--root", str(root)]
    return CliRunner().invoke(main, [*prefix, *args], catch_exceptions=False)


def one_line_error(result) -> str:  # type: ignore[no-untyped-def]
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("registry: error:"), result.output
    return lines[0]


def with_password(url: str) -> str:
    return url.replace("postgres@", "postgres:s3cret@", 1) if url.startswith("postgresql") else url


# ---------------------------------------------------------------------- binding a root to its catalog


def test_wrong_or_unmounted_root_is_refused_and_marks_nothing(catalog_url: str, root: Path, tmp_path: Path) -> None:
    url = with_password(catalog_url)
    with Registry.open(url=url, root=root) as reg:
        for step in (1, 2, 3):
            reg.publish("r", step, make_state(step))
        before = [(i.step, i.status) for i in reg.checkpoints("r")]
        events = len(reg.events("r"))
    empty_mount = tmp_path / "mnt"  # a mount point whose filesystem is not mounted: an empty directory
    empty_mount.mkdir()
    for args in (("verify", "r"), ("ls", "r"), ("show", "r@3"), ("fsck", "--repair")):
        line = one_line_error(run_cli(url, empty_mount, *args))
        assert str(empty_mount) in line and "does not belong to the catalog" in line
        assert ("127.0.0.1" in line or "catalog.db" in line) and "s3cret" not in line
    with pytest.raises(RootMismatchError):
        Registry.open(url=url, root=empty_mount)  # a writer is refused too: no publish lands there
    assert list(empty_mount.iterdir()) == []
    with pytest.raises(RootMismatchError):
        Registry.open(url=url, root=tmp_path / "typo" / "ckpt")  # a writer's mistyped root is not left behind
    assert not (tmp_path / "typo").exists()
    with Registry.open(url=url, root=root) as reg:
        assert [(i.step, i.status) for i in reg.checkpoints("r")] == before
        assert len(reg.events("r")) == events
        assert_state_equal(reg.load("r@latest").state_dict, make_state(3))


def test_root_bound_to_another_catalog_is_refused(catalog_url: str, root: Path, tmp_path: Path) -> None:
    other_url, other_root = f"sqlite:///{tmp_path / 'other.db'}", tmp_path / "other"
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("r", 1, make_state(1))
    with Registry.open(url=other_url, root=other_root) as other:
        other.publish("o", 1, make_state(1))
    for url, wrong in ((catalog_url, other_root), (other_url, root)):
        with pytest.raises(RootMismatchError, match="bound to another catalog") as err:
            Registry.open(url=url, root=wrong)
        assert str(wrong) in str(err.value) and "\n" not in str(err.value)
    with Registry.open(url=catalog_url, root=root) as reg:
        assert [r.name for r in reg.runs()] == ["r"]


def test_the_same_root_at_another_path_is_accepted(catalog_url: str, root: Path, tmp_path: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("r", 7, make_state(7))
    elsewhere = tmp_path / "host-b" / "mnt" / "ckpt"  # the same filesystem, mounted at another path on host B
    elsewhere.parent.mkdir(parents=True)
    root.rename(elsewhere)
    with Registry.open(url=catalog_url, root=elsewhere) as reg:
        assert reg.resolve("r").path == elsewhere / "r" / "step-00000007"
        assert_state_equal(reg.load("r").state_dict, make_state(7))
        assert [v.ok for v in reg.verify("r")] == [True]


def _forget_binding(url: str, root: Path) -> None:
    """Make a catalog and a root as they were before catalogs had ids: schema 0003, no marker."""
    from alembic import command
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0003")
    finally:
        engine.dispose()
    (root / ".registry" / "root.json").unlink()


def test_catalog_and_root_from_before_binding_are_adopted(catalog_url: str, root: Path, tmp_path: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("r", 1, make_state(1))
        reg.publish("r", 2, make_state(2))
    _forget_binding(catalog_url, root)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    line = one_line_error(run_cli(catalog_url, wrong, "verify", "r"))  # a reader at the wrong path is refused
    assert "holds none of the newest 2 checkpoints" in line
    assert run_cli(catalog_url, root, "ls", "r").exit_code == 0  # a reader at the right one binds nothing
    assert not (root / ".registry" / "root.json").exists()
    with pytest.raises(RootMismatchError, match="holds none of the newest 2 checkpoints"):
        Registry.open(url=catalog_url, root=wrong)  # the first writer after the upgrade is at the wrong path
    assert not (wrong / ".registry").exists()
    with Registry.open(url=catalog_url, root=root) as reg:  # a writer finds r/step-2 here: binds
        assert json.loads((root / ".registry" / "root.json").read_text())["catalog_id"]
        assert [(i.step, i.status) for i in reg.checkpoints("r")] == [(1, "verified"), (2, "verified")]
    with pytest.raises(RootMismatchError, match="has no .registry/root.json"):
        Registry.open(url=catalog_url, root=wrong)  # now bound: a root without a marker is refused at once


def test_an_opener_that_loses_the_binding_race_is_refused(catalog_url: str, root: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import registry.ops.binding as binding
    other = tmp_path / "other"
    real = binding.locked_identity
    calls = []

    def second_opener_binds_first(engine):  # type: ignore[no-untyped-def]
        if not calls:
            calls.append(1)
            with Registry.open(url=catalog_url, root=root):  # binds `root` between our checks and our lock
                pass
        return real(engine)

    monkeypatch.setattr(binding, "locked_identity", second_opener_binds_first)
    with pytest.raises(RootMismatchError, match="has no .registry/root.json"):
        Registry.open(url=catalog_url, root=other)
    assert not (other / ".registry").exists()
    monkeypatch.setattr(binding, "locked_identity", real)
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("r", 1, make_state(1))


def test_a_marker_that_cannot_be_written_binds_nothing(catalog_url: str, root: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    real_replace = os.replace

    def read_only_fs(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(dst).endswith("root.json"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", read_only_fs)
    with pytest.raises(RootError, match="cannot bind .*Read-only file system"):
        Registry.open(url=catalog_url, root=root)
    assert not [p for p in (root / ".registry").iterdir() if "root.json" in p.name]
    monkeypatch.setattr(os, "replace", real_replace)
    other = root.parent / "other"
    with Registry.open(url=catalog_url, root=other) as reg:  # the catalog stayed unbound: another root may bind
        reg.publish("r", 1, make_state(1))
    with pytest.raises(RootMismatchError):
        Registry.open(url=catalog_url, root=root)


def test_bind_root_rebinds_a_root_restored_without_its_marker(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("r", 1, make_state(1))
    (root / ".registry" / "root.json").unlink()
    assert "does not belong" in one_line_error(run_cli(catalog_url, root, "ls", "r"))
    result = run_cli(catalog_url, root, "db", "bind-root")
    assert result.exit_code == 0, result.output
    assert run_cli(catalog_url, root, "ls", "r").exit_code == 0


# ---------------------------------------------------------------------- the registry's own files


def test_default_catalog_lives_under_dot_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REGISTRY_URL", raising=False)
    root = tmp_path / "ckpt"
    with Registry.open(root=root) as reg:
        reg.publish("r", 1, make_state(1))
    assert (root / ".registry" / "catalog.db").is_file()
    assert sorted(p.name for p in root.iterdir()) == [".registry", "r"]
    with Registry.open(root=root, create=False) as reg:
        assert [r.name for r in reg.runs()] == ["r"]


def test_a_root_with_a_legacy_catalog_keeps_using_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REGISTRY_URL", raising=False)
    root = tmp_path / "ckpt"
    with Registry.open(url=f"sqlite:///{root / 'catalog.db'}", root=root) as reg:
        reg.publish("old", 1, make_state(1))
    with Registry.open(root=root) as reg:
        assert [r.name for r in reg.runs()] == ["old"]
        reg.publish("old", 2, make_state(2))
    assert not (root / ".registry" / "catalog.db").exists()


@pytest.mark.parametrize("name", ["catalog.db", "catalog.db-wal", "catalog.db-shm", "Catalog.DB-journal"])
def test_catalog_file_names_are_not_run_names(reg: Registry, name: str) -> None:
    reg.publish("r", 1, make_state(1))
    with pytest.raises(InvalidNameError, match="reserved"):
        reg.publish(name, 1, make_state(1))
    with pytest.raises(Exception, match="reserved"):
        reg.resolve(f"{name}@1")
    assert [r.name for r in reg.runs()] == ["r"]
    assert sorted(p.name for p in reg.store.root.iterdir()) == [".registry", "r"]
    reg.publish("r", 2, make_state(2))  # the catalog is still usable


# ---------------------------------------------------------------------- readers


def test_reader_commands_create_nothing(catalog_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REGISTRY_URL", raising=False)
    missing = tmp_path / "no-such-root"
    for args in (("runs",), ("ls", "r"), ("show", "r"), ("resolve", "r"), ("metrics", "r"), ("db", "current")):
        one_line_error(run_cli(None, missing, *args))  # default catalog under a root that does not exist
        assert not missing.exists()
    empty_root = tmp_path / "root"
    empty_root.mkdir()
    for args in (("runs",), ("ls", "r"), ("fsck",), ("verify", "r"), ("tag", "r", "1", "t")):
        line = one_line_error(run_cli(catalog_url, empty_root, *args))  # no catalog yet at catalog_url
        assert "nothing was created" in line
    assert list(empty_root.iterdir()) == []
    assert not (tmp_path / "catalog.db").exists()
    with pytest.raises(RootError, match="does not exist"):
        Registry.open(url=catalog_url, root=missing, create=False)
    with pytest.raises(CatalogError, match="nothing was created"):
        Registry.open(url=f"sqlite:///{tmp_path / 'typo.db'}", root=empty_root, create=False)
    assert not (tmp_path / "typo.db").exists()


def test_read_only_open_reads_takes_no_lease_and_writes_nothing(catalog_url: str, root: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import registry.fs.filemaps as filemaps  # where a load's read looks up its parser, at each call
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("r", 1, make_state(1), metrics={"loss": 0.5}, tags=["release"])
        events = len(reg.events("r"))
    leases_seen = []
    real_read = filemaps.read_directory

    def read_and_look(*args, **kwargs):  # type: ignore[no-untyped-def]
        with Registry.open(url=catalog_url, root=root) as other:
            leases_seen.append(other.catalog.leased_steps("r"))
        return real_read(*args, **kwargs)

    monkeypatch.setattr(filemaps, "read_directory", read_and_look)
    with Registry.open(url=catalog_url, root=root, read_only=True) as ro:
        assert ro.read_only
        assert [r.name for r in ro.runs()] == ["r"]
        assert ro.resolve("r@release").step == 1
        assert [p.value for p in ro.metrics("r")] == [0.5]
        assert_state_equal(ro.load("r").state_dict, make_state(1))
        assert leases_seen == [set()]
        for write in (lambda: ro.tag("r", 1, "x"), lambda: ro.publish("r", 2, make_state(2))):
            with pytest.raises(ReadOnlyError, match="read-only"):
                write()
    monkeypatch.setattr(filemaps, "read_directory", real_read)
    with Registry.open(url=catalog_url, root=root) as reg:
        assert [i.step for i in reg.checkpoints("r", include_deleted=True)] == [1]
        assert len(reg.events("r")) == events
    for args in (("runs",), ("ls", "r"), ("show", "r"), ("resolve", "r"), ("metrics", "r")):
        result = run_cli(catalog_url, root, "--read-only", *args)
        assert result.exit_code == 0, result.output
    assert "read-only" in one_line_error(run_cli(catalog_url, root, "--read-only", "tag", "r", "1", "x"))


def test_a_sqlite_catalog_nobody_here_may_write_opens_read_only(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only copy: neither the catalog file nor its directory is writable, and nobody has it open."""
    root = tmp_path / "copy"
    with Registry.open(root=root) as reg:
        reg.publish("r", 1, make_state(1))
    catalog_dir = root / ".registry"
    assert not (catalog_dir / "catalog.db-shm").exists()
    real_access = os.access

    def access(path, mode, **kwargs):  # type: ignore[no-untyped-def]
        if mode & os.W_OK and Path(path).absolute().is_relative_to(catalog_dir):
            return False  # root ignores permissions; answer as the filesystem would for another user
        return real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.delenv("REGISTRY_URL", raising=False)
    result = run_cli(None, root, "runs")
    assert result.exit_code == 0 and "r" in result.output, result.output
    with Registry.open(root=root) as ro:
        assert ro.read_only and not (catalog_dir / "catalog.db-shm").exists()  # read as immutable: no -shm
        assert_state_equal(ro.load("r").state_dict, make_state(1))
        with pytest.raises(ReadOnlyError):
            ro.publish("r", 2, make_state(2))


def test_a_read_only_load_of_a_corrupt_latest_falls_back_once_and_records_nothing(
        catalog_url: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verdict a read-only catalog cannot record is still a verdict: fall back, do not re-read the step."""
    import registry.fs.filemaps as filemaps  # where a load's read looks up its parser, at each call
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("r", 1, make_state(1))
        bad = reg.publish("r", 2, make_state(2))
        events = len(reg.events("r"))
    weights = bad.path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    reads: list[Path] = []
    real_read = filemaps.read_directory

    def counted(path: Path, *args, **kwargs):  # type: ignore[no-untyped-def]
        reads.append(path)
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(filemaps, "read_directory", counted)
    with Registry.open(url=catalog_url, root=root, read_only=True) as ro, \
            pytest.warns(RuntimeWarning, match="falling back"):
        ckpt = ro.load("r@latest")
    assert ckpt.step == 1 and ckpt.fallback is not None and ckpt.fallback.from_step == 2
    assert_state_equal(ckpt.state_dict, make_state(1))
    assert [p.name for p in reads] == ["step-00000002", "step-00000001"]  # each step read once
    with Registry.open(url=catalog_url, root=root) as reg:
        assert reg.resolve("r@2").status == "verified" and len(reg.events("r")) == events
