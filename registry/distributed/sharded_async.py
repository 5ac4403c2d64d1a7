"""Sharded publish in the background: ``publish(..., sharded=True, blocking=False)`` on every rank.

In the caller's thread, every rank checks the call, copies its own part of
the state (:func:`snapshot_sharded`) and agrees with the others on the
request, as a blocking sharded publish does; then it queues the rest on the
registry's background publisher (:mod:`registry.ops.background`: one thread,
publishes in call order, so in step order) and returns a future. The rest is
:func:`registry.distributed.sharded.publish_sharded` unchanged: claim, staging
broadcast, ``dcp.save``, digests, manifest, rename, commit, outcome, then
rank 0's retention.

Why a group of its own: the background protocol runs collectives while the
trainer runs its own (FSDP's all-gathers and reduce-scatters) on the
trainer's group from the trainer's thread. Two threads issuing collectives on
one group interleave them differently on different ranks, and the group
deadlocks or mixes up messages. So the first background sharded publish
creates, in the caller's thread and in the same order on every rank, a gloo
group over the same ranks (:class:`PublishGroups`), and every later
background collective of that registry runs on it. gloo because the staged
copies are in CPU memory whatever the trainer's backend is.

Why copy only the local data: a DTensor is a local shard plus a spec (mesh,
placements, global shape) that DCP plans with; the copy keeps the spec and
replaces the local shard by a CPU copy in a reused arena
(:class:`registry.fs.snapshot.Snapshotter`: pinned when the source is on
CUDA, cut once per layout), as ``torch.distributed.checkpoint``'s own
``async_save`` stages a state. A ``ShardedTensor`` (FSDP1, rare) is copied
to the CPU afresh each time, not into the arena.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from registry.distributed.collectives import Comm, Solo
from registry.distributed.sharded import agree, publish_sharded
from registry.fs.snapshot import Snapshotter
from registry.records import CheckpointInfo

if TYPE_CHECKING:
    from registry.distributed.parts import Hosts, PartPublish
    from registry.fs.payloadfiles import Payload, Written
    from registry.roots.shards import Shards


@dataclass(kw_only=True)
class ShardedSnapshot:
    """One rank's copy of its state, with DCP's structure, and the way to hand the arena back."""

    state: dict[str, Any]
    _release: Callable[[], None] = field(repr=False)
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


def snapshot_sharded(snapshots: Snapshotter, state: Mapping[str, Any]) -> ShardedSnapshot:
    """Copy this rank's tensors of ``state`` (a nest of dicts, lists and tuples) now, into a reused arena.

    DTensors come back as DTensors with the same spec over CPU copies of their
    local shards; plain tensors as CPU copies; other values deep-copied. Once
    this returns the caller may change its tensors.
    """
    local: dict[str, torch.Tensor] = {}

    def collect(obj: Any) -> None:
        if isinstance(obj, DTensor):
            local[str(len(local))] = obj._local_tensor
        elif isinstance(obj, ShardedTensor):
            return
        elif isinstance(obj, torch.Tensor):
            local[str(len(local))] = obj.detach()
        elif isinstance(obj, Mapping):
            for value in obj.values():
                collect(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                collect(value)

    collect(state)
    snap = snapshots.take(local, {})
    copies = iter(snap.state_dict.values())
    memo: dict[int, Any] = {}

    def rebuild(obj: Any) -> Any:
        if isinstance(obj, DTensor):
            return DTensor(next(copies), obj._spec, requires_grad=False)
        if isinstance(obj, ShardedTensor):
            return copy.deepcopy(obj) if obj.device.type == "cpu" else obj.to(device="cpu")
        if isinstance(obj, torch.Tensor):
            return next(copies)
        if isinstance(obj, Mapping):
            return {key: rebuild(value) for key, value in obj.items()}
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(rebuild(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(rebuild(v) for v in obj)
        return copy.deepcopy(obj, memo)

    try:
        copied = {key: rebuild(value) for key, value in state.items()}
    except BaseException:
        snap.release()
        raise
    return ShardedSnapshot(state=copied, _release=snap.release)


class PublishGroups:
    """The gloo groups background sharded publishes run their collectives on: one per set of ranks, made once.

    :meth:`comm` is collective over the trainer's group the first time (all
    its ranks create the new group together, in the caller's thread); later
    calls only look it up. A new group has the trainer group's timeout, which
    bounds DCP's collectives as in a blocking publish; the registry's own keep
    the call's ``timeout``. The groups live as long as the process group.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], Any] = {}

    def comm(self, comm: Comm | Solo) -> Comm | Solo:
        if isinstance(comm, Solo):
            return comm
        ranks = tuple(dist.get_process_group_ranks(comm.group) if comm.group is not None
                      else range(dist.get_world_size()))
        group = self._groups.get(ranks)
        if group is None:
            timeout = _group_timeout(comm.group)
            options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
            group = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True, **options)
            self._groups[ranks] = group
        return Comm(timeout=comm.timeout, group=group)


def _group_timeout(group: Any) -> timedelta | None:
    """The trainer group's own timeout, which DCP's collectives then keep (None: torch's default)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def publish_in_background(comm: Comm | Solo, groups: PublishGroups, *, run: str, step: int,
                          request: tuple[Any, ...], local_error: BaseException | None,
                          snap: ShardedSnapshot | None,
                          run_publish: Callable[[Callable[[Any], Written]], CheckpointInfo] | None,
                          payload: Payload | None, shards: Shards,
                          after: Callable[[CheckpointInfo], object] | None = None,
                          submit: Callable[[str, Callable[[], CheckpointInfo]], Future[CheckpointInfo]],
                          finished: Callable[[], None], hosts: Hosts | None = None,
                          parts: PartPublish | None = None, verify: bool = True) -> Future[CheckpointInfo]:
    """Agree (in the caller's thread, on the trainer's group), then queue the publish on the publish group
    (``hosts``, ``parts``, ``verify``: as :func:`registry.distributed.sharded.publish_sharded` takes them).

    ``finished`` runs once this rank is done with the publish, however it
    ended (the caller's bookkeeping of queued steps). Every rank's future
    holds the same ``CheckpointInfo`` or raises the same ``RegistryError`` subclass.
    """
    try:
        agree(comm, request, local_error)
        assert snap is not None  # a rank without a snapshot raised its error in the agreement
        background = groups.comm(comm)
    except BaseException:
        if snap is not None:
            snap.release()
        finished()
        raise

    def work() -> CheckpointInfo:
        try:
            return publish_sharded(background, run=run, step=step, state=snap.state, request=request,
                                   local_error=None, run_publish=run_publish, payload=payload, shards=shards,
                                   after=after, hosts=hosts, parts=parts, verify=verify)
        finally:
            snap.release()
            finished()
    try:
        return submit(f"{run}@{step}", work)
    except BaseException:
        snap.release()
        finished()
        raise


__all__ = ["PublishGroups", "ShardedSnapshot", "publish_in_background", "snapshot_sharded"]
