"""The command line's import paths, each in a fresh interpreter, and the arrows inside the package.

Arrows run one way: ``main`` -> the command modules -> ``common`` -> ``types``/``terminal`` -> the library.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "registry" / "cli"
MODULES = sorted(f"registry.cli.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__")
COMMAND_MODULES = {"registry.cli.runs", "registry.cli.maintenance", "registry.cli.transfer", "registry.cli.lineage",
                   "registry.cli.ui", "registry.cli.hooks", "registry.cli.mirror",
                   "registry.cli.policy"}
# what each module of the package may import of it (anything else it imports is the library or third parties)
ALLOWED = {
    "registry.cli": {"registry.cli.main"},
    "registry.cli.main": COMMAND_MODULES | {"registry.cli.common"},
    "registry.cli.docs": {"registry.cli.main"},
    "registry.cli.common": {"registry.cli.terminal", "registry.cli.types"},
    "registry.cli.terminal": set(),
    "registry.cli.types": set(),
    **{m: {"registry.cli.common", "registry.cli.types", "registry.cli.terminal"} for m in COMMAND_MODULES},
}


def fresh(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=PACKAGE.parent.parent)


def test_the_entry_point_imports() -> None:
    done = fresh("from registry.cli import main\nprint(sorted(main.commands))")
    assert done.returncode == 0, done.stderr
    assert "'gc'" in done.stdout and "'ui'" in done.stdout and "'checkout'" in done.stdout


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_first(module: str) -> None:
    done = fresh(f"import {module}")
    assert done.returncode == 0, done.stderr


def cli_imports(path: Path) -> set[str]:
    """The ``registry.cli`` modules ``path`` imports, wherever the statement is (in functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path.name}: relative import"
            found.update(f"{node.module}.{a.name}" if (PACKAGE / f"{a.name}.py").is_file()
                         and node.module == "registry.cli" else node.module for a in node.names)
    return {m for m in found if m == "registry.cli" or m.startswith("registry.cli.")}


def test_every_module_has_its_arrows_stated() -> None:
    assert set(ALLOWED) == {"registry.cli", *MODULES}


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_arrows_run_one_way(module: str) -> None:
    path = PACKAGE / "__init__.py" if module == "registry.cli" else PACKAGE / f"{module.rpartition('.')[2]}.py"
    assert cli_imports(path) - {module} <= ALLOWED[module]


def test_a_listing_starts_no_child_process(tmp_path: Path) -> None:
    """Looking up a C function once ran ``ldconfig`` in a child process, at the import of every command."""
    from registry import Registry

    Registry.open(root=tmp_path / "root").close()
    done = fresh("import subprocess, sys\n"
                 "started = []\n"
                 "real = subprocess.Popen.__init__\n"
                 "def record(self, args, *rest, **options):\n"
                 "    started.append(args)\n"
                 "    real(self, args, *rest, **options)\n"
                 "subprocess.Popen.__init__ = record\n"
                 "from registry.cli import main\n"
                 "import registry.fs.dedup\n"
                 "main(['--root', sys.argv[1], 'runs'], standalone_mode=False)\n"
                 "from registry.fs.hashing import libc_function\n"
                 "memcmp = libc_function('memcmp')\n"
                 "assert memcmp is not None and memcmp is not libc_function('memcmp')\n"
                 "assert libc_function('no_such_function') is None\n"
                 "print('started', started)", str(tmp_path / "root"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("started []"), done.stdout


# What a listing of a directory root never needs: the other commands' modules, the writers' and verifiers'
# (manifest, safetensors, hashing), the object store's, the background publisher's copies, the migrations (Alembic,
# for a catalog already at head), the ORM and torch. Each is imported by the command or the call that uses it.
NOT_FOR_A_LISTING = ("registry.cli.maintenance", "registry.cli.transfer", "registry.cli.lineage", "registry.cli.ui",
                     "registry.cli.terminal", "registry.format.manifest", "registry.format.safetensors",
                     "registry.fs.hashing", "registry.fs.payloadfiles", "registry.fs.snapshot", "registry.fs.objects",
                     "registry.fs.dedup", "ctypes", "alembic", "sqlalchemy.orm", "torch", "numpy", "xxhash")


# ``show`` parses the step's manifest (its digests: xxhash), but reads no bytes and links nothing.
@pytest.mark.parametrize(("args", "uses"), [(["ls", "demo"], ()), (["runs"], ()), (["resolve", "demo"], ()),
                                            (["show", "demo@latest"], ("registry.format.manifest", "xxhash"))],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_listing_imports_only_what_it_uses(tmp_path: Path, args: list[str], uses: tuple[str, ...]) -> None:
    done = fresh("import sys\n"
                 "import torch\n"
                 "from registry import Registry\n"
                 "with Registry.open(root=sys.argv[1]) as reg:\n"
                 "    reg.publish('demo', 1, {'w': torch.zeros(2)})\n", str(tmp_path / "root"))
    assert done.returncode == 0, done.stderr
    done = fresh("import sys\n"
                 "from registry.cli import main\n"
                 "try:\n"
                 "    main(['--root', sys.argv[1], *sys.argv[2:]])\n"
                 "except SystemExit as exc:\n"
                 "    assert not exc.code, exc.code\n"
                 "print('loaded', *sorted(sys.modules))", str(tmp_path / "root"), *args)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split("loaded", 1)[1].split())
    assert "registry.cli.runs" in loaded  # the probe works: the command's own module is there
    assert sorted(m for m in loaded for heavy in NOT_FOR_A_LISTING
                  if heavy not in uses and (m == heavy or m.startswith(heavy + "."))) == []


def test_every_command_is_found_under_its_own_name() -> None:
    from registry.cli.main import COMMAND_HOMES, COMMANDS
    assert [command.name for command in COMMANDS] == list(COMMAND_HOMES)
