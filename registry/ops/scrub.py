"""``registry verify``: re-hash checkpoints from storage and record the verdict.

Publish-time ``verified`` trusts the hashes computed while writing (see
``store.check_written``); a scrub is the full re-read that catches what
storage did afterwards: bit rot, truncation, a file replaced behind our back,
or a manifest that no longer matches the catalog's record of it.

A verdict is about the payload that was read, so it is recorded only by a
compare-and-set on that payload's manifest digest: a step that another writer
overwrote, deleted or re-published meanwhile keeps whatever that writer made
of it, and the result says ``changed``. Only bytes that were read and did not
match condemn a step, and only when a second read from storage differs too
(:func:`registry.ops.verdicts.read_again`: a mismatch of one read is this
host's or the wire's); a read that failed here (a missing mount, a wrong root,
no permission, no file descriptors left) is ``unreadable`` and records nothing.
A step or copy marked corrupt whose bytes read intact now is verified again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from registry.catalog import Catalog
from registry.catalog.replicas import DURABLE, ReplicaCatalog, ReplicaInfo
from registry.errors import CheckpointReadError, CorruptCheckpointError
from registry.format.manifest import MANIFEST, Manifest
from registry.records import HAS_PAYLOAD, CheckpointInfo, Status
from registry.roots.base import Root
from registry.progress import Counter, ProgressFn
from registry.ops.copies import Copies, OneCopy
from registry.ops.verdicts import condemned, read_again

VERDICT_FROM = HAS_PAYLOAD
MISMATCH = "manifest does not match the catalog"


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    """One step's outcome. ``status``: ``verified`` or ``corrupt`` (recorded in the catalog);
    ``corrupt-copy`` (on a root with tiers: the copy read, this host's fast copy or, when this host holds none,
    the durable copy, is damaged and recorded so; the step stands on another copy); ``changed`` (another writer
    replaced or deleted the step while it was hashed) or ``unreadable`` (this host could not read it): nothing
    recorded; ``corrupt-part`` (a step published from several hosts, not durable yet: this host's part of it is
    damaged and recorded so, the step itself untouched). ``ok`` only for ``verified``."""
    run: str
    step: int
    ok: bool
    status: str
    problems: tuple[str, ...] = ()


class _Unreadable(Exception):
    """Reading failed on this side: says nothing about the bytes stored."""


@dataclass(frozen=True, kw_only=True)
class _Read:
    digest: str | None  # sha256 of the manifest read; None when there was no valid manifest
    files: dict[str, tuple[int, str]]  # name -> (size, sha256) as the manifest lists them
    problems: tuple[str, ...]


class _Damaged(CorruptCheckpointError):
    """A re-read that still found ``found.problems``."""

    def __init__(self, found: _Read) -> None:
        super().__init__("; ".join(found.problems))
        self.found = found


def _intact(found: _Read) -> _Read:
    if found.problems:
        raise _Damaged(found)
    return found


def _confirmed(info: CheckpointInfo, found: _Read, again: Callable[[], _Read], *, where: str = "") -> _Read:
    """``found`` if intact; else what a second read from storage finds (:func:`registry.ops.verdicts.read_again`)."""
    if not found.problems:
        return found
    try:
        return read_again("; ".join(found.problems), lambda: _intact(again()),
                          what=f"{info.run}@{info.step}{where}")
    except _Damaged as exc:
        return exc.found


def _manifest(home: Root, info: CheckpointInfo) -> tuple[Manifest | None, str]:
    """The step's manifest as stored now and its digest, or None and why it is not a valid one."""
    try:
        return home.stored_manifest(info)
    except CheckpointReadError as exc:
        raise _Unreadable(str(exc)) from None


def _read(home: Root, info: CheckpointInfo, counter: Counter, *, part: Collection[str] | None = None) -> _Read:
    """Read and re-hash the step as stored now (through its root); raises ``_Unreadable`` when this host cannot.
    ``part``: ``info`` is a host's part of the step holding these data files (``registry.distributed.parts``),
    re-hashed only when its manifest is the catalog's."""
    manifest, digest = _manifest(home, info)
    if manifest is None:
        return _Read(digest=None, files={}, problems=(digest,))
    if part is not None:
        if digest != info.manifest_sha256:
            return _Read(digest=digest, files={}, problems=(f"{MANIFEST}: not the one the catalog records",))
        from registry.fs.dcpfiles import part_of
        manifest = part_of(manifest, part)
    try:
        damaged = home.rehash(info, manifest, on_bytes=lambda n: counter.advance(n, item=f"{info.run}@{info.step}"))
    except CheckpointReadError as exc:
        raise _Unreadable(str(exc)) from None
    return _Read(digest=digest, files={n: (e.size, e.sha256) for n, e in manifest.files.items()},
                 problems=tuple(f"{p.name}: {p.problem}" for p in damaged))


def recheck(info: CheckpointInfo, *, home: Root) -> None:
    """Re-hash ``info``'s payload as stored in ``home`` now against the catalog's manifest digest: the second read
    from storage a load's verdict waits for. Returns when it is intact; raises ``CorruptCheckpointError`` naming
    what differs, ``CheckpointReadError`` when this host cannot read it."""
    counter = Counter(None, task="verify", total=None)
    try:  # the manifest first: one that is not the catalog's says enough, no other file is opened
        manifest, digest = _manifest(home, info)
        if manifest is None:
            problems: tuple[str, ...] = (digest,)
        elif digest != info.manifest_sha256:
            problems = (f"{MANIFEST}: not the one the catalog records",)
        else:  # the files against the manifest just read: it is the catalog's
            problems = tuple(f"{p.name}: {p.problem}" for p in home.rehash(
                info, manifest, on_bytes=lambda n: counter.advance(n, item=f"{info.run}@{info.step}")))
    except CheckpointReadError as exc:
        raise CheckpointReadError(f"cannot read {info.run}@{info.step} again: {exc}", path=info.path,
                                  run=info.run, step=info.step) from None
    except _Unreadable as exc:
        raise CheckpointReadError(f"cannot read {info.run}@{info.step} again: {exc}", path=info.path,
                                  run=info.run, step=info.step) from None
    if problems:
        raise CorruptCheckpointError(f"{info.run}@{info.step} read again from storage: {'; '.join(problems)}",
                                     path=info.path, run=info.run, step=info.step)


def scrub(catalog: Catalog, infos: Sequence[CheckpointInfo], *, actor: str,
          home: Root, progress: ProgressFn | None = None, copies: Copies | None = None) -> list[VerifyResult]:
    """Re-hash each checkpoint (a few in parallel); intact ones become ``verified``, damaged ``corrupt``.

    A corrupt step that hashes clean again (restored from a backup) is verified again.
    ``progress`` hears of the bytes hashed, of the sum of the steps' sizes (``registry.progress``).
    ``home``: the root the steps live in, which reads and re-hashes them (``infos`` placed by it).
    ``copies``: the root's copies as this host judges them (:mod:`registry.ops.copies`; the root's only copy
    by default). On a root with a durable tier a damaged fast copy of a step with a verified durable copy is this
    host's copy's fault (``corrupt-copy``); a step this host holds no copy of (its directory is gone, or holds
    an older payload of it) is verified on its durable copy instead, a durable copy marked corrupt included.
    After a step is condemned, the two newest verified steps left must share no inode
    (:func:`registry.ops.verdicts.condemned`, on the root's directory here).
    """
    copies = copies if copies is not None else OneCopy(home)
    manifest_of = functools.partial(_manifest, home)
    read = functools.partial(_read, home)

    def result(info: CheckpointInfo, status: str, *problems: str) -> VerifyResult:
        return VerifyResult(run=info.run, step=info.step, ok=status == Status.VERIFIED, status=status,
                            problems=problems)

    def changed(info: CheckpointInfo) -> VerifyResult:
        return result(info, "changed", "replaced or deleted by another writer while being verified; "
                                       "nothing recorded, verify it again")

    def record(info: CheckpointInfo, digest: str | None, problems: tuple[str, ...], *,
               copy_only: bool = True) -> VerifyResult:
        status = Status.CORRUPT if problems else Status.VERIFIED
        if problems and digest is not None and copy_only and copies.condemn(info, digest, "; ".join(problems)):
            return result(info, "corrupt-copy", *problems)
        if digest is None or not catalog.set_status(
                info.run, info.step, status, kind="corrupt" if problems else "verify", actor=actor,
                only_from=VERDICT_FROM, manifest_sha256=digest, problems=list(problems)):
            return changed(info)
        if problems:
            condemned(catalog, home.local_dir, info.run)
        elif copy_only:
            copies.restore(info, digest)
        return result(info, status, *problems)

    def current(info: CheckpointInfo) -> CheckpointInfo | None:
        """The step's row now, placed as its root places it (on an object store each incarnation has a prefix of
        its own, so the row's own path is the one read)."""
        now = catalog.get(info.run, info.step)
        return None if now is None else home.place(now)

    def unreadable(info: CheckpointInfo, reason: str) -> VerifyResult:
        now = current(info)
        if now is None or now.status not in VERDICT_FROM or now.manifest_sha256 != info.manifest_sha256:
            return changed(info)
        return result(info, "unreadable", reason)

    def recorded(info: CheckpointInfo) -> dict[str, tuple[int, str]]:
        return {f.name: (f.size, f.sha256) for f in catalog.files(info.run, info.step)}

    def durable(info: CheckpointInfo) -> VerifyResult:
        """Re-hash the verified durable copy of a step this host holds no copy of. Damage condemns that copy,
        and the step only when no other copy of its payload stands: a fast copy's row is taken at its word,
        since a directory missing here may be a disk not mounted, never proof of lost bytes."""
        tiers = copies.tiered("verifying a durable copy")
        replicas = ReplicaCatalog(catalog)
        copy = next((r for r in replicas.replicas(info.run, info.step) if r.location == DURABLE
                     and r.manifest_sha256 == info.manifest_sha256 and r.status in ("verified", "corrupt")), None)
        if copy is None:
            part = next((r for r in replicas.replicas(info.run, info.step) if r.location == tiers.part_location
                         and r.manifest_sha256 == info.manifest_sha256 and r.status in ("verified", "corrupt")
                         and r.files is not None), None)
            if part is not None:
                return this_part(info, part)
            return unreadable(info, f"this host holds no copy of its payload ({info.path}) and it has no verified "
                                    "durable copy: verify it on the host that holds it")
        at = replace(info, path=Path(copy.path))

        def hashed() -> _Read:
            from registry.roots.objectstore import ObjectStoreRoot  # the object store's modules: a tiered root's
            found = _read(ObjectStoreRoot(tiers.durable), at, counter)
            if found.digest is not None and found.digest != info.manifest_sha256:
                return replace(found, problems=(f"{MANIFEST}: not the one the catalog records",))
            if not found.problems and (files := recorded(info)) and files != found.files:
                return replace(found, problems=(MISMATCH,))
            return found
        problems = _confirmed(info, hashed(), hashed, where=f": its durable copy {tiers.durable.url(copy.path)}"
                              ).problems
        if not problems:
            if copy.status == "corrupt" and not replicas.set_replica_status(
                    info.run, info.step, DURABLE, "verified", path=copy.path, manifest_sha256=info.manifest_sha256,
                    only_from=("corrupt",), actor=actor, reason="its bytes read intact again"):
                return changed(info)
            return record(info, info.manifest_sha256, (), copy_only=False)
        where = tuple(f"durable copy {tiers.durable.url(copy.path)}: {p}" for p in problems)
        if copy.status == "verified" and not replicas.set_replica_status(
                info.run, info.step, DURABLE, "corrupt", path=copy.path, manifest_sha256=info.manifest_sha256,
                only_from=("verified",), actor=actor, reason="; ".join(problems)):
            return changed(info)
        if any(r.location != DURABLE and r.status in ("published", "verified")
               and r.manifest_sha256 == info.manifest_sha256 for r in replicas.replicas(info.run, info.step)):
            return result(info, "corrupt-copy", *where)
        return record(info, info.manifest_sha256, where, copy_only=False)

    def this_part(info: CheckpointInfo, part: ReplicaInfo) -> VerifyResult:
        """Re-hash this host's part of a step published from several hosts that is not durable yet: the step
        has no copy to verify, but damage to this host's share of it is this host's to know (and to keep out of
        loads and replication), never a verdict on the step."""
        tiers = copies.tiered("verifying a part")
        at = replace(info, path=tiers.fast.root / part.path)

        def hashed() -> _Read:
            return _read(home, at, counter, part=part.files or ())
        problems = _confirmed(info, hashed(), hashed, where=f": this host's part {at.path}").problems
        replicas, to = ReplicaCatalog(catalog), "corrupt" if problems else "verified"
        if part.status != to and not replicas.set_replica_status(
                info.run, info.step, part.location, to, path=part.path, manifest_sha256=info.manifest_sha256,
                only_from=(part.status,), actor=actor, reason="; ".join(problems) or "its bytes read intact again"):
            return changed(info)
        if problems:
            return result(info, "corrupt-part", *(f"this host's part {at.path}: {p}" for p in problems))
        return unreadable(info, f"not durable yet: this host's part of it ({len(part.files or ())} data files, "
                                f"{at.path}) is intact; the other parts are on their hosts")

    def check(info: CheckpointInfo) -> VerifyResult:
        try:
            if not copies.holds(info):  # this host holds no copy of it: its durable copy is verified
                return durable(info)
            first = info
            found = _confirmed(info, read(info, counter), lambda: read(first, counter))
            if found.digest is not None and found.digest != info.manifest_sha256:
                now = current(info)  # re-published since it was listed?
                if now is not None and now.manifest_sha256 == found.digest:
                    info = now
            if found.digest is not None and found.digest == info.manifest_sha256:
                problems, files = found.problems, recorded(info)
                if not problems and files and files != found.files:
                    problems = (MISMATCH,)
                return record(info, found.digest, problems)
            # Not the manifest the catalog recorded. Condemn that record only if it is still
            # current and the manifest, read again after it, still disagrees: a failed overwrite
            # puts the old payload back before the row, so a payload in flux is not mistaken.
            now = current(info)
            if now is None or now.status not in VERDICT_FROM or now.manifest_sha256 is None:
                return changed(info)
            manifest, digest_or_problem = manifest_of(now)
            if manifest is None:
                return record(now, now.manifest_sha256, (digest_or_problem,))
            if digest_or_problem == now.manifest_sha256:
                return changed(info)
            return record(now, now.manifest_sha256, (MISMATCH,))
        except _Unreadable as exc:
            return unreadable(info, str(exc))

    counter = Counter(progress, task="verify", total=sum(i.total_bytes for i in infos))
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(infos)))) as pool:
        return list(pool.map(check, infos))
