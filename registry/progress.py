"""Progress of long work, reported through a callback: the library counts, the caller draws.

Verifying a 100 GB step takes most of a minute. The library never prints, so
long operations take an optional ``progress`` callable and call it with a
:class:`ProgressEvent` as they go; the command line turns those into bars on
a terminal (``registry.cli.terminal.progress_bar``), a script may log them, and
None (the default) costs nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ProgressEvent:
    """``done`` of ``total`` (None when unknown) units of ``task``, now at ``item`` (a step, a file)."""

    task: str
    done: int
    total: int | None
    unit: str = "bytes"
    item: str | None = None


ProgressFn = Callable[[ProgressEvent], None]


class Counter:
    """Adds up work done towards a total and reports each advance; a no-op without a callback; thread-safe."""

    def __init__(self, progress: ProgressFn | None, *, task: str, total: int | None, unit: str = "bytes") -> None:
        self.progress = progress
        self.task = task
        self.total = total
        self.unit = unit
        self.done = 0
        self._lock = threading.Lock()

    def advance(self, amount: int, *, item: str | None = None) -> None:
        if self.progress is None:
            return
        with self._lock:  # one event at a time, in order, from whichever thread did the work
            self.done += amount
            self.progress(ProgressEvent(task=self.task, done=self.done, total=self.total, unit=self.unit, item=item))


__all__ = ["Counter", "ProgressEvent", "ProgressFn"]
