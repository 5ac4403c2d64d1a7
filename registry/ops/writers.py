"""Who writes a claim, and whether that writer is still alive: the protocol's notion of a live writer.

A claim (a ``staging`` row) names its writer with :func:`writer_id`; a later
claim, and fsck, take over a row only when :func:`writer_alive` says its
writer is gone. The publish refreshes its row every
``registry.ops.protocol.HEARTBEAT``, well inside :data:`STALE_AFTER`, so a
slow beat never looks like a dead writer.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
from datetime import datetime, timedelta, timezone
from pathlib import Path


_HOST = socket.gethostname()[:128]  # bounded so that a writer id fits the catalog's 255-character columns


@functools.cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "") or "-"
    except OSError:
        return "-"


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), None if no such process is running.

    "-" where ``/proc`` cannot tell (not Linux, or hidden by ``hidepid``) but
    the process exists. A zombie is not running: it is a writer that died and
    was not yet reaped.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "-"
    fields = raw.rpartition(b")")[2].split()  # the command name in parentheses may hold spaces
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()


_IDENTITY: tuple[int, str, str] | None = None  # (pid, "host:pid:boot:start", the process's own token)
_OPEN: set[str] = set()  # the tokens of this process's open writers (one per open Registry)


def _identity() -> tuple[int, str, str]:
    global _IDENTITY
    pid = os.getpid()
    if _IDENTITY is None or _IDENTITY[0] != pid:  # computed once per process, again in a forked child
        _IDENTITY = (pid, f"{_HOST}:{pid}:{_boot_id()}:{_process_start(pid) or '-'}", secrets.token_hex(4))
    return _IDENTITY


def writer_id(token: str | None = None) -> str:
    """A writer of a claim: ``host:pid:boot:start:token``, a string that never repeats.

    ``host:pid`` alone repeats: a restarted container has the same host name
    and the same low pid. The boot id and the process start time tell this
    process from any other that ever had its pid on this kernel, and the
    random token from any process elsewhere. ``token`` tells one writer
    within the process from another (an open ``Registry``'s, from
    :func:`open_writer`), so that two registries of one process never take
    over each other's live claims; None is the process's own.
    """
    _, process, own = _identity()
    return f"{process}:{token or own}"


def open_writer() -> str:
    """A token for a new writer of this process (:func:`writer_id`), alive until :func:`close_writer`."""
    token = secrets.token_hex(4)
    _OPEN.add(token)
    return token


def close_writer(token: str) -> None:
    """The writer ``token`` is done: its claims left behind may be taken over, as a dead process's are."""
    _OPEN.discard(token)


STALE_AFTER = timedelta(minutes=10)  # a staging row on another host not refreshed for this long is abandoned
_CLOCK_SLACK = timedelta(seconds=2)  # /proc/stat's boot time has whole seconds


def writer_alive(writer: str | None, updated_at: datetime | None = None) -> bool:
    """Whether the writer of a staging row last refreshed at ``updated_at`` may still be writing.

    A writer on this host and kernel (same host name and boot id) is alive
    while a process with its pid and start time runs: a different start time
    is another process that reuses the pid, such as the trainer of a
    restarted container. A writer elsewhere, or from another boot under this
    host name, cannot be asked, so its row decides: a publish refreshes its
    staging row while it writes (``registry.ops.protocol.HEARTBEAT``), and a row
    left unrefreshed for ``STALE_AFTER`` belongs to a writer that is gone,
    such as a preempted node whose job resumed elsewhere. A writer of this
    process is alive while its token is open (:func:`open_writer`). Without
    ``updated_at`` it is presumed alive. The row's time is the writer's clock
    and ``now`` is ours: hosts must agree to well within ``STALE_AFTER`` (NTP
    keeps them within milliseconds). Rows written as ``host:pid`` by earlier
    versions are judged by the pid, and by its start time against the row's.
    """
    if not writer or ":" not in writer:
        return False
    parts = writer.split(":")
    host, pid_text = parts[0], parts[1]
    local = host == _HOST and pid_text.isdigit() and len(parts) in (2, 5)
    if local and len(parts) == 5 and parts[2] != _boot_id():
        local = False  # another kernel under this name: a reboot, or a machine with the same host name
    if not local:
        if updated_at is None:
            return True
        return datetime.now(timezone.utc) - _utc(updated_at) < STALE_AFTER
    started = _process_start(int(pid_text))
    if started is None:
        return False
    if len(parts) == 5:
        same = started == "-" or parts[3] == "-" or started == parts[3]
        if same and int(pid_text) == os.getpid():  # this process: that writer's registry must still be open
            return parts[4] == _identity()[2] or parts[4] in _OPEN
        return same
    return updated_at is None or not _started_after(started, _utc(updated_at))


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def _started_after(started: str, moment: datetime) -> bool:
    """Whether the process that started ``started`` ticks after boot began after ``moment``."""
    if started == "-":
        return False
    try:
        stat_lines = Path("/proc/stat").read_text().splitlines()
        boot = next(int(line.split()[1]) for line in stat_lines if line.startswith("btime "))
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError):
        return False
    began = datetime.fromtimestamp(boot + int(started) / ticks, timezone.utc)
    return began > moment + _CLOCK_SLACK


__all__ = ["STALE_AFTER", "close_writer", "open_writer", "writer_alive", "writer_id"]
