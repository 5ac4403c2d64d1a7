"""A root with tiers: a fast filesystem root, and a durable ``s3://`` root the steps are replicated to.

The fast root is where a trainer publishes (as on any directory root); the
durable root is bound to the catalog (``registry.ops.binding``) and holds
each step's durable copy under an attempt prefix of its own. Each fast root
carries a random tier id in ``<fast>/.registry/tier.json`` (written
create-only, with the catalog's id), so several hosts with fast directories
of their own share one catalog and one durable root; the catalog records
each copy as a replica (``registry.catalog.replicas``): a step's directory
under the fast root at ``fast:<tier id>``, this host's cached download of it
at ``cache:<tier id>``, its durable copy at ``durable``.

Loads take the nearest verified copy (:func:`read_nearest`): the fast
copy when it is there and good; else the durable copy, downloaded once per
host into ``<fast>/.registry/cache/`` under an ``fcntl`` lock that every
process of the host shares, then recorded as this host's cache copy
(:func:`record_cached_copy`), a row apart from its fast copy's: a host that
holds an older payload of the step in its fast directory keeps that row, so
fsck finds the directory superseded, never damaged. A corrupt
fast copy falls back to the durable copy of the same step before the
loader goes on to any older step. A copy is marked corrupt only when a second
read from storage differs too (:func:`registry.ops.verdicts.read_again`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from registry.catalog import CommitRecord, PayloadRecord
from registry.catalog.replicas import DURABLE, ReplicaCatalog, cache_location, fast_location
from registry.crashpoints import crashpoint
from registry.errors import (CatalogError, CorruptCheckpointError, NoCopyError, ReadOnlyError, RegistryError,
                             RootError, RootMismatchError, StorageError)
from registry.format.layout import REGISTRY_DIR, hidden_sibling, parse_hidden, parse_step_dirname, step_dirname
from registry.fs.filemaps import Extras, Loaded, read_directory
from registry.fs.removal import manifest_digest, remove_checkpoint_dir
from registry.fs.store import Store, fsync_dir
from registry.ops.verdicts import read_again
from registry.records import ENDED, CheckpointInfo

if TYPE_CHECKING:
    from registry.catalog import Catalog
    from registry.fs.objects import ObjectRoot
    from registry.ops.protocol import CommitHooks

log = logging.getLogger(__name__)

TIER_MARKER = "tier.json"
CACHE_DIR = f"{REGISTRY_DIR}/cache"
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Tiers:
    """A fast root and the durable root its steps are replicated to; ``tier_id`` names the fast one."""

    fast: Store
    durable: ObjectRoot
    tier_id: str
    # False for a read-only registry on a host the tier does not know yet (no fast directory or no marker):
    # nothing is written there, and each read of a durable copy downloads it into a temporary directory
    cached: bool = True

    @property
    def location(self) -> str:
        """This fast tier's replica location (``fast:<tier id>``): the steps' directories under its root."""
        return fast_location(self.tier_id)

    @property
    def cache_location(self) -> str:
        """This host's cache's replica location (``cache:<tier id>``): its downloads of durable copies."""
        return cache_location(self.tier_id)


def _marker(store: Store) -> Path:
    return store.root / REGISTRY_DIR / TIER_MARKER


def _read_tier(store: Store) -> dict[str, Any] | None:
    path = _marker(store)
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RootError(f"cannot read {path}: {exc.strerror}", path=path) from None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("tier_id"), str) or not isinstance(
            doc.get("catalog_id"), str):
        raise RootError(f"{path} is not a tier marker (expected JSON with a tier_id and a catalog_id)", path=path)
    return doc


def open_tier(store: Store, *, catalog_id: str, create: bool) -> str:
    """The tier id of the fast root ``store`` for the catalog ``catalog_id``, its marker written if ``create``.

    A marker that names another catalog is refused (``RootMismatchError``):
    that fast root belongs to another registry. Written create-only, so two
    processes opening a new fast root at once agree on one id.
    """
    doc = _read_tier(store)
    if doc is None:
        if not create:
            raise RootError(f"fast root {store.root} has no {REGISTRY_DIR}/{TIER_MARKER}: it was never opened "
                            "by a writer with this durable tier (open it once without read_only/create=False)",
                            path=store.root)
        doc = {"tier_id": secrets.token_hex(8), "catalog_id": catalog_id}
        path = _marker(store)
        # written whole under a temporary name, then linked into place: the link is the create-only step, so a
        # reader (or a crash) never meets a marker that exists but is not yet written
        tmp = path.parent / f".{TIER_MARKER}.{secrets.token_hex(4)}"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "xb") as f:
                f.write((json.dumps(doc, indent=2) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.link(tmp, path)
        except FileExistsError:
            return open_tier(store, catalog_id=catalog_id, create=False)
        except OSError as exc:
            raise RootError(f"cannot write {path}: {exc.strerror}", path=path) from None
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
    if doc["catalog_id"] != catalog_id:
        raise RootMismatchError(f"fast root {store.root} is a tier of another catalog (id {doc['catalog_id']}), "
                                f"not of this one (id {catalog_id}); pass the --root, --durable and --url that "
                                "belong together", path=store.root)
    return str(doc["tier_id"])


def known_tier(store: Store, *, catalog_id: str) -> str | None:
    """The tier id of the fast root ``store`` if a writer ever named it, else None; writes nothing (a read-only
    registry on a host new to the tier). A marker of another catalog is refused as by :func:`open_tier`."""
    try:
        doc = _read_tier(store)
    except RootError:
        if not store.root.exists():
            return None
        raise
    if doc is None:
        return None
    return open_tier(store, catalog_id=catalog_id, create=False)


def refuse_durable_as_root(catalog: Catalog, root: str) -> None:
    """An ``s3://`` root whose catalog records durable copies is a durable tier, never a root of its own: its
    prefixes are named by replica rows, which a plain root's fsck and gc would take for orphans."""
    if ReplicaCatalog(catalog).has_durable():
        raise RootError(f"{root} is the durable tier of this catalog, not a checkpoint root of its own: open the "
                        "fast root with durable= (--durable) instead")


@dataclass(frozen=True)
class FastCopyHooks:
    """A publish's commit hooks on a tiered root: the commit also records the fast tier's copy."""

    inner: CommitHooks
    location: str
    path: str

    def record(self, payload: PayloadRecord) -> CommitRecord:
        return replace(self.inner.record(payload), replica=(self.location, self.path))

    def failed(self) -> None:
        self.inner.failed()

    def done(self) -> None:
        self.inner.done()


# --------------------------------------------------------------------------- reading the nearest copy


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


def _cache_runs(tiers: Tiers) -> list[Path]:
    try:
        return [d for d in (tiers.fast.root / CACHE_DIR).iterdir() if d.is_dir() and not d.is_symlink()]
    except FileNotFoundError:
        return []


def _lock_path(cached: Path) -> Path:
    return cached.parent / f".{cached.name}.lock"


@contextmanager
def _host_lock(path: Path, *, wait: bool = True) -> Iterator[bool]:
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


def abandoned_downloads(tiers: Tiers) -> list[tuple[Path, int, Path]]:
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
            with _host_lock(_lock_path(cached), wait=False) as free:
                if free:
                    found.append((entry, copy[0], cached))
    return found


def remove_abandoned_download(staging: Path, cached: Path) -> bool | str:
    """Remove a staging directory :func:`abandoned_downloads` found, unless a download took the lock since."""
    with _host_lock(_lock_path(cached), wait=False) as free:
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


def stale_cached_copies(tiers: Tiers, catalog: Catalog, *, run: str | None = None) -> list[tuple[str, int, Path]]:
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


def evict_cached_copy(tiers: Tiers, catalog: Catalog, run: str, step: int, cached: Path, *,
                      actor: str) -> bool | str:
    """Remove a copy :func:`stale_cached_copies` found, under its host lock and only if it is still stale then (a
    load downloading or reading it holds that lock); this host's row naming it is marked ``deleted`` first."""
    hidden = parse_hidden(cached.name)
    name = hidden[0] if hidden is not None else cached.name
    copy = _parse_cached(name)
    if copy is None:
        return "not a cached copy"
    with _host_lock(_lock_path(cached.parent / name), wait=False) as free:
        if not free:
            return "a load of that copy is under way"
        if hidden is not None:  # a removal's leftover
            shutil.rmtree(cached)
            return True
        if not _stale(catalog, run, step, copy[1]):
            return "its step holds that payload again"
        digest = manifest_digest(cached)
        if digest is not None:  # a catalog that cannot record it (read-only) leaves a row no load reads
            _note("the evicted cached copy", lambda: ReplicaCatalog(catalog).set_replica_status(
                run, step, tiers.cache_location, "deleted", path=tiers.fast.relpath(cached), manifest_sha256=digest,
                only_from=("published", "verified"), actor=actor, reason="its step ended or holds another payload"))
        crashpoint("cache-evict-after-mark")
        remove_checkpoint_dir(cached)
    return True


def _evict_stale(tiers: Tiers, catalog: Catalog, run: str, *, actor: str) -> None:
    """Evict this host's stale cached copies of ``run`` after a download; a failure is logged, never the load's."""
    try:
        for stale_run, step, cached in stale_cached_copies(tiers, catalog, run=run):
            if evict_cached_copy(tiers, catalog, stale_run, step, cached, actor=actor) is True:
                log.info("%s@%s: evicted this host's cached copy %s (its step ended or holds another payload)",
                         stale_run, step, cached)
    except (CatalogError, OSError) as exc:
        log.warning("this host's stale cached copies of %s were not evicted: %s", run, exc)


def _not_durable_yet(tiers: Tiers, info: CheckpointInfo) -> NoCopyError:
    return NoCopyError(f"{info.run}@{info.step} has no copy this host can read: it is not on the fast tier "
                       f"{tiers.fast.root} and has no verified durable copy yet (its writer's host holds it until "
                       "it is replicated)", run=info.run, step=info.step, path=info.path)


def read_nearest(tiers: Tiers, catalog: Catalog, info: CheckpointInfo, *, verify: bool, map_location: Any,
                 trust_pickle: bool, extras: Extras, holder: str) -> Loaded:
    """Read ``info`` (placed under the fast root) from the nearest verified copy (see :func:`nearest`)."""
    def read(directory: Path, check: bool) -> Loaded:
        return read_directory(directory, verify=check, trust_pickle=trust_pickle, map_location=map_location,
                              extras=extras, expected_digest=info.manifest_sha256)

    return nearest(tiers, catalog, info, read, verify=verify, holder=holder)


def nearest(tiers: Tiers, catalog: Catalog, info: CheckpointInfo, read: Callable[[Path, bool], T], *,
            verify: bool, holder: str) -> T:
    """``read(directory, check)`` of the nearest verified copy of ``info`` on this host: its fast copy, else
    this host's cached download of the durable copy (see the module's docstring). Every reader of a tiered
    root's bytes (a load, a checkout, a diff) comes here. ``read`` must raise ``CorruptCheckpointError`` on
    bytes that do not match, and may be called again on another copy after it raised.

    Raises ``NoCopyError`` when neither this fast tier nor the durable tier
    holds its payload (or its durable copy is corrupt), ``CorruptCheckpointError``
    when the fast copy is bad and there is no durable one (the step's only copy:
    the load's judge reads it again before any verdict), and ``StorageError``
    when the durable tier cannot be reached (nothing is marked).
    """
    replicas = ReplicaCatalog(catalog)
    fast_bad: CorruptCheckpointError | None = None
    if info.path.is_dir():
        try:
            return read(info.path, verify)
        except CorruptCheckpointError as exc:
            if not older_payload_here(tiers, replicas, info.run, info.step, info.path, info.manifest_sha256):
                if replicas.copy(info.run, info.step, DURABLE, manifest_sha256=info.manifest_sha256) is None:
                    raise
                try:
                    return read_again(exc, lambda: read(info.path, verify),
                                      what=f"{info.run}@{info.step}: this host's copy {info.path}")
                except CorruptCheckpointError as stable:
                    fast_bad = stable
    if fast_bad is not None:
        log.warning("%s@%s: the fast copy is corrupt (%s); reading the durable copy of the same step",
                    info.run, info.step, fast_bad)
        relpath = tiers.fast.relpath(info.path)
        why = str(fast_bad)
        _note("the corrupt fast copy", lambda: replicas.set_replica_status(
            info.run, info.step, tiers.location, "corrupt", path=relpath, manifest_sha256=info.manifest_sha256,
            only_from=("published", "verified"), actor=holder, reason=why))
    return _from_durable(tiers, catalog, info, read, verify=verify, holder=holder, fast_bad=fast_bad)


def _from_durable(tiers: Tiers, catalog: Catalog, info: CheckpointInfo, read: Callable[[Path, bool], T], *,
                  verify: bool, holder: str, fast_bad: CorruptCheckpointError | None = None) -> T:
    """``read`` of this host's cached copy of ``info``'s verified durable copy; ``NoCopyError`` when it has none,
    or when that copy proved corrupt (marked so by :func:`_read_cached`), unless the fast copy was bad too."""
    stored = ReplicaCatalog(catalog).copy(info.run, info.step, DURABLE, manifest_sha256=info.manifest_sha256)
    if stored is None:
        if fast_bad is not None:
            raise fast_bad
        raise _not_durable_yet(tiers, info)
    try:
        if not tiers.cached:
            return _read_uncached(tiers, stored.path, info, read)
        return _read_cached(tiers, catalog, stored.path, info, read, verify=verify, holder=holder)
    except CorruptCheckpointError as exc:
        if fast_bad is not None:
            raise fast_bad from exc
        raise NoCopyError(f"{info.run}@{info.step} has no copy this host can read: not on the fast tier "
                          f"{tiers.fast.root}, and its durable copy is corrupt ({exc})",
                          run=info.run, step=info.step, path=info.path) from exc


def older_payload_here(tiers: Tiers, replicas: ReplicaCatalog, run: str, step: int, directory: Path,
                       digest: str | None) -> bool:
    """Whether this host's ``directory`` of ``run@step`` holds an older payload of the step, one this fast tier
    recorded before the step was published again on another host: not the step's copy here, so it is neither
    read nor a verdict on the step (a local leftover is not corruption)."""
    held = manifest_digest(directory)
    if held is None or digest is None or held == digest:
        return False
    older = any(r.location == tiers.location and r.manifest_sha256 == held
                and r.status in ("published", "verified") for r in replicas.replicas(run, step))
    if older:
        log.warning("%s@%s: this host's %s holds an older payload of the step (it was published again on another "
                    "host since); it is not read, and says nothing about the step", run, step, directory)
    return older


def mark_fast_copy(tiers: Tiers, catalog: Catalog, run: str, step: int, directory: Path, digest: str, reason: str,
                   *, actor: str) -> bool:
    """Record this host's copy of ``run@step`` at ``directory`` ``corrupt`` instead of the step, when a verified
    durable copy of the same payload (``digest``) stands; False (nothing recorded) when none does, and the step's
    own verdict is the caller's. Compare-and-set on the copy's path and digest (a :data:`CopyOnly`). True, and
    nothing recorded, when ``directory`` holds an older payload of the step (:func:`older_payload_here`)."""
    replicas = ReplicaCatalog(catalog)
    if older_payload_here(tiers, replicas, run, step, directory, digest):
        return True
    if replicas.copy(run, step, DURABLE, manifest_sha256=digest) is None:
        return False
    marked = replicas.set_replica_status(run, step, tiers.location, "corrupt", path=tiers.fast.relpath(directory),
                                         manifest_sha256=digest, only_from=("published", "verified"), actor=actor,
                                         reason=reason)
    if marked:
        log.warning("%s@%s: this host's copy %s is damaged (%s); marked so, the step stands on its durable copy",
                    run, step, directory, reason)
    return True


def restore_fast_copy(tiers: Tiers, catalog: Catalog, run: str, step: int, directory: Path, digest: str, *,
                      actor: str) -> bool:
    """Record this host's copy of ``run@step`` at ``directory``, marked corrupt, ``verified`` again: its bytes
    (payload ``digest``) read intact now. Compare-and-set on the copy's path, digest and ``corrupt`` status; a
    catalog that cannot record it is logged. Whether it was restored."""
    restored = False

    def restore() -> None:
        nonlocal restored
        restored = ReplicaCatalog(catalog).set_replica_status(
            run, step, tiers.location, "verified", path=tiers.fast.relpath(directory), manifest_sha256=digest,
            only_from=("corrupt",), actor=actor, reason="its bytes read intact again")
    _note("the restored fast copy", restore)
    return restored


def _note(what: str, record: Callable[[], object]) -> None:
    """Record what a load found about a copy; a catalog that cannot record it (read-only, or down) does not fail
    the load, which has its bytes."""
    try:
        record()
    except CatalogError as exc:
        log.warning("%s was not recorded in the catalog: %s", what, exc)


def read_local(tiers: Tiers, catalog: Catalog, info: CheckpointInfo, read: Callable[[Path, bool], T], *,
               verify: bool, holder: str, fast: bool = True) -> T:
    """``read(directory, check)`` of a directory of this host holding ``info``'s payload, for a mapped
    (distributed) load: the fast copy when it is here (``check`` False: the caller checks what it maps), else
    this host's cached download of the durable copy, checked when ``verify`` and downloaded again when damaged,
    so that a bad cached file is this host's to repair, never a verdict on the step (``NoCopyError`` when there
    is no durable copy). ``fast`` False: the fast copy was found damaged, read the durable copy."""
    if fast and info.path.is_dir():
        return read(info.path, False)
    return _from_durable(tiers, catalog, info, read, verify=verify, holder=holder)


def _read_uncached(tiers: Tiers, prefix: str, info: CheckpointInfo, read: Callable[[Path, bool], T]) -> T:
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


def _read_cached(tiers: Tiers, catalog: Catalog, prefix: str, info: CheckpointInfo,
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

    with _host_lock(_lock_path(cached)):
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
                _note("the corrupt durable copy", lambda: replicas.set_replica_status(
                    info.run, info.step, DURABLE, "corrupt", path=prefix, manifest_sha256=info.manifest_sha256,
                    only_from=("verified",), actor=holder, reason=why))
                log.error("%s@%s: its durable copy is corrupt (%s); marked so", info.run, info.step, stable)
                raise
        if fresh:
            _note("this host's cached copy", lambda: record_cached_copy(tiers, catalog, info, writer=holder))
    if fresh:
        _evict_stale(tiers, catalog, info.run, actor=holder)
    return loaded


def record_cached_copy(tiers: Tiers, catalog: Catalog, info: CheckpointInfo, *, writer: str | None) -> bool:
    """Record this host's cached copy of ``info``'s payload (:func:`cache_relpath`) ``verified`` at its cache's
    location, only while the step still holds that payload; whether it was recorded."""
    return ReplicaCatalog(catalog).record(info.run, info.step, location=tiers.cache_location, status="verified",
                                          path=cache_relpath(info), manifest_sha256=info.manifest_sha256 or "",
                                          writer=writer, event="cached")


def _download(tiers: Tiers, prefix: str, dest: Path, info: CheckpointInfo) -> None:
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


def located_here(tiers: Tiers, catalog: Catalog, info: CheckpointInfo) -> CheckpointInfo:
    """Where this host finds the placed step ``info``: its fast copy when that holds the step's payload, else
    this host's cached copy of it, else the URL of its verified durable copy (what a load downloads). A step
    with none of these comes back as placed: ``show`` and ``resolve`` name no directory that is not there."""
    digest = info.manifest_sha256
    if digest is not None and manifest_digest(info.path) == digest:
        return info
    cached = tiers.fast.root / cache_relpath(info)
    if digest is not None and manifest_digest(cached) == digest:
        return replace(info, path=cached)
    copy = ReplicaCatalog(catalog).copy(info.run, info.step, DURABLE, manifest_sha256=digest)
    if copy is not None and copy.status == "verified":
        return info.at(tiers.durable.url(copy.path))
    return info


def local_copy(tiers: Tiers, catalog: Catalog, info: CheckpointInfo, *, holder: str) -> CheckpointInfo:
    """``info`` placed at a directory of this host that holds its payload: the fast copy, or this host's cached
    copy of the durable one, downloaded now if it has none (for readers of directories: diff)."""
    from registry.fs.filemaps import check_manifest_digest
    if not tiers.cached and manifest_digest(info.path) != info.manifest_sha256:
        raise ReadOnlyError(f"{info.run}@{info.step} has no copy on this host, and a read-only registry keeps "
                            f"none in {tiers.fast.root}: open it writable once, or load the step instead")

    def here(directory: Path, _check: bool) -> Path:
        check_manifest_digest(directory, manifest_digest(directory), info.manifest_sha256, run=info.run,
                              step=info.step)
        return directory
    return replace(info, path=nearest(tiers, catalog, info, here, verify=False, holder=holder), url=None)
