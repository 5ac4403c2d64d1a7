"""``registry policy``: a run's policy versions, the consumers that serve them, and their lag.

Each subcommand is one library call: ``Registry.policy_versions``,
``policy_lag``, ``loads``, ``materialize`` and ``prune_policy_loads``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from registry.cli.common import State, command, emit_json, fail, json_option, table

if TYPE_CHECKING:
    from registry.records import PolicyLag


@click.group()
def policy() -> None:
    """The RL policy channel: versions of a run's policy, and the consumers (rollout workers) that load them.

    \b
    Examples:
        registry policy ls demo
        registry policy lag demo
        registry policy consumers demo --json
        registry policy who demo@pv:12
        registry policy pull demo@latest-policy /tmp/policy
        registry policy prune demo --older-than-days 7
    """


@policy.command("ls")
@click.argument("run")
@json_option
@click.pass_obj
@command
def policy_ls(state: State, run: str, as_json: bool) -> None:
    """List RUN's policy versions: step, kind (full, delta, marker), base step, size and status.

    \b
    Example:
        registry policy ls demo
    """
    found = state.registry().policy_versions(run)
    if as_json:
        emit_json([v.to_json() for v in found])
        return
    from registry.records import human_bytes
    table(["VERSION", "STEP", "KIND", "BASE STEP", "SIZE", "STATUS"],
          [[v.version, "-" if v.step is None else v.step, v.storage, "-" if v.base_step is None else v.base_step,
            "-" if v.kind == "marker" else human_bytes(v.total_bytes), v.status] for v in found])


def _consumer_rows(lag: PolicyLag) -> list[list[object]]:
    from registry.views import format_time
    return [[c.name, c.host, "-" if c.pid is None else c.pid, "-" if c.applied_version is None else c.applied_version,
             "-" if c.lag is None else c.lag, format_time(c.heartbeat_at),
             "ended" if c.ended_at is not None else ("live" if c.live else "expired")] for c in lag.consumers]


CONSUMER_HEADERS = ["CONSUMER", "HOST", "PID", "SERVES", "LAG", "HEARTBEAT", "STATE"]


@policy.command("lag")
@click.argument("run")
@json_option
@click.pass_obj
@command
def policy_lag(state: State, run: str, as_json: bool) -> None:
    """Show how far RUN's live consumers lag behind its newest verified policy version.

    A live consumer that serves nothing yet is listed as pending.

    \b
    Example:
        registry policy lag demo
    """
    lag = state.registry().policy_lag(run)
    if as_json:
        emit_json(lag.to_json())
        return
    live = [c for c in lag.consumers if c.live]
    newest = "-" if lag.newest_version is None else lag.newest_version
    oldest = "-" if lag.oldest_applied is None else lag.oldest_applied
    click.echo(f"newest version {newest}, oldest served {oldest}, lag {lag.lag} "
               f"({len(live)} live consumer(s)" + (f", pending: {', '.join(lag.pending)})" if lag.pending else ")"))


@policy.command("consumers")
@click.argument("run")
@json_option
@click.pass_obj
@command
def policy_consumers(state: State, run: str, as_json: bool) -> None:
    """List RUN's consumers: host, process, the version each serves, its lag and whether it is live.

    \b
    Example:
        registry policy consumers demo
    """
    lag = state.registry().policy_lag(run)
    if as_json:
        emit_json([c.to_json() for c in lag.consumers])
        return
    table(CONSUMER_HEADERS, _consumer_rows(lag))


@policy.command("who")
@click.argument("ref")
@click.option("--version", "version", type=int, default=None, metavar="N",
              help="The policy version, when REF is a bare RUN.")
@json_option
@click.pass_obj
@command
def policy_who(state: State, ref: str, version: int | None, as_json: bool) -> None:
    """List the consumers that loaded (and applied) a policy version: REF is RUN@pv:N, or RUN with --version N.

    \b
    Examples:
        registry policy who demo@pv:12
        registry policy who demo --version 12 --json
    """
    from registry.format.refs import parse_ref
    parsed = parse_ref(ref)
    if "@" in ref:
        if version is not None:
            fail("give the version once: RUN@pv:N or RUN --version N", status=2)
        pv = getattr(parsed, "version", None) if parsed.kind == "pv" else None
        if pv is None:
            fail(f"{ref}: name a policy version as RUN@pv:N (or RUN --version N)", status=2)
        version = pv
    elif version is None:
        fail("which version? RUN@pv:N or RUN --version N", status=2)
    found = state.registry().loads(parsed.run, version)
    if as_json:
        emit_json([x.to_json() for x in found])
        return
    from registry.records import human_bytes
    from registry.views import format_time
    table(["CONSUMER", "HOST", "STEP", "SOURCE", "FETCHED", "VERIFIED", "APPLIED", "RELEASED"],
          [[x.consumer, x.host, "marker" if x.step is None else x.step, x.source or "-", human_bytes(x.bytes_fetched),
            "-" if x.step is None else ("yes" if x.verified else ("no: " + x.error if x.error else "no")),
            format_time(x.applied_at), format_time(x.released_at)] for x in found])


@policy.command("pull")
@click.argument("ref")
@click.argument("dest", type=click.Path(path_type=str))
@click.pass_obj
@command
def policy_pull(state: State, ref: str, dest: str) -> None:
    """Write the full weights of the policy version REF names into DEST, checked against its digest.

    \b
    Examples:
        registry policy pull demo@pv:12 /tmp/policy-12
        registry policy pull demo@latest-policy ./policy
    """
    from pathlib import Path
    path = state.registry().materialize(ref, Path(dest))
    click.echo(str(path))


@policy.command("reanchor")
@click.argument("run")
@click.argument("version", type=int)
@json_option
@click.pass_obj
@command
def policy_reanchor(state: State, run: str, version: int, as_json: bool) -> None:
    """Store policy VERSION of RUN whole beside its delta step, so it reads without its chain.

    The very model.safetensors a full publish writes, checked against the version's digest and read back;
    the step itself is untouched (tags, metrics, leases). Retention may then delete the chain's older steps
    (gc --reanchor does this for every delta step whose chain stays only for it).

    \b
    Example:
        registry policy reanchor demo 12
    """
    from dataclasses import asdict

    from registry.records import human_bytes
    got = state.registry().reanchor(run, version)
    if as_json:
        emit_json({k: (str(v) if v is not None and k == "path" else v) for k, v in asdict(got).items()})
    else:
        click.echo(f"{run}@pv:{version} (step {got.step}) stored whole at {got.url} ({human_bytes(got.size)})")


@policy.command("prune")
@click.argument("run", required=False)
@click.option("--older-than-days", "days", type=float, default=30.0, show_default=True,
              help="Forget loads released (or whose consumer ended or expired) more than this many days ago.")
@json_option
@click.pass_obj
@command
def policy_prune(state: State, run: str | None, days: float, as_json: bool) -> None:
    """Forget old policy loads of RUN (or of every run) from the audit log.

    Only loads that protect nothing: never an unreleased load of a live consumer, nor the load of the version
    a consumer serves. A process with subscriptions does this itself at most once an hour, for 30 days.

    \b
    Example:
        registry policy prune demo --older-than-days 7
    """
    from datetime import timedelta
    if not days >= 0:
        raise click.BadParameter(f"must be >= 0, got {days!r}", param_hint="--older-than-days")
    forgotten = state.registry().prune_policy_loads(run, older_than=timedelta(days=days))
    if as_json:
        emit_json({"forgotten": forgotten})
    else:
        click.echo(f"forgot {forgotten} policy loads")
