"""An object-storage root (``s3://BUCKET/PREFIX``): each publish uploads to a fresh attempt prefix, manifest last,
and the catalog row that names the prefix is the commit (``registry.fs.objects``, ``registry.ops.objectlanding``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from registry.format.layout import attempt_relpath
from registry.fs.objects import ObjectRoot
from registry.records import CheckpointInfo
from registry.roots.base import Capabilities, Capability, Tiered, refusal, refuse

if TYPE_CHECKING:
    from registry.fs.store import Store

OBJECTS = Capabilities()


@dataclass(frozen=True)
class ObjectStoreRoot:
    """A :class:`~registry.roots.base.Root` over an :class:`~registry.fs.objects.ObjectRoot`."""

    objects: ObjectRoot
    kind: str = "s3"
    can: Capabilities = OBJECTS

    @property
    def url(self) -> str:
        return self.objects.url()

    def place(self, info: CheckpointInfo) -> CheckpointInfo:
        return info.at(self.objects.url(info.path.as_posix()))

    def new_relpath(self, run: str, step: int) -> str:
        """A fresh attempt prefix: two attempts at one step never share a key."""
        return attempt_relpath(run, step)

    def require(self, capability: Capability, what: str) -> None:
        refuse(self, capability, what)

    def local_store(self, what: str) -> Store:
        raise refusal(self, "directories", what)

    def object_store(self) -> ObjectRoot | None:
        return self.objects

    def tiered(self) -> Tiered | None:
        return None


__all__ = ["OBJECTS", "ObjectStoreRoot"]
