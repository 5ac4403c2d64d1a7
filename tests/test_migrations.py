"""The schema belongs to Alembic: empty -> head, verified at open, models agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from registry import Registry, SchemaTooNewError
from registry.catalog.models import Base
from registry.catalog.session import head_revision, make_engine, open_engine, upgrade


def test_empty_to_head_and_current(catalog_url: str) -> None:
    engine = make_engine(catalog_url)
    try:
        before, after = upgrade(engine)
        assert before is None and after == head_revision()
        assert upgrade(engine) == (head_revision(), head_revision())
    finally:
        engine.dispose()


def test_models_match_migrations(catalog_url: str) -> None:
    engine = open_engine(catalog_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = [d for d in compare_metadata(ctx, Base.metadata) if d[0] != "remove_table"
                    or d[1].name != "alembic_version"]
        assert diff == []
    finally:
        engine.dispose()


def test_newer_schema_is_refused(catalog_url: str, root: Path) -> None:
    engine = open_engine(catalog_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'ffff_from_the_future'"))
    engine.dispose()
    with pytest.raises(SchemaTooNewError, match="ffff_from_the_future"):
        Registry.open(url=catalog_url, root=root)


def test_open_without_migrate_refuses_old_schema(catalog_url: str, root: Path) -> None:
    from registry import CatalogError
    with pytest.raises(CatalogError, match="db upgrade"):
        Registry.open(url=catalog_url, root=root, migrate=False)
    with Registry.open(url=catalog_url, root=root) as reg:
        assert reg.catalog.revision() == head_revision()
