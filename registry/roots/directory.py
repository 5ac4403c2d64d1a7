"""A directory root: each step a directory under the root, published by a staged rename (``registry.fs.store``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from registry.fs.store import Store
from registry.records import CheckpointInfo
from registry.roots.base import Capabilities, Capability, Tiered, refuse

if TYPE_CHECKING:
    from registry.fs.objects import ObjectRoot

DIRECTORY = Capabilities(links=True, sharded=True, local_import=True, directories=True)


@dataclass(frozen=True)
class DirectoryRoot:
    """A :class:`~registry.roots.base.Root` over a :class:`~registry.fs.store.Store`."""

    store: Store
    kind: str = "directory"
    can: Capabilities = DIRECTORY

    @property
    def url(self) -> str:
        return str(self.store.root)

    @property
    def directory(self) -> Path:
        """The root directory on this host."""
        return self.store.root

    def place(self, info: CheckpointInfo) -> CheckpointInfo:
        return info.under(self.store.root)

    def new_relpath(self, run: str, step: int) -> str:
        return self.store.relpath(self.store.step_dir(run, step))

    def require(self, capability: Capability, what: str) -> None:
        refuse(self, capability, what)

    def local_store(self, what: str) -> Store:
        return self.store

    def object_store(self) -> ObjectRoot | None:
        return None

    def tiered(self) -> Tiered | None:
        return None


__all__ = ["DIRECTORY", "DirectoryRoot"]
