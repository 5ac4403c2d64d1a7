"""A PostgreSQL catalog's password never shows: not in a repr, a log line, an error, the CLI or a web page.

The real server on 127.0.0.1 trusts local connections and ignores the password,
so a URL that carries one still opens; each form libpq takes is tried: in the
user-info, and as a ``password=`` or ``sslpassword=`` query parameter.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from registry import Registry
from registry.catalog.session import safe_url
from registry.cli import main
from registry.errors import CatalogError, RootMismatchError
from tests.helpers import make_state, pg_schema_url

SECRET = "s3cretPassw0rd"
FORMS = ("password", "sslpassword", "user-info")


def with_secret(url: str, form: str) -> str:
    """``url`` (a PostgreSQL schema URL with a query already) carrying SECRET the way ``form`` says."""
    if form == "user-info":
        return url.replace("://postgres@", f"://postgres:{SECRET}@", 1)
    return f"{url}&{form}={SECRET}"


@pytest.fixture(params=FORMS)
def secret_url(request: pytest.FixtureRequest, pg_database: str) -> str:
    return with_secret(pg_schema_url(pg_database), request.param)


def cli(url: str, root: Path, *args: str) -> str:
    result = CliRunner().invoke(main, ["--url", url, "--root", str(root), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_the_url_opens_and_its_repr_and_creation_log_hide_the_password(
        secret_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        reg = Registry.open(url=secret_url, root=tmp_path / "ckpt")
    with reg:
        reg.publish("r", 1, make_state(1))  # the password did not stop the driver: the catalog works
        assert [i.step for i in reg.checkpoints("r")] == [1]
        shown = repr(reg)
    created = [r.getMessage() for r in caplog.records if "created a new catalog" in r.getMessage()]
    assert len(created) == 1 and "127.0.0.1" in created[0]
    assert not [r for r in caplog.records if SECRET in r.getMessage()]
    assert SECRET not in shown and "***" in shown and "127.0.0.1" in shown


def test_root_mismatch_errors_hide_the_password(secret_url: str, pg_database: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with Registry.open(url=secret_url, root=root) as reg:
        reg.publish("r", 1, make_state(1))
    another_catalog = with_secret(pg_schema_url(pg_database), "password")
    for url, wrong in ((secret_url, tmp_path / "empty"), (another_catalog, root)):
        with pytest.raises(RootMismatchError, match="does not belong to the catalog") as err:
            Registry.open(url=url, root=wrong)
        assert SECRET not in str(err.value) and "127.0.0.1" in str(err.value)


def test_cli_output_hides_the_password(secret_url: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with Registry.open(url=secret_url, root=root) as reg:
        reg.publish("r", 1, make_state(1))
    (root / ".registry" / "root.json").unlink()  # restored without its marker: what bind-root is for
    bound = cli(secret_url, root, "db", "bind-root")
    assert bound.startswith(f"bound {root} to ") and "127.0.0.1" in bound and SECRET not in bound
    current = cli(secret_url, root, "db", "current")
    assert "up to date" in current and SECRET not in current
    (tmp_path / "empty").mkdir()  # an unmounted mount point
    refused = CliRunner().invoke(main, ["--url", secret_url, "--root", str(tmp_path / "empty"), "ls", "r"])
    assert refused.exit_code == 1 and "does not belong" in refused.output and SECRET not in refused.output


def test_the_web_step_page_hides_the_password(secret_url: str, tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from registry.web import create_app
    root = tmp_path / "ckpt"
    with Registry.open(url=secret_url, root=root) as reg:
        reg.publish("r", 1, make_state(1))
    with Registry.open(url=secret_url, root=root, read_only=True, create=False) as ro:
        page = TestClient(create_app(ro), base_url="http://127.0.0.1:8765").get("/runs/r/steps/1")
    assert page.status_code == 200 and "Load it" in page.text
    assert "--url" in page.text and "127.0.0.1" in page.text and SECRET not in page.text


def test_urls_the_driver_or_the_parser_refuse_hide_the_password(pg_database: str, tmp_path: Path) -> None:
    schema_url = pg_schema_url(pg_database)
    refused = (f"{schema_url}&PASSWORD={SECRET}",  # libpq's keywords are lower case: the driver refuses it
               schema_url.replace("://postgres@", f":/postgres:{SECRET}@", 1),  # not a URL SQLAlchemy parses
               schema_url.replace("://postgres@127.0.0.1:5432", f"://postgres:{SECRET}@127.0.0.1:port", 1))
    for url in refused:
        with pytest.raises(CatalogError) as err:
            Registry.open(url=url, root=tmp_path / "ckpt")
        assert SECRET not in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql+psycopg://u:pw@h:5432/db?options=-c%20x&password=pw",
     "postgresql+psycopg://u:***@h:5432/db?options=-c+x&password=***"),
    ("postgresql://h/db?SSLPassword=pw&Password=pw&password=pw&password=pw2",
     "postgresql://h/db?Password=***&SSLPassword=***&password=***&password=***"),
    ("postgresql://h/db?pass%77ord=pw", "postgresql://h/db?password=***"),  # the key as the driver gets it
    ("postgresql://:pw@h/db", "postgresql://:***@h/db"),
    ("postgres:u:pw@h/db?sslpassword=pw", "postgres:***@h/db?sslpassword=***"),  # unparseable: shown scrubbed
    ("pg:/u:p/w@x@h/db", "pg:/***@h/db"),
    ("sqlite:////tmp/catalog.db", "sqlite:////tmp/catalog.db"),
])
def test_safe_url_hides_every_password_form(url: str, shown: str) -> None:
    assert safe_url(url) == shown
