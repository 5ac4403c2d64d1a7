"""``Registry``: the public API, composing the catalog, the store and the loader.

The publish protocol (design section 4) lives here because it is the one
place that must talk to both the catalog and the filesystem:

1. claim a ``staging`` row (the unique constraint picks one winner);
2. write the payload into a hidden staging directory, hashing as it writes,
   manifest last, everything fsync'd;
3. rename it into place (retiring an old payload when overwriting);
4. one catalog transaction: status, digest, files, metrics, tags, event.

Anything that fails before 4 removes the staging directory and either
restores the overwritten step or marks the row ``failed``.
"""

from __future__ import annotations

import copy
import math
import os
import threading
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from registry.catalog import Catalog, Claim, FileRecord
from registry.checkpoint import Checkpoint
from registry.crashpoints import crashpoint
from registry.errors import AsyncPublishError, CorruptCheckpointError, InvalidStateError, PublishError, RegistryError
from registry.records import LIVE, CheckpointInfo, EventInfo, MetricPoint, RunInfo
from registry.refs import Ref, check_metric_key, check_run_name, check_step, check_tag_name, parse_ref, step_dirname
from registry.snapshot import Snapshot, Snapshotter
from registry.store import (Payload, Store, Written, check_written, discard, install, new_staging, now_timestamp,
                            read_directory, remove_stale_staging, verify_directory, write_payload, writer_alive,
                            writer_id)
from registry.tensorio import check_state_dict

DEFAULT_ROOT = "checkpoints"


def _check_metrics(run: str, step: int, metrics: Mapping[str, Any] | None) -> list[tuple[int, str, float]]:
    if metrics is None:
        return []
    if not isinstance(metrics, Mapping):
        raise InvalidStateError(f"metrics for {run}@{step} must be a mapping of names to numbers")
    out = []
    for key, value in metrics.items():
        check_metric_key(key)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidStateError(f"metric {key!r} at {run}@{step} is {value!r}, not a number", run=run, step=step)
        if not math.isfinite(float(value)):
            raise InvalidStateError(f"metric {key!r} at {run}@{step} is {value!r}; only finite values can be ranked",
                                    run=run, step=step)
        out.append((step, key, float(value)))
    return out


def locations(url: str | None, root: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """The root and catalog URL after applying the environment and the defaults."""
    root_path = Path(root if root is not None else os.environ.get("REGISTRY_ROOT", DEFAULT_ROOT)).absolute()
    return root_path, url or os.environ.get("REGISTRY_URL") or f"sqlite:///{root_path / 'catalog.db'}"


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    run: str
    step: int
    ok: bool
    status: str
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class _PublishJob:
    """A validated, claimed publish: everything phases 2-4 need."""

    run: str
    step: int
    claim: Claim
    final: Path
    payload: Payload
    verify: bool
    new_metrics: tuple[tuple[int, str, float], ...]
    tags: tuple[str, ...]
    epoch: int
    consumed_samples: int
    optimizer_step: int
    policy_version: int | None


class Registry:
    """A catalog plus a checkpoint root. Use :meth:`open`; close it (or use ``with``)."""

    def __init__(self, *, catalog: Catalog, store: Store, url: str,
                 lease_ttl: timedelta = timedelta(minutes=30)) -> None:
        self.catalog = catalog
        self.store = store
        self.url = url
        self.lease_ttl = lease_ttl
        self.writer = writer_id()
        self._pending_metrics: dict[str, list[tuple[int, str, float]]] = {}
        self._attempts: dict[str, int] = {}
        self._resumed_from: dict[str, int] = {}
        self._closed = False
        # async publish (issue 7): the background writer, its pending futures, the first unreported error
        self._lock = threading.RLock()
        self._worker: ThreadPoolExecutor | None = None
        self._pending: list[Future[CheckpointInfo]] = []
        self._async_errors: list[tuple[str, BaseException]] = []
        self._snapshots = Snapshotter()

    @classmethod
    def open(cls, url: str | None = None, root: str | os.PathLike[str] | None = None, *,
             migrate: bool = True, lease_ttl: timedelta = timedelta(minutes=30)) -> Registry:
        """Open (creating and migrating as needed) the catalog and the root.

        ``root`` defaults to ``$REGISTRY_ROOT`` or ``./checkpoints``; ``url`` to
        ``$REGISTRY_URL`` or ``sqlite:///<root>/catalog.db``.
        """
        root_path, url = locations(url, root)
        store = Store(root_path)
        return cls(catalog=Catalog.open(url, migrate=migrate), store=store, url=url, lease_ttl=lease_ttl)

    def close(self) -> None:
        """Wait for background publishes, flush metrics, release everything.

        A background publish that failed and was not yet reported is raised
        (as :class:`AsyncPublishError`) after everything is closed.
        """
        if self._closed:
            return
        try:
            self._wait_pending()
            self.flush()
        finally:
            self._closed = True
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            self._snapshots.clear()
            self.catalog.close()
        self._raise_async_error()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _absolute(self, info: CheckpointInfo) -> CheckpointInfo:
        return replace(info, path=self.store.root / info.path)

    def _attempt(self, run: str) -> int:
        with self._lock:  # also called from the background publisher
            if run not in self._attempts:
                self._attempts[run] = self.catalog.start_attempt(
                    run, writer=self.writer, resumed_from=self._resumed_from.get(run))
            return self._attempts[run]

    # ------------------------------------------------------------------ publish

    def publish(self, run: str, step: int, state_dict: Mapping[str, torch.Tensor], *,
                extra: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
                meta: Mapping[str, Any] | None = None, metrics: Mapping[str, Any] | None = None,
                epoch: int = 0, consumed_samples: int = 0, policy_version: int | None = None,
                optimizer_step: int | None = None, tags: Iterable[str] = (), overwrite: bool = False,
                verify: bool = True, max_shard_size: int | None = None,
                blocking: bool = True) -> Any:
        """Atomically publish ``state_dict`` and friends as ``run@step``.

        Returns the ``CheckpointInfo``; with ``blocking=False`` a
        ``Future[CheckpointInfo]`` instead, as soon as the state is copied
        (see "async publish" below). ``verify=True`` makes the step
        ``verified`` at once when the written files pass
        :func:`registry.store.check_written`; ``verify=False`` leaves it
        ``published`` until ``registry verify`` re-hashes it.
        """
        self._raise_async_error()
        check_run_name(run)
        check_step(step)
        state = check_state_dict(state_dict)
        tags = tuple(check_tag_name(t) for t in tags)
        for key in (extra or {}):
            if not isinstance(key, str) or not key or "/" in key or key.startswith("."):
                raise InvalidStateError(f"invalid extra name {key!r}: it becomes the file name NAME.pt")
        if policy_version is not None:
            check_step(policy_version)
        if max_shard_size is not None and (not isinstance(max_shard_size, int) or max_shard_size <= 0):
            raise InvalidStateError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
        new_metrics = _check_metrics(run, step, metrics)
        user_meta = dict(meta or {})
        full_meta = {"epoch": epoch, "consumed_samples": consumed_samples, "timestamp": now_timestamp(),
                     "optimizer_step": optimizer_step if optimizer_step is not None else step,
                     "policy_version": policy_version, **user_meta}
        payload = Payload(state_dict=state, meta=full_meta, config=dict(config or {}),
                          extra=dict(extra or {}), max_shard_size=max_shard_size)
        if blocking:
            self._wait_pending()  # publishes commit in call order, background ones first
            self._raise_async_error()

        final = self.store.step_dir(run, step)
        claim = self.catalog.claim(run, step, path=self.store.relpath(final), writer=self.writer,
                                   overwrite=overwrite, writer_alive=writer_alive)
        crashpoint("after-claim")
        job = _PublishJob(run=run, step=step, claim=claim, final=final, payload=payload, verify=verify,
                          new_metrics=tuple(new_metrics), tags=tags, epoch=epoch,
                          consumed_samples=consumed_samples, optimizer_step=full_meta["optimizer_step"],
                          policy_version=policy_version)
        if not blocking:
            return self._submit_publish(job)
        return self._run_publish(job)

    def _run_publish(self, job: _PublishJob) -> CheckpointInfo:
        """Phases 2-4 for a claimed step (on the caller's thread, or the background publisher's)."""
        remove_stale_staging(job.final)
        written, status = self._write_and_install(job.claim, job.final, job.payload, job.verify)

        with self._lock:
            pending = self._pending_metrics.get(job.run, [])
            due = [m for m in pending if m[0] <= job.step]
            self._pending_metrics[job.run] = [m for m in pending if m[0] > job.step]
        try:
            self.catalog.commit_publish(
                job.claim, status=status, manifest_sha256=written.manifest_sha256,
                files=[FileRecord(name=f.name, size=f.size, sha256=f.sha256)
                       for f in written.manifest.files.values()], total_bytes=written.total_bytes,
                epoch=job.epoch, consumed_samples=job.consumed_samples,
                optimizer_step=job.optimizer_step, policy_version=job.policy_version,
                metrics=due + list(job.new_metrics), attempt_id=self._attempt(job.run), tags=job.tags,
                writer=self.writer)
        except BaseException:
            with self._lock:
                self._pending_metrics[job.run] = due + self._pending_metrics.get(job.run, [])
            raise
        crashpoint("after-commit")
        info = self.catalog.get(job.run, job.step)
        assert info is not None
        return self._absolute(info)

    def _write_and_install(self, claim: Claim, final: Path, payload: Payload,
                           verify: bool) -> tuple[Written, str]:
        staging = new_staging(final)
        installed = False
        try:
            written = write_payload(staging, payload)
            crashpoint("after-write")
            status = "published"
            if verify:
                problems = check_written(staging, written)
                if problems:
                    raise CorruptCheckpointError(
                        f"read-back of {final} failed: {problems[0].name}: {problems[0].problem}", path=final)
                status = "verified"
            install(staging, final)
            installed = True
            return written, status
        except BaseException as exc:
            discard(staging)
            intact = not installed and final.is_dir()
            try:
                self.catalog.abort_claim(claim, reason=str(exc) or type(exc).__name__,
                                         old_payload_intact=intact)
            except Exception:
                pass  # fsck repairs a staging row whose writer is gone
            if isinstance(exc, OSError):
                raise PublishError(f"could not publish {final}: {exc.strerror or exc}",
                                   errno=exc.errno, path=final) from exc
            raise

    # ------------------------------------------------------------------ metrics

    def log_metrics(self, run: str, step: int, metrics: Mapping[str, Any]) -> None:
        """Buffer metric points; durable at the next publish of a step >= ``step``, or ``flush()``."""
        check_run_name(run)
        check_step(step)
        points = _check_metrics(run, step, metrics)
        with self._lock:
            self._pending_metrics.setdefault(run, []).extend(points)

    def flush(self) -> None:
        """Make every buffered metric point durable."""
        with self._lock:
            for run in list(self._pending_metrics):
                points = self._pending_metrics[run]
                if points:
                    self.catalog.add_metrics(run, points, attempt_id=self._attempt(run))
                self._pending_metrics.pop(run, None)

    def metrics(self, run: str, key: str | None = None, *, history: bool = False) -> list[MetricPoint]:
        check_run_name(run)
        return self.catalog.metrics(run, key=key, history=history)

    # ------------------------------------------------------------------ queries

    def resolve(self, ref: str | Ref) -> CheckpointInfo:
        return self._absolute(self.catalog.resolve(parse_ref(ref)))

    def checkpoints(self, run: str, include_deleted: bool = False, *,
                    policy_version: int | None = None) -> list[CheckpointInfo]:
        check_run_name(run)
        return [self._absolute(i) for i in self.catalog.checkpoints(
            run, include_deleted=include_deleted, policy_version=policy_version)]

    def runs(self) -> list[RunInfo]:
        return self.catalog.runs()

    def events(self, run: str | None = None, *, step: int | None = None) -> list[EventInfo]:
        return self.catalog.events(run, step=step)

    def tag(self, run: str, step: int, name: str) -> None:
        check_run_name(run)
        check_step(step)
        self.catalog.tag(run, step, check_tag_name(name), actor=self.writer)

    def untag(self, run: str, name: str) -> None:
        check_run_name(run)
        self.catalog.untag(run, check_tag_name(name), actor=self.writer)

    # ------------------------------------------------------------------ load

    def load(self, ref: str | Ref, broadcast: bool = False, verify: bool = True,
             map_location: Any = "cpu", *, trust_pickle: bool = False) -> Checkpoint:
        """Resolve ``ref`` and load it; a corrupt ``@latest`` falls back to an older step."""
        parsed = parse_ref(ref)
        if broadcast:
            from registry.loader import distributed_load
            return distributed_load(self, parsed, verify=verify, map_location=map_location,
                                    trust_pickle=trust_pickle)
        return self.load_local(parsed, verify=verify, map_location=map_location, trust_pickle=trust_pickle)

    def load_local(self, parsed: Ref, *, verify: bool, map_location: Any, trust_pickle: bool) -> Checkpoint:
        below: int | None = None
        while True:
            info = self._absolute(self.catalog.resolve(parsed, below=below))
            if info.status == "corrupt":
                raise CorruptCheckpointError(f"{parsed} is marked corrupt (step {info.step}); "
                                             "run 'registry verify' after repairing it",
                                             run=info.run, step=info.step, path=info.path)
            try:
                loaded = self.read_checked(info, verify=verify, map_location=map_location,
                                           trust_pickle=trust_pickle)
            except CorruptCheckpointError as exc:
                self.mark_corrupt(info, str(exc))
                if parsed.names_one_step:
                    raise
                warnings.warn(f"{info.run}@{info.step} is corrupt ({exc}); falling back to an older step",
                              RuntimeWarning, stacklevel=3)
                below = info.step
                continue
            self._resumed_from[info.run] = info.step
            return Checkpoint.from_loaded(loaded, step=info.step, info=info)

    def read_checked(self, info: CheckpointInfo, *, verify: bool, map_location: Any,
                     trust_pickle: bool) -> Any:
        """Read ``info``'s directory under a reader lease and match it against the catalog."""
        lease = self.catalog.acquire_lease(info.run, info.step, holder=self.writer, ttl=self.lease_ttl)
        try:
            loaded = read_directory(info.path, verify=verify, trust_pickle=trust_pickle,
                                    map_location=map_location)
        finally:
            if lease is not None:
                self.catalog.release_lease(lease)
        if info.manifest_sha256 and loaded.manifest_sha256 != info.manifest_sha256:
            raise CorruptCheckpointError(f"manifest of {info.path} does not match the catalog's record",
                                         path=info.path, run=info.run, step=info.step)
        return loaded

    def mark_corrupt(self, info: CheckpointInfo, reason: str) -> None:
        self.catalog.set_status(info.run, info.step, "corrupt", kind="corrupt", actor=self.writer,
                                only_from=LIVE, reason=reason)

    # ------------------------------------------------------------------ verify

    def verify(self, *refs: str) -> list[VerifyResult]:
        """Re-hash checkpoints (all live ones of a RUN, or the step a REF names).

        Intact steps become ``verified``; damaged ones ``corrupt``. A corrupt
        step that hashes clean again (restored from backup) is verified again.
        """
        targets: list[CheckpointInfo] = []
        for ref in refs:
            parsed = parse_ref(ref)
            if "@" in ref:
                targets.append(self.resolve(parsed))
            else:
                targets.extend(i for i in self.checkpoints(parsed.run)
                               if i.status in ("published", "verified", "corrupt"))

        def check(info: CheckpointInfo) -> VerifyResult:
            problems = verify_directory(info.path) if info.path.is_dir() else []
            if not info.path.is_dir():
                problems_text: tuple[str, ...] = ("directory missing",)
            else:
                problems_text = tuple(f"{p.name}: {p.problem}" for p in problems)
                if not problems:
                    files = {f.name: f for f in self.catalog.files(info.run, info.step)}
                    from registry.manifest import read_manifest
                    manifest, digest = read_manifest(info.path)
                    if (info.manifest_sha256 and digest != info.manifest_sha256) or (
                            files and {n: (e.size, e.sha256) for n, e in manifest.files.items()}
                            != {n: (f.size, f.sha256) for n, f in files.items()}):
                        problems_text = ("manifest does not match the catalog",)
            ok = not problems_text
            status = "verified" if ok else "corrupt"
            self.catalog.set_status(info.run, info.step, status, kind="verify" if ok else "corrupt",
                                    actor=self.writer, only_from=("published", "verified", "corrupt"),
                                    problems=list(problems_text))
            return VerifyResult(run=info.run, step=info.step, ok=ok, status=status, problems=problems_text)

        with ThreadPoolExecutor(max_workers=min(4, max(1, len(targets)))) as pool:
            return list(pool.map(check, targets))

    # ------------------------------------------------------------------ followers (issue 3)

    # ------------------------------------------------------------------ retention (issue 4)

    # ------------------------------------------------------------------ import (issue 5)

    # ------------------------------------------------------------------ fsck (issue 6)

    # ------------------------------------------------------------------ async publish (issue 7)
    #
    # ``publish(..., blocking=False)`` validates and claims the step on the
    # caller's thread (so a bad name or an existing step raises at once), then
    # copies every tensor of the state dict and of ``extra`` into a reusable
    # CPU arena (pinned when the source is on CUDA; see ``registry.snapshot``)
    # and returns a future. One background thread per registry writes, fsyncs,
    # installs and commits the queued publishes one at a time, in call order,
    # so a trainer's steps commit in step order. ``wait()`` and ``close()``
    # wait for the queue; a blocking publish waits for it first. A failed
    # background publish sets its future's exception and is raised once more,
    # as ``AsyncPublishError``, by the next ``publish``, ``wait`` or ``close``.

    def wait(self) -> None:
        """Block until every background publish has committed or failed; raise the first failure."""
        self._wait_pending()
        self._raise_async_error()

    def pending_publishes(self) -> int:
        """How many background publishes have not finished yet."""
        with self._lock:
            return len(self._pending)

    def _submit_publish(self, job: _PublishJob) -> Future[CheckpointInfo]:
        try:
            snap = self._snapshots.take(job.payload.state_dict, job.payload.extra)
            payload = replace(job.payload, state_dict=snap.state_dict, extra=snap.extra,
                              meta=copy.deepcopy(job.payload.meta), config=copy.deepcopy(job.payload.config))
            with self._lock:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="registry-publish")
                future = self._worker.submit(self._background_publish, replace(job, payload=payload), snap)
                self._pending.append(future)
        except BaseException as exc:
            try:
                self.catalog.abort_claim(job.claim, reason=str(exc) or type(exc).__name__,
                                         old_payload_intact=job.final.is_dir())
            except Exception:
                pass  # fsck repairs a staging row whose writer is gone
            raise
        future.add_done_callback(self._background_done)
        return future

    def _background_publish(self, job: _PublishJob, snap: Snapshot) -> CheckpointInfo:
        try:
            return self._run_publish(job)
        except BaseException as exc:
            with self._lock:  # recorded before the future completes, so wait() cannot miss it
                self._async_errors.append((f"{job.run}@{job.step}", exc))
            raise
        finally:
            snap.release()

    def _background_done(self, future: Future[CheckpointInfo]) -> None:
        with self._lock:
            if future in self._pending:
                self._pending.remove(future)

    def _wait_pending(self) -> None:
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            wait_futures(pending)
            with self._lock:  # done callbacks may still be running
                self._pending = [f for f in self._pending if not f.done()]

    def _raise_async_error(self) -> None:
        with self._lock:
            errors, self._async_errors = self._async_errors, []
        if errors:
            name, first = errors[0]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise AsyncPublishError(f"background publish of {name} failed: {first}{more}") from first

    def __repr__(self) -> str:
        return f"Registry(url={self.catalog.engine.url.render_as_string(hide_password=True)!r}, root={str(self.store.root)!r})"


__all__ = ["Registry", "VerifyResult", "RegistryError", "step_dirname"]
