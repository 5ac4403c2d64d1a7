"""The publish sequence (docs/reference/protocol.md), the one place that talks to both the catalog and the store.

A publish and an import both run :func:`publish_sequence` for a :class:`Target`, with
:class:`CommitHooks` that make the commit record:

1. claim a ``staging`` row (the unique constraint picks one winner);
2. write the payload into a hidden staging directory, hashing as it writes,
   manifest last, everything fsync'd (:func:`write_and_install`);
3. rename it into place, retiring an old payload when overwriting;
4. one catalog transaction: status, digest, files, metrics, tags, event.

Anything that fails after the claim and before 4 (creating the staging
directory included) removes the staging directory and returns the row to its
previous status (an overwritten step) or marks it ``failed``; a failed commit
puts the retired old payload back (:func:`commit_failed`). The retired
payload is discarded only after the commit, so a crash at any moment leaves
either the old or the new payload in place, and ``fsck`` finishes the job.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from registry.catalog import Catalog, Claim, CommitRecord, FileRecord, PayloadRecord
from registry.catalog.fallback import neighbours, newest_verified, same_size_files
from registry.catalog.lineage import identical_files
from registry.crashpoints import crashpoint
from registry.errors import CatalogError, CorruptCheckpointError, PublishError, RegistryError, StorageError
from registry.records import CheckpointInfo, Status, human_bytes
from registry.fs import dedup as dedup_files
from registry.format.manifest import FileEntry
from registry.format.pieces import NotHeld
from registry.format.safetensors import Encoded
from registry.fs.dedup import Linked, Source, link_held, link_identical, unshare
from registry.fs.inodes import Inode, held
from registry.fs.payloadfiles import Written
from registry.fs.store import Reuse
from registry.ops.writers import writer_alive
from registry.roots.directory import DirectoryLanding
from registry.roots.landing import Landing, os_cause

log = logging.getLogger(__name__)

HEARTBEAT = timedelta(seconds=30)  # well inside writers.STALE_AFTER, so a slow beat never looks like a dead writer


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where and how a publish lands: ``run@step`` at ``relpath`` under the root (the catalog records ``relpath``).

    ``root``: the root's directory on this host, where dedup looks for links (``Path()`` on an object store,
    whose landing names its own prefix). ``dedup``: store files a verified step of the run already holds as links
    (:func:`link_duplicates`); only a verified publish links.
    """

    run: str
    step: int
    root: Path
    relpath: str
    writer: str
    overwrite: bool = False
    verify: bool = True
    dedup: bool = False
    epoch: int = 0
    consumed_samples: int = 0

    @property
    def final(self) -> Path:
        return self.root / self.relpath


class CommitHooks(Protocol):
    """What the publisher adds to the commit, and hears of its outcome."""

    def record(self, payload: PayloadRecord) -> CommitRecord:
        """The payload, once installed, as the commit records it (with the metrics, tags and attempt it adds)."""

    def failed(self) -> None:
        """The commit raised: give back whatever :meth:`record` took."""

    def done(self) -> None:
        """The commit happened (after :meth:`failed` too, when a failed COMMIT turns out to have happened)."""


@dataclass(frozen=True)
class RecordOnly:
    """Hooks that only build the commit record (an import: no attempt, nothing to give back)."""

    make: Callable[[PayloadRecord], CommitRecord]

    def record(self, payload: PayloadRecord) -> CommitRecord:
        return self.make(payload)

    def failed(self) -> None:
        pass

    def done(self) -> None:
        pass


def publish_sequence(catalog: Catalog, target: Target, write: Callable[[Any, Reuse | None], Written],
                     hooks: CommitHooks, landing: Landing | None = None) -> CheckpointInfo:
    """Phases 1-4: publish what ``write`` puts where ``landing`` says as ``target``'s step.

    ``landing`` defaults to a staging directory renamed to ``target.final``
    (:class:`registry.roots.directory.DirectoryLanding`); ``write(place, reuse)`` fills what the
    landing prepared (the staging directory, or an object store's attempt
    prefix). ``reuse`` (dedup on, a verified publish to a directory) may store
    a file it is about to write as a link instead (:class:`HeldSources`), or
    is None. ``hooks`` make the commit record and hear whether it happened.
    Every failure after the claim is undone before it is raised. Returns the
    step as the catalog now has it (its path relative to the root).
    """
    started = time.perf_counter()
    run, step, final, root, writer = target.run, target.step, target.final, target.root, target.writer
    verify, dedup = target.verify, target.dedup
    landing = landing if landing is not None else DirectoryLanding(final)
    if target.overwrite and not verify and landing.shares_inodes:
        # the step leaves the verified chain while it is replaced: the two verified steps that then are the
        # newest must not share an inode, before the old payload goes
        keep_fallback_apart(catalog, root, run, excluding=(step,))
    claim = catalog.claim(run, step, path=target.relpath, writer=writer, overwrite=target.overwrite,
                          writer_alive=writer_alive)
    crashpoint("after-claim")
    linked: list[Linked] = []
    sources = HeldSources(catalog, root, run=run, step=step) if dedup and verify else None

    def write_then_link(staging: Path) -> Written:
        written = write(staging, sources)
        if sources is not None:
            if sources.linked:
                crashpoint("dedup-after-fsync")  # write() fsync'd the staging directory with the links in it
            linked.extend(sources.linked)
            linked.extend(link_duplicates(catalog, staging, root, written, run=run, step=step,
                                          searched=sources.searched))
        return written
    written, status, retired = write_and_install(catalog, claim, landing, write_then_link, verify=verify)
    info: CheckpointInfo | None = None
    try:  # from here on, anything (even a KeyboardInterrupt) must reach commit_failed's undo
        info = catalog.commit_publish(claim, hooks.record(payload_record(written, status, epoch=target.epoch,
                                                                         consumed_samples=target.consumed_samples,
                                                                         linked=linked)),
                                      writer=writer)
    except BaseException as exc:
        try:
            hooks.failed()
        finally:
            commit_failed(catalog, claim, run=run, step=step, writer=writer, landing=landing, retired=retired,
                          exc=exc)
    hooks.done()
    if retired is not None:
        landing.settle(retired)
    crashpoint("after-commit")
    if linked:  # a step of the run published beside this one meanwhile; the publish itself has succeeded
        restore_fallback(catalog, root, run, after=f"published {run}@{step}")
    seconds = time.perf_counter() - started
    log.info("published %s@%d (%s): %s in %.3f s, %s/s", run, step, status, human_bytes(written.total_bytes), seconds,
             human_bytes(int(written.total_bytes / seconds) if seconds > 0 else 0))
    if info is None or linked:  # the commit happened although it raised; or linking may have changed it since
        info = catalog.get(run, step)
    assert info is not None, "a committed step has a row"
    return info


def payload_record(written: Written, status: str, *, epoch: int, consumed_samples: int,
                   linked: Sequence[Linked] = ()) -> PayloadRecord:
    """What the catalog records about the payload just written."""
    return PayloadRecord(status=status, manifest_sha256=written.manifest_sha256,
                         files=tuple(FileRecord(name=f.name, size=f.size, sha256=f.sha256)
                                     for f in written.manifest.files.values()),
                         total_bytes=written.total_bytes, epoch=epoch, consumed_samples=consumed_samples,
                         optimizer_step=written.manifest.optimizer_step,
                         policy_version=written.manifest.policy_version,
                         linked=tuple(sorted(f.name for f in linked)), linked_bytes=sum(f.size for f in linked))


def link_duplicates(catalog: Catalog, staging: Path, root: Path, written: Written, *, run: str,
                    step: int, searched: Collection[str] = ()) -> list[Linked]:
    """Dedup: store each large staged file that a verified step of ``run`` holds as a hard link to it.

    After the write, for the files not ``searched`` before it
    (:class:`HeldSources`): ``extra`` pickles, tensors that were not in CPU
    memory as they are written.

    Only files :func:`registry.fs.dedup.linkable` allows; candidates are the
    catalog's file rows of the run's other verified steps with the same size
    and sha256 (a few per file, newest first), minus the inodes held by the
    new step's fallback neighbours (:func:`registry.catalog.fallback.neighbours`),
    so the two newest verified steps never share one.
    :func:`registry.fs.dedup.link_identical` confirms the bytes before
    linking. An optimisation only: a catalog that cannot be asked means
    nothing is linked, never a failed publish.
    """
    wanted = {(e.size, e.sha256): e.name for e in written.manifest.files.values()
              if dedup_files.linkable(e.name, e.size) and e.name not in searched}
    if not wanted:
        return []
    try:
        near = neighbours(catalog, run, step)
        same = identical_files(catalog, list(wanted), run=run, statuses=(Status.VERIFIED,),
                               exclude_steps=[step] + [n.step for n in near])
    except CatalogError:
        return []
    candidates: dict[str, list[Path]] = {}
    for hit in same:
        name = wanted.get((hit.size, hit.sha256))
        paths = candidates.setdefault(name, []) if name is not None else None
        if paths is not None and len(paths) < 4:
            paths.append(root / hit.path / hit.name)
    if not candidates:
        return []
    exclude = held(root / n.path for n in near)
    return link_identical(staging, candidates, exclude=exclude)


class HeldSources:
    """Dedup before writing (a :class:`registry.fs.store.Reuse`): link a file whose bytes a verified step holds.

    For each large safetensors file about to be written, one catalog read
    (:func:`registry.catalog.fallback.same_size_files`) names the files of
    that size in the run's newest verified steps outside the new step's
    fallback neighbours; :func:`registry.fs.dedup.link_held` finds the one
    whose recorded xxh3 pieces are those of the bytes in memory, compares
    them in full and links it, and nothing is written. A file of a size no
    such step holds costs that one read. The same rules as
    :func:`link_duplicates`: within the run, never an inode a neighbour
    holds, bytes compared before linking; a catalog that cannot be asked
    means the file is written.
    """

    def __init__(self, catalog: Catalog, root: Path, *, run: str, step: int) -> None:
        self._catalog, self._root, self._run, self._step = catalog, root, run, step
        self._exclude: dict[Inode, int] | None = None
        self.linked: list[Linked] = []
        self.searched: set[str] = set()

    def link(self, staging: Path, name: str, encoded: Encoded) -> FileEntry | None:
        size = encoded.size
        if not dedup_files.linkable(name, size):
            return None
        self.searched.add(name)
        try:
            near, files = same_size_files(self._catalog, self._run, self._step, size)
        except CatalogError:
            return None
        if not files:
            return None
        if self._exclude is None:
            self._exclude = held(self._root / n.path for n in near)
        try:
            found = link_held(staging, name, encoded.lengths, encoded.held,
                              [Source(step_dir=self._root / f.path, name=f.name, sha256=f.sha256,
                                      manifest_sha256=f.manifest_sha256) for f in files],
                              exclude=self._exclude)
        except NotHeld:
            self.searched.discard(name)  # a tensor to copy first: linked after the write, if at all (link_duplicates)
            return None
        if found is None:
            return None
        entry, path = found
        self.linked.append(Linked(name=name, source=path, size=size))
        return entry


def keep_fallback_apart(catalog: Catalog, root: Path, run: str, *, excluding: Sequence[int] = ()) -> list[str]:
    """Make sure the two newest verified steps of ``run`` (other than ``excluding``) share no inode.

    The newer one gets its own copy of whatever the other holds too
    (:func:`registry.fs.dedup.unshare`), so one bad inode can take at most
    one of them and ``RUN@latest`` falls back to the other. Returns the names
    copied. Called before anything that changes which steps those are: a
    deletion, an overwrite that leaves the chain; a catalog that cannot be
    asked leaves things as they are.
    """
    try:
        newest = newest_verified(catalog, run, excluding=excluding, n=2)
    except CatalogError:
        return []
    if len(newest) < 2:
        return []
    return unshare(root / newest[0].path, root / newest[1].path)


def restore_fallback(catalog: Catalog, root: Path | None, run: str, *, after: str) -> None:
    """``after`` (a step condemned, or deleted) may have changed which two steps of ``run`` are the newest verified:
    they must share no inode (:func:`keep_fallback_apart`). ``root`` None (an object store) holds no links. Never
    raises: a copy that cannot be made is logged, and the next publish or gc tries again."""
    if root is None:
        return
    try:
        keep_fallback_apart(catalog, root, run)
    except OSError as exc:
        log.warning("%s: %s, but the newest verified step could not get its own copy of a file it shares with the "
                    "next: %s; the next publish or gc tries again", run, after, exc.strerror or exc)


def write_and_install(catalog: Catalog, claim: Claim, landing: Landing, write: Callable[[Any], Written], *,
                      verify: bool) -> tuple[Written, str, Any]:
    """Phases 2 and 3: ``write`` fills what ``landing`` prepared, which then becomes the step's payload.

    Returns what was written, the status it earned and the retired old
    payload (kept until the catalog commit, see :func:`commit_failed`).
    """
    dest: Any = None
    installed = False
    try:
        dest = landing.prepare(claim)
        with heartbeat(catalog, claim):
            written = write(dest)
        crashpoint("after-write")
        status = Status.PUBLISHED
        if verify:
            problems = landing.check(dest, written)
            if problems:
                raise CorruptCheckpointError(
                    f"read-back of {landing.where} failed: {problems[0].name}: {problems[0].problem}",
                    path=landing.path)
            status = Status.VERIFIED
        retired = landing.install(dest)
        installed = True
        return written, status, retired
    except BaseException as exc:
        if dest is not None:
            landing.discard(dest)
        intact = not installed and landing.old_intact()
        try:
            catalog.abort_claim(claim, reason=str(exc) or type(exc).__name__, old_payload_intact=intact)
        except Exception:
            pass  # fsck repairs a staging row whose writer is gone
        if isinstance(exc, OSError) and not isinstance(exc, StorageError):
            raise landing.failure(exc) from exc
        raise


@contextmanager
def heartbeat(catalog: Catalog, claim: Claim) -> Iterator[None]:
    """Refresh the claimed row every ``HEARTBEAT`` while the body runs.

    A writer on another host cannot be asked whether it is alive; a row it
    keeps refreshing says so, and one left unrefreshed for
    ``registry.ops.writers.STALE_AFTER`` is taken over by the next claim and
    repaired by fsck. A missed beat is harmless unless every beat for that
    long is missed.
    """
    with beating(lambda: catalog.touch_claim(claim)):
        yield


@contextmanager
def beating(touch: Callable[[], object]) -> Iterator[None]:
    """Call ``touch`` (the refresh of a claim's row) every ``HEARTBEAT`` while the body runs.

    One thread of the process beats for every claim in flight (a thread
    started and joined per publish cost more than the beats); a failed beat is
    left to the next. Once this returns, no beat of ``touch`` is running or to come.
    """
    key = _BEATS.add(touch)
    try:
        yield
    finally:
        _BEATS.remove(key)


class _Beats:
    """The process's heartbeat thread and the refreshes it makes, each ``HEARTBEAT`` after it was added."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[int, tuple[float, Callable[[], object]]] = {}
        self._beating: int | None = None  # the key whose beat is running: remove() waits for it
        self._next_key = 0
        self._thread: threading.Thread | None = None

    def add(self, touch: Callable[[], object]) -> int:
        with self._cond:
            key, self._next_key = self._next_key, self._next_key + 1
            self._due[key] = (time.monotonic() + HEARTBEAT.total_seconds(), touch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="registry-heartbeat", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return key

    def remove(self, key: int) -> None:
        with self._cond:
            while self._beating == key:
                self._cond.wait()
            self._due.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                key, at = min(((k, due[0]) for k, due in self._due.items()), key=lambda d: d[1],
                              default=(None, now + HEARTBEAT.total_seconds()))
                if key is None or at > now:
                    self._cond.wait(at - now)
                    continue
                touch = self._due[key][1]
                self._due[key] = (now + HEARTBEAT.total_seconds(), touch)
                self._beating = key
            try:
                touch()
            except Exception:  # noqa: BLE001 - the next beat tries again
                pass
            finally:
                with self._cond:
                    self._beating = None
                    self._cond.notify_all()


_BEATS = _Beats()
if hasattr(os, "register_at_fork"):  # a forked child starts with no beats, and no lock its parent's thread held
    os.register_at_fork(after_in_child=_BEATS.reset)


def commit_failed(catalog: Catalog, claim: Claim, *, run: str, step: int, writer: str, landing: Landing,
                  retired: Any, exc: BaseException) -> None:
    """The catalog commit failed: put the old payload back, unless the commit happened after all.

    A commit error can be ambiguous (the connection died during COMMIT), so
    the row decides: still our ``staging`` row means nothing was recorded.
    Returns only when the commit did happen; otherwise raises.
    """
    try:
        row = catalog.get(run, step)
    except Exception:
        # cannot tell: leave the payload in place; fsck rolls it forward once we are gone
        raise CatalogError(f"could not record {run}@{step} in the catalog and cannot tell whether it "
                           f"was: {_first_line(exc)}", run=run, step=step) from exc
    if row is not None and not (row.status == Status.STAGING and row.writer == writer):
        return
    undo_error: OSError | None = None
    intact = False
    try:
        intact = landing.undo(None, retired)
    except OSError as err:
        undo_error = err  # fsck restores a retired payload left without its final directory
    try:
        catalog.abort_claim(claim, reason=str(exc) or type(exc).__name__,
                            old_payload_intact=intact and undo_error is None)
    except Exception:
        pass  # fsck repairs a staging row whose writer is gone
    if undo_error is not None:
        raise PublishError(f"could not record {run}@{step} in the catalog nor undo its rename: "
                           f"{os_cause(undo_error, Path(landing.where))}; run 'registry fsck --repair'",
                           errno=undo_error.errno, path=landing.path, run=run, step=step) from exc
    if isinstance(exc, CatalogError) or (isinstance(exc, Exception) and not isinstance(exc, RegistryError)):
        raise CatalogError(f"could not record {run}@{step} in the catalog, nothing was published: "
                           f"{_first_line(exc)}", run=run, step=step) from exc
    raise exc


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
