"""Sharded checkpoints: publish from every rank, load at any world size, on ``torch.distributed.checkpoint``.

Publish (``Registry.publish(..., sharded=True)``), called by every rank of the group:

0. *agree*: every rank's request (run, step, overwrite, verify) and any
   argument error are gathered; an error anywhere is raised everywhere.
   Metrics, tags, config, meta, epoch, consumed_samples and policy_version
   are rank 0's; the other ranks' values are ignored.
1. rank 0 claims the ``staging`` row and makes the staging directory inside
   :func:`registry.ops.protocol.publish_sequence`, the one publish sequence,
   and broadcasts the directory (or why it could not, which every rank raises).
2. every rank writes its shards with ``dcp.save`` through a hashing writer
   (:mod:`registry.fs.dcpfiles`): each file is hashed while written and
   fsync'd; the digests are gathered on rank 0.
3. rank 0 writes ``meta.json``, ``config.json`` and the manifest last, and
   ``publish_sequence`` renames and commits as for any publish; the outcome
   (the ``CheckpointInfo``, or the failure) is broadcast right after the
   commit.
4. then, on rank 0 only, whatever comes after a commit (``after``: the
   publish's ``retention``), which no other rank waits for: a gc however
   long cannot make a committed step look failed, and its failure is rank
   0's ``RetentionWarning``.

Where the files go and how they are read back is the root's
(:mod:`registry.roots.shards`, ``Registry.root.shards()``): a staging directory
of DCP files written hashed and fsync'd, or, on ``s3://``, the claim's attempt
prefix, to which every rank uploads its own files hashed while uploading
(:mod:`registry.fs.dcpobjects`); the sequence here is the same for both.

A failure on any rank is raised on every rank as the same ``RegistryError``
subclass (a failed write as ``PublishError``), after rank 0 removed the
staging directory and released the row: nothing becomes visible. A rank
that dies makes the others raise ``DistributedError`` within ``timeout`` for
the registry's own collectives; DCP's collectives wait as long as the process
group's timeout. ``fsck --repair`` cleans up after a crash of any rank.

Load (``Registry.load_into``), called by every rank with its own template:
rank 0 resolves the ref, holds the reader lease and sends the manifest and
``.metadata`` bytes (checked against the catalog's digest); ``dcp.load``
reshards into the templates from whatever world size and layout the step
was saved with, while every rank checks its share of the data files' xxh3
pieces on a thread beside it (the whole step is checked once, spread over the
ranks; with ``trust_pickle=True`` the check finishes before any byte is
read, since a full unpickler must never see bytes not yet checked). On
``s3://`` each rank fetches only the byte ranges its plan names, and checks
every piece it fetches before DCP sees it. On a root with
tiers rank 0 locates the nearest copy: this host's fast or cached copy when
every rank's host holds it, else the durable copy, read by ranged GETs as on
``s3://`` (a step no rank can reach is ``NoCopyError``, skipped by ``@latest``
and never marked). Hosts that hold the parts of a step published from several
hosts read them from their own disks
(:func:`registry.distributed.parts.part_read`), before it is durable too. The
load succeeds only when every share checked out; otherwise the templates hold
whatever was read and the load fails, or a corrupt ``@latest`` falls back to
an older step on every rank alike. Without a process group the same runs in
one process.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from registry.crashpoints import crashpoint
from registry.distributed.collectives import Comm, Failure, Solo, as_timedelta, first_failure, settle, status
from registry.distributed.collectives import agree as agree_on
from registry.distributed.loader import _Source
from registry.distributed.parts import (Hosts, PartPublish, PartStart, install_part, part_read, small_files,
                                        staging_here, undo_part)
from registry.errors import (CheckpointReadError, CorruptCheckpointError, DistributedError, InvalidStateError,
                             NoCopyError, PublishError, RegistryError)
from registry.format.manifest import CONFIG, MANIFEST, META, Manifest, digest_bytes, parse_manifest
from registry.format.sharding import DCP_METADATA, layout_of
from registry.format.dcp_metadata import dcp_failure
from registry.fs.dcpfiles import checked_metadata, dcp_failures, load_flat, quiet, wanted, write_threads
from registry.fs.filemaps import json_object
from registry.fs.mapping import host_view, read_error
from registry.fs.store import now_timestamp
from registry.fs.payloadfiles import Payload, Written
from registry.fs.validation import check_flags, check_tags, checked_payload
from registry.format.refs import check_run_name, check_step
from registry.ops.reading import Access, CatalogRead, check_digest, report
from registry.pools import Pool
from registry.records import CheckpointInfo, Fallback
from registry.format.refs import Ref
from registry.format.layout import in_part
from registry.roots.shards import PartShards, Reading, Shards, StepParts

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


_CHECKS = Pool(1, "registry-sharded-check")


def comm_for(group: Any) -> Comm | Solo:
    """The group's collectives (no deadline yet, see :func:`set_timeout`), or a group of one without a process group."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return Solo()
    return Comm(timeout=None, group=group)


def set_timeout(comm: Comm | Solo, timeout: float | timedelta | None) -> None:
    """Give ``comm`` its per-collective deadline; a bad value raises here, inside the agreement's try."""
    deadline = as_timedelta(timeout)
    if isinstance(comm, Comm):
        comm.timeout = deadline


def agree(comm: Comm | Solo, request: tuple[Any, ...], local: BaseException | None) -> None:
    """Every rank's request and argument error; raise on every rank if any rank erred or asked differently."""
    agree_on(comm, request, local, differ="made different sharded calls",
             advice="every rank must pass the same ref or run and step, and the same options")


# --------------------------------------------------------------------------- publish


@dataclass(frozen=True, kw_only=True)
class _Wrote:
    """What one rank's ``dcp.save`` produced, or how it failed."""

    files: dict[str, Any] | None
    tensors: tuple[str, ...] = ()
    failure: Failure | None = None


def _install_part_here(comm: Comm | Solo, hosts: Hosts, start: PartStart, gathered: list[_Wrote], *,
                       verify: bool) -> None:
    """A rank of a publish from several hosts, once every rank wrote: rank 0's small files, and on another
    host's first rank its part installed; every rank's outcome to rank 0 before it commits."""
    small = comm.broadcast_object(None, "receiving the small files")
    if isinstance(small, Failure):  # rank 0 failed first (a rank's write, the tail): its outcome says so
        return
    mine: Failure | None = None
    if hosts.lead and hosts.here != hosts.ids[0]:
        _, mine = status(partial(install_part, hosts, start, small, [tuple(w.files or ()) for w in gathered],
                                 verify=verify), comm.rank)
        if mine is None:
            crashpoint("parts-after-install")
    comm.all_gather_object(mine, "installing each host's part")


def _save_rank(comm: Comm | Solo, shards: Shards, staging: str, state: Mapping[str, Any], *, where: str) -> _Wrote:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    # ranks on this host: torchrun says so; otherwise assume the whole group shares it (never oversubscribe)
    here = os.environ.get("LOCAL_WORLD_SIZE", "")
    writer = shards.writer(staging, threads=write_threads(int(here) if here.isdigit() else comm.world))
    try:
        with quiet():
            md = dcp.save(dict(state), storage_writer=writer, process_group=comm.group,
                          no_dist=isinstance(comm, Solo))
    except dcp_failures() as exc:  # every rank hears of it
        failed, cause = dcp_failure(exc)
        text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        return _Wrote(files=None, failure=Failure.of(PublishError(
            f"sharded write of {where} failed on rank {comm.rank if failed is None else failed}: "
            f"{type(cause).__name__}: {text}",
            path=Path(staging)), comm.rank))
    tensors = tuple(k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    return _Wrote(files=writer.written, tensors=tensors)


def publish_sharded(comm: Comm | Solo, *, run: str, step: int, state: Mapping[str, Any],
                    request: tuple[Any, ...], local_error: BaseException | None,
                    run_publish: Callable[[Callable[[Any], Written]], CheckpointInfo] | None,
                    payload: Payload | None, shards: Shards,
                    after: Callable[[CheckpointInfo], object] | None = None,
                    hosts: Hosts | None = None, parts: PartPublish | None = None,
                    verify: bool = True) -> CheckpointInfo:
    """One sharded publish, on every rank (see the module docstring); ``run_publish`` etc. matter on rank 0 only.

    ``run_publish(write)`` runs the publish sequence with ``write`` filling what the root's landing prepared
    (a staging directory, an attempt prefix), through ``shards``, this rank's root's;
    ``after(info)`` runs once every rank has been sent the committed outcome. ``hosts``: the ranks write to
    fast directories of several hosts, each host's files becoming its part (:mod:`registry.distributed.parts`;
    ``parts`` is rank 0's landing and record of them).
    """
    agree(comm, request, local_error)
    where = f"{run}@{step}"
    if comm.rank != 0:
        start = comm.broadcast_object(None, "waiting for the staging directory")
        if isinstance(start, Failure):
            raise start.error()
        staging = str(start) if hosts is None else str(staging_here(hosts, start))
        wrote = _save_rank(comm, shards, staging, state, where=where)
        if wrote.failure is None:
            crashpoint("sharded-rank-after-write")
        gathered = comm.all_gather_object(wrote, "gathering the files' digests")
        if hosts is not None:
            _install_part_here(comm, hosts, start, gathered, verify=verify)
        done = comm.broadcast_object(None, "receiving the outcome of the publish")
        if isinstance(done, Failure):
            if hosts is not None and hosts.lead and hosts.here != hosts.ids[0]:
                undo_part(hosts, start)
            raise done.error()
        return done

    assert run_publish is not None and payload is not None
    assert payload.meta_json is not None and payload.config_json is not None
    meta_raw, config_raw = payload.meta_json, payload.config_json
    started = False

    def write(staging: Any) -> Written:
        nonlocal started
        comm.broadcast_object(str(staging) if parts is None else parts.start(staging), "sending the staging directory")
        started = True
        wrote = _save_rank(comm, shards, str(staging), state, where=where)
        gathered: list[_Wrote] = comm.all_gather_object(wrote, "gathering the files' digests")
        if parts is None:
            return tail(staging, gathered, shards.tail)
        try:
            written = tail(staging, gathered, parts.tail)
            parts.record([tuple(w.files or ()) for w in gathered])
            small = small_files(Path(staging), written)
        except BaseException as exc:  # the other hosts wait for the small files: they hear the failure instead
            comm.broadcast_object(Failure.of(exc, 0), "sending the small files")
            raise
        comm.broadcast_object(small, "sending the small files")
        failure = first_failure(comm.all_gather_object(None, "installing each host's part"))
        if failure is not None:
            raise failure.error()
        return written

    def tail(staging: Any, gathered: list[_Wrote], put: Callable[..., Written]) -> Written:
        failure = first_failure([w.failure for w in gathered])
        if failure is not None:
            raise failure.error()
        crashpoint("sharded-after-gather")
        entries: dict[str, Any] = {}
        for w in gathered:
            assert w.files is not None
            for name, entry in w.files.items():
                if name in entries:
                    raise PublishError(f"two ranks wrote {name} for {where}", path=Path(staging))
                entries[name] = entry
        if DCP_METADATA not in entries:
            raise PublishError(f"the sharded write of {where} left no {DCP_METADATA}", path=Path(staging))
        return put(str(staging), entries=entries, layout=layout_of(entries, comm.world),
                   tensors=gathered[0].tensors, meta=payload.meta, meta_raw=meta_raw, config_raw=config_raw)

    outcome: CheckpointInfo | Failure
    error: BaseException | None = None
    try:
        outcome = run_publish(write)
    except DistributedError:
        raise  # a peer is gone: nobody is listening for the outcome
    except Exception as exc:  # noqa: BLE001 - every rank raises the same
        outcome, error = Failure.of(exc, 0), exc
    comm.broadcast_object(outcome, "sending the outcome of the publish" if started
                          else "sending the staging directory")
    if isinstance(outcome, Failure):
        if isinstance(error, RegistryError):
            raise error
        raise outcome.error() from error
    if after is not None:
        after(outcome)
    return outcome


# --------------------------------------------------------------------------- load


@dataclass(frozen=True, kw_only=True)
class ShardedLoad:
    """A sharded step loaded into the callers' templates (``state_dict`` is the template, now filled).

    ``missing_keys``: flat keys of the template (within ``keys``) that the step
    does not have; ``unexpected_keys``: flat keys of the step (within ``keys``)
    that the template does not have. ``meta``, ``config`` and ``info`` are rank 0's.
    """

    state_dict: Any
    step: int | None
    info: CheckpointInfo | None
    meta: dict[str, Any]
    config: dict[str, Any]
    epoch: int
    consumed_samples: int
    policy_version: int | None
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    fallback: Fallback | None = None


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """What rank 0 sends: the step, ``where`` its nearest copy is read (:meth:`Shards.locate`), and on a root
    whose steps have several copies (``several``, a root with tiers) its durable copy's ``where``, for ranks whose
    host holds no directory of it, and the hosts' ``parts`` of a step published from several hosts (each host's
    ranks read their host's share there). ``metadata``: the step's DCP ``.metadata``, its bytes checked against
    the manifest and unpickled once, here, by the restricted unpickler; the other ranks get the records it built,
    checked, from rank 0 of their own job."""

    info: CheckpointInfo
    where: Path
    several: bool
    durable: Path | None
    parts: StepParts | None
    from_part: bool  # ``where`` is rank 0's host's part: the other hosts hold their own parts, not the step
    manifest_raw: bytes
    metadata: Metadata
    meta: dict[str, Any]
    config: dict[str, Any]
    notes: tuple[str, ...]
    fallback: Fallback | None


@dataclass(kw_only=True)
class _Judge(_Source):
    """Rank 0's judge of a sharded load's failures: a plain load's (a bad fast copy of a step with a durable copy
    is condemned alone, and the step read from its durable copy), and for a round that reads the durable copy by
    ranged GETs (``durable_prefix``), bad bytes there are re-hashed from storage, then that copy is marked
    corrupt and the step judged as having no copy this host can read (``@latest`` goes on to an older step)."""

    durable_prefix: Path | None = None
    durable_reread: set[int] = field(default_factory=set)
    parts_bad: set[int] = field(default_factory=set)  # steps whose parts failed a read: read without them

    def judge(self, exc: BaseException) -> None:
        read, prefix = self.read, self.durable_prefix
        if (read is not None and read.info is not None and read.info.step not in self.parts_bad
                and isinstance(exc, (CorruptCheckpointError, CheckpointReadError)) and exc.path is not None
                and in_part(exc.path)):
            # a host's part is no copy of the step: its trouble is that host's, and no verdict on the step
            info = read.info
            self.parts_bad.add(info.step)
            read.release()
            read.notes.append(f"{info.run}@{info.step}: a host's part of it could not be read ({exc}); read "
                              "without the hosts' parts")
            return
        if prefix is None or read is None or read.info is None or not isinstance(exc, CorruptCheckpointError):
            return super().judge(exc)
        from registry.ops.tiercache import durable_read_failed
        info, access = read.info, read.access
        self.durable_prefix = None
        if info.step in self.durable_reread:  # it re-hashed intact once already: no verdict rests on this read
            read.release()
            raise CheckpointReadError(f"cannot read {info.run}@{info.step}: its durable copy read differently "
                                      f"twice ({exc}) though it re-hashes intact; nothing was marked",
                                      run=info.run, step=info.step, path=prefix)
        self.durable_reread.add(info.step)
        verdict = durable_read_failed(access.copies.tiered("a sharded load"), access.catalog, info,
                                      prefix.as_posix(), exc, holder=access.holder)
        if verdict is None:
            read.release()  # intact as stored: the same step is read once more
            return
        read.judge(verdict)


def _read_plan(judge: _Judge, shards: Shards) -> _Plan:
    """Rank 0: resolve and lease the next candidate, and read its manifest and ``.metadata``, both checked.

    On a root with tiers the step is read where this host holds it, else from its durable copy; a fast copy
    ``judge`` condemned (its bytes bad while a durable copy stands) is passed over for the durable copy."""
    read = judge.read
    assert read is not None
    while True:
        info = read.candidate()
        try:
            copies = read.access.copies
            far = None  # the durable copy's prefix, on a root with tiers
            parts, mine = None, None  # the hosts' parts, and rank 0's host's
            if copies.several:
                from registry.ops.tiercache import durable_located
                from registry.ops.tiers import step_parts
                there = durable_located(copies.tiered("a sharded load"), read.access.catalog, info)
                far = shards.locate(there) if there is not None else None
                if info.step not in judge.parts_bad:
                    parts = step_parts(read.access.catalog, info)
                    mine = shards.part(parts, info.manifest_sha256, durable=far) if parts is not None else None
            try:
                where = shards.locate(copies.located(info))  # this host's fast or cached copy, else the durable one
            except NoCopyError:
                if mine is None:
                    raise
                where = mine.where
            if far is not None and info.step in judge.fast_bad:
                where = far
            if mine is not None and where == far:
                where = mine.where  # the small files from this host's disk
            judge.durable_prefix = where if where == far else None
            manifest_raw = bytes(host_view(shards.read(where, MANIFEST)))
            manifest = parse_manifest(manifest_raw, path=where / MANIFEST)
            check_digest(info, digest_bytes(manifest_raw))
            if manifest.layout is None:
                raise InvalidStateError(f"{info.run}@{info.step} is not a sharded checkpoint; load it with "
                                        "Registry.load", run=info.run, step=info.step, path=info.path)
            # the sha256 check, then the one (restricted) unpickling: every rank is sent the records
            metadata = checked_metadata(where, manifest, bytes(host_view(shards.read(where, DCP_METADATA))))
            meta = json_object(shards.read(where, META), where / META) if META in manifest.files else {}
            config = (json_object(shards.read(where, CONFIG), where / CONFIG) if CONFIG in manifest.files
                      else {})
        except RegistryError as exc:
            judge.judge(exc)
            continue
        notes = tuple(read.notes)
        read.notes.clear()
        return _Plan(info=info, where=where, several=copies.several, durable=far, parts=parts,
                     from_part=mine is not None and where == mine.where, manifest_raw=manifest_raw,
                     metadata=metadata, meta=meta, config=config, notes=notes, fallback=read.record(info))


def load_sharded(comm: Comm | Solo, access: Access | None, ref: Ref | None, asked_for: str, state: Any, *,
                 shards: Shards, keys: Collection[str] | None,
                 strict: bool, verify: bool, trust_pickle: bool, fallback: bool,
                 local_error: BaseException | None = None) -> ShardedLoad:
    """Load ``ref`` into every rank's ``state`` in place (see the module docstring); ``access`` is rank 0's,
    ``shards`` this rank's root's."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    agree(comm, ("load", asked_for, tuple(sorted(keys)) if keys is not None else None, strict, verify,
                 trust_pickle, fallback), local_error)
    read = CatalogRead(access, ref, fallback=fallback) if comm.rank == 0 and access is not None and ref else None
    judge = _Judge(read=read) if read is not None else None  # a bad fast copy condemned alone, as a plain load's
    flat, mappings = flatten_state_dict(state)
    try:
        while True:
            plan: Any = None
            if judge is not None:
                try:
                    plan = _read_plan(judge, shards)
                except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                    plan = Failure.of(exc, 0)
            plan = comm.broadcast_object(plan, "sending the plan")
            if isinstance(plan, Failure):
                raise plan.error()
            for note in plan.notes:
                warnings.warn(note, RuntimeWarning, stacklevel=3)
            saved = {k for k in plan.metadata.state_dict_metadata if keys is None or wanted(k, keys)}
            asked = {k for k in flat if keys is None or wanted(k, keys)}
            found = _copy_read(comm, shards, plan, partial(_needed, plan.metadata, flat, asked & saved), verify=verify)
            if found is None:
                if settle(comm, judge, _no_copy(comm, plan), "agreeing on the copy to read"):
                    continue
                raise AssertionError("rank 0's judge ends or retries a load with no copy")  # pragma: no cover
            directory, here = found
            if judge is not None:  # a rank reading its host's part fetches the rest from the durable copy
                judge.durable_prefix = (plan.durable if directory == plan.durable or isinstance(here, PartShards)
                                        else None)
            manifest: Manifest = parse_manifest(plan.manifest_raw, path=directory / MANIFEST)

            share = here.share(manifest, comm.rank, comm.world) if verify else []
            # the check runs while DCP reads, unless a full unpickler would meet bytes not yet checked
            overlap = bool(share) and not trust_pickle

            # the pieces are checked up front only where a full unpickler reads them (``trust_pickle``, as every rank
            # was asked): otherwise there is nothing here that can fail, and nothing to agree on before DCP reads
            md, mine = status(partial(_check_plan, here, directory, manifest, plan.metadata,
                                       share if not overlap else []), comm.rank)
            if verify and trust_pickle and settle(comm, judge, mine, "agreeing on the checksums"):
                continue
            missing, unexpected = tuple(sorted(asked - saved)), tuple(sorted(saved - asked))

            mismatch = (missing, unexpected) if strict and (missing or unexpected) else None
            _, mine = status(partial(_load_checked, comm, here, plan.info, directory, md, flat, asked & saved,
                                      mismatch=mismatch, manifest=manifest, verify=verify, trust_pickle=trust_pickle,
                                      pending_check=share if overlap else None),
                              comm.rank)
            if settle(comm, judge, mine, "agreeing on the loaded state"):
                continue
            _write_back(state, flat, mappings, asked & saved)
            if comm.rank == 0:
                report(plan.fallback)
            info = plan.info
            return ShardedLoad(state_dict=state, step=info.step, info=info, meta=plan.meta, config=plan.config,
                               epoch=info.epoch, consumed_samples=info.consumed_samples,
                               policy_version=info.policy_version, missing_keys=missing,
                               unexpected_keys=unexpected, fallback=plan.fallback)
    finally:
        if read is not None:
            read.release()



def _copy_read(comm: Comm | Solo, shards: Shards, plan: _Plan, needed: Callable[[], dict[str, list[tuple[int, int]]]],
               *, verify: bool) -> tuple[Path, Reading] | None:
    """Where this rank reads ``plan``'s step, and how: the copy rank 0 located when every rank's host holds it
    there (one host, or a filesystem they share); else, for a step published from several hosts, each rank its
    host's part, with what it reads of other files (``needed()``: the ranges its plan names) sent by the hosts
    holding them when every rank's host holds its part and that is little (:func:`part_read`), else fetched from
    the durable copy; else the durable copy by ranged GETs; None when some rank can read no copy of what it
    needs. A root whose copy is the step's only one is read where it is."""
    if not plan.several:
        return plan.where, shards.at(plan.where)
    digest, far = plan.info.manifest_sha256, plan.durable
    # every rank reaches the durable copy: a rank whose host holds a part reads that instead
    common = not plan.from_part and plan.where != far and shards.holds(plan.where, digest)
    part = shards.part(plan.parts, digest, durable=far) if plan.parts is not None else None
    seen = comm.all_gather_object((common, part is not None), "finding the copy every rank reads")
    if all(c for c, _ in seen):
        return plan.where, shards.at(plan.where)
    if plan.parts is not None and all(p for _, p in seen):  # every rank's host holds its part
        try:
            wanted = needed()
        except Exception:  # noqa: BLE001 - dcp.load makes the same plan, and reports its failure on every rank
            wanted = {}
        manifest = parse_manifest(plan.manifest_raw, path=plan.where / MANIFEST)
        sent = part_read(comm, part, wanted, manifest, verify=verify)
        if sent is not None:
            return sent.where, sent
    if far is None:
        return None
    return (part.where, part) if part is not None else (far, shards.at(far))


def _needed(metadata: Metadata, flat: dict[str, Any], keys: set[str]) -> dict[str, list[tuple[int, int]]]:
    """The (offset, length) ranges of each data file this rank's plan reads to load ``keys`` of ``flat``: DCP's own
    local plan, made the way ``dcp.load`` makes it, before anything is read."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    planner = DefaultLoadPlanner(allow_partial_load=True)
    planner.set_up_planner({k: flat[k] for k in keys}, metadata, False)
    wanted: dict[str, list[tuple[int, int]]] = {}
    for item in planner.create_local_plan().items:
        info = metadata.storage_data[item.storage_index]
        wanted.setdefault(info.relative_path, []).append((info.offset, info.length))
    return wanted


def _no_copy(comm: Comm | Solo, plan: _Plan) -> Failure | None:
    """Rank 0's failure to judge when a rank's host holds no copy of the step and it is not durable yet."""
    if comm.rank != 0:
        return None
    info = plan.info
    where = (f"its hosts' parts ({len(plan.parts.files)}) do not hold on each rank's host what that rank reads"
             if plan.parts is not None else f"it is at {plan.where} on rank 0's host only")
    return Failure.of(NoCopyError(f"{info.run}@{info.step} has no copy every rank can read: {where}, and it has no "
                                  "verified durable copy yet", run=info.run, step=info.step, path=info.path), 0)


def _check_plan(shards: Reading, directory: Path, manifest: Manifest, metadata: Any,
                share: list[tuple[str, int]]) -> Any:
    """The step's ``.metadata`` (rank 0's, checked), and this rank's share of the pieces when they are checked up
    front."""
    if share:
        shards.check(directory, manifest, share)
    return metadata


def _load_checked(comm: Comm | Solo, shards: Reading, info: CheckpointInfo, directory: Path, md: Any,
                  flat: dict[str, Any], keys: set[str], *, mismatch: tuple[Sequence[str], Sequence[str]] | None,
                  manifest: Manifest, verify: bool, trust_pickle: bool,
                  pending_check: list[tuple[str, int]] | None) -> None:
    """DCP reads ``keys`` of ``flat`` from ``info``'s step while this rank's share of the pieces is checked beside it
    (``pending_check``); ``mismatch`` (missing, unexpected keys) refuses a strict load first."""
    if mismatch is not None:
        missing, unexpected = mismatch
        first = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
        raise InvalidStateError(
            f"{info.run}@{info.step} does not match the state to load into ({first}; "
            f"{len(missing)} missing, {len(unexpected)} unexpected keys); pass strict=False "
            "to load the keys both have", run=info.run, step=info.step)
    pending = _CHECKS.submit(shards.check, directory, manifest, pending_check) if pending_check is not None else None
    try:
        subset = {k: flat[k] for k in keys}
        reader = shards.reader(directory, md, manifest=manifest, verify=verify, trust_pickle=trust_pickle)
        _dcp_load(comm, directory, reader, subset)
        flat.update(subset)  # DCP puts non-tensor values into the dict it was given
    except BaseException:
        if pending is not None:
            pending.result()  # damaged bytes are the verdict, not what DCP made of them
        raise
    if pending is not None:
        pending.result()


def _dcp_load(comm: Comm | Solo, directory: Path, reader: Any, flat: dict[str, Any]) -> None:
    try:
        load_flat(flat, reader, process_group=comm.group, no_dist=isinstance(comm, Solo))
    except dcp_failures() as exc:
        _, cause = dcp_failure(exc)
        if isinstance(cause, RegistryError):
            raise cause from None
        if isinstance(cause, OSError):  # this rank could not read (EACCES, EIO, EMFILE): never evidence against it
            raise read_error(directory, cause) from None
        text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        if isinstance(cause, (ValueError, AssertionError)) and "ize" in text:  # a shape the template disagrees with
            raise InvalidStateError(f"cannot load {directory} into this state: {text}", path=directory) from None
        raise CorruptCheckpointError(f"cannot load the sharded checkpoint {directory}: {type(cause).__name__}: "
                                     f"{text}", path=directory) from None


def _write_back(state: Any, flat: dict[str, Any], mappings: Mapping[str, Any], loaded: set[str]) -> None:
    """Non-tensor values are replaced, not copied into: put them back into the caller's nested state."""
    from torch.distributed.checkpoint._traverse import get_element, set_element
    for key in loaded:
        value = flat[key]
        if not isinstance(value, torch.Tensor) and get_element(state, mappings[key]) is not value:
            set_element(state, mappings[key], value)


def sharded_job(run: str, step: int, state: object, *, rank: int, extra: object, config: object, meta: object,
                epoch: object, consumed_samples: object, policy_version: object, optimizer_step: object,
                tags: Any, overwrite: object, verify: object, max_shard_size: object, blocking: object,
                trust_pickle: object, sharded: object, **_: object) -> tuple[Payload | None, tuple[str, ...]]:
    """Check a sharded publish's arguments; on rank 0 also build what ``meta.json`` and ``config.json`` hold."""
    check_run_name(run)
    check_step(step)
    check_flags(overwrite=overwrite, verify=verify, blocking=blocking, trust_pickle=trust_pickle, sharded=sharded)
    where = f"{run}@{step}"
    if extra:
        raise InvalidStateError(f"a sharded publish of {where} takes no extra: put those values into the state")
    if max_shard_size is not None:
        raise InvalidStateError(f"a sharded publish of {where} takes no max_shard_size: every rank writes its shards")
    if not isinstance(state, Mapping) or not state or not all(isinstance(k, str) for k in state):
        raise InvalidStateError(f"the state of a sharded publish of {where} must be a non-empty mapping with "
                                "string keys, as get_state_dict gives it")
    if rank != 0:
        return None, ()
    payload = checked_payload(step=step, state_dict={}, extra=None, config=config, meta=meta, epoch=epoch,
                              consumed_samples=consumed_samples, optimizer_step=optimizer_step,
                              policy_version=policy_version, max_shard_size=None, trust_pickle=False,
                              timestamp=now_timestamp())
    return payload, check_tags(tags)


__all__ = ["ShardedLoad", "agree", "comm_for", "load_sharded", "publish_sharded", "set_timeout", "sharded_job"]
