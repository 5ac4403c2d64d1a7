"""``registry``: the command line. Every command is one library call of the same name.

The top group and its global options, and the one list that registers every command.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from registry.cli import lineage, maintenance, runs, transfer, ui
from registry.cli.common import State


class Main(click.Group):
    """The top group: its options may also follow the subcommand (``registry ls RUN --root /data``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_global_options(args))


GLOBAL_VALUED = ("--url", "--root", "--durable")
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


def _print_version(ctx: click.Context) -> None:
    # looked up only when asked: reading the installed metadata costs every other command ~50 ms
    if not ctx.resilient_parsing:
        click.echo(f"registry {package_version()}")
        ctx.exit()


@click.group(cls=Main, epilog="Environment: REGISTRY_URL, REGISTRY_ROOT, REGISTRY_DURABLE and REGISTRY_READ_ONLY set "
             "the options of the "
             "same names; REGISTRY_UI_TOKEN is registry ui's --token. Global options may follow the command.")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=lambda ctx, _, value:
              _print_version(ctx) if value else None, help="Show the version and exit.")
@click.option("--url", envvar="REGISTRY_URL", show_envvar=True,
              help="Catalog URL (default sqlite:///ROOT/.registry/catalog.db, or ROOT/catalog.db where it exists).")
@click.option("--root", envvar="REGISTRY_ROOT", show_envvar=True, type=click.Path(path_type=str),
              help="Checkpoint root (default ./checkpoints); each host passes its own mount of it.")
@click.option("--durable", envvar="REGISTRY_DURABLE", show_envvar=True,
              help="The durable tier (s3://BUCKET/PREFIX) of the --root directory, its fast tier.")
@click.option("--read-only", is_flag=True, envvar="REGISTRY_READ_ONLY", show_envvar=True,
              help="Open the catalog read-only (automatic for a SQLite catalog this user cannot write); "
                   "loads take no lease.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars (they are drawn only on a terminal anyway).")
@click.pass_context
def main(ctx: click.Context, url: str | None, root: str | None, durable: str | None, read_only: bool,
         quiet: bool) -> None:
    """A checkpoint registry for PyTorch training.

    \b
    Examples:
        registry runs
        registry --root /data/ckpt ls demo
        REGISTRY_URL=postgresql://host/db registry show demo@latest
    """
    state = State(url, root, command=ctx.invoked_subcommand, read_only=read_only, quiet=quiet, durable=durable)
    ctx.obj = state
    ctx.call_on_close(state.close)


# Every command, registered here and nowhere else (docs/cli.md is written from this list, in this order).
COMMANDS: tuple[click.Command, ...] = (
    runs.runs, runs.ls, runs.show, runs.resolve, runs.tag, runs.untag, runs.metrics,
    maintenance.db, maintenance.verify, maintenance.gc, maintenance.fsck, maintenance.replicate,
    transfer.import_, transfer.export, transfer.checkout, lineage.lineage, lineage.diff, ui.ui,
)
for command in COMMANDS:
    main.add_command(command)

if __name__ == "__main__":  # pragma: no cover
    main()
