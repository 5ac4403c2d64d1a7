"""``registry verify``: re-hash checkpoints from storage and record the verdict.

Publish-time ``verified`` trusts the hashes computed while writing (see
``store.check_written``); a scrub is the full re-read that catches what
storage did afterwards: bit rot, truncation, a file replaced behind our back,
or a manifest that no longer matches the catalog's record of it.

A verdict is about the payload that was read, so it is recorded only by a
compare-and-set on that payload's manifest digest: a step that another writer
overwrote, deleted or re-published meanwhile keeps whatever that writer made
of it, and the result says ``changed``. Only bytes that were read and did not
match condemn a step; a read that failed here (a missing mount, a wrong root,
no permission, no file descriptors left) is ``unreadable`` and records nothing.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from registry.catalog import Catalog
from registry.errors import CheckpointReadError, CorruptCheckpointError, ObjectNotFoundError
from registry.format.manifest import MANIFEST, Manifest, read_manifest
from registry.records import HAS_PAYLOAD, CheckpointInfo, Status
from registry.fs.objects import ObjectRoot
from registry.fs.prefixes import check_objects, read_manifest as read_manifest_object
from registry.fs.store import verify_directory
from registry.progress import Counter, ProgressFn
from registry.ops.verdicts import CopyOnly

VERDICT_FROM = HAS_PAYLOAD
MISMATCH = "manifest does not match the catalog"


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    """One step's outcome. ``status``: ``verified`` or ``corrupt`` (recorded in the catalog);
    ``corrupt-copy`` (on a root with tiers: this host's copy is damaged and recorded so, the step stands on its
    durable copy); ``changed`` (another writer replaced or deleted the step while it was hashed) or
    ``unreadable`` (this host could not read it): nothing recorded. ``ok`` only for ``verified``."""
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


def _manifest(info: CheckpointInfo) -> tuple[Manifest | None, str]:
    """The step's manifest as stored now and its digest, or None and why it is not a valid one."""
    try:
        st = os.stat(info.path)
    except (FileNotFoundError, NotADirectoryError):
        raise _Unreadable(f"directory missing: {info.path}") from None
    except OSError as exc:
        raise _Unreadable(f"cannot read {info.path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        return None, f"{info.path} is not a directory"
    try:
        return read_manifest(info.path)
    except CheckpointReadError as exc:
        raise _Unreadable(str(exc)) from None
    except CorruptCheckpointError as exc:  # missing, a symlink, not a file, or not a valid manifest
        return None, f"{MANIFEST}: {exc}"


def _read(info: CheckpointInfo, counter: Counter) -> _Read:
    """Read and re-hash the step as stored now; raises ``_Unreadable`` when this host cannot."""
    manifest, digest = _manifest(info)
    if manifest is None:
        return _Read(digest=None, files={}, problems=(digest,))
    try:
        damaged = verify_directory(info.path, manifest,
                                   on_bytes=lambda n: counter.advance(n, item=f"{info.run}@{info.step}"))
    except OSError as exc:
        raise _Unreadable(f"cannot read {exc.filename or info.path}: {exc.strerror or exc}") from None
    if damaged and not info.path.is_dir():  # vanished while being read: gc, or the mount went away
        raise _Unreadable(f"directory disappeared while being read: {info.path}")
    return _Read(digest=digest, files={n: (e.size, e.sha256) for n, e in manifest.files.items()},
                 problems=tuple(f"{p.name}: {p.problem}" for p in damaged))


def _object_manifest(root: ObjectRoot, info: CheckpointInfo) -> tuple[Manifest | None, str]:
    """:func:`_manifest` on an object-store root: the bucket answered, so a missing manifest is the step's."""
    try:
        return read_manifest_object(root, info.path.as_posix())
    except ObjectNotFoundError:
        try:  # a missing bucket answers GET like a missing key: only a bucket that is there condemns
            root.check_bucket()
        except OSError as exc:
            raise _Unreadable(str(exc)) from None
        return None, f"{MANIFEST}: missing on the server"
    except CorruptCheckpointError as exc:
        return None, f"{MANIFEST}: {exc}"
    except OSError as exc:  # StorageError: the server's trouble, never the step's
        raise _Unreadable(str(exc)) from None


def _object_read(root: ObjectRoot, info: CheckpointInfo, counter: Counter) -> _Read:
    """:func:`_read` on an object-store root: every object re-read by ranged GETs and hashed."""
    manifest, digest = _object_manifest(root, info)
    if manifest is None:
        return _Read(digest=None, files={}, problems=(digest,))
    rel = info.path.as_posix()
    try:
        listed = {e.rel[len(rel) + 1:]: e for e in root.list(rel)}
        damaged = check_objects(root, rel, manifest, listed, checksums=True,
                                on_bytes=lambda n: counter.advance(n, item=f"{info.run}@{info.step}"))
        if damaged and root.head(f"{rel}/{MANIFEST}") is None:  # deleted while being read (gc)
            raise _Unreadable(f"objects deleted while being read: {root.url(rel)}")
    except OSError as exc:
        raise _Unreadable(str(exc)) from None
    return _Read(digest=digest, files={n: (e.size, e.sha256) for n, e in manifest.files.items()},
                 problems=tuple(f"{p.name}: {p.problem}" for p in damaged))


def scrub(catalog: Catalog, infos: Sequence[CheckpointInfo], *, actor: str,
          progress: ProgressFn | None = None, objects: ObjectRoot | None = None,
          copy_only: CopyOnly | None = None) -> list[VerifyResult]:
    """Re-hash each checkpoint (a few in parallel); intact ones become ``verified``, damaged ``corrupt``.

    A corrupt step that hashes clean again (restored from a backup) is verified again.
    ``progress`` hears of the bytes hashed, of the sum of the steps' sizes (``registry.progress``).
    ``objects``: the root is that object store (``infos``' paths are relative to it), not a directory.
    ``copy_only``: on a root with tiers, asked before a step is condemned (see ``registry.ops.verdicts``).
    """
    manifest_of: Callable[[CheckpointInfo], tuple[Manifest | None, str]] = (
        _manifest if objects is None else functools.partial(_object_manifest, objects))
    read: Callable[[CheckpointInfo, Counter], _Read] = (
        _read if objects is None else functools.partial(_object_read, objects))

    def result(info: CheckpointInfo, status: str, *problems: str) -> VerifyResult:
        return VerifyResult(run=info.run, step=info.step, ok=status == Status.VERIFIED, status=status,
                            problems=problems)

    def changed(info: CheckpointInfo) -> VerifyResult:
        return result(info, "changed", "replaced or deleted by another writer while being verified; "
                                       "nothing recorded, verify it again")

    def record(info: CheckpointInfo, digest: str | None, problems: tuple[str, ...]) -> VerifyResult:
        status = Status.CORRUPT if problems else Status.VERIFIED
        if problems and digest is not None and copy_only is not None and copy_only(
                info.run, info.step, info.path, digest, "; ".join(problems)):
            return result(info, "corrupt-copy", *problems)
        if digest is None or not catalog.set_status(
                info.run, info.step, status, kind="corrupt" if problems else "verify", actor=actor,
                only_from=VERDICT_FROM, manifest_sha256=digest, problems=list(problems)):
            return changed(info)
        return result(info, status, *problems)

    def current(info: CheckpointInfo) -> CheckpointInfo | None:
        """The step's row now. A directory root keeps the caller's absolute path (every incarnation of a
        step lives there); on an object store each has its own prefix, so the row's own path is the one."""
        now = catalog.get(info.run, info.step)
        if now is None or objects is not None:
            return now
        return replace(now, path=info.path)

    def unreadable(info: CheckpointInfo, reason: str) -> VerifyResult:
        now = current(info)
        if now is None or now.status not in VERDICT_FROM or now.manifest_sha256 != info.manifest_sha256:
            return changed(info)
        return result(info, "unreadable", reason)

    def check(info: CheckpointInfo) -> VerifyResult:
        try:
            found = read(info, counter)
            if found.digest is not None and found.digest != info.manifest_sha256:
                now = current(info)  # re-published since it was listed?
                if now is not None and now.manifest_sha256 == found.digest:
                    info = now
            if found.digest is not None and found.digest == info.manifest_sha256:
                recorded = {f.name: (f.size, f.sha256) for f in catalog.files(info.run, info.step)}
                problems = found.problems
                if not problems and recorded and recorded != found.files:
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
