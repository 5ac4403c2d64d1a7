"""Process-wide thread pools that keep working in a forked child.

A ``ThreadPoolExecutor`` created in a parent is broken in a child made by
``os.fork()``: its worker threads do not exist there, yet an idle one had
released the executor's semaphore, so the executor starts no new thread and
work submitted in the child waits forever. A ``DataLoader`` worker or a
``multiprocessing`` child (fork is the default start method on Linux) that
publishes or verifies after its parent did would hang. A :class:`Pool`
creates its executor on first use and forgets it in a forked child, which
then creates its own.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
_POOLS: list[Pool] = []


class Pool:
    """A lazily created ``ThreadPoolExecutor`` of ``max_workers`` threads named ``name-N``."""

    def __init__(self, max_workers: int, name: str) -> None:
        self.max_workers = max_workers
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _POOLS.append(self)

    def _get(self) -> ThreadPoolExecutor:
        executor = self._executor
        if executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=self.max_workers,
                                                        thread_name_prefix=self._name,
                                                        initializer=_process_priority)
                executor = self._executor
        return executor

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return self._get().submit(fn, *args, **kwargs)

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any]) -> Iterator[T]:
        return self._get().map(fn, *iterables)

    def run_all(self, fn: Callable[..., object], jobs: Iterable[tuple[Any, ...]]) -> None:
        """``fn(*job)`` for every job on the pool; the first failure is raised once every job has stopped (those
        not started are cancelled), so nothing a job writes lands after this returns: the caller may close
        what they write into."""
        from concurrent.futures import wait
        futures = [self.submit(fn, *job) for job in jobs]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            wait(futures)
            raise

    def _forget_after_fork(self) -> None:
        self._executor = None
        self._lock = threading.Lock()


def _process_priority() -> None:
    """A worker started by a thread running at lower priority (the background publisher) takes the process's.

    Linux threads inherit their creator's nice level; a shared pool's worker
    must not keep the background publisher's for every later blocking publish
    or load. Raising a priority back needs privilege (root, or ``RLIMIT_NICE``);
    without it the worker keeps the lower one.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        process = os.getpriority(os.PRIO_PROCESS, os.getpid())
        if os.getpriority(os.PRIO_PROCESS, tid) != process:
            os.setpriority(os.PRIO_PROCESS, tid, process)
    except OSError:
        pass


def _after_fork_in_child() -> None:
    for pool in _POOLS:
        pool._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
