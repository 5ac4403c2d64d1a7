"""``registry``: the command line (``registry.cli:main`` is the console script)."""

from __future__ import annotations

from registry.cli.main import main

__all__ = ["main"]
