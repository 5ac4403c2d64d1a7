"""Alembic environment for the registry catalog.

Run programmatically by ``registry.catalog.session.upgrade`` with an open
connection in ``config.attributes["connection"]``; the ``alembic`` command
line works too given ``-x url=...``. Batch mode lets SQLite alter tables.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

config = context.config
connection = config.attributes.get("connection")


def run(conn: Connection) -> None:
    context.configure(connection=conn, target_metadata=None,
                      render_as_batch=conn.dialect.name == "sqlite",
                      transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if url is None:
        raise SystemExit("no catalog URL: pass -x url=URL or set sqlalchemy.url")
    engine = create_engine(url)
    with engine.begin() as conn:
        run(conn)
