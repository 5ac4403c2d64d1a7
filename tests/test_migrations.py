"""The schema belongs to Alembic: empty -> head, verified at open, models agree."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text, update

from registry import CatalogError, Registry, SchemaTooNewError
from registry.catalog import Catalog
from registry.catalog.models import CheckpointRow, metadata
from registry.catalog.session import head_revision, make_engine, open_engine, upgrade
from registry.records import Status


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
            diff = [d for d in compare_metadata(ctx, metadata) if d[0] != "remove_table"
                    or d[1].name != "alembic_version"]
        assert diff == []
    finally:
        engine.dispose()


def test_migrated_status_check_admits_every_status_and_refuses_others(catalog_url: str) -> None:
    # compare_metadata ignores CHECK constraints, and the migrations spell the statuses out on their own.
    catalog = Catalog.open(catalog_url)
    try:
        claim = catalog.claim("r", 1, path="r/step", writer="w", overwrite=False)

        def set_to(value: str) -> None:
            catalog.write(lambda conn: conn.execute(update(CheckpointRow)
                                                    .where(CheckpointRow.c.id == claim.checkpoint_id)
                                                    .values(status=value)))
        for status in Status:
            set_to(status.value)
        with pytest.raises(CatalogError, match="(?i)check"):
            set_to("archived")
    finally:
        catalog.close()


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


def test_lineage_upgrade_from_0004_backfills_with_data_in_place(catalog_url: str) -> None:
    """0005 on a catalog with steps: resumed ones name the step their attempt resumed from."""
    from registry.catalog.lineage import LineageCatalog
    engine = make_engine(catalog_url)
    try:
        upgrade(engine, "0004")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name, created_at) VALUES (1, 'r', CURRENT_TIMESTAMP)"))
            conn.execute(text("INSERT INTO attempts (id, run_id, writer, resumed_from, started_at) VALUES "
                              "(1, 1, 'w', NULL, CURRENT_TIMESTAMP), (2, 1, 'w', 1, CURRENT_TIMESTAMP)"))
            for cid, step, attempt, status in ((1, 1, 1, "verified"), (2, 2, 2, "deleted"), (3, 3, None, "published"),
                                               (4, 4, 2, "staging")):
                conn.execute(text(
                    "INSERT INTO checkpoints (id, run_id, step, status, path, attempt_id, epoch, consumed_samples, "
                    "manifest_sha256, total_bytes, created_at, updated_at) VALUES (:id, 1, :step, :status, 'p', "
                    ":attempt, 0, 0, :digest, 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
                    {"id": cid, "step": step, "status": status, "attempt": attempt, "digest": f"{step:064x}"})
            conn.execute(text("INSERT INTO checkpoint_files (checkpoint_id, name, size, sha256) "
                              "VALUES (1, 'model.safetensors', 3, :sha)"), {"sha": "a" * 64})
        assert upgrade(engine) == ("0004", head_revision())
    finally:
        engine.dispose()
    catalog = Catalog.open(catalog_url)
    try:
        chain = LineageCatalog(catalog).chain("r", 2)
        assert [(h.step, h.how, h.status) for h in chain] == [(2, "resumed", "deleted"), (1, "started", "verified")]
        assert chain[0].parent_manifest_sha256 == f"{1:064x}"
        assert [(h.step, h.how) for h in LineageCatalog(catalog).chain("r", 3)] == [(3, "unknown")]
        assert [h.how for h in LineageCatalog(catalog).chain("r", 4)] == ["unknown"]  # staging: no row yet
        assert catalog.files("r", 1)[0].sha256 == "a" * 64
    finally:
        catalog.close()
