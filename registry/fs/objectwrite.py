"""A payload uploaded to an attempt prefix in a bucket, hashed on the way; and the check of what the server stored.

The files are those :func:`registry.fs.payloadfiles.write_files` writes on a
filesystem, each streamed from the tensors' memory through the same hashing
writer (sha256 and xxh3-128 pieces computed while uploading, nothing read
back), into parts uploaded concurrently. The small files (meta, config,
index, manifest) go as one create-only PUT each, the manifest last; the
large ones as multipart uploads, to keys under a prefix no other attempt can
use. Nothing here makes a step visible: only the catalog commit does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from registry.format.manifest import CONFIG, MANIFEST, META, WEIGHTS_INDEX, FileEntry, Manifest
from registry.format.pieces import PIECE_SIZE
from registry.fs.hashing import Hasher, HashingWriter
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

    def __init__(self, sink: ObjectWriter | _CreateOnly, *, sha256: bool = True) -> None:
        self.path = Path(sink.rel)
        self._sink = sink
        self._fd = -1
        self._begin()
        if not sha256:  # the pieces alone (inline, memory speed): the file is checked against them
            self._hasher = Hasher(sha256=False, xxh3=False)

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


def _put(root: ObjectRoot, prefix: str, name: str, fill: Callable[[Any], object], *,
         sha256: bool = True) -> FileEntry:
    """Upload one file under ``prefix`` as ``fill(out)`` writes it, hashed on the way; its manifest entry
    (without ``sha256``, its sha256 is left empty and only the pieces are computed)."""
    rel = f"{prefix}/{name}"
    sink = _CreateOnly(root, rel) if name in SMALL_FILES else root.writer(rel)
    out = HashingUpload(sink, sha256=sha256)
    try:
        fill(out)
        out.close()
    except BaseException:
        out.abort()
        raise
    if not sha256:
        return FileEntry(name=name, size=out.size, sha256="", piece_size=out.piece_size,
                         xxh3_128_pieces=out.xxh3_128_pieces)
    return entry_of(name, out)


def upload_payload(root: ObjectRoot, prefix: str, payload: Payload) -> Written:
    """Upload every file of ``payload`` under ``prefix`` (relative to the root), manifest last."""
    return write_files(payload, lambda name, fill: _put(root, prefix, name, fill))


COPY_CHUNK = 8 << 20  # bytes read from a file at a time while it is uploaded


def upload_directory(root: ObjectRoot, prefix: str, directory: Path, manifest: Manifest, raw_manifest: bytes
                     ) -> tuple[Written, list[FileProblem]]:
    """Upload a checkpoint directory's files under ``prefix``, hashed while uploading; the manifest last.

    Each file is uploaded and compared with ``manifest`` (whose bytes are
    ``raw_manifest``) by :func:`upload_files`. A file that differs is a
    problem of the directory's copy, and the manifest is then not uploaded,
    so the prefix never holds what could pass for a payload. Returns what was
    uploaded (as :func:`check_uploaded` takes it) and the problems found.
    """
    from registry.format.manifest import digest_bytes

    heads, problems = upload_files(root, prefix, directory, manifest, sorted(manifest.files))
    if not problems:
        _put(root, prefix, MANIFEST, lambda out: out.write(raw_manifest))
    written = Written(manifest=manifest, manifest_sha256=digest_bytes(raw_manifest),
                      total_bytes=manifest.total_bytes + len(raw_manifest), heads=heads)
    return written, problems


def upload_files(root: ObjectRoot, prefix: str, directory: Path, manifest: Manifest, names: Sequence[str]
                 ) -> tuple[dict[str, bytes], list[FileProblem]]:
    """Upload ``names`` of ``directory`` under ``prefix``, each hashed while uploading and compared with its
    ``manifest`` entry, as a verified load checks a file: its size and pieces, its sha256 only where the
    manifest has no pieces of this writer's size (the pieces hash at memory speed, sha256 would take a core from
    the upload and the server). Returns the safetensors headers uploaded (for :func:`check_uploaded`) and the
    files that differ (or are missing), which are problems of the directory's copy."""
    from registry.format.safetensors import MAX_HEADER

    problems: list[FileProblem] = []
    heads: dict[str, bytes] = {}
    for name in names:
        expected = manifest.files[name]
        try:
            source = open(directory / name, "rb")  # noqa: SIM115 - closed below, after the upload
        except FileNotFoundError:
            problems.append(FileProblem(name=name, problem="missing"))
            continue
        with source:
            def fill(out: Any, source: Any = source) -> None:
                while chunk := source.read(COPY_CHUNK):
                    out.write(chunk)
            pieces = expected.xxh3_128_pieces is not None and expected.piece_size == PIECE_SIZE
            entry = _put(root, prefix, name, fill, sha256=not pieces)
            if name.endswith(".safetensors") and entry.size >= 8:
                source.seek(0)
                head = source.read(8)
                length = int.from_bytes(head, "little")
                if length <= MAX_HEADER:  # the header read back from the server must be these bytes
                    heads[name] = head + source.read(length)
        if entry.size != expected.size:
            problems.append(FileProblem(name=name, problem=f"size {entry.size}, manifest says {expected.size}"))
        elif (not pieces and entry.sha256 != expected.sha256) or (
                expected.xxh3_128_pieces is not None and expected.piece_size == entry.piece_size
                and entry.xxh3_128_pieces != expected.xxh3_128_pieces):
            problems.append(FileProblem(name=name, problem="checksum mismatch"))
    return heads, problems


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
