"""``registry``: the command line. Every command is one library call of the same name.

Exit status: 0 on success, 1 with a one-line message on a registry error,
2 on a usage error (click's own).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from registry.cli_types import Count, Size
from registry.errors import RegistryError
from registry.ops.policies import PolicyOptionError, build_policy
from registry.records import NO_PAYLOAD, human_bytes
from registry.terminal import plural

F = TypeVar("F", bound=Callable[..., Any])


CREATORS = frozenset({"import", "db"})  # may create the root and the catalog; other commands need them to exist


class State:
    def __init__(self, url: str | None, root: str | None, *, command: str | None = None,
                 read_only: bool = False, quiet: bool = False) -> None:
        self.url = url
        self.quiet = quiet
        self.root = root
        self.command = command
        self.read_only = read_only
        self._registry: Any = None

    def registry(self, *, migrate: bool = True, rebind_root: bool = False) -> Any:
        if self._registry is None:
            from registry.api import Registry
            self._registry = Registry.open(url=self.url, root=self.root, migrate=migrate,
                                           create=self.command in CREATORS, read_only=self.read_only,
                                           rebind_root=rebind_root)
        return self._registry

    def progress(self, as_json: bool) -> Any:
        """Progress bars on stderr for long work: on a terminal only, never with --json or --quiet."""
        from registry.terminal import progress_bar
        return progress_bar(enabled=not (as_json or self.quiet))

    def close(self) -> None:
        if self._registry is not None:
            self._registry.close()


def command(fn: F) -> F:
    """Turn every failure that is not a bug into one line ``registry: error: ...``.

    A ``RegistryError`` exits 1 (a retention metric nobody logged is a usage
    error: 2); so do a raw ``OSError`` (named by its file and cause) and a
    catalog error that escaped the library (named by its catalog). Hints
    that name a Python argument are shown as the command's flag.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RegistryError as exc:
            from registry.errors import UnknownMetricError
            fail(cli_hints(str(exc)), status=2 if isinstance(exc, UnknownMetricError) else 1)
        except BrokenPipeError:
            # the reader went away (``registry diff A B | head``): nothing to say to it; the shell's usual status
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
            sys.exit(141)
        except OSError as exc:
            fail(os_error_line(exc))
        except Exception as exc:
            import sqlite3

            from sqlalchemy.exc import DBAPIError, SQLAlchemyError
            if not isinstance(exc, (SQLAlchemyError, sqlite3.Error)):
                raise
            cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
            state = next((a for a in args if isinstance(a, State)), None)
            where = catalog_name(state) if state is not None else "catalog"
            fail(f"catalog {where}: {first_line(cause)}")
    return wrapper  # type: ignore[return-value]


def fail(message: str, *, status: int = 1) -> None:
    click.echo(f"registry: error: {message}", err=True)
    sys.exit(status)


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def os_error_line(exc: OSError) -> str:
    """``/path: No space left on device``: the file and the cause, whatever raised it."""
    cause = exc.strerror or first_line(exc)
    if exc.filename is None:
        return cause
    files = str(exc.filename) + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    return f"{files}: {cause}"


def catalog_name(state: State) -> str:
    """The catalog's database file (SQLite) or its URL without the password."""
    from sqlalchemy.engine import make_url

    from registry.api import locations
    url = make_url(locations(state.url, state.root)[1])
    return str(url.database) if url.get_backend_name() == "sqlite" else url.render_as_string(hide_password=True)


def cli_hints(message: str) -> str:
    """A library message with its hints about Python arguments put as this CLI's flags."""
    from registry.retention import MISSING_METRIC_HINT
    flags = {MISSING_METRIC_HINT: "pass --allow-missing-metric (or missing_ok=True to the policy in a --policy "
                                  "file) if that is intended",
             "pass overwrite=True": "pass --overwrite"}
    for python, flag in flags.items():
        message = message.replace(python, flag)
    return message


def stdin_is_terminal() -> bool:
    """Whether a person can answer a question (gc's confirmation): stdin is a terminal, not a pipe or a file."""
    return sys.stdin.isatty()


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


class Main(click.Group):
    """The top group: its options may also follow the subcommand (``registry ls RUN --root /data``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_global_options(args))


GLOBAL_VALUED = ("--url", "--root")
GLOBAL_FLAGS = ("--read-only", "--quiet", "-q")


def hoist_global_options(args: Sequence[str]) -> list[str]:
    """Move the global options found after the subcommand's name to before it; ``--`` ends the search."""
    args = list(args)
    first = next((i for i, a in enumerate(args) if not a.startswith("-")
                  and (i == 0 or args[i - 1] not in GLOBAL_VALUED)), None)
    if first is None:
        return args
    head, rest, tail = args[:first], [], args[first:]
    i = 1
    while i < len(tail):
        arg = tail[i]
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if name in GLOBAL_VALUED and "=" in arg:
            rest.append(arg)
            del tail[i]
        elif arg in GLOBAL_VALUED and i + 1 < len(tail):
            rest.extend(tail[i:i + 2])
            del tail[i:i + 2]
        elif arg in GLOBAL_FLAGS:
            rest.append(arg)
            del tail[i]
        else:
            i += 1
    return head + rest + tail


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("checkpoint-registry")
    except PackageNotFoundError:
        return "unknown (not installed)"


@click.group(cls=Main, epilog="Environment: REGISTRY_URL, REGISTRY_ROOT and REGISTRY_READ_ONLY set the options of the "
             "same names; REGISTRY_UI_TOKEN is registry ui's --token. Global options may follow the command.")
@click.version_option(package_version(), "--version", prog_name="registry", message="%(prog)s %(version)s")
@click.option("--url", envvar="REGISTRY_URL", show_envvar=True,
              help="Catalog URL (default sqlite:///ROOT/.registry/catalog.db, or ROOT/catalog.db where it exists).")
@click.option("--root", envvar="REGISTRY_ROOT", show_envvar=True, type=click.Path(path_type=str),
              help="Checkpoint root (default ./checkpoints); each host passes its own mount of it.")
@click.option("--read-only", is_flag=True, envvar="REGISTRY_READ_ONLY", show_envvar=True,
              help="Open the catalog read-only (automatic for a SQLite catalog this user cannot write); "
                   "loads take no lease.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars (they are drawn only on a terminal anyway).")
@click.pass_context
def main(ctx: click.Context, url: str | None, root: str | None, read_only: bool, quiet: bool) -> None:
    """A checkpoint registry for PyTorch training."""
    state = State(url, root, command=ctx.invoked_subcommand, read_only=read_only, quiet=quiet)
    ctx.obj = state
    ctx.call_on_close(state.close)


@main.group()
def db() -> None:
    """Catalog schema migrations."""


@db.command("upgrade")
@click.pass_obj
@command
def db_upgrade(state: State) -> None:
    """Bring the catalog schema to the newest revision."""
    from registry.api import locations
    from registry.catalog.session import make_engine, upgrade
    from registry.fs.store import Store
    root, url = locations(state.url, state.root)
    Store(root)
    engine = make_engine(url)
    try:
        before, after = upgrade(engine)
    except Exception as exc:
        if isinstance(exc, RegistryError):
            raise
        from registry.errors import CatalogError
        raise CatalogError(f"cannot upgrade catalog: {str(exc).splitlines()[0]}") from None
    finally:
        engine.dispose()
    click.echo(f"upgraded {before or '(empty)'} -> {after}" if before != after else f"already at {after}")


@db.command("current")
@click.pass_obj
@command
def db_current(state: State) -> None:
    """Print the catalog's schema revision and the newest this code knows."""
    from sqlalchemy.exc import OperationalError

    from registry.api import locations
    from registry.catalog.session import current_revision, head_revision, make_engine
    from registry.errors import CatalogError
    engine = make_engine(locations(state.url, state.root)[1], create=False)
    try:
        with engine.connect() as conn:
            revision = current_revision(conn)
    except OperationalError as exc:
        raise CatalogError(f"cannot reach catalog: {str(exc.orig).splitlines()[0]}") from None
    finally:
        engine.dispose()
    head = head_revision()
    click.echo(f"{revision or '(empty)'} (head: {head}{', up to date' if revision == head else ''})")


@db.command("bind-root")
@click.pass_obj
@command
def db_bind_root(state: State) -> None:
    """Bind --root to the catalog even where the checks refuse it (a root restored without .registry/)."""
    reg = state.registry(rebind_root=True)
    click.echo(f"bound {reg.store.root} to {reg.catalog.engine.url.render_as_string(hide_password=True)}")


@main.command()
@click.option("--sort-by", default=None, metavar="METRIC[:max]",
              help="Order runs by their best value of METRIC (lowest first; ':max' for highest), as RUN@best ranks.")
@json_option
@click.pass_obj
@command
def runs(state: State, sort_by: str | None, as_json: bool) -> None:
    """List runs, with when each was created."""
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


def _number(value: float | None) -> str | None:
    return None if value is None else f"{value:.6g}"


def _time(iso: str | None) -> Any:
    from datetime import datetime
    return datetime.fromisoformat(iso) if iso else None


@main.command("ls")
@click.argument("run")
@click.option("--all", "include_deleted", is_flag=True, help="Include deleted and failed steps.")
@click.option("--policy-version", type=Count(minimum=0), default=None,
              help="Only steps with this policy version.")
@json_option
@click.pass_obj
@command
def ls(state: State, run: str, include_deleted: bool, policy_version: int | None, as_json: bool) -> None:
    """List the checkpoints of RUN, oldest first, with their tags and metrics."""
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


@main.command()
@click.argument("ref")
@json_option
@click.pass_obj
@command
def show(state: State, ref: str, as_json: bool) -> None:
    """Show one checkpoint: status, sizes, metrics, tags, files and events.

    A deleted, failed or staging step (named by its number) is shown too,
    marked as such, with the event that ended it.
    """
    from registry.views import format_time, step_view
    view = step_view(state.registry(), ref)
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
    click.echo(f"path:     {info.path}")
    click.echo(f"epoch:    {info.epoch}  consumed_samples: {info.consumed_samples}  "
               f"policy_version: {info.policy_version}")
    click.echo(f"tags:     {', '.join(info.tags) or '-'}")
    click.echo(f"metrics:  {', '.join(f'{k}={v:.6g}' for k, v in sorted(info.metrics.items())) or '-'}")
    click.echo(f"created:  {format_time(info.created_at)}  verified: {format_time(info.verified_at)}")
    click.echo(f"manifest: {info.manifest_sha256}")
    if shared:
        click.echo(f"shared:   {human_bytes(shared)} stored once with other steps (hard links, dedup)")
    for f in files:
        click.echo(f"  {f.name:<40} {human_bytes(f.size):>10}  {f.sha256[:16]}")
    for e in events:
        click.echo(f"  {format_time(e.created_at)}  {e.kind:<14} {json.dumps(e.detail, sort_keys=True)}")


@main.command()
@click.argument("ref")
@click.pass_obj
@command
def resolve(state: State, ref: str) -> None:
    """Print the directory that REF names."""
    click.echo(str(state.registry().resolve(ref).path))


@main.command()
@click.argument("target", metavar="REF|RUN")
@click.argument("step_or_name", metavar="[STEP] NAME")
@click.argument("name", required=False, metavar="")
@click.pass_obj
@command
def tag(state: State, target: str, step_or_name: str, name: str | None) -> None:
    """Point tag NAME at the step REF names (tag run@best:eval/loss release), or at RUN STEP.

    The tag moves if it exists.
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
    reg.tag(run, step, name)
    click.echo(f"{run}@{name} -> {step}")


@main.command()
@click.argument("run")
@click.argument("name")
@click.pass_obj
@command
def untag(state: State, run: str, name: str) -> None:
    """Remove tag NAME from RUN."""
    state.registry().untag(run, name)
    click.echo(f"removed {run}@{name}")


@main.command()
@click.argument("run")
@click.option("--key", default=None, help="Only this metric (with --plot: the one drawn; default eval/loss or the "
                                          "first key).")
@click.option("--history", is_flag=True, help="Include superseded points.")
@click.option("--plot", is_flag=True, help="Draw the curve in the terminal with every checkpoint marked on it.")
@click.option("--wide", is_flag=True, help="One row per step, one column per key.")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV (for spreadsheets); with --wide, steps x keys.")
@json_option
@click.pass_obj
@command
def metrics(state: State, run: str, key: str | None, history: bool, plot: bool, wide: bool, as_csv: bool,
            as_json: bool) -> None:
    """List the metric points of RUN, or draw them (--plot)."""
    from registry.views import metrics_doc
    reg = state.registry()
    if plot:
        from registry.cli_ui import plot_metrics
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
        from registry.terminal import to_csv, wide_rows
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


def no_metric_error(run: str, key: str, keys: Sequence[str]) -> RegistryError:
    """``metrics --key`` (or ``--plot --key``) of a key the run never logged: one line naming those it has."""
    from registry.errors import CheckpointNotFoundError
    from registry.format.refs import did_you_mean
    more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
    has = f"it has {', '.join(keys[:10])}{more}" if keys else "it has no metrics"
    return CheckpointNotFoundError(f"run {run!r} has no metric {key!r} ({has})"
                                   f"{did_you_mean(key, keys, shown='{!r}')}", run=run)


@main.command()
@click.argument("targets", nargs=-1, required=True)
@json_option
@click.pass_obj
@command
def verify(state: State, targets: tuple[str, ...], as_json: bool) -> None:
    """Re-hash checkpoints (every live step of a RUN, or one REF); exit 1 unless every one is verified."""
    with state.progress(as_json) as bar:
        results = state.registry().verify(*targets, progress=bar)
    if as_json:
        from registry.views import verify_doc
        emit_json(verify_doc(results))
    else:
        table(["RUN", "STEP", "RESULT", "PROBLEMS"],
              [[r.run, r.step, "ok" if r.ok else r.status.upper(), "; ".join(r.problems)] for r in results])
    if not all(r.ok for r in results):
        sys.exit(1)


# ---------------------------------------------------------------------- gc

@main.command()
@click.argument("run")
@click.option("--keep-last", type=Count(minimum=1), default=None, metavar="N",
              help="Keep the N newest loadable steps.")
@click.option("--keep-best", multiple=True, metavar="METRIC[:max]=K",
              help="Keep the K best steps by METRIC (lowest; ':max' for highest). Repeatable.")
@click.option("--keep-every", type=Count(minimum=1), default=None, metavar="N",
              help="Keep steps that are a multiple of N.")
@click.option("--max-bytes", type=Size(), default=None, metavar="SIZE",
              help="Byte budget (e.g. 50G): of what the other options keep (or of every step), "
                   "drop the oldest until the run fits.")
@click.option("--policy", "policy_file", type=click.Path(exists=True, dir_okay=False), default=None,
              metavar="FILE.py", help="A Python file that defines 'policy = ...'.")
@click.option("--allow-missing-metric", is_flag=True,
              help="Let a --keep-best metric that no checkpoint of RUN has keep nothing (default: refuse, "
                   "exit 2: a typo there would delete the real best).")
@click.option("--release-fork-parents", is_flag=True,
              help="Let the policy delete steps that live forks name as their parent (default: keep them).")
@click.option("--dry-run", is_flag=True, help="Print the plan; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking (on a terminal gc shows the plan and asks "
                                                "first; scripts and --json are never asked).")
@json_option
@click.pass_obj
@command
def gc(state: State, run: str, keep_last: int | None, keep_best: tuple[str, ...], keep_every: int | None,
       max_bytes: int | None, policy_file: str | None, allow_missing_metric: bool, release_fork_parents: bool,
       dry_run: bool, yes: bool, as_json: bool) -> None:
    """Delete the checkpoints of RUN that no policy keeps.

    Options combine: a step is kept if any of them keeps it. Whatever they
    say, @latest, @latest-published, tagged, staging and leased steps stay.
    On a terminal the plan is shown and gc asks before deleting (--yes does not ask).
    """
    try:
        policy = build_policy(keep_last=keep_last, keep_best=keep_best, keep_every=keep_every,
                              max_bytes=max_bytes, policy_file=policy_file)
    except PolicyOptionError as exc:
        raise click.BadParameter(str(exc), param_hint="--" + exc.option.replace("_", "-")) from None
    if policy is None:
        raise click.UsageError("say what to keep: --keep-last, --keep-best, --keep-every, --max-bytes "
                               "or --policy (gc never guesses)")
    plan = state.registry().plan_retention(run, policy, allow_missing_metrics=allow_missing_metric,
                                           keep_fork_parents=not release_fork_parents)
    from registry.views import gc_doc, plan_shared_bytes
    shared = plan_shared_bytes(plan)
    if not as_json:
        click.echo(f"{run}: {policy!r}")
        table(["STEP", "STATUS", "ACTION", "SIZE", "REASON"],
              [[d.step, d.status, d.action.upper() if d.action == "delete" else d.action,
                human_bytes(d.total_bytes), "; ".join(d.reasons)] for d in plan.decisions])
        verb = "would delete" if dry_run else "planned to delete"
        click.echo(f"{verb} {len(plan.delete)} of {plural(len(plan.decisions), 'checkpoint')}, "
                   f"{human_bytes(plan.bytes_freed)}; keeping {human_bytes(plan.bytes_kept)}")
        if shared:
            click.echo(f"{human_bytes(shared)} of what they hold is stored once with kept steps (dedup): "
                       "it stays on disk and is not counted as freed")
    asking = bool(plan.delete) and not (dry_run or yes or as_json) and stdin_is_terminal()
    if asking and not click.confirm(f"delete {plural(len(plan.delete), 'checkpoint')} of {run} "
                                    f"({human_bytes(plan.bytes_freed)})?", default=False):
        fail("nothing deleted")
    with state.progress(as_json) as bar:
        result = None if dry_run else plan.execute(progress=bar)
    if as_json:
        emit_json(gc_doc(plan, dry_run=dry_run, result=result, shared_bytes=shared))
    elif result is not None:
        click.echo(f"deleted {len(result.deleted)} ({human_bytes(result.bytes_freed)} freed)"
                   + (f"; finished {plural(len(result.healed), 'interrupted deletion')}" if result.healed else ""))
        if result.checkouts_removed:
            click.echo(f"removed {plural(len(result.checkouts_removed), 'registry-owned checkout')} whose lease "
                       "had expired")
        for step, why in sorted(result.skipped.items()):
            click.echo(f"skipped {step}: {why}")
        for step, why in sorted(result.errors.items()):
            click.echo(f"error {step}: {why}", err=True)
    if result is not None and result.errors:
        sys.exit(1)



# ---------------------------------------------------------------------- import


@main.command("import")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--run", required=True, help="Run to import into.")
@click.option("--step", required=True, type=Count(minimum=0), help="Step to publish it as.")
@click.option("--move", is_flag=True, help="Move the files (same filesystem) instead of copying them.")
@click.option("--overwrite", is_flag=True, help="Replace an existing step.")
@click.option("--tag", "tags", multiple=True, help="Tag the imported step (repeatable).")
@json_option
@click.pass_obj
@command
def import_(state: State, path: str, run: str, step: int, move: bool, overwrite: bool,
            tags: tuple[str, ...], as_json: bool) -> None:
    """Adopt the checkpoint directory PATH (reference, legacy, Hugging Face or DCP layout) as RUN@STEP."""
    with state.progress(as_json) as bar:
        info = state.registry().import_checkpoint(path, run=run, step=step, move=move, overwrite=overwrite,
                                                  tags=tags, progress=bar)
    if as_json:
        emit_json(info.to_json())
        return
    click.echo(f"{'moved' if move else 'copied'} {path} -> {info.run}@{info.step} "
               f"({info.status}, {human_bytes(info.total_bytes)}) at {info.path}")


# ---------------------------------------------------------------------- fsck


@main.command()
@click.option("--repair", is_flag=True, help="Fix what is found (default: only report).")
@click.option("--checksums", is_flag=True, help="Re-hash every live step, not just sizes and digests.")
@json_option
@click.pass_obj
@command
def fsck(state: State, repair: bool, checksums: bool, as_json: bool) -> None:
    """Reconcile the catalog with the checkpoint root; exit 1 if problems remain unrepaired."""
    from registry.ops.fsck import iter_lines
    with state.progress(as_json) as bar:
        report = state.registry().fsck(repair=repair, checksums=checksums, progress=bar)
    if as_json:
        emit_json(report.to_json())
    else:
        for line in iter_lines(report):
            click.echo(line)
        click.echo(f"{plural(report.rows_checked, 'row')} checked, {plural(len(report.problems), 'problem')}, "
                   f"{len(report.repaired)} repaired, {len(report.in_progress)} in progress")
    if report.unrepaired or report.failures:
        sys.exit(1)


def _register_optional_commands() -> None:
    from registry.cli_ui import ui
    main.add_command(ui)


_register_optional_commands()
import registry.cli_export  # noqa: E402, F401 - registers export and checkout on main (it imports this module)

from registry.cli_lineage import register as _register_lineage  # noqa: E402 - needs the helpers above

_register_lineage(main)

if __name__ == "__main__":  # pragma: no cover
    main()
