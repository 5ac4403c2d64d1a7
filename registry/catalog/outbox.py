"""Webhooks in the catalog: the receivers, the outbox of events each is owed, and the log of every attempt.

An event (a step published, verified, condemned or deleted, a tag set, moved
or removed, a step's durable copy verified) becomes one ``webhook_outbox``
row per subscribing webhook, written by :func:`record_outbox` from
``Catalog.record_event``, in the transaction that commits what it reports:
after that commit nothing is lost, whoever dies. Which webhooks subscribe is
read once per such transaction; a catalog with no webhook writes nothing
more. The body is fixed when the row is written, so every attempt sends the
same bytes with the same ``id``.

Deliverers (any number, in any process) share the rows through leases: a
row is claimed by compare-and-set on ``claimed_until`` (and only while no
older row of its webhook and run is still pending: each run's events reach
a receiver in order), delivered outside any transaction, and finished by a
second compare-and-set that logs the attempt and marks it ``delivered``,
schedules its retry, or dead-letters it after its webhook's
``max_attempts``. A deliverer that dies mid-delivery leaves a lease that
expires: the row is delivered again (at least once). On PostgreSQL the
run's row is locked before its outbox rows are written, so their ids follow
the commits' order.

Knows SQL and nothing of HTTP: the requests are :mod:`registry.ops.webhooks`'s.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import Connection, and_, delete, func, insert, select, update

from registry.catalog.models import CheckpointRow, Run, Webhook, WebhookDelivery, WebhookOutbox
from registry.catalog.session import Transactions, aware, utcnow

STEP_EVENTS = ("step.published", "step.verified", "step.condemned", "step.deleted", "step.durable")
TAG_EVENTS = ("tag.set", "tag.moved", "tag.removed")
EVENTS = STEP_EVENTS + TAG_EVENTS
ALL = "*"  # a webhook's subscription to every event
PENDING, DELIVERED, DEAD = "pending", "delivered", "dead"

_WROTE = "registry_outbox_written"   # conn.info: this transaction wrote outbox rows
_SUBSCRIBED = "registry_webhooks"    # conn.info: (the transaction, the webhooks it read)
_STATUS_EVENTS = {"verified": "step.verified", "corrupt": "step.condemned", "deleted": "step.deleted"}
_SUBSCRIPTIONS = select(Webhook.c.id, Webhook.c.events).order_by(Webhook.c.id)


def shown_url(url: str) -> str:
    """``url`` as it may be shown or logged: credentials in it (``user:pass@``) become ``***@``."""
    try:
        parts = urlsplit(url)
        if "@" not in parts.netloc:
            return url
        return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))
    except ValueError:
        return "***" if "@" in url else url


def events_of(kind: str, detail: Mapping[str, Any]) -> tuple[str, ...]:
    """The webhook events an ``events`` row of ``kind`` with ``detail`` stands for, in the order they happened."""
    status = detail.get("status")
    if kind == "tag":
        return ("tag.set",) if detail.get("old_step") is None else ("tag.moved",)
    if kind == "untag":
        return ("tag.removed",)
    if kind == "replicate" or kind == "replica-verified" and detail.get("location") == "durable":
        return ("step.durable",)  # "durable" is queries.DURABLE, the durable tier's location
    if kind.startswith("replica-"):
        return ()  # one copy's fate, not the step's
    if kind in ("publish", "repair") and status in ("published", "verified"):
        return ("step.published", "step.verified") if status == "verified" else ("step.published",)
    if status is None or status == detail.get("previous_status"):
        return ()  # a verdict repeated (verify of a verified step) reports nothing new
    event = _STATUS_EVENTS.get(str(status))
    return (event,) if event is not None else ()


def _subscriptions(conn: Connection) -> list[tuple[int, frozenset[str] | None]]:
    """Every webhook and the events it subscribes to (None: all), read once per transaction."""
    txn = conn.get_transaction()
    seen = conn.info.get(_SUBSCRIBED)
    if seen is not None and seen[0] is txn:
        subs: list[tuple[int, frozenset[str] | None]] = seen[1]
        return subs
    subs = [(int(hid), None if events == ALL else frozenset(events.split(",")))
            for hid, events in conn.execute(_SUBSCRIPTIONS)]
    conn.info[_SUBSCRIBED] = (txn, subs)
    return subs


def record_outbox(conn: Connection, run_id: int | None, step: int | None, kind: str,
                  detail: Mapping[str, Any]) -> None:
    """The outbox rows for one event just recorded in ``conn``'s transaction: none without a subscriber."""
    events = events_of(kind, detail)
    if not events or run_id is None:
        return
    subs = _subscriptions(conn)
    wanted = [(hid, event) for event in events for hid, names in subs if names is None or event in names]
    if not wanted:
        return
    if conn.dialect.name == "postgresql":  # the run's rows in commit order (see the module's docstring)
        conn.execute(select(Run.c.id).where(Run.c.id == run_id).with_for_update(key_share=True))
    c = CheckpointRow.c
    row = conn.execute(select(Run.c.name, c.status, c.manifest_sha256).select_from(Run)
                       .outerjoin(CheckpointRow, and_(c.run_id == Run.c.id, c.step == step))
                       .where(Run.c.id == run_id)).one()
    now = utcnow()
    digest = detail.get("manifest_sha256") or row.manifest_sha256
    rows = []
    for hid, event in wanted:
        uid = uuid.uuid4().hex
        body: dict[str, Any] = {"id": uid, "event": event, "run": row.name, "step": step,
                                "tag": detail.get("tag"), "digest": digest, "status": row.status,
                                "time": now.isoformat().replace("+00:00", "Z")}
        if event in ("tag.moved", "tag.removed"):
            body["previous_step"] = detail.get("old_step")
        rows.append({"uid": uid, "webhook_id": hid, "run_id": run_id, "event": event,
                     "body": json.dumps(body, sort_keys=True), "status": PENDING, "attempts": 0,
                     "next_attempt_at": now, "created_at": now})
    conn.execute(insert(WebhookOutbox), rows)
    conn.info[_WROTE] = True


def forget_written(conn: Connection) -> None:
    """Start a transaction on ``conn`` with no outbox rows counted (a pooled connection keeps its ``info``)."""
    conn.info.pop(_WROTE, None)


def took_written(conn: Connection) -> bool:
    """Whether the transaction on ``conn`` wrote outbox rows (and forget it)."""
    return bool(conn.info.pop(_WROTE, False))


@dataclass(frozen=True, kw_only=True)
class WebhookInfo:
    """A webhook as it may be shown: its URL without credentials, never its secret."""

    id: int
    url: str
    events: tuple[str, ...]  # ("*",) for every event
    signed: bool             # has a secret: its requests carry X-Registry-Signature
    max_attempts: int
    created_at: datetime | None
    pending: int = 0
    dead: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "events": list(self.events), "signed": self.signed,
                "max_attempts": self.max_attempts, "pending": self.pending, "dead": self.dead,
                "created_at": self.created_at.isoformat() if self.created_at else None}


@dataclass(frozen=True, kw_only=True)
class DeliveryAttempt:
    """One attempt at delivering an outbox row: the HTTP status it got, or why it got none."""

    attempt: int
    status_code: int | None
    error: str | None
    deliverer: str | None
    at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "status_code": self.status_code, "error": self.error,
                "deliverer": self.deliverer, "at": self.at.isoformat() if self.at else None}


@dataclass(frozen=True, kw_only=True)
class OutboxEntry:
    """One event owed to one webhook, and every attempt at delivering it so far."""

    id: str  # what the receiver sees as the body's ``id`` and X-Registry-Delivery
    webhook: int
    event: str
    run: str
    step: int | None
    status: str  # pending, delivered or dead
    created_at: datetime | None
    finished_at: datetime | None
    next_attempt_at: datetime | None
    attempts: tuple[DeliveryAttempt, ...]
    body: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "webhook": self.webhook, "event": self.event, "run": self.run, "step": self.step,
                "status": self.status, "created_at": self.created_at.isoformat() if self.created_at else None,
                "finished_at": self.finished_at.isoformat() if self.finished_at else None,
                "next_attempt_at": self.next_attempt_at.isoformat() if self.next_attempt_at else None,
                "attempts": [a.to_json() for a in self.attempts], "body": self.body}


@dataclass(frozen=True, kw_only=True)
class Claimed:
    """An outbox row this deliverer holds a lease on: what to send, where, and which attempt this is."""

    row_id: int
    uid: str
    url: str  # as stored, credentials and all: never shown
    secret: str | None
    event: str
    body: bytes
    attempt: int
    max_attempts: int


def _head(o: Any) -> Any:
    """The condition that no older row of ``o``'s webhook and run is still pending."""
    e = WebhookOutbox.alias("earlier")
    return ~select(e.c.id).where(e.c.status == PENDING, e.c.webhook_id == o.webhook_id, e.c.run_id == o.run_id,
                                 e.c.id < o.id).exists()


class WebhookCatalog:
    """The webhook queries over a catalog's transactions (see the module's docstring)."""

    def __init__(self, catalog: Transactions) -> None:
        self.catalog = catalog

    # ------------------------------------------------------------------ webhooks

    def add(self, url: str, events: Iterable[str], *, secret: str | None, max_attempts: int) -> WebhookInfo:
        """A new webhook; ``events`` already checked (``*`` for all)."""
        names = ",".join(events)

        def fn(conn: Connection) -> int:
            return int(conn.execute(insert(Webhook).values(url=url, secret=secret, events=names,
                                                           max_attempts=max_attempts, created_at=utcnow())
                                    .returning(Webhook.c.id)).scalar_one())
        hid: int = self.catalog.write(fn)
        return next(w for w in self.webhooks() if w.id == hid)

    def webhooks(self) -> list[WebhookInfo]:
        def fn(conn: Connection) -> list[WebhookInfo]:
            o = WebhookOutbox.c
            counts: dict[tuple[int, str], int] = {
                (int(hid), str(status)): int(n) for hid, status, n in conn.execute(
                    select(o.webhook_id, o.status, func.count()).where(o.status.in_((PENDING, DEAD)))
                    .group_by(o.webhook_id, o.status))}
            return [WebhookInfo(id=w.id, url=shown_url(w.url), events=tuple(w.events.split(",")),
                                signed=w.secret is not None, max_attempts=w.max_attempts,
                                created_at=aware(w.created_at), pending=counts.get((w.id, PENDING), 0),
                                dead=counts.get((w.id, DEAD), 0))
                    for w in conn.execute(select(Webhook).order_by(Webhook.c.id))]
        result: list[WebhookInfo] = self.catalog.read(fn)
        return result

    def remove(self, webhook_id: int) -> bool:
        """Forget a webhook with its outbox and log; False when there is no such webhook."""
        def fn(conn: Connection) -> bool:
            rows = select(WebhookOutbox.c.id).where(WebhookOutbox.c.webhook_id == webhook_id)
            conn.execute(delete(WebhookDelivery).where(WebhookDelivery.c.outbox_id.in_(rows)))
            conn.execute(delete(WebhookOutbox).where(WebhookOutbox.c.webhook_id == webhook_id))
            return bool(conn.execute(delete(Webhook).where(Webhook.c.id == webhook_id)).rowcount)
        result: bool = self.catalog.write(fn)
        return result

    def log(self, webhook_id: int | None = None, *, run: str | None = None, limit: int = 50) -> list[OutboxEntry]:
        """The newest ``limit`` outbox rows (of one webhook, of one run), oldest first, with their attempts."""
        def fn(conn: Connection) -> list[OutboxEntry]:
            o = WebhookOutbox.c
            query = select(WebhookOutbox, Run.c.name.label("run_name")).join(Run, Run.c.id == o.run_id)
            if webhook_id is not None:
                query = query.where(o.webhook_id == webhook_id)
            if run is not None:
                query = query.where(Run.c.name == run)
            rows = list(reversed(conn.execute(query.order_by(o.id.desc()).limit(limit)).all()))
            attempts: dict[int, list[DeliveryAttempt]] = {}
            d = WebhookDelivery.c
            for start in range(0, len(rows), 500):
                ids = [r.id for r in rows[start:start + 500]]
                for a in conn.execute(select(WebhookDelivery).where(d.outbox_id.in_(ids)).order_by(d.id)):
                    attempts.setdefault(a.outbox_id, []).append(DeliveryAttempt(
                        attempt=a.attempt, status_code=a.status_code, error=a.error, deliverer=a.deliverer,
                        at=aware(a.attempted_at)))
            entries = []
            for r in rows:
                body = json.loads(r.body)
                entries.append(OutboxEntry(
                    id=r.uid, webhook=r.webhook_id, event=r.event, run=r.run_name, step=body.get("step"),
                    status=r.status, created_at=aware(r.created_at), finished_at=aware(r.finished_at),
                    next_attempt_at=aware(r.next_attempt_at) if r.status == PENDING else None,
                    attempts=tuple(attempts.get(r.id, ())), body=body))
            return entries
        result: list[OutboxEntry] = self.catalog.read(fn)
        return result

    # ------------------------------------------------------------------ delivery

    def due(self, *, limit: int = 100) -> list[int]:
        """The rows a deliverer may claim now, oldest first: each (webhook, run)'s oldest pending row, when it is
        due and no live lease holds it."""
        def fn(conn: Connection) -> list[int]:
            o = WebhookOutbox.c
            now = utcnow()
            return [int(i) for i in conn.scalars(
                select(o.id).where(o.status == PENDING, o.next_attempt_at <= now,
                                   (o.claimed_until.is_(None)) | (o.claimed_until < now), _head(o))
                .order_by(o.id).limit(limit))]
        result: list[int] = self.catalog.read(fn)
        return result

    def next_due(self) -> datetime | None:
        """When the earliest pending row that heads its (webhook, run) may be claimed; None when none is pending."""
        def fn(conn: Connection) -> datetime | None:
            o = WebhookOutbox.c
            whens = [max(t for t in (aware(at), aware(until)) if t is not None)
                     for at, until in conn.execute(select(o.next_attempt_at, o.claimed_until)
                                                   .where(o.status == PENDING, _head(o)))]
            return min(whens, default=None)
        result: datetime | None = self.catalog.read(fn)
        return result

    def claim(self, row_id: int, *, deliverer: str, lease: timedelta) -> Claimed | None:
        """A lease on row ``row_id`` for this attempt (compare-and-set); None when another deliverer has it, it
        is no longer pending or due, or an older row of its run is pending again."""
        def fn(conn: Connection) -> Claimed | None:
            now = utcnow()
            o = WebhookOutbox.c
            changed = conn.execute(update(WebhookOutbox).where(
                o.id == row_id, o.status == PENDING, o.next_attempt_at <= now,
                (o.claimed_until.is_(None)) | (o.claimed_until < now), _head(WebhookOutbox.c))
                .values(claimed_by=deliverer, claimed_until=now + lease, attempts=o.attempts + 1)).rowcount
            if not changed:
                return None
            row = conn.execute(select(o.uid, o.event, o.body, o.attempts, Webhook.c.url, Webhook.c.secret,
                                      Webhook.c.max_attempts)
                               .join(Webhook, Webhook.c.id == o.webhook_id).where(o.id == row_id)).one()
            return Claimed(row_id=row_id, uid=row.uid, url=row.url, secret=row.secret, event=row.event,
                           body=row.body.encode(), attempt=int(row.attempts), max_attempts=int(row.max_attempts))
        result: Claimed | None = self.catalog.write(fn)
        return result

    def finish(self, claimed: Claimed, *, deliverer: str, status_code: int | None, error: str | None,
               delivered: bool, retry_in: timedelta) -> str:
        """Log the attempt and settle the row: ``delivered``, ``dead`` after its last attempt, else ``pending``
        again, due in ``retry_in``. A failure no longer under this deliverer's lease changes nothing but the
        log. The row's status afterwards."""
        def fn(conn: Connection) -> str:
            now = utcnow()
            o = WebhookOutbox.c
            conn.execute(insert(WebhookDelivery).values(outbox_id=claimed.row_id, attempt=claimed.attempt,
                                                        status_code=status_code, error=error, deliverer=deliverer,
                                                        attempted_at=now))
            mine = (o.id == claimed.row_id, o.status == PENDING)
            released = {"claimed_by": None, "claimed_until": None}
            if delivered:  # whoever holds it now: the receiver has it
                conn.execute(update(WebhookOutbox).where(*mine).values(status=DELIVERED, finished_at=now, **released))
            elif claimed.attempt >= claimed.max_attempts:
                conn.execute(update(WebhookOutbox).where(*mine, o.claimed_by == deliverer)
                             .values(status=DEAD, finished_at=now, **released))
            else:
                conn.execute(update(WebhookOutbox).where(*mine, o.claimed_by == deliverer)
                             .values(next_attempt_at=now + retry_in, **released))
            status = conn.scalar(select(o.status).where(o.id == claimed.row_id))
            return str(status) if status is not None else DELIVERED
        result: str = self.catalog.write(fn)
        return result

    def prune(self, *, finished_before: datetime) -> int:
        """Forget the events delivered or dead-lettered before ``finished_before``, with their attempts; a
        pending event is never forgotten (its run's later events wait on it). How many were forgotten."""
        def fn(conn: Connection) -> int:
            o = WebhookOutbox.c
            done = select(o.id).where(o.status.in_((DELIVERED, DEAD)), o.finished_at < finished_before)
            conn.execute(delete(WebhookDelivery).where(WebhookDelivery.c.outbox_id.in_(done)))
            return int(conn.execute(delete(WebhookOutbox).where(o.id.in_(done))).rowcount)
        result: int = self.catalog.write(fn)
        return result


__all__ = ["ALL", "DEAD", "DELIVERED", "EVENTS", "PENDING", "Claimed", "DeliveryAttempt", "OutboxEntry",
           "WebhookCatalog", "WebhookInfo", "events_of", "forget_written", "record_outbox", "shown_url",
           "took_written"]
