"""Webhook delivery: the checks at the door, the signed request, and the deliverers that drain the outbox.

The outbox is the catalog's (:mod:`registry.catalog.outbox`): a row per event
per webhook, written with what it reports. A :class:`Deliverer` claims the
rows that are due (each run's oldest pending one, under a lease), POSTs each
once and records what came back: a 2xx delivers it; anything else (another
status, a redirect, which is never followed, a refused connection, a timeout)
schedules the next attempt after an exponential backoff, until the
webhook's ``max_attempts`` dead-letter it. Any number of deliverers may run
at once: the publishing process's background thread
(:class:`BackgroundDelivery`, started by the first commit that wrote outbox
rows), ``registry hooks deliver --follow``, another host's.

Each request is ``POST`` of the row's JSON body (``id``, ``event``, ``run``,
``step``, ``tag``, ``digest``, ``status``, ``time``), the same bytes on
every attempt, with ``X-Registry-Event``, ``X-Registry-Delivery`` (the
body's ``id``, for de-duplication) and, for a webhook with a secret,
``X-Registry-Signature: sha256=<hex HMAC-SHA256 of the body>``. The client is
the standard library's, with a short timeout.

Where requests may go is decided when a webhook is added: only loopback
hosts (127.0.0.0/8, ::1, ``localhost``), unless the host is listed in
``$REGISTRY_WEBHOOK_ALLOW_HOSTS`` (comma-separated) or ``allow_hosts=``.
Credentials in a URL (``user:pass@``) are sent as HTTP basic authentication
and never shown: listings, the log, errors and log lines show ``***@``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import unquote, urlsplit

from registry.catalog.outbox import ALL, DEAD, DELIVERED, EVENTS, Claimed, WebhookCatalog, WebhookInfo, shown_url
from registry.catalog.session import Transactions, utcnow
from registry.errors import WebhookError

log = logging.getLogger(__name__)

ALLOW_HOSTS_ENV = "REGISTRY_WEBHOOK_ALLOW_HOSTS"
DEFAULT_MAX_ATTEMPTS = 8
PRUNE_EVERY = 3600.0  # seconds between a deliverer's passes over the log's old events
_RESPONSE_READ = 64 * 1024  # of a receiver's answer, read so the connection ends cleanly; the rest is ignored


@dataclass(frozen=True, kw_only=True)
class WebhookOptions:
    """How a deliverer works: ``timeout`` per request (seconds), the first retry's ``backoff``, doubled on
    each failed attempt up to ``backoff_max``; ``background``: whether a publishing process delivers on a
    thread of its own (off: only ``deliver_webhooks`` and ``registry hooks deliver`` deliver); ``keep_days``:
    how long a delivered or dead-lettered event stays in the log (a deliverer forgets older ones, at most once
    an hour; pending events are never forgotten)."""

    timeout: float = 5.0
    backoff: float = 1.0
    backoff_max: float = 600.0
    background: bool = True
    keep_days: float = 30.0

    def __post_init__(self) -> None:
        if not (self.timeout > 0 and self.backoff >= 0 and self.backoff_max >= self.backoff):
            raise WebhookError(f"webhook options need timeout > 0 and 0 <= backoff <= backoff_max, got {self}")
        if not self.keep_days >= 0:
            raise WebhookError(f"webhook options need keep_days >= 0, got {self.keep_days!r}")

    def retry_in(self, attempt: int) -> timedelta:
        """How long after failed attempt number ``attempt`` (from 1) the next one is due."""
        return timedelta(seconds=min(self.backoff_max, self.backoff * 2 ** min(attempt - 1, 60)))

    @property
    def lease(self) -> timedelta:
        """How long a claim holds a row: past the request's timeout, so a live deliverer never loses it."""
        return timedelta(seconds=2 * self.timeout + 10)


@dataclass(frozen=True, kw_only=True)
class DeliveryReport:
    """What a deliverer did: rows delivered, attempts that failed and will be retried, rows dead-lettered."""

    delivered: int = 0
    retried: int = 0
    dead: int = 0

    def __add__(self, other: DeliveryReport) -> DeliveryReport:
        return DeliveryReport(delivered=self.delivered + other.delivered, retried=self.retried + other.retried,
                              dead=self.dead + other.dead)

    def to_json(self) -> dict[str, int]:
        return {"delivered": self.delivered, "retried": self.retried, "dead": self.dead}


# ---------------------------------------------------------------------- the checks at the door


def allowed_hosts(allow_hosts: Iterable[str] = ()) -> frozenset[str]:
    """The hosts beyond loopback a webhook may name: ``allow_hosts`` and ``$REGISTRY_WEBHOOK_ALLOW_HOSTS``."""
    listed = os.environ.get(ALLOW_HOSTS_ENV, "").split(",")
    return frozenset(h.strip().lower().strip("[]") for h in (*listed, *allow_hosts) if h.strip())


def check_url(url: str, allow_hosts: Iterable[str] = ()) -> None:
    """Refuse a URL that is not http(s) or names a host that is neither loopback nor allowed."""
    if not isinstance(url, str):
        raise WebhookError(f"a webhook URL is text, got {type(url).__name__}")
    shown = shown_url(url)
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        raise WebhookError(f"invalid webhook URL {shown!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise WebhookError(f"invalid webhook URL {shown!r}: it needs http:// or https:// and a host")
    if host in allowed_hosts(allow_hosts) or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise WebhookError(f"webhook host {host!r} is not allowed: only loopback hosts (127.0.0.0/8, ::1, "
                           f"localhost) are, unless listed in ${ALLOW_HOSTS_ENV} or allow_hosts=")


def check_events(events: Iterable[str] | str | None) -> tuple[str, ...]:
    """The event names a webhook subscribes to, checked; ``None`` or ``"*"`` is every event (``("*",)``)."""
    if events is None or events == ALL:
        return (ALL,)
    names = (events,) if isinstance(events, str) else tuple(events)
    if ALL in names:
        return (ALL,)
    unknown = [n for n in names if n not in EVENTS]
    if unknown or not names:
        raise WebhookError(f"unknown webhook event {unknown[0]!r}; the events are {', '.join(EVENTS)} (or *)"
                           if unknown else "a webhook needs at least one event (or *)")
    return tuple(dict.fromkeys(names))


def add_webhook(catalog: Transactions, url: str, events: Iterable[str] | str | None, *, secret: str | None,
                max_attempts: int, allow_hosts: Iterable[str]) -> WebhookInfo:
    check_url(url, allow_hosts)
    names = check_events(events)
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise WebhookError(f"max_attempts must be a positive integer, got {max_attempts!r}")
    if secret is not None and not secret:
        raise WebhookError("an empty webhook secret signs nothing: pass a secret, or None for unsigned requests")
    return WebhookCatalog(catalog).add(url, names, secret=secret, max_attempts=max_attempts)


def remove_webhook(catalog: Transactions, webhook_id: int) -> None:
    if not WebhookCatalog(catalog).remove(webhook_id):
        raise WebhookError(f"no webhook with id {webhook_id}")


# ---------------------------------------------------------------------- one request


def signature(secret: str, body: bytes) -> str:
    """The ``X-Registry-Signature`` value of ``body``: ``sha256=`` and the hex HMAC-SHA256 with ``secret``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def post(claimed: Claimed, *, timeout: float) -> int:
    """POST ``claimed``'s body to its webhook; the HTTP status (redirects are not followed). Raises ``OSError``
    or ``http.client.HTTPException`` when no answer came."""
    parts = urlsplit(claimed.url)
    headers = {"Content-Type": "application/json", "User-Agent": "checkpoint-registry-webhooks",
               "X-Registry-Event": claimed.event, "X-Registry-Delivery": claimed.uid}
    if claimed.secret is not None:
        headers["X-Registry-Signature"] = signature(claimed.secret, claimed.body)
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.request("POST", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), body=claimed.body,
                     headers=headers)
        response = conn.getresponse()
        response.read(_RESPONSE_READ)
        return int(response.status)
    finally:
        conn.close()


def _why(exc: BaseException, url: str) -> str:
    said = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {said}".replace(url, shown_url(url))[:500]


# ---------------------------------------------------------------------- deliverers


class Deliverer:
    """Delivers the outbox's due rows, as ``name`` (its leases say who holds a row)."""

    def __init__(self, catalog: Transactions, *, name: str, options: WebhookOptions | None = None) -> None:
        self.hooks = WebhookCatalog(catalog)
        self.name = name
        self.options = options or WebhookOptions()
        self._pruned_at: float | None = None

    def deliver(self, claimed: Claimed) -> DeliveryReport:
        """One attempt at one claimed row, recorded."""
        status_code: int | None = None
        error: str | None = None
        try:
            status_code = post(claimed, timeout=self.options.timeout)
        except (OSError, http.client.HTTPException) as exc:
            error = _why(exc, claimed.url)
        ok = status_code is not None and 200 <= status_code < 300
        if status_code is not None and not ok:
            error = "a redirect, not followed" if 300 <= status_code < 400 else f"HTTP {status_code}"
        status = self.hooks.finish(claimed, deliverer=self.name, status_code=status_code, error=error,
                                   delivered=ok, retry_in=self.options.retry_in(claimed.attempt))
        if status == DEAD:
            log.warning("webhook delivery %s (%s) dead-lettered after %d attempts to %s: %s", claimed.uid,
                        claimed.event, claimed.attempt, shown_url(claimed.url), error)
        elif status != DELIVERED:
            log.info("webhook delivery %s (%s) attempt %d to %s failed (%s); retried later", claimed.uid,
                     claimed.event, claimed.attempt, shown_url(claimed.url), error)
        return DeliveryReport(delivered=int(status == DELIVERED and ok), dead=int(status == DEAD),
                              retried=int(not ok and status not in (DEAD, DELIVERED)))

    def deliver_due(self, stop: Callable[[], bool] = lambda: False) -> DeliveryReport:
        """Deliver every row due now, each run's in order, until none is due (or ``stop()``)."""
        total = DeliveryReport()
        while not stop():
            progressed = False
            for row_id in self.hooks.due():
                if stop():
                    break
                claimed = self.hooks.claim(row_id, deliverer=self.name, lease=self.options.lease)
                if claimed is not None:
                    progressed = True
                    total += self.deliver(claimed)
            if not progressed:
                break
        self._prune_now_and_then()
        return total

    def _prune_now_and_then(self) -> None:
        """Keep the log from growing without end: forget old finished events, once an hour per deliverer."""
        now = time.monotonic()
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY:
            return
        self._pruned_at = now
        forgotten = self.hooks.prune(finished_before=utcnow() - timedelta(days=self.options.keep_days))
        if forgotten:
            log.info("webhook log: forgot %d events finished more than %g days ago", forgotten,
                     self.options.keep_days)

    def seconds_to_next(self) -> float | None:
        """Seconds until a pending row may be claimed (0 when one may be now); None when none is pending."""
        when = self.hooks.next_due()
        return None if when is None else max(0.0, (when - utcnow()).total_seconds())

    def follow(self, stop: threading.Event, *, max_seconds: float | None = None, poll: float = 1.0) -> DeliveryReport:
        """Deliver for everyone until ``stop`` is set (or ``max_seconds`` passed): rows are due as other processes
        commit them, so the outbox is asked again every ``poll`` seconds at least."""
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        total = DeliveryReport()
        while not stop.is_set():
            done = self.deliver_due(stop.is_set)
            total += done
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            wait = poll
            upcoming = self.seconds_to_next()
            if upcoming is not None:
                wait = min(wait, upcoming if done != DeliveryReport() else max(upcoming, 0.05))
            stop.wait(wait if left is None else min(wait, left))
        return total


class BackgroundDelivery:
    """A publishing process's deliverer thread: started by :meth:`kick` (after a commit wrote outbox rows), it
    delivers what is due, sleeps until the next retry is due, and ends when nothing is pending."""

    def __init__(self, catalog: Transactions, *, name: str, options: WebhookOptions) -> None:
        self.deliverer = Deliverer(catalog, name=name, options=options)
        self._state = threading.Condition()
        self._thread: threading.Thread | None = None
        self._kicked = False
        self._closing = False
        self._deadline: float | None = None  # set by close(): the pass under way starts no row after it

    def kick(self) -> None:
        with self._state:
            if self._closing:
                return
            self._kicked = True
            self._state.notify_all()
            if self._thread is None or not self._thread.is_alive():  # not alive: a forked child's copy
                self._thread = threading.Thread(target=self._loop, name="registry-webhooks", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._state:
                self._kicked = False
            try:
                self.deliverer.deliver_due(self._past_deadline)
                wait = self.deliverer.seconds_to_next()
            except Exception:  # noqa: BLE001 - the catalog's trouble or a bug: logged, tried again in a while
                log.exception("webhook delivery failed; retrying")
                wait = max(1.0, self.deliverer.options.backoff)
            with self._state:
                if self._closing:
                    return
                if self._kicked:
                    continue
                if wait is None:
                    self._thread = None
                    return
                self._state.wait(wait)

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() > self._deadline

    def close(self) -> None:
        """Stop once the pass under way (which delivers what is due now) ends, starting no new request after
        one request timeout; rows still pending are the next deliverer's. Waits about two timeouts at most."""
        with self._state:
            self._closing = True
            self._deadline = time.monotonic() + self.deliverer.options.timeout
            self._state.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2 * self.deliverer.options.timeout + 1)


def deliver(catalog: Transactions, *, name: str, options: WebhookOptions, follow: bool = False,
            max_seconds: float | None = None, poll: float = 1.0, stop: threading.Event | None = None) -> DeliveryReport:
    """Deliver what is due now, or with ``follow`` keep delivering until ``stop`` or ``max_seconds``."""
    deliverer = Deliverer(catalog, name=name, options=options)
    if not follow:
        return deliverer.deliver_due()
    return deliverer.follow(stop or threading.Event(), max_seconds=max_seconds, poll=poll)


__all__ = ["ALLOW_HOSTS_ENV", "DEFAULT_MAX_ATTEMPTS", "BackgroundDelivery", "Deliverer", "DeliveryReport",
           "WebhookOptions", "add_webhook", "allowed_hosts", "check_events", "check_url", "deliver", "post",
           "remove_webhook", "signature"]
