"""Webhooks against a real HTTP receiver on 127.0.0.1: every event, signed; at least once, in order per run,
retried with backoff and dead-lettered; nothing lost to a kill between the commit and the delivery; only
loopback or allowed hosts; credentials never shown. On SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from sqlalchemy import func, select

from registry import Registry, WebhookError
from registry.catalog.models import WebhookOutbox
from registry.catalog.outbox import EVENTS
from registry.ops.webhooks import Deliverer, WebhookOptions
from registry.retention import KeepLast
from tests.helpers import child_env, flip_stored_byte, free_port, make_state
from tests.test_hot_path_counts import statements

SECRET = "s3cret"
WAIT = 60.0  # the longest any condition is waited for; never reached when things work


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    raw: bytes
    signed_ok: bool
    answered: int

    @property
    def body(self) -> dict[str, object]:
        doc: dict[str, object] = json.loads(self.raw)
        return doc


class Receiver:
    """A webhook receiver in a thread: records every request, answers 401 to one whose signature is not the
    HMAC of its body with ``secret``, then the statuses queued in ``script``, then 204."""

    def __init__(self, secret: str | None = SECRET, port: int = 0) -> None:
        self.secret = secret
        self.requests: list[Received] = []
        self.script: list[int] = []
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                given = self.headers.get("X-Registry-Signature", "")
                ok = receiver.secret is None or hmac.compare_digest(
                    given, "sha256=" + hmac.new(receiver.secret.encode(), raw, hashlib.sha256).hexdigest())
                with receiver.changed:
                    status = 401 if not ok else receiver.script.pop(0) if receiver.script else 204
                    receiver.requests.append(Received(dict(self.headers), raw, ok, status))
                    receiver.changed.notify_all()
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/hook"

    def delivered(self) -> list[dict[str, object]]:
        """The bodies answered with a 2xx, in the order they came."""
        with self.changed:
            return [r.body for r in self.requests if 200 <= r.answered < 300]

    def wait_for(self, done: Callable[[list[Received]], bool]) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: done(self.requests), timeout=WAIT), self.requests

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def quiet(reg: Registry, **options: float) -> Registry:
    """``reg`` delivering only when asked (no background thread), with the given options."""
    reg.webhook_options = WebhookOptions(background=False, **{"backoff": 0.0, **options})
    return reg


def outbox_rows(reg: Registry) -> int:
    return int(reg.catalog.read(lambda conn: conn.scalar(select(func.count()).select_from(WebhookOutbox))))


def events_of(bodies: list[dict[str, object]]) -> list[tuple[object, ...]]:
    return [(b["event"], b["run"], b["step"], b["tag"]) for b in bodies]


# ---------------------------------------------------------------------- every event, signed


def test_each_event_reaches_the_receiver_signed_with_its_id_and_digest(reg: Registry, receiver: Receiver) -> None:
    quiet(reg)
    hook = reg.add_webhook(receiver.url, secret=SECRET)
    assert hook.events == ("*",) and hook.signed
    one = reg.publish("run", 1, make_state(1), verify=False)
    reg.verify("run@1")
    reg.verify("run@1")  # a verdict repeated tells nobody anything
    two = reg.publish("run", 2, make_state(2), tags=["release"])
    reg.tag("run", 1, "release")
    reg.untag("run", "release")
    three = reg.publish("run", 3, make_state(3))
    flip_stored_byte(reg, three, "model.safetensors")
    assert not reg.verify("run@3")[0].ok
    reg.plan_retention("run", KeepLast(1)).execute()
    report = reg.deliver_webhooks()
    assert events_of(receiver.delivered()) == [
        ("step.published", "run", 1, None), ("step.verified", "run", 1, None),
        ("step.published", "run", 2, None), ("step.verified", "run", 2, None), ("tag.set", "run", 2, "release"),
        ("tag.moved", "run", 1, "release"), ("tag.removed", "run", 1, "release"),
        ("step.published", "run", 3, None), ("step.verified", "run", 3, None), ("step.condemned", "run", 3, None),
        ("step.deleted", "run", 1, None), ("step.deleted", "run", 3, None)]
    assert report.delivered == 12 and report.retried == report.dead == 0
    assert all(r.signed_ok for r in receiver.requests)
    digests = {1: one.manifest_sha256, 2: two.manifest_sha256, 3: three.manifest_sha256}
    for r in receiver.requests:
        body = r.body
        assert r.headers["X-Registry-Delivery"] == body["id"] and r.headers["X-Registry-Event"] == body["event"]
        assert r.headers["Content-Type"] == "application/json"
        assert body["digest"] == digests[int(str(body["step"]))]
        assert datetime.fromisoformat(str(body["time"]).replace("Z", "+00:00")).tzinfo is not None
    moved = receiver.delivered()[5]
    assert moved["previous_step"] == 2 and moved["status"] == "verified"
    assert len({b["id"] for b in receiver.delivered()}) == 12
    log = reg.webhook_log()
    assert [e.id for e in log] == [b["id"] for b in receiver.delivered()]
    assert all(e.status == "delivered" and [a.status_code for a in e.attempts] == [204] for e in log)
    assert reg.deliver_webhooks().delivered == 0  # nothing twice


def test_a_step_becoming_durable_is_an_event(treg: Registry, receiver: Receiver) -> None:
    quiet(treg)
    treg.add_webhook(receiver.url, events=["step.durable"], secret=SECRET)
    info = treg.publish("run", 5, make_state())
    treg.wait_durable("run", 5, timeout=WAIT)
    treg.deliver_webhooks()
    assert events_of(receiver.delivered()) == [("step.durable", "run", 5, None)]
    assert receiver.delivered()[0]["digest"] == info.manifest_sha256


def test_only_subscribed_events_are_written_and_the_webhooks_are_read_once_per_transaction(
        reg: Registry, receiver: Receiver) -> None:
    quiet(reg)
    reg.publish("run", 1, make_state())
    assert outbox_rows(reg) == 0  # no webhook: no row
    reg.add_webhook(receiver.url, events=["tag.set", "tag.moved"], secret=SECRET)
    with statements() as seen:
        reg.publish("run", 2, make_state(), tags=["a", "b"])
    assert sum(" FROM webhooks" in s for s in seen) == 1, seen  # the commit's one transaction
    assert outbox_rows(reg) == 2
    reg.publish("run", 3, make_state())
    assert outbox_rows(reg) == 2
    reg.deliver_webhooks()
    assert events_of(receiver.delivered()) == [("tag.set", "run", 2, "a"), ("tag.set", "run", 2, "b")]


# ---------------------------------------------------------------------- failures, retries, order


def test_a_wrong_secret_is_rejected_by_the_receiver_retried_then_dead_lettered(reg: Registry,
                                                                               receiver: Receiver) -> None:
    quiet(reg)
    reg.add_webhook(receiver.url, events=["step.published"], secret="not-the-receivers", max_attempts=3)
    reg.publish("run", 1, make_state())
    reg.publish("run", 2, make_state())
    report = reg.deliver_webhooks()
    assert (report.delivered, report.retried, report.dead) == (0, 4, 2)
    assert [r.answered for r in receiver.requests] == [401] * 6
    first, second = reg.webhook_log()
    assert first.status == second.status == "dead"
    assert [(a.attempt, a.status_code, a.error) for a in first.attempts] == [(n, 401, "HTTP 401") for n in (1, 2, 3)]
    # the dead letter let the run's next event go: step 2's tries all came after step 1's
    assert [r.body["step"] for r in receiver.requests] == [1, 1, 1, 2, 2, 2]
    assert reg.webhooks()[0].dead == 2 and reg.deliver_webhooks().dead == 0


def test_finished_events_are_forgotten_after_keep_days_and_pending_ones_never(reg: Registry, receiver: Receiver,
                                                                            cli) -> None:  # type: ignore[no-untyped-def]
    from datetime import timedelta
    quiet(reg)
    hook = reg.add_webhook(receiver.url, events=["step.published"], secret=SECRET, max_attempts=1)
    receiver.script[:] = [500]
    reg.publish("run", 1, make_state())
    reg.publish("run", 2, make_state())
    assert reg.deliver_webhooks().to_json() == {"delivered": 1, "retried": 0, "dead": 1}
    other = reg.add_webhook(receiver.url.replace("/hook", "/other"), events=["step.published"], secret=SECRET)
    reg.publish("run", 3, make_state())  # pending for both webhooks
    assert reg.prune_webhook_log() == 0  # the default keeps 30 days
    assert reg.prune_webhook_log(older_than=timedelta(0)) == 2
    assert [(e.webhook, e.step, e.status) for e in reg.webhook_log()] == [(hook.id, 3, "pending"),
                                                                         (other.id, 3, "pending")]
    with pytest.raises(WebhookError, match="older_than"):
        reg.prune_webhook_log(older_than=timedelta(days=-1))
    # a deliverer forgets by itself what finished more than keep_days ago
    quiet(reg, keep_days=0.0)
    assert reg.deliver_webhooks().delivered == 2 and reg.webhook_log() == []
    assert reg.webhooks()[0].pending == 0
    reg.publish("run", 4, make_state())
    quiet(reg).deliver_webhooks()
    pruned = cli("hooks", "prune", "--older-than-days", "0", "--json")
    assert pruned.exit_code == 0 and json.loads(pruned.output) == {"forgotten": 2}
    assert cli("hooks", "prune", "--older-than-days", "-1").exit_code != 0


def test_a_500_storm_then_success_sends_the_same_bytes_with_the_same_id(reg: Registry, receiver: Receiver) -> None:
    quiet(reg)
    reg.add_webhook(receiver.url, events=["step.published"], secret=SECRET)
    reg.publish("run", 1, make_state())
    receiver.script = [500, 502, 503, 500, 500]
    report = reg.deliver_webhooks()
    assert (report.delivered, report.retried, report.dead) == (1, 5, 0)
    assert [r.answered for r in receiver.requests] == [500, 502, 503, 500, 500, 204]
    assert len({r.raw for r in receiver.requests}) == 1  # what a receiver de-duplicates by: one id, one body
    assert len({r.headers["X-Registry-Delivery"] for r in receiver.requests}) == 1
    (entry,) = reg.webhook_log()
    assert entry.status == "delivered" and [a.status_code for a in entry.attempts] == [500, 502, 503, 500, 500, 204]


def test_a_runs_later_event_waits_for_its_earlier_one_while_other_runs_go_on(reg: Registry,
                                                                              receiver: Receiver) -> None:
    quiet(reg, backoff=3600.0, backoff_max=3600.0)
    reg.add_webhook(receiver.url, events=["step.published", "tag.set"], secret=SECRET)
    reg.publish("a", 1, make_state(), tags=["x"])
    reg.publish("b", 1, make_state(), tags=["y"])
    reg.publish("a", 2, make_state())
    receiver.script = [500]  # run a's first event fails, and is not due again for an hour
    report = reg.deliver_webhooks()
    assert (report.delivered, report.retried) == (2, 1)
    assert events_of(receiver.delivered()) == [("step.published", "b", 1, None), ("tag.set", "b", 1, "y")]
    pending = [e for e in reg.webhook_log() if e.status == "pending"]
    assert [(e.run, e.event, len(e.attempts)) for e in pending] == [
        ("a", "step.published", 1), ("a", "tag.set", 0), ("a", "step.published", 0)]


def test_order_per_run_holds_through_failures_and_two_deliverers_at_once(reg: Registry, receiver: Receiver) -> None:
    quiet(reg)
    reg.add_webhook(receiver.url, events=["tag.set", "tag.moved"], secret=SECRET)
    for run in ("a", "b", "c"):
        reg.publish(run, 1, make_state())
        reg.publish(run, 2, make_state())
    expected: dict[str, list[int]] = {run: [] for run in ("a", "b", "c")}
    for n in range(12):
        for run in ("a", "b", "c"):
            reg.tag(run, 1 + n % 2, f"t{n % 3}")
            expected[run].append(1 + n % 2)
    receiver.script = [500, 500, 503, 500, 500, 500, 503]
    options = WebhookOptions(backoff=0.0, background=False)
    deliverers = [Deliverer(reg.catalog, name=f"d{i}", options=options) for i in range(2)]
    threads = [threading.Thread(target=d.deliver_due) for d in deliverers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    reg.deliver_webhooks()  # whatever a thread left when it found nothing due at that moment
    got = receiver.delivered()
    assert len(got) == 36 and len({b["id"] for b in got}) == 36  # at least once: no id delivered twice here
    for run in ("a", "b", "c"):
        assert [b["step"] for b in got if b["run"] == run] == expected[run]
    by_id: dict[object, list[int]] = {}
    for r in receiver.requests:
        by_id.setdefault(r.body["id"], []).append(r.answered)
    assert all(answers[-1] == 204 and all(a >= 500 for a in answers[:-1]) for answers in by_id.values())


def test_a_receiver_down_for_a_while_then_back_gets_the_event(reg: Registry) -> None:
    port = free_port()
    quiet(reg, backoff=0.05)
    reg.add_webhook(f"http://127.0.0.1:{port}/hook", events=["step.published"], secret=SECRET, max_attempts=50)
    reg.publish("run", 1, make_state())
    report = reg.deliver_webhooks()
    # once, or again within the same call when the pass outlasts the 50 ms backoff on a loaded machine
    assert report.delivered == 0 and report.retried >= 1
    (entry,) = reg.webhook_log()
    assert entry.status == "pending" and len(entry.attempts) == report.retried
    assert all("ConnectionRefusedError" in str(a.error) for a in entry.attempts)
    back = Receiver(port=port)
    try:
        stop = threading.Event()
        deliverer = Deliverer(reg.catalog, name="follower", options=WebhookOptions(backoff=0.05, background=False))
        follower = threading.Thread(target=deliverer.follow, args=(stop,), kwargs={"max_seconds": WAIT})
        follower.start()
        back.wait_for(lambda seen: any(r.answered == 204 for r in seen))
        stop.set()
        follower.join(WAIT)
        (entry,) = reg.webhook_log()
        assert entry.status == "delivered" and entry.attempts[-1].status_code == 204
        assert entry.attempts[-1].deliverer == "follower"
    finally:
        back.close()


# ---------------------------------------------------------------------- processes


KILLED_PUBLISH = """
import sys
import torch
from registry import Registry
reg = Registry.open(sys.argv[1], sys.argv[2])
reg.publish("run", 7, {"w": torch.ones(4)})
print("not killed")
"""


def test_a_kill_between_the_commit_and_the_delivery_loses_nothing(catalog_url: str, root: Path,
                                                                  receiver: Receiver, cli) -> None:  # type: ignore[no-untyped-def]
    with Registry.open(catalog_url, root) as reg:
        reg.add_webhook(receiver.url, events=["step.published", "step.verified"], secret=SECRET)
    env = {**child_env(), "REGISTRY_CRASH_AT": "outbox-after-commit"}
    done = subprocess.run([sys.executable, "-c", KILLED_PUBLISH, catalog_url, str(root)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert receiver.requests == []
    with Registry.open(catalog_url, root, create=False) as reg:
        assert reg.resolve("run@latest").step == 7  # committed before the kill
        assert [e.status for e in reg.webhook_log()] == ["pending", "pending"]
    result = cli("hooks", "deliver")
    assert result.exit_code == 0 and "delivered 2" in result.output, result.output
    assert events_of(receiver.delivered()) == [("step.published", "run", 7, None), ("step.verified", "run", 7, None)]


def test_the_publishing_process_delivers_in_the_background_and_stops_on_close(catalog_url: str, root: Path,
                                                                             receiver: Receiver) -> None:
    reg = Registry.open(catalog_url, root)
    try:
        reg.add_webhook(receiver.url, events=["step.published", "tag.set"], secret=SECRET)
        reg.publish("run", 1, make_state(), tags=["best"])
        receiver.wait_for(lambda seen: len(seen) == 2)
        thread = reg._webhook_delivery._thread if reg._webhook_delivery is not None else None
    finally:
        reg.close()
    assert thread is None or not thread.is_alive()
    assert events_of(receiver.delivered()) == [("step.published", "run", 1, None), ("tag.set", "run", 1, "best")]


# ---------------------------------------------------------------------- the door: hosts, credentials


@pytest.mark.parametrize("url", ["http://10.0.0.5/hook", "https://example.com/hook", "http://169.254.169.254/",
                                 "http://[fd00::1]/x", "http://127.0.0.1.nip.io/x", "ftp://127.0.0.1/x",
                                 "http:///nohost", "http://127.0.0.1:notaport/x"])
def test_hosts_beyond_loopback_and_other_schemes_are_refused(sqlite_reg: Registry, url: str) -> None:
    with pytest.raises(WebhookError) as refused:
        sqlite_reg.add_webhook(url)
    assert "\n" not in str(refused.value) and isinstance(refused.value, ValueError)
    assert sqlite_reg.webhooks() == []


def test_loopback_and_allowed_hosts_are_accepted(sqlite_reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    for url in ("http://127.0.0.1:9/x", "http://127.8.9.10/x", "http://[::1]:8080/x", "http://localhost/x"):
        sqlite_reg.add_webhook(url)
    sqlite_reg.add_webhook("https://ci.example.com/hook", allow_hosts=["ci.example.com"])
    monkeypatch.setenv("REGISTRY_WEBHOOK_ALLOW_HOSTS", " chat.example.org , 10.1.2.3")
    sqlite_reg.add_webhook("https://chat.example.org/x")
    sqlite_reg.add_webhook("http://10.1.2.3:8000/x")
    assert len(sqlite_reg.webhooks()) == 7
    with pytest.raises(WebhookError, match="unknown webhook event 'step.verifed'"):
        sqlite_reg.add_webhook("http://127.0.0.1/x", events=["step.verifed"])
    with pytest.raises(WebhookError, match="no webhook with id 99"):
        sqlite_reg.remove_webhook(99)
    assert set(EVENTS) >= {"step.published", "step.verified", "step.condemned", "step.deleted", "step.durable",
                           "tag.set", "tag.moved"}


def test_credentials_in_a_url_are_used_but_never_shown(reg: Registry, cli, caplog: pytest.LogCaptureFixture,  # type: ignore[no-untyped-def]
                                                       receiver: Receiver) -> None:
    quiet(reg, backoff=0.0)
    port = free_port()
    with pytest.raises(WebhookError) as refused:
        reg.add_webhook("http://alice:hunter2@10.9.9.9/x")
    assert "hunter2" not in str(refused.value) and "alice" not in str(refused.value)
    down = reg.add_webhook(f"http://alice:hunter2@127.0.0.1:{port}/x", events=["step.published"], max_attempts=2)
    up = reg.add_webhook(receiver.url.replace("http://", "http://bob:pa%40ss@"), events=["step.published"],
                         secret=SECRET)
    assert "hunter2" not in repr(down) and down.url == f"http://***@127.0.0.1:{port}/x"
    reg.publish("run", 1, make_state())
    with caplog.at_level(logging.DEBUG, logger="registry"):
        report = reg.deliver_webhooks()
    assert (report.delivered, report.dead) == (1, 1)
    import base64
    assert receiver.requests[0].headers["Authorization"] == "Basic " + base64.b64encode(b"bob:pa@ss").decode()
    shown = [cli("hooks", "ls").output, cli("hooks", "ls", "--json").output, cli("hooks", "log").output,
             cli("hooks", "log", "--json").output, caplog.text, repr(reg.webhooks()), repr(reg.webhook_log()),
             cli("hooks", "add", "http://carol:hunter2@10.0.0.1/x").output,
             cli("hooks", "add", f"http://carol:hunter2@127.0.0.1:{port}/y").output]
    assert "dead-lettered" in caplog.text and f"127.0.0.1:{port}" in shown[0]
    assert not any("hunter2" in text or "pa%40ss" in text or "pa@ss" in text for text in shown), shown
    assert up.id in {h.id for h in reg.webhooks()}


# ---------------------------------------------------------------------- the command line


def test_hooks_commands(cli, receiver: Receiver, catalog_url: str, root: Path) -> None:  # type: ignore[no-untyped-def]
    with Registry.open(catalog_url, root) as reg:
        reg.publish("run", 1, make_state())
    added = cli("hooks", "add", receiver.url, "--event", "tag.set", "--secret", SECRET, "--json")
    assert added.exit_code == 0, added.output
    hook = json.loads(added.output)
    assert hook["events"] == ["tag.set"] and hook["signed"] is True and SECRET not in added.output
    assert cli("hooks", "add", "http://10.0.0.1/x").exit_code == 1
    assert cli("hooks", "add", receiver.url, "--event", "nope").exit_code == 1
    # a command that commits an event delivers it itself, before it exits
    assert cli("tag", "run", "1", "best").exit_code == 0
    assert events_of(receiver.delivered()) == [("tag.set", "run", 1, "best")]
    with Registry.open(catalog_url, root) as reg:
        quiet(reg).tag("run", 1, "second")
    listed = json.loads(cli("hooks", "ls", "--json").output)
    assert [(h["id"], h["pending"]) for h in listed] == [(hook["id"], 1)]
    delivered = cli("hooks", "deliver", "--follow", "--max-seconds", "0", "--backoff", "0", "--json")
    assert delivered.exit_code == 0 and json.loads(delivered.output) == {"delivered": 1, "retried": 0, "dead": 0}
    assert events_of(receiver.delivered()) == [("tag.set", "run", 1, "best"), ("tag.set", "run", 1, "second")]
    log = cli("hooks", "log", "--hook", str(hook["id"]))
    assert log.exit_code == 0 and "tag.set" in log.output and "delivered" in log.output and "204" in log.output
    assert [e["status"] for e in json.loads(cli("hooks", "log", "--run", "run", "--json").output)] == ["delivered"] * 2
    assert cli("hooks", "rm", str(hook["id"])).exit_code == 0
    assert json.loads(cli("hooks", "ls", "--json").output) == []
    gone = cli("hooks", "rm", str(hook["id"]))
    assert gone.exit_code == 1 and "no webhook with id" in gone.output


# ---------------------------------------------------------------------- the schema


def test_the_webhook_revision_downgrades_and_upgrades_again(catalog_url: str) -> None:
    from alembic import command
    from sqlalchemy import inspect

    from registry.catalog.session import (alembic_config, current_revision, head_revision, open_engine, upgrade,
                                          write_connection)
    engine = open_engine(catalog_url)
    try:
        with write_connection(engine) as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0007")
            assert not {"webhooks", "webhook_outbox", "webhook_deliveries"} & set(inspect(conn).get_table_names())
        assert upgrade(engine) == ("0007", head_revision())
        with engine.connect() as conn:
            assert current_revision(conn) == head_revision()
            assert {"webhooks", "webhook_outbox", "webhook_deliveries"} <= set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


def test_a_publish_tells_the_background_thread_only_when_a_webhook_is_owed_something(
        sqlite_reg: Registry, receiver: Receiver) -> None:
    sqlite_reg.publish("run", 1, {"w": torch.ones(2)})
    assert sqlite_reg._webhook_delivery is None
    sqlite_reg.add_webhook(receiver.url, events=["tag.removed"])
    sqlite_reg.publish("run", 2, {"w": torch.ones(2)})
    assert sqlite_reg._webhook_delivery is None
