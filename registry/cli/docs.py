"""docs/reference/cli.md, written from the command list: every command's ``--help``, in the order ``main`` registers
them.

``python -m registry.cli.docs > docs/reference/cli.md`` rewrites it; ``tests/test_cli_docs.py`` fails while it is stale.
"""

from __future__ import annotations

from collections.abc import Iterator

import click

from registry.cli.main import COMMANDS, main

WIDTH = 100  # help is wrapped to a fixed width here, whatever the terminal that runs this is

HEADER = """# Command line reference

Every command's `--help`, generated from the command list in `registry/cli/main.py` by
`python -m registry.cli.docs > docs/reference/cli.md` (`tests/test_cli_docs.py` fails while this page is stale). The
README's [command line at a glance](../../README.md#command-line-at-a-glance) is the overview.
"""


def walk() -> Iterator[tuple[click.Context, click.Command]]:
    """Each command with the context it is shown in: the top group, then every command and subcommand."""
    top = click.Context(main, info_name="registry", terminal_width=WIDTH, max_content_width=WIDTH)
    yield top, main
    pending = [(top, command) for command in COMMANDS]
    while pending:
        parent, command = pending.pop(0)
        ctx = click.Context(command, info_name=command.name, parent=parent)
        yield ctx, command
        if isinstance(command, click.Group):
            pending[:0] = [(ctx, sub) for sub in command.commands.values()]


def render() -> str:
    sections = [HEADER]
    for ctx, command in walk():
        sections.append(f"## {ctx.command_path}\n\n```\n{command.get_help(ctx)}\n```\n")
    return "\n".join(sections)


if __name__ == "__main__":  # pragma: no cover
    click.echo(render(), nl=False)
