"""SIGKILL real worker processes at every crash point and at random moments; nothing may be lost.

Sizes: ``REGISTRY_KILLS`` random kills per backend (default 30),
``REGISTRY_MIGRATION_KILLS`` kills during migration per backend (default 6).
``scripts/killtest`` runs thousands with the same harness.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import pg_schema_url
from tests.killharness import CRASH_TABLE, crashpoint_kills, migration_kills, random_kills

KILLS = int(os.environ.get("REGISTRY_KILLS", "30"))
MIGRATION_KILLS = int(os.environ.get("REGISTRY_MIGRATION_KILLS", "6"))


def test_every_crash_point(catalog_url: str, root: Path) -> None:
    tally = crashpoint_kills(catalog_url, root)
    assert tally.kills == len(CRASH_TABLE) + 2 and tally.not_reached == 0
    assert tally.checked_before_repair == tally.kills and tally.loaded_before_repair > 0
    # each window needed its own repair: roll forward, roll back, restore
    assert {"uncommitted-publish", "abandoned-publish", "interrupted-overwrite"} <= set(tally.repairs)


def test_random_kills(catalog_url: str, root: Path) -> None:
    tally = random_kills(catalog_url, root, kills=KILLS, seed=KILLS)
    assert tally.kills >= KILLS and tally.checked_steps > 0
    # every kill was checked as found, before fsck repaired anything
    assert tally.checked_before_repair == tally.kills + tally.not_reached
    assert tally.loaded_before_repair > 0


def test_kills_during_migration(request: pytest.FixtureRequest, catalog_url: str, tmp_path: Path) -> None:
    if catalog_url.startswith("sqlite"):
        counter = iter(range(1 << 20))

        def make() -> str:
            return f"sqlite:///{tmp_path / f'fresh{next(counter)}.db'}"
    else:
        database = request.getfixturevalue("pg_database")

        def make() -> str:
            return pg_schema_url(database)
    tally = migration_kills(make, tmp_path / "roots", kills=MIGRATION_KILLS)
    assert tally.kills == tally.checked_before_repair == MIGRATION_KILLS
    # every other kill is at the crash point inside the migration's transaction: it landed mid-migration
    assert tally.repairs["killed-mid-migration"] == (MIGRATION_KILLS + 1) // 2 >= 1
    assert tally.repairs["killed-mid-migration"] <= tally.repairs["killed-before-migration-done"]
