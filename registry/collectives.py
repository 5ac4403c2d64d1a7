"""Collectives with a deadline, and failures that every rank raises alike.

Why not ``broadcast_object_list``? It has no deadline: a rank that died
leaves the others waiting for the process group's timeout (30 minutes by
default), and it cannot say *which* rank failed. Here every collective is
started asynchronously and waited on with the caller's timeout, and any
failure of the transport becomes a :class:`DistributedError` naming the step
of the protocol that broke. Failures of the load itself travel as
:class:`Failure` values (type name, message, rank) so that every rank raises
the very same ``RegistryError`` subclass.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from registry import errors


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

    @classmethod
    def of(cls, exc: BaseException, rank: int) -> Failure:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return cls(kind=type(exc).__name__, message=text, rank=rank,
                   corrupt=isinstance(exc, errors.CorruptCheckpointError))

    def error(self) -> errors.RegistryError:
        """The same RegistryError subclass on every rank; anything else as DistributedError."""
        cls = getattr(errors, self.kind, None)
        if isinstance(cls, type) and issubclass(cls, errors.RegistryError):
            try:
                return cls(self.message)
            except TypeError:  # a subclass with a different constructor
                pass
        return errors.DistributedError(f"rank {self.rank} failed: {self.kind}: {self.message}")


def first_failure(statuses: list[Failure | None]) -> Failure | None:
    """Rank 0's failure if any, else the lowest rank's: the one every rank raises."""
    return next((s for s in statuses if s is not None), None)


class Comm:
    """The default process group, its device, and a per-collective deadline."""

    def __init__(self, *, timeout: float | timedelta | None) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.backend = str(dist.get_backend())
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
        self._wait(lambda: dist.broadcast(tensor, src=0, async_op=True), what)

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
        self._wait(lambda: dist.all_gather(sizes, size, async_op=True), what)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else mine[:0]
        mine = mine.to(self.device)
        bufs = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        self._wait(lambda: dist.all_gather(bufs, mine, async_op=True), what)
        return [pickle.loads(b[:int(s.item())].cpu().numpy().tobytes()) for b, s in zip(bufs, sizes)]


__all__ = ["Comm", "Failure", "active", "as_timedelta", "first_failure"]
