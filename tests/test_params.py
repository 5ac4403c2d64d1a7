"""Runs as experiments: run parameters and a search over them and the metrics (one SQL query, on both catalogs),
the code and environment of each attempt, a system-metrics sampler, notes on tags, the revision that stores them,
and the command line."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sqlalchemy import inspect, text

from registry import CheckpointNotFoundError, InvalidQueryError, InvalidStateError, Registry
from registry.ops.environment import git_state, hide_credentials, packages
from registry.ops.sysmetrics import SystemSampler, proc_counters, psutil_counters
from registry.retention import KeepLast
from tests.helpers import IN_CI, make_state, mark_corrupt
from tests.test_hot_path_counts import statements

WAIT = 60.0  # the longest a condition is waited for; never reached when things work
SYS_KEYS = {"sys/cpu_percent", "sys/memory_used_bytes", "sys/disk_read_bytes", "sys/disk_write_bytes",
            "sys/net_sent_bytes", "sys/net_recv_bytes"}


# ---------------------------------------------------------------------- parameters


def test_params_are_flattened_merged_and_read_back(reg: Registry) -> None:
    reg.set_params("r", {"optimizer": {"lr": 1e-3, "betas": (0.9, 0.99)}, "batch": np.int64(32), "name": "base",
                         "ema": False, "warmup": None, "extra": {}})
    reg.set_params("r", {"optimizer": {"lr": 3e-4, "eps": 1e-8}, "layers": [{"width": 64}]})
    assert reg.params("r") == {"batch": 32, "ema": False, "extra": {}, "layers": [{"width": 64}], "name": "base",
                               "optimizer.betas": [0.9, 0.99], "optimizer.eps": 1e-8, "optimizer.lr": 3e-4,
                               "warmup": None}
    assert list(reg.params("r")) == sorted(reg.params("r"))
    assert [r.name for r in reg.runs()] == ["r"]  # set_params creates the run; it has no checkpoint
    reg.publish("empty", 1, make_state())
    assert reg.params("empty") == {}
    with pytest.raises(CheckpointNotFoundError, match="no run named 'nope'"):
        reg.params("nope")


@pytest.mark.parametrize("bad, match", [
    ({"lr": float("nan")}, "'lr'.*finite"), ({"opt": {"lr": float("inf")}}, "'opt.lr'.*finite"),
    ({"model": object()}, "'model'.*not a JSON value"), ({1: 2}, "invalid param name"), ({"": 1}, "invalid param"),
    ({"a\x00b": 1}, "control"), ({"k" * 256: 1}, "longer than 255"), ({"big": "x" * 70000}, "more than 65536"),
    ({"ids": [1, {2: 3}]}, "text keys"),
])
def test_a_value_json_cannot_hold_is_refused_and_nothing_of_the_call_is_kept(reg: Registry, bad: dict[Any, Any],
                                                                            match: str) -> None:
    reg.set_params("r", {"kept": 1})
    with pytest.raises(InvalidStateError, match=match):
        reg.set_params("r", {"also": 2, **bad})
    assert reg.params("r") == {"kept": 1}


def test_params_refuse_a_non_mapping(reg: Registry) -> None:
    with pytest.raises(InvalidStateError, match="mapping"):
        reg.set_params("r", [("lr", 1)])  # type: ignore[arg-type]


# ---------------------------------------------------------------------- search


def experiments(reg: Registry) -> None:
    """Four runs: three with an optimizer, learning rate and an eval/loss at each checkpoint, one with neither.

    Only the current points at live checkpoints count, as for ``RUN@best``: b's first step (0.95, its highest)
    is deleted by retention, a's lowest and newest point (0.1) is at a step without a checkpoint, and c's 0.4
    was superseded by 0.45.
    """
    for run, lr, opt, losses in (("a", 1e-4, "adamw", [0.9, 0.5, 0.7]), ("b", 3e-3, "sgd", [0.95, 0.8, 0.6]),
                                 ("c", 1e-3, "adamw", [0.4])):
        reg.set_params(run, {"lr": lr, "optimizer": {"name": opt}, "ema": run == "a", "note": None})
        for step, loss in enumerate(losses, 1):
            reg.publish(run, step, make_state(step), metrics={"eval/loss": loss}, verify=False)
    reg.apply_retention("b", KeepLast(2))
    reg.log_metrics("a", 4, {"eval/loss": 0.1}, flush=True)
    reg.set_params("d", {"lr": "auto"})
    reg.log_metrics("c", 1, {"eval/loss": 0.45}, flush=True)


@pytest.mark.parametrize("where, sort, names", [
    ("params.lr < 1e-3", None, ["a"]),
    ("params.lr <= 1e-3", "-params.lr", ["c", "a"]),
    ("params.lr >= 1e-3 and params.optimizer.name = adamw", None, ["c"]),
    ("params.optimizer.name = 'adamw', params.ema = false", None, ["c"]),
    ("params.ema = true", None, ["a"]),
    ("params.note = null", None, ["a", "b", "c"]),
    ("params.lr = auto", None, ["d"]),
    ("params.lr != 1e-3", "params.lr", ["a", "b", "d"]),  # a run without the parameter matches no condition on it
    ("params.optimizer.name != sgd", None, ["a", "c"]),
    ("eval/loss:min < 0.55", "eval/loss:min", ["c", "a"]),  # c's 0.4 was superseded by 0.45
    ("eval/loss < 0.55", "eval/loss", ["c", "a"]),  # a metric alone is KEY:min, as in RUN@best:KEY
    ("eval/loss:last > 0.5", "eval/loss:last", ["b", "a"]),
    ("eval/loss:max >= 0.8", "eval/loss:max", ["a", "b"]),  # :max sorts highest first
    ("eval/loss:min < 0.2", None, []),  # a's 0.1 is at no checkpoint
    (None, "params.lr", ["a", "c", "b", "d"]),  # numbers first, then text
    (None, "-eval/loss:min", ["b", "a", "c", "d"]),  # no value: last either way
    (None, "params.ema,params.lr", ["c", "b", "a", "d"]),  # false before true (as text), then by lr
    ("params.missing = 1", None, []),
])
def test_search_filters_and_sorts_runs(reg: Registry, where: str | None, sort: str | None, names: list[str]) -> None:
    experiments(reg)
    assert [r.name for r in reg.search_runs(where, sort=sort)] == names


def test_a_search_is_one_query_and_returns_its_columns(reg: Registry) -> None:
    experiments(reg)
    with statements() as seen:
        found = reg.search_runs("params.lr < 1e-2 and eval/loss:min < 1", sort="eval/loss:min",
                                columns="params.lr, eval/loss:min,eval/loss:last,params.optimizer.name,params.x")
    work = [s for s in seen if not s.startswith(("BEGIN", "SET", "SELECT pg_", "COMMIT", "ROLLBACK", "PRAGMA"))]
    assert len(work) == 1 and work[0].startswith("SELECT"), seen
    assert [(f.name, f.values, f.steps) for f in found] == [
        ("c", {"params.lr": 1e-3, "eval/loss:min": 0.45, "eval/loss:last": 0.45, "params.optimizer.name": "adamw",
               "params.x": None}, {"eval/loss:min": 1, "eval/loss:last": 1}),
        ("a", {"params.lr": 1e-4, "eval/loss:min": 0.5, "eval/loss:last": 0.7, "params.optimizer.name": "adamw",
               "params.x": None}, {"eval/loss:min": 2, "eval/loss:last": 3}),
        ("b", {"params.lr": 3e-3, "eval/loss:min": 0.6, "eval/loss:last": 0.6, "params.optimizer.name": "sgd",
               "params.x": None}, {"eval/loss:min": 3, "eval/loss:last": 3})]
    assert found[0].to_json()["values"]["params.lr"] == 1e-3 and found[0].to_json()["steps"]["eval/loss:min"] == 1
    # without columns: the fields the conditions and the sort name
    assert list(reg.search_runs("params.lr < 1", sort="eval/loss:max")[0].values) == ["params.lr", "eval/loss:max"]
    assert [r.name for r in reg.search_runs()] == ["a", "b", "c", "d"]


def test_a_metric_field_is_what_best_refs_resolve(reg: Registry) -> None:
    """``KEY:min``/``KEY:max`` are the value and step ``RUN@best:KEY[:max]`` resolves to, whatever happens to the
    run's steps; ``KEY:last`` the newest live step that has the metric."""
    experiments(reg)
    reg.publish("a", 5, make_state(5), verify=False)  # newer, without eval/loss: :last stays at step 3
    assert mark_corrupt(reg, reg.resolve("c@1"), "a scrub found other bytes")  # c has no live step left
    columns = "eval/loss:min,eval/loss:max,eval/loss:last"
    found = {f.name: f for f in reg.search_runs(columns=columns)}
    for run in ("a", "b"):
        for mode in ("min", "max"):
            best = reg.resolve(f"{run}@best:eval/loss:{mode}")
            spec = f"eval/loss:{mode}"
            assert (found[run].values[spec], found[run].steps[spec]) == (best.metrics["eval/loss"], best.step)
    assert (found["a"].values["eval/loss:last"], found["a"].steps["eval/loss:last"]) == (0.7, 3)
    assert found["c"].values == dict.fromkeys(columns.split(","))
    assert found["c"].steps == dict.fromkeys(columns.split(","))
    assert found["d"].values == dict.fromkeys(columns.split(","))


@pytest.mark.parametrize("where, sort, names", [
    ("lr < 1", None, []),  # the metric lr, which no run logs; the parameter is params.lr
    ("eval/loss <= 0.6", "-eval/loss", ["b", "a", "c"]),
])
def test_a_metric_without_a_summary_is_its_min(reg: Registry, where: str, sort: str, names: list[str]) -> None:
    experiments(reg)
    found = reg.search_runs(where, sort=sort)
    assert [r.name for r in found] == names
    assert all(list(r.values) == [where.split()[0] + ":min"] for r in found)


@pytest.mark.parametrize("where", [
    "params.lr <", "params.lr < abc", "eval/loss:min = low", "eval/loss:avg < 1", "eval loss < 1",
    "params.x = 1 or params.y = 2", "(params.x = 1)", "params.x = 'unclosed", "params. = 1", "params.lr < 1e999",
    "params.a = 1 and", "and params.a = 1", "params.a = 1 params.b = 2", "params.a = = 1", "= 1", "\x00",
    "params.a = 1; DROP TABLE runs", "params.lr < 1 -- comment", "x" * 5000, "params.lr < nan", "params.lr ~ 1",
    " and ".join(["params.a = 1"] * 40), "params.a\x1b[31m = 1", "params." + "k" * 300 + " = 1",
])
def test_a_bad_expression_is_one_line_naming_it(sqlite_reg: Registry, where: str) -> None:
    with pytest.raises(InvalidQueryError) as caught:
        sqlite_reg.search_runs(where)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300


@pytest.mark.parametrize("kwargs", [{"sort": "eval/loss:median"}, {"sort": "--params.lr"}, {"columns": "l r"},
                                    {"columns": ",".join(f"params.p{i}" for i in range(40))},
                                    {"sort": "params.a b"}, {"columns": "eval/loss:min:max"}])
def test_bad_sort_keys_and_columns_are_refused(sqlite_reg: Registry, kwargs: dict[str, str]) -> None:
    with pytest.raises(InvalidQueryError):
        sqlite_reg.search_runs(**kwargs)  # type: ignore[arg-type]


def test_hostile_values_are_bound_never_run(reg: Registry) -> None:
    experiments(reg)
    reg.set_params("e", {"name": "x'; DROP TABLE runs; --", "optimizer": {"name": "\"quoted\""}})
    assert [r.name for r in reg.search_runs("params.name = \"x'; DROP TABLE runs; --\"")] == ["e"]
    assert [r.name for r in reg.search_runs("params.optimizer.name = '\"quoted\"'")] == ["e"]
    assert [r.name for r in reg.search_runs("params.name = '%'")] == []  # no LIKE anywhere
    assert len(reg.runs()) == 5


# ---------------------------------------------------------------------- environment


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def no_repo_above(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path``, with git told not to look for a repository above it."""
    if shutil.which("git") is None:
        if IN_CI:
            pytest.fail("git is required in CI: the environment capture is tested in a real repository")
        pytest.skip("git is not installed")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    return tmp_path


def test_an_attempt_records_its_commit_dirty_flag_and_environment(reg: Registry, no_repo_above: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    repo = no_repo_above / "repo"
    (repo / "sub").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "train.py").write_text("print('hi')\n")
    git(repo, "add", "train.py")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    head = git(repo, "rev-parse", "HEAD")
    monkeypatch.chdir(repo)
    reg.publish("r", 1, make_state())
    (first,) = reg.attempts("r")
    env = first.environment
    assert env["git"] == {"commit": head, "branch": "main", "dirty": False}
    assert env["python"] == platform.python_version() and env["torch"] == torch.__version__
    assert env["registry"] and env["host"] and env["cwd"] == str(repo)
    assert env["argv"] == [hide_credentials(a) for a in sys.argv]
    assert env["packages"] == len(packages()) > 10 and len(env["packages_sha256"]) == 64

    (repo / "train.py").write_text("print('changed')\n")
    (repo / "untracked.txt").write_text("not counted\n")
    monkeypatch.chdir(repo / "sub")  # captured once per working directory: a new one is asked again
    reg.begin_attempt("r", resumed_from=1)
    reg.publish("r", 2, make_state())
    second = reg.attempts("r")[1]
    assert second.environment["git"] == {"commit": head, "branch": "main", "dirty": True}
    assert second.environment["packages_sha256"] == env["packages_sha256"]
    assert [a.id for a in reg.attempts("r", step=2)] == [second.id]
    assert [a.id for a in reg.attempts("r", step=1)] == [first.id]
    assert reg.attempts("r", step=99) == []


def test_outside_a_repository_or_without_git_there_is_no_git_and_no_error(reg: Registry, no_repo_above: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    plain = no_repo_above / "plain"
    plain.mkdir()
    monkeypatch.chdir(plain)
    reg.publish("r", 1, make_state())
    assert reg.attempts("r")[0].environment["git"] is None
    (plain / "nogit").mkdir()
    monkeypatch.chdir(plain / "nogit")
    monkeypatch.setenv("PATH", str(plain / "nogit"))  # no git on the path at all
    assert git_state(str(plain / "nogit")) is None
    reg.begin_attempt("r", resumed_from=1)
    reg.publish("r", 2, make_state())
    assert reg.attempts("r")[1].environment["git"] is None


def test_an_empty_repository_has_no_commit_yet(no_repo_above: Path) -> None:
    git(no_repo_above, "init", "-q", "-b", "trunk")
    assert git_state(str(no_repo_above)) == {"commit": None, "branch": "trunk", "dirty": False}


def test_credentials_in_the_command_line_are_hidden() -> None:
    assert hide_credentials("--url=postgresql://user:pw@db/x") == "--url=postgresql://***@db/x"
    assert hide_credentials("https://tok@host/a https://h2/b") == "https://***@host/a https://h2/b"
    assert hide_credentials("me@example.com --lr 1e-3") == "me@example.com --lr 1e-3"


# ---------------------------------------------------------------------- system metrics


def test_the_sampler_logs_sys_metrics_through_log_metrics(migrated_url: str, root: Path) -> None:
    with Registry.open(url=migrated_url, root=root) as reg:
        reg.publish("r", 7, make_state())
        sampler = reg.sample_system_metrics("r", every=0.01)
        with pytest.raises(InvalidStateError, match="sampled already"):
            reg.sample_system_metrics("r")
        assert sampler.wait(2, timeout=WAIT)
        last = sampler.last
        assert set(last) >= SYS_KEYS and 0.0 <= last["sys/cpu_percent"] <= 100.0
        assert last["sys/memory_used_bytes"] > 0 and all(v >= 0 for v in last.values())
        sampler.stop()
        assert not sampler.running
        reg.flush("r")
        points = [p for p in reg.metrics("r", history=True) if p.key.startswith("sys/")]
        assert {p.key for p in points} >= SYS_KEYS and {p.step for p in points} == {7}  # the run's newest step
        assert reg.sample_system_metrics("r", every=0.01, step=lambda: 8).wait(1, timeout=WAIT)  # stopped: again
        running = reg._samplers["r"]
    assert not running.running  # close() stopped it, then flushed its points
    with Registry.open(url=migrated_url, root=root) as again:
        assert {p.key for p in again.metrics("r") if p.step == 8} >= SYS_KEYS


def test_proc_gives_what_psutil_gives() -> None:
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc on this platform")
    if importlib.util.find_spec("psutil") is None:
        if IN_CI:
            pytest.fail("psutil (the system extra) is required in CI")
        pytest.skip("psutil is not installed (the system extra)")
    a, b = proc_counters(), psutil_counters()
    assert a.cpu_total > 0 and b.cpu_total > 0 and a.memory_used > 0 and b.memory_used > 0
    assert a.net_recv >= 0 and a.disk_read >= 0
    logged: list[dict[str, float]] = []
    sampler = SystemSampler(lambda values: logged.append(dict(values)), every=0.01, counters=proc_counters)
    try:
        assert sampler.wait(2, timeout=WAIT)
    finally:
        sampler.stop()
    assert set(logged[0]) >= SYS_KEYS


@pytest.mark.parametrize("every", [0, -1, float("nan"), True, "10"])
def test_a_sampling_interval_must_be_positive_seconds(every: Any) -> None:
    with pytest.raises(InvalidStateError, match="every"):
        SystemSampler(lambda values: None, every=every)


# ---------------------------------------------------------------------- notes on tags


def test_a_tag_keeps_its_note_until_it_moves(reg: Registry) -> None:
    for step in (1, 2):
        reg.publish("r", step, make_state(step))
    reg.tag("r", 1, "release", note="shipped to the eval cluster")
    reg.tag("r", 2, "plain")
    assert [(t.name, t.step, t.note) for t in reg.tags("r")] == [("plain", 2, None),
                                                                  ("release", 1, "shipped to the eval cluster")]
    reg.tag("r", 1, "release")  # again where it is, without a note: kept
    assert reg.tags("r")[1].note == "shipped to the eval cluster"
    reg.tag("r", 1, "release", note="rolled back")
    assert reg.tags("r")[1].note == "rolled back"
    reg.tag("r", 2, "release")  # moved without a note: the old one described the old step
    assert (reg.tags("r")[1].step, reg.tags("r")[1].note) == (2, None)
    reg.tag("r", 1, "release", note="back")
    reg.tag("r", 1, "release", note="")  # removed
    assert reg.tags("r")[1].note is None
    events = [(e.kind, e.detail.get("note")) for e in reg.events("r") if e.kind.startswith("tag")]
    assert events == [("tag", "shipped to the eval cluster"), ("tag", None), ("tag-note", "rolled back"),
                      ("tag", None), ("tag", "back"), ("tag-note", "")]
    assert reg.resolve("r@release").step == 1 and reg.resolve("r@release").tags == ("release",)
    with pytest.raises(InvalidStateError, match="note"):
        reg.tag("r", 1, "release", note="x" * 5000)
    with pytest.raises(InvalidStateError, match="note"):
        reg.tag("r", 1, "release", note=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the revision


def test_the_revision_downgrades_with_data_in_place_and_upgrades_again(catalog_url: str, root: Path) -> None:
    from alembic import command

    from registry.catalog.session import (alembic_config, current_revision, head_revision, open_engine, upgrade,
                                          write_connection)
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.set_params("r", {"lr": 0.1})
        reg.publish("r", 1, make_state(), metrics={"loss": 1.0})
        reg.tag("r", 1, "release", note="n")
    engine = open_engine(catalog_url)
    try:
        with write_connection(engine) as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0008")
            tables = set(inspect(conn).get_table_names())
            assert not {"run_params", "attempt_environments"} & tables
            assert "note" not in {c["name"] for c in inspect(conn).get_columns("tags")}
            assert conn.execute(text("SELECT name FROM tags")).scalars().all() == ["release"]
            # the attempt that wrote the step and its metric point are still named
            assert conn.execute(text("SELECT count(*) FROM checkpoints WHERE attempt_id IS NOT NULL")).scalar() == 1
            assert conn.execute(text("SELECT count(*) FROM metrics WHERE attempt_id IS NOT NULL")).scalar() == 1
        assert upgrade(engine)[0] == "0008"
        with engine.connect() as conn:
            assert current_revision(conn) == head_revision()
    finally:
        engine.dispose()
    with Registry.open(url=catalog_url, root=root) as reg:
        assert reg.params("r") == {} and reg.tags("r")[0].note is None and reg.attempts("r")[0].environment == {}
        assert reg.resolve("r@release").step == 1


# ---------------------------------------------------------------------- the command line


def test_runs_where_sort_columns_on_the_command_line(cli, catalog_url: str, root: Path) -> None:  # type: ignore[no-untyped-def]
    with Registry.open(url=catalog_url, root=root) as reg:
        experiments(reg)
    shown = cli("runs", "--where", "params.lr < 1e-2", "--sort", "eval/loss:min",
                "--columns", "params.lr,eval/loss:min,params.optimizer.name,params.ema")
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert lines[0].split() == ["RUN", "params.lr", "eval/loss:min", "params.optimizer.name", "params.ema"]
    assert [line.split() for line in lines[1:]] == [["c", "0.001", "0.45", "adamw", "false"],
                                                    ["a", "0.0001", "0.5", "adamw", "true"],
                                                    ["b", "0.003", "0.6", "sgd", "false"]]
    doc = json.loads(cli("runs", "--where", "params.lr < 1e-3", "--where", "eval/loss:min < 1", "--json").output)
    assert [(d["name"], d["values"]) for d in doc] == [("a", {"params.lr": 1e-4, "eval/loss:min": 0.5})]
    bad = cli("runs", "--where", "params.lr < < 1")
    assert bad.exit_code == 1 and bad.output.count("\n") == 1 and "cannot search by" in bad.output
    both = cli("runs", "--sort-by", "eval/loss", "--sort", "eval/loss:min")
    assert both.exit_code == 2 and "--sort-by cannot be combined" in both.output
    plain = cli("runs")
    assert plain.exit_code == 0 and plain.output.splitlines()[0].split()[:2] == ["RUN", "CHECKPOINTS"]


def test_tag_note_show_and_show_json(cli, catalog_url: str, root: Path) -> None:  # type: ignore[no-untyped-def]
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.set_params("r", {"lr": 0.1, "optimizer": {"name": "adamw"}})
        reg.publish("r", 5, make_state())
    tagged = cli("tag", "r@latest", "release", "--note", "passed the eval\nsuite")
    assert tagged.exit_code == 0 and tagged.output == "r@release -> 5\n"
    shown = cli("show", "r@release")
    assert shown.exit_code == 0, shown.output
    assert "  release: passed the eval suite" in shown.output.splitlines()
    assert "params:   lr=0.1 optimizer.name=adamw" in shown.output.splitlines()
    assert any(line.startswith("code:     ") and f"python {platform.python_version()}" in line
               for line in shown.output.splitlines())
    doc = json.loads(cli("show", "r@5", "--json").output)
    assert doc["tag_notes"] == {"release": "passed the eval\nsuite"}
    assert doc["params"] == {"lr": 0.1, "optimizer.name": "adamw"}
    assert doc["attempt"]["environment"]["python"] == platform.python_version()


# ---------------------------------------------------------------------- the integrations


def test_lightning_records_the_modules_hparams_when_training_starts(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from registry.integrations.lightning import RegistryCheckpoint
    from tests._lightning_worker import Model
    with Registry.open(root=tmp_path / "root") as reg:
        ckpt = RegistryCheckpoint(reg, "lit")
        ckpt.on_train_start(pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False), Model(lr=0.02))
        assert reg.params("lit") == {"lr": 0.02}


def test_transformers_records_the_training_arguments_when_training_starts(tmp_path: Path) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from registry.integrations.transformers import RegistryCallback
    args = TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=3e-4, per_device_train_batch_size=2,
                             report_to=[])
    with Registry.open(root=tmp_path / "root") as reg:
        RegistryCallback(reg, "hf").on_train_begin(args, TrainerState(), TrainerControl())
        params = reg.params("hf")
    assert params["learning_rate"] == 3e-4 and params["per_device_train_batch_size"] == 2
    assert params["output_dir"] == str(tmp_path / "out") and "report_to" not in params
    assert all(not isinstance(v, (list, dict)) for v in params.values())
