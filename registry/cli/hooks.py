"""``hooks``: webhooks told of new, verified, condemned, deleted and durable steps and of tag moves."""

from __future__ import annotations

import click

from registry.cli.common import State, command, emit_json, json_option, table
from registry.cli.types import Count

EVENT_HELP = ("An event to send (repeatable; default every one): step.published, step.verified, step.condemned, "
              "step.deleted, step.durable, tag.set, tag.moved, tag.removed.")


@click.group()
def hooks() -> None:
    """Webhooks: POST each event to a URL, signed, at least once and in order per run.

    Events are written to the catalog's outbox in the transaction that
    commits what they report; the publishing process delivers them in the
    background, and 'hooks deliver' delivers what any process left behind.

    \b
    Examples:
        registry hooks add http://127.0.0.1:8080/ckpt --event step.verified --secret S
        registry hooks ls
        registry hooks log --limit 20
        registry hooks deliver --follow
    """


@hooks.command("add")
@click.argument("url")
@click.option("--event", "events", multiple=True, metavar="EVENT", help=EVENT_HELP)
@click.option("--secret", envvar="REGISTRY_WEBHOOK_SECRET", show_envvar=True, default=None,
              help="Sign each request's body with this secret (X-Registry-Signature: sha256=HMAC).")
@click.option("--max-attempts", type=Count(minimum=1), default=8, show_default=True,
              help="Attempts before a delivery is dead-lettered.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="HOST",
              help="Allow this non-loopback host (repeatable; also $REGISTRY_WEBHOOK_ALLOW_HOSTS).")
@json_option
@click.pass_obj
@command
def hooks_add(state: State, url: str, events: tuple[str, ...], secret: str | None, max_attempts: int,
              allow_hosts: tuple[str, ...], as_json: bool) -> None:
    """Send events to URL from now on (only loopback hosts unless allowed).

    \b
    Examples:
        registry hooks add http://127.0.0.1:8080/ckpt --secret S
        registry hooks add https://ci.example.com/hook --allow-host ci.example.com --event tag.moved
    """
    hook = state.registry().add_webhook(url, events or None, secret=secret, max_attempts=max_attempts,
                                        allow_hosts=allow_hosts)
    if as_json:
        emit_json(hook.to_json())
    else:
        click.echo(f"added webhook {hook.id}: {hook.url} ({', '.join(hook.events)})"
                   + ("" if hook.signed else "; requests are not signed (no --secret)"))


@hooks.command("ls")
@json_option
@click.pass_obj
@command
def hooks_ls(state: State, as_json: bool) -> None:
    """List the webhooks, with their pending and dead-lettered deliveries.

    \b
    Example:
        registry hooks ls --json
    """
    found = state.registry().webhooks()
    if as_json:
        emit_json([h.to_json() for h in found])
    else:
        table(["ID", "URL", "EVENTS", "SIGNED", "PENDING", "DEAD"],
              [[h.id, h.url, ",".join(h.events), "yes" if h.signed else "no", h.pending, h.dead] for h in found])


@hooks.command("rm")
@click.argument("webhook_id", metavar="ID", type=int)
@click.pass_obj
@command
def hooks_rm(state: State, webhook_id: int) -> None:
    """Remove webhook ID, with its pending deliveries and its log.

    \b
    Example:
        registry hooks rm 2
    """
    state.registry().remove_webhook(webhook_id)
    click.echo(f"removed webhook {webhook_id}")


@hooks.command("log")
@click.option("--hook", "webhook_id", type=int, default=None, metavar="ID", help="Only this webhook's.")
@click.option("--run", default=None, help="Only this run's events.")
@click.option("--limit", type=Count(minimum=1), default=50, show_default=True, help="The newest N events.")
@json_option
@click.pass_obj
@command
def hooks_log(state: State, webhook_id: int | None, run: str | None, limit: int, as_json: bool) -> None:
    """Show the events owed to webhooks, oldest first: delivered, pending or dead, and the last attempt.

    \b
    Examples:
        registry hooks log --hook 1 --limit 20
        registry hooks log --run demo --json
    """
    entries = state.registry().webhook_log(webhook_id, run=run, limit=limit)
    if as_json:
        emit_json([e.to_json() for e in entries])
        return
    from registry.catalog.outbox import OutboxEntry
    from registry.views import format_time

    def last(entry: OutboxEntry) -> str:
        if not entry.attempts:
            return "-"
        tried = entry.attempts[-1]
        return str(tried.status_code) if tried.error is None else tried.error
    table(["ID", "HOOK", "EVENT", "RUN", "STEP", "STATUS", "TRIES", "LAST", "AT"],
          [[e.id[:12], e.webhook, e.event, e.run, e.step, e.status, len(e.attempts), last(e),
            format_time(e.attempts[-1].at if e.attempts else e.created_at)] for e in entries])


@hooks.command("prune")
@click.option("--older-than-days", "days", type=float, default=30.0, show_default=True,
              help="Forget events finished (delivered or dead-lettered) more than this many days ago.")
@json_option
@click.pass_obj
@command
def hooks_prune(state: State, days: float, as_json: bool) -> None:
    """Forget old delivered and dead-lettered events, with their attempts; pending events stay.

    A deliverer does this itself at most once an hour, for events older than 30 days.

    \b
    Example:
        registry hooks prune --older-than-days 7
    """
    from datetime import timedelta
    if not days >= 0:
        raise click.BadParameter(f"must be >= 0, got {days!r}", param_hint="--older-than-days")
    forgotten = state.registry().prune_webhook_log(older_than=timedelta(days=days))
    if as_json:
        emit_json({"forgotten": forgotten})
    else:
        click.echo(f"forgot {forgotten} finished events")


@hooks.command("deliver")
@click.option("--follow", is_flag=True, help="Keep delivering (for every process) until interrupted.")
@click.option("--max-seconds", type=float, default=None, help="With --follow: stop after this many seconds.")
@click.option("--poll", type=float, default=1.0, show_default=True,
              help="With --follow: ask the outbox for new events at least this often (seconds).")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds per request.")
@click.option("--backoff", type=float, default=1.0, show_default=True,
              help="Seconds before the first retry of a failed delivery, doubled at each retry.")
@click.option("--backoff-max", type=float, default=600.0, show_default=True, help="The longest wait between tries.")
@json_option
@click.pass_obj
@command
def hooks_deliver(state: State, follow: bool, max_seconds: float | None, poll: float, timeout: float,
                  backoff: float, backoff_max: float, as_json: bool) -> None:
    """Deliver the events that are due (once), or with --follow keep delivering.

    \b
    Examples:
        registry hooks deliver
        registry hooks deliver --follow
    """
    from registry.ops.webhooks import WebhookOptions
    reg = state.registry()
    reg.webhook_options = WebhookOptions(timeout=timeout, backoff=backoff, backoff_max=backoff_max, background=False)
    try:
        report = reg.deliver_webhooks(follow=follow, max_seconds=max_seconds, poll=poll)
    except KeyboardInterrupt:  # --follow's way out: what was delivered is in 'hooks log'
        click.echo("stopped", err=True)
        return
    if as_json:
        emit_json(report.to_json())
    else:
        click.echo(f"delivered {report.delivered}, retried {report.retried}, dead-lettered {report.dead}")
