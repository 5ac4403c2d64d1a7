"""``registry gc`` and the two example retention scripts, on both catalogs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from registry import Registry
from registry.ops.policies import parse_keep_best, parse_size
from tests.helpers import make_state

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def populated(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        for step in (100, 200, 300, 400, 500, 600):
            reg.publish("alpha", step, make_state(step), metrics={"eval/loss": 1.0 if step != 300 else 0.1,
                                                                  "eval/acc": step / 1000})
        reg.publish("beta", 1, make_state(1))
        reg.tag("alpha", 100, "release")


def statuses(catalog_url: str, root: Path, run: str = "alpha") -> dict[int, str]:
    with Registry.open(url=catalog_url, root=root) as reg:
        return {i.step: i.status for i in reg.checkpoints(run, include_deleted=True)}


@pytest.mark.usefixtures("migrated_url")
def test_gc_dry_run_table_and_json(cli, populated, catalog_url: str, root: Path) -> None:  # type: ignore[no-untyped-def]
    result = cli("gc", "alpha", "--keep-last", "1", "--keep-best", "eval/loss=1", "--dry-run")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "alpha: KeepLast(1) | KeepBest(1, 'eval/loss')"
    assert lines[1].split() == ["STEP", "STATUS", "ACTION", "SIZE", "REASON"]
    rows = {int(line.split()[0]): line for line in lines[2:8]}
    assert "DELETE" in rows[200] and "not kept by the policy" in rows[200] and "KiB" in rows[200]
    assert "keep" in rows[100] and "tagged release" in rows[100]
    assert "best 1/1 eval/loss=0.1" in rows[300] and "@latest" in rows[600]
    assert "would delete 3 of 6 checkpoints" in result.output
    assert set(statuses(catalog_url, root).values()) == {"verified"}  # nothing changed

    doc = json.loads(cli("gc", "alpha", "--keep-best", "eval/acc:max=2", "--dry-run", "--json").output)
    assert doc["keep"] == [100, 500, 600] and doc["delete"] == [200, 300, 400]
    assert doc["dry_run"] is True and doc["result"] is None and doc["bytes_freed"] > 0
    assert doc["policy"] == "KeepBest(2, 'eval/acc', mode='max')"
    assert set(statuses(catalog_url, root).values()) == {"verified"}


@pytest.mark.usefixtures("migrated_url")
def test_gc_executes_with_a_policy_file(cli, populated, catalog_url: str, root: Path,  # type: ignore[no-untyped-def]
                                        tmp_path: Path) -> None:
    policy_file = tmp_path / "keep.py"
    policy_file.write_text("from registry.retention import KeepEvery, KeepLast\n"
                           "policy = KeepEvery(200) | KeepLast(1)\n")
    result = cli("gc", "alpha", "--policy", str(policy_file), "--keep-every", "300", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["result"]["deleted"] == [500] and doc["keep"] == [100, 200, 300, 400, 600]
    assert statuses(catalog_url, root)[500] == "deleted"
    assert not (root / "alpha" / "step-00000500").exists()
    # again: nothing left to delete
    result = cli("gc", "alpha", "--policy", str(policy_file), "--keep-every", "300")
    assert result.exit_code == 0 and "deleted 0" in result.output


def test_gc_byte_budget(cli, populated, catalog_url: str, root: Path) -> None:  # type: ignore[no-untyped-def]
    with Registry.open(url=catalog_url, root=root) as reg:
        size = {i.step: i.total_bytes for i in reg.checkpoints("alpha")}
    # latest (600) and tagged (100) count first; then the newest that fit: 500, 400
    budget = size[600] + size[100] + size[500] + size[400]
    result = cli("gc", "alpha", "--max-bytes", str(budget), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["keep"] == [100, 400, 500, 600] and doc["result"]["deleted"] == [200, 300]
    assert doc["bytes_kept"] == budget


@pytest.mark.usefixtures("migrated_url")
def test_gc_errors(cli, populated, tmp_path: Path, catalog_url: str, root: Path) -> None:  # type: ignore[no-untyped-def]
    no_policy = tmp_path / "none.py"
    no_policy.write_text("keep = 3\n")
    broken = tmp_path / "broken.py"
    broken.write_text("policy = KeepLast(\n")
    raising = tmp_path / "raising.py"
    raising.write_text("raise RuntimeError('no config\\nsecond line')\n")
    for args, code, text in [
        (("gc", "alpha"), 2, "say what to keep"),
        (("gc", "alpha", "--keep-last", "0"), 2, "--keep-last"),
        (("gc", "alpha", "--keep-best", "eval/loss"), 2, "METRIC[:max]=K"),
        (("gc", "alpha", "--keep-best", "eval/loss:max=0"), 2, "METRIC[:max]=K"),
        (("gc", "alpha", "--max-bytes", "lots"), 2, "not a size"),
        (("gc", "alpha", "--policy", str(tmp_path / "missing.py")), 2, "does not exist"),
        (("gc", "alpha", "--policy", str(no_policy)), 1, "must define `policy = ...`"),
        (("gc", "alpha", "--policy", str(broken)), 1, "SyntaxError"),
        (("gc", "alpha", "--policy", str(raising)), 1, "RuntimeError: no config"),
        (("gc", "alpha", "--keep-best", "bad key!=1"), 1, "invalid metric key"),
        (("gc", "nope", "--keep-last", "1"), 1, "no run named 'nope'"),
    ]:
        result = cli(*args)
        assert result.exit_code == code, (args, result.output)
        assert text in result.output, (args, result.output)
        if code == 1:
            assert len(result.output.strip().splitlines()) == 1, result.output
    assert set(statuses(catalog_url, root).values()) == {"verified"}


def test_parsers() -> None:
    assert parse_keep_best("eval/loss=2") == ("eval/loss", "min", 2)
    assert parse_keep_best("eval/acc:max=3") == ("eval/acc", "max", 3)
    assert parse_size("10G") == 10 * 1000**3 and parse_size("2 GiB") == 2 << 30 and parse_size("123") == 123
    for bad in ("=2", "x=", "x=-1", "x:max"):
        with pytest.raises(ValueError):
            parse_keep_best(bad)
    with pytest.raises(ValueError):
        parse_size("10 parsecs")


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)


def load_script(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), REPO / "examples" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scripts_are_runnable() -> None:
    for name in ("retention_cron.py", "retention_trainer.py"):
        result = run_script(name, "--help")
        assert result.returncode == 0 and "usage:" in result.stdout, result.stderr


@pytest.mark.usefixtures("migrated_url")
def test_cron_script_across_runs(populated, catalog_url: str, root: Path,  # type: ignore[no-untyped-def]
                                 capsys: pytest.CaptureFixture[str]) -> None:
    cron = load_script("retention_cron.py")
    with pytest.raises(SystemExit) as usage:
        cron.main(["--url", catalog_url, "--root", str(root)])
    assert usage.value.code == 2 and "say what to keep" in capsys.readouterr().err
    assert cron.main(["--url", catalog_url, "--root", str(root), "--keep-last", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "alpha: delete 3/6" in out and "beta: delete 0/1" in out
    assert set(statuses(catalog_url, root).values()) == {"verified"}
    done = run_script("retention_cron.py", "--url", catalog_url, "--root", str(root), "--keep-last", "2",
                      "--keep-best", "eval/loss=1", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert {r["run"]: r["result"]["deleted"] for r in doc["runs"]} == {"alpha": [200, 400], "beta": []}
    assert statuses(catalog_url, root) == {100: "verified", 200: "deleted", 300: "verified", 400: "deleted",
                                           500: "verified", 600: "verified"}


def test_trainer_script(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REGISTRY_URL", raising=False)
    trainer = load_script("retention_trainer.py")
    root = tmp_path / "ckpt"
    assert trainer.main(["--root", str(root), "--steps", "60", "--every", "10", "--keep-every", "50", "--json"]) == 0
    kept = [c["step"] for c in json.loads(capsys.readouterr().out)]
    # last 2 (50, 60), every 50 (50), and the best eval loss (on a falling curve, the newest)
    assert kept[-2:] == [50, 60] and len(kept) <= 3
    assert trainer.main(["--root", str(root), "--steps", "80", "--every", "10", "--keep-every", "50"]) == 0
    assert "resumed from retention-demo@60" in capsys.readouterr().out
    with Registry.open(root=root) as reg:
        live = [i.step for i in reg.checkpoints("retention-demo")]
        assert live[-2:] == [70, 80] and 50 in live
        assert {i.step for i in reg.checkpoints("retention-demo", include_deleted=True)} == set(range(10, 81, 10))
