"""Attempt prefixes on an object-store root: what a listing holds, and removing one prefix's keys.

A listing is grouped by the ``RUN/step-N/a-<hex>`` part of each key
(:func:`registry.format.layout.parse_attempt_key`), never by the server's
``CommonPrefixes``: some servers keep a prefix listed after its last object
is gone. Shared by gc (finishing a deletion) and fsck (orphans); knows
objects, not the catalog.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from registry.crashpoints import crashpoint
from registry.format.layout import AttemptKey, parse_attempt_key
from registry.format.manifest import MANIFEST, Manifest, digest_bytes, parse_manifest
from registry.format.refs import RUN_NAME_RE
from registry.fs.objects import ObjectEntry, ObjectRoot
from registry.fs.store import FileProblem

HASH_WINDOW = 64 << 20  # bytes of one object in memory at a time while it is hashed
HASH_RANGE = 8 << 20    # one ranged GET
CHECK_WORKERS = 4


@dataclass(frozen=True, kw_only=True)
class AttemptPrefix:
    """The objects listed under one attempt prefix."""

    run: str
    step: int
    prefix: str                       # RUN/step-00001000/a-<hex>, relative to the root
    entries: tuple[ObjectEntry, ...]  # each with its key relative to the root

    @property
    def names(self) -> dict[str, ObjectEntry]:
        """File name under the prefix -> its entry."""
        return {e.rel[len(self.prefix) + 1:]: e for e in self.entries}

    @property
    def has_manifest(self) -> bool:
        return MANIFEST in self.names


def group(entries: Iterable[ObjectEntry]) -> dict[str, AttemptPrefix]:
    """Listed objects by attempt prefix; keys publish never writes (``.registry/``, strays) are left out."""
    found: dict[str, tuple[AttemptKey, list[ObjectEntry]]] = {}
    for entry in entries:
        key = parse_attempt_key(entry.rel)
        if key is None or not key.name or not RUN_NAME_RE.fullmatch(key.run):
            continue
        found.setdefault(key.prefix, (key, []))[1].append(entry)
    return {prefix: AttemptPrefix(run=key.run, step=key.step, prefix=prefix, entries=tuple(items))
            for prefix, (key, items) in sorted(found.items())}


def scan(root: ObjectRoot, under: str = "") -> dict[str, AttemptPrefix]:
    """One recursive listing of ``under`` (a run, or the whole root), grouped (raises ``StorageError``)."""
    return group(root.list(under))


def remove_prefix(root: ObjectRoot, prefix: str, keys: Sequence[str] | None = None, *,
                  point: str | None = None) -> bool:
    """Delete every key under ``prefix``, the manifest first; False when there was none.

    Without the manifest the rest can never pass for a valid payload, so a
    deletion killed half-way leaves at worst keys that fsck and gc remove.
    ``keys`` (relative to the root) spares the listing when the caller has one;
    ``point`` names the crash point between the manifest and the rest.
    """
    if keys is None:
        keys = [e.rel for e in root.list(prefix)]
    if not keys:
        return False
    manifest = f"{prefix}/{MANIFEST}"
    if manifest in keys:
        root.delete([manifest])
        if point is not None:
            crashpoint(point)  # the payload is out of sight, its other keys still there
    root.delete([k for k in keys if k != manifest])
    return True


def read_manifest(root: ObjectRoot, prefix: str) -> tuple[Manifest, str]:
    """The parsed manifest under ``prefix`` and the sha256 of its bytes.

    Raises ``ObjectNotFoundError`` where there is none, ``ManifestError`` for
    an invalid one and ``StorageError`` when the server cannot be asked.
    """
    raw = bytes(root.get(f"{prefix}/{MANIFEST}"))
    return parse_manifest(raw, path=Path(root.url(f"{prefix}/{MANIFEST}"))), digest_bytes(raw)


def hash_object(root: ObjectRoot, rel: str, size: int, *, on_bytes: Callable[[int], object] | None = None) -> str:
    """The sha256 of the first ``size`` bytes of an object, read by ranged GETs, a window at a time."""
    digest = hashlib.sha256()
    for start in range(0, size, HASH_WINDOW):
        end = min(size, start + HASH_WINDOW)
        starts = list(range(start, end, HASH_RANGE))
        for part in root.get_ranges(rel, starts, [min(s + HASH_RANGE, end) for s in starts]):
            digest.update(part)
            if on_bytes is not None:
                on_bytes(len(part))
    return digest.hexdigest()


def check_objects(root: ObjectRoot, prefix: str, manifest: Manifest, listed: Mapping[str, ObjectEntry], *,
                  checksums: bool, on_bytes: Callable[[int], object] | None = None) -> list[FileProblem]:
    """Whether the objects under ``prefix`` are what ``manifest`` lists: present, the sizes listed, and with
    ``checksums`` the sha256 of every byte (re-read from the server). ``listed``: file name -> its entry."""
    def check(name: str) -> FileProblem | None:
        entry, found = manifest.files[name], listed.get(name)
        if found is None:
            return FileProblem(name=name, problem="missing on the server")
        if found.size != entry.size:
            return FileProblem(name=name, problem=f"size {found.size} on the server, manifest says {entry.size}")
        if checksums and hash_object(root, f"{prefix}/{name}", entry.size, on_bytes=on_bytes) != entry.sha256:
            return FileProblem(name=name, problem="checksum mismatch")
        return None

    names = sorted(manifest.files, key=lambda n: -manifest.files[n].size)  # the longest hash starts first
    with ThreadPoolExecutor(max_workers=max(1, min(CHECK_WORKERS, len(names))),
                            thread_name_prefix="registry-s3-verify") as pool:
        found = dict(zip(names, pool.map(check, names)))
    return [p for n in sorted(names) if (p := found[n]) is not None]


__all__ = ["AttemptPrefix", "check_objects", "group", "hash_object", "read_manifest", "remove_prefix", "scan"]
