"""System metrics sampled on a daemon thread and logged as ``sys/*`` metric points of a run.

Each sample logs, through a ``log(values)`` callback (``Registry.log_metrics``
at the run's current step):

- ``sys/cpu_percent``: the machine's CPU busy since the previous sample, 0-100;
- ``sys/memory_used_bytes``: the machine's memory in use (total less available);
- ``sys/disk_read_bytes``, ``sys/disk_write_bytes``, ``sys/net_sent_bytes``,
  ``sys/net_recv_bytes``: bytes moved by the machine's disks and network
  interfaces since sampling started;
- where torch has initialised CUDA in this process, per device N:
  ``sys/gpuN/memory_allocated_bytes`` and ``sys/gpuN/memory_reserved_bytes``
  (this process's tensors and its caching allocator) and
  ``sys/gpuN/memory_used_bytes`` (the whole device, every process).

The counters come from psutil (the ``system`` extra) or, without it, from
Linux's ``/proc``. Sampling never imports torch nor initialises CUDA.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from registry.errors import InvalidStateError

log = logging.getLogger(__name__)

SECTOR = 512  # bytes per sector in /proc/diskstats, whatever the device's own sector size


@dataclass(frozen=True)
class Counters:
    """One reading of the machine's counters: CPU time busy and in all, memory in use, bytes moved."""

    cpu_busy: float
    cpu_total: float
    memory_used: int
    disk_read: int
    disk_write: int
    net_sent: int
    net_recv: int


def psutil_counters() -> Counters:
    import psutil
    cpu = psutil.cpu_times()
    idle = cpu.idle + getattr(cpu, "iowait", 0.0)
    total = sum(cpu)
    disk = psutil.disk_io_counters()
    net = psutil.net_io_counters()
    memory = psutil.virtual_memory()
    return Counters(cpu_busy=total - idle, cpu_total=total, memory_used=int(memory.total - memory.available),
                    disk_read=int(disk.read_bytes) if disk else 0, disk_write=int(disk.write_bytes) if disk else 0,
                    net_sent=int(net.bytes_sent) if net else 0, net_recv=int(net.bytes_recv) if net else 0)


def proc_counters(proc: str = "/proc", sys_block: str = "/sys/block") -> Counters:
    """The same counters from Linux's ``/proc`` (for a machine without psutil)."""
    with open(f"{proc}/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is counted in user already)
    cpu = fields[:8]
    total, idle = sum(cpu), cpu[3] + (cpu[4] if len(cpu) > 4 else 0.0)
    memory: dict[str, int] = {}
    with open(f"{proc}/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            memory[name] = int(rest.split()[0]) * 1024
    available = memory.get("MemAvailable", memory.get("MemFree", 0))
    try:
        disks = {name for name in os.listdir(sys_block) if not name.startswith(("loop", "ram"))}
    except OSError:
        disks = set()
    read = write = 0
    with open(f"{proc}/diskstats") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 10 and parts[2] in disks:  # whole disks only: a partition's bytes are its disk's
                read += int(parts[5]) * SECTOR
                write += int(parts[9]) * SECTOR
    sent = recv = 0
    with open(f"{proc}/net/dev") as f:
        for line in f.readlines()[2:]:
            _, _, rest = line.partition(":")
            values = rest.split()
            if len(values) >= 9:
                recv += int(values[0])
                sent += int(values[8])
    return Counters(cpu_busy=total - idle, cpu_total=total, memory_used=memory.get("MemTotal", 0) - available,
                    disk_read=read, disk_write=write, net_sent=sent, net_recv=recv)


def default_counters() -> Callable[[], Counters]:
    """psutil's counters where it is installed, else ``/proc``'s; ``InvalidStateError`` with neither."""
    try:
        import psutil  # noqa: F401
        return psutil_counters
    except ImportError:
        pass
    if os.path.exists("/proc/stat"):
        return proc_counters
    from registry.errors import install_hint
    raise InvalidStateError(f"system metrics need psutil on this platform: {install_hint('system')}")


def gpu_memory() -> dict[str, float]:
    """CUDA memory per device, where torch is imported and has initialised CUDA in this process."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return {}
    values: dict[str, float] = {}
    for device in range(cuda.device_count()):
        reserved = cuda.memory_reserved(device)
        values[f"sys/gpu{device}/memory_allocated_bytes"] = float(cuda.memory_allocated(device))
        values[f"sys/gpu{device}/memory_reserved_bytes"] = float(reserved)
        if reserved:  # this process has a context there already: asking costs nothing new
            free, total = cuda.mem_get_info(device)
            values[f"sys/gpu{device}/memory_used_bytes"] = float(total - free)
    return values


def values_between(start: Counters, before: Counters, now: Counters) -> dict[str, float]:
    """A sample's values: CPU busy since ``before``, memory now, bytes moved since ``start``."""
    elapsed = now.cpu_total - before.cpu_total
    busy = 100.0 * (now.cpu_busy - before.cpu_busy) / elapsed if elapsed > 0 else 0.0
    return {
        "sys/cpu_percent": min(100.0, max(0.0, busy)),
        "sys/memory_used_bytes": float(now.memory_used),
        "sys/disk_read_bytes": float(max(0, now.disk_read - start.disk_read)),
        "sys/disk_write_bytes": float(max(0, now.disk_write - start.disk_write)),
        "sys/net_sent_bytes": float(max(0, now.net_sent - start.net_sent)),
        "sys/net_recv_bytes": float(max(0, now.net_recv - start.net_recv)),
    }


class SystemSampler:
    """Samples every ``every`` seconds on a daemon thread and hands each sample to ``log``, until :meth:`stop`.

    A sample that fails (a counter unreadable, ``log`` raising) is logged as a warning and skipped; the next
    one is tried all the same.
    """

    def __init__(self, log_values: Callable[[Mapping[str, float]], None], *, every: float,
                 counters: Callable[[], Counters] | None = None, name: str = "registry-sys-metrics") -> None:
        if isinstance(every, bool) or not isinstance(every, (int, float)) or not 0 < every <= 86400:
            raise InvalidStateError(f"every must be a number of seconds in (0, 86400], got {every!r}")
        self.every = float(every)
        self._log = log_values
        self._counters = counters or default_counters()
        self._start = self._counters()  # read now: a platform that cannot is refused at once
        self._stop = threading.Event()
        self._sampled = threading.Condition()
        self.samples = 0
        self.last: dict[str, float] = {}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        before = self._start
        while not self._stop.wait(self.every):
            try:
                now = self._counters()
                values = values_between(self._start, before, now)
                values.update(gpu_memory())
                before = now
                self._log(values)
            except Exception as exc:  # noqa: BLE001 - a sampler must never end the training it watches
                log.warning("system metrics: a sample failed: %s", exc)
                continue
            with self._sampled:
                self.samples += 1
                self.last = values
                self._sampled.notify_all()

    def wait(self, samples: int = 1, timeout: float | None = None) -> bool:
        """Wait until ``samples`` samples were logged in all (or ``timeout`` seconds); whether they were."""
        with self._sampled:
            return self._sampled.wait_for(lambda: self.samples >= samples, timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        """Stop sampling; waits for a sample being logged to finish."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


__all__ = ["Counters", "SystemSampler", "default_counters", "gpu_memory", "proc_counters", "psutil_counters",
           "values_between"]
