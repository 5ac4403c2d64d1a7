"""``registry runs``, ``ls``, ``show``, ``resolve``, ``tag``, ``untag`` and ``metrics``: reading and naming steps."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from collections.abc import Sequence
from typing import Any

import click

from registry.cli.common import State, command, emit_json, json_option, table
from registry.cli.types import Count
from registry.errors import RegistryError
from registry.records import NO_PAYLOAD, human_bytes


@click.command()
@click.option("--sort-by", default=None, metavar="METRIC[:max]",
              help="Order runs by their best value of METRIC (lowest first; ':max' for highest), as RUN@best ranks.")
@click.option("--where", "where", multiple=True, metavar="EXPR",
              help="Only runs that meet EXPR: conditions FIELD OP VALUE joined by 'and', OP one of < <= > >= = != "
                   "(repeatable). A FIELD is params.KEY or a metric at the run's live checkpoints: METRIC:min or "
                   ":max, the best value (the step RUN@best:METRIC loads; METRIC alone is METRIC:min), or "
                   "METRIC:last, the value at the newest one that has it.")
@click.option("--sort", "sort", default=None, metavar="FIELD[,FIELD...]",
              help="Order runs by these fields, best first (METRIC:max highest first, others lowest first; a "
                   "leading '-' turns one round); runs without a value last.")
@click.option("--columns", default=None, metavar="FIELD[,FIELD...]",
              help="Show these fields (default: the ones --where and --sort name).")
@json_option
@click.pass_obj
@command
def runs(state: State, sort_by: str | None, where: tuple[str, ...], sort: str | None, columns: str | None,
         as_json: bool) -> None:
    """List runs, with when each was created; or search them by parameters and metrics.

    \b
    Examples:
        registry runs
        registry runs --sort-by eval/accuracy:max --json
        registry runs --where 'params.lr < 1e-3' --sort eval/loss:min --columns params.lr,eval/loss:min
    """
    if where or sort or columns:
        if sort_by:
            raise click.UsageError("--sort-by cannot be combined with --where, --sort or --columns "
                                   "(use --sort METRIC:min or --sort METRIC:max)")
        search_runs(state, where, sort, columns, as_json=as_json)
        return
    from registry.views import format_age, format_time, runs_doc
    docs = runs_doc(state.registry(), sort_by=sort_by)
    if as_json:
        emit_json(docs)
        return
    best = [f"BEST {sort_by}", "AT"] if sort_by else []
    table(["RUN", "CHECKPOINTS", "LATEST", "VERIFIED", "SIZE", *best, "CREATED", "AGE"],
          [[d["name"], d["checkpoints"], d["latest_step"], d["latest_verified_step"], human_bytes(d["total_bytes"]),
            *([_number(d["best"]["value"]), d["best"]["step"]] if sort_by else []),
            format_time(_time(d["created_at"])), format_age(_time(d["created_at"]))] for d in docs])


def search_runs(state: State, where: Sequence[str], sort: str | None, columns: str | None, *, as_json: bool) -> None:
    """``runs --where/--sort/--columns``: one search, a run per row, a column per field."""
    found = state.registry().search_runs(list(where), sort=sort, columns=columns)
    if as_json:
        emit_json([f.to_json() for f in found])
        return
    from registry.format.search import parse_search
    fields = [f.spec for f in parse_search(list(where), sort, columns).columns]
    table(["RUN", *fields], [[f.name, *(_cell(f.values.get(k)) for k in fields)] for f in found])


def _cell(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.6g}"
    return json.dumps(value)


def _number(value: float | None) -> str | None:
    return None if value is None else f"{value:.6g}"


def _time(iso: str | None) -> Any:
    from datetime import datetime
    return datetime.fromisoformat(iso) if iso else None


@click.command("ls")
@click.argument("run")
@click.option("--all", "include_deleted", is_flag=True, help="Include deleted and failed steps.")
@click.option("--policy-version", type=Count(minimum=0), default=None,
              help="Only steps with this policy version.")
@json_option
@click.pass_obj
@command
def ls(state: State, run: str, include_deleted: bool, policy_version: int | None, as_json: bool) -> None:
    """List the checkpoints of RUN, oldest first, with their tags and metrics.

    \b
    Examples:
        registry ls demo
        registry ls demo --all --json
    """
    from registry.views import checkpoints_doc, format_age, format_time
    infos = state.registry().checkpoints(run, include_deleted=include_deleted, policy_version=policy_version)
    if as_json:
        emit_json(checkpoints_doc(infos))
        return
    policy = any(i.policy_version is not None for i in infos)  # a column nobody's training sets is left out
    table(["STEP", "STATUS", *(["POLICY"] if policy else []), "SIZE", "TAGS", "CREATED", "AGE", "METRICS"],
          [[i.step, i.status, *([i.policy_version] if policy else []), human_bytes(i.total_bytes), ",".join(i.tags),
            format_time(i.created_at), format_age(i.created_at),
            " ".join(f"{k}={v:.4g}" for k, v in sorted(i.metrics.items()))] for i in infos])


@click.command()
@click.argument("ref")
@json_option
@click.pass_obj
@command
def show(state: State, ref: str, as_json: bool) -> None:
    """Show one checkpoint: status, sizes, metrics, tags, files and events.

    A deleted, failed or staging step (named by its number) is shown too,
    marked as such, with the event that ended it.

    \b
    Examples:
        registry show demo@latest
        registry show demo@best:eval/loss --json
    """
    from registry.views import code_summary, format_time, step_view
    reg = state.registry()
    view = step_view(reg, ref)
    notes, params, attempt = view.tag_notes, view.params, view.attempt
    if as_json:
        emit_json(view.to_json())
        return
    info, files, events, ended, manifest = view.info, view.files, view.events, view.ended, view.manifest
    shared = view.shared_bytes
    marked = info.status.upper() if info.status in NO_PAYLOAD else info.status
    click.echo(f"{info.run}@{info.step}  {marked}  {human_bytes(info.total_bytes)}")
    if ended is not None:
        click.echo(f"ended:    {ended.kind} at {format_time(ended.created_at)} by {ended.actor or '-'}  "
                   f"{json.dumps(ended.detail, sort_keys=True)}")
    if "error" in manifest:
        click.echo(f"manifest: unreadable: {manifest['error']}")
    else:
        click.echo(f"manifest: format {manifest['format_version']}, {manifest['tensors']} tensors, "
                   f"{manifest['files']} files, created {manifest['created_at']} (writer's local time; "
                   "the manifest records no zone)")
        if manifest.get("layout"):
            layout = manifest["layout"]
            per_rank = sorted(set(layout["files_per_rank"]))
            click.echo(f"layout:   {layout['kind']}, world size {layout['world_size']}, "
                       f"{'/'.join(map(str, per_rank))} file(s) per rank, {human_bytes(layout['bytes'])} of shards")
    click.echo(f"path:     {info.url or info.path}")
    for copy in view.copies:  # a root with a durable tier: where each copy is, and whether it is good
        when = f", durable since {format_time(copy.durable_at)}" if copy.durable_at else ""
        click.echo(f"copy:     {copy.location} {copy.status}{when}  {copy.path}")
    click.echo(f"epoch:    {info.epoch}  consumed_samples: {info.consumed_samples}  "
               f"policy_version: {info.policy_version}")
    click.echo(f"tags:     {', '.join(info.tags) or '-'}")
    for name, note in sorted(notes.items()):
        click.echo(f"  {name}: {' '.join(note.split())}")
    if params:
        click.echo(f"params:   {' '.join(f'{k}={_cell(v)}' for k, v in params.items())}")
    if attempt is not None and attempt.environment:
        click.echo(f"code:     {code_summary(attempt.environment)}")
        argv = attempt.environment.get("argv") or []
        if argv:
            click.echo(f"command:  {' '.join(shlex.quote(str(a)) for a in argv)}")
    click.echo(f"metrics:  {', '.join(f'{k}={v:.6g}' for k, v in sorted(info.metrics.items())) or '-'}")
    click.echo(f"created:  {format_time(info.created_at)}  verified: {format_time(info.verified_at)}")
    click.echo(f"manifest: {info.manifest_sha256}")
    if shared:
        click.echo(f"shared:   {human_bytes(shared)} stored once with other steps (hard links, dedup)")
    for f in files:
        click.echo(f"  {f.name:<40} {human_bytes(f.size):>10}  {f.sha256[:16]}")
    for e in events:
        click.echo(f"  {format_time(e.created_at)}  {e.kind:<14} {json.dumps(e.detail, sort_keys=True)}")


@click.command()
@click.argument("ref")
@click.pass_obj
@command
def resolve(state: State, ref: str) -> None:
    """Print the directory that REF names (its s3:// URL on an object-store root).

    \b
    Examples:
        registry resolve demo@release
        cd "$(registry resolve demo@latest)"
    """
    info = state.registry().resolve(ref)
    click.echo(info.url or str(info.path))


@click.command()
@click.argument("target", metavar="REF|RUN")
@click.argument("step_or_name", metavar="[STEP] NAME")
@click.argument("name", required=False, metavar="")
@click.option("--note", default=None, metavar="TEXT",
              help="Say why, kept with the tag ('registry show' prints it). A tag moved without a note loses its "
                   "old one.")
@click.pass_obj
@command
def tag(state: State, target: str, step_or_name: str, name: str | None, note: str | None) -> None:
    """Point tag NAME at the step REF names (tag run@best:eval/loss release), or at RUN STEP.

    The tag moves if it exists.

    \b
    Examples:
        registry tag demo@best:eval/loss release
        registry tag demo 1200 baseline --note "before the lr change"
    """
    if name is not None:
        try:
            step = int(step_or_name)
        except ValueError:
            raise click.BadParameter(f"{step_or_name!r} is not a step number (tag RUN STEP NAME, "
                                     "or tag REF NAME)", param_hint="STEP") from None
    reg = state.registry()
    if name is None:
        name = step_or_name
        info = reg.resolve(target)
        run, step = info.run, info.step
    else:
        run = target
    reg.tag(run, step, name, note=note)
    click.echo(f"{run}@{name} -> {step}")


@click.command()
@click.argument("run")
@click.argument("name")
@click.pass_obj
@command
def untag(state: State, run: str, name: str) -> None:
    """Remove tag NAME from RUN.

    \b
    Example:
        registry untag demo baseline
    """
    state.registry().untag(run, name)
    click.echo(f"removed {run}@{name}")


@click.command()
@click.argument("run")
@click.option("--key", default=None, help="Only this metric (with --plot: the one drawn; default eval/loss or the "
                                          "first key).")
@click.option("--history", is_flag=True, help="Include superseded points.")
@click.option("--plot", is_flag=True, help="Draw the curve in the terminal with every checkpoint marked on it.")
@click.option("--wide", is_flag=True, help="One row per step, one column per key.")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV (for spreadsheets); with --wide, steps x keys.")
@click.option("--tensorboard", "tensorboard_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              metavar="DIR", help="Write the points as a TensorBoard event file in DIR/RUN, checkpoint steps marked "
                                  "(tensorboard --logdir DIR).")
@click.option("--import-tensorboard", "import_dir", type=click.Path(exists=True, file_okay=False, path_type=str),
              default=None, metavar="DIR", help="Log the scalars of the TensorBoard event files under DIR as "
                                                "RUN's metric points (a subdirectory's path prefixes its tags).")
@json_option
@click.pass_obj
@command
def metrics(state: State, run: str, key: str | None, history: bool, plot: bool, wide: bool, as_csv: bool,
            tensorboard_dir: str | None, import_dir: str | None, as_json: bool) -> None:
    """List or draw (--plot) the metric points of RUN, or move them to or from TensorBoard.

    \b
    Examples:
        registry metrics demo --key eval/loss
        registry metrics demo --wide --csv > metrics.csv
        registry metrics demo --plot
        registry metrics demo --tensorboard tb && tensorboard --logdir tb
        registry metrics demo --import-tensorboard lightning_logs/version_0
    """
    from registry.views import metrics_doc
    if tensorboard_dir is not None or import_dir is not None:
        tensorboard_metrics(state, run, key, tensorboard_dir, import_dir, as_json=as_json,
                            other=[flag for flag, on in (("--history", history), ("--plot", plot), ("--wide", wide),
                                                         ("--csv", as_csv)) if on])
        return
    reg = state.registry()
    if plot:
        plot_metrics(reg, run, key)
        return
    points = reg.metrics(run, key, history=history)
    if key is not None and not points:
        keys = reg.catalog.metric_keys(run)
        if key not in keys:
            raise no_metric_error(run, key, keys)
    if as_json:
        emit_json(metrics_doc(points))
        return
    if wide or as_csv:
        from registry.cli.terminal import to_csv, wide_rows
        header, rows = (wide_rows(points) if wide else
                        (["step", "key", "value"], [[p.step, p.key, p.value] for p in points]))
        if as_csv:
            click.echo(to_csv(header, rows), nl=False)
        else:
            table([h.upper() if h == "step" else h for h in header],
                  [[r[0], *(None if v is None else f"{v:.6g}" for v in r[1:])] for r in rows])
        return
    table(["STEP", "KEY", "VALUE"] + (["CURRENT", "ATTEMPT"] if history else []),
          [[p.step, p.key, f"{p.value:.6g}"] + (["yes" if p.current else "no", p.attempt] if history else [])
           for p in points])


def tensorboard_metrics(state: State, run: str, key: str | None, export_dir: str | None, import_dir: str | None, *,
                        as_json: bool, other: Sequence[str]) -> None:
    """``metrics --tensorboard DIR`` and ``--import-tensorboard DIR``: one of them, alone."""
    if (export_dir is not None and import_dir is not None) or other:
        given = ["--tensorboard"] * (export_dir is not None) + ["--import-tensorboard"] * (import_dir is not None)
        raise click.UsageError(f"{' and '.join(given + list(other))} cannot be combined")
    from registry.integrations.tensorboard import export_tensorboard, import_tensorboard
    reg = state.registry()
    if export_dir is not None:
        written = export_tensorboard(reg, run, export_dir, key=key)
        if as_json:
            emit_json(written.to_json())
            return
        click.echo(f"wrote {written.points} points and {written.checkpoints} checkpoint marks to {written.path}")
        return
    assert import_dir is not None
    imported = import_tensorboard(reg, run, import_dir, key=key)
    if as_json:
        emit_json(imported.to_json())
        return
    click.echo(f"imported {imported.points} points into {run} ({imported.unchanged} already there) "
               f"from {len(imported.keys)} keys")
    for name, why in sorted(imported.skipped.items()):
        click.echo(f"  skipped {name}: {why}")


def no_metric_error(run: str, key: str, keys: Sequence[str]) -> RegistryError:
    """``metrics --key`` (or ``--plot --key``) of a key the run never logged: one line naming those it has."""
    from registry.errors import CheckpointNotFoundError
    from registry.format.refs import did_you_mean
    more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
    has = f"it has {', '.join(keys[:10])}{more}" if keys else "it has no metrics"
    return CheckpointNotFoundError(f"run {run!r} has no metric {key!r} ({has})"
                                   f"{did_you_mean(key, keys, shown='{!r}')}", run=run)


def plot_metrics(reg: Any, run: str, key: str | None) -> None:
    """Draw ``key`` of ``run`` (default ``eval/loss`` or the first key) with its checkpoints marked."""
    from registry.errors import CheckpointNotFoundError
    from registry.cli.terminal import plot
    keys = reg.catalog.metric_keys(run)
    if key is None:
        if not keys:
            raise CheckpointNotFoundError(f"run {run!r} has no metrics to plot")
        key = "eval/loss" if "eval/loss" in keys else keys[0]
    points = reg.metrics(run, key)
    if not points:
        raise no_metric_error(run, key, keys)
    size = shutil.get_terminal_size((100, 30))
    text = plot(points, reg.checkpoints(run, include_deleted=True), run=run, key=key,
                width=max(40, size.columns), height=max(12, min(size.lines - 2, 30)), colour=sys.stdout.isatty())
    click.echo(text)
