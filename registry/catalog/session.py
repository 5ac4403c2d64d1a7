"""Engines, transactions and schema migration for the catalog.

SQLite is opened in WAL mode with ``foreign_keys`` and a ``busy_timeout``;
write transactions start with ``BEGIN IMMEDIATE`` so two writers queue on the
lock up front instead of deadlocking on an upgrade from a read lock, which is
what turns into "database is locked" under concurrency. Read transactions
stay deferred so readers never wait for each other.

The schema belongs to Alembic. ``open_engine`` brings an empty or older
database to head under a lock (``BEGIN IMMEDIATE`` on SQLite, an advisory
lock on PostgreSQL), so eight processes opening a fresh catalog at once apply
each migration exactly once, and it refuses a database whose revision this
code does not know: it was migrated by a newer registry. Creating a catalog's
schema is logged as a WARNING naming it (a mistyped URL or path must not pass
unnoticed); Alembic's own INFO lines are dropped while the registry migrates,
unless an ``alembic`` logger was given a level of INFO or lower.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import quote, quote_plus

from sqlalchemy import URL, Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, DisconnectionError
from sqlalchemy.pool import NullPool, QueuePool

from registry.crashpoints import crashpoint
from registry.errors import CatalogError, ReadOnlyError, SchemaTooNewError, install_hint

if TYPE_CHECKING:  # Alembic is imported under _quiet_alembic: its first import logs a line per plugin
    from alembic.config import Config
    from alembic.script import ScriptDirectory

BUSY_TIMEOUT_MS = 60_000
_ADVISORY_KEY = 0x5E61_57E7  # "registry" migrations lock on PostgreSQL
_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})  # libpq's keywords that hold a secret
T = TypeVar("T")
log = logging.getLogger(__name__)
_hushed: ContextVar[bool] = ContextVar("registry_hush_alembic", default=False)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def aware(value: datetime | None) -> datetime | None:
    """A timestamp read back from the catalog, in UTC (SQLite returns them naive)."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value



class Transactions(Protocol):
    """Runs ``fn(conn)`` in one catalog transaction, retried as a whole (what :class:`Catalog` offers the
    catalog's other query modules)."""

    def read(self, fn: Callable[[Connection], Any]) -> Any: ...

    def read_prebuilt(self, fn: Callable[[Connection], Any]) -> Any:
        """:meth:`read` for a reader whose statements are built once and run with ``conn.execute`` alone,
        rows read by column name: a backend may run those straight on its driver."""
        ...

    def write(self, fn: Callable[[Connection], Any], *, durable: bool = True) -> Any: ...


def migrations_dir() -> Path:
    """Where the Alembic environment is: ``registry.migrations``, the top-level ``migrations/`` of a checkout
    (mapped by the editable install) or the package's own folder in an installed wheel."""
    spec = importlib.util.find_spec("registry.migrations")
    if spec is None or not spec.submodule_search_locations:
        raise CatalogError("the catalog migrations (registry.migrations) are not installed; reinstall the registry")
    return Path(next(iter(spec.submodule_search_locations)))


class _AlembicChatter(logging.Filter):
    """Drops Alembic's INFO lines logged inside :func:`_quiet_alembic`, unless someone asked for them by
    giving ``alembic`` (or one of its loggers) a level of INFO or lower; the root logger's level does not ask."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or not _hushed.get():
            return True
        name = record.name
        while name:
            level = logging.getLogger(name).level
            if level != logging.NOTSET:
                return level <= record.levelno
            name = name.rpartition(".")[0]
        return False


_CHATTER = _AlembicChatter()


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    # A logger's filters see only the records logged on it, so each of Alembic's loggers gets one; the
    # plugins' logger is made on the first upgrade's import of autogenerate, so it is named ahead of it.
    names = {"alembic.runtime.migration", "alembic.runtime.plugins",
             *(name for name in list(logging.Logger.manager.loggerDict) if name.startswith("alembic."))}
    for name in names:
        logger = logging.getLogger(name)
        if _CHATTER not in logger.filters:
            logger.addFilter(_CHATTER)
    token = _hushed.set(True)
    try:
        yield
    finally:
        _hushed.reset(token)


def _scripts() -> ScriptDirectory:
    with _quiet_alembic():
        from alembic.script import ScriptDirectory
        return ScriptDirectory.from_config(alembic_config())


_REVISION_LINE = re.compile(r"^(down_revision|revision)\s*=\s*(None|\"([^\"]*)\"|'([^']*)')\s*$", re.M)
_head: list[str] = []


def head_revision() -> str:
    """The newest revision of the migrations, read from their ``revision``/``down_revision`` lines.

    Opening a catalog compares it with the database's revision on every
    command; importing Alembic to build its script directory costs more than
    the command itself, so a linear history is read directly and anything
    else (a branch, a line this cannot read) is left to Alembic.
    """
    if not _head:
        _head.append(_linear_head() or _alembic_head())
    return _head[0]


def _linear_head() -> str | None:
    revisions: set[str] = set()
    parents: set[str] = set()
    try:
        files = sorted((migrations_dir() / "versions").glob("*.py"))
        for path in files:
            found = dict((m.group(1), m.group(3) if m.group(3) is not None else m.group(4))
                         for m in _REVISION_LINE.finditer(path.read_text(encoding="utf-8")))
            if "revision" not in found or "down_revision" not in found or found["revision"] is None:
                return None
            revisions.add(found["revision"])
            if found["down_revision"] is not None:
                parents.add(found["down_revision"])
    except OSError:
        return None
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 and len(revisions) == len(files) and parents <= revisions else None


def _alembic_head() -> str:
    head = _scripts().get_current_head()
    assert head is not None
    return head


def alembic_config() -> Config:
    with _quiet_alembic():
        from alembic.config import Config
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    return cfg


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA foreign_keys = ON")
    _switch_to_wal(cur)
    cur.execute("PRAGMA synchronous = FULL")
    cur.close()


def _switch_to_wal(cur: Any) -> None:
    """Put the database in WAL mode, waiting out other connections doing the same.

    Two connections switching a fresh file at once both hold a shared lock and
    both want the exclusive one; SQLite answers one of them "database is
    locked" at once, without its busy handler, to break the deadlock. So the
    loser re-reads the mode (the winner has usually switched it) and retries.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    delay = 0.001
    while str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
        try:
            cur.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay * (0.5 + random.random()))
            delay = min(0.1, delay * 2)


def _sqlite_begin(conn: Connection) -> None:
    immediate = conn.get_execution_options().get("registry_write", False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def read_engine(engine: Engine) -> Engine:
    """A pooled engine for SQLite *read* transactions and reader leases.

    The main engine opens a fresh connection per transaction (NullPool), which
    costs ~0.3 ms of connect and pragmas when the process is quiet, and
    several ms after it freed a lot of memory: more than the indexed queries
    of a ``resolve``. Readers reuse connections from a small pool instead; an
    idle pooled connection holds no transaction, so it blocks neither writers
    nor WAL checkpoints. A connection inherited through ``fork()`` is never
    used (nor closed) by the child: SQLite forbids it, so the child opens its
    own. The only writes made here are reader leases, which need not survive
    a power loss, so these connections commit without the WAL fsync
    (``synchronous = NORMAL``; a checkpoint still syncs what it copies).
    """
    read = create_engine(engine.url, poolclass=QueuePool, pool_size=2, max_overflow=8,
                         connect_args={"check_same_thread": False})
    event.listen(read, "connect", _sqlite_pragmas)
    event.listen(read, "connect", _not_durable)
    event.listen(read, "begin", _sqlite_begin)

    @event.listens_for(read, "connect")
    def remember_pid(_dbapi_conn: Any, record: Any) -> None:
        record.info["pid"] = os.getpid()

    @event.listens_for(read, "checkout")
    def refuse_inherited(_dbapi_conn: Any, record: Any, proxy: Any) -> None:
        if record.info.get("pid") != os.getpid():
            record.dbapi_connection = proxy.dbapi_connection = None
            raise DisconnectionError("SQLite connection inherited across fork()")
    return read


def _not_durable(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.execute("PRAGMA synchronous = NORMAL")


def _sqlite_read_only_pragmas(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA query_only = ON")
    cur.close()


def _sqlite_read_only_uri(database: Path) -> str:
    """A read-only SQLite URI for ``database``.

    A WAL database can be read only through its ``-shm`` index, which a reader
    must create when no one has the database open; in a directory it cannot
    write, it cannot, so there it reads the file as immutable: correct because
    no connection is open (SQLite removes ``-shm`` with the last one), though a
    writer that opens it later is not seen by this reader.
    """
    shm = database.with_name(database.name + "-shm")
    immutable = not shm.exists() and not os.access(database.parent, os.W_OK)
    return f"file:{quote(str(database))}?mode=ro" + ("&immutable=1" if immutable else "")


def cannot_write(url: str) -> bool:
    """Whether ``url`` is an existing SQLite file that this process may not write, such as a
    read-only copy or mount (it needs the file and, for ``-wal``/``-shm``, its directory)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return False  # make_engine says what is wrong with it
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return False
    path = Path(parsed.database)
    return path.is_file() and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK))


def make_engine(url: str, *, create: bool = True, read_only: bool = False) -> Engine:
    """An engine on ``url``. ``create=False`` refuses a SQLite file that does not exist yet instead
    of creating it; ``read_only=True`` opens a connection that cannot write (and implies it)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise CatalogError(f"invalid catalog URL {safe_url(url)!r}") from None
    backend = parsed.get_backend_name()
    options = {"registry_read_only": True} if read_only else {}
    if backend == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:"):
            raise CatalogError("the catalog needs a SQLite file, not an in-memory database")
        path = Path(database).absolute()
        if create and not read_only:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                why = "it exists and is not a directory" if isinstance(exc, FileExistsError) else failure_reason(exc)
                raise CatalogError(f"cannot create the catalog's directory {path.parent}: {why}",
                                   path=database) from exc
        elif not path.is_file():
            raise CatalogError(f"no catalog at {path}: nothing was created; check --root/--url "
                               "(publish, import and 'registry db upgrade' create a catalog)", path=path)
        if read_only:
            uri = _sqlite_read_only_uri(path)
            engine = create_engine(parsed, poolclass=NullPool, execution_options=options,
                                   creator=lambda: sqlite3.connect(uri, uri=True, check_same_thread=False))
            event.listen(engine, "connect", _sqlite_read_only_pragmas)
        else:
            engine = create_engine(parsed, poolclass=NullPool)
            event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    if backend == "postgresql":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        try:
            engine = create_engine(parsed, pool_pre_ping=True, pool_size=2, max_overflow=4,
                                   connect_args={"connect_timeout": 10}, execution_options=options)
        except ImportError as exc:
            raise CatalogError(f"a PostgreSQL catalog needs its driver ({exc.name or 'psycopg'}): "
                               f"{install_hint('postgres')}") from None
        if read_only:
            event.listen(engine, "connect", _postgresql_read_only)
        return engine
    raise CatalogError(f"unsupported catalog backend {backend!r}: use sqlite or postgresql")


def safe_url(url: URL | str) -> str:
    """A catalog URL as a repr, a log line, an error, the CLI or a page shows it: every password hidden.

    SQLAlchemy's ``hide_password`` hides the user-info's password only; libpq (under the PostgreSQL
    driver) also takes one as a query parameter, hidden here whatever the case of its name. A string
    SQLAlchemy cannot parse is shown with all before its last ``@`` hidden, but its scheme.
    """
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        return _scrubbed(str(url))
    shown = parsed.set(query={}).render_as_string(hide_password=True)
    if not parsed.query:
        return shown
    return shown + "?" + "&".join(
        f"{quote_plus(key)}={'***' if key.lower() in _SECRET_PARAMETERS else quote_plus(value)}"
        for key, values in sorted(parsed.query.items())
        for value in ((values,) if isinstance(values, str) else values))


def _scrubbed(text: str) -> str:
    if "@" in text:
        scheme = re.match(r"[\w+]+:/*", text)
        text = (scheme.group(0) if scheme else "") + "***" + text[text.rindex("@"):]
    return re.sub(r"(?i)((?:ssl)?password=)[^&\s]*", r"\1***", text)


def catalog_name(url: URL | str) -> str:
    """How messages name a catalog: the SQLite file (absolute), or the URL without its passwords."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return safe_url(url)
    if parsed.get_backend_name() == "sqlite":
        return str(Path(parsed.database or "").absolute())
    return safe_url(parsed)


def missing_database(exc: BaseException, url: URL) -> CatalogError | None:
    """The one-line error for a PostgreSQL URL naming a database the server does not have, or None.

    The server says so only in words (a refused connection carries no SQLSTATE), so the words are
    matched, with the database's own name.
    """
    if url.get_backend_name() != "postgresql" or not url.database:
        return None
    said = str(exc.orig) if isinstance(exc, DBAPIError) and exc.orig is not None else str(exc)
    if not re.search(f'database "{re.escape(url.database)}" does not exist', said):
        return None
    flags = [f"-{flag} {value}" for flag, value in (("h", url.host), ("p", url.port), ("U", url.username))
             if value is not None]
    server = f"{url.host or 'localhost'}:{url.port or 5432}"
    return CatalogError(f"catalog database {url.database!r} does not exist on the PostgreSQL server at {server}: "
                        f"create it with 'createdb {' '.join([*flags, url.database])}' (the registry makes its "
                        "tables, not the database)")


def failure_reason(exc: BaseException) -> str:
    """The first line of what the database driver or the OS said, without SQLAlchemy's decoration."""
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        said = str(exc.orig)
    elif isinstance(exc, OSError) and exc.strerror:
        said = exc.strerror
    else:
        said = str(exc)
    lines = [line.strip() for line in said.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _postgresql_read_only(dbapi_conn: Any, _record: Any) -> None:
    with dbapi_conn.cursor() as cur:
        cur.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    dbapi_conn.commit()


def is_transient(exc: BaseException) -> bool:
    """Errors that a retry of the whole transaction cures."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    text_ = str(exc.orig).lower() if exc.orig is not None else ""
    code = getattr(exc.orig, "sqlstate", None)
    return ("database is locked" in text_ or "database table is locked" in text_
            or code in ("40001", "40P01", "55P03"))


def retrying(fn: Callable[[], T], *, attempts: int = 8) -> T:
    """Run a whole transaction again after a lock timeout, serialization failure or deadlock."""
    for attempt in range(attempts):
        try:
            return fn()
        except DBAPIError as exc:
            if attempt == attempts - 1 or not is_transient(exc):
                raise
            time.sleep(min(1.0, 0.01 * 2 ** attempt) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def current_revision(conn: Connection) -> str | None:
    """The database's schema revision (None: no schema yet), as Alembic records it in ``alembic_version``."""
    if conn.dialect.has_table(conn, "alembic_version"):
        rows = list(conn.execute(text("SELECT version_num FROM alembic_version")).scalars())
        if len(rows) <= 1:
            return rows[0] if rows else None
    with _quiet_alembic():  # no table (Alembic says None) or several heads (Alembic says why not)
        from alembic.runtime.migration import MigrationContext
        return MigrationContext.configure(conn).get_current_revision()


@contextmanager
def write_connection(engine: Engine, *, durable: bool = True) -> Iterator[Connection]:
    """A write transaction (``BEGIN IMMEDIATE`` on SQLite).

    ``durable=False`` is for rows that mean nothing after a power loss, such as
    a writer's heartbeat (the writer died with the machine): on SQLite its commit
    skips the WAL fsync (``synchronous = NORMAL``), which is most of a commit's
    cost. It is still atomic and survives a crash of the process. The write
    engine opens a fresh connection per transaction, so the setting ends with it.
    """
    if engine.get_execution_options().get("registry_read_only"):
        raise ReadOnlyError(f"catalog {safe_url(engine.url)} is open read-only")
    with engine.connect() as conn:
        if not durable and conn.dialect.name == "sqlite":
            # on the driver's connection: SQLAlchemy would begin a transaction first, where SQLite refuses it
            conn.connection.driver_connection.execute("PRAGMA synchronous = NORMAL")  # type: ignore[union-attr]
        conn.execution_options(registry_write=True)
        with conn.begin():
            yield conn


def _check_known(revision: str | None, url: str) -> None:
    if revision is None or revision == head_revision():
        return
    script = _scripts()
    try:
        script.get_revision(revision)
    except Exception:
        raise SchemaTooNewError(
            f"catalog {url} is at schema revision {revision!r}, which this version of the "
            "registry does not know; upgrade the registry package") from None


def upgrade(engine: Engine, target: str = "head") -> tuple[str | None, str]:
    """Bring the schema to ``target``; returns (revision before, revision after)."""
    url = safe_url(engine.url)

    def run() -> tuple[str | None, str]:
        with write_connection(engine) as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ADVISORY_KEY})
            before = current_revision(conn)
            _check_known(before, url)
            if before != head_revision() or target != "head":
                cfg = alembic_config()
                cfg.attributes["connection"] = conn
                with _quiet_alembic():
                    from alembic import command
                    command.upgrade(cfg, target)
                crashpoint("migrate-before-commit")
            after = current_revision(conn)
            return before, after or ""

    try:
        return retrying(run)
    except DBAPIError as exc:
        missing = missing_database(exc, engine.url)
        if missing is not None:
            raise missing from exc
        raise


def open_engine(url: str, *, migrate: bool = True, create: bool = True, read_only: bool = False) -> Engine:
    """An engine on a catalog whose schema is at head, or a clear one-line error.

    A file that is not a database, a directory where the file should be, a
    server that refuses us: each is a ``CatalogError`` naming the catalog and
    the cause (the driver's error stays attached as ``__cause__``).
    ``create=False`` (and ``read_only=True``) refuse a catalog that does not
    exist or has no schema yet rather than making one; a read-only catalog
    is never migrated. Making a new catalog's schema logs a WARNING naming it;
    opening an existing one logs nothing.
    """
    engine = make_engine(url, create=create, read_only=read_only)
    shown = safe_url(engine.url)
    name = catalog_name(engine.url)
    try:
        with engine.connect() as conn:
            revision = current_revision(conn)
    except DBAPIError as exc:
        engine.dispose()
        missing = missing_database(exc, engine.url)
        if missing is not None:
            raise missing from exc
        verb = "open" if engine.dialect.name == "sqlite" else "reach"
        raise CatalogError(f"cannot {verb} catalog {name}: {failure_reason(exc)}") from exc
    try:
        _check_known(revision, shown)
        if revision is None and (read_only or not create):
            raise CatalogError(f"catalog {name} is empty: nothing was created; check --root/--url "
                               "(publish, import and 'registry db upgrade' create a catalog)")
        if revision != head_revision():
            if not migrate or read_only:
                raise CatalogError(f"catalog {shown} is at revision {revision!r}, not "
                                   f"{head_revision()!r}; run 'registry db upgrade'")
            before, _ = upgrade(engine)
            if before is None:
                log.warning("created a new catalog %s", name)
    except DBAPIError as exc:
        engine.dispose()
        raise CatalogError(f"cannot bring catalog {name} up to date: {failure_reason(exc)}") from exc
    except BaseException:
        engine.dispose()
        raise
    return engine
