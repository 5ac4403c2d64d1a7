"""The PostgreSQL catalogs the fixtures hand out (``CatalogTemplates`` in ``tests/conftest.py``).

A schema a test used comes back to a later test in place of a new one, so it must come back as a new one
would be: at head, every table empty, the template's rows and a catalog id of its own. One that a test
altered, or that a session still holds, is never reused. Each case runs on a database of its own: the
session's holds the fixtures' own session, which would keep any schema from being reused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from registry import Registry
from registry.catalog.identity import read_identity
from registry.errors import CheckpointNotFoundError
from tests.conftest import _OTHER_SESSIONS, CatalogTemplates, _schema
from tests.helpers import PG_ADMIN, pg_connect, pg_schema_url


@pytest.fixture
def database(pg_database: str) -> Iterator[str]:
    name = f"regtest_pool_{uuid.uuid4().hex[:8]}"
    with pg_connect(PG_ADMIN) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with pg_connect(PG_ADMIN) as admin:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture
def templates(tmp_path: Path) -> Iterator[CatalogTemplates]:
    made = CatalogTemplates(tmp_path / "templates")
    yield made
    made.close()


def new_catalog(templates: CatalogTemplates, database: str) -> str:
    """What ``migrated_url`` does for a PostgreSQL test: a new schema, brought to head."""
    url = pg_schema_url(database, conn=templates.connection(database))
    templates._fill_postgresql(url, database)
    return url


def runs_oid(templates: CatalogTemplates, database: str, url: str) -> int:
    row = templates.connection(database).execute(f"SELECT to_regclass('\"{_schema(url)}\".runs')::oid").fetchone()
    assert row is not None and row[0] is not None
    return int(row[0])


def ended(templates: CatalogTemplates, database: str) -> None:
    """Wait until the sessions the test closed are gone from the server (a backend exits a moment after its
    client hung up): the state a test's teardown finds once its children and threads have ended."""
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing the outcome depends on
    while templates.connection(database).execute(_OTHER_SESSIONS).fetchone() != (0,):
        assert time.monotonic() < deadline, "a closed session never left the server"
        time.sleep(0.01)


def used(url: str, root: Path) -> str:
    """Publish, tag and log into the catalog at ``url``; its catalog id."""
    with Registry.open(url, root=root) as reg:
        reg.publish("run", 1, {"w": torch.ones(3)}, metrics={"loss": 1.0}, tags=["best"])
        reg.publish("run", 2, {"w": torch.zeros(3)})
        return read_identity(reg.catalog.engine).catalog_id


def test_a_used_schema_comes_back_empty_at_head_with_a_catalog_id_of_its_own(
        database: str, templates: CatalogTemplates, tmp_path: Path) -> None:
    first = new_catalog(templates, database)
    old_id = used(first, tmp_path / "a")
    oid = runs_oid(templates, database, first)
    ended(templates, database)
    templates.recycle(first, database)

    second = new_catalog(templates, database)
    assert runs_oid(templates, database, second) == oid  # the same tables, renamed: not migrated again
    left = {n for (n,) in templates.connection(database).execute(
        "SELECT nspname FROM pg_namespace WHERE nspname LIKE 't%' OR nspname LIKE 'emptied_%'")}
    assert _schema(first) not in left and _schema(second) in left and not any(n.startswith("emptied_") for n in left)
    with Registry.open(second, root=tmp_path / "b") as reg:
        assert reg.runs() == []
        with pytest.raises(CheckpointNotFoundError):
            reg.checkpoints("run")
        assert read_identity(reg.catalog.engine).catalog_id not in (old_id, "")
        again = reg.publish("run", 1, {"w": torch.ones(3)}, tags=["best"])  # a step and a tag as in a new one
        assert again.step == 1 and reg.resolve("run@best").step == 1


def test_an_altered_schema_is_not_reused(database: str, templates: CatalogTemplates, tmp_path: Path) -> None:
    first = new_catalog(templates, database)
    used(first, tmp_path / "a")
    with pg_connect(database) as conn:
        conn.execute(f'ALTER TABLE "{_schema(first)}".runs ADD COLUMN extra integer')
    oid = runs_oid(templates, database, first)
    ended(templates, database)
    templates.recycle(first, database)
    second = new_catalog(templates, database)
    assert runs_oid(templates, database, second) != oid
    with Registry.open(second, root=tmp_path / "b") as reg:
        assert reg.runs() == []


def test_a_schema_is_not_reused_while_another_session_is_open(database: str, templates: CatalogTemplates,
                                                             tmp_path: Path) -> None:
    first = new_catalog(templates, database)
    used(first, tmp_path / "a")
    oid = runs_oid(templates, database, first)
    ended(templates, database)
    with pg_connect(database) as still_open:  # a child or a thread of the test that has not ended
        still_open.execute("SELECT 1")
        templates.recycle(first, database)
    second = new_catalog(templates, database)
    assert runs_oid(templates, database, second) != oid
    with Registry.open(first, root=tmp_path / "a") as reg:  # left as the test left it
        assert [c.step for c in reg.checkpoints("run")] == [1, 2]
