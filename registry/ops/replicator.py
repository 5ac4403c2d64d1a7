"""Replication of a tiered root's steps to its durable tier, in the background, in step order.

The queue is the catalog's (:meth:`ReplicaCatalog.queue`): ``verified``
steps with no durable copy of their payload. A replicator takes the ones
whose fast copy is on its own fast root (the manifest there has the step's
digest; another host's steps are that host's to replicate), and for each:

1. claims the durable copy (a ``pending`` row naming a fresh attempt
   prefix; compare-and-set, a live writer's claim is left alone), and
   refreshes that row while it uploads, as a publish does its claim, so a
   long upload never looks like a dead writer to another host;
2. uploads the fast copy's files to that prefix, hashing each while it is
   uploaded and comparing it with the manifest (the same upload code as an
   ``s3://`` publish, :func:`registry.fs.objectwrite.upload_directory`), the
   manifest last; then checks what the server stored (sizes, headers);
3. one compare-and-set commit makes the durable copy ``verified``, unless
   the step was deleted meanwhile (retention marks the claim ``deleted`` with
   the step): then the upload is removed again.

A fast copy whose bytes differ from its manifest is never uploaded as good:
its step is marked ``corrupt`` (compare-and-set on its digest) and the
prefix removed. The durable tier's trouble (``StorageError``) marks nothing,
and the trainer never waits for it. A step the server refuses while the step
after it goes through (a key a bucket policy denies, an object the server
cannot store) is that step's own trouble: it is retried with its own backoff
and never holds back the steps after it. Two steps failing in a row, or the
only one, mean the tier is down: the thread backs off and retries, logging
the outage once. A process killed mid-way leaves a ``pending`` row of a dead
writer, which the next replicator takes over (its prefix is deleted once the
new copy committed; fsck removes any other orphan prefix).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from registry.catalog import Catalog
from registry.catalog.replicas import DURABLE, DurableClaim, Queued, ReplicaCatalog
from registry.crashpoints import crashpoint
from registry.errors import ManifestError, RegistryError, StorageError
from registry.format.layout import attempt_relpath
from registry.format.manifest import MANIFEST, digest_bytes, parse_manifest
from registry.fs.objects import ObjectRoot
from registry.fs.objectwrite import check_uploaded, upload_directory
from registry.fs.prefixes import remove_prefix
from registry.ops.protocol import beating
from registry.ops.writers import writer_alive
from registry.records import LIVE, Status

log = logging.getLogger(__name__)

BACKOFF_START = 0.5  # seconds before the first retry after the durable tier failed
BACKOFF_MAX = 30.0


@dataclass(frozen=True, kw_only=True)
class Deferred:
    """A queued step the durable tier refused while it took the steps after it: retried after its own backoff."""

    item: Queued
    error: StorageError
    retry_at: float  # time.monotonic() of its next try
    backoff: float


class Replicator:
    """The replication queue of one fast root: :meth:`drain` on the caller's thread, or :meth:`kick` a thread."""

    def __init__(self, *, catalog: Catalog, fast_root: Path, durable: ObjectRoot, writer: Callable[[], str]) -> None:
        self.catalog = catalog
        self.replicas = ReplicaCatalog(catalog)
        self.fast_root = fast_root
        self.durable = durable
        self.writer = writer
        self._drain_lock = threading.Lock()  # one drain at a time (the thread, or a caller's replicate())
        self._state = threading.Condition()
        self._thread: threading.Thread | None = None
        self._kicked = False
        self._stopping = False
        self.failing: StorageError | None = None  # the durable tier's error while it is down
        self.replicated = 0
        self._deferred: dict[tuple[int, str], Deferred] = {}  # by checkpoint id and payload digest
        self._deferred_lock = threading.Lock()  # taken last: nothing else is taken while it is held
        self._resting = False  # the thread waits only for a deferred step's next try: idle for idle()

    # ------------------------------------------------------------------ the thread

    def kick(self) -> None:
        """Have the background thread (started if needed) go through the queue."""
        with self._state:
            if self._stopping:
                return
            self._kicked = True
            self._state.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="registry-replicator", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        backoff = BACKOFF_START
        while True:
            with self._state:
                self._kicked = False
                if self._stopping:
                    break
            try:
                did = self.drain()
            except StorageError as exc:
                if self.failing is None:
                    log.warning("the durable tier %s is failing (%s); replication retries with backoff, "
                                "nothing is marked", self.durable.url(), exc)
                self.failing = exc
                with self._state:
                    if not self._stopping:
                        self._state.wait(backoff)
                backoff = min(BACKOFF_MAX, backoff * 2)
                continue
            except Exception:  # noqa: BLE001 - a bug or the catalog's trouble: logged, retried at the next kick
                log.exception("replication to %s failed", self.durable.url())
                did = 0
            if self.failing is not None:
                log.warning("the durable tier %s answers again; replication caught up", self.durable.url())
                self.failing = None
            backoff = BACKOFF_START
            with self._state:
                if self._stopping:
                    break
                if not self._kicked and not did:
                    rest = self._next_retry()
                    if rest is None:
                        self._thread = None
                        self._state.notify_all()
                        return
                    self._resting = True
                    self._state.notify_all()
                    self._state.wait(rest)
                    self._resting = False
        with self._state:
            self._thread = None
            self._state.notify_all()

    def _next_retry(self) -> float | None:
        """Seconds until the earliest deferred step's next try (0 when due), None when none is deferred."""
        with self._deferred_lock:
            if not self._deferred:
                return None
            return max(0.0, min(d.retry_at for d in self._deferred.values()) - time.monotonic())

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until the thread has nothing left to do but deferred steps' retries (or ``timeout`` seconds);
        True when it has."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._state:
            while self._thread is not None and not self._resting:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._state.wait(left if left is None else min(left, 1.0))
        return True

    def close(self, *, wait: bool = True) -> None:
        """Stop the thread: after the queue drained when ``wait`` and the durable tier answers, else now."""
        if wait and self.failing is None:
            self.idle()
        with self._state:
            self._stopping = True
            self._state.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    # ------------------------------------------------------------------ the work

    def drain(self, *, run: str | None = None, now: bool = False) -> int:
        """Replicate every queued step whose fast copy is on this fast root; how many were replicated.

        A ``StorageError`` on one step moves on to the next: when that one goes
        through, the error was the first one's own, and it is deferred (see
        :meth:`deferred`); ``now`` tries deferred steps before their backoff
        ends. Raises ``StorageError`` when two steps in a row fail so, or the
        last one tried and never deferred (the tier may be down; what was done
        stays done).
        """
        with self._drain_lock:
            done = 0
            skipped: set[int] = set()
            skipped_keys: set[tuple[int, str]] = set()
            while True:
                queue = [q for q in self.replicas.queue(run=run) if q.checkpoint_id not in skipped]
                if run is None:  # a step no longer queued (durable elsewhere, deleted) is no longer deferred
                    queued = {_key(q) for q in queue} | skipped_keys
                    with self._deferred_lock:
                        self._deferred = {k: d for k, d in self._deferred.items() if k in queued}
                if not queue:
                    return done
                progressed = False
                refused: list[tuple[Queued, StorageError]] = []  # since the last step that went through
                for item in queue:
                    with self._state:
                        if self._stopping:
                            return done
                    with self._deferred_lock:
                        deferred = self._deferred.get(_key(item))
                    skipped.add(item.checkpoint_id)  # tried once per drain; one that went through leaves the queue
                    skipped_keys.add(_key(item))
                    if deferred is not None and not now and deferred.retry_at > time.monotonic():
                        continue
                    outcome: bool | None
                    try:
                        outcome = self.replicate(item)
                    except StorageError as exc:
                        refused.append((item, exc))
                        outcome = None
                    except (OSError, RegistryError) as exc:  # this step's own (a fast file unreadable): the rest go on
                        log.warning("%s@%s was not replicated: %s", item.run, item.step, exc)
                        outcome = False
                    if outcome is None:
                        if len(refused) == 2:
                            raise refused[0][1]  # two in a row: the tier's trouble, the caller backs off
                        continue
                    with self._deferred_lock:  # replicated, or no longer this replicator's to do
                        self._deferred.pop(_key(item), None)
                    if outcome:
                        done += 1
                        progressed = True
                        for failed, error in refused:
                            self._defer(failed, error)
                        refused.clear()
                        with self._state:
                            self._state.notify_all()  # wakes wait_durable at once
                with self._deferred_lock:
                    before = set(self._deferred)
                for failed, error in refused:
                    if _key(failed) in before:  # refused before while the tier took others: still its own
                        self._defer(failed, error)
                fresh = [error for failed, error in refused if _key(failed) not in before]
                if fresh:
                    raise fresh[0]  # no step after it went through: it may be the tier's trouble
                if not progressed:
                    return done

    def _defer(self, item: Queued, error: StorageError) -> None:
        with self._deferred_lock:
            before = self._deferred.get(_key(item))
            backoff = BACKOFF_START if before is None else min(BACKOFF_MAX, before.backoff * 2)
            self._deferred[_key(item)] = Deferred(item=item, error=error, retry_at=time.monotonic() + backoff,
                                                  backoff=backoff)
        if before is None:
            log.warning("%s@%s was not replicated: %s; the durable tier takes the steps after it, so this one is "
                        "retried on its own, with backoff", item.run, item.step, error)

    def deferred(self, *, run: str | None = None) -> list[Deferred]:
        """The queued steps the durable tier refused while it took others, oldest first: each is retried later."""
        with self._deferred_lock:
            found = [d for d in self._deferred.values() if run is None or d.item.run == run]
        return sorted(found, key=lambda d: (d.item.run, d.item.step))

    def local_queue(self, *, run: str | None = None) -> list[Queued]:
        """The queued steps whose fast copy is on this fast root, oldest first."""
        return [q for q in self.replicas.queue(run=run) if self._local_manifest(q) is not None]

    def _local_manifest(self, item: Queued) -> tuple[bytes, Path] | None:
        """The fast copy's manifest bytes when this root holds ``item``'s payload, else None."""
        directory = self.fast_root / item.path
        try:
            raw = (directory / MANIFEST).read_bytes()
        except OSError:
            return None
        if digest_bytes(raw) != item.manifest_sha256:
            return None  # another payload at that path (another host's step, or one overwritten since)
        return raw, directory

    def replicate(self, item: Queued) -> bool:
        """Replicate one queued step; False when it is not this replicator's to do (or no longer queued)."""
        if item.replica_status == "pending" and item.replica_writer is not None and item.replica_writer != \
                self.writer() and writer_alive(item.replica_writer, item.replica_updated_at):
            return False
        local = self._local_manifest(item)
        if local is None:
            return False
        raw, directory = local
        writer = self.writer()
        claim = self.replicas.claim_durable(item, path=attempt_relpath(item.run, item.step), writer=writer,
                                            writer_alive=writer_alive)
        if claim is None:
            return False
        crashpoint("replicate-after-claim")
        try:
            with beating(lambda: self.replicas.touch_durable(claim, writer=writer)):
                manifest = parse_manifest(raw, path=directory / MANIFEST)
                written, problems = upload_directory(self.durable, claim.path, directory, manifest, raw)
                if not problems:
                    crashpoint("replicate-after-upload")
                    problems = check_uploaded(self.durable, claim.path, written)
                    if problems:  # the fast copy matched its manifest as it was read: the server's is what differs
                        raise StorageError(f"the durable tier stored {claim.run}@{claim.step} differently from "
                                           f"what was uploaded ({problems[0].name}: {problems[0].problem})",
                                           url=self.durable.url(claim.path))
        except ManifestError as exc:
            self._fast_corrupt(claim, str(exc))
            return True
        except BaseException:
            self._remove(claim.path)
            self.replicas.drop_claim(claim, writer=writer)
            raise
        if problems:
            first = problems[0]
            self._fast_corrupt(claim, f"{first.name}: {first.problem}")
            return True
        if not self.replicas.finish_durable(claim, writer=writer):
            # taken over meanwhile (we looked dead): theirs stands; or the step was deleted meanwhile, its claim
            # with it: nothing may stay durable of it
            self._remove(claim.path)
            return False
        if claim.stale is not None:
            self._remove(claim.stale)
        self.replicated += 1
        log.info("%s@%s is durable at %s", claim.run, claim.step, self.durable.url(claim.path))
        return True

    def _fast_corrupt(self, claim: DurableClaim, reason: str) -> None:
        """The fast copy's bytes are not its manifest's: never durable as good; the step is marked corrupt."""
        self._remove(claim.path)
        self.replicas.drop_claim(claim, writer=self.writer())
        log.error("%s@%s: its fast copy is corrupt (%s); it was not replicated", claim.run, claim.step, reason)
        self.catalog.set_status(claim.run, claim.step, Status.CORRUPT, kind="corrupt", actor=self.writer(),
                                only_from=LIVE, manifest_sha256=claim.manifest_sha256,
                                reason=f"while replicating to the durable tier: {reason}")

    def _remove(self, prefix: str) -> None:
        try:
            remove_prefix(self.durable, prefix)
        except (StorageError, OSError) as exc:  # never masks the outcome: fsck finds the orphan prefix
            log.warning("could not delete the objects under %s: %s; 'registry fsck --repair' removes them",
                        self.durable.url(prefix), exc)

    def wait_durable(self, run: str, step: int, manifest_sha256: str | None, *,
                     timeout: float | None) -> bool:
        """Wait until ``run@step``'s payload has a verified durable copy; False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.05
        while True:
            if self.replicas.copy(run, step, DURABLE, manifest_sha256=manifest_sha256) is not None:
                return True
            self.kick()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            with self._state:
                self._state.wait(delay if left is None else min(delay, left))
            delay = min(1.0, delay * 2)


def _key(item: Queued) -> tuple[int, str]:
    """A deferral is the payload's: the step published again starts with no backoff."""
    return item.checkpoint_id, item.manifest_sha256


__all__ = ["Deferred", "Replicator"]
