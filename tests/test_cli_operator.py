"""Operator mistakes at the edges: retention by a metric nobody logged, faults that reach the
command line, tagging by ref, showing ended steps, ref typos and flag-form hints."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pytest

from registry import PolicyError, Registry
from registry.errors import InvalidRefError, UnknownMetricError
from registry.format.refs import REF_GRAMMAR, parse_ref
from registry.retention import KeepBest, KeepLast, KeepPolicyVersions, MaxBytes, RetentionWarning
from tests.helpers import make_state


@pytest.fixture
def populated(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        for step in (100, 200, 300, 400):
            reg.publish("alpha", step, make_state(step),
                        metrics={"eval/loss": 0.1 if step == 200 else 1.0, "train/loss": 2.0, "acc": 0.5})
        reg.publish("beta", 1, make_state(1))


def live(catalog_url: str, root: Path, run: str = "alpha") -> dict[int, str]:
    with Registry.open(url=catalog_url, root=root) as reg:
        return {i.step: i.status for i in reg.checkpoints(run, include_deleted=True)}


def files_under(root: Path, run: str = "alpha") -> list[str]:
    return sorted(p.name for p in (root / run).iterdir())


def one_error_line(result, status: int = 1) -> str:  # type: ignore[no-untyped-def]
    assert result.exit_code == status, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("registry: error: "), result.output
    assert "Traceback" not in result.output
    return result.output.strip()


# ---------------------------------------------------------------------- retention by an unknown metric


@pytest.mark.usefixtures("migrated_url")
def test_keep_best_typo_is_refused_naming_the_known_metrics(populated, catalog_url: str, root: Path) -> None:
    before = files_under(root)
    with Registry.open(url=catalog_url, root=root) as reg:
        for policy in (KeepBest(2, "eval/los") | KeepLast(1), MaxBytes(10**9, keep=KeepBest(1, "eval/los")),
                       KeepBest(1, "eval/los", mode="max")):
            with pytest.raises(UnknownMetricError) as caught:
                reg.apply_retention("alpha", policy)
            assert isinstance(caught.value, PolicyError) and isinstance(caught.value, ValueError)
            message = str(caught.value)
            assert "\n" not in message and "'eval/los'" in message and "did you mean 'eval/loss'?" in message
            assert caught.value.known[0] == "eval/loss"       # closest match first
            assert set(caught.value.known) == {"eval/loss", "train/loss", "acc"}
            assert "missing_ok=True" in message
    assert live(catalog_url, root) == {s: "verified" for s in (100, 200, 300, 400)}
    assert files_under(root) == before


@pytest.mark.usefixtures("migrated_url")
def test_keep_best_missing_metric_when_intended(populated, catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        assert list(reg.plan_retention("alpha", KeepBest(1, "nope", missing_ok=True) | KeepLast(1)).keep) == [400]
        assert list(reg.plan_retention("alpha", KeepBest(1, "nope") | KeepLast(1),
                                       allow_missing_metrics=True).delete) == [100, 200, 300]
        # a run whose only step is protected anyway has nothing to lose: no refusal
        assert list(reg.plan_retention("beta", KeepBest(1, "nope")).keep) == [1]
        # the real metric still ranks as before
        assert list(reg.plan_retention("alpha", KeepBest(1, "eval/loss")).keep) == [200, 400]
        assert repr(KeepBest(1, "x", missing_ok=True)) == "KeepBest(1, 'x', missing_ok=True)"
        with pytest.raises(PolicyError):
            KeepBest(1, "x", missing_ok="yes")  # type: ignore[arg-type]


@pytest.mark.usefixtures("migrated_url")
def test_keep_policy_versions_on_a_run_that_records_none(populated, catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        for policy in (KeepPolicyVersions(2) | KeepLast(1), KeepPolicyVersions(versions=[3])):
            with pytest.raises(UnknownMetricError, match="has a policy version"):
                reg.apply_retention("alpha", policy)
        assert list(reg.plan_retention("alpha", KeepPolicyVersions(2, missing_ok=True) | KeepLast(1)).keep) == [400]
    assert live(catalog_url, root) == {s: "verified" for s in (100, 200, 300, 400)}


@pytest.mark.usefixtures("migrated_url")
def test_publish_retention_with_a_typo_deletes_nothing(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        for step in (10, 20, 30):
            reg.publish("run", step, make_state(step), metrics={"eval/loss": 1.0 / step})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reg.publish("run", 40, make_state(40), metrics={"eval/loss": 1.0},
                        retention=KeepLast(1) | KeepBest(1, "eval/los"))
        assert [w.category for w in caught] == [RetentionWarning]
        assert "did you mean 'eval/loss'?" in str(caught[0].message)
        assert [(i.step, i.status) for i in reg.checkpoints("run", include_deleted=True)] == [
            (10, "verified"), (20, "verified"), (30, "verified"), (40, "verified")]
    assert sorted(p.name for p in (root / "run").iterdir()) == [f"step-{s:08d}" for s in (10, 20, 30, 40)]


@pytest.mark.usefixtures("migrated_url")
def test_gc_keep_best_typo_exits_2(cli, populated, catalog_url: str, root: Path,  # type: ignore[no-untyped-def]
                                   tmp_path: Path) -> None:
    before = files_under(root)
    for args in (["--keep-best", "nope=1", "--keep-last", "1"], ["--keep-best", "eval/los=1", "--dry-run"],
                 ["--keep-best", "eval/los:max=2", "--max-bytes", "1G", "--json"]):
        line = one_error_line(cli("gc", "alpha", *args), status=2)
        assert "has metric" in line and "eval/loss" in line and "--allow-missing-metric" in line
        assert "allow_missing_metrics=True" not in line
    policy_file = tmp_path / "typo.py"
    policy_file.write_text("from registry.retention import KeepBest, KeepLast\n"
                           "policy = KeepLast(1) | KeepBest(1, 'eval/los')\n")
    line = one_error_line(cli("gc", "alpha", "--policy", str(policy_file)), status=2)
    assert "did you mean 'eval/loss'?" in line and "missing_ok=True" in line
    assert live(catalog_url, root) == {s: "verified" for s in (100, 200, 300, 400)}
    assert files_under(root) == before
    # said to be intended: it runs, keeping nothing by that metric
    result = cli("gc", "alpha", "--keep-best", "nope=1", "--keep-last", "1", "--allow-missing-metric")
    assert result.exit_code == 0, result.output
    assert live(catalog_url, root) == {100: "deleted", 200: "deleted", 300: "deleted", 400: "verified"}


# ---------------------------------------------------------------------- faults reach the CLI as one line


def run_cli(*args: str):  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from registry.cli import main
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_catalog_that_is_not_a_database(tmp_path: Path) -> None:
    bad = tmp_path / "catalog.db"
    bad.write_text("these are not the pages you are looking for\n" * 200)
    (tmp_path / "ckpt").mkdir()  # a reader refuses a missing root first; here only the catalog is wrong
    for command in (["runs"], ["ls", "x"], ["show", "x@1"], ["gc", "x", "--keep-last", "1"], ["fsck"]):
        line = one_error_line(run_cli("--url", f"sqlite:///{bad}", "--root", str(tmp_path / "ckpt"), *command))
        assert str(bad) in line and "not a database" in line


def test_catalog_path_is_a_directory_or_blocked_by_a_file(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    (tmp_path / "r").mkdir()
    line = one_error_line(run_cli("--url", f"sqlite:///{tmp_path / 'dir.db'}", "--root", str(tmp_path / "r"), "runs"))
    assert str(tmp_path / "dir.db") in line
    (tmp_path / "plain").write_text("in the way")
    line = one_error_line(run_cli("--url", f"sqlite:///{tmp_path / 'plain' / 'catalog.db'}",
                                  "--root", str(tmp_path / "r"), "runs"))
    assert str(tmp_path / "plain") in line
    (tmp_path / "rootfile").write_text("in the way")
    line = one_error_line(run_cli("--root", str(tmp_path / "rootfile" / "ckpt"), "runs"))
    assert str(tmp_path / "rootfile") in line


def test_import_of_an_impossible_path(cli, catalog_url: str, root: Path) -> None:  # type: ignore[no-untyped-def]
    line = one_error_line(cli("import", "/tmp/" + "x" * 300, "--run", "r", "--step", "1"))
    assert "File name too long" in line and "x" * 300 in line
    with Registry.open(url=catalog_url, root=root) as reg:
        assert reg.runs() == []


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC, errno.EIO])
def test_raw_os_errors_become_one_line(cli, populated, root: Path, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                       code: int) -> None:
    real_scandir, real_stat = os.scandir, os.stat

    def scandir(path="."):  # type: ignore[no-untyped-def]
        if Path(path) == root.absolute():
            raise OSError(code, os.strerror(code), str(path))
        return real_scandir(path)

    def stat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(path) == root.absolute():
            raise OSError(code, os.strerror(code), str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "scandir", scandir)
    line = one_error_line(cli("fsck"))
    assert line == f"registry: error: {root.absolute()}: {os.strerror(code)}"
    monkeypatch.setattr(os, "scandir", real_scandir)
    monkeypatch.setattr(os, "stat", stat)
    line = one_error_line(cli("show", "alpha@200"))
    assert line == f"registry: error: {root.absolute()}: {os.strerror(code)}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions; EACCES is injected "
                                                "in test_raw_os_errors_become_one_line instead")
def test_unreadable_root_is_one_line(cli, populated, root: Path) -> None:  # type: ignore[no-untyped-def]
    root.chmod(0o000)
    try:
        line = one_error_line(cli("fsck"))
        assert "Permission denied" in line
    finally:
        root.chmod(0o755)


# ---------------------------------------------------------------------- tag by ref, show ended steps


def test_tag_by_ref_and_by_run_step(cli, populated, catalog_url: str, root: Path) -> None:  # type: ignore[no-untyped-def]
    result = cli("tag", "alpha@best:eval/loss", "release")
    assert result.exit_code == 0 and result.output.strip() == "alpha@release -> 200"
    assert cli("resolve", "alpha@release").output.strip().endswith("step-00000200")
    assert cli("tag", "alpha@release", "candidate").output.strip() == "alpha@candidate -> 200"
    assert cli("tag", "alpha", "release").output.strip() == "alpha@release -> 400"  # RUN alone is RUN@latest
    assert cli("tag", "alpha", "300", "release").output.strip() == "alpha@release -> 300"  # the contract form
    one_error_line(cli("tag", "alpha@999", "x"))
    line = one_error_line(cli("tag", "alpha@best:eval/loss:maxx", "x"))
    assert "did you mean alpha@best:eval/loss:max?" in line
    assert cli("tag", "alpha", "3x", "release").exit_code == 2
    with Registry.open(url=catalog_url, root=root) as reg:
        assert {i.step: i.tags for i in reg.checkpoints("alpha")}[300] == ("release",)


@pytest.mark.usefixtures("migrated_url")
def test_show_deleted_and_failed_steps(cli, populated, catalog_url: str, root: Path,  # type: ignore[no-untyped-def]
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli("gc", "alpha", "--keep-last", "1").exit_code == 0
    result = cli("show", "alpha@100")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("alpha@100  DELETED") and lines[1].startswith("ended:    delete at ")
    doc = json.loads(cli("show", "alpha@100", "--json").output)
    assert doc["status"] == "deleted" and doc["ended_by"]["kind"] == "delete"
    assert doc["ended_by"]["detail"]["reason"] == "not kept by the policy"

    real_replace = os.replace

    def full_disk(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        if "step-00000500" in str(dst):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real_replace(src, dst, *args, **kwargs)

    with Registry.open(url=catalog_url, root=root) as reg:
        monkeypatch.setattr(os, "replace", full_disk)
        with pytest.raises(OSError):
            reg.publish("alpha", 500, make_state(500))
        monkeypatch.setattr(os, "replace", real_replace)
    doc = json.loads(cli("show", "alpha@500", "--json").output)
    assert doc["status"] == "failed" and doc["ended_by"]["kind"] == "publish-failed"
    assert "FAILED" in cli("show", "alpha@500").output.splitlines()[0]
    # a live step has no ending; a step that never existed is still an error
    assert json.loads(cli("show", "alpha@400", "--json").output)["ended_by"] is None
    one_error_line(cli("show", "alpha@600"))


# ---------------------------------------------------------------------- ref typos and flag-form hints


@pytest.mark.parametrize("text,intent", [
    ("run@best:loss:maxx", "run@best:loss:max"),
    ("run@best:", "run@best:METRIC"),
    ("run@Best:loss", "run@best:loss"),
    ("run@best-loss:max", "run@best:loss:max"),
    ("run@latest:published", "run@latest-published"),
    ("run@", "run@latest"),
])
def test_ref_errors_give_the_grammar_and_the_intent(text: str, intent: str) -> None:
    with pytest.raises(InvalidRefError) as caught:
        parse_ref(text)
    message = str(caught.value)
    assert "\n" not in message and f"did you mean {intent}?" in message and message.endswith(REF_GRAMMAR)


def test_cli_ref_typos(cli, populated) -> None:  # type: ignore[no-untyped-def]
    for ref, intent in (("alpha@best", "alpha@best:METRIC"), ("alpha@lastest", "alpha@latest"),
                        ("alpha@best:eval/loss:maxx", "alpha@best:eval/loss:max")):
        assert f"did you mean {intent}?" in one_error_line(cli("resolve", ref)), ref
    # a tag that exists is still a tag, whatever it looks like
    assert cli("tag", "alpha", "100", "best").exit_code == 0
    assert cli("resolve", "alpha@best").output.strip().endswith("step-00000100")


def test_cli_hints_name_flags(cli, populated, root: Path) -> None:  # type: ignore[no-untyped-def]
    source = root / "alpha" / "step-00000100"
    line = one_error_line(cli("import", str(source), "--run", "alpha", "--step", "200"))
    assert "--overwrite" in line and "overwrite=True" not in line
    assert cli("import", str(source), "--run", "alpha", "--step", "200", "--overwrite").exit_code == 0


def test_a_reader_that_goes_away_gets_silence_not_an_error(tmp_path: Path) -> None:
    """``registry metrics RUN | head -1``: a closed pipe ends the command quietly, with the shell's 141."""
    import subprocess
    import sys

    from tests.helpers import child_env
    root = tmp_path / "root"
    with Registry.open(root=root) as reg:
        reg.publish("run", 1, make_state(1), metrics={"train/loss": 0.5})
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write fails with EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "registry", "--root", str(root), "metrics", "run"],
                              stdout=write_end, stderr=subprocess.PIPE, env=child_env(), timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 141 and done.stderr == b"", done.stderr.decode()
