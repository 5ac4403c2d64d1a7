"""A tiered root: a fast directory root on this host over a durable object-storage root.

Publishes land on the fast root as on any directory root and are replicated
to the durable root in the background; every copy is a replica row
(``registry.catalog.replicas``) and loads read the nearest verified copy
(``registry.ops.tiers``). The fast root's tier id (``<fast>/.registry/tier.json``)
names this host's copies, so many hosts share one catalog and one durable root.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from typing import TYPE_CHECKING, Any

from registry.fs.objects import ObjectRoot
from registry.fs.store import Store
from registry.records import CheckpointInfo
from registry.roots.aside import ObjectAside
from registry.roots.base import Capabilities, Capability, Tiered, refuse
from registry.roots.directory import DirectoryLanding, DirectoryRoot, FileRemoval
from registry.roots.objectstore import ObjectStoreRoot
from registry.roots.shards import Host, ObjectShards, TieredShards

if TYPE_CHECKING:
    from registry.roots.dirscan import DirectoryScan
    from registry.roots.objectscan import ObjectScan
    from registry.format.manifest import Manifest
    from registry.fs.filemaps import Extras, Loaded
    from registry.fs.payloadfiles import Payload, Written
    from registry.fs.store import FileProblem, Reuse

TIERED = Capabilities(links=True, sharded=True, local_import=True, directories=True, tiers=True)


@dataclass(frozen=True)
class TieredRoot:
    """A :class:`~registry.roots.base.Root` composed of a fast :class:`DirectoryRoot` and a durable
    :class:`ObjectStoreRoot`; ``tier_id`` names the fast one among the hosts sharing the durable one."""

    fast: DirectoryRoot
    durable: ObjectStoreRoot
    tier_id: str
    cached: bool = True  # False: a read-only open on a host no writer named, which keeps no cache there
    kind: str = "tiered"
    can: Capabilities = TIERED

    @property
    def url(self) -> str:
        return self.fast.url

    @property
    def store(self) -> Store:
        return self.fast.store

    @property
    def directory(self) -> Path:
        return self.fast.directory

    @property
    def objects(self) -> ObjectRoot:
        return self.durable.objects

    def place(self, info: CheckpointInfo) -> CheckpointInfo:
        return self.fast.place(info)

    @property
    def local_dir(self) -> Path | None:
        return self.fast.local_dir

    def holds(self, relpath: str) -> bool:
        return self.durable.holds(relpath)

    def stored_manifest(self, info: CheckpointInfo) -> tuple[Manifest | None, str]:
        return self.fast.stored_manifest(info)

    def rehash(self, info: CheckpointInfo, manifest: Manifest, *, on_bytes: Callable[[int], None]) -> list[FileProblem]:
        return self.fast.rehash(info, manifest, on_bytes=on_bytes)

    def read(self, info: CheckpointInfo, *, verify: bool, trust_pickle: bool, map_location: Any,
             extras: Extras = True) -> Loaded:
        return self.fast.read(info, verify=verify, trust_pickle=trust_pickle, map_location=map_location,
                              extras=extras)

    def manifest_bytes(self, info: CheckpointInfo) -> tuple[bytes, Path]:
        """From the copy ``info`` names: a directory of this host, or the durable copy its ``url`` names."""
        prefix = f"{self.durable.url}/"
        if info.url is not None and info.url.startswith(prefix):
            return self.durable.manifest_bytes(replace(info, path=Path(info.url[len(prefix):])))
        return self.fast.manifest_bytes(info)

    # the durable root is the one bound to the catalog: every host's fast directory serves the same catalog
    def read_marker(self) -> str | None:
        return self.durable.read_marker()

    def write_marker(self, catalog_id: str, *, bound_from: str, overwrite: bool = False) -> None:
        self.durable.write_marker(catalog_id, bound_from=bound_from, overwrite=overwrite)

    def remove_marker(self) -> None:
        self.durable.remove_marker()

    def reopen(self) -> dict[str, str]:
        return {"root": self.url, "durable": self.durable.url}

    def new_relpath(self, run: str, step: int) -> str:
        return self.fast.new_relpath(run, step)

    def scan(self) -> DirectoryScan:
        """The fast directory's; the durable tier's is :meth:`durable_scan` (``registry.ops.tierfsck`` runs both)."""
        return self.fast.scan()

    def durable_scan(self) -> ObjectScan:
        return self.durable.scan()

    def removal(self) -> FileRemoval:
        """The fast directory's: tier retention removes copies on each tier (``registry.ops.tierretention``)."""
        return self.fast.removal()

    def aside(self) -> ObjectAside:
        """On the durable tier: every host sharing the catalog reads a run's folds there."""
        return self.durable.aside()

    def landing(self, relpath: str) -> DirectoryLanding:
        """A publish lands on the fast directory; the durable copy is made by replication."""
        return self.fast.landing(relpath)

    def write(self, dest: Path, payload: Payload, reuse: Reuse | None) -> Written:
        return self.fast.write(dest, payload, reuse)

    def shards(self) -> TieredShards:
        """Written on the fast directory; read at the nearest copy a load located (the durable one by ranged GETs)."""
        return TieredShards(self.fast.shards(), ObjectShards(self.durable.objects),
                            Host(self.tier_id, self.fast.directory))

    def require(self, capability: Capability, what: str) -> None:
        refuse(self, capability, what)

    def local_store(self, what: str) -> Store:
        return self.fast.store

    def object_store(self) -> ObjectRoot | None:
        return None

    def tiered(self) -> Tiered | None:
        return self


__all__ = ["TIERED", "TieredRoot"]
