"""This process's attempts at runs, and the metric points it buffers for them, under one lock.

An attempt is one process's stint of training (or evaluating) a run, started
lazily at its first metric or publish (``Registry.begin_attempt`` says what
it means for metrics). Metric points wait in a buffer until the next publish
of a step at or above theirs commits them in the same transaction, or until
:meth:`Attempts.flush`. The background publisher calls in from its own
thread, hence the lock.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from registry.catalog import Catalog, CommitRecord, PayloadRecord
from registry.ops.environment import environment

if TYPE_CHECKING:
    from registry.catalog.lineage import LineageRecord
    from registry.format.refs import Ref
    from registry.ops.protocol import CommitHooks

Fork = tuple[str, int, str | None]  # the (run, step, manifest digest) an attempt forked from
Point = tuple[int, str, float]  # (step, key, value), as the catalog records a metric point


class Attempts:
    """The attempts of this process at each run: ids, resume and fork points, what was published, buffered points."""

    def __init__(self, catalog: Catalog, writer: Callable[[], str]) -> None:
        self._catalog = catalog
        self._writer = writer
        self._lock = threading.RLock()
        self._ids: dict[str, int] = {}
        self._resumed_from: dict[str, int] = {}
        self._forks: dict[str, Fork] = {}  # run -> the checkpoint its attempt forked from
        self._published: set[str] = set()  # runs the current attempt has published to
        self._pending: dict[str, list[Point]] = {}
        self._last_step: dict[str, int] = {}  # the highest step this process logged or published at, per run

    def attempt(self, run: str) -> int:
        """This process's attempt at ``run``, started at the first call."""
        with self._lock:
            if run not in self._ids:
                self._ids[run] = self._catalog.start_attempt(
                    run, writer=self._writer(), resumed_from=self._resumed_from.get(run), fork=self._forks.get(run),
                    environment=json.dumps(environment(), sort_keys=True))
            return self._ids[run]

    def begin(self, run: str, *, resumed_from: int | None, fork: Fork | None) -> int:
        """A new attempt at ``run``: the points still buffered are flushed under the previous one first."""
        with self._lock:
            self.flush(run)
            self._published.discard(run)
            self._ids.pop(run, None)
            if fork is None:
                self._forks.pop(run, None)
            else:
                self._forks[run] = fork
            if resumed_from is None:
                self._resumed_from.pop(run, None)
            else:
                self._resumed_from[run] = resumed_from
            return self.attempt(run)

    def note_resume(self, ref: Ref, step: int, resume: bool | None) -> None:
        """Record that this attempt resumes ``ref.run`` from ``step``, when the load was a resume."""
        if resume is False or (resume is None and ref.names_one_step):
            return
        with self._lock:
            if ref.run not in self._published:
                self._resumed_from[ref.run] = step  # this attempt resumes from here
                return
        if resume:  # resuming again after publishing: a new attempt
            self.begin(ref.run, resumed_from=step, fork=None)

    def buffer(self, run: str, points: Sequence[Point]) -> None:
        with self._lock:
            self._pending.setdefault(run, []).extend(points)
            if points:
                self.saw_step(run, max(p[0] for p in points))

    def saw_step(self, run: str, step: int) -> None:
        with self._lock:
            self._last_step[run] = max(step, self._last_step.get(run, step))

    def last_step(self, run: str) -> int:
        """The highest step this process logged a metric or published at for ``run``; 0 before any."""
        with self._lock:
            return self._last_step.get(run, 0)

    def flush(self, run: str | None = None) -> None:
        """Make every buffered point (of ``run``, or of every run) durable, under its run's attempt."""
        with self._lock:
            for name in [run] if run is not None else list(self._pending):
                points = self._pending.get(name)
                if points:
                    self._catalog.add_metrics(name, points, attempt_id=self.attempt(name))
                self._pending.pop(name, None)

    def hooks(self, run: str, step: int, *, metrics: Sequence[Point], tags: Sequence[str],
              lineage: LineageRecord | None) -> CommitHooks:
        """The commit hooks of a publish of ``run@step`` (see :class:`registry.ops.protocol.CommitHooks`).

        The commit carries the points buffered up to ``step`` and ``metrics``;
        the buffered ones go back into the buffer if it fails.
        """
        return _PublishHooks(self, run=run, step=step, metrics=tuple(metrics), tags=tuple(tags), lineage=lineage)


class _PublishHooks:
    def __init__(self, attempts: Attempts, *, run: str, step: int, metrics: tuple[Point, ...], tags: tuple[str, ...],
                 lineage: LineageRecord | None) -> None:
        self.attempts, self.run, self.step = attempts, run, step
        self.metrics, self.tags, self.lineage = metrics, tags, lineage
        self.due: list[Point] = []  # the buffered points this commit took

    def record(self, payload: PayloadRecord) -> CommitRecord:
        a, run = self.attempts, self.run
        with a._lock:
            pending = a._pending.get(run, [])
            self.due.extend(m for m in pending if m[0] <= self.step)
            a._pending[run] = [m for m in pending if m[0] > self.step]
            resumed_from = a._resumed_from.get(run) if run not in a._published else None
        return CommitRecord(payload=payload, metrics=self.due + list(self.metrics), attempt_id=a.attempt(run),
                            tags=self.tags, resumed_from=resumed_from, lineage=self.lineage)

    def failed(self) -> None:
        a = self.attempts
        with a._lock:
            a._pending[self.run] = self.due + a._pending.get(self.run, [])

    def done(self) -> None:
        with self.attempts._lock:
            self.attempts._published.add(self.run)
            self.attempts.saw_step(self.run, self.step)


__all__ = ["Attempts", "Fork", "Point"]
