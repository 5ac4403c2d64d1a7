"""What an ``s3://`` root holds, as fsck's judge asks it (:mod:`registry.roots.scan`).

A publish uploads to a fresh attempt prefix ``RUN/step-N/a-<hex>``, manifest
last, and the catalog row that names the prefix is the commit: there is no
rename and no marker. So a step holds any number of prefixes, each whole
(its manifest there) or not, and incomplete multipart uploads. The bucket is
listed, objects and uploads, before the catalog is read: a publish claims
before its first upload, so every prefix listed belongs to a claim the
catalog shows. A request the server fails raises ``StorageError``: the judge
makes it a failure line, never a verdict.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.errors import CorruptCheckpointError, ObjectNotFoundError, RegistryError
from registry.format.layout import parse_attempt_key
from registry.format.manifest import MANIFEST, META
from registry.fs import multipart
from registry.fs.objects import ObjectRoot
from registry.fs.prefixes import AttemptPrefix, check_objects, read_manifest, remove_prefix, scan
from registry.roots.aside import Aside, ObjectAside
from registry.roots.scan import Checked, Leftover, StepKey, Stored, Valid


@dataclass(kw_only=True)
class Listed:
    """What the listing found of one step: its attempt prefixes and its incomplete uploads (with their prefix)."""

    prefixes: list[AttemptPrefix] = field(default_factory=list)
    uploads: list[tuple[str, multipart.Upload]] = field(default_factory=list)


@dataclass(frozen=True)
class StoredPrefix:
    """An attempt prefix as a :class:`~registry.roots.scan.Stored`, judged by the objects its listing saw."""

    objects: ObjectRoot
    found: AttemptPrefix

    @property
    def rel(self) -> str:
        return self.found.prefix

    @property
    def path(self) -> Path:
        return Path(self.found.prefix)

    @property
    def url(self) -> str | None:
        return self.objects.url(self.found.prefix)

    def check(self, *, checksums: bool, on_bytes: Callable[[int], object] | None = None) -> Checked:
        if not self.found.has_manifest:
            return Checked(valid=None, why="no manifest: the upload did not finish", digest=None)
        try:
            manifest, digest = read_manifest(self.objects, self.found.prefix)
        except ObjectNotFoundError:
            return Checked(valid=None, why="its manifest vanished while being checked", digest=None, vanished=True)
        except CorruptCheckpointError as exc:
            return Checked(valid=None, why=str(exc), digest=self.digest())
        listed = self.found.names
        problems = check_objects(self.objects, self.found.prefix, manifest, listed, checksums=checksums,
                                 on_bytes=on_bytes)
        if problems:
            return Checked(valid=None, why=f"{problems[0].name}: {problems[0].problem}", digest=digest)
        meta = None
        if META in manifest.files:
            try:
                meta = json.loads(bytes(self.objects.get(f"{self.found.prefix}/{META}")))
            except (RegistryError, ValueError):
                meta = None
        return Checked(valid=Valid(manifest=manifest, digest=digest, manifest_size=listed[MANIFEST].size,
                                   meta=meta), why="", digest=digest)

    def digest(self) -> str | None:
        try:
            return read_manifest(self.objects, self.found.prefix)[1]
        except (ObjectNotFoundError, CorruptCheckpointError):
            return None


def _newest_first(prefixes: list[AttemptPrefix]) -> list[AttemptPrefix]:
    return sorted(prefixes, key=lambda f: max((e.last_modified for e in f.entries if e.last_modified is not None),
                                              default=None) or 0, reverse=True)


def _remove(objects: ObjectRoot, found: AttemptPrefix) -> bool:
    remove_prefix(objects, found.prefix, [e.rel for e in found.entries])
    return True


def _abort(objects: ObjectRoot, upload: multipart.Upload) -> bool:
    multipart.abort_upload(objects.config, upload)
    return True


class ObjectStep:
    """What an object-store root holds of one step (:class:`registry.roots.scan.StepFound`)."""

    def __init__(self, objects: ObjectRoot, listed: Listed | None, rel: str | None) -> None:
        self.objects = objects
        self.listed = listed or Listed()
        self.rel = rel
        self.done: set[str] = set()  # prefixes judged already: a deleted row's, an older payload handed out

    @property
    def absent(self) -> str:
        return f"no manifest at {self.objects.url(self.rel)}" if self.rel is not None else "no manifest"

    def _own(self) -> AttemptPrefix | None:
        return next((f for f in self.listed.prefixes if f.prefix == self.rel and f.has_manifest), None)

    def payload(self) -> Stored | None:
        own = self._own()
        return StoredPrefix(self.objects, own) if own is not None else None

    def present(self) -> bool:
        return self.rel is not None and self.objects.head(f"{self.rel}/{MANIFEST}") is not None

    def older(self, *, digest: str | None, claim: bool, theirs: Collection[Path] = ()) -> tuple[Stored, str] | None:
        """An overwrite killed before its commit: the old payload, found by the digest the claim kept (a claim
        leaves the row's digest as it was), whole."""
        if not claim or digest is None:
            return None
        for old in self.listed.prefixes:
            if old.prefix == self.rel or not old.has_manifest or Path(old.prefix) in theirs:
                continue
            stored = StoredPrefix(self.objects, old)
            if stored.digest() != digest or stored.check(checksums=True).valid is None:
                continue
            self.done.add(old.prefix)
            return stored, "an overwrite never committed and the old payload is intact"
        return None

    def restore(self, old: Stored) -> Stored:
        return old  # nothing moved: the row is pointed back at it

    def adoptable(self, *, failed: bool) -> list[Stored]:
        if failed:  # a failed row's prefixes are attempts its publish gave up: orphans, never adopted
            return []
        return [StoredPrefix(self.objects, f) for f in _newest_first([f for f in self.listed.prefixes
                                                                      if f.has_manifest])]

    def deleted(self, *, digest: str | None) -> list[Leftover]:
        found = [f for f in self.listed.prefixes if f.prefix == self.rel]
        self.done.update(f.prefix for f in found)
        return [Leftover(kind="unfinished-deletion", path=Path(f.prefix), detail="deleted step still has objects",
                         url=self.objects.url(f.prefix), remove=functools.partial(_remove, self.objects, f))
                for f in found]

    def leftovers(self) -> list[Leftover]:
        found = [Leftover(kind="orphan-prefix", path=Path(f.prefix), url=self.objects.url(f.prefix),
                          detail=f"attempt prefix with {len(f.entries)} object(s) that no row names",
                          rel=f.prefix, claimed=True, unadopted=f.has_manifest,
                          remove=functools.partial(_remove, self.objects, f))
                 for f in self.listed.prefixes if f.prefix not in self.done]
        for prefix, upload in self.listed.uploads:
            name = upload.key.rsplit("/", 1)[-1]
            when = f" (started {upload.initiated:%Y-%m-%d %H:%M:%S}Z)" if upload.initiated else ""
            found.append(Leftover(kind="incomplete-upload", path=Path(prefix), url=self.objects.url(prefix),
                                  detail=f"multipart upload of {name} never completed{when}", claimed=True,
                                  remove=functools.partial(_abort, self.objects, upload)))
        return found


@dataclass(frozen=True)
class ObjectScan:
    """An object-store root as fsck reads it (:class:`registry.roots.scan.Scan`)."""

    objects: ObjectRoot

    @property
    def local_dir(self) -> Path | None:
        return None

    def check(self) -> None:
        self.objects.check_bucket()

    def still_there(self) -> bool:
        self.objects.check_bucket()  # a bucket gone meanwhile answers like missing keys: raises StorageError
        return True

    def listing(self, failures: list[str]) -> Mapping[StepKey, Listed]:
        base = self.objects.key()
        found: dict[StepKey, Listed] = {}
        for prefix in scan(self.objects).values():
            found.setdefault((prefix.run, prefix.step), Listed()).prefixes.append(prefix)
        for upload in multipart.list_uploads(self.objects.config, base + "/" if base else ""):
            key = parse_attempt_key(upload.key[len(base) + 1:] if base else upload.key)
            if key is not None:
                found.setdefault((key.run, key.step), Listed()).uploads.append((key.prefix, upload))
        return found

    def step(self, key: StepKey, listed: Any, rel: str | None) -> ObjectStep:
        return ObjectStep(self.objects, listed, rel)

    def runs(self, listed: Mapping[StepKey, Any]) -> list[str]:
        return sorted({key[0] for key in listed})

    def aside(self) -> Aside:
        return ObjectAside(self.objects)

    def where(self, rel: str) -> tuple[Path, str | None]:
        return Path(rel), self.objects.url(rel)


__all__ = ["Listed", "ObjectScan", "ObjectStep", "StoredPrefix"]
