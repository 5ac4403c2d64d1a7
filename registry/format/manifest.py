"""``manifest.json``: what a checkpoint directory must contain, and its checksums.

Format version 1 is the reference module's: ``format_version``, ``created_at``,
``optimizer_step``, ``policy_version``, ``tensors`` (sorted names) and
``files`` (name -> size, sha256). We only ever add fields. Parsing treats the
file as hostile: it is size-capped before it is read, every field is
type-checked, and every file name must be a plain name inside the directory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.errors import CheckpointReadError, CorruptCheckpointError, ManifestError, UnsafePathError
from registry.format.pieces import MIN_PIECE_SIZE, piece_count
from registry.format.sharding import SHARDED_FORMAT_VERSION, ShardedLayout, parse_layout

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
META = "meta.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
DELTA = "delta.safetensors"  # a policy delta step's weights: a delta against its base (registry.format.delta)
POLICY_DELTA = "policy_delta"  # a delta step's manifest field: {"base_sha256", "full_sha256"} (see format.md)
MAX_MANIFEST_BYTES = 64 << 20
MAX_JSON_BYTES = 64 << 20  # meta.json, config.json, an index: small files read whole, so bounded
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_XXH3_128_RE = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    name: str
    size: int
    sha256: str
    # Added fields: fast digests for load-time checks; sha256 stays the
    # reference-compatible checksum that scrubs (``registry verify``) use.
    # ``xxh3_128`` is of the whole file (written before pieces existed);
    # ``xxh3_128_pieces`` of each ``piece_size`` piece (see ``registry.format.pieces``).
    xxh3_128: str | None = None
    piece_size: int | None = None
    xxh3_128_pieces: tuple[str, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class Manifest:
    files: dict[str, FileEntry]
    tensors: tuple[str, ...] = ()
    created_at: str | None = None
    optimizer_step: int | None = None
    policy_version: int | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)
    # set for a sharded (DCP) step, which is then format version 2 (see ``registry.format.sharding``)
    layout: ShardedLayout | None = None

    @property
    def format_version(self) -> int:
        return SHARDED_FORMAT_VERSION if self.layout is not None else FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format_version": self.format_version,
            "created_at": self.created_at,
            "optimizer_step": self.optimizer_step,
            "policy_version": self.policy_version,
            "tensors": sorted(self.tensors),
            "files": {name: _entry_json(f) for name, f in sorted(self.files.items())},
        }
        if self.layout is not None:
            doc["layout"] = self.layout.to_json()
        for key, value in self.extra_fields.items():
            doc.setdefault(key, value)
        return doc

    def encode(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2) + "\n").encode()


def _entry_json(entry: FileEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"size": entry.size, "sha256": entry.sha256}
    if entry.xxh3_128 is not None:
        doc["xxh3_128"] = entry.xxh3_128
    if entry.xxh3_128_pieces is not None:
        doc["xxh3_128_pieces"] = {"piece_size": entry.piece_size, "digests": list(entry.xxh3_128_pieces)}
    return doc


def _parse_pieces(entry: dict[str, Any], name: str, size: int,
                  path: Path) -> tuple[int | None, tuple[str, ...] | None]:
    doc = entry.get("xxh3_128_pieces")
    if doc is None:
        return None, None
    piece_size = doc.get("piece_size") if isinstance(doc, dict) else None
    digests = doc.get("digests") if isinstance(doc, dict) else None
    if (isinstance(piece_size, bool) or not isinstance(piece_size, int) or piece_size < MIN_PIECE_SIZE
            or not isinstance(digests, list) or len(digests) != piece_count(size, piece_size)
            or not all(isinstance(d, str) and _XXH3_128_RE.fullmatch(d) for d in digests)):
        raise ManifestError(f"manifest {path}: {name!r} has an invalid xxh3_128_pieces", path=path)
    return piece_size, tuple(digests)


def digest_bytes(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def check_file_name(name: object, *, where: Path | None = None) -> str:
    """A manifest may only name plain files directly inside the checkpoint."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\x00" in name or name.startswith("~")
            or os.path.basename(name) != name or os.path.isabs(name)):  # a drive ("C:x") where paths have them
        raise UnsafePathError(f"unsafe file name {name!r} in manifest" + (f" of {where}" if where else ""),
                              path=where)
    return name


def _int_or_none(doc: dict[str, Any], key: str, path: Path) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"manifest {path}: {key} must be an integer or null", path=path)
    return value


def decode_json_object(raw: bytes, *, path: Path, what: str | None = None) -> dict[str, Any]:
    """A checkpoint's JSON file (manifest, meta, config, index) as the object it must be, or one line why not.

    ``what`` names it in the error (default: its path).
    """
    what = what or str(path)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ManifestError(f"{what} is not valid JSON", path=path) from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{what} is not a JSON object", path=path)
    return doc


def parse_manifest(raw: bytes, *, path: Path) -> Manifest:
    """Validate a manifest's bytes. ``path`` is only used in error messages."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest {path} is larger than {MAX_MANIFEST_BYTES} bytes", path=path)
    doc = decode_json_object(raw, path=path, what=f"manifest {path}")
    version = doc.get("format_version")
    if version not in (FORMAT_VERSION, SHARDED_FORMAT_VERSION) or isinstance(version, bool):
        raise ManifestError(f"manifest {path} has unsupported format_version {version!r}", path=path)
    files_doc = doc.get("files")
    if not isinstance(files_doc, dict) or not files_doc:
        raise ManifestError(f"manifest {path} has no file table", path=path)
    files: dict[str, FileEntry] = {}
    for name, entry in files_doc.items():
        check_file_name(name, where=path)
        if name == MANIFEST:
            raise UnsafePathError(f"manifest {path} lists itself", path=path)
        if not isinstance(entry, dict):
            raise ManifestError(f"manifest {path}: entry {name!r} is not an object", path=path)
        size, sha = entry.get("size"), entry.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ManifestError(f"manifest {path}: {name!r} has an invalid size", path=path)
        if not isinstance(sha, str) or not _SHA256_RE.fullmatch(sha):
            raise ManifestError(f"manifest {path}: {name!r} has an invalid sha256", path=path)
        fast = entry.get("xxh3_128")
        if fast is not None and (not isinstance(fast, str) or not _XXH3_128_RE.fullmatch(fast)):
            raise ManifestError(f"manifest {path}: {name!r} has an invalid xxh3_128", path=path)
        piece_size, pieces = _parse_pieces(entry, name, size, path)
        files[name] = FileEntry(name=name, size=size, sha256=sha, xxh3_128=fast, piece_size=piece_size,
                                xxh3_128_pieces=pieces)
    tensors = doc.get("tensors", [])
    if not isinstance(tensors, list) or not all(isinstance(t, str) for t in tensors):
        raise ManifestError(f"manifest {path}: tensors must be a list of names", path=path)
    created_at = doc.get("created_at")
    if created_at is not None and not isinstance(created_at, str):
        raise ManifestError(f"manifest {path}: created_at must be a string", path=path)
    layout = None
    if version == SHARDED_FORMAT_VERSION:
        layout = parse_layout(doc.get("layout"), files, path=path)
    known = {"format_version", "files", "tensors", "created_at", "optimizer_step", "policy_version"}
    if layout is not None:
        known.add("layout")
    return Manifest(layout=layout,
        files=files, tensors=tuple(tensors), created_at=created_at,
        optimizer_step=_int_or_none(doc, "optimizer_step", path),
        policy_version=_int_or_none(doc, "policy_version", path),
        extra_fields={k: v for k, v in doc.items() if k not in known},
    )


def open_regular(directory: Path, name: str, *, error: type[CorruptCheckpointError] = CorruptCheckpointError,
                 what: str = "checkpoint file") -> int:
    """A read-only fd on ``directory/name``, which must be a plain regular file inside it.

    Symlinks are refused (they could point anywhere) and the open never blocks
    on a FIFO planted under a checkpoint name; the caller closes the fd.
    """
    check_file_name(name, where=directory)
    try:
        fd = os.open(os.path.join(directory, name), _OPEN_FLAGS)
    except OSError as exc:
        path = directory / name
        if exc.errno in (errno.ENOENT, errno.ENOTDIR) and not directory.is_dir():
            # the whole directory is gone (an unmounted root, a step removed under us): nothing was
            # read, so this says nothing about the checkpoint's bytes
            raise CheckpointReadError(f"checkpoint directory is missing: {directory}", errno=exc.errno,
                                      path=directory) from None
        if exc.errno == errno.ENOENT:
            raise error(f"{what} is missing: {path}", path=path) from None
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{what} is a symlink: {path}", path=path) from None
        raise CheckpointReadError(f"cannot open {path}: {exc.strerror}", errno=exc.errno, path=path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{what} is not a regular file: {directory / name}", path=directory / name)
    return fd


_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0))


def read_manifest(directory: Path) -> tuple[Manifest, str]:
    """The parsed manifest of ``directory`` and the sha256 of its bytes."""
    raw = manifest_bytes(directory)
    return parse_manifest(raw, path=directory / MANIFEST), digest_bytes(raw)


def manifest_bytes(directory: Path) -> bytes:
    """The bytes of ``directory``'s manifest, unparsed (at most one byte more than a manifest may hold)."""
    path = directory / MANIFEST
    fd = open_regular(directory, MANIFEST, error=ManifestError, what="manifest")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise CheckpointReadError(f"cannot read {path}: {exc.strerror}", errno=exc.errno, path=path) from None
