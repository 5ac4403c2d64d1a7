"""``fsck``: reconcile the catalog with the checkpoint root after any crash; the one judge, on every kind of root.

The publish protocol (docs/reference/protocol.md) is a two-phase commit between the
catalog and the filesystem, and retention is a mark-then-delete; a process
killed at any moment leaves one of a handful of states. fsck looks at both
sides, names each state it finds with one of the kinds below, and with
``repair=True`` moves it to the state the interrupted operation would have
reached (or rolled back to). Without ``repair`` it changes nothing at all.

The disk is scanned *before* the catalog is read: a staging directory seen on
disk therefore belongs to a claim the snapshot already shows, so fsck never
mistakes a brand-new writer's directory for an abandoned one. A row's own
directory is looked at again *after* the snapshot, and every verdict about a
row is kept only if the row, read again once the files were checked, is still
as the snapshot showed it (status, writer, last update, manifest digest): a
publish, overwrite or gc that moves while fsck looks is never taken for damage
(the step is listed in ``in_progress``; fsck run again judges it). Every catalog
repair is compare-and-set on that same state, so a writer that takes a step
over in the meantime wins and fsck leaves it alone. Each step is checked, and
each repair made, in isolation: one that fails is listed in ``failures`` (its
problem stays unrepaired) and the rest still run. A root that goes away while
fsck runs (an unmounted share) stops it before its next verdict: past that
point every step would look missing.

This module holds the rules, once; what a kind of root holds of a step, and
how a leftover is removed, is its scan's (:mod:`registry.roots.scan`:
:mod:`registry.roots.dirscan`, :mod:`registry.roots.objectscan`), and the rows
judged are a row source's (:class:`Rows`): the steps' own, or a tier's copies
(a tiered root's durable tier is the same judge over its object scan and its
durable copies' rows: :mod:`registry.ops.tierfsck`).

| kind | found | repair |
|---|---|---|
| uncommitted-publish | staging row (dead writer), valid final dir | roll forward: published (verified if hashed) |
| invalid-staged-payload | staging row (dead writer), final dir fails its manifest or checksums | mark corrupt |
| abandoned-publish | staging row (dead writer), no final dir | remove staging dirs, mark failed |
| abandoned-staging | ``.tmp-`` dir with no live writer | remove |
| interrupted-overwrite | ``.retired-`` dir, no final dir | restore it (then the row is judged as above) |
| leftover-retired | ``.retired-`` dir next to its final dir | remove |
| unfinished-deletion | ``deleted`` row whose final or retired dir exists | remove the directories |
| unregistered-checkpoint | final dir with no row (or a failed row) | adopt if valid and its step fits the catalog |
| missing-payload | published/verified row, no directory | mark corrupt |
| damaged-payload | published/verified row, files differ from the catalog | mark corrupt |
| corrupt-step | corrupt row | none: says what to do (restore, ``registry verify``; or gc) |
| expired-checkout | registry-owned checkout whose reader lease expired or was released | remove it |
| orphan-fold | a file in ``.policy-folds/`` no ``verified`` row of live steps names; a write of it killed | remove it |

On an ``s3://`` root (:mod:`registry.roots.objectscan`) the same kinds name the
same states, with an attempt prefix in place of a directory, plus two:

| kind | found | repair |
|---|---|---|
| orphan-prefix | attempt prefix no row or live claim names (an old overwritten payload) | delete its objects |
| incomplete-upload | a multipart upload never completed, not of a live claim | abort it |

A staging row whose writer is alive is reported in ``in_progress`` and left alone
(on another host: one it refreshed within ``registry.ops.writers.STALE_AFTER``).
A repair skipped because the row changed after the snapshot (a writer took the
step over, or a dead writer's last COMMIT was still completing on the server)
is listed in ``failures``; running fsck again judges the new state. An
unfinished deletion is finished by gc's own :func:`registry.fs.removal.remove_checkpoint_dir`
(:func:`~registry.fs.removal.retire_and_remove`), which removes a directory only
while it holds the payload the row deleted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from registry.catalog import Catalog
from registry.catalog.fsck import RowState, record_payload, set_status_if, snapshot, unchanged
from registry.catalog.policy import stale_folds, usable_folds
from registry.errors import CheckpointNotFoundError
from registry.format.refs import MAX_STEP
from registry.ops.checkouts import expired as expired_checkouts, remove_owned
from registry.ops.verdicts import (REPAIRS, REPORTED, CopyOnly, FsckPass, FsckReport, Problem, Repair, _RootVanished,
                                   condemned, damage_again, found_payload, iter_lines, meta_numbers, one_line)
from registry.ops.writers import writer_alive
from registry.progress import ProgressFn
from registry.records import LIVE, Status
from registry.roots.aside import Aside, Unfinished
from registry.roots.scan import Leftover, Scan, StepFound, Stored, Valid


class Rows(Protocol):
    """The catalog rows a scan is judged against, read and changed by compare-and-set on the state seen: the
    steps' own rows (:class:`StepRows`), or one location's copy rows (a durable tier's,
    ``registry.ops.tierfsck.DurableRows``), whose claims are judged as publish claims are."""

    #: kinds of problem as this row source names them (a durable copy's ``missing-payload`` is its own kind)
    kinds: Mapping[str, str]
    #: whether a payload no row names and adoption cannot take stays for a person to judge (a step's), or is a
    #: leftover like any other (a copy's: its step is recorded elsewhere)
    keeps_unadopted: bool

    def snapshot(self) -> list[RowState]:
        """Every row, read after the scan listed the storage."""

    def now(self, run: str, step: int) -> RowState | None:
        """The row of ``run@step`` as it is now."""

    def unchanged(self, seen: RowState) -> bool:
        """Whether the row is still as ``seen``."""

    def set_status_if(self, seen: RowState, status: str, *, kind: str, **detail: str | None) -> bool:
        """Move the row to ``status`` (``failed``: the claim is given up) if it is still as ``seen``."""

    def record(self, seen: RowState | None, *, run: str, step: int, rel: str, valid: Valid, kind: str) -> bool:
        """A valid payload found at ``rel``: roll the claim ``seen`` forward, or adopt it (``seen`` None)."""

    def adopts(self, run: str, step: int, digest: str | None) -> bool:
        """Whether a valid payload of manifest ``digest`` that no row names would be adopted."""

    def condemn(self, seen: RowState, kind: str, why: str) -> bool | str:
        """The payload ``seen`` names is missing or damaged (read again first): record the verdict."""

    def corrupt(self, seen: RowState, where: str) -> tuple[str, Repair | None]:
        """A row marked corrupt (``where``: what its storage holds): what to say of it, and the repair, if any."""


class StepRows:
    """The steps' own rows: the verdicts are the step's (see the module's docstring)."""

    kinds: Mapping[str, str] = MappingProxyType({})
    keeps_unadopted = True

    def __init__(self, catalog: Catalog, *, actor: str, local_dir: Path | None, copy_at: str | None = None) -> None:
        self.catalog = catalog
        self.actor = actor
        self.local_dir = local_dir
        self.copy_at = copy_at  # on a root with tiers: the fast tier where a payload rolled forward is a copy

    def snapshot(self) -> list[RowState]:
        return snapshot(self.catalog)

    def now(self, run: str, step: int) -> RowState | None:
        return next(iter(snapshot(self.catalog, run=run, step=step)), None)

    def unchanged(self, seen: RowState) -> bool:
        return unchanged(self.catalog, seen)

    def set_status_if(self, seen: RowState, status: str, *, kind: str, **detail: str | None) -> bool:
        return set_status_if(self.catalog, seen, status, kind=kind, actor=self.actor, **detail)

    def record(self, seen: RowState | None, *, run: str, step: int, rel: str, valid: Valid, kind: str) -> bool:
        record = found_payload(valid.manifest, valid.digest, valid.manifest_size, status=Status.VERIFIED,
                               meta=meta_numbers(valid.meta))
        return record_payload(self.catalog, seen, run=run, step=step, path=rel, payload=record, kind=kind,
                              actor=self.actor, copy_at=self.copy_at,
                              **({"dead_writer": seen.writer} if seen is not None and seen.writer else {}))

    def adopts(self, run: str, step: int, digest: str | None) -> bool:
        return True

    def condemn(self, seen: RowState, kind: str, why: str) -> bool:
        marked = set_status_if(self.catalog, seen, Status.CORRUPT, kind=kind, actor=self.actor, reason=why)
        if marked:
            condemned(self.catalog, self.local_dir, seen.run)
        return marked

    def corrupt(self, seen: RowState, where: str) -> tuple[str, Repair | None]:
        return (f"marked corrupt ({where}): restore its files and run 'registry verify {seen.run}@{seen.step}', "
                f"or let 'registry gc {seen.run}' delete it", None)


class Fsck(FsckPass):
    """One pass of fsck over a catalog and what a root's scan reports. Use :func:`run_fsck`."""

    def __init__(self, *, catalog: Catalog, scan: Scan, repair: bool, checksums: bool, actor: str,
                 progress: ProgressFn | None = None, elsewhere: Collection[tuple[str, int]] = (),
                 copy_only: CopyOnly | None = None, superseded: Collection[tuple[str, int]] = (),
                 copy_at: str | None = None, theirs: Collection[Path] = (), rows: Rows | None = None,
                 runs: Collection[str] = ()) -> None:
        super().__init__(catalog=catalog, repair=repair, checksums=checksums, actor=actor, progress=progress)
        self.scan = scan
        # on a root with tiers, copy_at is this host's fast tier, where a payload rolled forward or adopted is a copy
        self.rows = rows if rows is not None else StepRows(catalog, actor=actor, local_dir=scan.local_dir,
                                                             copy_at=copy_at)
        self.runs = frozenset(runs)  # whose policy folds are checked besides those of the rows and the scan
        self.adopting: set[Path] = set()  # payloads reported for adoption: not leftovers too
        # steps whose copy is on another tier (a durable tier, another host's fast root): nothing here is no
        # missing payload
        self.elsewhere = frozenset(elsewhere)
        # steps whose directory here holds an older payload of theirs (published again on another host): the
        # tier pass reports those, never as damage to the step
        self.superseded = frozenset(superseded)
        # on a root with tiers: records damage against this host's copy alone where another good copy stands
        self.copy_only = copy_only
        # on a root with tiers: what the tier pass judges (a copy's removal killed after its rename left a retired
        # directory: no interrupted overwrite, nothing to put back)
        self.theirs = frozenset(theirs)

    def _root_present(self) -> bool:
        return self.scan.still_there()

    def _unchanged(self, row: RowState) -> bool:
        return self.rows.unchanged(row)

    def _found(self, kind: str, run: str, step: int, path: Path, detail: str, *, repairable: bool = True,
               row: RowState | None = None, still: Callable[[], bool] | None = None,
               url: str | None = None) -> Problem | None:
        return super()._found(self.rows.kinds.get(kind, kind), run, step, path, detail, repairable=repairable,
                              row=row, still=still, url=url)

    def run(self) -> FsckReport:
        self.scan.check()  # a root that is not there says nothing about the steps
        listed = self.scan.listing(self.failures)  # before the snapshot: see the module docstring
        rows = {(r.run, r.step): r for r in self.rows.snapshot()}
        for key in sorted(set(listed) | set(rows)):
            row = rows.get(key)
            try:
                self._step(key[0], key[1], row, self.scan.step(key, listed.get(key),
                                                               row.path if row is not None else None))
            except OSError as exc:  # a local failure to read, or the server's: neither corruption nor a stop
                self.failures.append(f"{key[0]}@{key[1]}: cannot check: {one_line(exc)}")
            except _RootVanished:
                path, url = self.scan.where("")
                self.failures.append(f"checkpoint root {url or path} vanished while fsck ran (unmounted?); stopped "
                                     f"at {key[0]}@{key[1]} and judged nothing after it")
                return self.report(len(rows))
        for co in expired_checkouts(self.catalog, self.scan.local_dir):
            problem = self._found("expired-checkout", co.run, co.step, co.path,
                                  f"checkout {co.path}: its reader lease expired or was released")
            self._fix(problem, functools.partial(remove_owned, co.path))
        try:
            runs = sorted({key[0] for key in rows} | set(self.scan.runs(listed)) | self.runs)
            check_folds(self, self.scan.aside(), runs, where=self.scan.where)
        except OSError as exc:  # the root gone meanwhile (unmounted), the server's trouble: no verdict
            self.failures.append(f"policy folds: cannot check: {one_line(exc)}")
        return self.report(len(rows))

    # ------------------------------------------------------------------ one step

    def _step(self, run: str, step: int, row: RowState | None, found: StepFound) -> None:
        if row is not None and row.status == Status.STAGING and writer_alive(row.writer, row.updated_at):
            path, url = self.scan.where(row.path)
            self.in_progress.append(Problem(kind="in-progress", run=run, step=step, path=path, repair=None,
                                            detail=f"being published by {row.writer}", url=url))
            return  # whatever the step holds is the writer's
        if row is not None and row.status == Status.DELETED:
            for left in found.deleted(digest=row.manifest_sha256):
                p = self._found(left.kind, run, step, left.path, left.detail, row=row, url=left.url)
                self._fix(p, functools.partial(self._finish_deletion, row, left))
            self._leftovers(run, step, found)
            return
        payload = found.payload()
        if payload is None:
            older = found.older(digest=row.manifest_sha256 if row is not None else None,
                                claim=row is not None and row.status == Status.STAGING, theirs=self.theirs)
            if older is not None:
                old, how = older
                p = self._found("interrupted-overwrite", run, step, old.path, how, row=row, url=old.url)
                if p is None:
                    return
                restored: list[Stored] = []

                def restore() -> bool:
                    restored.append(found.restore(old))
                    return True
                if self._fix(p, restore):
                    payload = restored[0]
                elif self.repair:
                    return  # the restore failed: judging the row by a payload not in place would be wrong
                else:
                    payload = old  # judge the row by what a repair would restore
        if row is None or row.status == Status.FAILED:
            self._unregistered(run, step, row, [c for c in found.adoptable(failed=row is not None)
                                                if c.path not in self.theirs])
        elif row.status == Status.STAGING:
            self._dead_staging(row, payload, found)
        elif row.status == Status.CORRUPT:
            where = f"it has {found.absent}" if payload is None else f"its files are at {payload.url or payload.path}"
            path, url = self.scan.where(row.path)
            detail, repair = self.rows.corrupt(row, where)
            p = self._found("corrupt-step", run, step, path, detail, repairable=repair is not None, row=row, url=url)
            if repair is not None:
                self._fix(p, repair)
        elif row.status in LIVE:
            self._live(row, payload, found)
        self._leftovers(run, step, found)

    def _live(self, row: RowState, payload: Stored | None, found: StepFound) -> None:
        run, step = row.run, row.step
        if (run, step) in self.superseded or payload is None and (run, step) in self.elsewhere:
            return
        if payload is None:
            why = f"{row.status} step has {found.absent}"
            path, url = self.scan.where(row.path)
            p = self._found("missing-payload", run, step, path, why, row=row, url=url,
                            still=lambda: not found.present())
            self._fix(p, lambda: self._condemn(row, "missing-payload", why))
            return

        def look() -> tuple[str, str | None]:
            """Why the payload differs from the catalog's record ('' when it does not), and the manifest digest
            that look read: the verdict rests on it."""
            checked = payload.check(checksums=self.checksums,
                                    on_bytes=lambda n: self.counter.advance(n, item=f"{run}@{step}"))
            why = checked.why
            if checked.valid is not None and row.manifest_sha256 and checked.digest != row.manifest_sha256:
                why = f"manifest of {payload.url or payload.path} does not match the catalog's record"
            elif checked.valid is not None and row.files and {
                    f.name: (f.size, f.sha256) for f in checked.valid.manifest.files.values()} != row.files:
                why = "file table does not match the catalog's"
            return why, checked.digest

        why, digest = look()
        if why:  # read again before any verdict; the verdict then rests on the manifest that re-read saw
            def again() -> str:
                nonlocal digest
                found_why, digest = look()
                return found_why
            why = damage_again(why, again, what=f"{run}@{step}")
        if why:
            p = self._found("damaged-payload", run, step, payload.path, why, row=row, url=payload.url,
                            still=lambda: payload.digest() == digest)
            self._fix(p, lambda: (self.copy_only is not None and row.manifest_sha256 is not None
                                  and self.copy_only(run, step, payload.path, row.manifest_sha256, why))
                      or self._condemn(row, "damaged-payload", why))

    def _condemn(self, row: RowState, kind: str, why: str) -> bool | str:
        return self.rows.condemn(row, kind, why)

    def _dead_staging(self, row: RowState, payload: Stored | None, found: StepFound) -> None:
        if payload is None:
            path, url = self.scan.where(row.path)
            p = self._found("abandoned-publish", row.run, row.step, path,
                            f"staging row of dead writer {row.writer} and {found.absent}: it died before its "
                            "payload was in place", row=row, url=url)
            self._fix(p, lambda: self.rows.set_status_if(row, Status.FAILED, kind="abandoned-publish",
                                                         dead_writer=row.writer))
            return
        checked = payload.check(checksums=True)
        if checked.valid is None:
            why = checked.why
            p = self._found("invalid-staged-payload", row.run, row.step, payload.path,
                            f"staging row of dead writer {row.writer}; its payload is invalid: {why}", row=row,
                            url=payload.url)
            self._fix(p, lambda: self.rows.set_status_if(row, Status.CORRUPT, kind="invalid-staged-payload",
                                                         reason=why))
            return
        p = self._found("uncommitted-publish", row.run, row.step, payload.path,
                        f"payload in place but writer {row.writer} died before the catalog commit", row=row,
                        url=payload.url)
        self._fix(p, functools.partial(self._record, row, row.run, row.step, payload.rel, checked.valid,
                                       "uncommitted-publish"))

    def _record(self, row: RowState | None, run: str, step: int, rel: str, valid: Valid, kind: str) -> bool:
        return self.rows.record(row, run=run, step=step, rel=rel, valid=valid, kind=kind)

    def _unregistered(self, run: str, step: int, row: RowState | None, candidates: list[Stored]) -> None:
        """A step without a live row: adopt the first valid payload among ``candidates``."""
        what = "no catalog row" if row is None else "a failed catalog row"
        if not candidates:
            return
        if step > MAX_STEP:
            self._found("unregistered-checkpoint", run, step, candidates[0].path,
                        f"payload with {what} cannot be adopted: step {step} is beyond the catalog's range "
                        f"(0..{MAX_STEP})", repairable=False, url=candidates[0].url)
            return
        why, vanished = "", False
        for candidate in candidates:
            checked = candidate.check(checksums=True)
            if checked.valid is None:
                why, vanished = checked.why, checked.vanished
                continue
            if not self.rows.adopts(run, step, checked.digest):
                continue  # a copy of no live payload: a leftover (see _spared)
            self.adopting.add(candidate.path)
            p = self._found("unregistered-checkpoint", run, step, candidate.path, f"valid checkpoint with {what}",
                            row=row, url=candidate.url)
            self._fix(p, functools.partial(self._record, row, run, step, candidate.rel, checked.valid,
                                           "unregistered-checkpoint"))
            return
        if not vanished and why and self.rows.keeps_unadopted:  # one removed while checked: nothing to report
            self._found("unregistered-checkpoint", run, step, candidates[0].path,
                        f"payload with {what} cannot be adopted: {why}", repairable=False, row=row,
                        url=candidates[0].url)

    # ------------------------------------------------------------------ what storage left

    def _finish_deletion(self, row: RowState, left: Leftover) -> bool | str:
        """gc's own finishing, for one step whose row is (re-read now) still the deleted one fsck saw."""
        if not self.rows.unchanged(row):
            return False
        return left.remove()

    def _spared(self, run: str, step: int, left: Leftover) -> str:
        """Why ``left`` must stay, by the step's row as it is now ('' when nothing spares it): a live claim owns
        all its step holds, a dead one what it named, a row its payload; a payload no row names is adoption's."""
        now = self.rows.now(run, step)
        if now is not None and now.status == Status.STAGING:
            if writer_alive(now.writer, now.updated_at):
                return "a live claim holds the step now"
            if left.claimed:
                return "a claim holds the step"
        if left.rel is not None and now is not None and now.path == left.rel and now.status not in (
                Status.FAILED, Status.DELETED):
            return "a row names it now"
        if now is None and left.unadopted and self.rows.keeps_unadopted:
            return "a payload no row names: adoption judges it"
        return ""

    def _leftovers(self, run: str, step: int, found: StepFound) -> None:
        """Everything else the step left, each reported only if, by the row read again now, nothing spares it,
        and removed only if that still holds just before."""
        for left in found.leftovers():
            if left.path in self.theirs or left.path in self.adopting or self._spared(run, step, left):
                continue
            p = self._found(left.kind, run, step, left.path, left.detail, url=left.url)
            self._fix(p, functools.partial(self._remove, run, step, left))

    def _remove(self, run: str, step: int, left: Leftover) -> bool | str:
        why = self._spared(run, step, left)
        return why or left.remove()


def _fold_ends(rel: str) -> tuple[int, int]:
    """The steps a fold's file name (``<from>-<to>.<kind>.safetensors``) starts and ends at; (0, 0) for a name
    fold never writes."""
    ends = rel.rsplit("/", 1)[-1].split(".", 1)[0].split("-")
    if len(ends) == 2 and all(e.isdigit() and int(e) <= MAX_STEP for e in ends):
        return int(ends[0]), int(ends[1])
    return 0, 0


def check_folds(fsck: FsckPass, aside: Aside, runs: Collection[str], *,
                where: Callable[[str], tuple[Path, str | None]]) -> None:
    """Every file under a run's ``.policy-folds/`` that no usable fold row names (``verified``, both its steps
    with a payload) is an ``orphan-fold``: a fold whose step was deleted, whose bytes were found corrupt, or
    whose write died before its row. ``--repair`` marks a row whose step is gone ``deleted`` and removes the
    file, unless a row made it usable meanwhile: a fold recorded after the listing is never taken for an
    orphan, since the catalog is read after it. So is the unfinished write of one (a temporary file, an
    incomplete multipart upload), unless one of its steps is leased: its writer holds their leases from
    before the write until its row is in, so a write in flight is left alone (``in_progress``), and
    ``--repair`` asks again just before it removes one. ``where(rel)``: the problem's path and URL."""
    from registry.ops.policy import FOLDS
    listed = {run: aside.names(f"{run}/{FOLDS}") for run in runs}
    usable = usable_folds(fsck.catalog)
    for run, names in listed.items():
        for rel in names:
            if rel in usable:
                continue
            path, url = where(rel)
            p = fsck._found("orphan-fold", run, _fold_ends(rel)[0], path,
                            "policy fold no verified row of live steps names (a step deleted, or found corrupt)",
                            url=url)
            fsck._fix(p, functools.partial(_drop_fold, fsck.catalog, aside, rel))
        for unfinished in aside.unfinished(f"{run}/{FOLDS}"):
            path, url = where(unfinished.rel)
            ends = _fold_ends(unfinished.rel)
            steps = set(ends)
            if steps & _leased(fsck.catalog, run):
                fsck.in_progress.append(Problem(
                    kind="in-progress", run=run, step=ends[0], path=path, url=url, repair=None,
                    detail=f"{unfinished.detail}, of a leased step: a fold or re-anchor in flight, left alone"))
                continue
            p = fsck._found("orphan-fold", run, ends[0], path, unfinished.detail, url=url)
            fsck._fix(p, functools.partial(_drop_unfinished, fsck.catalog, run, steps, unfinished))


def _leased(catalog: Catalog, run: str) -> set[int]:
    try:
        return catalog.leased_steps(run)
    except CheckpointNotFoundError:  # a run the catalog does not know: nothing of it is read or written
        return set()


def _drop_unfinished(catalog: Catalog, run: str, steps: set[int], unfinished: Unfinished) -> bool | str:
    """A fold's write that never completed, removed (a multipart upload aborted) unless its step is leased by now:
    the writer of a fold or an anchor holds its steps' leases until the write is stored and recorded."""
    if steps & _leased(catalog, run):
        return "its step is leased now: a fold or re-anchor may be writing it"
    return unfinished.remove()


def _drop_fold(catalog: Catalog, aside: Aside, rel: str) -> bool | str:
    stale_folds(catalog, rel)
    if rel in usable_folds(catalog):
        return "a fold row names it now"
    aside.delete(rel)
    return True


def run_fsck(*, catalog: Catalog, scan: Scan, repair: bool = False, checksums: bool = False,
             actor: str, progress: ProgressFn | None = None,
             elsewhere: Collection[tuple[str, int]] = (), copy_only: CopyOnly | None = None,
             superseded: Collection[tuple[str, int]] = (), copy_at: str | None = None,
             theirs: Collection[Path] = ()) -> FsckReport:
    """Check (and with ``repair`` fix) every step ``scan`` (the root's: ``Root.scan()``) reports against ``catalog``.

    ``checksums`` re-hashes every live step's files instead of checking sizes
    and the manifest digest; roll-forward and adoption always hash. ``progress``
    hears of the bytes that ``checksums`` re-hashes (the total is not known ahead).
    """
    return Fsck(catalog=catalog, scan=scan, repair=repair, checksums=checksums, actor=actor,
                progress=progress, elsewhere=elsewhere, copy_only=copy_only, superseded=superseded,
                copy_at=copy_at, theirs=theirs).run()


# FsckReport, Problem, REPAIRS, REPORTED, iter_lines: verdicts' names, re-exported
__all__ = ["Fsck", "FsckReport", "Problem", "REPAIRS", "REPORTED", "check_folds", "iter_lines", "run_fsck"]
