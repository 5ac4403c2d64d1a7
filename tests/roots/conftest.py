"""Fixtures of the conformance suite: every case runs on each kind of root (``kind``), on both catalogs.

``kind`` says how to open a registry on the test's root (``kind.open()``, for
a second registry on the same root and catalog); ``kind_reg`` is one open
registry on it. The S3 fixtures (``s3_root``) come from ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from registry import Registry
from tests.roots.kinds import KINDS, Kind


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kinds(*names): the kinds of root a case applies to (the others never run it)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A case marked ``kinds(...)`` is not collected for the other kinds: it does not apply there (say, a rename
    on an object store), which is no skip to report."""
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        kind = callspec.params.get("kind") if callspec is not None else None
        applies = [m.args for m in item.iter_markers("kinds")]
        (dropped if kind is not None and any(kind not in names for names in applies) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, catalog_url: str, tmp_path: Path) -> Kind:
    request.getfixturevalue("migrated_url")  # every case opens the catalog at once: start it at head
    if request.param == "directory":
        return Kind(name="directory", url=catalog_url, root=str(tmp_path / "ckpt"))
    s3_root = str(request.getfixturevalue("s3_root"))
    if request.param == "s3":
        return Kind(name="s3", url=catalog_url, root=s3_root)
    return Kind(name="tiered", url=catalog_url, root=str(tmp_path / "fast"), durable=s3_root)


@pytest.fixture
def kind_reg(kind: Kind) -> Iterator[Registry]:
    with kind.open() as reg:
        yield reg
