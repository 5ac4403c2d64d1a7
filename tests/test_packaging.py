"""The wheel: every package is listed, and an installed copy migrates a catalog without the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_every_package_is_listed() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "registry").rglob("__init__.py")
               if "__pycache__" not in p.parts}
    assert set(config["packages"]) == folders | {"registry.migrations"}
    assert config["package-dir"] == {"registry.migrations": "migrations"}
    assert not (REPO / "registry" / "migrations").exists()


@pytest.mark.slow
def test_installed_wheel_migrates_a_fresh_catalog(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheel"), str(REPO)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    wheel = next((tmp_path / "wheel").glob("checkpoint_registry-*.whl"))
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                                str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    assert (target / "registry" / "migrations" / "env.py").is_file()
    assert any((target / "registry" / "migrations" / "versions").glob("0001_*.py"))
    probe = (
        "import registry, registry.catalog.session as s\n"
        "from sqlalchemy import create_engine\n"
        f"assert registry.__file__.startswith({str(target)!r}), registry.__file__\n"
        f"assert str(s.migrations_dir()).startswith({str(target)!r}), s.migrations_dir()\n"
        "engine = s.open_engine('sqlite:///' + 'catalog.db')\n"
        "with engine.connect() as conn:\n"
        "    print(s.current_revision(conn), s.head_revision())\n"
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=work, env=env)
    assert done.returncode == 0, done.stderr
    current, head = done.stdout.split()
    assert current == head
    assert (work / "catalog.db").is_file()


def test_lint_reads_every_module() -> None:
    """No folder of the package is one a tool skips by name (ruff, black and pytest skip any ``dist/``)."""
    shown = subprocess.run([sys.executable, "-m", "ruff", "check", "registry", "--show-files"], capture_output=True,
                           text=True, cwd=REPO)
    assert shown.returncode == 0, shown.stderr
    linted = {Path(line.strip()).resolve() for line in shown.stdout.splitlines() if line.strip().endswith(".py")}
    modules = {p.resolve() for p in (REPO / "registry").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules and modules <= linted, sorted(str(p) for p in modules - linted)
