"""The command line, through click's runner, on both catalogs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from registry import Registry
from registry.catalog.session import head_revision
from tests.helpers import make_state


@pytest.fixture
def populated(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        for step in (100, 200, 300):
            reg.publish("alpha", step, make_state(step), metrics={"eval/loss": 1.0 / step}, policy_version=step // 100)
        reg.publish("beta", 1, make_state(1))
        reg.tag("alpha", 200, "release")


def test_db_upgrade_and_current(cli, catalog_url: str) -> None:  # type: ignore[no-untyped-def]
    result = cli("db", "current")
    if catalog_url.startswith("sqlite"):  # reading the revision creates no catalog file
        assert result.exit_code == 1 and "no catalog at" in result.output
        assert not Path(catalog_url.removeprefix("sqlite:///")).exists()
    else:
        assert result.exit_code == 0 and "(empty)" in result.output
    result = cli("db", "upgrade")
    assert result.exit_code == 0 and head_revision() in result.output
    result = cli("db", "current")
    assert result.exit_code == 0 and "up to date" in result.output
    assert "already at" in cli("db", "upgrade").output


def test_runs_and_ls(cli, populated) -> None:  # type: ignore[no-untyped-def]
    result = cli("runs")
    assert result.exit_code == 0
    assert "alpha" in result.output and "beta" in result.output
    doc = json.loads(cli("runs", "--json").output)
    assert [(r["name"], r["checkpoints"], r["latest_step"]) for r in doc] == [("alpha", 3, 300), ("beta", 1, 1)]
    doc = json.loads(cli("ls", "alpha", "--json").output)
    assert [c["step"] for c in doc] == [100, 200, 300]
    assert doc[1]["tags"] == ["release"] and doc[2]["policy_version"] == 3
    table = cli("ls", "alpha").output
    assert "release" in table and "verified" in table


def test_show_and_resolve(cli, populated, root: Path) -> None:  # type: ignore[no-untyped-def]
    result = cli("resolve", "alpha")
    assert result.exit_code == 0
    assert result.output.strip() == str(root.absolute() / "alpha" / "step-00000300")
    assert cli("resolve", "alpha@release").output.strip().endswith("step-00000200")
    doc = json.loads(cli("show", "alpha@200", "--json").output)
    assert doc["step"] == 200 and doc["status"] == "verified" and doc["tags"] == ["release"]
    assert {f["name"] for f in doc["files"]} >= {"model.safetensors", "meta.json", "config.json"}
    assert [e["kind"] for e in doc["events"]] == ["publish", "tag"]
    text = cli("show", "alpha@release").output
    assert "alpha@200" in text and "model.safetensors" in text


def test_errors_are_one_line_with_exit_1(cli, populated) -> None:  # type: ignore[no-untyped-def]
    for args in (["resolve", "alpha@999"], ["resolve", "nope"], ["show", "alpha@@x"], ["ls", "../etc"]):
        result = cli(*args)
        assert result.exit_code == 1, args
        assert result.output.count("\n") == 1 and result.output.startswith("registry: error:"), result.output


def test_usage_errors_exit_2(cli) -> None:  # type: ignore[no-untyped-def]
    assert cli("resolve").exit_code == 2
    assert cli("no-such-command").exit_code == 2
    assert cli("tag", "run", "notanumber", "x").exit_code == 2


def test_tag_untag_metrics_verify(cli, populated) -> None:  # type: ignore[no-untyped-def]
    assert cli("tag", "alpha", "100", "release").exit_code == 0
    assert cli("resolve", "alpha@release").output.strip().endswith("step-00000100")
    assert cli("untag", "alpha", "release").exit_code == 0
    assert cli("resolve", "alpha@release").exit_code == 1
    points = json.loads(cli("metrics", "alpha", "--json").output)
    assert [p["step"] for p in points] == [100, 200, 300]
    assert cli("verify", "alpha").exit_code == 0
