"""A newcomer's ordinary mistakes and first looks: did-you-mean, gc's question on a terminal, one-line errors,
tables without empty columns, plurals, help without markup, plots that show their ends, the Python API's repr."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from registry import Registry
from registry.checkpoint import Checkpoint
from registry.errors import CheckpointNotFoundError, PolicyError
from registry.retention import KeepBest
from tests.helpers import REPO, child_env, make_state


@pytest.fixture
def wide(reg: Registry) -> Registry:
    for step in (10, 20, 30):
        reg.publish("wide-64", step, make_state(step), metrics={"eval/loss": 1.0 / step, "eval/acc": step / 40})
    reg.tag("wide-64", 20, "release")
    return reg


def one_line_error(result) -> str:  # type: ignore[no-untyped-def]
    assert result.exit_code == 1, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("registry: error: "), result.output
    return str(result.output)


# ---------------------------------------------------------------------- did you mean


@pytest.mark.parametrize(("ref", "meant"), [
    ("wide64@latest", "did you mean 'wide-64'?"),
    ("wide-64@relase", "did you mean wide-64@release?"),
    ("wide-64@best:eval/los", "did you mean wide-64@best:eval/loss?"),
    ("wide-64@best:eval/acx:max", "did you mean wide-64@best:eval/acc:max?"),
    ("wide-64:latest", "did you mean wide-64@latest?"),
    ("wide-64:release", "did you mean wide-64@release?"),
])
def test_names_looked_up_get_a_did_you_mean_from_the_catalog(wide: Registry, cli, ref: str,  # type: ignore[no-untyped-def]
                                                             meant: str) -> None:
    assert meant in one_line_error(cli("show", ref))


def test_the_python_api_says_it_too_and_nothing_far_is_suggested(wide: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CheckpointNotFoundError, match=r"no run named 'wide64'; did you mean 'wide-64'\?"):
        wide.resolve("wide64")
    with pytest.raises(CheckpointNotFoundError, match=r"has no tag 'relase'; did you mean 'release'\?"):
        wide.untag("wide-64", "relase")
    for ref in ("zzzz", "wide-64@nightly", "wide-64@best:train/tokens"):
        assert "did you mean" not in one_line_error(cli("resolve", ref))


def test_a_metric_key_with_a_colon_is_not_called_a_bad_mode(wide: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    out = one_line_error(cli("resolve", "wide-64@best:eval:loss:max"))
    assert "is not min or max" not in out and "'eval:loss' is not a metric key" in out


# ---------------------------------------------------------------------- gc asks on a terminal


def gc_steps(reg: Registry) -> list[int]:
    return [i.step for i in reg.checkpoints("wide-64")]


def test_gc_on_a_terminal_shows_the_plan_and_asks(wide: Registry, cli, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from registry.cli import main
    monkeypatch.setattr("registry.cli.maintenance.stdin_is_terminal", lambda: True)
    url, root = str(wide.catalog.engine.url.render_as_string(hide_password=False)), str(wide.store.root)
    runner = CliRunner()

    def gc(*args: str, answer: str | None = None):  # type: ignore[no-untyped-def]
        return runner.invoke(main, ["--url", url, "--root", root, "gc", "wide-64", "--keep-last", "1", *args],
                             input=answer, catch_exceptions=False)
    no = gc(answer="n\n")
    assert no.exit_code == 1 and "DELETE" in no.output and "planned to delete 1 of 3 checkpoints" in no.output
    assert "delete 1 checkpoint of wide-64" in no.output and "[y/N]" in no.output
    assert "nothing deleted" in no.output and gc_steps(wide) == [10, 20, 30]
    assert "[y/N]" not in gc("--json").output  # --json is for programs: never asked
    assert gc_steps(wide) == [20, 30]
    wide.publish("wide-64", 40, make_state(40))
    yes = gc("-y")
    assert yes.exit_code == 0 and "[y/N]" not in yes.output and gc_steps(wide) == [20, 40]
    wide.publish("wide-64", 50, make_state(50))
    asked = gc(answer="y\n")
    assert asked.exit_code == 0 and "[y/N]" in asked.output and "deleted 1" in asked.output
    assert gc_steps(wide) == [20, 50]


def test_gc_in_a_script_deletes_without_asking_and_on_a_real_terminal_asks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with Registry.open(root=root, create=True) as reg:
        for step in (1, 2, 3):
            reg.publish("run", step, make_state(step))
    command = [sys.executable, "-m", "registry", "--root", str(root), "gc", "run", "--keep-last", "2"]
    primary, secondary = os.openpty()  # a real terminal on stdin, as a person at a shell has
    try:
        os.write(primary, b"n\n")
        asked = subprocess.run(command, stdin=secondary, capture_output=True, text=True, env=child_env(), cwd=REPO,
                               timeout=120)
    finally:
        os.close(secondary)
        os.close(primary)
    assert asked.returncode == 1 and "[y/N]" in asked.stdout and "nothing deleted" in asked.stderr
    script = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=child_env(),
                            cwd=REPO, timeout=120)
    assert script.returncode == 0 and "[y/N]" not in script.stdout and "deleted 1" in script.stdout
    with Registry.open(root=root) as reg:
        assert [i.step for i in reg.checkpoints("run")] == [2, 3]


# ---------------------------------------------------------------------- tables and messages


def test_metrics_of_an_unknown_key_is_an_error_naming_the_keys(wide: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    out = one_line_error(cli("metrics", "wide-64", "--key", "nope"))
    assert "no metric 'nope'" in out and "eval/acc, eval/loss" in out
    assert "did you mean 'eval/loss'?" in one_line_error(cli("metrics", "wide-64", "--key", "eval/los"))
    assert "did you mean 'eval/loss'?" in one_line_error(cli("metrics", "wide-64", "--plot", "--key", "eval/los"))
    assert cli("metrics", "wide-64", "--key", "eval/loss").output.count("eval/loss") == 3


def test_ls_leaves_out_a_policy_column_nobody_set(wide: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    assert cli("ls", "wide-64").output.splitlines()[0].split() == ["STEP", "STATUS", "SIZE", "TAGS", "CREATED",
                                                                    "AGE", "METRICS"]
    wide.publish("versioned", 1, make_state(1), policy_version=3)
    table = cli("ls", "versioned").output.splitlines()
    assert "POLICY" in table[0] and table[1].split()[2] == "3"


def test_counts_take_the_right_plural(wide: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    shutil.rmtree(wide.resolve("wide-64@10").path)
    out = cli("fsck").output
    assert "1 problem," in out and "1 problems" not in out
    wide.publish("solo", 1, make_state(1))
    assert "would delete 0 of 1 checkpoint," in cli("gc", "solo", "--keep-last", "1", "--dry-run").output


def test_help_text_shows_no_markup() -> None:
    from registry.cli import main

    def helps(cmd: click.Command, path: list[str]):  # type: ignore[no-untyped-def]
        yield " ".join(path), cmd.get_help(click.Context(cmd, info_name=" ".join(path)))
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from helps(sub, [*path, name])
    marked = [(name, line.strip()) for name, text in helps(main, ["registry"])
              for line in text.splitlines() if "`" in line]
    assert marked == []


def test_the_plot_shows_its_ends_in_whole_steps_with_the_legend_out_of_the_way(wide: Registry) -> None:
    from registry.cli.terminal import plot
    wide.tag("wide-64", 30, "newest")
    text = plot(wide.metrics("wide-64", "eval/loss"), wide.checkpoints("wide-64"), run="wide-64", key="eval/loss",
                width=80, height=20, colour=False)
    lines = text.splitlines()
    assert "newest" in text and "release" in text  # a tag on the last step is drawn
    ticks = lines[lines.index(next(line for line in lines if line.lstrip().startswith("└"))) + 1]
    assert ticks.split() == ["10", "15", "20", "25", "30"]  # whole steps, no 12.5
    legend = next(line for line in lines if "● verified" in line)
    assert legend.index("● verified") > 40  # the falling curve starts top left: the legend sits top right
    assert "(3 points, 3 checkpoints)" in lines[0]


def test_progress_bars_write_sizes_as_the_tables_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from registry.progress import ProgressEvent
    from registry.cli.terminal import progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    with progress_bar(enabled=True) as bar:
        assert bar is not None
        bar(ProgressEvent(task="verify", done=3 * 2**20, total=10 * 2**20))
        bar(ProgressEvent(task="gc", done=2, total=5, unit="checkpoints"))
    out = terminal.getvalue()
    assert "3.0 MiB/10.0 MiB" in out and "2/5 checkpoints" in out
    assert not re.search(r"\d (kB|MB|GB)\b", out)


# ---------------------------------------------------------------------- the Python API


def test_a_checkpoint_prints_short_and_has_its_metrics(wide: Registry) -> None:
    ckpt = wide.load("wide-64@30")
    assert ckpt.metrics == ckpt.info.metrics == {"eval/loss": pytest.approx(1 / 30), "eval/acc": 0.75}  # type: ignore[union-attr]
    text = repr(ckpt)
    assert text == str(ckpt) and text.startswith("Checkpoint(wide-64@30, verified, ")
    assert re.fullmatch(r"Checkpoint\(wide-64@30, verified, \d+ tensors?, [\d.]+ (B|KiB|MiB)\)", text), text
    assert not any(name in text for name in ckpt.state_dict)
    assert Checkpoint().metrics == {} and repr(Checkpoint()) == "Checkpoint(no step, 0 tensors, 0 B)"


def test_keep_best_takes_either_order_and_every_spelling_names_the_right_one(wide: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    assert KeepBest("eval/loss", 2) == KeepBest(2, "eval/loss")
    assert repr(KeepBest("eval/acc", 1, "max")) == "KeepBest(1, 'eval/acc', mode='max')"
    with pytest.raises(PolicyError, match=re.escape("as in KeepBest(2, 'eval/loss')")):
        KeepBest("eval/loss", "2")  # type: ignore[arg-type]
    swapped = cli("gc", "wide-64", "--keep-best", "2=eval/loss", "--dry-run")
    assert swapped.exit_code == 2 and "--keep-best eval/loss=2" in swapped.output
    from registry.ops.policies import parse_policy_text
    with pytest.raises(PolicyError, match="as in keep-best eval/loss 2"):
        parse_policy_text("keep-best 2 eval/loss")
    assert parse_policy_text("keep-best eval/loss 2") == parse_policy_text("keep-best eval/loss=2") \
        == KeepBest(2, "eval/loss")
    doc = json.loads(cli("gc", "wide-64", "--keep-best", "eval/loss=1", "--dry-run", "--json").output)
    assert doc["dry_run"] is True
