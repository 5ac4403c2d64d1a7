"""The catalog's identity and the record of the checkpoint root bound to it.

Knows SQL only: the root's side of the binding (its marker file) belongs to
``registry.fs.store``, and the rule that ties the two together to
``registry.ops.binding``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import Connection, Engine, select, update

from registry.catalog.models import CatalogIdentity, CheckpointRow
from registry.catalog.session import retrying, safe_url, write_connection
from registry.errors import CatalogError
from registry.records import LIVE


@dataclass(frozen=True, kw_only=True)
class Identity:
    catalog_id: str
    root_bound_at: datetime | None
    root_hint: str | None  # "host:/path" the root was bound from; for messages only


def _select(conn: Connection, *, lock: bool) -> Identity:
    query = select(CatalogIdentity).where(CatalogIdentity.c.id == 1)
    if lock:
        query = query.with_for_update()  # PostgreSQL; SQLite's BEGIN IMMEDIATE already serialises writers
    row = conn.execute(query).first()
    if row is None:
        raise CatalogError(f"catalog {safe_url(conn.engine.url)} has no identity row; run 'registry db upgrade'")
    return Identity(catalog_id=row.catalog_id, root_bound_at=row.root_bound_at, root_hint=row.root_hint)


def read_identity(engine: Engine) -> Identity:
    def txn() -> Identity:
        with engine.connect() as conn, conn.begin():
            return _select(conn, lock=False)
    return retrying(txn)


@contextmanager
def locked_identity(engine: Engine) -> Iterator[tuple[Connection, Identity]]:
    """The identity inside a write transaction that keeps every other binder waiting until it ends."""
    with write_connection(engine) as conn:
        yield conn, _select(conn, lock=True)


def record_binding(conn: Connection, *, hint: str) -> None:
    conn.execute(update(CatalogIdentity).where(CatalogIdentity.c.id == 1)
                 .values(root_bound_at=datetime.now(timezone.utc), root_hint=hint[:1024]))


def live_paths(conn: Connection, *, limit: int) -> list[str]:
    """Root-relative directories of the newest ``limit`` published or verified checkpoints."""
    return list(conn.scalars(select(CheckpointRow.c.path).where(CheckpointRow.c.status.in_(LIVE))
                             .order_by(CheckpointRow.c.id.desc()).limit(limit)))
