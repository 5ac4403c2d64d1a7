"""The catalog-free ``Checkpoint``: the reference module's dataclass, made safe.

It reads and writes the same directories as the reference module, so a
trainer can move to the registry one side at a time. Differences that matter:
files are hashed while written (never re-read), ``.pt`` extras load with
``weights_only=True`` unless ``trust_pickle=True``, and every file name in a
manifest is checked to stay inside the directory.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import InvalidStateError
from registry.fs.bounds import as_directory
from registry.fs.filemaps import Loaded, check_extras, read_directory
from registry.fs.store import save_directory
from registry.fs.payloadfiles import Payload
from registry.fs.validation import check_flags, check_max_shard_size, saved_payload

if TYPE_CHECKING:
    import torch

    from registry.ops.reading import Read
    from registry.records import CheckpointInfo, Fallback


@dataclass
class Checkpoint:
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    epoch: int = 0
    consumed_samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    policy_version: int | None = None
    info: CheckpointInfo | None = None
    fallback: Fallback | None = None  # set when a load of @latest skipped corrupt steps to reach this one

    @property
    def metrics(self) -> dict[str, float]:
        """The checkpoint's metrics (those of ``info``); empty for a directory loaded without the catalog."""
        return dict(self.info.metrics) if self.info is not None else {}

    def __repr__(self) -> str:
        """``Checkpoint(toy@300, verified, 12 tensors, 4.5 MiB)``: what it is, never every tensor."""
        from registry.records import human_bytes
        size = sum(t.nelement() * t.element_size() for t in self.state_dict.values() if hasattr(t, "element_size"))
        if self.info is not None:
            what = f"{self.info.run}@{self.info.step}, {self.info.status}"
        else:
            what = "no step" if self.step is None else f"step {self.step}"
        tensors = len(self.state_dict)
        return f"Checkpoint({what}, {tensors} tensor{'' if tensors == 1 else 's'}, {human_bytes(size)})"

    def payload(self, *, max_shard_size: int | None = None) -> Payload:
        check_max_shard_size(max_shard_size)
        return saved_payload(self.state_dict, epoch=self.epoch, consumed_samples=self.consumed_samples,
                             meta=self.meta, config=self.config, extra=self.extra,
                             policy_version=self.policy_version, max_shard_size=max_shard_size)

    def save(self, save_dir: str | Path, *, max_shard_size: int | None = None) -> None:
        """Atomically write this checkpoint to ``save_dir`` (replacing it if present)."""
        save_directory(as_directory(save_dir, what="save_dir"), self.payload(max_shard_size=max_shard_size))

    @classmethod
    def from_read(cls, read: Read) -> Checkpoint:
        """What ``Registry.load`` hands out for a step read through the catalog."""
        return cls.from_loaded(read.loaded, step=read.info.step, info=read.info, fallback=read.fallback)

    @classmethod
    def from_loaded(cls, loaded: Loaded, *, step: int | None = None, info: CheckpointInfo | None = None,
                    fallback: Fallback | None = None) -> Checkpoint:
        if loaded.delta is not None:  # never an empty state dict for a step whose weights are a delta
            where = f"{info.run}@{info.step}" if info is not None else "this directory"
            raise InvalidStateError(f"{where} is a policy delta step (delta.safetensors): its weights are rebuilt "
                                    "from its delta chain through the catalog (Registry.load), or written whole by "
                                    "Registry.materialize")
        return cls(state_dict=loaded.state_dict, epoch=loaded.epoch, consumed_samples=loaded.consumed_samples,
                   extra=loaded.extra, meta=loaded.meta, config=loaded.config, step=step,
                   policy_version=loaded.policy_version, info=info, fallback=fallback)

    @classmethod
    def load(cls, save_dir: str | Path, broadcast: bool = False, verify_checksums: bool = False,
             *, trust_pickle: bool = False, map_location: Any = "cpu", strategy: str = "auto",
             timeout: float | None = None, extras: bool | Collection[str] = True) -> Checkpoint:
        """Load a directory; with ``broadcast`` rank 0 checks it and every rank gets the same contents.

        ``strategy`` and ``timeout`` are those of :mod:`registry.distributed.loader`;
        ``extras`` is that of :meth:`registry.Registry.load`.
        """
        path = as_directory(save_dir, what="save_dir")
        check_flags(broadcast=broadcast, verify_checksums=verify_checksums, trust_pickle=trust_pickle)
        extras = check_extras(extras)
        if broadcast:
            from registry.distributed.loader import broadcast_directory
            loaded = broadcast_directory(path, verify=verify_checksums, trust_pickle=trust_pickle,
                                         map_location=map_location, strategy=strategy, timeout=timeout,
                                         extras=extras)
        else:
            loaded = read_directory(path, verify=verify_checksums, trust_pickle=trust_pickle,
                                    map_location=map_location, extras=extras)
        return cls.from_loaded(loaded)

    @classmethod
    def load_any(cls, save_dir: str | Path, broadcast: bool = False, verify_checksums: bool = False,
                 *, trust_pickle: bool = False, map_location: Any = "cpu") -> Checkpoint | None:
        """Like :meth:`load`, but None for a directory with no weights at all."""
        path = as_directory(save_dir, what="save_dir")
        check_flags(broadcast=broadcast, verify_checksums=verify_checksums, trust_pickle=trust_pickle)
        found = any((path / n).is_file() for n in ("meta.json", "model.safetensors",
                                                   "model.safetensors.index.json"))
        if broadcast:
            from registry.distributed.collectives import Comm, active
            if active():  # rank 0 decides, or ranks without the files would skip the collective load
                found = bool(Comm(timeout=None).broadcast_object(found, "checking for weights"))
        if not found:
            return None
        return cls.load(path, broadcast, verify_checksums, trust_pickle=trust_pickle,
                        map_location=map_location)
