"""``registry lineage`` and ``registry diff``: where a checkpoint came from, and what changed.

Each command is one library call of the same name (``Registry.lineage`` or
``Registry.descendants``, ``Registry.diff``).
"""

from __future__ import annotations

import click

from registry.cli.common import State, command, emit_json, fail, json_option, table


@click.command()
@click.argument("ref")
@click.option("--descendants", is_flag=True, help="List the steps forked from REF instead of its ancestors.")
@click.option("--all", "include_resumes", is_flag=True,
              help="With --descendants: also the steps that resumed from REF.")
@json_option
@click.pass_obj
@command
def lineage(state: State, ref: str, descendants: bool, include_resumes: bool, as_json: bool) -> None:
    """Show where REF came from, hop by hop up to its root (resumes, forks, imports).

    A numbered ref names deleted steps too: their history stays.

    \b
    Examples:
        registry lineage demo-ft@latest
        registry lineage demo@500 --descendants --all
    """
    reg = state.registry()
    hops = (reg.descendants(ref, forks_only=not include_resumes) if descendants else reg.lineage(ref))
    if as_json:
        emit_json([h.to_json() for h in hops])
        return
    from registry.views import LINEAGE_HEADERS, lineage_rows
    table(LINEAGE_HEADERS, lineage_rows(hops))


@click.command()
@click.argument("ref_a")
@click.argument("ref_b")
@click.option("--values", is_flag=True,
              help="For changed tensors of the same shape (content or dtype), also the max absolute and "
                   "relative L2 difference (reads those tensors whole).")
@json_option
@click.pass_obj
@command
def diff(state: State, ref_a: str, ref_b: str, values: bool, as_json: bool) -> None:
    """List what changed from REF_A to REF_B: tensors, non-tensor values, files, config and metrics.

    Exits 1 when some part could not be compared (listed as "not compared"):
    the steps are then not known to be identical.

    \b
    Examples:
        registry diff demo@500 demo@latest
        registry diff demo@release demo-ft@latest --values --json
    """
    from registry.ops.diff import render
    result = state.registry().diff(ref_a, ref_b, values=values)
    if as_json:
        emit_json(result.to_json())
    else:
        for line in render(result):
            click.echo(line)
    if result.not_compared:
        fail(f"{len(result.not_compared)} part(s) of {ref_a} and {ref_b} could not be compared: "
             + "; ".join(n.what for n in result.not_compared))
