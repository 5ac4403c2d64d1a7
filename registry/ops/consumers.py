"""Policy consumers: RL rollout workers that serve the newest verified policy version of a run.

``Registry.subscribe(run, consumer=NAME, ttl=120)`` registers a consumer and
returns a :class:`Subscription`; ``sub.versions()`` yields a :class:`Lease` on
each new verified policy version; ``lease.materialize()`` gives a host-local
directory an inference engine reloads from; ``lease.applied()`` records that
the consumer now serves it. The trainer bounds staleness with
``Registry.wait_lag(run, k)``.

A version recorded with ``Registry.publish_policy_marker`` (its bytes moved
outside the registry, over NCCL or RDMA) is a version like any other here: it
is leased in version order with the steps (``lease.marker``, ``lease.step``
None), it cannot be materialized (the engine got its bytes elsewhere), and
``lease.applied()`` records that the consumer serves it, so lag and the load
audit cover it.

One process is one host's consumers, however many subscriptions it holds:
they share the registry's catalog pool, *one* heartbeat thread that writes all
their heartbeats as one transaction per beat, and one PostgreSQL listener
(:class:`ConsumerHub`). That keeps the catalog's connections at (hosts x pool
size) and its heartbeat writes at (hosts / beat interval), whatever the number
of consumers per host. Waking up is :mod:`registry.ops.follow`'s mechanism: a
listener connection LISTENing before the first query, and re-querying the
catalog on each notification of the run (the answer always comes from a
query, so a version is never seen before its step is verified); on SQLite, a
poll with backoff.

Every consumer of a host reads one copy of a version: :meth:`Lease.materialize`
fills ``<cache>/<run>/v<N>/`` once under an ``fcntl`` lock, through
``Registry.materialize`` (which checks the bytes against the version's full
digest); later consumers find it there and record ``bytes_fetched=0``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

from registry.catalog import Catalog
from registry.catalog.consumers import APPLIED, ConsumersCatalog, LeasableVersion, LeaseRequest
from registry.catalog.session import utcnow
from registry.errors import CheckpointNotFoundError, InvalidStateError, LagTimeoutError, RegistryError
from registry.format.refs import check_run_name
from registry.fs.validation import check_keep_days, check_timeout
from registry.ops.follow import PG_RECHECK_S, POLL_MAX_S, POLL_MIN_S, _Listener
from registry.ops.hostcopies import POLICY_CACHE, Materialize, host_copy, prune_host_copies
from registry.records import LoadInfo, PolicyLag

log = logging.getLogger(__name__)

MAX_BEAT_S = 10.0
MIN_BEAT_S = 0.05
NEWEST_FRESH_S = 1.0  # how long a process's shared answer to "the newest version" serves its consumers
LAG_RECHECK_S = 1.0  # wait_lag re-reads at least this often: a consumer expiring sends no notification
PRUNE_EVERY_S = 3600.0  # how often a hub forgets old loads (see ConsumerHub.prune_now_and_then)
KEEP_DAYS = 30.0


def _check_ttl(ttl: float) -> float:
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
        raise InvalidStateError(f"ttl must be a positive number of seconds, got {ttl!r}")
    return float(ttl)


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 255 or not name.isprintable():
        raise InvalidStateError(f"{what} must be a printable name of 1 to 255 characters, got {name!r}")
    return name


class ConsumerHub:
    """A process's one heartbeat thread and one listener for all its subscriptions (one per ``Registry``).

    Waiters read a run's generation before querying and wait for it to move: a notification that arrives
    between the query and the wait moves it, so no wake-up is lost. Two topics per run: ``steps`` (a step was
    published, verified, deleted ...) and ``consumers`` (a consumer applied a version, for ``wait_lag``).
    """

    def __init__(self, catalog: Catalog, *, keep_days: float = KEEP_DAYS) -> None:
        self.catalog = catalog
        self.consumers = ConsumersCatalog(catalog)
        self.keep_days = check_keep_days(keep_days)
        self._pruned_at: float | None = None
        self._lock = threading.Condition()
        self._subs: dict[int, Subscription] = {}
        self._generations: dict[tuple[str, str], int] = {}
        self._closed = False
        self._beat_wake = threading.Event()
        self.beating = threading.Lock()  # held while a beat is written: see Subscription.stop_heartbeat
        self._beater: threading.Thread | None = None
        self._listener: _Listener | None = None
        self._listening: threading.Thread | None = None
        # run -> (generation, monotonic time, newest policy version, when it was read): see newest()
        self._newest: dict[str, tuple[int, float, LeasableVersion | None, datetime]] = {}
        self._querying: dict[str, threading.Lock] = {}
        self._leases = threading.Condition()  # leases group-committed: see lease()
        self._queued: list[_Pending] = []
        self._leading = False
        if catalog.dialect == "postgresql":
            try:
                self._listener = _Listener(catalog)  # LISTEN now, before any waiter's first query
            except Exception:  # noqa: BLE001 - no listener: polling still answers correctly
                self._listener = None
            if self._listener is not None:
                self._listening = threading.Thread(target=self._listen, name="registry-policy-listener",
                                                   daemon=True)
                self._listening.start()

    # ------------------------------------------------------------------ subscriptions and heartbeats

    def add(self, sub: Subscription) -> None:
        with self._lock:
            if self._closed:
                raise InvalidStateError("this registry is closed")
            self._subs[sub.consumer_id] = sub
            if self._beater is None:
                self._beater = threading.Thread(target=self._beat, name="registry-policy-heartbeat", daemon=True)
                self._beater.start()
        self._beat_wake.set()  # a shorter ttl may shorten the interval

    def remove(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.pop(sub.consumer_id, None)

    def _interval(self) -> float:
        with self._lock:
            ttls = [s.ttl for s in self._subs.values() if s.heartbeating]
        return min(MAX_BEAT_S, max(MIN_BEAT_S, min(ttls, default=MAX_BEAT_S) / 3))

    def beat(self) -> int:
        """Heartbeat every subscription that still beats, in one transaction; how many."""
        with self.beating:
            with self._lock:
                beats = [(cid, s.ttl) for cid, s in self._subs.items() if s.heartbeating]
            if beats:
                self.consumers.heartbeat(beats)
            return len(beats)

    def _beat(self) -> None:
        while True:
            self._beat_wake.wait(self._interval())
            self._beat_wake.clear()
            if self._closed:
                return
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - a catalog hiccup: the next beat tries again, well within ttl
                log.warning("policy consumer heartbeat failed: %s", exc)
            try:
                self.prune_now_and_then()
            except Exception as exc:  # noqa: BLE001 - the log only grows meanwhile: the next hour tries again
                log.warning("forgetting old policy loads failed: %s", exc)

    def prune_now_and_then(self) -> int | None:
        """Keep the load audit from growing without end: forget loads that protect nothing and ended more than
        ``keep_days`` ago (see :meth:`ConsumersCatalog.prune_loads`), at most once per ``PRUNE_EVERY_S`` per
        process. How many were forgotten; None when it was not time yet."""
        now = time.monotonic()
        with self._lock:
            if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY_S:
                return None
            self._pruned_at = now
        forgotten = self.consumers.prune_loads(None, before=utcnow() - timedelta(days=self.keep_days))
        if forgotten:
            log.info("policy loads: forgot %d that ended more than %g days ago", forgotten, self.keep_days)
        return forgotten

    # ------------------------------------------------------------------ waking up

    def _listen(self) -> None:
        listener = self._listener
        while not self._closed and listener is not None:
            try:
                for note in listener.conn.notifies(timeout=0.5):
                    self._dispatch(note.payload)
            except Exception:  # noqa: BLE001 - connection lost: waiters poll every PG_RECHECK_S from now on
                if not self._closed:
                    log.warning("policy listener lost its connection; consumers fall back to slow polling")
                with self._lock:
                    self._listener = None
                    self._lock.notify_all()
                return

    def _dispatch(self, payload: str) -> None:
        try:
            note = json.loads(payload)
            runs = [note["run"]]
            topic = "consumers" if note.get("status") == APPLIED else "steps"
        except (ValueError, KeyError, TypeError):
            runs, topic = [run for run, _ in self._generations], "steps"  # unreadable: everyone looks again
        with self._lock:
            for run in runs:
                key = (run, topic)
                self._generations[key] = self._generations.get(key, 0) + 1
            followed = {sub.run for sub in self._subs.values()} if topic == "steps" else set()
        # The listener reads the newest version itself before it wakes anyone: a process's consumers, woken
        # first, would all be runnable at once and the one thread that queries would wait its turn for the GIL
        # behind them. Woken after, they find the answer cached for this generation.
        for run in runs:
            if run in followed:
                try:
                    self.newest(run, time.monotonic())
                except Exception as exc:  # noqa: BLE001 - the consumers woken below query for themselves
                    log.debug("reading the newest version of %s after a notification failed: %s", run, exc)
        with self._lock:
            self._lock.notify_all()

    def generation(self, run: str, topic: str) -> int:
        with self._lock:
            return self._generations.setdefault((run, topic), 0)

    def newest(self, run: str, since: float) -> tuple[LeasableVersion | None, datetime]:
        """``run``'s newest policy version (a verified step's, or a newer marker's) and when this process read
        it: one query per notification for all the process's consumers of the run (the others wait for it
        and share the answer), from a query that started at ``since`` (monotonic) or later: what the caller
        must see (its call began, or its wait began, then) a cached answer sees too.

        Safe because the generation is read before the query: a step whose notification moved the
        generation to ``g`` committed before that notification, so a query started at generation ``g`` sees
        it; one committed later moves the generation on and the next caller queries again. A cached answer
        is at most ``NEWEST_FRESH_S`` old, so the slow re-poll still finds what a lost notification
        announced; without a listener (SQLite, or a lost connection) at most ``POLL_MIN_S``: the polls of a
        process's consumers cost one query per poll interval between them.
        """
        fresh = NEWEST_FRESH_S if self._listener is not None else POLL_MIN_S
        with self._lock:
            flight = self._querying.setdefault(run, threading.Lock())
        with flight:
            gen = self.generation(run, "steps")
            hit = self._newest.get(run)
            if hit is not None and hit[0] == gen and hit[1] >= since and time.monotonic() - hit[1] < fresh:
                return hit[2], hit[3]
            started = time.monotonic()
            info = self._query_newest(run)
            seen = utcnow()
            self._newest[run] = (gen, started, info, seen)
            return info, seen

    def lease(self, request: LeaseRequest) -> LoadInfo | None:
        """``request``'s lease, group-committed with the other consumers of the process that ask meanwhile.

        The first to ask writes its lease at once; those that ask while it is
        in flight queue, and the next of them writes the whole queue in one
        transaction: a notification seen by 50 consumers of a process costs
        a couple of transactions, not 50, and nobody waits for a timer.
        """
        mine = _Pending(request)
        with self._leases:
            self._queued.append(mine)
            while mine.outcome is _WAITING and self._leading:
                self._leases.wait()
            if mine.outcome is _WAITING:
                self._leading = True
                batch, self._queued = self._queued, []
            else:
                batch = []
        if batch:
            outcomes: list[Any] = [RegistryError("lease batch interrupted")] * len(batch)
            try:
                outcomes = list(self.consumers.lease_many([p.request for p in batch]))
            except Exception as exc:  # noqa: BLE001 - every request of the batch hears of it
                outcomes = [exc] * len(batch)
            finally:
                with self._leases:
                    for pending, outcome in zip(batch, outcomes):
                        pending.outcome = outcome
                    self._leading = False
                    self._leases.notify_all()
        if isinstance(mine.outcome, BaseException):
            raise mine.outcome
        result: LoadInfo | None = mine.outcome
        return result

    def _query_newest(self, run: str) -> LeasableVersion | None:
        return self.consumers.next_version(run, None, newest=True)

    def waiter(self, run: str, *topics: str, recheck: float = PG_RECHECK_S) -> _Waiter:
        """A wait loop on ``run``'s ``topics``; with a listener it re-queries at least every ``recheck`` s."""
        return _Waiter(self, run, topics, recheck)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """End every subscription still open, stop the threads, close the listener."""
        with self._lock:
            subs = list(self._subs.values())
        for sub in subs:
            try:
                sub.close()
            except RegistryError as exc:
                log.warning("closing policy consumer %s of %s: %s", sub.consumer, sub.run, exc)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._beat_wake.set()
        for thread in (self._beater, self._listening):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=2)
        if self._listener is not None:
            try:
                self._listener.close()
            except Exception:  # noqa: BLE001 - closing a lost connection
                pass
            self._listener = None


_WAITING = object()


class _Pending:
    """A lease request in the hub's queue, and its outcome once a batch wrote it."""

    def __init__(self, request: LeaseRequest) -> None:
        self.request = request
        self.outcome: Any = _WAITING


class _Waiter:
    """One wait loop's wake-ups: a notification of the run (PostgreSQL) or a poll with backoff (SQLite)."""

    def __init__(self, hub: ConsumerHub, run: str, topics: tuple[str, ...], recheck: float) -> None:
        self.hub, self.run, self.topics, self.recheck = hub, run, topics, recheck
        self.delay = POLL_MIN_S
        self.seen = self.mark()

    def mark(self) -> tuple[int, ...]:
        return tuple(self.hub.generation(self.run, t) for t in self.topics)

    def sleep(self, remaining: float) -> None:
        """Return after a notification since :meth:`mark` (re-marking), or after a poll interval."""
        hub = self.hub
        if hub._listener is None:
            time.sleep(min(self.delay, remaining))
            self.delay = min(self.delay * 1.5, POLL_MAX_S)
            self.seen = self.mark()
            return
        deadline = time.monotonic() + min(remaining, self.recheck)
        with hub._lock:
            while (self.mark() == self.seen and not hub._closed and hub._listener is not None
                   and (left := deadline - time.monotonic()) > 0):
                hub._lock.wait(left)
        self.seen = self.mark()


class Subscription:
    """One registered consumer of a run's policy versions; close it (or use ``with``).

    Made by ``Registry.subscribe``. The heartbeat runs on the registry's
    shared thread; a consumer that stops heartbeating for ``ttl`` seconds
    expires, and then protects nothing from retention and counts for no lag.
    """

    def __init__(self, hub: ConsumerHub, run: str, consumer: str, *, ttl: float, host: str | None,
                 cache_dir: Path | None, materialize: Materialize, source: str) -> None:
        self.run = check_run_name(run)
        self.consumer = _check_name(consumer, "consumer")
        self.ttl = _check_ttl(ttl)
        self.host = _check_name(socket.gethostname() if host is None else host, "host")
        self.pid = os.getpid()
        self.cache_dir = cache_dir
        self._hub = hub
        self._materialize = materialize
        self._source = source  # a failed load's source: the root it was read through (no copy was read whole)
        self.heartbeating = True
        self._closed = False
        self._last_version: int | None = None
        self.consumer_id = hub.consumers.register(self.run, self.consumer, host=self.host, pid=self.pid,
                                                  ttl=self.ttl)
        hub.add(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Subscription {self.consumer!r} of {self.run!r} on {self.host}:{self.pid} ({state})>"

    def close(self) -> None:
        """End the consumer (``ended_at``) and release its leases; it protects nothing from now on."""
        if self._closed:
            return
        self._closed = True
        self._hub.remove(self)
        self._hub.consumers.end(self.consumer_id)

    def _prune(self) -> None:
        """Remove this host's copies of the run's versions older than any a live consumer here holds."""
        if self.cache_dir is None:
            return
        try:
            floor = self._hub.consumers.host_floor(self.run, self.host)
            if floor is not None:
                prune_host_copies(self.cache_dir / self.run, floor)
        except (RegistryError, OSError) as exc:  # the next apply tries again; the copies only take space
            log.warning("could not remove old policy copies of %s under %s: %s", self.run, self.cache_dir, exc)

    def stop_heartbeat(self) -> None:
        """Stop this consumer's heartbeats without ending it, as a hung worker would: it expires after ttl.
        Returns once no beat that began before is still being written."""
        self.heartbeating = False
        with self._hub.beating:
            pass

    def versions(self, *, newest_only: bool = True, timeout: float | None = None) -> Iterator[Lease]:
        """Yield a :class:`Lease` on each new verified policy version of the run, as it is verified.

        The first is the newest verified version there is; then each later
        one in version order, or with ``newest_only`` (default) only the newest
        of those that arrived while the caller was busy. A marker's version
        (``Registry.publish_policy_marker``) is yielded like a step's, as a
        lease with ``marker`` True and ``step`` None: apply it once the engine
        holds the bytes it got elsewhere. Stops after ``timeout`` seconds
        without a new version (``None``: never). A lease the caller did not
        apply is released when the next one is yielded (the consumer skipped
        it); an applied one stays until :meth:`Lease.release` or a later
        version is applied. Iterating again continues after the last version yielded.
        """
        check_timeout(timeout)
        if not isinstance(newest_only, bool):
            raise InvalidStateError(f"newest_only must be True or False, got {newest_only!r}")
        previous: Lease | None = None
        while True:
            skipped = previous if previous is not None and previous.applied_at is None else None
            lease = self._next(newest_only=newest_only, timeout=timeout, skipped=skipped)
            if lease is None:
                return
            previous = lease
            yield lease

    def _next(self, *, newest_only: bool, timeout: float | None, skipped: Lease | None) -> Lease | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = self._hub.waiter(self.run, "steps")
        newest = newest_only or self._last_version is None
        since = time.monotonic()
        while True:
            if self._closed:
                raise InvalidStateError(f"subscription {self.consumer!r} of {self.run} is closed")
            if newest:
                info, seen = self._hub.newest(self.run, since)
                if info is not None and self._last_version is not None and info.version <= self._last_version:
                    info = None
            else:
                info = self._hub.consumers.next_version(self.run, self._last_version)
                seen = utcnow()
            if info is not None:
                release = None if skipped is None or skipped.released else skipped.load.id
                load = self._hub.lease(LeaseRequest(self.consumer_id, self.run, info.step, seen, release,
                                                    info.version))
                if skipped is not None:
                    skipped.released = True  # released in the same transaction
                    skipped = None
                self._last_version = info.version
                if load is not None:
                    return Lease(self, load)
                continue  # gone between the query and the lease: look again
            remaining = math.inf if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return None
            since = time.monotonic()
            waiter.sleep(remaining)


class Lease:
    """One consumer's lease on one policy version: keeps it from retention until released.

    A lease on a marker's version (:attr:`marker`, ``step`` None) keeps nothing (there are no bytes) and
    cannot be materialized; :meth:`applied` records that the consumer serves it, without a check
    (``verified`` stays False: the engine got the bytes elsewhere and verifying them is its business).
    """

    def __init__(self, sub: Subscription, load: LoadInfo) -> None:
        self._sub = sub
        self.load = load
        self.run = load.run
        self.policy_version = load.version
        self.step = load.step
        self.path: Path | None = None
        self.verified = False
        self.applied_at: datetime | None = None
        self.released = False

    @property
    def marker(self) -> bool:
        """True for a marker's version: its bytes moved outside the registry (``publish_policy_marker``)."""
        return self.step is None

    def __repr__(self) -> str:
        what = "marker" if self.step is None else f"step {self.step}"
        return f"<Lease {self.run} policy version {self.policy_version} ({what}) by {self._sub.consumer}>"

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    def materialize(self) -> Path:
        """This host's directory holding the version's full weights (``model.safetensors``, ``config.json``).

        The first consumer of the host to ask fetches them (once, under a file
        lock) through ``Registry.materialize``, which checks them against the
        version's digest; the others wait for it and find them there. The load
        records the source, the bytes fetched (0 from the host's copy) and the
        outcome; a failed check is recorded (``verified=False``) and raised.
        ``InvalidStateError`` for a marker's version, recording nothing: there is nothing to fetch.
        """
        if self.step is None:
            raise InvalidStateError(f"version {self.policy_version} of {self.run} is a marker: its bytes moved "
                                    "outside the registry (publish_policy_marker); the engine got them elsewhere")
        if self.path is not None:
            return self.path
        if self.released:
            raise InvalidStateError(f"{self!r} was released; lease the version again")
        if self._sub.cache_dir is None:
            raise InvalidStateError(f"{self.run}: this root has no local directory for a host's policy copies: "
                                    "subscribe(..., cache_dir=DIR)")
        consumers = self._sub._hub.consumers
        try:
            path, source, fetched = host_copy(self._sub.cache_dir, self.run, self.policy_version, self.step,
                                               self._sub._materialize)
        except (RegistryError, OSError) as exc:
            consumers.fetched(self.load.id, source=self._sub._source, bytes_fetched=0, fetched_at=None,
                              verified=False, error=f"{type(exc).__name__}: {exc}")
            raise
        consumers.fetched(self.load.id, source=source, bytes_fetched=fetched, fetched_at=utcnow(), verified=True,
                          error=None)
        self.path, self.verified = path, True
        return path

    def applied(self) -> None:
        """This consumer now serves this version (refused unless it verified; a marker's needs no check);
        older leases are released, and the host's copies of versions no live consumer of the host holds any
        more are removed."""
        self._sub._hub.consumers.applied(self.load.id)
        self.applied_at = utcnow()
        self._sub._prune()

    def release(self) -> None:
        """Hold the version no more (a version being served stays kept by that alone)."""
        if not self.released:
            self._sub._hub.consumers.release(self.load.id)
            self.released = True


# ---------------------------------------------------------------------- the trainer's side


def wait_lag(hub: ConsumerHub, run: str, max_lag: int, *, timeout: float | None) -> PolicyLag:
    """Block until no live consumer of ``run`` lags more than ``max_lag`` versions (see ``PolicyLag.within``);
    the lag then. ``LagTimeoutError`` after ``timeout`` seconds."""
    check_run_name(run)
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
        raise InvalidStateError(f"max_lag must be a non-negative number of versions, got {max_lag!r}")
    check_timeout(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    waiter = hub.waiter(run, "consumers", "steps", recheck=LAG_RECHECK_S)
    while True:
        try:
            lag = hub.consumers.lag(run)
        except CheckpointNotFoundError:  # a trainer's first call, before it or any consumer made the run
            return PolicyLag(run=run, newest_version=None, newest_step=None, oldest_applied=None, lag=0,
                             pending=(), consumers=(), taken_at=utcnow())
        if lag.within(max_lag):
            return lag
        remaining = math.inf if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            behind = ", ".join(f"{c.name} ({'nothing' if c.applied_version is None else c.applied_version})"
                               for c in lag.consumers if c.live
                               and (c.applied_version is None or (lag.newest_version or 0) - c.applied_version
                                    > max_lag))
            raise LagTimeoutError(f"{run}: policy lag still above {max_lag} after {timeout} s (newest version "
                                  f"{lag.newest_version}; serving: {behind})", run=run)
        waiter.sleep(remaining)


__all__ = ["ConsumerHub", "Lease", "POLICY_CACHE", "Subscription", "wait_lag"]
