"""``fsck`` on a root with a durable tier: the one judge over the fast directory and over the durable tier, then
this host's copies.

The fast root is judged by :mod:`registry.ops.fsck` against the step rows,
except that a live step with no directory here is not a missing payload when
its copy is on another tier (a verified durable copy of its payload, or
another host's fast root): that is how tiers work. The durable tier is judged
by the same judge over its object scan against the durable copies' rows
(:class:`DurableRows`): a replication's ``pending`` claim is a publish's
claim there, and every verdict is the copy's, never the step's. The judge's
kinds take the copy's names (:data:`DURABLE_KINDS`): ``missing-durable-copy``
and ``damaged-durable-copy`` (``--repair`` marks the copy corrupt and, where
a fast copy is here, deletes its objects and replicates the step again),
``corrupt-durable-copy`` (the same, for a copy a load marked),
``uncommitted-replication`` (a dead claim whose upload is whole: recorded),
``abandoned-replication`` (a dead claim without one: given up, the step
queued again), ``unrecorded-durable-copy`` (a whole copy of the live payload
no row names: recorded), ``orphan-durable-prefix``, ``incomplete-upload`` and
``unfinished-copy-deletion`` (objects no row or live claim keeps). Then, from
the replica rows, this host's own:

* ``only-on-fast-tier``: a verified step whose fast copy is here and which has
  no durable copy yet; ``--repair`` replicates it (as ``registry replicate``);
* ``corrupt-fast-copy``: this host's copy of a live step marked corrupt (by
  verify, a load or fsck) whose directory is still here; ``--repair`` marks it
  ``deleted``, removes it (digest-checked) and copies the step again from its
  verified durable copy into this host's cache (recorded as this host's cache
  copy, a row apart from the fast copy's), so a second ``--repair``
  finds nothing. A ``damaged-payload`` the fast root's checks find, with a
  verified durable copy standing, is repaired the same way at once;
* ``superseded-fast-copy``: this host's directory of a live step holds an
  older payload of it (the step was published again on another host since):
  never damage to the step, even when this host holds the step's new payload in
  its cache (that copy has a row of its own); ``--repair`` marks this host's
  fast copy ``deleted``, then removes that directory (digest-checked);
* ``superseded-part``: this host's part of a live step (published from
  several hosts) that holds an older payload, the step published again
  since; ``--repair`` marks its row ``deleted``, then removes it
  (digest-checked);
* ``unfinished-copy-deletion``: this host's copy (fast, or in its cache)
  marked ``deleted`` whose files are still there (their removal failed, or
  the process was killed after the mark); ``--repair`` removes them if the
  row still says so;
* ``abandoned-download``: a staging directory in this host's cache that no
  download is filling (a process killed mid-download); ``--repair`` removes
  it unless a download took that copy's host lock meanwhile;
* ``stale-cached-copy``: a download in this host's cache whose step has ended
  or was published again since (a load evicts those of its run after each
  download); ``--repair`` marks this host's row of it ``deleted`` and removes it.

Every verdict is a compare-and-set on the copy's row; a request the durable
tier fails is a failure line, never a verdict.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path

from types import MappingProxyType

from registry.catalog import Catalog
from registry.catalog.fsck import (RowState, copy_snapshot, copy_unchanged, holds_payload, record_copy,
                                   set_copy_status_if)
from registry.catalog.replicas import DURABLE, ReplicaCatalog, ReplicaInfo
from registry.errors import RegistryError
from registry.format.manifest import MANIFEST, digest_bytes
from registry.format.layout import PARTS_DIR, parse_hidden, parse_step_dirname
from registry.fs.prefixes import remove_prefix
from registry.fs.removal import manifest_digest, remove_checkpoint_dir, remove_tree
from registry.ops.fsck import Fsck, run_fsck
from registry.ops.replicator import Replicator
from registry.ops.tiercache import (abandoned_downloads, evict_cached_copy, record_cached_copy,
                                    remove_abandoned_download, stale_cached_copies)
from registry.ops.tierretention import LeftCopy, unfinished_here
from registry.ops.tiers import Tiers, mark_fast_copy, read_local
from registry.ops.verdicts import FsckPass, FsckReport, Repair, one_line
from registry.roots.scan import Scan, Valid
from registry.progress import ProgressFn
from registry.records import LIVE, Status


class TierFsck(FsckPass):
    """The copies of a tiered root (see the module's docstring). Use :func:`run_tier_fsck`."""

    def __init__(self, *, catalog: Catalog, tiers: Tiers, replicator: Replicator | None, repair: bool,
                 checksums: bool, actor: str, progress: ProgressFn | None = None) -> None:
        super().__init__(catalog=catalog, repair=repair, checksums=checksums, actor=actor, progress=progress)
        self.tiers = tiers
        self.replicas = ReplicaCatalog(catalog)
        # the copies as the fast root's checks see them, read once before them (run() reads its own after its scan)
        self._before = self.replicas.snapshot()
        self.replicator = replicator
        self.requeued = False
        self._left: list[LeftCopy] | None = None

    def elsewhere(self) -> set[tuple[str, int]]:
        """The live steps with a good copy of their payload somewhere other than this fast root's step
        directory (the durable tier, another host's fast root, this host's cache): a step directory missing
        here is then no missing payload."""
        found: set[tuple[str, int]] = set()
        for copy, status, digest, path in self._before:
            good = status in LIVE and copy.manifest_sha256 == digest and copy.status in ("published", "verified")
            if good and not (copy.location == self.tiers.location and copy.path == path):
                found.add((copy.run, copy.step))
        return found

    def superseded(self) -> dict[tuple[str, int], ReplicaInfo]:
        """This tier's copies of live steps that hold an older payload in the step's directory here: the step
        was published again on another host since. Not the step's copy, so never a verdict on the step."""
        found = {}
        for copy, status, digest, path in self._before:
            if (copy.location == self.tiers.location and copy.path == path and status in LIVE
                    and copy.status in ("published", "verified") and copy.manifest_sha256 != digest
                    and self._fast_here(copy.run, copy.step, path, copy.manifest_sha256)):
                found[(copy.run, copy.step)] = copy
        return found

    def condemned(self) -> dict[tuple[str, int], tuple[ReplicaInfo, bool]]:
        """This tier's copies of live steps marked corrupt whose directory is still here, each with whether it is
        the step's own directory: the step stands on another copy, so these are never a verdict on the step."""
        return {(copy.run, copy.step): (copy, copy.path == path) for copy, status, digest, path in self._before
                if copy.location == self.tiers.location and copy.status == "corrupt" and status in LIVE
                and copy.manifest_sha256 == digest and (self.tiers.fast.root / copy.path).is_dir()}

    def condemned_copies(self, condemned: dict[tuple[str, int], tuple[ReplicaInfo, bool]]) -> None:
        durable = {(c.run, c.step) for c, status, digest, _path in self._before
                   if c.location == DURABLE and c.status == "verified" and c.manifest_sha256 == digest}
        for key, (copy, _own) in condemned.items():
            where = self.tiers.fast.root / copy.path
            good = key in durable
            p = self._found("corrupt-fast-copy", copy.run, copy.step, where, "this host's copy is marked corrupt" + (
                "; the step stands on its durable copy" if good else
                f"; no verified durable copy to copy it from ('registry verify {copy.run}@{copy.step}' judges "
                "the step)"), repairable=good)
            self._fix(p, functools.partial(self._replace_copy, copy.run, copy.step, where,
                                           copy.manifest_sha256 or ""))

    def copy_only(self, run: str, step: int, directory: Path, digest: str, reason: str) -> bool:
        """The fast root's checks found this host's copy damaged: with a verified durable copy standing, the copy
        is condemned (not the step), then replaced at once (:meth:`_replace_copy`); False when no durable copy
        stands and the step's verdict is the caller's."""
        if not mark_fast_copy(self.tiers, self.catalog, run, step, directory, digest, reason, actor=self.actor):
            return False
        if manifest_digest(directory) not in (None, digest):
            return True  # an older payload of the step: superseded-fast-copy's to remove
        try:
            done = self._replace_copy(run, step, directory, digest)
        except (OSError, RegistryError) as exc:
            done = one_line(exc)
        if done is not True:
            self.failures.append(f"{run}@{step}: this host's copy {directory} was marked corrupt, not replaced: "
                                 f"{done}")
        return True

    def _replace_copy(self, run: str, step: int, directory: Path, digest: str) -> bool | str:
        """Remove this host's condemned copy at ``directory`` and copy the step again from its durable copy."""
        here, rel = self.tiers.location, self.tiers.fast.relpath(directory)
        if not self.replicas.set_replica_status(run, step, here, "deleted", path=rel, manifest_sha256=digest,
                                                only_from=("corrupt",), actor=self.actor,
                                                reason="corrupt; copied again from the durable copy") and any(
                r.location == here and r.path == rel for r in self.replicas.replicas(run, step)):
            return "the copy's row changed meanwhile"
        remove_checkpoint_dir(directory, digest)
        info = self.catalog.get(run, step)
        if info is None or info.status not in LIVE or info.manifest_sha256 != digest:
            return True  # the step moved on: nothing to copy again
        read_local(self.tiers, self.catalog, info, lambda cached, _check: cached, verify=False, holder=self.actor,
                   fast=False)
        # a cached copy from before (not downloaded now) whose row a catalog that could not record it then lacks
        if self.replicas.copy(run, step, self.tiers.cache_location, manifest_sha256=digest) is None:
            record_cached_copy(self.tiers, self.catalog, info, writer=self.actor)
        return True

    def older_payloads(self, superseded: dict[tuple[str, int], ReplicaInfo]) -> None:
        for copy in superseded.values():
            where = self.tiers.fast.root / copy.path
            p = self._found("superseded-fast-copy", copy.run, copy.step, where,
                            "holds an older payload of the step, which was published again on another host since")
            self._fix(p, functools.partial(self._remove_older, copy, where))

    def _remove_older(self, copy: ReplicaInfo, where: Path) -> bool | str:
        # marked first: a kill after the mark leaves a row saying deleted over files unfinished-copy-deletion
        # removes, never a live row naming a directory that is gone
        if not self.replicas.set_replica_status(copy.run, copy.step, copy.location, "deleted", path=copy.path,
                                                manifest_sha256=copy.manifest_sha256,
                                                only_from=("published", "verified"), actor=self.actor,
                                                reason="an older payload of the step"):
            return "its row changed meanwhile"
        if not remove_checkpoint_dir(where, copy.manifest_sha256):  # digest-checked: only the payload seen
            return "marked deleted, but its directory changed meanwhile: left as it is"
        return True

    def superseded_parts(self) -> None:
        """This host's parts of live steps that hold an older payload: the step was published again since (from
        one host), so nothing reads them again and no replication takes them."""
        for copy, status, digest, _path in self._before:
            if (copy.location == self.tiers.part_location and status in LIVE
                    and copy.status in ("published", "verified") and copy.manifest_sha256 != digest
                    and self._fast_here(copy.run, copy.step, copy.path, copy.manifest_sha256)):
                where = self.tiers.fast.root / copy.path
                p = self._found("superseded-part", copy.run, copy.step, where,
                                "this host's part of an older payload of the step, which was published again since")
                self._fix(p, functools.partial(self._remove_older, copy, where))

    def left_copies(self) -> list[LeftCopy]:
        """This host's copies marked deleted whose payload is still on disk, as the snapshot before the checks
        saw them (:func:`registry.ops.tierretention.unfinished_here`), read once."""
        if self._left is None:
            self._left = unfinished_here(self.tiers, [c for c, *_ in self._before])
        return self._left

    def downloads(self) -> None:
        for staging, step, cached in abandoned_downloads(self.tiers):
            p = self._found("abandoned-download", cached.parent.name, step, staging,
                            f"a download into this host's cache that no process is making (for {cached.name})")
            self._fix(p, functools.partial(remove_abandoned_download, staging, cached))
        # unfinished-copy-deletion's to finish: a copy marked deleted, its directory or a retired sibling of it
        marked = {self.tiers.fast.root / c.path for c, *_ in self._before
                  if c.location == self.tiers.cache_location and c.status == "deleted"}
        marked |= {path for left in self.left_copies() for path in left.paths}
        for run, step, cached in stale_cached_copies(self.tiers, self.catalog):
            if cached in marked:
                continue
            what = ("the leftover of a cached copy's removal" if parse_hidden(cached.name) is not None
                    else "a download into this host's cache whose step has ended or holds another payload")
            p = self._found("stale-cached-copy", run, step, cached, what)
            self._fix(p, functools.partial(evict_cached_copy, self.tiers, self.catalog, run, step, cached,
                                           actor=self.actor))

    def leftover_parts(self) -> None:
        """This host's part directories (``<fast>/.registry/parts/RUN/step-N/``) that no part row of this tier
        names, and their staging directories, while the step is not being published: a publish from several hosts
        whose rank was killed, or whose commit failed on another host, or a part of a payload the step was
        published again over from several hosts (this host's row names the new one). Never a part a row names,
        whatever its status (a part marked deleted is :meth:`fast_deletions`' to finish)."""
        named = {c.path for c, *_ in self._before if c.location == self.tiers.part_location}
        base = self.tiers.fast.root / PARTS_DIR
        try:
            runs = sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink())
        except (FileNotFoundError, NotADirectoryError):
            return
        for run_dir in runs:
            for step_dir in sorted(run_dir.iterdir()):
                parsed = parse_step_dirname(step_dir.name)
                if parsed is None or parsed[1] != "final" or not step_dir.is_dir():
                    continue
                step = parsed[0]
                for entry in sorted(step_dir.iterdir()):
                    hidden = parse_hidden(entry.name)
                    final = step_dir / (hidden[0] if hidden is not None else entry.name)
                    rel = final.relative_to(self.tiers.fast.root).as_posix()
                    if rel in named or not entry.is_dir() or entry.is_symlink():
                        continue
                    unowned = functools.partial(self._unowned_part, run_dir.name, step, rel)
                    if not unowned():  # committed or being published since the snapshot was read
                        continue
                    p = self._found("leftover-part", run_dir.name, step, entry,
                                    "a part of a publish from several hosts that no row names (its publish "
                                    "failed or was killed)")
                    self._fix(p, functools.partial(_remove_leftover, entry, unowned))

    def _unowned_part(self, run: str, step: int, rel: str) -> bool:
        """Whether no part row of this tier names ``rel`` and the step is not being published, read now: a publish
        may have committed the part since the snapshot (a dead claim is the judge's; its part goes next time)."""
        row = self.catalog.get(run, step)
        if row is not None and row.status == Status.STAGING:
            return False
        return not any(c.location == self.tiers.part_location and c.path == rel
                       for c in self.replicas.replicas(run, step))

    def _fast_here(self, run: str, step: int, path: str, digest: str | None) -> bool:
        try:
            raw = (self.tiers.fast.root / path / MANIFEST).read_bytes()
        except OSError:
            return False
        return digest_bytes(raw) == digest

    def run(self) -> FsckReport:
        """The steps queued for a durable copy whose fast copy is here (``only-on-fast-tier``), replicated with
        ``--repair``, after the durable copies were judged (:class:`DurableRows`) and any requeued."""
        rows = self.replicas.snapshot()
        durable_of = {(c.run, c.step) for c, *_ in rows if c.location == DURABLE}
        waiting = []
        for q in self.replicas.queue():
            if (q.run, q.step) not in durable_of and self._fast_here(q.run, q.step, q.path, q.manifest_sha256):
                p = self._found("only-on-fast-tier", q.run, q.step, self.tiers.fast.root / q.path,
                                "verified, with no durable copy yet (queued for replication)")
                if p is not None:
                    waiting.append((p, q))
        if self.repair and (waiting or self.requeued) and self.replicator is not None:
            try:
                self.replicator.drain()
            except OSError as exc:
                self.failures.append(f"replication after repair: {one_line(exc)}")
            for p, q in waiting:
                if self.replicas.copy(q.run, q.step, DURABLE, manifest_sha256=q.manifest_sha256) is not None:
                    self.repaired.append(p)
                else:
                    self.failures.append(f"{p}: not replicated (see the log)")
        return self.report(len(rows))

    def _still_deleted(self, copy: ReplicaInfo) -> bool:
        return any(r.location == copy.location and r.status == "deleted" and r.path == copy.path
                   and r.manifest_sha256 == copy.manifest_sha256 for r in self.replicas.replicas(copy.run, copy.step))

    def fast_deletions(self) -> None:
        """This host's copies (fast, or in its cache) marked deleted whose directory still holds that payload (the
        removal failed, or its process was killed after the mark)."""
        # an ended step's own directory is the judge's unfinished-deletion (gc's own finishing)
        ended = {(c.run, c.step, c.path) for c, status, _digest, path in self._before
                 if status not in LIVE and c.path == path}
        for left in self.left_copies():
            copy, where = left.copy, left.paths[0]
            if (copy.run, copy.step, copy.path) in ended:
                continue
            p = self._found("unfinished-copy-deletion", copy.run, copy.step, where,
                            "this host's copy is marked deleted, its directory still there")
            self._fix(p, functools.partial(self._finish_fast_deletion, left))

    def _finish_fast_deletion(self, left: LeftCopy) -> bool | str:
        if not self._still_deleted(left.copy):
            return "the copy's row changed meanwhile"
        if not left.remove():
            return "its directory changed meanwhile"
        return True


#: the judge's kinds as a durable copy's (registry.ops.fsck; the rest keep their names)
DURABLE_KINDS = MappingProxyType({
    "missing-payload": "missing-durable-copy",
    "damaged-payload": "damaged-durable-copy",
    "corrupt-step": "corrupt-durable-copy",
    "unfinished-deletion": "unfinished-copy-deletion",
    "orphan-prefix": "orphan-durable-prefix",
    "uncommitted-publish": "uncommitted-replication",
    "abandoned-publish": "abandoned-replication",
    "invalid-staged-payload": "invalid-replication",
    "interrupted-overwrite": "interrupted-replication",
    "unregistered-checkpoint": "unrecorded-durable-copy",
})


class DurableRows:
    """The durable copies' rows, as fsck's one judge (:mod:`registry.ops.fsck`) reads and changes rows: a
    replication's ``pending`` claim is judged as a publish's (a live one left alone; a dead one rolled forward
    when its upload is whole, else given up so the step is queued again), and a verdict is the copy's, never the
    step's: a missing or damaged durable copy is marked ``corrupt`` and, where this host holds the step's fast
    copy, its objects are deleted and the step replicated again (as is a copy already marked corrupt)."""

    kinds: Mapping[str, str] = DURABLE_KINDS
    keeps_unadopted = False  # a prefix no copy names is an orphan: its step is recorded by its own row

    def __init__(self, tier: TierFsck) -> None:
        self.tier = tier
        self.catalog = tier.catalog
        self.steps = {(c.run, c.step): (status, digest, path) for c, status, digest, path in tier.replicas.snapshot()}

    def snapshot(self) -> list[RowState]:
        return copy_snapshot(self.catalog, DURABLE)

    def now(self, run: str, step: int) -> RowState | None:
        return next(iter(copy_snapshot(self.catalog, DURABLE, run=run, step=step)), None)

    def unchanged(self, seen: RowState) -> bool:
        return copy_unchanged(self.catalog, DURABLE, seen)

    def set_status_if(self, seen: RowState, status: str, *, kind: str, **detail: str | None) -> bool:
        done = set_copy_status_if(self.catalog, DURABLE, seen, status, kind=kind, actor=self.tier.actor, **detail)
        if done and status == Status.FAILED:
            self.tier.requeued = True  # given up: the queue has the step again
        return done

    def record(self, seen: RowState | None, *, run: str, step: int, rel: str, valid: Valid, kind: str) -> bool:
        return record_copy(self.catalog, DURABLE, seen, run=run, step=step, path=rel, manifest_sha256=valid.digest,
                           kind=kind, actor=self.tier.actor)

    def adopts(self, run: str, step: int, digest: str | None) -> bool:
        return holds_payload(self.catalog, run, step, digest)

    def _local(self, seen: RowState) -> bool:
        """Whether the step holds this copy's payload and its fast copy is here: the copy can be made again."""
        status, digest, path = self.steps.get((seen.run, seen.step), (None, None, ""))
        return (status == Status.VERIFIED and seen.manifest_sha256 == digest
                and self.tier._fast_here(seen.run, seen.step, path, digest))

    def condemn(self, seen: RowState, kind: str, why: str) -> bool | str:
        if not set_copy_status_if(self.catalog, DURABLE, seen, Status.CORRUPT, kind=kind, actor=self.tier.actor,
                                  reason=why):
            return False
        return self._requeue(seen) if self._local(seen) else True

    def corrupt(self, seen: RowState, where: str) -> tuple[str, Repair | None]:
        if self._local(seen):
            return "marked corrupt", functools.partial(self._requeue, seen)
        return "marked corrupt; no fast copy here to replicate from", None

    def _requeue(self, seen: RowState) -> bool | str:
        """Delete a bad copy's objects and forget it, so the step is replicated again from the fast copy here."""
        remove_prefix(self.tier.tiers.durable, seen.path)
        if not self.tier.replicas.forget(seen.run, seen.step, DURABLE, path=seen.path, status="corrupt"):
            return "the copy's row changed meanwhile"
        self.tier.requeued = True
        return True


def _remove_leftover(path: Path, unowned: Callable[[], bool]) -> bool | str:
    if not unowned():
        return "a publish committed it or is publishing its step meanwhile"
    remove_tree(path)
    return True


def run_tier_fsck(*, catalog: Catalog, tiers: Tiers, scan: Scan, durable_scan: Scan, replicator: Replicator | None,
                  repair: bool, checksums: bool, actor: str, progress: ProgressFn | None = None) -> FsckReport:
    """fsck of the fast root (``scan``: the root's, :meth:`registry.roots.base.Root.scan`, its fast directory), then of
    this host's copies, then of the durable tier's (the one judge over ``durable_scan``, the root's
    :meth:`~registry.roots.base.Tiered.durable_scan`, against :class:`DurableRows`, which also checks the runs'
    policy folds kept there); one report."""
    tier = TierFsck(catalog=catalog, tiers=tiers, replicator=replicator, repair=repair,
                    checksums=checksums, actor=actor, progress=progress)
    superseded = tier.superseded()
    condemned = tier.condemned()
    # the fast root's checks leave these alone: this pass reports them, never as damage to the step (a copy marked
    # deleted whose removal did not finish, an older payload among them, is unfinished-copy-deletion's)
    unfinished = {(left.copy.run, left.copy.step) for left in tier.left_copies()
                  if left.copy.location == tiers.location and tiers.fast.root / left.copy.path in left.paths}
    skip = set(superseded) | {key for key, (_copy, own) in condemned.items() if own} | unfinished
    # a copy's removal killed after its rename: the retired directory is that copy's unfinished deletion
    retired = {path for left in tier.left_copies() for path in left.paths if parse_hidden(path.name) is not None}
    fast = run_fsck(catalog=catalog, scan=scan, repair=repair, checksums=checksums, actor=actor,
                    progress=progress, elsewhere=tier.elsewhere(), superseded=skip, copy_only=tier.copy_only,
                    copy_at=tiers.location, theirs=retired)
    tier.condemned_copies(condemned)
    tier.older_payloads(superseded)
    tier.superseded_parts()
    tier.downloads()
    tier.fast_deletions()
    tier.leftover_parts()
    durable = Fsck(catalog=catalog, scan=durable_scan, repair=repair, checksums=checksums, actor=actor,
                   progress=progress, rows=DurableRows(tier), runs={c.run for c, *_ in tier._before}).run()
    copies = tier.run()
    reports = (fast, durable, copies)
    return FsckReport(problems=sum((r.problems for r in reports), ()), repaired=sum((r.repaired for r in reports), ()),
                      in_progress=sum((r.in_progress for r in reports), ()),
                      failures=sum((r.failures for r in reports), ()), rows_checked=fast.rows_checked,
                      checksums=checksums)


__all__ = ["DURABLE_KINDS", "DurableRows", "TierFsck", "run_tier_fsck"]
