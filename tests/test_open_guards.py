"""Opening a registry is never silent about what it creates, and a restart can insist on finding its root.

A new root or catalog logs one WARNING each, naming it by its absolute path
(or URL); reopening logs nothing; Alembic's own INFO lines stay out of the
way unless its logger is asked for them. ``create=False`` refuses and creates
nothing, and the integrations' resume helpers offer the same.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import inspect

from registry import Registry
from registry.errors import CatalogError, CheckpointNotFoundError, RegistryError, RootError, RootMismatchError
from tests.helpers import PG_ADMIN, REPO, child_env, make_state, pg_connect, pg_schema_url


def warnings_from(caplog: pytest.LogCaptureFixture, prefix: str = "registry") -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and (r.name == prefix or r.name.startswith(prefix + "."))]


def test_a_new_root_and_catalog_each_log_a_warning_naming_them(
        catalog_url: str, root: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with Registry.open(url=catalog_url, root=root) as reg:
        shown = reg.catalog.engine.url.render_as_string(hide_password=True)
    found = warnings_from(caplog)
    assert len(found) == 2, found
    assert any(str(root) in line and "checkpoint root" in line and "create=False" in line for line in found)
    catalog = str(Path(catalog_url.removeprefix("sqlite:///"))) if catalog_url.startswith("sqlite") else shown
    assert any(line == f"created a new catalog {catalog}" for line in found), found


def test_a_relative_root_is_named_by_its_absolute_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REGISTRY_URL", raising=False)
    caplog.set_level(logging.WARNING)
    with Registry.open(root="typo/ckpt"):
        pass
    found = warnings_from(caplog)
    assert any(f"checkpoint root {tmp_path / 'typo' / 'ckpt'} " in line for line in found), found
    assert f"created a new catalog {tmp_path / 'typo' / 'ckpt' / '.registry' / 'catalog.db'}" in found


def test_reopening_an_existing_registry_logs_nothing(
        catalog_url: str, root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("run", 1, make_state(1))
    caplog.clear()
    caplog.set_level(logging.INFO)
    with Registry.open(url=catalog_url, root=root) as reg:
        assert reg.resolve("run@latest").step == 1
    assert [(r.name, r.getMessage()) for r in caplog.records] == []


def test_alembic_stays_quiet_on_a_new_catalog_unless_asked(
        catalog_url: str, root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)  # the root logger at INFO is not asking Alembic for its lines
    with Registry.open(url=catalog_url, root=root):
        pass
    assert [r.getMessage() for r in caplog.records if r.name.startswith("alembic")] == []

    caplog.clear()
    alembic = logging.getLogger("alembic")
    alembic.setLevel(logging.INFO)
    try:
        other = f"sqlite:///{tmp_path / 'other.db'}" if catalog_url.startswith("sqlite") else pg_schema_url(
            catalog_url.split("?")[0].replace("postgresql+psycopg://", "postgresql://"))
        with Registry.open(url=other, root=tmp_path / "other"):
            pass
    finally:
        alembic.setLevel(logging.NOTSET)
    assert any(r.getMessage().startswith("Running upgrade") for r in caplog.records if r.name.startswith("alembic"))


def test_a_new_registry_shows_a_user_only_the_registrys_own_lines(tmp_path: Path) -> None:
    script = ("import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')\n"
              "from registry import Registry\n"
              f"Registry.open(root={str(tmp_path / 'ckpt')!r}).close()\n")
    env = {k: v for k, v in child_env().items() if k not in ("REGISTRY_ROOT", "REGISTRY_URL")}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["registry.catalog.session", "registry.roots.open"], lines


def test_create_false_refuses_a_missing_root_and_creates_nothing(
        catalog_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "mistyped" / "ckpt"
    with pytest.raises(RootError) as caught:
        Registry.open(url=catalog_url, root=missing, create=False)
    assert "\n" not in str(caught.value) and str(missing) in str(caught.value)
    assert not (tmp_path / "mistyped").exists()
    if catalog_url.startswith("sqlite"):
        assert not Path(catalog_url.removeprefix("sqlite:///")).exists()
    assert warnings_from(caplog) == []


def test_create_false_refuses_a_missing_catalog_and_creates_nothing(
        catalog_url: str, root: Path, caplog: pytest.LogCaptureFixture) -> None:
    root.mkdir()
    with pytest.raises(CatalogError) as caught:
        Registry.open(url=catalog_url, root=root, create=False)
    assert "\n" not in str(caught.value) and "nothing was created" in str(caught.value)
    assert list(root.iterdir()) == []
    if catalog_url.startswith("sqlite"):
        assert not Path(catalog_url.removeprefix("sqlite:///")).exists()
    else:
        from sqlalchemy import create_engine
        engine = create_engine(catalog_url)
        try:
            assert inspect(engine).get_table_names() == []  # the new, empty schema stays empty
        finally:
            engine.dispose()
    assert warnings_from(caplog) == []


def test_a_refused_new_root_is_removed_and_not_announced(
        catalog_url: str, root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("run", 1, make_state(1))
    caplog.clear()
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(RootMismatchError):
        Registry.open(url=catalog_url, root=elsewhere)
    assert not elsewhere.exists()
    assert warnings_from(caplog) == []


def test_a_postgresql_database_that_does_not_exist_says_createdb(tmp_path: Path) -> None:
    try:
        pg_connect(PG_ADMIN).close()
    except Exception as exc:  # noqa: BLE001 - any failure means "no server here"
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN}: {exc}")
    name = f"regmissing_{uuid.uuid4().hex[:10]}"
    url = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    for create in (True, False):
        root = tmp_path / f"ckpt-{create}"
        if not create:
            root.mkdir()
        with pytest.raises(CatalogError) as caught:
            Registry.open(url=url, root=root, create=create)
        message = str(caught.value)
        assert "\n" not in message and f"catalog database {name!r} does not exist" in message
        assert f"'createdb {name}'" in message or f"-U postgres {name}'" in message, message
        assert not root.exists() if create else list(root.iterdir()) == []

    from click.testing import CliRunner

    from registry.cli import main
    result = CliRunner().invoke(main, ["--url", url, "--root", str(tmp_path / "ckpt"), "db", "upgrade"])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "createdb" in result.output and name in result.output, result.output
    with pg_connect(PG_ADMIN) as admin:  # and nothing made it
        assert admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None
    assert isinstance(caught.value, RegistryError)


def test_lightning_resume_path_can_insist_on_a_step(reg: Registry) -> None:
    pytest.importorskip("lightning")
    from registry.integrations.lightning import RegistryCheckpoint

    callback = RegistryCheckpoint(reg, "lit")
    assert callback.resume_path() is None  # a new run
    with pytest.raises(CheckpointNotFoundError) as caught:
        callback.resume_path(create=False)
    assert "\n" not in str(caught.value) and str(reg.store.root) in str(caught.value)
    reg.publish("lit", 3, make_state(3))
    assert callback.resume_path(create=False) == "registry:lit@latest"


def test_transformers_resume_from_can_insist_on_a_step(reg: Registry) -> None:
    pytest.importorskip("transformers")
    from registry.integrations.transformers import RegistryCallback

    callback = RegistryCallback(reg, "hf")
    assert callback.resume_from() is None
    with pytest.raises(CheckpointNotFoundError) as caught:
        callback.resume_from(create=False)
    assert "\n" not in str(caught.value) and str(reg.store.root) in str(caught.value)


def test_install_hints_give_the_checkout_form_and_the_index_form(monkeypatch: pytest.MonkeyPatch) -> None:
    from registry.catalog.session import make_engine
    from registry.cli.terminal import MissingExtraError, require

    with pytest.raises(MissingExtraError) as caught:
        require("no_such_module_for_a_test", "registry ui")
    assert "pip install -e '.[ui]'" in str(caught.value) and "'checkpoint-registry[ui]'" in str(caught.value)

    monkeypatch.setitem(sys.modules, "psycopg", None)  # as where the [postgres] extra is not installed
    with pytest.raises(CatalogError) as refused:
        make_engine("postgresql://postgres@127.0.0.1:5432/test")
    assert "pip install -e '.[postgres]'" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_the_quickstarts_resume_idiom_tells_a_new_run_from_a_wrong_root(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart"):]
    code = quickstart[quickstart.index("```python\n") + len("```python\n"):]
    code = code[:code.index("```\n")]
    (tmp_path / "train.py").write_text(code)
    env = {k: v for k, v in child_env().items() if k not in ("REGISTRY_ROOT", "REGISTRY_URL")}

    def train(*args: str, root: str = "checkpoints") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "train.py", *args], cwd=tmp_path, env={**env, "REGISTRY_ROOT": root},
                              capture_output=True, text=True, timeout=120)

    first = train()
    assert first.returncode == 0, first.stderr
    assert f"created a new checkpoint root {tmp_path / 'checkpoints'} " in first.stderr
    mistyped = train("--resume", root="chekpoints")
    assert mistyped.returncode != 0
    assert "RootError" in mistyped.stderr and "chekpoints does not exist" in mistyped.stderr
    assert not (tmp_path / "chekpoints").exists()
    again = train("--resume")
    assert again.returncode == 0 and again.stderr == "", again.stderr
    with Registry.open(root=tmp_path / "checkpoints", create=False) as reg:
        assert [info.step for info in reg.checkpoints("demo")][-1] == 1000
