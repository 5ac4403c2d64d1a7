"""A run mirrored into a real MLflow server (``registry mirror mlflow``), read back through MLflow's own client.

One ``mlflow server`` (SQLite backend, artifacts served) on 127.0.0.1 for the whole module: it takes about 25 s
to start here. Each test mirrors runs of names of its own, on both catalogs. Without mlflow the tests skip,
saying so; with ``CI=true`` that is a failure instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from registry import Registry
from registry.errors import InvalidStateError
from registry.retention import KeepLast
from tests.helpers import IN_CI, child_env, free_port, make_state

# MLflow reports its use to its makers unless told not to; a test run sends nothing anywhere
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

START_DEADLINE_S = 180.0
CONFIG = {"lr": 1e-3, "optimizer": {"name": "adamw", "betas": [0.9, 0.95]}, "layers": 4}
LOSSES = {100: 0.9, 200: 0.4, 300: 0.6, 400: 0.5}


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tracking URI of this module's real MLflow server."""
    try:
        import mlflow  # noqa: F401
    except ImportError as exc:
        if IN_CI:
            pytest.fail(f"the MLflow mirror tests must run in CI: mlflow not installed ({exc})")
        pytest.skip(f"mlflow not installed ({exc}); the MLflow mirror tests skipped")
    home = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = {**child_env(), "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    with open(home / "server.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
             "--artifacts-destination", str(home / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"], cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(server, uri, home / "server.log")
        yield uri
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def wait_until_serving(server: subprocess.Popen[bytes], uri: str, log: Path) -> None:
    """Poll the server's health endpoint until it answers, it exits, or the deadline passes."""
    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        if server.poll() is not None:
            pytest.fail(f"mlflow server exited with {server.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"mlflow server not answering after {START_DEADLINE_S:.0f} s: {log.read_text()[-3000:]}")
        time.sleep(0.2)  # the readiness poll's interval, not a wait for a race


def client(uri: str) -> Any:
    from mlflow import MlflowClient
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def new_run_name() -> str:
    return f"demo-{uuid.uuid4().hex[:8]}"


def publish_run(reg: Registry, run: str) -> None:
    """Four verified steps with eval and train losses, a late point between two, two tags."""
    for step, loss in LOSSES.items():
        reg.publish(run, step, make_state(step), config=CONFIG,
                    metrics={"eval/loss": loss, "train/loss": 2.0 / step})
    reg.log_metrics(run, 150, {"train/loss": 0.015}, flush=True)
    reg.tag(run, 200, "release")
    reg.tag(run, 300, "candidate")


def mlflow_run(c: Any, run: str) -> Any:
    experiment = c.get_experiment_by_name(run)
    found = c.search_runs([experiment.experiment_id], filter_string=f"tags.`registry.run` = '{run}'")
    assert len(found) == 1
    return found[0]


def models_by_step(c: Any, mlrun: Any) -> dict[int, Any]:
    models = c.search_logged_models([mlrun.info.experiment_id])
    return {int(m.tags["registry.step"]): m for m in models}


def snapshot(c: Any, run: str) -> dict[str, Any]:
    """Everything the mirror writes on the MLflow side, with the times MLflow stamps on a change."""
    mlrun = mlflow_run(c, run)
    metrics = {key: sorted((m.step, m.value, m.timestamp) for m in c.get_metric_history(mlrun.info.run_id, key))
               for key in mlrun.data.metrics}
    models = {step: (m.model_id, m.tags, sorted((x.key, x.step, x.value) for x in m.metrics or []),
                     m.last_updated_timestamp, m.status)
              for step, m in models_by_step(c, mlrun).items()}
    registered = c.get_registered_model(run)
    versions = {v.version: (v.source, v.tags, v.last_updated_timestamp)
                for v in c.search_model_versions(f"name = '{run}'")}
    return {"params": mlrun.data.params, "tags": mlrun.data.tags, "status": mlrun.info.status, "metrics": metrics,
            "models": models, "aliases": registered.aliases, "model_tags": registered.tags, "versions": versions}


def test_a_run_reads_back_through_mlflow_and_mirroring_again_changes_nothing(
        catalog_url: str, root: Path, mlflow_uri: str) -> None:
    from registry.integrations.mlflow import mirror_run
    run = new_run_name()
    with Registry.open(catalog_url, root=root) as reg:
        publish_run(reg, run)
        result = mirror_run(reg, run, tracking_uri=mlflow_uri)
        assert result.changed and result.models_created == 4 and result.versions_created == 2
        c = client(mlflow_uri)
        mlrun = mlflow_run(c, run)
        assert mlrun.info.run_name == run and mlrun.info.status == "FINISHED"
        assert mlrun.data.params == {"lr": "0.001", "optimizer.name": "adamw", "optimizer.betas": "[0.9, 0.95]",
                                     "layers": "4"}
        assert mlrun.data.tags["registry.tag.release"] == "200" and mlrun.data.tags["registry.root"] == str(root)
        for key in ("eval/loss", "train/loss"):
            got = sorted((m.step, m.value) for m in c.get_metric_history(mlrun.info.run_id, key))
            assert got == [(p.step, p.value) for p in reg.metrics(run, key)]
        assert (150, 0.015) in [(m.step, m.value) for m in c.get_metric_history(mlrun.info.run_id, "train/loss")]

        models = models_by_step(c, mlrun)
        assert sorted(models) == sorted(LOSSES)
        for info in reg.checkpoints(run):
            model = models[info.step]
            assert model.tags["registry.ref"] == f"{run}@{info.step}"
            assert model.tags["registry.manifest_sha256"] == info.manifest_sha256
            assert model.tags["registry.status"] == "verified" and model.tags["mlflow.external"] == "true"
            assert model.source_run_id == mlrun.info.run_id
            assert {(m.key, m.value) for m in model.metrics} == {(k, v) for k, v in info.metrics.items()}
            assert [a.path for a in c.list_logged_model_artifacts(model.model_id)] == ["MLmodel"]  # no payload

        for key, ascending in (("eval/loss", True), ("train/loss", False)):
            ranked = c.search_logged_models([mlrun.info.experiment_id],
                                            filter_string="tags.`registry.status` = 'verified'",
                                            order_by=[{"field_name": f"metrics.{key}", "ascending": ascending}])
            best = reg.resolve(f"{run}@best:{key}" + ("" if ascending else ":max"))
            assert int(ranked[0].tags["registry.step"]) == best.step

        registered = c.get_registered_model(run)
        assert {alias: int(c.get_model_version(run, version).tags["registry.step"])
                for alias, version in registered.aliases.items()} == {"release": 200, "candidate": 300}
        assert c.get_model_version_by_alias(run, "release").source == f"models:/{models[200].model_id}"

        before = snapshot(c, run)
        again = mirror_run(reg, run, tracking_uri=mlflow_uri)
        assert not again.changed, again
        assert (again.experiment_id, again.run_id) == (result.experiment_id, result.run_id)
        assert snapshot(c, run) == before


def test_retention_tag_moves_and_late_metrics_are_mirrored(catalog_url: str, root: Path, mlflow_uri: str) -> None:
    from registry.integrations.mlflow import mirror_run
    run = new_run_name()
    with Registry.open(catalog_url, root=root) as reg:
        publish_run(reg, run)
        mirror_run(reg, run, tracking_uri=mlflow_uri)
        c = client(mlflow_uri)
        c.set_registered_model_alias(run, "by-hand", c.get_model_version_by_alias(run, "candidate").version)

        reg.tag(run, 400, "release")  # moves from 200
        reg.untag(run, "candidate")
        reg.log_metrics(run, 400, {"eval/accuracy": 0.75}, flush=True)  # a late evaluation
        reg.publish(run, 500, make_state(500), metrics={"eval/loss": 0.3})
        deleted = reg.apply_retention(run, KeepLast(2)).deleted
        assert set(deleted) == {100, 200, 300}

        result = mirror_run(reg, run, tracking_uri=mlflow_uri)
        assert result.models_created == 1 and result.aliases_removed == 1 and result.aliases_set == 1
        mlrun = mlflow_run(c, run)
        models = models_by_step(c, mlrun)
        assert {step: m.tags["registry.status"] for step, m in models.items()} == {
            100: "deleted", 200: "deleted", 300: "deleted", 400: "verified", 500: "verified"}
        assert ("eval/accuracy", 0.75) in {(m.key, m.value) for m in models[400].metrics}
        assert [(m.step, m.value) for m in c.get_metric_history(mlrun.info.run_id, "eval/accuracy")] == [(400, 0.75)]
        registered = c.get_registered_model(run)
        assert set(registered.aliases) == {"release", "by-hand"}  # the hand-set alias stays
        assert c.get_model_version_by_alias(run, "release").source == f"models:/{models[400].model_id}"
        ranked = c.search_logged_models([mlrun.info.experiment_id],
                                        filter_string="tags.`registry.status` = 'verified'",
                                        order_by=[{"field_name": "metrics.eval/loss", "ascending": True}])
        assert int(ranked[0].tags["registry.step"]) == reg.resolve(f"{run}@best:eval/loss").step == 500
        assert not mirror_run(reg, run, tracking_uri=mlflow_uri).changed


def test_an_s3_root_records_the_object_url(s3_root: str, tmp_path: Path, mlflow_uri: str) -> None:
    from registry.integrations.mlflow import mirror_run
    run = new_run_name()
    with Registry.open(f"sqlite:///{tmp_path / 'catalog.db'}", root=s3_root) as reg:
        reg.publish(run, 1, make_state(1), metrics={"eval/loss": 1.0})
        info = reg.resolve(f"{run}@1")
        assert info.url and info.url.startswith("s3://")
        mirror_run(reg, run, tracking_uri=mlflow_uri)
        c = client(mlflow_uri)
        model = models_by_step(c, mlflow_run(c, run))[1]
        assert model.tags["registry.url"] == info.url and model.tags["registry.ref"] == f"{run}@1"


def test_the_command_copies_payload_only_when_asked(tmp_path: Path, mlflow_uri: str) -> None:
    from registry.cli import main
    run = new_run_name()
    url, root = f"sqlite:///{tmp_path / 'catalog.db'}", tmp_path / "ckpt"
    with Registry.open(url, root=root) as reg:
        reg.publish(run, 1, make_state(1), metrics={"eval/loss": 1.0})
        reg.tag(run, 1, "release")
    runner = CliRunner()
    args = ["--url", url, "--root", str(root), "mirror", "mlflow", run, "--tracking-uri", mlflow_uri]
    first = runner.invoke(main, args, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    assert "1 models created" in first.output and "1 aliases set" in first.output
    c = client(mlflow_uri)
    model = models_by_step(c, mlflow_run(c, run))[1]
    assert [a.path for a in c.list_logged_model_artifacts(model.model_id)] == ["MLmodel"]

    again = runner.invoke(main, [*args, "--json"], catch_exceptions=False)
    assert again.exit_code == 0 and json.loads(again.output)["changed"] is False

    copied = runner.invoke(main, [*args, "--copy-payload"], catch_exceptions=False)
    assert copied.exit_code == 0 and "1 payloads copied" in copied.output, copied.output
    files = {a.path for a in c.list_logged_model_artifacts(model.model_id)}
    assert {"MLmodel", "model.safetensors", "manifest.json"} <= files
    assert c.get_logged_model(model.model_id).tags["registry.payload"] == "copied"
    assert "already up to date" in runner.invoke(main, [*args, "--copy-payload"], catch_exceptions=False).output


def test_an_event_mirrors_its_run_and_a_foreign_model_is_refused(sqlite_reg: Registry, mlflow_uri: str) -> None:
    from registry.integrations.mlflow import mirror_event, mirror_run
    run = new_run_name()
    sqlite_reg.publish(run, 1, make_state(1), metrics={"eval/loss": 1.0, "odd//key": 2.0},
                       tags=("release", "team/a"))
    event = {"id": "x", "event": "step.verified", "run": run, "step": 1, "status": "verified"}
    first = mirror_event(sqlite_reg, event, tracking_uri=mlflow_uri)
    assert first is not None and first.models_created == 1 and first.metrics == 1 and first.aliases_set == 1
    assert [why.split(":")[0] for why in first.skipped] == ["metric odd//key", "tag team/a"]  # MLflow refuses both
    again = mirror_event(sqlite_reg, event, tracking_uri=mlflow_uri)  # delivered twice: at least once
    assert again is not None and not again.changed
    assert mirror_event(sqlite_reg, {"event": "tag.set"}, tracking_uri=mlflow_uri) is None

    other = new_run_name()
    sqlite_reg.publish(other, 1, make_state(1), tags=("release",))
    with pytest.raises(InvalidStateError, match="not the mirror of run"):
        mirror_run(sqlite_reg, other, tracking_uri=mlflow_uri, model_name=run)
