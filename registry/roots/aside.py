"""Files a root keeps beside its steps (a run's policy folds): written once whole, read back, removed, listed.

Each is a blob at a path relative to the root, named by the caller and
recorded in the catalog by it; the root only stores it. On a directory a
file lands under a temporary name, is fsync'd and renamed (a reader never
sees half of one); on an object store a small one is one create-only PUT
(an object is whole or absent), so two writers of one name never overwrite
each other's bytes. A large one (an anchor: a model whole) is streamed
(:meth:`Aside.writer`): it is never held in memory, and is stored only once
its writer checked what it wrote; a write killed midway leaves a temporary
file or an incomplete multipart upload, which :meth:`Aside.unfinished`
lists for fsck. A tiered root keeps them on its durable tier, where every
host that shares the catalog reads them.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from registry.errors import CorruptCheckpointError, ObjectExistsError, ObjectNotFoundError

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from registry.fs.objects import ObjectRoot, ObjectWriter

CHUNK = 8 << 20  # bytes read at a time by chunks()
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-[0-9a-f]{8}$")  # a directory write in flight (or killed)


class AsideWrite(Protocol):
    """One file being written beside the steps: nothing is stored until :meth:`commit`."""

    def write(self, data: Buffer) -> int: ...

    def commit(self) -> None:
        """Store what was written, whole, replacing what is at the path; on failure nothing is stored."""

    def abort(self) -> None:
        """Drop what was written; the path keeps what it held."""


@dataclass(frozen=True)
class Unfinished:
    """A write beside the steps that never completed: ``rel`` is the path it would have stored."""

    rel: str
    detail: str
    remove: Callable[[], bool]


class Aside(Protocol):
    """A root's store of files beside its steps, by path relative to the root."""

    def where(self, rel: str) -> str:
        """Where ``rel`` is, as users see it: an absolute path or a URL."""

    def local(self, rel: str) -> Path | None:
        """``rel`` on this host's filesystem; None where the root keeps it elsewhere (an object store)."""

    def put(self, rel: str, data: bytes) -> None:
        """Store ``data`` at ``rel`` whole; a file already there with the same bytes is kept, with other bytes
        replaced. Raises ``OSError`` (``StorageError`` on an object store)."""

    def writer(self, rel: str) -> AsideWrite:
        """A file at ``rel`` written as a stream and stored whole at ``commit()``, replacing what is there: for
        one too large to hold in memory, whose writer checks what it wrote before it commits."""

    def get(self, rel: str) -> bytes:
        """The bytes at ``rel``; ``FileNotFoundError`` when there are none, another ``OSError`` when this host
        cannot read them."""

    def chunks(self, rel: str) -> Iterator[Buffer]:
        """The bytes at ``rel`` in order, a few MiB at a time (errors as :meth:`get`'s)."""

    def whole(self, rel: str, size: int) -> bytearray | memoryview:
        """The ``size`` bytes at ``rel`` as one writable buffer that tensors may view, never copied twice: on
        this host's disk the file mapped copy-on-write (as a step's files are), elsewhere streamed into one
        buffer. ``CorruptCheckpointError`` when there are not ``size`` bytes; other errors as :meth:`get`'s."""

    def delete(self, rel: str) -> bool:
        """Remove ``rel``; False when nothing was there."""

    def names(self, prefix: str) -> list[str]:
        """Every stored path under the folder ``prefix`` (recursive), relative to the root, sorted."""

    def unfinished(self, prefix: str) -> list[Unfinished]:
        """The writes under the folder ``prefix`` that never completed: in flight, or killed midway."""


class _FileWrite:
    """:class:`AsideWrite` to a temporary name beside ``path``, fsync'd and renamed over it at commit."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(4)}"
        self._out = open(self.tmp, "xb")  # noqa: SIM115 - closed by commit() or abort()

    def write(self, data: Buffer) -> int:
        return self._out.write(data)

    def commit(self) -> None:
        from registry.fs.store import fsync_dir
        try:
            self._out.flush()
            os.fsync(self._out.fileno())
            self._out.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        self._out.close()
        self.tmp.unlink(missing_ok=True)


class _ObjectWrite:
    """:class:`AsideWrite` as a multipart upload, completed (the object then whole at once) at commit. The
    client cannot abort an upload it started: an aborted write past one part stays an incomplete upload,
    which fsck aborts (:meth:`ObjectAside.unfinished`)."""

    def __init__(self, out: ObjectWriter) -> None:
        self._out = out

    def write(self, data: Buffer) -> int:
        return self._out.write(data)

    def commit(self) -> None:
        try:
            self._out.close()
        except BaseException:
            self._out.abort()
            raise

    def abort(self) -> None:
        self._out.abort()


@dataclass(frozen=True)
class DirectoryAside:
    """:class:`Aside` on a directory of this host."""

    directory: Path

    def where(self, rel: str) -> str:
        return str(self.directory / rel)

    def local(self, rel: str) -> Path | None:
        return self.directory / rel

    def put(self, rel: str, data: bytes) -> None:
        out = self.writer(rel)
        try:
            out.write(data)
        except BaseException:
            out.abort()
            raise
        out.commit()

    def writer(self, rel: str) -> AsideWrite:
        return _FileWrite(self.directory / rel)

    def get(self, rel: str) -> bytes:
        return (self.directory / rel).read_bytes()

    def chunks(self, rel: str) -> Iterator[Buffer]:
        with open(self.directory / rel, "rb", buffering=0) as f:
            while block := f.read(CHUNK):
                yield block

    def whole(self, rel: str, size: int) -> bytearray | memoryview:
        from registry.fs.mapping import host_view, map_file
        path = self.directory / rel
        if not path.is_file():  # gone: a failed read, which says nothing about the bytes
            raise FileNotFoundError(f"no file {path}")
        return host_view(map_file(path.parent, path.name, expected_size=size, what="file"))

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

    def unfinished(self, prefix: str) -> list[Unfinished]:
        found = []
        for folder, _, files in os.walk(self.directory / prefix):
            for f in sorted(files):
                if (match := _TEMPORARY.match(f)) is not None:
                    path = Path(folder) / f
                    found.append(Unfinished(
                        rel=(Path(folder) / match["name"]).relative_to(self.directory).as_posix(),
                        detail=f"temporary file {f} of a write that never completed", remove=_unlinker(path)))
        return found


def _unlinker(path: Path) -> Callable[[], bool]:
    def remove() -> bool:
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True
    return remove


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

    def writer(self, rel: str) -> AsideWrite:
        return _ObjectWrite(self.objects.writer(rel))

    def get(self, rel: str) -> bytes:
        try:
            return bytes(self.objects.get(rel))
        except ObjectNotFoundError as exc:
            raise FileNotFoundError(str(exc)) from None

    def chunks(self, rel: str) -> Iterator[Buffer]:
        try:
            yield from self.objects.chunks(rel, CHUNK)
        except ObjectNotFoundError as exc:
            raise FileNotFoundError(str(exc)) from None

    def whole(self, rel: str, size: int) -> bytearray | memoryview:
        buf = bytearray(size)
        view, at = memoryview(buf), 0
        for block in self.chunks(rel):
            part = memoryview(block).cast("B")
            if at + len(part) > size:
                break
            view[at:at + len(part)] = part
            at += len(part)
        else:
            if at == size:
                return buf
        raise CorruptCheckpointError(f"{self.where(rel)} is not the {size} bytes recorded for it")

    def delete(self, rel: str) -> bool:
        if self.objects.head(rel) is None:
            return False
        self.objects.delete([rel])
        return True

    def names(self, prefix: str) -> list[str]:
        return [e.rel for e in self.objects.list(prefix)]

    def unfinished(self, prefix: str) -> list[Unfinished]:
        import functools

        from registry.fs import multipart
        base = self.objects.key()
        cut = len(base) + 1 if base else 0
        found = []
        for upload in multipart.list_uploads(self.objects.config, self.objects.key(prefix).rstrip("/") + "/"):
            when = f" (started {upload.initiated:%Y-%m-%d %H:%M:%S}Z)" if upload.initiated else ""
            found.append(Unfinished(rel=upload.key[cut:], detail=f"multipart upload that never completed{when}",
                                    remove=functools.partial(multipart.abort_upload, self.objects.config, upload)))
        return found


__all__ = ["Aside", "AsideWrite", "DirectoryAside", "ObjectAside", "Unfinished"]
