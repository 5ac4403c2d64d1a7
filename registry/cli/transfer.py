"""``registry import``, ``export`` and ``checkout``: a directory in, a step out as a plain directory for tools
that want a path.

Each is one library call (:meth:`registry.Registry.import_checkpoint`,
:meth:`registry.Registry.export`, :meth:`registry.Registry.checkout`).
"""

from __future__ import annotations

from datetime import timedelta

import click

from registry.cli.common import State, command, emit_json, json_option
from registry.cli.types import Count, Size
from registry.records import human_bytes

MAX_TTL = 100 * 365 * 86400  # a lease's end must stay a date the catalog can store


@click.command("import")
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
    """Adopt the checkpoint directory PATH (reference, legacy, Hugging Face or DCP layout) as RUN@STEP.

    \b
    Examples:
        registry import ./old-run/checkpoint-500 --run demo --step 500
        registry import /scratch/dcp/step-900 --run demo --step 900 --move --tag imported
    """
    with state.progress(as_json) as bar:
        info = state.registry().import_checkpoint(path, run=run, step=step, move=move, overwrite=overwrite,
                                                  tags=tags, progress=bar)
    if as_json:
        emit_json(info.to_json())
        return
    click.echo(f"{'moved' if move else 'copied'} {path} -> {info.run}@{info.step} "
               f"({info.status}, {human_bytes(info.total_bytes)}) at {info.path}")


@click.command("export")
@click.argument("ref")
@click.argument("dest", type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(["safetensors", "hf"]), default="safetensors", show_default=True,
              help="One model.safetensors, or Hugging Face shards with model.safetensors.index.json.")
@click.option("--max-shard-size", type=Size(minimum=1), default=None,
              help="Largest shard with --format hf, like 500MB or 2GiB (default 5GB).")
@click.option("--overwrite", is_flag=True,
              help="Replace DEST if it is not empty (never inside ROOT or a directory holding it).")
@click.pass_obj
@command
def export(state: State, ref: str, dest: str, fmt: str, max_shard_size: int | None, overwrite: bool) -> None:
    """Write REF's weights and config.json to DEST as a standalone checkpoint (a verified read).

    \b
    Examples:
        registry export demo@release ./release
        registry export demo@latest ./hf --format hf --max-shard-size 2GiB
    """
    done = state.registry().export(ref, dest, format=fmt, max_shard_size=max_shard_size, overwrite=overwrite)
    click.echo(f"{done.run}@{done.step} -> {done.path} ({', '.join(done.files)})")


@click.command("checkout")
@click.argument("ref", required=False)
@click.argument("dest", required=False, type=click.Path(path_type=str))
@click.option("--ttl", type=Count(minimum=1, maximum=MAX_TTL), default=24 * 3600, show_default=True,
              help="Seconds the reader lease protects the step from retention; it then expires by itself, and "
                   "gc or fsck --repair remove a checkout the registry placed.")
@click.option("--no-verify", is_flag=True, help="Copy without checking the files against the manifest.")
@click.option("--link", type=click.Choice(["hardlink", "symlink"]), default=None,
              help="Link the step's files instead of copying them. RISKY: a write into DEST (save_pretrained, "
                   "an editor) then rewrites the registry's own step, and root ignores file modes; a symlink "
                   "also follows an overwrite of the step.")
@click.option("--release", "release", metavar="DIR", type=click.Path(path_type=str), default=None,
              help="End the registry-owned checkout DIR now: release its lease and remove it.")
@click.pass_obj
@command
def checkout(state: State, ref: str | None, dest: str | None, ttl: int, no_verify: bool, link: str | None,
             release: str | None) -> None:
    """Copy REF's verified files into DEST (default: under ROOT/.registry/checkouts/) and print the directory.

    The directory looks like a Hugging Face checkpoint folder and is yours:
    each file is a reflink where the filesystem clones, a checked copy
    otherwise, so writing into it never changes a step. The lease is left to
    expire after --ttl seconds, as this command exits at once; a directory
    under ROOT/.registry/checkouts/ is then removed by gc and fsck --repair,
    or now by 'registry checkout --release DIR'. DEST must be outside ROOT.

    \b
    Examples:
        registry checkout demo@release
        registry checkout demo@latest ./eval-copy --ttl 3600
        DIR=$(registry checkout demo@latest) && python eval.py "$DIR"
        registry checkout --release "$DIR"
    """
    if release is not None:
        if ref is not None or dest is not None:
            raise click.UsageError("--release DIR takes no REF or DEST")
        state.registry().release_checkout(release)
        click.echo(f"released {release}")
        return
    if ref is None:
        raise click.UsageError("missing REF (or --release DIR)")
    reg = state.registry()
    if dest is None and reg.read_only:
        raise click.UsageError("a read-only registry writes nothing into the root: give DEST, a directory "
                               "outside it, for the checkout")
    done = reg.checkout(ref, dest, ttl=timedelta(seconds=ttl), verify=not no_verify, link=link)
    click.echo(str(done.path))
