"""Every command documents itself, with an example that runs, and docs/reference/cli.md is what the commands say
today."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from registry.cli import main
from registry.cli.docs import render, walk
from registry.cli.main import COMMANDS, GLOBAL_FLAGS, GLOBAL_VALUED, hoist_global_options

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reference" / "cli.md"
SHOWN = [(ctx.command_path, ctx, command) for ctx, command in walk()]


def test_every_command_is_registered_by_the_one_list() -> None:
    assert len(COMMANDS) == len(set(COMMANDS))
    assert set(main.commands.values()) == set(COMMANDS)


def test_every_command_and_subcommand_is_shown() -> None:
    def all_commands(group: click.Group, path: str) -> set[str]:
        found = set()
        for name, command in group.commands.items():
            found.add(f"{path} {name}")
            if isinstance(command, click.Group):
                found |= all_commands(command, f"{path} {name}")
        return found
    assert {path for path, _, _ in SHOWN} == {"registry"} | all_commands(main, "registry")


def examples(help_text: str) -> list[str]:
    """The lines of the help's ``Example:``/``Examples:`` block, as rendered (not re-wrapped)."""
    lines = help_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() in ("Example:", "Examples:")), None)
    if start is None:
        return []
    block = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        block.append(line.strip())
    return block


def invocation(line: str) -> list[str] | None:
    """The arguments after ``registry`` in an example line (env assignments and shell redirections dropped)."""
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        words.pop(0)
    if not words or words[0] != "registry":
        return None
    words = words[1:]
    cut = next((i for i, w in enumerate(words) if w in (">", "|", "&&", ";")), len(words))
    return words[:cut]


def command_words(args: list[str]) -> list[str]:
    """The command path an invocation names: global options (before or after the command) left out."""
    args, words, i = hoist_global_options(args), [], 0
    while i < len(args):
        if args[i] in GLOBAL_VALUED:
            i += 2
        elif args[i] in GLOBAL_FLAGS or args[i].split("=", 1)[0] in GLOBAL_VALUED:
            i += 1
        else:
            break
    group: click.Command = main
    for arg in args[i:]:
        if not isinstance(group, click.Group) or arg not in group.commands:
            break
        words.append(arg)
        group = group.commands[arg]
    return words


@pytest.mark.parametrize(("path", "ctx", "command"), SHOWN, ids=[path for path, _, _ in SHOWN])
def test_every_command_has_help_and_a_working_example(path: str, ctx: click.Context, command: click.Command) -> None:
    assert command.help and command.help.strip(), f"{path} has no help text"
    assert command.get_short_help_str(), f"{path} has no short help"
    lines = examples(command.get_help(ctx))
    assert lines, f"{path} --help has no 'Example:' or 'Examples:' section (or it was re-wrapped: use \\b)"
    calls = [args for args in map(invocation, lines) if args is not None]
    assert calls, f"{path}'s examples never run registry"
    wanted = path.split()[1:]
    if wanted:
        assert any(command_words(args)[:len(wanted)] == wanted for args in calls), f"no example of {path} runs it"
    for args in calls:
        # --help is eager: the options are parsed (an unknown one fails) but nothing runs
        result = CliRunner().invoke(main, [*args, "--help"])
        assert result.exit_code == 0, f"example 'registry {shlex.join(args)}': {result.output}"


def test_examples_are_checked() -> None:
    """The check above can fail: an example with an option its command does not have is refused."""
    assert command_words(["--root", "x", "db", "upgrade"]) == ["db", "upgrade"]
    assert command_words(["ls", "demo", "--root", "x"]) == ["ls"]
    assert CliRunner().invoke(main, ["gc", "demo", "--keep-lots", "--help"]).exit_code == 2


def test_docs_cli_md_is_current() -> None:
    assert DOCS.read_text() == render(), \
        "docs/reference/cli.md is stale: run python -m registry.cli.docs > docs/reference/cli.md"
