"""This host's cache of durable copies, on a root with tiers: where each lands, its lock, its eviction.

A step this host holds no fast copy of is read from its durable copy,
downloaded once per host into ``<fast>/.registry/cache/RUN/step-N-<digest>``
through a hidden staging sibling renamed into place, under an ``fcntl`` lock
on the copy that every process of the host shares (:func:`host_lock`), and
recorded as this host's cache copy (:func:`record_cached_copy`), a replica
row at ``cache:<tier id>`` apart from its fast copy's. A cached copy whose
step ended or holds another payload since is evicted after the next
download of the run, or by fsck (:func:`stale_cached_copies`). A read-only
registry keeps no cache: it reads a temporary download (:func:`read_uncached`).
Bytes that differ as they land are downloaded again before anything is marked
(:func:`registry.ops.verdicts.read_again`); a cached copy damaged on this
host's disk is this host's to repair, never a verdict on the step.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from registry.catalog.replicas import DURABLE, ReplicaCatalog
from registry.crashpoints import crashpoint
from registry.errors import CatalogError, CorruptCheckpointError, NoCopyError, RegistryError, StorageError
from registry.format.layout import REGISTRY_DIR, hidden_sibling, parse_hidden, parse_step_dirname, step_dirname
from registry.fs.removal import manifest_digest, remove_checkpoint_dir
from registry.fs.store import fsync_dir
from registry.ops.verdicts import read_again
from registry.records import ENDED, CheckpointInfo

if TYPE_CHECKING:
    from registry.catalog import Catalog
    from registry.fs.objects import ObjectRoot
    from registry.fs.store import Store

log = logging.getLogger(__name__)

CACHE_DIR = f"{REGISTRY_DIR}/cache"
T = TypeVar("T")


class CacheHost(Protocol):
    """What the cache needs of a root with tiers (a :class:`registry.ops.tiers.Tiers`)."""

    @property
    def fast(self) -> Store: ...

    @property
    def durable(self) -> ObjectRoot: ...

    @property
    def cache_location(self) -> str: ...

    @property
    def cached(self) -> bool: ...


def cache_relpath(info: CheckpointInfo) -> str:
    """Where this host's cache keeps the durable copy of ``info``'s payload, relative to the fast root."""
    digest = (info.manifest_sha256 or "none")[:16]
    return f"{CACHE_DIR}/{info.run}/{step_dirname(info.step)}-{digest}"


def _parse_cached(name: str) -> tuple[int, str] | None:
    """The step and the digest prefix a cached copy's name (:func:`cache_relpath`) holds; None for other names."""
    stem, _, digest = name.rpartition("-")
    parsed = parse_step_dirname(stem)
    if parsed is None or parsed[1] != "final" or not digest:
        return None
    return parsed[0], digest


def _cache_runs(tiers: CacheHost) -> list[Path]:
    try:
        return [d for d in (tiers.fast.root / CACHE_DIR).iterdir() if d.is_dir() and not d.is_symlink()]
    except FileNotFoundError:
        return []


def lock_path(cached: Path) -> Path:
    return cached.parent / f".{cached.name}.lock"


@contextmanager
def host_lock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """An exclusive ``fcntl`` lock on ``path`` (created), shared by every process of this host; with ``wait``
    False, yields False at once when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def abandoned_downloads(tiers: CacheHost) -> list[tuple[Path, int, Path]]:
    """This host's cache's staging directories that no download is filling now (its process was killed mid-way),
    each with its step and the cached copy it was for: a download holds the copy's host lock from start to rename."""
    found = []
    for run_dir in _cache_runs(tiers):
        for entry in run_dir.iterdir():
            hidden = parse_hidden(entry.name)
            copy = _parse_cached(hidden[0]) if hidden is not None and hidden[1] == "tmp" else None
            if copy is None or hidden is None or not entry.is_dir() or entry.is_symlink():
                continue
            cached = run_dir / hidden[0]
            with host_lock(lock_path(cached), wait=False) as free:
                if free:
                    found.append((entry, copy[0], cached))
    return found


def remove_abandoned_download(staging: Path, cached: Path) -> bool | str:
    """Remove a staging directory :func:`abandoned_downloads` found, unless a download took the lock since."""
    with host_lock(lock_path(cached), wait=False) as free:
        if not free:
            return "a download of that copy is under way"
        shutil.rmtree(staging)
    return True


def _stale(catalog: Catalog, run: str, step: int, digest: str) -> bool:
    """Whether nothing will read a cached copy of ``run@step`` whose payload's digest starts with ``digest``: the
    step has ended, or holds another payload now."""
    row = catalog.get(run, step)
    return row is None or row.status in ENDED or (
        row.manifest_sha256 is not None and not row.manifest_sha256.startswith(digest))


def stale_cached_copies(tiers: CacheHost, catalog: Catalog, *, run: str | None = None) -> list[tuple[str, int, Path]]:
    """This host's cached downloads (of one ``run``) whose step has ended or was published again since, and the
    leftovers of their removal: no load reads them again, and nothing else frees their space."""
    found = []
    for run_dir in _cache_runs(tiers):
        if run is not None and run_dir.name != run:
            continue
        for entry in sorted(run_dir.iterdir()):
            hidden = parse_hidden(entry.name)
            copy = _parse_cached(hidden[0] if hidden is not None else entry.name)
            if copy is None or not entry.is_dir() or entry.is_symlink() or hidden is not None and hidden[1] == "tmp":
                continue
            if hidden is not None or _stale(catalog, run_dir.name, copy[0], copy[1]):
                found.append((run_dir.name, copy[0], entry))
    return found


def evict_cached_copy(tiers: CacheHost, catalog: Catalog, run: str, step: int, cached: Path, *,
                      actor: str) -> bool | str:
    """Remove a copy :func:`stale_cached_copies` found, under its host lock and only if it is still stale then (a
    load downloading or reading it holds that lock); this host's row naming it is marked ``deleted`` first."""
    hidden = parse_hidden(cached.name)
    name = hidden[0] if hidden is not None else cached.name
    copy = _parse_cached(name)
    if copy is None:
        return "not a cached copy"
    with host_lock(lock_path(cached.parent / name), wait=False) as free:
        if not free:
            return "a load of that copy is under way"
        if hidden is not None:  # a removal's leftover
            shutil.rmtree(cached)
            return True
        if not _stale(catalog, run, step, copy[1]):
            return "its step holds that payload again"
        digest = manifest_digest(cached)
        if digest is not None:  # a catalog that cannot record it (read-only) leaves a row no load reads
            note("the evicted cached copy", lambda: ReplicaCatalog(catalog).set_replica_status(
                run, step, tiers.cache_location, "deleted", path=tiers.fast.relpath(cached), manifest_sha256=digest,
                only_from=("published", "verified"), actor=actor, reason="its step ended or holds another payload"))
        crashpoint("cache-evict-after-mark")
        remove_checkpoint_dir(cached)
    return True


def _evict_stale(tiers: CacheHost, catalog: Catalog, run: str, *, actor: str) -> None:
    """Evict this host's stale cached copies of ``run`` after a download; a failure is logged, never the load's."""
    try:
        for stale_run, step, cached in stale_cached_copies(tiers, catalog, run=run):
            if evict_cached_copy(tiers, catalog, stale_run, step, cached, actor=actor) is True:
                log.info("%s@%s: evicted this host's cached copy %s (its step ended or holds another payload)",
                         stale_run, step, cached)
    except (CatalogError, OSError) as exc:
        log.warning("this host's stale cached copies of %s were not evicted: %s", run, exc)


def note(what: str, record: Callable[[], object]) -> None:
    """Record what a load found about a copy; a catalog that cannot record it (read-only, or down) does not fail
    the load, which has its bytes."""
    try:
        record()
    except CatalogError as exc:
        log.warning("%s was not recorded in the catalog: %s", what, exc)


def read_uncached(tiers: CacheHost, prefix: str, info: CheckpointInfo, read: Callable[[Path, bool], T]) -> T:
    """``read`` of a download of the durable copy into a temporary directory, removed once read (a read-only
    registry on a host with no fast tier of its own writes nothing there). Bytes that differ as they land are
    downloaded again; nothing is marked (a read-only catalog records nothing)."""
    import tempfile

    def fetch() -> T:
        with tempfile.TemporaryDirectory(prefix="registry-download-") as tmp:
            where = Path(tmp) / step_dirname(info.step)
            _download(tiers, prefix, where, info)
            return read(where, False)
    try:
        return fetch()
    except CorruptCheckpointError as exc:
        return read_again(exc, fetch, what=f"{info.run}@{info.step}: its durable copy {tiers.durable.url(prefix)}")


def read_cached(tiers: CacheHost, catalog: Catalog, prefix: str, info: CheckpointInfo,
                 read: Callable[[Path, bool], T], *, verify: bool, holder: str) -> T:
    """This host's cached copy of ``info``, downloaded from ``prefix`` on the durable tier if it has none yet; a
    download then evicts the run's cached copies no load will read again (:func:`stale_cached_copies`).

    Bytes of the durable copy that differ as they land are downloaded again
    before anything is marked; when they differ again, the durable copy is
    marked ``corrupt`` (compare-and-set on its path and the step's digest) and
    the ``CorruptCheckpointError`` raised."""
    replicas = ReplicaCatalog(catalog)
    cached = tiers.fast.root / cache_relpath(info)

    def fetch() -> T:
        shutil.rmtree(cached, ignore_errors=True)
        _download(tiers, prefix, cached, info)
        return read(cached, False)  # bytes just downloaded were checked piece by piece as they landed

    with host_lock(lock_path(cached)):
        fresh = True
        try:
            if (cached / "manifest.json").is_file():
                try:
                    fresh, loaded = False, read(cached, verify)
                except CorruptCheckpointError as exc:  # this host's disk: its cache's to repair, never a verdict
                    log.warning("%s@%s: this host's cached copy %s is damaged (%s); downloading it again",
                                info.run, info.step, cached, exc)
                    fresh, loaded = True, fetch()
            else:
                loaded = fetch()
        except CorruptCheckpointError as exc:
            try:
                loaded = read_again(exc, fetch, what=f"{info.run}@{info.step}: its durable copy "
                                                     f"{tiers.durable.url(prefix)}")
            except CorruptCheckpointError as stable:
                shutil.rmtree(cached, ignore_errors=True)
                why = str(stable)
                note("the corrupt durable copy", lambda: replicas.set_replica_status(
                    info.run, info.step, DURABLE, "corrupt", path=prefix, manifest_sha256=info.manifest_sha256,
                    only_from=("verified",), actor=holder, reason=why))
                log.error("%s@%s: its durable copy is corrupt (%s); marked so", info.run, info.step, stable)
                raise
        if fresh:
            note("this host's cached copy", lambda: record_cached_copy(tiers, catalog, info, writer=holder))
    if fresh:
        _evict_stale(tiers, catalog, info.run, actor=holder)
    return loaded


def record_cached_copy(tiers: CacheHost, catalog: Catalog, info: CheckpointInfo, *, writer: str | None) -> bool:
    """Record this host's cached copy of ``info``'s payload (:func:`cache_relpath`) ``verified`` at its cache's
    location, only while the step still holds that payload; whether it was recorded."""
    return ReplicaCatalog(catalog).record(info.run, info.step, location=tiers.cache_location, status="verified",
                                          path=cache_relpath(info), manifest_sha256=info.manifest_sha256 or "",
                                          writer=writer, event="cached")


def durable_located(tiers: CacheHost, catalog: Catalog, info: CheckpointInfo) -> CheckpointInfo | None:
    """``info`` located at its verified durable copy (``url`` set), or None when it has none: what a sharded load
    reads by ranged GETs when a rank's host holds no directory of the step (nothing is downloaded whole)."""
    copy = ReplicaCatalog(catalog).copy(info.run, info.step, DURABLE, manifest_sha256=info.manifest_sha256)
    return None if copy is None else info.at(tiers.durable.url(copy.path))


def durable_read_failed(tiers: CacheHost, catalog: Catalog, info: CheckpointInfo, prefix: str,
                        exc: CorruptCheckpointError, *, holder: str) -> NoCopyError | None:
    """A ranged read of ``info``'s durable copy under ``prefix`` found bytes that differ (``exc``): the copy is
    re-hashed from storage first (:func:`registry.ops.verdicts.read_again`); None when it reads intact (read it
    again), else the copy is marked ``corrupt`` (compare-and-set, as :func:`read_cached` does) and the
    ``NoCopyError`` to judge is returned: the step stands on any other copy, and ``@latest`` goes on to an older
    step. A re-read that fails otherwise (the server's trouble) is raised as it is."""
    from dataclasses import replace

    from registry.roots.objectstore import ObjectStoreRoot  # the object store's modules: a tiered root's
    at, durable = replace(info, path=Path(prefix)), ObjectStoreRoot(tiers.durable)

    def rehash() -> None:  # as verify re-hashes a copy: the manifest first, then every file against it
        manifest, digest = durable.stored_manifest(at)
        if manifest is None or digest != info.manifest_sha256:
            raise CorruptCheckpointError(digest if manifest is None else "manifest.json: not the one the catalog "
                                         "records", run=info.run, step=info.step, path=at.path)
        problems = durable.rehash(at, manifest, on_bytes=lambda _n: None)
        if problems:
            raise CorruptCheckpointError("; ".join(f"{p.name}: {p.problem}" for p in problems), run=info.run,
                                         step=info.step, path=at.path)
    try:
        read_again(exc, rehash, what=f"{info.run}@{info.step}: its durable copy {tiers.durable.url(prefix)}")
    except CorruptCheckpointError as stable:
        why = str(stable)
        note("the corrupt durable copy", lambda: ReplicaCatalog(catalog).set_replica_status(
            info.run, info.step, DURABLE, "corrupt", path=prefix, manifest_sha256=info.manifest_sha256,
            only_from=("verified",), actor=holder, reason=why))
        log.error("%s@%s: its durable copy is corrupt (%s); marked so", info.run, info.step, stable)
        return NoCopyError(f"{info.run}@{info.step} has no copy this host can read: not on its fast tier, and its "
                           f"durable copy is corrupt ({exc})", run=info.run, step=info.step, path=info.path)
    return None


def _download(tiers: CacheHost, prefix: str, dest: Path, info: CheckpointInfo) -> None:
    """The durable copy under ``prefix`` into ``dest``, through a hidden sibling renamed into place."""
    from registry.fs.objectread import download
    staging = hidden_sibling(dest, "tmp")
    try:
        staging.mkdir(parents=True)
        download(tiers.durable, prefix, staging, expected_digest=info.manifest_sha256)
        fsync_dir(staging)
        crashpoint("cache-after-download")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
        fsync_dir(dest.parent)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, RegistryError):  # a full disk: this host's, not the copy's
            raise StorageError(f"cannot download {info.run}@{info.step}'s durable copy into this host's cache "
                               f"{dest.parent}: {exc.strerror or exc}; nothing was kept",
                               path=dest.parent, run=info.run, step=info.step) from None
        raise


__all__ = ["CACHE_DIR", "abandoned_downloads", "cache_relpath", "durable_located", "durable_read_failed",
           "evict_cached_copy", "host_lock", "lock_path", "note", "read_cached", "read_uncached", "record_cached_copy",
           "remove_abandoned_download", "stale_cached_copies"]
