"""What the command line draws rather than tabulates: curves in the terminal, wide and CSV metric tables, progress.

Optional parts (``plotext``, ``rich``) come with the ``ui`` extra and are
imported only when asked for, so ``registry`` keeps starting without them.
"""

from __future__ import annotations

import csv
import io
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from registry.errors import RegistryError, install_hint
from registry.progress import ProgressEvent, ProgressFn
from registry.records import CheckpointInfo, MetricPoint, human_bytes

# one colour per status, the same as the web view's (registry/web/static/chart.js)
STATUS_COLOURS = {"verified": (46, 160, 67), "published": (31, 111, 235), "corrupt": (207, 34, 46),
                  "deleted": (140, 140, 140), "failed": (191, 135, 0), "staging": (130, 80, 223)}


class MissingExtraError(RegistryError, ImportError):  # type: ignore[misc]
    """An optional part of the command line whose package is not installed."""


def require(module: str, what: str) -> Any:
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(f"{what} needs {module}: {install_hint('ui')}") from None


def wide_rows(points: Sequence[MetricPoint]) -> tuple[list[str], list[list[Any]]]:
    """Steps by keys: the header (``step`` then each key) and one row per step, None where nothing was logged."""
    keys = sorted({p.key for p in points})
    column = {k: i for i, k in enumerate(keys, start=1)}
    rows: dict[int, list[Any]] = {}
    for p in points:
        row = rows.setdefault(p.step, [p.step] + [None] * len(keys))
        row[column[p.key]] = p.value
    return ["step", *keys], [rows[s] for s in sorted(rows)]


def to_csv(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([["" if v is None else (repr(v) if isinstance(v, float) else v) for v in row] for row in rows])
    return out.getvalue()


def plot(points: Sequence[MetricPoint], checkpoints: Sequence[CheckpointInfo], *, run: str, key: str,
         width: int, height: int, colour: bool) -> str:
    """The curve of ``key`` with a marker on it at every checkpoint, coloured by status, tags written above.

    Long curves are downsampled like the web view's (each bucket's min and max,
    every checkpointed step kept), so a million points draw as fast as a hundred.
    """
    from registry.views import downsample
    plt = require("plotext", "--plot")
    values = {p.step: p.value for p in points}
    curve = downsample([(p.step, p.value) for p in points], buckets=max(10, width), keep_steps=values)
    fig = plt.figure
    fig.clear()
    fig.plot_size(width, height)
    if not colour:
        fig.theme("colorless")
    fig.title(f"{run}  {key}  ({plural(len(points), 'point')}, {plural(len(checkpoints), 'checkpoint')})")
    fig.draw(fig.signal([s for s, _ in curve], [v for _, v in curve], marker="hd").lines())
    by_status: dict[str, list[tuple[int, float]]] = {}
    for info in checkpoints:
        if info.step in values:
            by_status.setdefault(str(info.status), []).append((info.step, values[info.step]))
    markers = {"verified": "●", "published": "○", "corrupt": "✖", "deleted": "·", "failed": "×", "staging": "◌"}
    for status, marks in sorted(by_status.items()):
        signal = fig.signal([s for s, _ in marks], [v for _, v in marks], marker=markers.get(status, "o"))
        fig.draw(signal.label(f"{markers.get(status, 'o')} {status}"))
    first, last = curve[0][0], curve[-1][0]
    pad = max(0.5, (last - first) * 0.03)  # a marker or tag at either end stays inside the frame
    middle = (first + last) / 2
    for info in checkpoints:
        if info.tags and info.step in values:
            # drawn over the point, with its marker in the text: a tag near the right edge ends at its point
            marker, tags = markers.get(str(info.status), "o"), ",".join(info.tags)
            right = info.step > middle
            fig.draw(fig.text(info.step, values[info.step], f"{tags} {marker}" if right else f"{marker} {tags}",
                              alignment="right" if right else "left"))
    fig.ruler("x").lim(first - pad, last + pad)
    fig.ruler("x").ticks(integer_ticks(first, last))
    low, high = min(v for _, v in curve), max(v for _, v in curve)
    spread = (high - low) * 0.05 or abs(high) * 0.5 or 1.0
    fig.ruler("y").lim(low - spread, high + spread)
    descends = curve[-1][1] <= (low + high) / 2
    # the legend goes in the corner the curve leaves empty: top right for a falling curve, bottom right for a rising one
    fig.legend(x=last + pad, y=high + spread if descends else low - spread, ha="right",
               va="top" if descends else "bottom", relative=True)
    fig.label("step", "x")
    out = fig.build()
    text = str(out)
    return text if colour else plt.uncolorize(text)


def integer_ticks(first: int, last: int, *, most: int = 7) -> list[int]:
    """At most ``most`` whole steps between ``first`` and ``last``, a round spacing apart (1, 2, 5, 10, 20, ...)."""
    span, magnitude = max(0, last - first), 1
    while True:
        spacing = next((f * magnitude for f in (1, 2, 5) if span <= (most - 1) * f * magnitude), None)
        if spacing is not None:
            break
        magnitude *= 10
    start = -(-first // spacing) * spacing  # the first multiple of the spacing at or after ``first``
    return list(range(start, last + 1, spacing)) or [first]


def plural(count: int, word: str, words: str | None = None) -> str:
    """``1 problem``, ``3 problems``: a count with its noun."""
    return f"{count} {word if count == 1 else (words or word + 's')}"


def progress_done(event: ProgressEvent) -> str:
    """``1.5 GiB/4.0 GiB`` for bytes, ``2/9 checkpoints`` for anything else counted."""
    if event.unit != "bytes":
        return f"{event.done}/{event.total if event.total is not None else '?'} {event.unit}"
    if event.total is None:
        return human_bytes(event.done)
    return f"{human_bytes(event.done)}/{human_bytes(event.total)}"


@contextmanager
def progress_bar(*, enabled: bool) -> Iterator[ProgressFn | None]:
    """A :data:`~registry.progress.ProgressFn` that draws ``rich`` bars on stderr, or None when off.

    Off unless stderr is a terminal: piped output and ``--json`` stay clean;
    off too without ``rich`` (the ``ui`` extra): bars are a nicety, never a reason to fail.
    """
    try:
        import rich.progress as rich_progress
        from rich.console import Console
    except ImportError:
        enabled = False
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.text import Text

    class Amount(rich_progress.ProgressColumn):
        """Sizes and speeds as every table writes them (KiB, MiB: human_bytes), not rich's decimal kB and MB."""

        def render(self, task: Any) -> Any:
            total = None if task.total is None else int(task.total)
            event = ProgressEvent(task="", done=int(task.completed), total=total, unit=task.fields["unit"])
            speed = task.finished_speed or task.speed
            per_second = f"  {human_bytes(int(speed))}/s" if speed and event.unit == "bytes" else ""
            return Text(progress_done(event) + per_second)

    bars = rich_progress.Progress(
        rich_progress.TextColumn("{task.description}"), rich_progress.BarColumn(), Amount(),
        rich_progress.TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    tasks: dict[str, Any] = {}

    def update(event: ProgressEvent) -> None:
        task = tasks.get(event.task)
        if task is None:
            task = tasks[event.task] = bars.add_task(event.task, total=event.total, unit=event.unit)
        bars.update(task, completed=event.done, total=event.total,
                    description=f"{event.task} {event.item}" if event.item else event.task)
    with bars:
        yield update


__all__ = ["MissingExtraError", "STATUS_COLOURS", "integer_ticks", "plot", "plural", "progress_bar", "progress_done",
           "to_csv", "wide_rows"]
