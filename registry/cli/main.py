"""``registry``: the command line. Every command is one library call of the same name.

The top group and its global options, and the one list that registers every command.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping, Sequence

import click

from registry.cli.common import State

# Every command, registered here and nowhere else (docs/reference/cli.md is written from this list, in this order): its
# name, and the module and attribute that define it. A module is imported when one of its commands is first
# looked up, to run it or to list it in --help: ``registry ls`` imports the reading commands' module alone.
COMMAND_HOMES: dict[str, str] = {
    "runs": "registry.cli.runs:runs", "ls": "registry.cli.runs:ls", "show": "registry.cli.runs:show",
    "resolve": "registry.cli.runs:resolve", "tag": "registry.cli.runs:tag", "untag": "registry.cli.runs:untag",
    "metrics": "registry.cli.runs:metrics",
    "db": "registry.cli.maintenance:db", "verify": "registry.cli.maintenance:verify",
    "gc": "registry.cli.maintenance:gc", "fsck": "registry.cli.maintenance:fsck",
    "replicate": "registry.cli.maintenance:replicate",
    "import": "registry.cli.transfer:import_", "export": "registry.cli.transfer:export",
    "checkout": "registry.cli.transfer:checkout",
    "lineage": "registry.cli.lineage:lineage", "diff": "registry.cli.lineage:diff",
    "ui": "registry.cli.ui:ui",
    "hooks": "registry.cli.hooks:hooks",
    "mirror": "registry.cli.mirror:mirror",
    "policy": "registry.cli.policy:policy",
}


class Commands(MutableMapping[str, click.Command]):
    """The top group's commands by name (click's ``Group.commands``), each imported from its home in
    :data:`COMMAND_HOMES` on first lookup. Listing the names (``--help``'s order, "did you mean") imports
    nothing; a command added with ``add_command`` is kept as given."""

    def __init__(self, homes: dict[str, str]) -> None:
        self._entries: dict[str, click.Command | str] = dict(homes)

    def __getitem__(self, name: str) -> click.Command:
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            entry = self._entries[name] = getattr(importlib.import_module(module), attribute)
        return entry

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._entries[name] = command

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


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


@click.group(cls=Main, commands=Commands(COMMAND_HOMES),
             epilog="Environment: REGISTRY_URL, REGISTRY_ROOT, REGISTRY_DURABLE and REGISTRY_READ_ONLY set "
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


def __getattr__(name: str) -> tuple[click.Command, ...]:
    # COMMANDS: every command, in COMMAND_HOMES's order, each module imported (for docs/reference/cli.md and the tests)
    if name == "COMMANDS":
        return tuple(main.commands[command] for command in COMMAND_HOMES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # pragma: no cover
    main()
