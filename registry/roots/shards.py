"""A sharded (DCP) step's files on each kind of root: what the one sharded publish and ``load_into`` ask of a root.

The sequence (``registry.distributed.sharded``) is the same on every root:
rank 0 claims and the root's landing prepares a place (a staging directory,
an attempt prefix); every rank writes its shards there through
:meth:`Shards.writer`; rank 0 adds the tail (meta, config, manifest last)
through :meth:`Shards.tail`; the landing installs and the catalog commits. A
load reads the small files through :meth:`Shards.read`, and DCP reads the
data through :meth:`Shards.reader`; the pieces are checked either by a share
spread over the ranks beside the read (a directory: every rank can map every
file, so the whole step is checked once) or by the reader itself as each
range lands (an object store: a rank fetches only what it reads, so it checks
only that, before DCP sees a byte). ``where`` is what the landing prepared or
a placed step's ``path``: an absolute directory, or an attempt prefix
relative to the object root.

A tiered root's (:class:`TieredShards`) writes as its fast directory's and
reads the nearest copy the load located (``Copies.located``, chosen on rank 0):
this host's fast or cached directory, else its durable copy by ranged GETs,
each range checked as it lands, with no whole download on any host
(:meth:`Shards.locate` turns the located step into ``where``, :meth:`Shards.at`
the ``where`` into the shards that read it). Its :meth:`Shards.host` names the
host a rank writes on: ranks on several hosts publish each host's files as
that host's part (``registry.distributed.parts``), and :meth:`Shards.part`
reads a host's part (:class:`PartShards`: its files mapped here, other
hosts' pieces as they sent them, the rest from the durable copy).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    from registry.format.manifest import FileEntry, Manifest
    from registry.format.sharding import ShardedLayout
    from registry.fs.dcpobjects import Received
    from registry.fs.objects import ObjectRoot
    from registry.fs.payloadfiles import Written
    from registry.records import CheckpointInfo


@dataclass(frozen=True)
class StepParts:
    """A step's parts (published from ranks on several hosts): the part's path relative to every host's fast root,
    and the data files each host (tier id) holds there, as the catalog records them."""

    path: str
    files: Mapping[str, frozenset[str]]


@dataclass(frozen=True)
class Host:
    """Where a rank of a tiered root writes: its host's fast directory (``root``), named by its tier id (``id``).
    Ranks whose hosts differ publish each host's files as that host's part (``registry.distributed.parts``)."""

    id: str
    root: Path


class Reading(Protocol):
    """How a load reads and checks one copy of a sharded step's data files."""

    def share(self, manifest: Manifest, rank: int, world: int) -> list[tuple[str, int]]:
        """The (file, piece) pairs ``rank`` checks beside the read; empty where the reader checks what it reads."""

    def check(self, where: Path, manifest: Manifest, share: list[tuple[str, int]]) -> None:
        """Check ``share`` against the manifest; ``CorruptCheckpointError`` if a piece differs."""

    def reader(self, where: Path, metadata: Metadata, *, manifest: Manifest, verify: bool,
               trust_pickle: bool) -> Any:
        """A DCP ``StorageReader`` of the step at ``where`` (``metadata`` checked against ``manifest``)."""


class Shards(Reading, Protocol):
    """A root's sharded files (see the module's docstring)."""

    def host(self) -> Host | None:
        """This rank's host-local place of writing, on a root whose ranks may each write to their own host; None
        where every rank writes to one place (a directory, shared or refused at the tail; a bucket)."""

    def part(self, parts: StepParts, digest: str | None, *, durable: Path | None) -> PartShards | None:
        """This host's part of a step published from several hosts, read here with the rest of the step from its
        durable copy at ``durable`` (None: not durable yet); None when this host holds no part of payload
        ``digest``."""

    def writer(self, where: str, *, threads: int) -> Any:
        """A DCP ``StorageWriter`` into ``where`` whose ``.written`` gives name -> ``FileEntry`` as hashed."""

    def tail(self, where: str, *, entries: Mapping[str, FileEntry], layout: ShardedLayout,
             tensors: Collection[str], meta: Mapping[str, Any], meta_raw: bytes, config_raw: bytes) -> Written:
        """``meta.json``, ``config.json`` and the manifest, last, beside every rank's ``entries``."""

    def read(self, where: Path, name: str) -> torch.Tensor:
        """One small file of a placed step (manifest, ``.metadata``, meta, config) as a uint8 buffer."""

    def locate(self, info: CheckpointInfo) -> Path:
        """``where`` the step ``info`` (placed, or located at its nearest copy) is read; ``NoCopyError`` when this
        host can reach no copy of it."""

    def at(self, where: Path) -> Shards:
        """The shards that read ``where`` (a tiered root's: its directory's, or its durable tier's)."""

    def holds(self, where: Path, digest: str | None) -> bool:
        """Whether this rank reads the payload of manifest ``digest`` at ``where`` (a directory of another host's
        filesystem may hold another one, or none)."""


@dataclass(frozen=True)
class FileShards:
    """A directory's: DCP's files written hashed and fsync'd, mapped to read, a share of pieces per rank."""

    def host(self) -> Host | None:
        return None

    def part(self, parts: StepParts, digest: str | None, *, durable: Path | None) -> PartShards | None:
        return None

    def writer(self, where: str, *, threads: int) -> Any:
        from registry.fs.dcpfiles import hashing_writer
        return hashing_writer(Path(where), threads=threads)

    def tail(self, where: str, *, entries: Mapping[str, FileEntry], layout: ShardedLayout,
             tensors: Collection[str], meta: Mapping[str, Any], meta_raw: bytes, config_raw: bytes) -> Written:
        from registry.errors import PublishError
        from registry.fs.dcpfiles import write_sharded_tail
        absent = sorted(name for name in entries if not (Path(where) / name).is_file())
        if absent:  # cheap (a stat per file), and the manifest must never list files another host holds
            raise PublishError(f"{len(absent)} files the ranks wrote are not in {where} on rank 0's host (first: "
                               f"{absent[0]}): every rank must write to the same directory (one host, or a shared "
                               "filesystem); ranks on several hosts with directories of their own are not supported",
                               path=Path(where))
        return write_sharded_tail(Path(where), entries=entries, layout=layout, tensors=tensors, meta=meta,
                                  meta_raw=meta_raw, config_raw=config_raw)

    def read(self, where: Path, name: str) -> torch.Tensor:
        from registry.errors import CorruptCheckpointError, ManifestError
        from registry.format.manifest import MANIFEST
        from registry.fs.mapping import map_file
        return map_file(where, name, error=ManifestError if name == MANIFEST else CorruptCheckpointError)

    def share(self, manifest: Manifest, rank: int, world: int) -> list[tuple[str, int]]:
        from registry.fs.dcpfiles import piece_share
        return piece_share(manifest, rank, world)

    def check(self, where: Path, manifest: Manifest, share: list[tuple[str, int]]) -> None:
        from registry.fs.dcpfiles import check_share
        check_share(where, manifest, share)

    def reader(self, where: Path, metadata: Metadata, *, manifest: Manifest, verify: bool,
               trust_pickle: bool) -> Any:
        from registry.format.dcp_metadata import RestrictedFileSystemReader
        return RestrictedFileSystemReader(where, metadata=metadata, trust_pickle=trust_pickle)

    def locate(self, info: CheckpointInfo) -> Path:
        return info.path

    def at(self, where: Path) -> Shards:
        return self

    def holds(self, where: Path, digest: str | None) -> bool:
        from registry.fs.removal import manifest_digest
        return digest is None or manifest_digest(where) == digest


@dataclass(frozen=True)
class ObjectShards:
    """An object store's: every rank uploads its own files to the attempt prefix, a load fetches its ranges."""

    objects: ObjectRoot

    def host(self) -> Host | None:
        return None

    def part(self, parts: StepParts, digest: str | None, *, durable: Path | None) -> PartShards | None:
        return None

    def writer(self, where: str, *, threads: int) -> Any:
        from registry.fs.dcpobjects import object_dcp_writer
        return object_dcp_writer(self.objects, where, threads=threads)

    def tail(self, where: str, *, entries: Mapping[str, FileEntry], layout: ShardedLayout,
             tensors: Collection[str], meta: Mapping[str, Any], meta_raw: bytes, config_raw: bytes) -> Written:
        from registry.fs.dcpobjects import upload_sharded_tail
        return upload_sharded_tail(self.objects, where, entries=entries, layout=layout, tensors=tensors, meta=meta,
                                   meta_raw=meta_raw, config_raw=config_raw)

    def read(self, where: Path, name: str) -> torch.Tensor:
        from registry.fs.dcpobjects import read_object
        return read_object(self.objects, where.as_posix(), name)

    def share(self, manifest: Manifest, rank: int, world: int) -> list[tuple[str, int]]:
        return []  # each rank checks every piece it fetches, as it lands

    def check(self, where: Path, manifest: Manifest, share: list[tuple[str, int]]) -> None:
        if share:
            raise ValueError("an object store's reader checks the pieces it fetches; there is no share")

    def reader(self, where: Path, metadata: Metadata, *, manifest: Manifest, verify: bool,
               trust_pickle: bool) -> Any:
        from registry.fs.dcpobjects import object_dcp_reader
        return object_dcp_reader(self.objects, where.as_posix(), metadata=metadata, manifest=manifest,
                                 verify=verify, trust_pickle=trust_pickle)

    def locate(self, info: CheckpointInfo) -> Path:
        return info.path

    def at(self, where: Path) -> Shards:
        return self

    def holds(self, where: Path, digest: str | None) -> bool:
        return True  # every rank reaches the bucket; the manifest's digest is checked where it is read


@dataclass(frozen=True)
class TieredShards:
    """A tiered root's: written as its fast directory's; read at the nearest copy the load located, a directory
    of this host (``where`` absolute) or the durable copy's attempt prefix (``where`` relative to the durable
    tier), by ranged GETs (see the module's docstring)."""

    files: FileShards
    durable: ObjectShards
    here: Host

    def host(self) -> Host | None:
        return self.here

    def part(self, parts: StepParts, digest: str | None, *, durable: Path | None) -> PartShards | None:
        """This host's part when the catalog records one here and its directory holds payload ``digest``."""
        from registry.fs.removal import manifest_digest
        files = parts.files.get(self.here.id)
        where = self.here.root / parts.path
        if files is None or digest is None or manifest_digest(where) != digest:
            return None
        return PartShards(where=where, files=files, durable=self.durable, prefix=durable)

    def writer(self, where: str, *, threads: int) -> Any:
        return self.files.writer(where, threads=threads)

    def tail(self, where: str, *, entries: Mapping[str, FileEntry], layout: ShardedLayout,
             tensors: Collection[str], meta: Mapping[str, Any], meta_raw: bytes, config_raw: bytes) -> Written:
        return self.files.tail(where, entries=entries, layout=layout, tensors=tensors, meta=meta,
                               meta_raw=meta_raw, config_raw=config_raw)

    def at(self, where: Path) -> Shards:
        return self.files if where.is_absolute() else self.durable

    def read(self, where: Path, name: str) -> torch.Tensor:
        return self.at(where).read(where, name)

    def share(self, manifest: Manifest, rank: int, world: int) -> list[tuple[str, int]]:
        raise TypeError("a tiered root's share depends on the copy read: ask the shards at(where)")

    def check(self, where: Path, manifest: Manifest, share: list[tuple[str, int]]) -> None:
        self.at(where).check(where, manifest, share)

    def reader(self, where: Path, metadata: Metadata, *, manifest: Manifest, verify: bool,
               trust_pickle: bool) -> Any:
        return self.at(where).reader(where, metadata, manifest=manifest, verify=verify, trust_pickle=trust_pickle)

    def locate(self, info: CheckpointInfo) -> Path:
        """The durable copy's prefix when ``info`` was located there (its ``url`` under the durable tier), else
        its directory on this host; ``NoCopyError`` when that is not here either (never evidence against it)."""
        from registry.errors import NoCopyError
        from registry.format.manifest import MANIFEST
        prefix = f"{self.durable.objects.url()}/"
        if info.url is not None and info.url.startswith(prefix):
            return Path(info.url[len(prefix):])
        if not (info.path / MANIFEST).is_file():
            raise NoCopyError(f"{info.run}@{info.step} has no copy this host can read: it is not on this host's "
                              f"fast tier ({info.path}) and has no verified durable copy (its writer's host holds it "
                              "until it is replicated, or that host was lost first)",
                              run=info.run, step=info.step, path=info.path)
        return info.path

    def holds(self, where: Path, digest: str | None) -> bool:
        return self.at(where).holds(where, digest)


@dataclass(frozen=True)
class PartShards:
    """One host's part of a step published from several hosts (``where``, holding ``files`` and the small files):
    a rank of that host maps the files its plan names from here, and reads the rest from the step's durable copy
    (``prefix``) by ranged GETs, or the ranges the hosts holding them sent (``received``: name -> (offset, length) ->
    bytes and digest, :func:`registry.distributed.parts.part_read`); each way what it reads is checked."""

    where: Path
    files: frozenset[str]
    durable: ObjectShards
    prefix: Path | None
    received: Received = field(default_factory=dict)

    def lacks(self, wanted: Mapping[str, list[tuple[int, int]]]) -> dict[str, list[tuple[int, int]]]:
        """The (offset, length) ranges of ``wanted`` in files this part does not hold."""
        return {name: ranges for name, ranges in wanted.items() if name not in self.files}

    def share(self, manifest: Manifest, rank: int, world: int) -> list[tuple[str, int]]:
        return []

    def check(self, where: Path, manifest: Manifest, share: list[tuple[str, int]]) -> None:
        if share:
            raise ValueError("a part's reader checks the pieces it reads; there is no share")

    def reader(self, where: Path, metadata: Metadata, *, manifest: Manifest, verify: bool,
               trust_pickle: bool) -> Any:
        from registry.fs.dcpobjects import part_dcp_reader
        prefix = None if self.prefix is None else self.prefix.as_posix()
        return part_dcp_reader(self.where, self.files, self.durable.objects if prefix else None, prefix,
                               received=self.received, metadata=metadata, manifest=manifest, verify=verify,
                               trust_pickle=trust_pickle)


__all__ = ["FileShards", "Host", "ObjectShards", "PartShards", "Reading", "Shards", "StepParts", "TieredShards"]
