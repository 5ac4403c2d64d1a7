"""Rank-consistent loading for ``torch.distributed`` jobs.

Only rank 0 touches the catalog and the files; every other rank receives the
outcome from it. Errors on rank 0 travel as (type name, message) and are
raised again on every rank as the same ``RegistryError`` subclass, so no rank
waits forever for tensors that will never come.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from registry import errors
from registry.refs import Ref
from registry.store import Loaded, read_directory

if TYPE_CHECKING:
    from registry.api import Registry
    from registry.checkpoint import Checkpoint


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _raise_remote(kind: str, message: str) -> None:
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.RegistryError)):
        cls = errors.DistributedError
        message = f"rank 0 failed: {kind}: {message}"
    raise cls(message)


def _share(produce: Any) -> Any:
    """Run ``produce`` on rank 0 and hand its result (or its error) to every rank."""
    if not _active():
        return produce()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", produce())
        except Exception as exc:  # sent to every rank, then raised here too
            box[0] = ("err", type(exc).__name__, str(exc))
    dist.broadcast_object_list(box, src=0)
    outcome = box[0]
    if outcome[0] == "err":
        _raise_remote(outcome[1], outcome[2])
    return outcome[1]


def broadcast_directory(path: Path, *, verify: bool, trust_pickle: bool, map_location: Any) -> Loaded:
    """Rank 0 reads ``path``; every rank returns the same tensors."""
    return _share(lambda: read_directory(path, verify=verify, trust_pickle=trust_pickle,
                                         map_location="cpu"))


def distributed_load(registry: Registry, ref: Ref, *, verify: bool, map_location: Any,
                     trust_pickle: bool) -> Checkpoint:
    from registry.checkpoint import Checkpoint

    def produce() -> tuple[Any, Checkpoint]:
        ckpt = registry.load_local(ref, verify=verify, map_location="cpu", trust_pickle=trust_pickle)
        return ckpt

    ckpt = _share(produce)
    if map_location not in (None, "cpu"):
        ckpt.state_dict = {k: v.to(map_location) for k, v in ckpt.state_dict.items()}
    return Checkpoint(**{f: getattr(ckpt, f) for f in ("state_dict", "epoch", "consumed_samples", "extra",
                                                       "meta", "config", "step", "policy_version", "info")})
