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
# (an entry covers its submodules) plus the top-level modules that sit at its level. An entry ending in ``*``
# is a plain prefix.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("registry.errors", "registry.records", "registry.crashpoints", "registry.pools", "registry.progress"),
    # the on-disk format, and the retention policies (plain Python over records)
    ("registry.format", "registry.retention"),
    # siblings: neither of the store and the catalog imports the other (see SIBLINGS)
    ("registry.fs", "registry.catalog", "registry.migrations"),
    # where payloads live: a directory, an object store, a fast directory over a durable tier (no SQL)
    ("registry.roots",),
    ("registry.ops",),
    ("registry.distributed",),
    # the facades: they build what they hand out (``Checkpoint``) from what the layers below return
    ("registry.checkpoint", "registry.api", "registry.views"),
    # the web view sits beside the command line: it may import the api; nothing but ``registry ui`` imports it
    # the tracker exports sit here too: the commands that drive them (mirror, metrics --tensorboard) import them
    ("registry.cli", "registry.web", "registry.__main__", "registry", "registry.integrations.mlflow",
     "registry.integrations.tensorboard"),
    # the trainers' integrations: they call the public API; nothing in the package imports them
    ("registry.integrations",),
)

# Parts of one layer that must not import each other either.
SIBLINGS: tuple[tuple[str, ...], ...] = (("registry.fs",), ("registry.catalog", "registry.migrations"))

# Imports that break the order today, each to be removed by the change that removes the dependency.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()

# Circles known to exist today, each to be removed by the change that cuts it.
KNOWN_CIRCLES: set[tuple[str, ...]] = set()

# The read-only commands open a ``Registry`` and go through the store, never through a tensor.
TORCH_FREE = ("registry", "registry.catalog", "registry.catalog.queries", "registry.catalog.records",
              "registry.catalog.session", "registry.retention", "registry.records", "registry.format.refs",
              "registry.errors", "registry.cli", "registry.api", "registry.ops.reading", "registry.checkpoint",
              "registry.fs.snapshot", "registry.fs.validation", "registry.fs.store", "registry.fs.filemaps",
              "registry.format.safetensors", "registry.fs.hashing", "registry.fs.mapping", "registry.cli.transfer",
              "registry.views", "registry.cli.ui",
              "registry.web", "registry.catalog.lineage", "registry.fs.dedup", "registry.fs.inodes",
              "registry.cli.lineage",
              "registry.cli.common", "registry.cli.runs", "registry.cli.maintenance", "registry.cli.main",
              "registry.cli.docs", "registry.fs.objects", "registry.fs.payloadfiles", "registry.fs.objectwrite",
              "registry.fs.objectread", "registry.roots.objectstore", "registry.roots.landing",
              "registry.fs.multipart", "registry.fs.prefixes", "registry.ops.retention", "registry.ops.fsck",
              "registry.roots.objectscan", "registry.roots.dirscan")
# Every module of the format, filesystem and roots folders.
SQL_FREE = ("registry.retention", *(f"registry.{folder}.{path.stem}" for folder in ("format", "fs", "roots")
                                    for path in sorted((PACKAGE / folder).glob("*.py")) if path.stem != "__init__"))


def loaded_after(code: str) -> set[str]:
    """The top-level packages loaded by a fresh interpreter that runs ``code``."""
    probe = code + "\nimport sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_catalog_and_cli_import_without_torch() -> None:
    """All of them in one fresh interpreter (imports only add modules: if together they load no torch, none
    does alone); when torch is loaded, one interpreter each names the modules that pull it in."""
    if "torch" in loaded_after("\n".join(f"import {module}" for module in TORCH_FREE)):
        culprits = [module for module in TORCH_FREE if "torch" in loaded_after(f"import {module}")]
        pytest.fail(f"these modules import torch: {culprits or 'only together'}")


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


def test_the_retention_policies_import_without_torch_or_sql() -> None:
    loaded = loaded_after("from registry.retention import KeepBest, KeepEvery, KeepLast, KeepTagged, MaxBytes")
    assert not loaded & {"torch", "sqlalchemy", "alembic", "psycopg"}, loaded


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def covers(entry: str, module: str) -> bool:
    if entry.endswith("*"):
        return module.startswith(entry[:-1])
    return module == entry or module.startswith(entry + ".")


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the matching entry, layer)
    for layer, names in enumerate(LAYERS):
        for name in names:
            if covers(name, module) and (best is None or len(name) > best[0]):
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


def upward_imports() -> set[tuple[str, str]]:
    """Every (importer, imported) pair where a module imports one of a higher layer."""
    upward = set()
    for path in SOURCES:
        importer = module_name(path)
        for imported in imported_modules(path):
            low, high = layer_of(importer), layer_of(imported)
            if low is not None and high is not None and high > low:
                upward.add((importer, imported))
    return upward


def test_no_module_imports_a_higher_layer() -> None:
    assert not KNOWN_VIOLATIONS
    assert sorted(upward_imports() - KNOWN_VIOLATIONS) == []


def test_the_store_and_the_catalog_never_import_each_other() -> None:
    def group(module: str) -> int | None:
        return next((i for i, names in enumerate(SIBLINGS) if any(covers(n, module) for n in names)), None)
    crossing = {(module_name(p), m) for p in SOURCES for m in imported_modules(p)
                if group(module_name(p)) is not None and group(m) is not None and group(module_name(p)) != group(m)}
    assert sorted(crossing) == []


def circles_of(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Every circle of ``graph`` (module -> what it imports), each as its sorted members: its strongly
    connected parts of more than one module."""
    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for target in graph.get(todo.pop(), set()) - seen:
                seen.add(target)
                todo.append(target)
        return seen
    reached = {m: reach(m) for m in graph}
    return {tuple(sorted({x for x in reached[m] if m in reached.get(x, set())} | {m}))
            for m in graph if m in reached[m]}


def import_circles() -> set[tuple[str, ...]]:
    """The package's import circles, counting every import statement (also those inside functions and under
    ``TYPE_CHECKING``: each is a dependency, whether or not it runs at import time)."""
    return circles_of({module_name(p): imported_modules(p) - {"registry", module_name(p)} for p in SOURCES})


def test_the_circle_check_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert circles_of(graph) == {("a", "b", "c")}
    assert circles_of({"a": {"b"}, "b": set()}) == set()


def test_no_import_circles() -> None:
    found = import_circles()
    assert sorted(found - KNOWN_CIRCLES) == []
    assert found >= KNOWN_CIRCLES  # a known circle that is gone comes off the list


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
