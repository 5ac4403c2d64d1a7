"""``fsck`` on an ``s3://`` root: reconcile the catalog with the attempt prefixes in the bucket.

The same verdicts as on a directory root (:mod:`registry.ops.fsck`, whose
kinds, report and compare-and-set bookkeeping this reuses), with an attempt
prefix ``RUN/step-N/a-<hex>`` in place of a directory. There is no rename and
no marker: a step is what its row names. So:

* the bucket is listed (objects and incomplete multipart uploads) *before*
  the catalog is read: a publish claims before its first upload, so every
  prefix listed belongs to a claim the snapshot already shows;
* a staging row of a dead writer is rolled forward when its own prefix holds
  a complete, valid payload (manifest present, every byte hashed); when it
  does not, a crashed overwrite's old payload is recognised by the digest the
  row still records (a claim does not touch it) and restored; otherwise the
  row ends ``failed``;
* a prefix no row or live claim names is an orphan and its objects are
  deleted, each time only if the row, read again just before, still names
  another prefix (``orphan-prefix``); a step without any row is adopted from
  a valid prefix instead (``unregistered-checkpoint``), as on a directory root;
* an incomplete multipart upload not of a live claim is aborted (``incomplete-upload``);
* a live row whose manifest is gone is ``missing-payload``, one whose objects
  differ from the manifest or whose manifest differs from the catalog's
  digest ``damaged-payload`` (both marked corrupt, compare-and-set).

A request the server fails (down, throttled past retries, access denied) is
a failure line, never a verdict: fsck does not judge what it could not read.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from registry.catalog import Catalog
from registry.catalog.fsck import RowState, record_payload, set_status_if, snapshot
from registry.catalog.records import PayloadRecord
from registry.errors import CorruptCheckpointError, ObjectNotFoundError, RegistryError
from registry.format.manifest import MANIFEST, META, Manifest
from registry.format.refs import MAX_STEP
from registry.fs import multipart
from registry.fs.objects import ObjectRoot
from registry.fs.prefixes import AttemptPrefix, check_objects, read_manifest, remove_prefix, scan
from registry.fs.store import FileProblem
from registry.ops.fsck import check_folds
from registry.ops.verdicts import FsckPass, FsckReport, Problem, damage_again, one_line, found_payload, meta_numbers
from registry.ops.writers import writer_alive
from registry.progress import ProgressFn
from registry.records import LIVE, Status
from registry.roots.aside import ObjectAside
from registry.format.layout import parse_attempt_key


class ObjectFsck(FsckPass):
    """One pass of fsck over a catalog and an object-store root. Use :func:`run_object_fsck`."""

    def __init__(self, *, catalog: Catalog, root: ObjectRoot, repair: bool, checksums: bool, actor: str,
                 progress: ProgressFn | None = None) -> None:
        super().__init__(catalog=catalog, repair=repair, checksums=checksums, actor=actor, progress=progress)
        self.root = root

    def run(self) -> FsckReport:
        self.root.check_bucket()  # a root that cannot be reached says nothing about any step
        prefixes = scan(self.root)  # before the snapshot: see the module docstring
        uploads = list(multipart.list_uploads(self.root.config, self.root.key() + "/" if self.root.key() else ""))
        rows = {(r.run, r.step): r for r in snapshot(self.catalog)}
        by_step: dict[tuple[str, int], list[AttemptPrefix]] = {}
        for found in prefixes.values():
            by_step.setdefault((found.run, found.step), []).append(found)
        pending: dict[tuple[str, int], list[tuple[str, multipart.Upload]]] = {}
        for upload in uploads:
            key = parse_attempt_key(self._rel(upload.key))
            if key is not None:
                pending.setdefault((key.run, key.step), []).append((key.prefix, upload))
        for run, step in sorted(set(by_step) | set(rows) | set(pending)):
            try:
                self._step(run, step, rows.get((run, step)), by_step.get((run, step), []),
                           pending.get((run, step), []))
            except OSError as exc:  # the server's trouble (StorageError): neither corruption nor a reason to stop
                self.failures.append(f"{run}@{step}: cannot check: {one_line(exc)}")
        try:
            runs = sorted({r.run for r in rows.values()} | {k[0] for k in by_step})
            check_folds(self, ObjectAside(self.root), runs, where=lambda rel: (Path(rel), self.root.url(rel)))
        except OSError as exc:
            self.failures.append(f"policy folds: cannot check: {one_line(exc)}")
        return self.report(len(rows))

    def _root_present(self) -> bool:
        """Asked before each verdict: a bucket gone meanwhile answers like missing keys (raises StorageError)."""
        self.root.check_bucket()
        return True

    # ------------------------------------------------------------------ helpers

    def _rel(self, key: str) -> str:
        base = self.root.key()
        return key[len(base) + 1:] if base else key

    def _url(self, prefix: str) -> str:
        return self.root.url(prefix)

    def _current(self, run: str, step: int) -> RowState | None:
        """The step's row as it is now (read again, after whatever fsck checked or repaired)."""
        return next(iter(snapshot(self.catalog, run=run, step=step)), None)

    def _names(self, run: str, step: int, prefix: str) -> bool:
        """Whether a row or a claim names ``prefix`` now: a staging row holds every prefix of its step (an
        overwrite's old payload is not named by the row while it is replaced)."""
        now = self._current(run, step)
        if now is None:
            return False
        return now.status == Status.STAGING or (now.path == prefix and now.status not in (Status.FAILED,
                                                                                           Status.DELETED))

    def _payload(self, found: AttemptPrefix, *, checksums: bool) -> tuple[PayloadRecord | None, str, str | None]:
        """A record of the valid payload under ``found``, or (None, why not); and the manifest digest read."""
        if not found.has_manifest:
            return None, "no manifest: the upload did not finish", None
        try:
            manifest, digest = read_manifest(self.root, found.prefix)
        except ObjectNotFoundError:
            return None, "its manifest vanished while being checked", None
        except CorruptCheckpointError as exc:
            return None, str(exc), None
        listed = found.names
        problems = check_objects(self.root, found.prefix, manifest, listed, checksums=checksums,
                                 on_bytes=lambda n: self.counter.advance(n, item=f"{found.run}@{found.step}"))
        if problems:
            return None, _problem(problems[0]), digest
        meta = self._meta(found.prefix, manifest)
        status = Status.VERIFIED if checksums else Status.PUBLISHED
        return found_payload(manifest, digest, listed[MANIFEST].size, status=status, meta=meta), "", digest

    def _meta(self, prefix: str, manifest: Manifest) -> dict[str, int]:
        if META not in manifest.files:
            return {}
        try:
            return meta_numbers(json.loads(bytes(self.root.get(f"{prefix}/{META}"))))
        except (RegistryError, ValueError):
            return {}

    def _manifest_digest(self, prefix: str) -> str | None:
        try:
            return read_manifest(self.root, prefix)[1]
        except (ObjectNotFoundError, CorruptCheckpointError):
            return None

    # ------------------------------------------------------------------ one step

    def _step(self, run: str, step: int, row: RowState | None, found: list[AttemptPrefix],
              uploads: list[tuple[str, multipart.Upload]]) -> None:
        own = next((f for f in found if row is not None and f.prefix == row.path), None)
        if row is not None and row.status == Status.STAGING:
            if writer_alive(row.writer, row.updated_at):
                self.in_progress.append(_progress(run, step, row.path, self._url(row.path),
                                                  f"being published by {row.writer}"))
                return  # its prefixes and uploads are the writer's
            self._dead_staging(row, own, found)
        elif row is not None and row.status == Status.CORRUPT:
            where = "its objects are missing" if own is None else f"its objects are at {self._url(own.prefix)}"
            self._found("corrupt-step", run, step, Path(row.path),
                        f"marked corrupt ({where}): restore them and run 'registry verify {run}@{step}', "
                        f"or let 'registry gc {run}' delete it", repairable=False, row=row, url=self._url(row.path))
        elif row is not None and row.status in LIVE:
            self._live(row, own)
        elif row is None or row.status == Status.FAILED:
            self._unregistered(run, step, row, found)
        self._sweep(run, step, found, uploads)

    def _live(self, row: RowState, own: AttemptPrefix | None) -> None:
        url = self._url(row.path)
        if own is None or not own.has_manifest:
            why = f"{row.status} step has no manifest at {url}"
            p = self._found("missing-payload", row.run, row.step, Path(row.path), why, row=row, url=url,
                            still=lambda: self.root.head(f"{row.path}/{MANIFEST}") is None)
            self._fix(p, lambda: set_status_if(self.catalog, row, Status.CORRUPT, kind="missing-payload",
                                               actor=self.actor, reason=why))
            return
        def look() -> tuple[str, str | None]:
            record, why, digest = self._payload(own, checksums=self.checksums)
            if record is not None and record.manifest_sha256 != row.manifest_sha256:
                why = "manifest does not match the catalog's digest"
            elif record is not None and row.files and {f.name: (f.size, f.sha256) for f in record.files} != row.files:
                why = "file table does not match the catalog's"
            return why, digest
        why, digest = look()
        if why:  # read again before any verdict; the verdict then rests on the manifest that re-read saw
            def again() -> str:
                nonlocal digest
                found, digest = look()
                return found
            why = damage_again(why, again, what=f"{row.run}@{row.step}")
        if why:
            p = self._found("damaged-payload", row.run, row.step, Path(row.path), why, row=row, url=url,
                            still=lambda: self._manifest_digest(row.path) == digest)
            self._fix(p, lambda: set_status_if(self.catalog, row, Status.CORRUPT, kind="damaged-payload",
                                               actor=self.actor, reason=why))

    def _dead_staging(self, row: RowState, own: AttemptPrefix | None, found: list[AttemptPrefix]) -> None:
        url = self._url(row.path)
        if own is not None and own.has_manifest:
            record, why, _ = self._payload(own, checksums=True)
            if record is None:
                p = self._found("invalid-staged-payload", row.run, row.step, Path(row.path),
                                f"staging row of dead writer {row.writer}; its objects are invalid: {why}",
                                row=row, url=url)
                self._fix(p, lambda: set_status_if(self.catalog, row, Status.CORRUPT, kind="invalid-staged-payload",
                                                   actor=self.actor, reason=why))
                return
            p = self._found("uncommitted-publish", row.run, row.step, Path(row.path),
                            f"payload uploaded but writer {row.writer} died before the catalog commit", row=row,
                            url=url)
            self._fix(p, functools.partial(self._record, row, row.path, record, "uncommitted-publish"))
            return
        for old in found:  # an overwrite killed before its commit: the old payload, by the digest the row kept
            if old.prefix == row.path or not old.has_manifest or row.manifest_sha256 is None:
                continue
            if self._manifest_digest(old.prefix) != row.manifest_sha256:
                continue
            record, why, _ = self._payload(old, checksums=True)
            if record is None:
                continue
            p = self._found("interrupted-overwrite", row.run, row.step, Path(old.prefix),
                            f"overwrite by dead writer {row.writer} never committed; the old payload is intact",
                            row=row, url=self._url(old.prefix))
            self._fix(p, functools.partial(self._record, row, old.prefix, record, "interrupted-overwrite"))
            return
        p = self._found("abandoned-publish", row.run, row.step, Path(row.path),
                        f"staging row of dead writer {row.writer} and no complete payload: crash before the "
                        "manifest was uploaded", row=row, url=url)
        self._fix(p, lambda: set_status_if(self.catalog, row, Status.FAILED, kind="abandoned-publish",
                                           actor=self.actor, dead_writer=row.writer))

    def _record(self, row: RowState | None, prefix: str, record: PayloadRecord, kind: str) -> bool:
        run, step = (row.run, row.step) if row is not None else _run_step(prefix)
        return record_payload(self.catalog, row, run=run, step=step, path=prefix, payload=record, kind=kind,
                              actor=self.actor, **({"dead_writer": row.writer} if row is not None else {}))

    def _unregistered(self, run: str, step: int, row: RowState | None, found: list[AttemptPrefix]) -> None:
        """A step without a row: adopt its newest valid prefix (a failed row's prefixes are orphans)."""
        if row is not None or not found:
            return
        what = "no catalog row"
        candidates = sorted((f for f in found if f.has_manifest),
                            key=lambda f: max((e.last_modified for e in f.entries if e.last_modified is not None),
                                              default=None) or 0, reverse=True)
        why = ""
        for found_prefix in candidates:
            if step > MAX_STEP:
                self._found("unregistered-checkpoint", run, step, Path(found_prefix.prefix),
                            f"prefix with {what} cannot be adopted: step {step} is beyond the catalog's range "
                            f"(0..{MAX_STEP})", repairable=False, url=self._url(found_prefix.prefix))
                return
            record, why, _ = self._payload(found_prefix, checksums=True)
            if record is None:
                continue
            p = self._found("unregistered-checkpoint", run, step, Path(found_prefix.prefix),
                            f"valid checkpoint with {what}", url=self._url(found_prefix.prefix))
            self._fix(p, functools.partial(self._record, None, found_prefix.prefix, record,
                                           "unregistered-checkpoint"))
            return
        if candidates:
            self._found("unregistered-checkpoint", run, step, Path(candidates[0].prefix),
                        f"prefix with {what} cannot be adopted: {why}", repairable=False,
                        url=self._url(candidates[0].prefix))

    def _sweep(self, run: str, step: int, found: list[AttemptPrefix],
               uploads: list[tuple[str, multipart.Upload]]) -> None:
        """Orphan prefixes and incomplete uploads of one step, each removed only if, read again just
        before, no row or live claim names its prefix."""
        now = self._current(run, step)
        if now is not None and now.status == Status.STAGING:
            return  # a claim in flight, or a dead one not (or not yet) repaired: its step's prefixes are its own
        for orphan in found:
            named = now is not None and now.path == orphan.prefix
            if named and now is not None and now.status not in (Status.FAILED, Status.DELETED):
                continue  # the step's payload
            if now is None and orphan.has_manifest:
                continue  # a payload without any row: adopted or reported by _unregistered, never deleted
            deleted = named and now is not None and now.status == Status.DELETED
            kind = "unfinished-deletion" if deleted else "orphan-prefix"
            detail = ("deleted step still has objects" if deleted
                      else f"attempt prefix with {len(orphan.entries)} object(s) that no row names")
            p = self._found(kind, run, step, Path(orphan.prefix), detail, url=self._url(orphan.prefix))
            self._fix(p, functools.partial(self._remove, run, step, orphan))
        for prefix, upload in uploads:
            p = self._found("incomplete-upload", run, step, Path(prefix),
                            f"multipart upload of {self._rel(upload.key).rsplit('/', 1)[-1]} never completed "
                            f"(started {upload.initiated:%Y-%m-%d %H:%M:%S}Z)" if upload.initiated else
                            f"multipart upload of {self._rel(upload.key).rsplit('/', 1)[-1]} never completed",
                            url=self._url(prefix))
            self._fix(p, functools.partial(self._abort, run, step, prefix, upload))

    def _remove(self, run: str, step: int, orphan: AttemptPrefix) -> bool | str:
        if self._names(run, step, orphan.prefix):
            return "a row or a live claim names the prefix now"
        remove_prefix(self.root, orphan.prefix, [e.rel for e in orphan.entries])
        return True

    def _abort(self, run: str, step: int, prefix: str, upload: multipart.Upload) -> bool | str:
        now = self._current(run, step)
        if now is not None and now.status == Status.STAGING and now.path == prefix and \
                writer_alive(now.writer, now.updated_at):
            return "its claim is live now"
        multipart.abort_upload(self.root.config, upload)
        return True


def _run_step(prefix: str) -> tuple[str, int]:
    key = parse_attempt_key(prefix + "/x")
    assert key is not None, "a listed attempt prefix parses"
    return key.run, key.step


def _problem(problem: FileProblem) -> str:
    return f"{problem.name}: {problem.problem}"


def _progress(run: str, step: int, prefix: str, url: str, detail: str) -> Problem:
    return Problem(kind="in-progress", run=run, step=step, path=Path(prefix), detail=detail, repair=None, url=url)


def run_object_fsck(*, catalog: Catalog, root: ObjectRoot, repair: bool = False, checksums: bool = False,
                    actor: str, progress: ProgressFn | None = None) -> FsckReport:
    """:func:`registry.ops.fsck.run_fsck` for an object-store root (see the module docstring)."""
    return ObjectFsck(catalog=catalog, root=root, repair=repair, checksums=checksums, actor=actor,
                      progress=progress).run()


__all__ = ["ObjectFsck", "run_object_fsck"]

