"""The command line's looks: plots, wide and CSV metrics, runs sorted by a metric, times with zones,
``--version``, environment variables in ``--help``, global options after the command, and logging."""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from registry import Registry
from registry.cli import main
from registry.cli.main import hoist_global_options
from registry.retention import KeepLast
from tests.helpers import make_state


@pytest.fixture
def runs(reg: Registry) -> Registry:
    for i, step in enumerate((10, 20, 30)):
        reg.publish("alpha", step, make_state(i), metrics={"eval/loss": 1.0 - 0.2 * i, "eval/acc": 0.5 + 0.1 * i})
    reg.log_metrics("alpha", 15, {"train/loss": 0.9}, flush=True)
    reg.publish("beta", 10, make_state(9), metrics={"eval/loss": 0.5, "eval/acc": 0.9})
    reg.tag("alpha", 20, "release")
    return reg


def test_version_and_environment_in_help() -> None:
    runner = CliRunner()
    version = runner.invoke(main, ["--version"])
    assert version.exit_code == 0 and version.output.startswith("registry ")
    helped = runner.invoke(main, ["--help"]).output
    for name in ("REGISTRY_URL", "REGISTRY_ROOT", "REGISTRY_READ_ONLY", "REGISTRY_UI_TOKEN"):
        assert name in helped


def test_global_options_after_the_command(runs: Registry, catalog_url: str, root: Path) -> None:
    runner = CliRunner()
    for args in (["ls", "alpha", "--url", catalog_url, "--root", str(root)],
                 ["ls", f"--root={root}", "alpha", f"--url={catalog_url}", "--read-only", "--json"],
                 ["--url", catalog_url, "ls", "alpha", "--root", str(root), "-q"]):
        result = runner.invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0 and "release" in result.output, (args, result.output)
    assert hoist_global_options(["gc", "r", "--keep-last", "2", "--root", "x"]) == \
        ["--root", "x", "gc", "r", "--keep-last", "2"]
    assert hoist_global_options(["--url", "u", "import", "p", "--", "--root", "x"]) == \
        ["--url", "u", "import", "p", "--", "--root", "x"]


def test_runs_sort_by_a_metric_and_show_times_with_zones(runs: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    low = json.loads(cli("runs", "--sort-by", "eval/loss", "--json").output)
    high = json.loads(cli("runs", "--sort-by", "eval/acc:max", "--json").output)
    assert [r["name"] for r in low] == ["beta", "alpha"] and [r["name"] for r in high] == ["beta", "alpha"]
    assert low[1]["best"] == {"metric": "eval/loss", "mode": "min", "step": 30, "value": pytest.approx(0.6)}
    assert [r["name"] for r in json.loads(cli("runs", "--sort-by", "eval/acc", "--json").output)] == \
        ["alpha", "beta"]
    table = cli("runs", "--sort-by", "eval/loss").output
    assert "BEST eval/loss" in table and "CREATED" in table and "AGE" in table and " UTC " in table
    assert table.index("beta") < table.index("alpha")
    listed = cli("ls", "alpha").output
    assert "CREATED" in listed and listed.count(" UTC ") == 3
    assert " UTC" in cli("show", "alpha@20").output
    bad = cli("runs", "--sort-by", "eval/loss:sideways")
    assert bad.exit_code == 1 and "eval/loss:sideways" in bad.output


def test_metrics_wide_and_csv(runs: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    wide = list(csv.reader(io.StringIO(cli("metrics", "alpha", "--wide", "--csv").output)))
    assert wide[0] == ["step", "eval/acc", "eval/loss", "train/loss"]
    assert [r[0] for r in wide[1:]] == ["10", "15", "20", "30"]
    assert wide[2] == ["15", "", "", "0.9"] and float(wide[3][2]) == pytest.approx(0.8)
    long = list(csv.reader(io.StringIO(cli("metrics", "alpha", "--csv", "--key", "eval/loss").output)))
    assert long[0] == ["step", "key", "value"] and len(long) == 4
    table = cli("metrics", "alpha", "--wide").output.splitlines()
    assert table[0].split() == ["STEP", "eval/acc", "eval/loss", "train/loss"] and len(table) == 5


def test_metrics_plot_marks_the_checkpoints(runs: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    runs.apply_retention("alpha", KeepLast(1))  # 10 deleted; 20 stays (tagged)
    result = cli("metrics", "alpha", "--plot")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "alpha  eval/loss  (3 points, 3 checkpoints)" in out
    assert "\x1b[" not in out  # not a terminal: no colour codes
    assert "● verified" in out and "· deleted" in out and "release" in out
    assert "(1 point, 3 checkpoints)" in cli("metrics", "alpha", "--plot", "--key", "train/loss").output
    missing = cli("metrics", "alpha", "--plot", "--key", "eval/typo")
    assert missing.exit_code == 1 and "eval/typo" in missing.output


def test_publish_is_logged_not_printed(reg: Registry, caplog: pytest.LogCaptureFixture,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with caplog.at_level(logging.INFO, logger="registry"):
        reg.publish("alpha", 1, make_state(1))
        reg.publish("alpha", 2, make_state(2))
        reg.apply_retention("alpha", KeepLast(1))
    published = [r for r in caplog.records if r.getMessage().startswith("published alpha@")]
    assert len(published) == 2 and re.search(r"in [\d.]+ s, [\d.]+ (B|KiB|MiB|GiB|TiB)/s$", published[0].getMessage())
    assert any(r.getMessage().startswith("retention deleted alpha@1") for r in caplog.records)
    assert all(r.name.startswith("registry") for r in caplog.records)
    assert capsys.readouterr() == ("", "")


def test_long_work_reports_progress(reg: Registry, tmp_path: Path) -> None:
    from registry.progress import ProgressEvent
    from tests.helpers import write_hf_sharded
    events: list[ProgressEvent] = []
    for step in (1, 2, 3):
        reg.publish("alpha", step, make_state(step))
    sizes = sum(i.total_bytes for i in reg.checkpoints("alpha"))
    assert all(r.ok for r in reg.verify("alpha", progress=events.append))
    verify = [e for e in events if e.task == "verify"]
    assert verify and verify[-1].total == sizes and verify[-1].done <= sizes
    assert [e.done for e in verify] == sorted(e.done for e in verify) and verify[-1].item.startswith("alpha@")
    events.clear()
    assert not reg.fsck(checksums=True, progress=events.append).problems
    assert events and events[-1].task == "fsck" and events[-1].done > 0
    events.clear()
    write_hf_sharded(tmp_path / "hf")
    reg.import_checkpoint(tmp_path / "hf", run="alpha", step=4, progress=events.append)
    assert events[-1].task == "import" and events[-1].done == events[-1].total > 0
    events.clear()
    reg.plan_retention("alpha", KeepLast(1)).execute(progress=events.append)
    assert [e.done for e in events if e.task == "gc"][-1] == 3 and events[-1].unit == "checkpoints"


def test_progress_bars_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from registry.cli.common import State
    from registry.progress import ProgressEvent
    from registry.cli.terminal import progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with progress_bar(enabled=True) as bar:
        assert bar is not None
        bar(ProgressEvent(task="verify", done=50, total=100, item="alpha@3"))
    assert "verify alpha@3" in terminal.getvalue()
    for state, as_json in ((State(None, None, quiet=True), False), (State(None, None), True)):
        with state.progress(as_json) as bar:
            assert bar is None
    monkeypatch.setattr("sys.stderr", io.StringIO())  # piped
    with progress_bar(enabled=True) as bar:
        assert bar is None
