"""What ``import registry`` offers: one list, said three ways (for type checkers, for lazy import, for ``*``)
that must agree, each name from the module that defines it, and every error of ``registry.errors``."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import registry
import registry.errors

INIT = Path(registry.__file__)


def type_checking_imports() -> dict[str, str]:
    """name -> module of the imports under ``if TYPE_CHECKING:`` in ``registry/__init__.py``."""
    tree = ast.parse(INIT.read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module is not None
                found.update({alias.asname or alias.name: stmt.module for alias in stmt.names})
    return found


def test_the_three_lists_agree() -> None:
    typed = type_checking_imports()
    homes = dict(registry._HOMES)
    assert typed == homes
    assert sorted(registry.__all__) == sorted(homes)
    assert len(set(registry.__all__)) == len(registry.__all__)


def test_each_name_comes_from_its_defining_module() -> None:
    for name, home in registry._HOMES.items():
        value = getattr(importlib.import_module(home), name)
        assert getattr(registry, name) is value
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__ == home, f"{name} is defined in {value.__module__}, listed under {home}"


def test_every_error_is_exported() -> None:
    errors = {name for name, value in vars(registry.errors).items()
              if inspect.isclass(value) and issubclass(value, registry.errors.RegistryError)}
    assert errors <= set(registry.__all__), sorted(errors - set(registry.__all__))
