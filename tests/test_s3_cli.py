"""The command line and checkouts on an ``s3://`` root (real SeaweedFS), credentials never shown."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from registry import Registry
from registry.cli import main
from registry.errors import InvalidStateError
from registry.format.manifest import read_manifest
from tests import s3server


def state(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), float(seed)), "b": torch.arange(seed + 1)}


@pytest.fixture
def published(catalog_url: str, s3_root: str) -> str:
    with Registry.open(catalog_url, root=s3_root) as reg:
        for step in (1, 2):
            reg.publish("alpha", step, state(step), metrics={"loss": 1.0 / step})
        reg.tag("alpha", 1, "release")
    return s3_root


def run_cli(catalog_url: str, root: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["--url", catalog_url, "--root", root, *args], catch_exceptions=False)
    return result.exit_code, result.output


def test_cli_on_an_s3_root_shows_urls_never_credentials(catalog_url: str, published: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    outputs = []
    code, out = run_cli(catalog_url, published, "ls", "alpha")
    assert code == 0 and "2" in out
    outputs.append(out)
    code, out = run_cli(catalog_url, published, "show", "alpha@latest")
    assert code == 0 and f"path:     {published}/alpha/step-00000002/a-" in out and "unreadable" not in out
    outputs.append(out)
    code, out = run_cli(catalog_url, published, "show", "alpha@release", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["url"].startswith(f"{published}/alpha/step-00000001/a-")
    assert doc["path"].startswith("alpha/step-00000001/a-") and "error" not in doc["manifest"]
    outputs.append(out)
    code, out = run_cli(catalog_url, published, "resolve", "alpha@release")
    assert code == 0 and out.strip() == doc["url"]
    outputs.append(out)
    code, out = run_cli(catalog_url, published, "ls", "alpha", "--json")
    assert code == 0 and all(row["url"].startswith(published) for row in json.loads(out))
    outputs.append(out)
    for text in [*outputs, caplog.text]:
        assert s3server.SECRET_KEY not in text and s3server.ACCESS_KEY not in text


def test_cli_refuses_an_s3_root_without_a_catalog_url(s3_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REGISTRY_URL", raising=False)
    result = CliRunner().invoke(main, ["--root", s3_root, "runs"], catch_exceptions=False)
    assert result.exit_code == 1
    assert "needs an explicit catalog URL" in result.output and len(result.output.strip().splitlines()) == 1


def test_checkout_downloads_verified_files(catalog_url: str, published: str, tmp_path: Path) -> None:
    with Registry.open(catalog_url, root=published) as reg:
        dest = tmp_path / "mine"
        with reg.checkout("alpha@release", dest) as co:
            assert co.kind == "copy" and co.step == 1 and co.path == dest
            manifest, digest = read_manifest(dest)
            assert digest == co.info.manifest_sha256
            assert sorted(p.name for p in dest.iterdir()) == sorted(["manifest.json", *manifest.files])
        assert dest.is_dir()  # the caller's directory stays; only the lease is released
        with reg.checkout("alpha@latest") as owned:
            where = owned.path
            assert (where / "model.safetensors").is_file()
        assert not where.exists()
        with pytest.raises(InvalidStateError, match="needs a filesystem root"):
            reg.checkout("alpha@latest", tmp_path / "linked", link="symlink")
