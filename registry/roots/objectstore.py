"""An object-storage root (``s3://BUCKET/PREFIX``): each publish uploads to a fresh attempt prefix, manifest last,
and the catalog row that names the prefix is the commit (``registry.fs.objects``, :class:`ObjectLanding`).

A publish uploads to ``RUN/step-N/a-<16 hex>/``, a prefix no other attempt
can use (:func:`registry.format.layout.attempt_relpath`); the claim names it, so fsck knows an
in-flight attempt's keys. Nothing is installed: the catalog commit that
names the prefix is what makes the step visible. An overwrite leaves the old
prefix alone until the commit has happened and then deletes its keys; a
failure before the commit deletes the new prefix's keys and the old payload
was never touched. A crash in between leaves an orphan prefix for fsck.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import (CheckpointReadError, CorruptCheckpointError, ObjectNotFoundError, PublishError,
                             RegistryError, StorageError)
from registry.format.layout import attempt_relpath
from registry.fs.objects import ObjectRoot
from registry.fs.objectwrite import check_uploaded
from registry.fs.prefixes import remove_prefix, scan
from registry.fs.store import FileProblem
from registry.records import HAS_PAYLOAD, CheckpointInfo
from registry.roots.aside import ObjectAside
from registry.roots.base import Capabilities, Capability, Gone, Tiered, refusal, refuse
from registry.roots.landing import Previous
from registry.roots.shards import ObjectShards

if TYPE_CHECKING:
    from registry.roots.objectscan import ObjectScan
    from registry.format.manifest import Manifest
    from registry.fs.filemaps import Extras, Loaded
    from registry.fs.payloadfiles import Payload, Written
    from registry.fs.store import Reuse, Store

log = logging.getLogger(__name__)

OBJECTS = Capabilities(sharded=True)


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

    @property
    def local_dir(self) -> Path | None:
        return None

    def holds(self, relpath: str) -> bool:
        from registry.format.manifest import MANIFEST
        return self.objects.head(f"{relpath}/{MANIFEST}") is not None

    def stored_manifest(self, info: CheckpointInfo) -> tuple[Manifest | None, str]:
        """The bucket answered, so a missing manifest is the step's; the server's trouble never is."""
        from registry.format.manifest import MANIFEST
        from registry.fs.prefixes import read_manifest
        try:
            return read_manifest(self.objects, info.path.as_posix())
        except ObjectNotFoundError:
            try:  # a missing bucket answers GET like a missing key: only a bucket that is there condemns
                self.objects.check_bucket()
            except OSError as exc:
                raise CheckpointReadError(str(exc)) from None
            return None, f"{MANIFEST}: missing on the server"
        except CorruptCheckpointError as exc:
            return None, f"{MANIFEST}: {exc}"
        except OSError as exc:  # StorageError: the server's trouble, never the step's
            raise CheckpointReadError(str(exc)) from None

    def rehash(self, info: CheckpointInfo, manifest: Manifest, *, on_bytes: Callable[[int], None]) -> list[FileProblem]:
        """Every object re-read by ranged GETs and hashed."""
        from registry.format.manifest import MANIFEST
        from registry.fs.prefixes import check_objects
        rel = info.path.as_posix()
        try:
            listed = {e.rel[len(rel) + 1:]: e for e in self.objects.list(rel)}
            damaged = check_objects(self.objects, rel, manifest, listed, checksums=True, on_bytes=on_bytes)
            if damaged and self.objects.head(f"{rel}/{MANIFEST}") is None:  # deleted while being read (gc)
                raise CheckpointReadError(f"objects deleted while being read: {self.objects.url(rel)}")
        except OSError as exc:
            raise CheckpointReadError(str(exc)) from None
        return damaged

    def read(self, info: CheckpointInfo, *, verify: bool, trust_pickle: bool, map_location: Any,
             extras: Extras = True) -> Loaded:
        from registry.fs.objectread import read_objects
        return read_objects(self.objects, info.path.as_posix(), verify=verify, trust_pickle=trust_pickle,
                            map_location=map_location, extras=extras, expected_digest=info.manifest_sha256)

    def manifest_bytes(self, info: CheckpointInfo) -> tuple[bytes, Path]:
        from registry.format.manifest import MANIFEST
        return bytes(self.objects.get(f"{info.path.as_posix()}/{MANIFEST}")), Path(info.path) / MANIFEST

    def read_marker(self) -> str | None:
        return self.objects.read_marker()

    def write_marker(self, catalog_id: str, *, bound_from: str, overwrite: bool = False) -> None:
        self.objects.write_marker(catalog_id, bound_from=bound_from, overwrite=overwrite)

    def remove_marker(self) -> None:
        self.objects.remove_marker()

    def reopen(self) -> dict[str, str]:
        return {"root": self.url}

    def new_relpath(self, run: str, step: int) -> str:
        """A fresh attempt prefix: two attempts at one step never share a key."""
        return attempt_relpath(run, step)

    def scan(self) -> ObjectScan:
        from registry.roots.objectscan import ObjectScan  # fsck's: multipart listings, which a read never needs
        return ObjectScan(self.objects)

    def removal(self) -> ObjectRemoval:
        return ObjectRemoval(self.objects)

    def aside(self) -> ObjectAside:
        return ObjectAside(self.objects)

    def landing(self, relpath: str) -> ObjectLanding:
        """Phases 2-3 of a publish to the attempt prefix ``relpath``: no rename, the commit names the prefix."""
        return ObjectLanding(self.objects, relpath)

    def write(self, dest: str, payload: Payload, reuse: Reuse | None) -> Written:
        """Upload ``payload`` under the attempt prefix ``dest``, hashing as it goes (objects are never linked)."""
        from registry.fs.objectwrite import upload_payload
        return upload_payload(self.objects, dest, payload)

    def shards(self) -> ObjectShards:
        """Every rank uploads its DCP files under the attempt prefix; a load fetches the ranges it reads."""
        return ObjectShards(self.objects)

    def require(self, capability: Capability, what: str) -> None:
        refuse(self, capability, what)

    def local_store(self, what: str) -> Store:
        raise refusal(self, "directories", what)

    def object_store(self) -> ObjectRoot | None:
        return self.objects

    def tiered(self) -> Tiered | None:
        return None


@dataclass
class ObjectLanding:
    """The :class:`registry.roots.landing.Landing` of an ``s3://`` root for one attempt prefix ``rel``."""

    root: ObjectRoot
    rel: str
    shares_inodes: bool = False  # objects share nothing: there is no dedup on an object store
    _old: str | None = None

    @property
    def where(self) -> str:
        return self.root.url(self.rel)

    @property
    def path(self) -> Path | None:
        return None

    def prepare(self, claim: Previous) -> str:
        if claim.previous_status in HAS_PAYLOAD and claim.previous_path not in (None, self.rel):
            self._old = claim.previous_path
        return self.rel

    def check(self, dest: str, written: Written) -> list[FileProblem]:
        return check_uploaded(self.root, dest, written)

    def install(self, dest: str) -> str | None:
        return self._old  # retired once the commit has happened

    def discard(self, dest: str) -> None:
        self._delete(dest, "a failed attempt's")

    def old_intact(self) -> bool:
        return True  # an upload never touches the old prefix

    def undo(self, dest: object, retired: str | None) -> bool:
        self._delete(self.rel, "an uncommitted attempt's")
        return retired is not None

    def settle(self, retired: str) -> None:
        self._delete(retired, "the overwritten payload's")

    def failure(self, exc: OSError) -> RegistryError:
        return PublishError(f"could not publish {self.where}: {exc.strerror or exc}", errno=exc.errno)

    def _delete(self, rel: str, what: str) -> None:
        try:
            remove_prefix(self.root, rel)
        except (StorageError, OSError) as exc:  # never masks the outcome: fsck finds the orphan prefix
            log.warning("could not delete %s objects under %s: %s; 'registry fsck --repair' removes them",
                        what, self.root.url(rel), exc)


@dataclass(frozen=True)
class ObjectRemoval:
    """:class:`~registry.roots.base.Removal` for an object-store root.

    The plan, the re-check inside the marking transaction and the catalog states
    are retention's own (:mod:`registry.ops.retention`); what differs is the
    removal. There is no rename on object storage, so a ``deleted`` row's payload
    goes by deleting the keys under its attempt prefix, manifest first
    (:func:`registry.fs.prefixes.remove_prefix`). Attempt prefixes are never
    reused (a re-publish of the step gets a fresh one), so a deleted row's prefix
    holds only the payload it deleted and needs no digest check before it goes.
    A gc killed after marking left a ``deleted`` row whose keys are still there:
    the next gc (or ``fsck --repair``) lists the run once and deletes them.

    No dedup on object storage: a step holds its own objects, and its bytes are
    the catalog's sizes.
    """

    root: ObjectRoot

    def held(self, info: CheckpointInfo) -> Mapping[Any, int]:
        return {}  # no object is shared between steps: the catalog's size is the step's

    def freed_bytes(self, doomed: Sequence[CheckpointInfo]) -> int:
        return sum(c.total_bytes for c in doomed)

    def kept_bytes(self, kept: Sequence[CheckpointInfo]) -> int:
        return sum(c.total_bytes for c in kept)

    def shared_bytes(self, doomed: Sequence[Path], kept: Sequence[Path]) -> int:
        return 0

    def remove(self, gone: Gone) -> bool:
        return remove_prefix(self.root, gone.path, point="gc-after-retire")

    def finish(self, run: str, rows: Sequence[Gone]) -> tuple[set[int], dict[int, str]]:
        """One listing of the run; the keys of every ``deleted`` row's prefix still there are deleted."""
        if not rows:
            return set(), {}
        healed: set[int] = set()
        errors: dict[int, str] = {}
        try:
            present = scan(self.root, run)
        except OSError as exc:
            return set(), {r.step: f"cannot list {self.root.url(run)}: {exc}" for r in rows}
        for row in rows:
            found = present.get(row.path)
            if found is None:
                continue
            try:
                remove_prefix(self.root, row.path, [e.rel for e in found.entries], point="gc-after-retire")
                healed.add(row.step)
            except OSError as exc:
                errors[row.step] = f"cannot delete {self.root.url(row.path)}: {exc}"
        return healed, errors


__all__ = ["OBJECTS", "ObjectLanding", "ObjectRemoval", "ObjectStoreRoot"]
