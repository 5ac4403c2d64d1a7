"""Followers: processes that wait for the checkpoints a trainer publishes.

Rollout workers and evaluators follow a run from other processes and other
machines. The catalog is the only thing they trust: a step is returned only
after a catalog query shows it ``verified``, so a step whose publish has not
committed is never seen.

Waking up:

- PostgreSQL: ``Catalog.commit_publish`` (and a move to ``verified``) sends
  ``pg_notify('registry_checkpoints', {run, step, status})`` inside its
  transaction, so the notification is delivered only after the commit. The
  follower LISTENs on a dedicated connection *before* its first query (no
  lost wake-up between query and wait) and re-queries on every notification
  for its run name. The payload only says "look again": other schemas of
  the same database may use the same run names. A slow re-poll covers a
  dropped listener connection.
- SQLite has no notifications: the follower polls one indexed query, backing
  off from 10 ms to 100 ms; each poll costs well under a millisecond.
"""

from __future__ import annotations

import json
import math
import time
from types import TracebackType
from typing import Any

from registry.catalog import Catalog
from registry.catalog.queries import NOTIFY_CHANNEL
from registry.records import CheckpointInfo
from registry.format.refs import check_run_name, check_step
from registry.fs.validation import check_timeout

POLL_MIN_S = 0.01
POLL_MAX_S = 0.1
PG_RECHECK_S = 5.0  # a re-query even without notifications, in case the listener lost its connection


class _Listener:
    """A dedicated autocommit psycopg connection LISTENing on the registry's channel."""

    def __init__(self, catalog: Catalog) -> None:
        import psycopg

        cargs, cparams = catalog.engine.dialect.create_connect_args(catalog.engine.url)
        self.conn: Any = psycopg.connect(*cargs, **cparams, autocommit=True, connect_timeout=10)
        self.conn.execute(f"LISTEN {NOTIFY_CHANNEL}")

    def wait(self, run: str, timeout: float) -> None:
        """Return when a notification about ``run`` arrives or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            for note in self.conn.notifies(timeout=remaining, stop_after=1):
                try:
                    about = json.loads(note.payload).get("run")
                except (ValueError, AttributeError):
                    return  # unreadable: look again rather than miss something
                if about == run:
                    return

    def close(self) -> None:
        self.conn.close()


class Follower:
    """Waits for new steps of one run; keeps its listener open between waits."""

    def __init__(self, catalog: Catalog, run: str, *, newest: bool = False,
                 min_policy_version: int | None = None, durable: bool = False) -> None:
        self.catalog = catalog
        self.durable = durable  # only steps with a verified durable copy (a root with tiers)
        self.run = check_run_name(run)
        self.newest = newest
        self.min_policy_version = None if min_policy_version is None else check_step(min_policy_version)
        self._listener: _Listener | None = None
        if catalog.dialect == "postgresql":
            try:
                self._listener = _Listener(catalog)
            except Exception:  # noqa: BLE001 - no listener: polling still answers correctly
                self._listener = None

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _query(self, after_step: int | None) -> CheckpointInfo | None:
        return self.catalog.next_after(self.run, after_step, newest=self.newest,
                                       min_policy_version=self.min_policy_version, durable=self.durable)

    def wait(self, after_step: int | None, *, timeout: float | None) -> CheckpointInfo | None:
        """The next verified step above ``after_step`` (``None``: any), or ``None`` after ``timeout`` s."""
        if after_step is not None:
            check_step(after_step)
        check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_MIN_S
        while True:
            info = self._query(after_step)
            if info is not None:
                return info
            remaining = math.inf if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._listener is not None:
                try:
                    self._listener.wait(self.run, min(remaining, PG_RECHECK_S))
                except Exception:  # noqa: BLE001 - connection lost: fall back to polling
                    self.close()
                continue
            time.sleep(min(delay, remaining))
            delay = min(delay * 1.5, POLL_MAX_S)


__all__ = ["Follower"]
