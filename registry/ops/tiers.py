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
host into ``<fast>/.registry/cache/`` (:mod:`registry.ops.tiercache`), under
an ``fcntl`` lock that every process of the host shares, then recorded as this
host's cache copy, a row apart from its fast copy's: a host that
holds an older payload of the step in its fast directory keeps that row, so
fsck finds the directory superseded, never damaged. A corrupt
fast copy falls back to the durable copy of the same step before the
loader goes on to any older step. A copy is marked corrupt only when a second
read from storage differs too (:func:`registry.ops.verdicts.read_again`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from registry.catalog import CommitRecord, PayloadRecord
from registry.catalog.replicas import DURABLE, ReplicaCatalog, cache_location, fast_location, part_location
from registry.errors import CorruptCheckpointError, NoCopyError, ReadOnlyError, RootError, RootMismatchError
from registry.format.layout import REGISTRY_DIR
from registry.fs.filemaps import Extras, Loaded, read_directory
from registry.fs.removal import manifest_digest
from registry.fs.store import Store, fsync_dir
from registry.ops.tiercache import cache_relpath, note, read_cached, read_uncached
from registry.ops.verdicts import read_again
from registry.records import CheckpointInfo
from registry.roots.shards import StepParts

if TYPE_CHECKING:
    from registry.catalog import Catalog
    from registry.fs.objects import ObjectRoot
    from registry.ops.protocol import CommitHooks

log = logging.getLogger(__name__)

TIER_MARKER = "tier.json"
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

    @property
    def part_location(self) -> str:
        """This host's parts' replica location (``part:<tier id>``): its share of steps published from several
        hosts (``registry.distributed.parts``)."""
        return part_location(self.tier_id)


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


def _not_durable_yet(tiers: Tiers, info: CheckpointInfo) -> NoCopyError:
    return NoCopyError(f"{info.run}@{info.step} has no copy this host can read: it is not on the fast tier "
                       f"{tiers.fast.root} and has no verified durable copy yet (its writer's host holds it until "
                       "it is replicated)", run=info.run, step=info.step, path=info.path)


def read_nearest(tiers: Tiers, catalog: Catalog, info: CheckpointInfo, *, verify: bool, map_location: Any,
                 trust_pickle: bool, extras: Extras, holder: str,
                 on_read: Callable[[Path], None] | None = None) -> Loaded:
    """Read ``info`` (placed under the fast root) from the nearest verified copy (see :func:`nearest`);
    ``on_read(directory)`` once it was read from there."""
    def read(directory: Path, check: bool) -> Loaded:
        loaded = read_directory(directory, verify=check, trust_pickle=trust_pickle, map_location=map_location,
                                extras=extras, expected_digest=info.manifest_sha256)
        if on_read is not None:
            on_read(directory)
        return loaded

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
        note("the corrupt fast copy", lambda: replicas.set_replica_status(
            info.run, info.step, tiers.location, "corrupt", path=relpath, manifest_sha256=info.manifest_sha256,
            only_from=("published", "verified"), actor=holder, reason=why))
    return _from_durable(tiers, catalog, info, read, verify=verify, holder=holder, fast_bad=fast_bad)


def _from_durable(tiers: Tiers, catalog: Catalog, info: CheckpointInfo, read: Callable[[Path, bool], T], *,
                  verify: bool, holder: str, fast_bad: CorruptCheckpointError | None = None) -> T:
    """``read`` of this host's cached copy of ``info``'s verified durable copy; ``NoCopyError`` when it has none,
    or when that copy proved corrupt (marked so by :func:`read_cached`), unless the fast copy was bad too."""
    stored = ReplicaCatalog(catalog).copy(info.run, info.step, DURABLE, manifest_sha256=info.manifest_sha256)
    if stored is None:
        if fast_bad is not None:
            raise fast_bad
        raise _not_durable_yet(tiers, info)
    try:
        if not tiers.cached:
            return read_uncached(tiers, stored.path, info, read)
        return read_cached(tiers, catalog, stored.path, info, read, verify=verify, holder=holder)
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
    note("the restored fast copy", restore)
    return restored


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


def step_parts(catalog: Catalog, info: CheckpointInfo) -> StepParts | None:
    """The verified parts holding ``info``'s payload (a sharded step published from ranks on several hosts), or
    None: what a load on those hosts reads each host's share of the step from."""
    from registry.catalog.replicas import PART
    rows = [r for r in ReplicaCatalog(catalog).replicas(info.run, info.step)
            if r.location.startswith(PART) and r.status == "verified" and r.files is not None
            and info.manifest_sha256 is not None and r.manifest_sha256 == info.manifest_sha256]
    if not rows:
        return None
    path = rows[0].path  # one publish's parts share their path; an identical later one's rows replaced these
    return StepParts(path=path, files={r.location[len(PART):]: frozenset(r.files or ()) for r in rows
                                       if r.path == path})


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
