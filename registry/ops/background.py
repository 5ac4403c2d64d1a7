"""The background publisher behind ``publish(..., blocking=False)``.

One worker thread runs queued publishes one at a time, in call order, so a
trainer's steps commit in step order. A failure is its future's exception and
is also kept here, to be raised once more (as ``AsyncPublishError``) by the
registry's next call: a trainer that never looks at its futures still hears
that a checkpoint was not saved.

Setting ``NICE`` above 0 runs the worker that many levels below the trainer
(Linux, where the scheduler's priority is per thread): when the cores are
busy, the trainer's threads go first and the checkpoint commits later.
Measured with ``./scripts/bench async`` on a loaded 2-core machine, a
Python-bound trainer kept a median 0.81 of its idle step rate during a
background publish against 0.59 at equal priority, and the commit took
1.0-2.2x as long. It is off by default: threads the worker starts inherit its
priority, and the process-wide pools can raise theirs back (``registry.pools``)
only with privilege (root or ``RLIMIT_NICE``); without it, a hashing pool first
started by the worker would stay slow for every later blocking load.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

from registry.errors import AsyncPublishError

T = TypeVar("T")
NICE = 0  # how many nice levels the background publisher runs below the process (opt-in; see above)


def lower_priority(nice: int) -> None:
    """Run the calling thread ``nice`` levels below the process, where the OS sets priorities per thread."""
    if nice <= 0 or not sys.platform.startswith("linux"):  # elsewhere PRIO_PROCESS would renice the process
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice))
    except OSError:
        pass  # a scheduling hint: refused by a sandbox, the publish runs as before


class BackgroundPublisher:
    def __init__(self, *, nice: int | None = None) -> None:
        self._nice = NICE if nice is None else nice
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self._pending: list[Future[Any]] = []
        self._errors: list[tuple[str, BaseException]] = []

    def _forked(self) -> None:
        """In a forked child the parent's worker, queue and lock holders do not exist: start afresh.

        The parent's pending publishes are the parent's to finish; waiting
        for them here would wait forever.
        """
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._worker, self._pending, self._errors = None, [], []

    def submit(self, name: str, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn`` (the publish of ``name``) behind every earlier one."""
        self._forked()
        def run() -> T:
            try:
                return fn()
            except BaseException as exc:
                with self._lock:  # recorded before the future completes, so wait() cannot miss it
                    self._errors.append((name, exc))
                raise

        with self._lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="registry-publish",
                                                  initializer=lower_priority, initargs=(self._nice,))
            future = self._worker.submit(run)
            self._pending.append(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[Any]) -> None:
        with self._lock:
            if future in self._pending:
                self._pending.remove(future)

    def pending(self) -> int:
        self._forked()
        with self._lock:
            return len(self._pending)

    def wait(self) -> None:
        """Block until every queued publish has committed or failed."""
        self._forked()
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            wait_futures(pending)
            with self._lock:  # done callbacks may still be running
                self._pending = [f for f in self._pending if not f.done()]

    def raise_error(self) -> None:
        """Raise the first failure not yet reported (once), as ``AsyncPublishError``."""
        self._forked()
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            name, first = errors[0]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise AsyncPublishError(f"background publish of {name} failed: {first}{more}") from first

    def shutdown(self) -> None:
        self._forked()
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
