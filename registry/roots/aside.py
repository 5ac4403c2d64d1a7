"""Files a root keeps beside its steps (a run's policy folds): written once whole, read back, removed, listed.

Each is a small blob at a path relative to the root, named by the caller
and recorded in the catalog by it; the root only stores it. On a directory
a file lands under a temporary name, is fsync'd and renamed (a reader never
sees half of one); on an object store it is one create-only PUT (an object
is whole or absent), so two writers of one name never overwrite each other's
bytes. A tiered root keeps them on its durable tier, where every host that
shares the catalog reads them.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from registry.errors import ObjectExistsError, ObjectNotFoundError

if TYPE_CHECKING:
    from registry.fs.objects import ObjectRoot


class Aside(Protocol):
    """A root's store of files beside its steps, by path relative to the root."""

    def where(self, rel: str) -> str:
        """Where ``rel`` is, as users see it: an absolute path or a URL."""

    def local(self, rel: str) -> Path | None:
        """``rel`` on this host's filesystem; None where the root keeps it elsewhere (an object store)."""

    def put(self, rel: str, data: bytes) -> None:
        """Store ``data`` at ``rel`` whole; a file already there with the same bytes is kept, with other bytes
        replaced. Raises ``OSError`` (``StorageError`` on an object store)."""

    def get(self, rel: str) -> bytes:
        """The bytes at ``rel``; ``FileNotFoundError`` when there are none, another ``OSError`` when this host
        cannot read them."""

    def delete(self, rel: str) -> bool:
        """Remove ``rel``; False when nothing was there."""

    def names(self, prefix: str) -> list[str]:
        """Every stored path under the folder ``prefix`` (recursive), relative to the root, sorted."""


@dataclass(frozen=True)
class DirectoryAside:
    """:class:`Aside` on a directory of this host."""

    directory: Path

    def where(self, rel: str) -> str:
        return str(self.directory / rel)

    def local(self, rel: str) -> Path | None:
        return self.directory / rel

    def put(self, rel: str, data: bytes) -> None:
        from registry.fs.store import fsync_dir
        path = self.directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)

    def get(self, rel: str) -> bytes:
        return (self.directory / rel).read_bytes()

    def delete(self, rel: str) -> bool:
        try:
            (self.directory / rel).unlink()
        except FileNotFoundError:
            return False
        return True

    def names(self, prefix: str) -> list[str]:
        top = self.directory / prefix
        found: list[str] = []
        for folder, _, files in os.walk(top):
            found += [(Path(folder) / f).relative_to(self.directory).as_posix() for f in files
                      if not f.startswith(".")]  # a temporary name of a write in flight is no stored file
        return sorted(found)


@dataclass(frozen=True)
class ObjectAside:
    """:class:`Aside` on an object store: one create-only PUT per file."""

    objects: ObjectRoot

    def where(self, rel: str) -> str:
        return self.objects.url(rel)

    def local(self, rel: str) -> Path | None:
        return None

    def put(self, rel: str, data: bytes) -> None:
        try:
            self.objects.put(rel, data, create_only=True)
            return
        except ObjectExistsError:
            there = bytes(self.objects.get(rel))
        if there != data:  # an earlier write of this name with other bytes (the catalog names the new ones)
            self.objects.delete([rel])
            self.objects.put(rel, data, create_only=True)

    def get(self, rel: str) -> bytes:
        try:
            return bytes(self.objects.get(rel))
        except ObjectNotFoundError as exc:
            raise FileNotFoundError(str(exc)) from None

    def delete(self, rel: str) -> bool:
        if self.objects.head(rel) is None:
            return False
        self.objects.delete([rel])
        return True

    def names(self, prefix: str) -> list[str]:
        return [e.rel for e in self.objects.list(prefix)]


__all__ = ["Aside", "DirectoryAside", "ObjectAside"]
