"""The import boundaries between the package's layers.

The catalog knows nothing of torch, the store and the on-disk format know
nothing of SQL, and a lower layer never imports a higher one. Imports are
checked in fresh interpreters (what a module really pulls in) and statically
over the source (every import, also those inside functions or under
``TYPE_CHECKING``, as each is a dependency).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from registry import Registry
from tests.helpers import make_state

PACKAGE = Path(__file__).resolve().parent.parent / "registry"

# Lowest first; a module may import its own layer and those below it. A layer is a folder of the package
# (an entry covers its submodules) plus the top-level modules that sit at its level.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("registry.errors", "registry.records", "registry.crashpoints", "registry.pools", "registry.progress"),
    ("registry.format",),
    ("registry.fs",),
    ("registry.catalog", "registry.migrations"),
    # one layer: ``Checkpoint`` loads through the dist loader, which reads through ops
    ("registry.ops", "registry.distributed", "registry.retention", "registry.checkpoint"),
    ("registry.api", "registry.views"),
    # the web view sits beside the command line: it may import the api; nothing but ``registry ui`` imports it
    ("registry.cli", "registry.web", "registry.__main__", "registry"),
    # the trainers' integrations: they call the public API; nothing in the package imports them
    ("registry.integrations",),
)

# Imports that break the order today, each to be removed by the change that removes the dependency.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()

# The read-only commands open a ``Registry`` and go through the store, never through a tensor.
TORCH_FREE = ("registry", "registry.catalog", "registry.catalog.queries", "registry.records", "registry.format.refs",
              "registry.errors", "registry.cli", "registry.api", "registry.ops.reading", "registry.checkpoint",
              "registry.fs.snapshot", "registry.fs.validation", "registry.fs.store", "registry.fs.filemaps",
              "registry.format.safetensors", "registry.fs.hashing", "registry.fs.mapping", "registry.cli.transfer", "registry.views", "registry.cli.ui",
              "registry.web", "registry.catalog.lineage", "registry.fs.dedup", "registry.cli.lineage",
              "registry.cli.common", "registry.cli.runs", "registry.cli.maintenance", "registry.cli.main",
              "registry.cli.docs")
# Every module of the format and filesystem folders.
SQL_FREE = tuple(f"registry.{folder}.{path.stem}" for folder in ("format", "fs")
                 for path in sorted((PACKAGE / folder).glob("*.py")) if path.stem != "__init__")


def loaded_after(code: str) -> set[str]:
    """The top-level packages loaded by a fresh interpreter that runs ``code``."""
    probe = code + "\nimport sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@pytest.mark.parametrize("module", TORCH_FREE)
def test_catalog_and_cli_import_without_torch(module: str) -> None:
    assert "torch" not in loaded_after(f"import {module}")


def test_cli_help_runs_without_torch() -> None:
    code = ("from registry.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n")
    assert "torch" not in loaded_after(code)


def test_read_only_commands_run_without_torch(reg: Registry, catalog_url: str, root: Path) -> None:
    for step in (1, 2):
        reg.publish("alpha", step, make_state(step), metrics={"loss": 1.0 / step})
    reg.tag("alpha", 1, "release")
    commands = [(["runs"], "alpha"), (["ls", "alpha"], "release"), (["show", "alpha@2"], "model.safetensors"),
                (["show", "alpha@release", "--json"], '"step": 1'), (["resolve", "alpha@release"], "step-00000001"),
                (["metrics", "alpha"], "loss")]
    code = textwrap.dedent(f"""
        from click.testing import CliRunner
        from registry.cli import main
        for args, expected in {commands!r}:
            result = CliRunner().invoke(main, ["--url", {catalog_url!r}, "--root", {str(root)!r}, *args])
            assert result.exit_code == 0 and expected in result.output, (args, result.output, result.exception)
    """)
    assert "torch" not in loaded_after(code)


def test_store_and_format_import_without_sql() -> None:
    loaded = loaded_after("\n".join(f"import {m}" for m in SQL_FREE))
    assert "xxhash" in loaded  # the probe works: these modules do load their own dependencies
    assert not loaded & {"sqlalchemy", "alembic", "psycopg"}, f"one of {SQL_FREE} imports SQL"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matching entry, layer)
    for layer, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[0]):
                best = (len(name), layer)
    return None if best is None else best[1]


def imported_modules(path: Path) -> set[str]:
    """Every ``registry`` module that ``path`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # ``from registry.ops import reading`` imports the submodule, not the package
                candidate = PACKAGE.parent.joinpath(*base.split("."), alias.name)
                is_module = candidate.with_suffix(".py").is_file() or candidate.is_dir()
                found.add(f"{base}.{alias.name}" if is_module else base)
    return {m for m in found if m == "registry" or m.startswith("registry.")}


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    assert [module_name(p) for p in SOURCES if layer_of(module_name(p)) is None] == []


def test_no_module_imports_a_higher_layer() -> None:
    upward = set()
    for path in SOURCES:
        importer = module_name(path)
        for imported in imported_modules(path):
            low, high = layer_of(importer), layer_of(imported)
            if low is not None and high is not None and high > low:
                upward.add((importer, imported))
    assert upward - KNOWN_VIOLATIONS == set()


def test_only_the_ui_command_imports_the_web_view() -> None:
    importers = {module_name(p) for p in SOURCES if not module_name(p).startswith("registry.web")
                 and any(m == "registry.web" or m.startswith("registry.web.") for m in imported_modules(p))}
    assert importers == {"registry.cli.ui"}


def test_the_static_check_sees_every_kind_of_import() -> None:
    found = imported_modules(PACKAGE / "api.py")
    assert {"registry.ops.reading", "registry.catalog", "registry.fs.store"} <= found  # module level, from-package
    assert {"registry.distributed.loader", "registry.ops.fsck"} <= found  # inside functions and under TYPE_CHECKING
    assert "registry" not in found
    assert layer_of("registry.catalog.queries") == layer_of("registry.catalog")
