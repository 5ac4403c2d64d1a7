"""``registry db``, ``verify``, ``gc`` and ``fsck``: the catalog's schema, checking, retention and repair."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from registry.cli.common import State, command, emit_json, fail, json_option, stdin_is_terminal, table
from registry.cli.terminal import plural
from registry.cli.types import Count, Size
from registry.errors import RegistryError
from registry.ops.policies import PolicyOptionError, build_policy
from registry.records import human_bytes


@click.group()
def db() -> None:
    """Catalog schema migrations.

    \b
    Examples:
        registry db upgrade
        registry db current
    """


@db.command("upgrade")
@click.pass_obj
@command
def db_upgrade(state: State) -> None:
    """Bring the catalog schema to the newest revision.

    \b
    Example:
        registry --url postgresql://host/registry db upgrade
    """
    from registry.api import locations
    from registry.catalog.session import make_engine, upgrade
    from registry.fs.store import Store
    root, url = locations(state.url, state.root)
    if isinstance(root, Path):  # an s3:// root's bucket is the operator's to create
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
    """Print the catalog's schema revision and the newest this code knows.

    \b
    Example:
        registry db current
    """
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
    """Bind --root to the catalog even where the checks refuse it (a root restored without .registry/).

    \b
    Example:
        registry --root /mnt/restored/ckpt db bind-root
    """
    reg = state.registry(rebind_root=True)
    from registry.catalog.session import safe_url
    click.echo(f"bound {reg.root_url} to {safe_url(reg.catalog.engine.url)}")


@click.command()
@click.argument("targets", nargs=-1, required=True)
@json_option
@click.pass_obj
@command
def verify(state: State, targets: tuple[str, ...], as_json: bool) -> None:
    """Re-hash checkpoints (every live step of a RUN, or one REF); exit 1 unless every one is verified.

    \b
    Examples:
        registry verify demo
        registry verify demo@latest demo@release --json
    """
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


@click.command()
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
@click.option("--tier", type=click.Choice(["fast", "durable"]), default=None,
              help="With --durable: the tier whose copies the policy is for (default: the plan of both, "
                   "the policy applied to the fast tier only).")
@click.option("--force", is_flag=True, help="With --durable: let the fast tier delete copies not yet durable.")
@click.option("--reanchor", is_flag=True, help="First store whole each policy delta step whose chain stays only for "
              "it (registry policy reanchor), so the chain's older steps go too.")
@click.option("--dry-run", is_flag=True, help="Print the plan; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking (on a terminal gc shows the plan and asks "
                                                "first; scripts and --json are never asked).")
@json_option
@click.pass_obj
@command
def gc(state: State, run: str, keep_last: int | None, keep_best: tuple[str, ...], keep_every: int | None,
       max_bytes: int | None, policy_file: str | None, allow_missing_metric: bool, release_fork_parents: bool,
       tier: str | None, force: bool, reanchor: bool, dry_run: bool, yes: bool, as_json: bool) -> None:
    """Delete the checkpoints of RUN that no policy keeps.

    Options combine: a step is kept if any of them keeps it. Whatever they
    say, @latest, @latest-published, tagged, staging and leased steps stay.
    On a terminal the plan is shown and gc asks before deleting (--yes does not ask).

    \b
    Examples:
        registry gc demo --keep-last 3 --dry-run
        registry gc demo --keep-last 2 --keep-best eval/loss=1 --yes
        registry gc demo --max-bytes 50G --policy policy.py
    """
    try:
        policy = build_policy(keep_last=keep_last, keep_best=keep_best, keep_every=keep_every,
                              max_bytes=max_bytes, policy_file=policy_file)
    except PolicyOptionError as exc:
        raise click.BadParameter(str(exc), param_hint="--" + exc.option.replace("_", "-")) from None
    if policy is None:
        raise click.UsageError("say what to keep: --keep-last, --keep-best, --keep-every, --max-bytes "
                               "or --policy (gc never guesses)")
    reg = state.registry()
    if reg.root.can.tiers:
        tier_gc(state, reg, run, policy, tier=tier, force=force, allow_missing_metric=allow_missing_metric,
                keep_fork_parents=not release_fork_parents, reanchor=reanchor, dry_run=dry_run, yes=yes,
                as_json=as_json)
        return
    if tier is not None or force:
        raise click.UsageError("--tier and --force apply to a root with a --durable tier")
    plan = reg.plan_retention(run, policy, allow_missing_metrics=allow_missing_metric,
                              keep_fork_parents=not release_fork_parents, reanchor=reanchor and not dry_run)
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
        _anchorable(plan, reanchor=reanchor, dry_run=dry_run)
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


def _anchorable(plan: Any, *, reanchor: bool, dry_run: bool) -> None:
    """What re-anchoring would free, when the plan keeps chains only for some delta steps."""
    if plan.anchorable:
        steps = ", ".join(str(s) for s in plan.anchorable)
        then = ("gc --reanchor stores those steps whole first, and the chains go" if not reanchor else
                "--reanchor stores them whole first (not on a dry run)" if dry_run else
                "they could not be stored whole (see the log), so their chains stay")
        click.echo(f"the chains of delta steps {steps} stay only for them: {then}")


def tier_gc(state: State, reg: Any, run: str, policy: Any, *, tier: str | None, force: bool,
            allow_missing_metric: bool, keep_fork_parents: bool, reanchor: bool, dry_run: bool, yes: bool,
            as_json: bool) -> None:
    """``gc`` on a root with a durable tier: the plan of each tier shown, the policy's tier executed."""
    chosen = tier or "fast"
    plans = {t: reg.plan_tier_retention(run, policy, tier=t, force=force, allow_missing_metrics=allow_missing_metric,
                                        keep_fork_parents=keep_fork_parents,
                                        reanchor=reanchor and not dry_run and t == chosen)
             for t in ((chosen,) if tier is not None else ("fast", "durable"))}
    if not as_json:
        for name, plan in plans.items():
            shown = "" if name == chosen else " (shown only: pass --tier durable to apply)"
            click.echo(f"{run} ({name} tier): {policy!r}{shown}")
            table(["STEP", "ACTION", "SIZE", "REASON"],
                  [[d.step, (d.action.upper() if d.action == "delete" else d.action)
                    + (" (last copy)" if d.ends_step else ""), human_bytes(d.total_bytes), "; ".join(d.reasons)]
                   for d in plan.decisions])
            _anchorable(plan, reanchor=reanchor, dry_run=dry_run or name != chosen)
    plan = plans[chosen]
    if not dry_run and plan.delete and not (yes or as_json) and stdin_is_terminal() and not click.confirm(
            f"delete {plural(len(plan.delete), 'copy', 'copies')} on the {chosen} tier?", default=False):
        fail("nothing deleted")
    with state.progress(as_json) as bar:
        result = None if dry_run else plan.execute(progress=bar)
    if as_json:  # as plain gc's: the plans, then what executing the chosen one did (None for a dry run)
        emit_json({"run": run, "tiers": [p.to_json() for p in plans.values()], "dry_run": dry_run,
                   "executed": chosen, "result": result.to_json() if result is not None else None})
    if result is None:
        return
    if not as_json:
        click.echo(f"deleted {len(result.deleted)} {chosen} copies ({human_bytes(result.bytes_freed)}), "
                   f"ended {plural(len(result.ended), 'step')}"
                   + (f"; finished {plural(len(result.healed), 'interrupted deletion')}" if result.healed else ""))
        if result.checkouts_removed:
            click.echo(f"removed {plural(len(result.checkouts_removed), 'registry-owned checkout')} whose lease "
                       "had expired")
        for step, why in sorted(result.skipped.items()):
            click.echo(f"skipped {step}: {why}")
        for step, why in sorted(result.errors.items()):
            click.echo(f"error {step}: {why}", err=True)
    if result.errors:
        sys.exit(1)


@click.command()
@click.option("--repair", is_flag=True, help="Fix what is found (default: only report).")
@click.option("--checksums", is_flag=True, help="Re-hash every live step, not just sizes and digests.")
@json_option
@click.pass_obj
@command
def fsck(state: State, repair: bool, checksums: bool, as_json: bool) -> None:
    """Reconcile the catalog with the checkpoint root; exit 1 if problems remain unrepaired.

    \b
    Examples:
        registry fsck
        registry fsck --repair --checksums
    """
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


@click.command()
@click.argument("run", required=False)
@click.option("--wait", is_flag=True, help="While the durable tier fails, retry with backoff until the queue drains.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
@click.pass_obj
@command
def replicate(state: State, run: str | None, wait: bool, timeout: float | None) -> None:
    """Copy the steps still only on this fast root (of RUN, or of every run) to its --durable tier.

    Publishes replicate in the background; this drains what a killed trainer,
    or a durable tier that was down, left in the queue. Each copy is checked
    against its manifest while it is uploaded.

    \b
    Examples:
        registry --root /nvme/ckpt --durable s3://bucket/ckpt replicate
        registry --root /nvme/ckpt --durable s3://bucket/ckpt replicate demo --wait --timeout 600
    """
    reg = state.registry()
    done = reg.replicate(run, wait=wait, timeout=timeout)
    left = len(reg.replication_queue(run))
    click.echo(f"replicated {plural(done, 'step')}; {plural(left, 'step')} of this root still queued")
