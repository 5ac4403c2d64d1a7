"""A payload uploaded to an attempt prefix in a bucket, hashed on the way; and the check of what the server stored.

The files are those :func:`registry.fs.store.write_files` writes on a
filesystem, each streamed from the tensors' memory through the same hashing
writer (sha256 and xxh3-128 pieces computed while uploading, nothing read
back), into parts uploaded concurrently. The small files (meta, config,
index, manifest) go as one create-only PUT each, the manifest last; the
large ones as multipart uploads, to keys under a prefix no other attempt can
use. Nothing here makes a step visible: only the catalog commit does.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from registry.format.manifest import CONFIG, MANIFEST, META, WEIGHTS_INDEX, FileEntry
from registry.fs.hashing import HashingWriter
from registry.fs.objects import ObjectRoot, ObjectWriter
from registry.fs.payloadfiles import Payload, Written, entry_of, write_files
from registry.fs.store import FileProblem

SMALL_FILES = (META, CONFIG, WEIGHTS_INDEX, MANIFEST)  # one create-only PUT each
CHECK_WORKERS = 8


class _CreateOnly:
    """A sink that keeps a small file in memory and stores it with one create-only PUT on close."""

    def __init__(self, root: ObjectRoot, rel: str) -> None:
        self._root = root
        self.rel = rel
        self._buf = bytearray()

    def write(self, data: Any) -> int:
        self._buf += memoryview(data).cast("B")
        return len(data)

    def close(self) -> None:
        self._root.put(self.rel, bytes(self._buf), create_only=True)

    def abort(self) -> None:
        self._buf = bytearray()


class HashingUpload(HashingWriter):
    """:class:`~registry.fs.hashing.HashingWriter`'s hashing, with each piece going to an object instead of a file."""

    def __init__(self, sink: ObjectWriter | _CreateOnly) -> None:
        self.path = Path(sink.rel)
        self._sink = sink
        self._fd = -1
        self._begin()

    def _emit(self, piece: memoryview | bytearray) -> None:
        self._sink.write(piece)

    def close(self) -> None:
        self._drain()
        self._sink.close()
        self._finish_digests()

    def abort(self) -> None:
        self._sink.abort()
        try:
            self._hasher.digests()  # never leave the worker reading a buffer we give back
        except BaseException:  # noqa: BLE001 - the original error is the one to report
            pass


def upload_payload(root: ObjectRoot, prefix: str, payload: Payload) -> Written:
    """Upload every file of ``payload`` under ``prefix`` (relative to the root), manifest last."""
    def put(name: str, fill: Callable[[Any], object]) -> FileEntry:
        rel = f"{prefix}/{name}"
        sink = _CreateOnly(root, rel) if name in SMALL_FILES else root.writer(rel)
        out = HashingUpload(sink)
        try:
            fill(out)
            out.close()
        except BaseException:
            out.abort()
            raise
        return entry_of(name, out)

    return write_files(payload, put)


def check_uploaded(root: ObjectRoot, prefix: str, written: Written) -> list[FileProblem]:
    """The publish-time check behind ``verified`` on an object store (as ``check_written`` on a filesystem).

    Asks the server what it stored: each object's size (HEAD; an ETag is no
    content hash for a multipart upload), each safetensors header read back
    byte for byte (the writer keeps every one it wrote), and the manifest's sha256. Requests run concurrently.
    """
    from registry.format.manifest import digest_bytes

    def check(name: str) -> FileProblem | None:
        rel = f"{prefix}/{name}"
        entry = written.manifest.files[name]
        head = root.head(rel)
        if head is None:
            return FileProblem(name=name, problem="missing on the server")
        if head.size != entry.size:
            return FileProblem(name=name, problem=f"size {head.size} on the server, manifest says {entry.size}")
        if name in written.heads:
            stored = root.get_ranges(rel, [0], [len(written.heads[name])])[0]
            if bytes(stored) != written.heads[name]:
                return FileProblem(name=name, problem="safetensors header read back differs")
        return None

    names = sorted(written.manifest.files)
    with ThreadPoolExecutor(max_workers=max(1, min(CHECK_WORKERS, len(names))),
                            thread_name_prefix="registry-s3-check") as pool:
        problems = [p for p in pool.map(check, names) if p is not None]
    raw = bytes(root.get(f"{prefix}/{MANIFEST}"))
    if digest_bytes(raw) != written.manifest_sha256:
        problems.append(FileProblem(name=MANIFEST, problem="checksum mismatch"))
    return problems
