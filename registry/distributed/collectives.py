"""Collectives with a deadline, and failures that every rank raises alike.

Why not ``broadcast_object_list``? It has no deadline: a rank that died
leaves the others waiting for the process group's timeout (30 minutes by
default), and it cannot say *which* rank failed. Here every collective is
started asynchronously and waited on with the caller's timeout, and any
failure of the transport becomes a :class:`DistributedError` naming the step
of the protocol that broke. Failures of the load itself travel as
:class:`Failure` values (type name, message, rank, and the run, step and
path the error names) so that every rank raises the very same
``RegistryError`` subclass with the same attributes.

Payload bytes move in flat uint8 buckets (:func:`transfer`): one collective
per bucket, never per small tensor; a large tensor goes straight from rank
0's file mapping into the storage each receiver allocated for it alone.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from registry import errors
from registry.crashpoints import crashpoint
from registry.fs.mapping import host_view
from registry.pools import Pool

_POOL = Pool(1, "registry-load-hash")
ALONE = 4 << 20  # a piece this big travels alone: one more collective costs less than copying it out of a bucket


def active() -> bool:
    """Whether there is a process group with more than one rank to agree with."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def as_timedelta(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        if isinstance(timeout, timedelta) and timeout.total_seconds() <= 0:
            raise errors.InvalidStateError(f"timeout must be positive, got {timeout}")
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise errors.InvalidStateError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return timedelta(seconds=float(timeout))


@dataclass(frozen=True, kw_only=True)
class Failure:
    """An exception reduced to what can cross the network and be raised again."""

    kind: str
    message: str
    rank: int
    corrupt: bool = False
    retry: bool = False  # rank 0 fell back to an older step; everyone goes round again
    run: str | None = None
    step: int | None = None
    path: str | None = None

    @classmethod
    def of(cls, exc: BaseException, rank: int) -> Failure:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(exc, errors.RegistryError):
            return cls(kind=type(exc).__name__, message=text, rank=rank)
        return cls(kind=type(exc).__name__, message=text, rank=rank,
                   corrupt=isinstance(exc, errors.CorruptCheckpointError), run=exc.run, step=exc.step,
                   path=str(exc.path) if exc.path is not None else None)

    def error(self) -> errors.RegistryError:
        """The same RegistryError subclass on every rank; anything else as DistributedError."""
        cls = getattr(errors, self.kind, None)
        if isinstance(cls, type) and issubclass(cls, errors.RegistryError):
            try:
                return cls(self.message, run=self.run, step=self.step, path=self.path)
            except TypeError:  # a subclass with a different constructor
                pass
        return errors.DistributedError(f"rank {self.rank} failed: {self.kind}: {self.message}",
                                       run=self.run, step=self.step, path=self.path)


def first_failure(statuses: list[Failure | None]) -> Failure | None:
    """Rank 0's failure if any, else the lowest rank's: the one every rank raises."""
    return next((s for s in statuses if s is not None), None)


class Judge(Protocol):
    """What judges a failure to read a candidate step (``registry.ops.reading.CatalogRead``)."""

    def judge(self, exc: BaseException) -> None: ...

    @property
    def notes(self) -> list[str]: ...


def status(fn: Callable[[], Any], rank: int) -> tuple[Any, Failure | None]:
    """``fn()`` and None, or None and its failure, to be gathered (a lost peer is raised at once)."""
    try:
        return fn(), None
    except errors.DistributedError:
        raise
    except Exception as exc:  # noqa: BLE001 - gathered, then raised on every rank alike
        return None, Failure.of(exc, rank)


def _verdict(judge: Judge, failure: Failure) -> Failure:
    """Rank 0's judgement of ``failure``: a retry (with the fall-back notes) or what the load ends with."""
    try:
        judge.judge(failure.error())
    except Exception as exc:  # noqa: BLE001 - the load is over: every rank raises this
        return Failure.of(exc, 0)
    notes = "\n".join(judge.notes)  # none when it lost a race: no warning
    judge.notes.clear()
    return Failure(kind=failure.kind, message=notes, rank=0, corrupt=failure.corrupt, retry=True)


def settle(comm: Any, judge: Judge | None, mine: Failure | None, what: str) -> bool:
    """One agreement round of a load: gather every rank's status; True to go round again, False when all are fine.

    Rank 0 (which holds ``judge``, the catalog read) judges one failure: its
    own if it has one, of whatever kind (a step replaced meanwhile is a race
    and is resolved again, a reader's own trouble ends the load with
    ``CheckpointReadError``, a corrupt step is marked and an older one tried);
    otherwise the first *corrupt* status of any other rank, since a sharded
    load checks a share of the pieces on every rank, so any rank's checksum
    failure is evidence against the step (that takes one broadcast more, and
    only then). Every other failure is raised on every rank alike, rank 0's
    first. Without a ``judge`` (a directory, not a ref) nothing is judged.
    """
    if comm.rank == 0 and mine is not None and judge is not None:
        mine = _verdict(judge, mine)
    statuses: list[Failure | None] = comm.all_gather_object(mine, what)
    head = statuses[0]
    if head is None:
        other = next((s for s in statuses if s is not None and s.corrupt), None)
        if other is not None:  # every rank sees it in the same list, so every rank joins the broadcast
            head = comm.broadcast_object(_verdict(judge, other) if comm.rank == 0 and judge is not None else None,
                                         what)
    if head is not None and head.retry:
        for note in head.message.splitlines():
            warnings.warn(note, RuntimeWarning, stacklevel=4)
        return True
    failure = head if head is not None else first_failure(statuses)
    if failure is not None:
        raise failure.error()
    return False


class Solo:
    """The collectives of a group of one: a load or publish without a process group runs the same code."""

    rank = 0
    world = 1
    group = None

    def broadcast_object(self, obj: Any, what: str) -> Any:
        return obj

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        return [obj]


def agree(comm: Any, request: tuple[Any, ...], local: BaseException | None, *, differ: str, advice: str) -> None:
    """The first collective of every call: each rank's request and argument error, raised on every rank alike.

    Any rank's error is every rank's (rank 0's first); otherwise ranks that
    asked for different things all raise ``DistributedError`` ("ranks
    ``differ`` (rank 0: ...; rank 1: ...); ``advice``"). ``comm`` is a
    :class:`Comm` or anything with its ``rank`` and ``all_gather_object``.
    """
    mine = Failure.of(local, comm.rank) if local is not None else None
    gathered = comm.all_gather_object((request, mine), "agreeing on the request")
    failure = first_failure([f for _, f in gathered])
    if failure is not None:
        raise failure.error()
    if any(req != gathered[0][0] for req, _ in gathered):
        described = "; ".join(f"rank {r}: {req}" for r, (req, _) in enumerate(gathered))
        raise errors.DistributedError(f"ranks {differ} ({described}); {advice}")


class Comm:
    """A process group (the default one unless ``group`` is given), its device, and a per-collective deadline."""

    def __init__(self, *, timeout: float | timedelta | None, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0  # the group's rank 0
        self.backend = str(dist.get_backend(group))
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self.timeout = as_timedelta(timeout)

    def _fail(self, what: str, exc: BaseException) -> errors.DistributedError:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        limit = f" (timeout {self.timeout.total_seconds():g}s)" if self.timeout is not None else ""
        return errors.DistributedError(f"{what} failed on rank {self.rank}{limit}: {text}")

    def _wait(self, start: Any, what: str) -> None:
        try:
            work = start()
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timeout=self.timeout)
        except Exception as exc:  # dead peer, closed socket, timeout: all the same to the caller
            raise self._fail(what, exc) from None

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self._wait(lambda: dist.broadcast(tensor, src=self.src, group=self.group, async_op=True), what)

    def broadcast_object(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` on every rank (pickled: the peers are the same job, same trust)."""
        if self.rank == 0:
            raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(raw)], dtype=torch.int64, device=self.device)
        else:
            raw = b""
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(size, what)
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(buf, what)
        return obj if self.rank == 0 else pickle.loads(buf.cpu().numpy().tobytes())

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(raw)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        self._wait(lambda: dist.all_gather(sizes, size, group=self.group, async_op=True), what)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else mine[:0]
        mine = mine.to(self.device)
        bufs = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        self._wait(lambda: dist.all_gather(bufs, mine, group=self.group, async_op=True), what)
        return [pickle.loads(b[:int(s.item())].cpu().numpy().tobytes()) for b, s in zip(bufs, sizes)]


# --------------------------------------------------------------------------- moving bytes in buckets


def buckets(sizes: list[int], limit: int) -> list[list[tuple[int, int, int]]]:
    """(unit, offset, length) pieces per bucket, in byte order; big units alone, small ones packed together.

    The order lets rank 0 hash each file as its bytes go out, piece after piece.
    """
    out: list[list[tuple[int, int, int]]] = []
    packed: list[tuple[int, int, int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if size == 0:
            continue
        if size >= max(1, min(limit // 8, ALONE)):
            if packed:
                out.append(packed)
                packed, used = [], 0
            out.extend([[(i, start, min(limit, size - start))] for start in range(0, size, limit)])
            continue
        if packed and used + size > limit:
            out.append(packed)
            packed, used = [], 0
        packed.append((i, 0, size))
        used += size
    if packed:
        out.append(packed)
    return out


def _runs(units: list[tuple[int, int, int]], pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """A bucket's pieces as (file, offset, length) ranges, pieces adjacent in one file merged."""
    out: list[tuple[int, int, int]] = []
    for u, start, length in pieces:
        f, offset, _ = units[u]
        if out and out[-1][0] == f and out[-1][1] + out[-1][2] == offset + start:
            out[-1] = (f, out[-1][1], out[-1][2] + length)
        else:
            out.append((f, offset + start, length))
    return out


def _hash_runs(hashers: list[Any], sources: list[torch.Tensor], runs: list[tuple[int, int, int]]) -> None:
    for f, start, length in runs:
        view = host_view(sources[f][start:start + length])
        for at in range(0, length, 16 << 20):
            hashers[f].update(view[at:at + (16 << 20)])


def transfer(comm: Comm, layouts: list[list[int]], sources: list[torch.Tensor] | None, *, limit: int,
             hash_files: bool) -> tuple[list[list[torch.Tensor]], list[str] | None]:
    """Broadcast rank 0's files into storages of their own on the others, one per piece of each file.

    ``layouts[f]`` lists the lengths of file f's pieces (see
    ``filemaps.layout``); a receiving rank gets, per file, one buffer per
    piece, so a tensor parsed from a piece owns exactly its bytes and keeps
    nothing else alive. A piece big enough travels alone, straight into its
    buffer; small ones travel packed in a bucket and are copied out of it.
    Rank 0 sends straight from its sources whatever is one range of one file,
    and gets its sources back, one piece per file. On rank 0, each bucket is
    hashed (sha256 per file) on a worker thread while it is on the wire, so
    verification costs no extra pass over the bytes.
    """
    root = comm.rank == 0
    units = [(f, offset, length) for f, lengths in enumerate(layouts)
             for offset, length in zip(itertools.accumulate([0, *lengths]), lengths)]
    sizes = [length for _, _, length in units]
    bufs: list[torch.Tensor | None] = [None] * len(units)
    plan = [(pieces, _runs(units, pieces)) for pieces in buckets(sizes, limit)]
    on_host = comm.device.type == "cpu"

    def direct(pieces: list[tuple[int, int, int]], runs: list[tuple[int, int, int]]) -> bool:
        return on_host and len(runs if root else pieces) == 1

    staged = [sum(p[2] for p in pieces) for pieces, runs in plan if not direct(pieces, runs)]
    stage = torch.empty(max(staged), dtype=torch.uint8, device=comm.device) if staged else None
    hashers = [hashlib.sha256() for _ in layouts] if root and hash_files else None
    for pieces, runs in plan:
        total = sum(p[2] for p in pieces)
        if root:
            assert sources is not None
            if direct(pieces, runs):
                f, start, length = runs[0]
                wire = sources[f][start:start + length]
            else:
                assert stage is not None
                wire = stage[:total]
                at = 0
                for f, start, length in runs:
                    wire[at:at + length].copy_(sources[f][start:start + length])
                    at += length
        elif direct(pieces, runs):
            u, start, length = pieces[0]
            if bufs[u] is None:
                bufs[u] = torch.empty(sizes[u], dtype=torch.uint8)
            wire = bufs[u][start:start + length]  # type: ignore[index]
        else:
            assert stage is not None
            wire = stage[:total]
        pending: Future[None] | None = None
        if hashers is not None:
            assert sources is not None
            pending = _POOL.submit(_hash_runs, hashers, sources, runs)
        try:
            comm.broadcast(wire, "checkpoint bucket broadcast")
        finally:
            if pending is not None:
                pending.result()
        if not root and not direct(pieces, runs):
            host = wire if wire.device.type == "cpu" else wire.cpu()  # one device copy per bucket, not per piece
            for (u, start, length), part in zip(pieces, torch.split(host, [p[2] for p in pieces])):
                if length == sizes[u]:
                    bufs[u] = part.clone()  # a whole small piece: a storage of its own, nothing shared
                    continue
                if bufs[u] is None:
                    bufs[u] = torch.empty(sizes[u], dtype=torch.uint8)
                bufs[u][start:start + length].copy_(part)  # type: ignore[index]
        crashpoint("loader-after-bucket")
    if root:
        assert sources is not None
        return [[buf] for buf in sources], ([h.hexdigest() for h in hashers] if hashers is not None else None)
    got: list[list[torch.Tensor]] = [[] for _ in layouts]
    for (f, _, _), buf in zip(units, bufs):
        got[f].append(buf if buf is not None else torch.empty(0, dtype=torch.uint8))
    return got, None


__all__ = ["Comm", "Failure", "Judge", "Solo", "active", "as_timedelta", "buckets", "first_failure", "settle", "status",
           "transfer"]
