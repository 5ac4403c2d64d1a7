"""``registry mirror``: a run copied into another tracker (``mirror mlflow``)."""

from __future__ import annotations

import os

import click

from registry.cli.common import State, command, emit_json, json_option


@click.group()
def mirror() -> None:
    """Mirror a run into another experiment tracker.

    \b
    Example:
        registry mirror mlflow demo --tracking-uri http://127.0.0.1:5000
    """


@mirror.command("mlflow")
@click.argument("run")
@click.option("--tracking-uri", required=True, envvar="MLFLOW_TRACKING_URI", show_envvar=True,
              help="The MLflow tracking server (http://HOST:PORT), or a database URI MLflow opens itself.")
@click.option("--experiment", default=None, help="The MLflow experiment (default: one named after RUN).")
@click.option("--model-name", default=None,
              help="The registered model whose aliases are RUN's tags (default: RUN's name).")
@click.option("--copy-payload", is_flag=True,
              help="Also upload each verified step's files to MLflow (by default it records where they are).")
@json_option
@click.pass_obj
@command
def mlflow(state: State, run: str, tracking_uri: str, experiment: str | None, model_name: str | None,
           copy_payload: bool, as_json: bool) -> None:
    """Mirror RUN into MLflow: params, metrics, steps as LoggedModels, tags as aliases.

    Each verified step becomes an external LoggedModel whose bytes stay in the registry (unless
    --copy-payload); a deleted step's model is marked so. Only what differs is written: running it
    again changes nothing.

    \b
    Examples:
        registry mirror mlflow demo --tracking-uri http://127.0.0.1:5000
        MLFLOW_TRACKING_URI=http://mlflow:5000 registry mirror mlflow demo --experiment team --json
    """
    # MLflow would report its own use from this process to its makers; a user who wants it sets this to false
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from registry.cli.common import fail
    from registry.integrations.mlflow import client, mirror_run
    client(tracking_uri)  # without mlflow installed: the error that names the extra
    from mlflow.exceptions import MlflowException
    try:
        result = mirror_run(state.registry(), run, tracking_uri=tracking_uri, experiment=experiment,
                            model_name=model_name, copy_payload=copy_payload)
    except MlflowException as exc:
        fail(f"MLflow at {tracking_uri}: {exc.message}")
        return
    if as_json:
        emit_json(result.to_json())
        return
    done = [f"{n} {what}" for n, what in (
        (result.params, "params"), (result.metrics, "metric points"), (result.run_tags, "run tags"),
        (result.models_created, "models created"), (result.models_updated, "models updated"),
        (result.versions_created, "versions created"), (result.versions_updated, "versions updated"),
        (result.aliases_set, "aliases set"), (result.aliases_removed, "aliases removed"),
        (result.payloads_copied, "payloads copied")) if n]
    click.echo(f"{run} -> MLflow experiment {result.experiment_id}, run {result.run_id}: "
               f"{', '.join(done) if done else 'already up to date'}")
    for why in result.skipped:
        click.echo(f"  not mirrored: {why}")
