"""Reading a step through the catalog: resolve, lease, read, judge, fall back.

Every load that starts from a ref goes through :class:`CatalogRead`: the
local :meth:`Registry.load <registry.api.Registry.load>` and rank 0 of a
distributed one (:mod:`registry.distributed.loader`), which differ only in how they read
the bytes. The judging is the same for both:

- The step is read under a reader lease. No lease for a step that resolved
  as live means retention deleted it in between: resolve again.
- Bytes that do not match (a checksum, a size, a format, a manifest that is
  not the catalog's) are read again from storage first
  (:func:`registry.ops.verdicts.read_again`): intact there, the mismatch was
  this host's or the wire's, nothing is marked and the same step is read
  again; differing there too (or on that second read), they condemn the
  step, by compare-and-set on the manifest digest the read was checked
  against. If the row changed since it was
  resolved (another writer overwrote the step, gc deleted it), the set does
  not happen and the ref is resolved again: a race is not corruption.
- Trouble of this process (:class:`CheckpointReadError`: an unmounted root,
  no file descriptors, no permission) condemns nothing and tries no older
  step; the load fails with a message saying so.
- A corrupt ``@latest`` falls back to the next older step unless the caller
  said ``fallback=False``; how far it went is logged and kept on the result
  as a :class:`Fallback`.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from registry.errors import (CheckpointDeletedError, CheckpointReadError, CorruptCheckpointError, NoCopyError,
                             RegistryError)
from registry.records import LIVE, CheckpointInfo, Fallback, Skipped, Status
from registry.format.refs import Ref

if TYPE_CHECKING:
    from registry.roots.base import Root
    from registry.fs.filemaps import Extras, Loaded
    from registry.catalog import Catalog
    from registry.ops.copies import Copies

log = logging.getLogger(__name__)
MAX_RACES = 8  # resolves in a row that lost a race to a writer or gc before giving up


class Access(Protocol):
    """What a catalog read needs from its owner."""

    @property
    def catalog(self) -> Catalog: ...

    @property
    def root(self) -> Path: ...

    @property
    def holder(self) -> str: ...

    @property
    def lease_ttl(self) -> timedelta: ...

    @property
    def home(self) -> Root: ...

    @property
    def copies(self) -> Copies: ...


@dataclass(frozen=True, kw_only=True)
class ReadAccess:
    """A plain :class:`Access`: the catalog, the root, who holds the leases, for how long.

    ``home``: the root the steps live in, which places and reads them; ``root``: its directory on this host
    (``Path()`` on an object store); ``copies``: which copy of a step this host reads and what a bad one
    condemns (:mod:`registry.ops.copies`).
    """

    catalog: Catalog
    home: Root
    root: Path
    holder: str
    lease_ttl: timedelta
    copies: Copies


def placed(access: Access, info: CheckpointInfo) -> CheckpointInfo:
    """A catalog row where readers find it: its path made absolute, or on an object store its ``url`` set."""
    return access.home.place(info)


def read_step(access: Access, info: CheckpointInfo, *, verify: bool, map_location: Any, trust_pickle: bool,
              extras: Extras = True) -> Loaded:
    """Read a placed step's payload from its nearest copy, matched against the catalog's digest; a policy delta
    step comes back rebuilt from its chain (:func:`registry.ops.policy.rebuild`), the tensors a full gives."""
    from registry.ops.policy import read_rebuilt
    return read_rebuilt(access, info, verify=verify, map_location=map_location, trust_pickle=trust_pickle,
                        extras=extras)


def acquire_lease(access: Access, info: CheckpointInfo) -> int:
    """A reader lease on ``info``; ``CheckpointDeletedError`` when it stopped being live since it resolved."""
    lease = access.catalog.acquire_lease(info.run, info.step, holder=access.holder, ttl=access.lease_ttl)
    if lease is None:
        # retention marked it deleted since it was resolved: its directory may be going away
        raise CheckpointDeletedError(f"{info.run}@{info.step} was deleted while being resolved",
                                     run=info.run, step=info.step, path=info.path)
    return lease


def check_digest(info: CheckpointInfo, digest: str | None) -> None:
    """The manifest read (sha256 ``digest``) must be the one the catalog recorded for this step."""
    from registry.fs.filemaps import check_manifest_digest
    check_manifest_digest(info.path, digest, info.manifest_sha256, run=info.run, step=info.step)


class CatalogRead:
    """One load of ``ref``, candidate by candidate, until one reads clean or the load must fail.

    ``candidate()`` resolves and leases the next step; the caller reads it and
    either keeps it (``record()`` says how far the load fell back to reach
    it) or hands the failure to ``judge()``, which returns when another
    candidate should be tried and raises when the load is over.
    """

    def __init__(self, access: Access, ref: Ref, *, fallback: bool = True) -> None:
        self.access = access
        self.ref = ref
        self.fallback = fallback
        self.below: int | None = None
        self.info: CheckpointInfo | None = None
        self.lease: int | None = None
        self.skipped: list[Skipped] = []
        self.notes: list[str] = []  # fall-backs not yet told to the user
        self._races = 0
        self._reread: set[tuple[int, str | None]] = set()  # steps (with their payload) read again from storage

    def candidate(self) -> CheckpointInfo:
        """Release the previous step, resolve the ref and lease what it names (its path made absolute)."""
        self.release()
        while True:
            raw, lease = self.access.catalog.resolve_leased(self.ref, below=self.below, holder=self.access.holder,
                                                           ttl=self.access.lease_ttl)
            info = placed(self.access, raw)
            if info.status == Status.CORRUPT:
                raise CorruptCheckpointError(f"{self.ref} is marked corrupt (step {info.step}); "
                                             "run 'registry verify' after repairing it",
                                             run=info.run, step=info.step, path=info.path)
            if lease is None:  # gc deleted it between the resolve and the lease: resolve again
                self._raced()
                continue
            self.lease = lease
            self.info = info
            return info

    def release(self) -> None:
        if self.lease is not None:
            lease, self.lease = self.lease, None
            try:
                self.access.catalog.release_lease(lease)
            except Exception:  # noqa: BLE001 - an expired lease is harmless; never mask the load's outcome
                pass

    def judge(self, exc: BaseException) -> None:
        """Decide what the failure to read the current candidate means; return to try another.

        Raises the error the load ends with: ``exc`` itself, or for a reader's
        own trouble a ``CheckpointReadError`` that says what to check.
        """
        info = self.info
        self.release()
        if info is None:
            raise exc
        if isinstance(exc, NoCopyError):  # another host's step, not durable yet: nothing to condemn
            if self.ref.names_one_step or not self.fallback:
                raise exc
            self.skipped.append(Skipped(step=info.step, reason=str(exc), created_at=info.created_at))
            self.notes.append(f"{exc}; falling back to an older step")
            self.below = info.step
            return
        if isinstance(exc, CheckpointReadError):
            return self._unreadable(info, exc)
        if not isinstance(exc, CorruptCheckpointError):
            raise exc
        from registry.ops.verdicts import condemned, read_again  # what only a failed read needs
        if (info.step, info.manifest_sha256) not in self._reread:
            self._reread.add((info.step, info.manifest_sha256))
            try:
                read_again(exc, lambda: self._recheck(info), what=f"{info.run}@{info.step}")
            except CorruptCheckpointError:
                pass  # the mismatch stands: the verdict below, told in the load's own words
            except CheckpointReadError as trouble:
                return self._unreadable(info, trouble)
            else:
                return  # intact as stored: the next candidate is this step again, read once more
        marked = self.access.catalog.set_status(
            info.run, info.step, Status.CORRUPT, kind="corrupt", actor=self.access.holder, only_from=LIVE,
            manifest_sha256=info.manifest_sha256, reason=str(exc))
        if not marked:
            now = self.access.catalog.get(info.run, info.step)
            if (now is None or now.manifest_sha256 != info.manifest_sha256
                    or now.status not in (info.status, Status.CORRUPT)):
                self._raced(exc)  # the row is no longer the one we checked against: a race, not corruption
                return
            # the same payload: another reader condemned it first, or the catalog records nothing
            # (opened read-only); either way the verdict stands, go on from it
        else:
            condemned(self.access.catalog, self.access.home.local_dir, info.run)
        log.error("%s@%s is corrupt (marked so unless the catalog is read-only): %s", info.run, info.step, exc)
        if self.ref.names_one_step or not self.fallback:
            raise exc
        self.skipped.append(Skipped(step=info.step, reason=str(exc), created_at=info.created_at))
        self.notes.append(f"{info.run}@{info.step} is corrupt ({exc}); falling back to an older step")
        self.below = info.step

    def _recheck(self, info: CheckpointInfo) -> None:
        from registry.ops.scrub import recheck  # hashing: only once a read went wrong
        recheck(info, home=self.access.home)

    def _unreadable(self, info: CheckpointInfo, exc: CheckpointReadError) -> None:
        now = self.access.catalog.get(info.run, info.step)
        if now is None or (now.status, now.manifest_sha256) != (info.status, info.manifest_sha256):
            self._raced(exc)  # replaced or deleted while we read it: resolve again
            return
        raise self._local_trouble(info, exc) from exc

    def record(self, info: CheckpointInfo) -> Fallback | None:
        """How far this load fell back to reach ``info``, or None when it did not."""
        if not self.skipped:
            return None
        return Fallback(ref=str(self.ref), skipped=tuple(self.skipped), step=info.step,
                        created_at=info.created_at)

    def _raced(self, exc: BaseException | None = None) -> None:
        self._races += 1
        if self._races > MAX_RACES:
            if exc is not None:
                raise exc
            raise CheckpointDeletedError(f"{self.ref} kept changing while being loaded "
                                         f"({MAX_RACES} resolves in a row)", run=self.ref.run)

    def _local_trouble(self, info: CheckpointInfo, exc: CheckpointReadError) -> CheckpointReadError:
        root = self.access.root
        where = f"{info.run}@{info.step}"
        if self.access.home.local_dir is None:  # an object store: the server's trouble, said as it said it
            why = f"cannot read {where}: {exc}"
        elif not root.is_dir():
            why = (f"cannot read {where}: the checkpoint root {root} is not there on this host "
                   "(is the shared filesystem mounted?)")
        elif exc.path is not None and exc.path == info.path and not info.path.exists():
            why = (f"cannot read {where}: its directory {info.path} is missing although the catalog lists "
                   f"the step as {info.status}; nothing was marked: run 'registry fsck' to check the root")
        else:
            why = f"cannot read {where}: {exc}; nothing was marked corrupt"
        return CheckpointReadError(why, errno=exc.errno, path=exc.path, run=info.run, step=info.step)


def report(fallback: Fallback | None) -> None:
    """Log how far a load fell back (once per load, on rank 0 for a distributed one)."""
    if fallback is not None:
        log.warning("%s", fallback)


def read_checked(access: Access, info: CheckpointInfo, *, verify: bool, map_location: Any,
                 trust_pickle: bool, extras: Extras = True) -> Loaded:
    """Read ``info``'s directory under a reader lease and match it against the catalog."""
    lease = acquire_lease(access, info)
    try:
        loaded = read_step(access, info, verify=verify, map_location=map_location, trust_pickle=trust_pickle,
                           extras=extras)
    finally:
        access.catalog.release_lease(lease)
    return loaded


@dataclass(frozen=True, kw_only=True)
class Read:
    """A step read through the catalog: its contents, its row, and how far the read fell back to reach it.

    The facades turn it into what they hand out (``Registry.load``'s ``Checkpoint``).
    """

    loaded: Loaded
    info: CheckpointInfo
    fallback: Fallback | None


def load(access: Access, ref: Ref, *, verify: bool, map_location: Any, trust_pickle: bool,
         extras: Extras = True, fallback: bool = True) -> Read:
    """Resolve ``ref`` and read it in this process, falling back past corrupt steps."""
    read = CatalogRead(access, ref, fallback=fallback)
    try:
        while True:
            info = read.candidate()
            try:
                loaded = read_step(access, info, verify=verify, map_location=map_location, trust_pickle=trust_pickle,
                                   extras=extras)
            except RegistryError as exc:
                read.judge(exc)
                for note in read.notes:
                    warnings.warn(note, RuntimeWarning, stacklevel=3)
                read.notes.clear()
                continue
            read.release()
            went = read.record(info)
            report(went)
            return Read(loaded=loaded, info=info, fallback=went)
    finally:
        read.release()


__all__ = ["Access", "CatalogRead", "Read", "ReadAccess", "acquire_lease", "check_digest", "load", "placed",
           "read_checked", "read_step", "report"]
