"""Async publish and the GIL: how long the trainer is blocked, and how fast a Python-bound trainer runs meanwhile.

Two questions about ``publish(..., blocking=False)``, answered in the same
run, interleaved round by round so that load from other processes hits every
variant alike:

(a) *blocked*: the time ``publish(blocking=False)`` takes to return (the
    snapshot) as a fraction of a blocking publish of the same state in the
    same round;
(b) *GIL*: the step rate of a trainer loop that is pure Python (dict and
    integer work, holding the GIL all the time) while the background publish
    runs, as a fraction of its idle rate (the mean of the idle windows just
    before and just after, in the same round).

Each variant starts a publish and is measured until it has committed:

- ``thread``: ``publish(blocking=False)`` in the trainer's interpreter (the
  background publisher thread shares the trainer's GIL), with the opt-in
  priority: its thread runs ``LOWERED`` nice levels below the trainer;
- ``thread, same priority``: the same with the publisher at the trainer's
  priority (``NICE`` = 0), the default;
- ``process``: the control. The same publish of the same state, run by a
  separate interpreter (its own GIL); it competes for the CPUs exactly like
  the thread does but cannot take the trainer's GIL. ``thread`` below
  ``process`` is what the GIL costs; ``process`` below 1.0 is what the CPUs
  cost (on a machine with few cores, busy with other work, that part is not
  the registry's to fix).

A sharded variant plugs in as one more entry of ``VARIANTS``.

    ./scripts/bench async [--mib 256] [--runs 5] [--dir DIR] [--url URL] [--switch-interval-ms MS]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from registry import Registry  # noqa: E402
from registry.ops.background import BackgroundPublisher  # noqa: E402

LOWERED = 10  # the opt-in registry.ops.background.NICE measured as "thread"

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
IDLE_WINDOW = 0.5  # seconds of idle stepping before and after each measured publish


def make_state(mib: int) -> dict[str, torch.Tensor]:
    """``mib`` MiB of fp32 weights in 4 MiB tensors, plus a few small ones (a trainer's usual mix)."""
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(max(1, mib // 4))}
    state.update({f"layers.{i}.norm": torch.ones(1024) for i in range(max(1, mib // 4))})
    return state


def python_step() -> int:
    """One trainer step that never releases the GIL: dict and integer work, about 0.1 ms."""
    acc: dict[int, int] = {}
    for i in range(400):
        acc[i & 31] = acc.get(i & 31, 0) + (i * 7) % 13
    return len(acc)


def schedstat() -> tuple[float, float]:
    """This thread's seconds on a CPU and seconds runnable but waiting for one (Linux schedstat)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            run_ns, wait_ns, _ = f.read().split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except OSError:
        return float("nan"), float("nan")


@dataclass(frozen=True)
class Window:
    """The trainer's steps over a stretch of wall time, and where that time went.

    ``wall = on_cpu + waiting_for_cpu + blocked``: ``waiting_for_cpu`` is the
    scheduler's run-queue wait (other processes, and our own threads, using
    the cores); ``blocked`` is time the thread slept, which for a loop that
    never does I/O is waiting for the GIL.
    """

    steps: int
    wall: float
    on_cpu: float
    waiting_for_cpu: float

    @property
    def blocked(self) -> float:
        return max(0.0, self.wall - self.on_cpu - self.waiting_for_cpu)

    @property
    def rate(self) -> float:
        return self.steps / self.wall

    @property
    def rate_given_a_cpu(self) -> float:
        """Steps per second of the time the thread had a core or could have run but for the GIL."""
        return self.steps / (self.wall - self.waiting_for_cpu)


_BLOCK = os.urandom(4 << 20)
TRAINERS: dict[str, Callable[[], object]] = {
    "sleeps (a GPU-bound trainer)": lambda: time.sleep(0.001),
    "computes, GIL released (hashlib over 4 MiB)": lambda: hashlib.sha256(_BLOCK),
    "computes, GIL held (pure Python)": python_step,
}


def step_until(done: Callable[[], bool]) -> Window:
    """The trainer stepping until ``done()`` (checked between steps)."""
    steps, (run0, wait0), t0 = 0, schedstat(), time.perf_counter()
    while not done():
        python_step()
        steps += 1
    wall, (run1, wait1) = time.perf_counter() - t0, schedstat()
    return Window(steps=steps, wall=wall, on_cpu=run1 - run0, waiting_for_cpu=wait1 - wait0)


def idle_window() -> Window:
    end = time.perf_counter() + IDLE_WINDOW
    return step_until(lambda: time.perf_counter() >= end)


# --------------------------------------------------------------------------- variants


@dataclass
class Started:
    returned_after: float           # seconds the trainer was blocked by the call
    done: Callable[[], bool]        # True once the publish has committed
    finish: Callable[[], Path]      # the committed step's directory (raises what the publish raised)


class ProcessPublisher:
    """A separate interpreter with its own registry and its own copy of the state, publishing on request."""

    def __init__(self, mib: int, url: str, root: Path) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, mib, url, str(root)), daemon=True)
        self._proc.start()
        assert self._conn.recv() == "ready"

    def start(self, run: str, step: int) -> Started:
        t0 = time.perf_counter()
        self._conn.send((run, step))
        returned = time.perf_counter() - t0
        got: list[object] = []

        def done() -> bool:
            if not got and self._conn.poll():
                got.append(self._conn.recv())
            return bool(got)

        def finish() -> Path:
            while not done():
                time.sleep(0.001)
            if isinstance(got[0], BaseException):
                raise got[0]
            return Path(str(got[0]))
        return Started(returned_after=returned, done=done, finish=finish)

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(timeout=30)


def _child(conn: Connection, mib: int, url: str, root: str) -> None:
    state = make_state(mib)
    with Registry.open(url=url, root=root) as reg:
        conn.send("ready")
        while (job := conn.recv()) is not None:
            run, step = job
            try:
                conn.send(str(reg.publish(run, step, state).path))
            except BaseException as exc:  # noqa: BLE001 - handed to the parent
                conn.send(exc)


def thread_variant(reg: Registry, state: dict[str, torch.Tensor]) -> Callable[[str, int], Started]:
    def start(run: str, step: int) -> Started:
        t0 = time.perf_counter()
        future = reg.publish(run, step, state, blocking=False)
        return Started(returned_after=time.perf_counter() - t0, done=future.done,
                       finish=lambda: future.result().path)
    return start


# --------------------------------------------------------------------------- measuring


def bench(mib: int, work: Path, runs: int, url: str | None) -> list[str]:
    url = url or f"sqlite:///{work / 'catalog.db'}"
    state = make_state(mib)
    size = sum(t.numel() * t.element_size() for t in state.values())
    reg = Registry.open(url=url, root=work / "root")
    reg._background = BackgroundPublisher(nice=LOWERED)  # no worker started yet: swapped before its first use
    same = Registry.open(url=url, root=work / "root")
    same._background = BackgroundPublisher(nice=0)  # no worker started yet: swapped before its first use
    child = ProcessPublisher(mib, url, work / "root")
    variants: dict[str, Callable[[str, int], Started]] = {
        "thread": thread_variant(reg, state),
        "thread, same priority": thread_variant(same, state),
        "process": child.start,
    }
    steps = iter(range(1, 1_000_000))
    blocking: list[float] = []
    returned: dict[str, list[float]] = {name: [] for name in variants}
    committed: dict[str, list[float]] = {name: [] for name in variants}
    busy: dict[str, list[Window]] = {name: [] for name in variants}
    idle: dict[str, list[Window]] = {name: [] for name in variants}  # the mean of the windows around each
    latency: dict[str, list[float]] = {kind: [] for kind in TRAINERS}  # "thread" variant, call to commit

    def publish_blocking() -> None:
        t0 = time.perf_counter()
        path = reg.publish("bench", next(steps), state).path
        blocking.append(time.perf_counter() - t0)
        shutil.rmtree(path)

    try:
        for round_ in range(runs + 1):  # round 0 warms up and is dropped
            publish_blocking()
            names = list(variants)
            names = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in names:
                before = idle_window()
                started = variants[name]("bench", next(steps))
                window = step_until(started.done)
                shutil.rmtree(started.finish())
                after = idle_window()
                returned[name].append(started.returned_after)
                committed[name].append(started.returned_after + window.wall)
                busy[name].append(window)
                idle[name].append(Window(before.steps + after.steps, before.wall + after.wall,
                                         before.on_cpu + after.on_cpu,
                                         before.waiting_for_cpu + after.waiting_for_cpu))
            for kind, trainer in TRAINERS.items():
                t0 = time.perf_counter()
                future = reg.publish("bench", next(steps), state, blocking=False)
                while not future.done():
                    trainer()
                latency[kind].append(time.perf_counter() - t0)
                shutil.rmtree(future.result().path)
            if round_ == 0:
                blocking.clear()
                for d in (returned, committed, busy, idle, latency):
                    for v in d.values():
                        v.clear()
    finally:
        child.close()
        reg.close()
        same.close()

    med = statistics.median
    all_idle = [w for ws in idle.values() for w in ws]
    lines = [f"\nstate: {size / 2**20:.0f} MiB in {len(state)} tensors; publish(verify=True) into {work}",
             f"background publisher priority: {LOWERED} nice levels below the trainer (\"thread\"), or equal",
             f"idle trainer: {med(w.rate for w in all_idle):.0f} steps/s (pure-Python steps); of its wall time "
             f"{med(w.waiting_for_cpu / w.wall for w in all_idle):.0%} waiting for a CPU",
             "",
             "| variant | blocking publish s | call returned after s | blocked / blocking | committed after s |",
             "|---|---:|---:|---:|---:|"]
    for name in variants:
        ratios = [r / b for r, b in zip(returned[name], blocking)]
        blocked = ("- | -" if name == "process" else f"{med(returned[name]):.4f} | {med(ratios):.3f}")
        lines.append(f"| {name} | {med(blocking):.3f} | {blocked} | {med(committed[name]):.3f} |")
    lines += ["",
              "Trainer during the publish (window: call returned -> committed), against the idle windows "
              "around it:",
              "",
              "| variant | steps/s / idle | share of wall: on a CPU | waiting for a CPU | blocked (GIL) "
              "| steps/s given a CPU / idle |",
              "|---|---:|---:|---:|---:|---:|"]
    for name in variants:
        w, i = busy[name], idle[name]
        lines.append(
            f"| {name} | {med(a.rate / b.rate for a, b in zip(w, i)):.2f} "
            f"| {med(a.on_cpu / a.wall for a in w):.0%} | {med(a.waiting_for_cpu / a.wall for a in w):.0%} "
            f"| {med(a.blocked / a.wall for a in w):.0%} "
            f"| {med(a.rate_given_a_cpu / b.rate_given_a_cpu for a, b in zip(w, i)):.2f} |")
    lines += ["", "Background publish (\"thread\"), call to commit, by what the trainer does meanwhile:", "",
              "| trainer | committed after s | x blocking publish |", "|---|---:|---:|"]
    for kind in TRAINERS:
        lines.append(f"| {kind} | {med(latency[kind]):.3f} "
                     f"| {med(t / b for t, b in zip(latency[kind], blocking)):.2f} |")
    lines.append("per-round blocked / blocking: " + "; ".join(
        f"{name} " + " ".join(f"{r / b:.2f}" for r, b in zip(returned[name], blocking))
        for name in variants if name != "process"))
    lines.append("per-round steps/s / idle: " + "; ".join(
        f"{name} " + " ".join(f"{a.rate / b.rate:.2f}" for a, b in zip(busy[name], idle[name]))
        for name in variants))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=int(os.environ.get("REGISTRY_BENCH_MIB", "256")))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the system disk)")
    parser.add_argument("--url", default=None, help="an empty catalog (default: a new SQLite file in the work dir)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval for the trainer's interpreter (Python's default: 5 ms)")
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    work = Path(tempfile.mkdtemp(prefix="bench-async-", dir=args.dir))
    try:
        lines = [f"command: ./scripts/bench async --mib {args.mib} --runs {args.runs}"
                 + (f" --dir {args.dir}" if args.dir else "")
                 + (f" --switch-interval-ms {args.switch_interval_ms:g}" if args.switch_interval_ms else ""),
                 f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
                 f"machine: {os.cpu_count()} cores, torch {torch.__version__}, switch interval "
                 f"{sys.getswitchinterval() * 1000:g} ms; medians of {args.runs} rounds after a warm-up, "
                 "variants interleaved; ratios are medians of per-round ratios"]
        lines += bench(args.mib, work, args.runs, args.url)
        lines.append(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print("\n".join(lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    threading.current_thread().name = "trainer"
    main()
