"""Rank-consistent loading for ``torch.distributed`` jobs.

Protocol (every rank runs the same rounds, so nobody waits for a message
that will never come):

0. *agree*: every rank gathers every rank's request (ref or directory,
   options) and any local argument error. Different requests, or an error on
   any rank, make every rank raise.
1. *plan*: only rank 0 touches the catalog, through the same
   :class:`registry.ops.reading.CatalogRead` as a local load (resolve, reader
   lease, race-versus-corruption judgement, fall-back). It checks the
   manifest against the catalog's digest and maps the files the load needs;
   it broadcasts the plan (step, info, manifest digest, file names and
   sizes, how far it fell back). A corrupt ``@latest`` falls back to an older
   step here when the damage shows before any byte is sent.
2. *move the bytes*, by strategy:
   ``broadcast``: rank 0 sends the files' bytes in large flat uint8 buckets
   into per-tensor storages the others allocate (one collective per bucket,
   never per small tensor), hashing each bucket on a worker thread while it
   is on the wire (sha256: the wire is slower than the hash); ``shared-fs``: rank 0
   checks its mapped files against the manifest's xxh3 pieces on all cores
   (nothing to hide a hash behind), the others map the same files and check
   that they see the same manifest digest. Nothing but the plan crosses the
   network.
3. *integrity*: all ranks gather every rank's status
   (:func:`registry.distributed.collectives.settle`). Rank 0's checksum
   failure is judged as in a local load: a step overwritten or deleted
   meanwhile is resolved again, a corrupt ``latest`` is marked and everyone
   goes round again with an older step; any other failure is raised on
   every rank.
4. *parse*: each rank parses the same bytes with the same code
   (:mod:`registry.fs.filemaps`); statuses are gathered once more. A policy
   delta step parses to its ``delta.safetensors`` alone: rank 0 rebuilds it
   from its chain (judged like any read, so a damaged ``@latest-policy``
   falls back) and sends every rank the tensors.

On an ``s3://`` root rank 0 downloads the files (checked against their
pieces as they land, :func:`registry.fs.objectread.fetch_step`) in place of
mapping them, and the bytes always travel by ``broadcast``: no other rank has
anything to map, so ``shared-fs`` is refused and ``auto`` does not probe.

``strategy="auto"`` (the default) picks ``shared-fs`` when every rank can read
the directory at rank 0's path and sees the very same manifest (same sha256;
for a directory without a manifest: same names, sizes and mtimes), and
``broadcast`` otherwise. One small extra all-gather decides it.

Every collective waits at most ``timeout`` seconds (default: the process
group's own timeout); a dead or diverging peer ends in ``DistributedError``
on the others, never a hang.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from registry.distributed.collectives import Comm, Failure, active, agree, as_timedelta, settle, status, transfer
from registry.errors import CorruptCheckpointError, DistributedError, InvalidStateError, RegistryError
from registry.fs.filemaps import Extras, Loaded, MappedFiles, layout, map_directory, parse_files, read_directory
from registry.fs.mapping import check_file_digest, host_view, map_file
from registry.format.manifest import MANIFEST, digest_bytes
from registry.ops.reading import Access, CatalogRead, Read, report
from registry.ops.reading import load as load_local
from registry.records import CheckpointInfo, Fallback
from registry.format.refs import Ref

if TYPE_CHECKING:
    from registry.fs.objects import ObjectRoot

log = logging.getLogger(__name__)
STRATEGIES = ("auto", "broadcast", "shared-fs")
BUCKET_BYTES = 128 << 20


def target_device(map_location: Any) -> torch.device | None:
    """None for CPU (tensors stay views of their buffers), else the device to move them to."""
    if map_location is None:
        return None
    if not isinstance(map_location, (str, torch.device)):
        raise InvalidStateError(f"map_location must be 'cpu', 'cuda', 'cuda:N' or a torch.device, "
                                f"got {map_location!r}")
    try:
        device = torch.device(map_location)
    except RuntimeError:
        raise InvalidStateError(f"invalid map_location {map_location!r}") from None
    if device.type == "cpu":
        return None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidStateError(f"map_location {map_location!r} asks for CUDA, which this process does not have")
    return device


# --------------------------------------------------------------------------- plan (rank 0)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What rank 0 tells everyone before a byte of payload moves."""

    path: str
    files: tuple[tuple[str, int], ...]
    manifest_sha256: str | None
    fingerprint: str
    bucket_bytes: int
    step: int | None = None
    info: CheckpointInfo | None = None
    warnings: tuple[str, ...] = ()
    fallback: Fallback | None = None
    fetched: bool = False  # downloaded and checked as it landed: no other rank can map it, the bytes are sent


def fingerprint(directory: Path, names: list[str], manifest_raw: bytes | None) -> str:
    """The manifest's digest, or for a legacy directory a digest of names, sizes and mtimes."""
    if manifest_raw is not None:
        return digest_bytes(manifest_raw)
    listing = []
    for name in names:
        st = (directory / name).lstat()
        listing.append([name, st.st_size, st.st_mtime_ns])
    return "legacy:" + hashlib.sha256(json.dumps(listing).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Mapped:
    """A checkpoint directory mapped on rank 0, and the fingerprint the other ranks compare theirs with."""

    files: MappedFiles
    fingerprint: str


def map_checkpoint(directory: Path, *, expected_digest: str | None, extras: Extras = True) -> Mapped:
    """Map what ``read_directory`` would read, checking names, sizes and the catalog's digest."""
    files = map_directory(directory, extras=extras, expected_digest=expected_digest)
    raw = bytes(host_view(files.buffers[MANIFEST])) if MANIFEST in files.buffers else None
    return Mapped(files=files, fingerprint=fingerprint(directory, [n for n in files.buffers if n != MANIFEST], raw))


def fetch_checkpoint(objects: ObjectRoot, info: CheckpointInfo, *, verify: bool, extras: Extras = True) -> Mapped:
    """What ``map_checkpoint`` maps, downloaded from an object store (checked against its pieces as it lands)."""
    from registry.fs.objectread import fetch_step
    files = fetch_step(objects, info.path.as_posix(), verify=verify, extras=extras,
                       expected_digest=info.manifest_sha256)
    assert files.manifest_sha256 is not None, "a step in a bucket always has its manifest"
    return Mapped(files=files, fingerprint=files.manifest_sha256)


def integrity(mapped: Mapped, *, hashes: dict[str, str] | None) -> None:
    """Compare computed sha256s with the manifest's (only files a manifest lists can be checked)."""
    if mapped.files.manifest is None or hashes is None:
        return
    for name, digest in hashes.items():
        entry = mapped.files.manifest.files.get(name)
        if entry is not None and entry.sha256 != digest:
            raise CorruptCheckpointError(f"checkpoint file checksum mismatch: {mapped.files.directory / name}",
                                         path=mapped.files.directory / name)


def check_mapped(mapped: Mapped) -> None:
    """Check every mapped file against its manifest's fastest digest (xxh3 pieces on all cores)."""
    if mapped.files.manifest is None:  # a legacy directory has no checksums
        return
    for name, buf in mapped.files.buffers.items():
        entry = mapped.files.manifest.files.get(name)
        if entry is not None:
            check_file_digest(mapped.files.directory, entry, host_view(buf))


# --------------------------------------------------------------------------- sources (rank 0)


@dataclass(kw_only=True)
class _Source:
    """Where rank 0 finds candidates: a catalog read (which can fall back), or one directory."""

    read: CatalogRead | None = None
    directory: Path | None = None
    fast_bad: set[int] = field(default_factory=set)  # steps whose fast copy here failed: read their durable copy
    fast_reread: set[int] = field(default_factory=set)  # steps whose fast copy here was read again after a mismatch

    def next(self) -> tuple[Path, CheckpointInfo | None]:
        if self.read is None:
            assert self.directory is not None
            return self.directory, None
        info = self.read.candidate()
        return info.path, info

    def judge(self, exc: BaseException) -> None:
        """Return when another candidate should be tried; raise what the load ends with.

        On a root with tiers, a bad fast copy of a step with a durable copy is that copy's fault alone
        (:func:`registry.ops.tiers.mark_fast_copy`): the same step is tried again from its durable copy,
        before any older step.
        """
        if self.read is None:
            raise exc
        info = self.read.info
        where = exc.path if isinstance(exc, CorruptCheckpointError) else None
        copies = self.read.access.copies
        if (copies.several and info is not None and where is not None and info.manifest_sha256 is not None
                and (where == info.path or info.path in where.parents) and info.step not in self.fast_bad):
            if info.step not in self.fast_reread:  # read the stored bytes again before any verdict on them
                self.fast_reread.add(info.step)
                from registry.ops.scrub import recheck
                from registry.ops.verdicts import read_again
                home = self.read.access.home
                try:
                    read_again(exc, lambda: recheck(info, home=home),
                               what=f"{info.run}@{info.step}: this host's copy {info.path}")
                except CorruptCheckpointError:
                    pass  # the mismatch stands: this copy is condemned below
                except RegistryError:
                    self.read.judge(exc)  # the re-read itself failed: no verdict on the copy can rest on it
                    return
                else:
                    self.read.release()  # intact as stored: the same step is read once more
                    return
            if copies.condemn(info, info.manifest_sha256, str(exc)):
                self.fast_bad.add(info.step)
                self.read.release()
                self.read.notes.append(f"{info.run}@{info.step}: this host's fast copy is not the step's good "
                                       f"payload ({exc}); read from the durable copy of the same step")
                return
        self.read.judge(exc)

    @property
    def notes(self) -> list[str]:
        return self.read.notes if self.read is not None else []

    def fallback(self, info: CheckpointInfo | None) -> Fallback | None:
        return self.read.record(info) if self.read is not None and info is not None else None

    def release(self) -> None:
        if self.read is not None:
            self.read.release()


# --------------------------------------------------------------------------- the protocol


def collective_load(*, request: tuple[Any, ...], source: Callable[[], _Source], verify: bool,
                    map_location: Any, trust_pickle: bool, strategy: str,
                    timeout: float | timedelta | None, bucket_bytes: int | None,
                    extras: Extras = True, fetched: bool = False) -> tuple[Loaded, Plan]:
    comm = Comm(timeout=None)
    local: RegistryError | None = None
    device: torch.device | None = None
    try:
        comm.timeout = as_timedelta(timeout)
        if strategy not in STRATEGIES:
            raise InvalidStateError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if fetched and strategy == "shared-fs":
            raise InvalidStateError("strategy='shared-fs' needs a filesystem root every rank mounts; an s3:// "
                                    "root is read by rank 0 and broadcast: use strategy='broadcast' or 'auto'")
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                         or bucket_bytes <= 0):
            raise InvalidStateError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        device = target_device(map_location)
    except RegistryError as exc:
        local = exc
    agree(comm, request, local, differ="called load with different arguments",
          advice="every rank must load the same ref with the same options")
    limit = bucket_bytes or BUCKET_BYTES  # rank 0's value travels in the plan
    src = source() if comm.rank == 0 else None
    try:
        while True:
            loaded, plan = _one_round(comm, src, verify=verify, device=device, trust_pickle=trust_pickle,
                                      strategy=strategy, limit=limit, extras=extras)
            if loaded is not None and loaded.delta is not None:  # the same on every rank: a policy delta step
                loaded = _rebuilt(comm, src, loaded, plan, verify=verify, device=device)
            if loaded is not None:
                return loaded, plan
    finally:
        if src is not None:
            src.release()


def _one_round(comm: Comm, src: _Source | None, *, verify: bool, device: torch.device | None, trust_pickle: bool,
               strategy: str, limit: int, extras: Extras = True) -> tuple[Loaded | None, Plan]:
    mapped: Mapped | None = None
    if comm.rank == 0:
        assert src is not None
        outcome: Any
        while True:
            try:
                path, info = src.next()
                try:
                    home = src.read.access.home if src.read is not None else None
                    fetched = home is not None and not home.can.directories
                    if fetched and info is not None and home is not None:
                        objects = home.object_store()
                        assert objects is not None, "a root of no directories is an object store"
                        mapped = fetch_checkpoint(objects, info, verify=verify, extras=extras)
                    elif info is not None and src.read is not None:
                        def mapped_at(directory: Path, check: bool, info: CheckpointInfo = info
                                      ) -> tuple[Path, Mapped]:
                            got = map_checkpoint(directory, expected_digest=info.manifest_sha256, extras=extras)
                            if check:  # this host's cached download: a damaged one is fetched again
                                check_mapped(got)
                            return directory, got
                        path, mapped = src.read.access.copies.mapped(info, mapped_at, verify=verify,
                                                                     fast=info.step not in src.fast_bad)
                    else:  # one directory, no catalog row (Checkpoint.load(dir, broadcast=True))
                        mapped = map_checkpoint(path, expected_digest=None, extras=extras)
                except RegistryError as exc:
                    src.judge(exc)  # returns when another candidate should be tried
                    continue
                buffers = mapped.files.buffers
                outcome = Plan(path=str(path), files=tuple((n, b.numel()) for n, b in buffers.items()),
                               manifest_sha256=mapped.files.manifest_sha256, fingerprint=mapped.fingerprint,
                               bucket_bytes=limit, step=info.step if info else None, info=info,
                               warnings=tuple(src.notes), fallback=src.fallback(info),
                               fetched=fetched)
                break
            except Exception as exc:  # whatever it is, every rank must hear of it, not wait for a plan
                outcome = Failure.of(exc, 0)
                break
        src.notes.clear()
    else:
        outcome = None
    outcome = comm.broadcast_object(outcome, "sending the plan")
    if isinstance(outcome, Failure):
        raise outcome.error()
    plan: Plan = outcome
    for note in plan.warnings:
        warnings.warn(note, RuntimeWarning, stacklevel=4)
    names = [n for n, _ in plan.files]
    sizes = [s for _, s in plan.files]
    directory = Path(plan.path)

    chosen = "broadcast" if plan.fetched else strategy
    if chosen == "auto":
        def sees_same() -> bool:
            if comm.rank == 0:
                return True
            try:
                raw = (directory / MANIFEST).read_bytes() if plan.manifest_sha256 else None
                return fingerprint(directory, [n for n in names if n != MANIFEST], raw) == plan.fingerprint
            except OSError:
                return False
        chosen = "shared-fs" if all(comm.all_gather_object(sees_same(), "probing for a shared filesystem")) \
            else "broadcast"

    files: Mapping[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    if chosen == "shared-fs":
        if comm.rank == 0:
            assert mapped is not None
            files = mapped.files.buffers
            _, mine = status(lambda: check_mapped(mapped) if verify else None, 0)
        else:
            def open_same() -> dict[str, torch.Tensor]:
                got = {n: map_file(directory, n, expected_size=s) for n, s in plan.files}
                if MANIFEST in got:
                    seen = digest_bytes(bytes(host_view(got[MANIFEST])))
                else:
                    seen = fingerprint(directory, [n for n in names if n != MANIFEST], None)
                if seen != (plan.manifest_sha256 or plan.fingerprint):
                    raise DistributedError(f"rank {comm.rank} sees a different checkpoint at {directory}; "
                                           "the root is not shared: use strategy='broadcast'")
                return got
            try:
                files, mine = open_same(), None
            except DistributedError as exc:
                files, mine = {}, Failure.of(exc, comm.rank)
            except Exception as exc:  # not the checkpoint's fault: this rank does not share rank 0's files
                files, mine = {}, Failure.of(DistributedError(
                    f"rank {comm.rank} cannot read the checkpoint at {directory} ({exc}); the root is not "
                    "shared: use strategy='broadcast'"), comm.rank)
    else:
        sources = [mapped.files.buffers[n] for n in names] if mapped is not None else None
        cuts = [layout(n, b) for n, b in zip(names, sources)] if sources is not None else None
        layouts = comm.broadcast_object(cuts, "sending the files' layout")
        pieces, digests = transfer(comm, layouts, sources, limit=plan.bucket_bytes,
                                   hash_files=(verify and not plan.fetched and mapped is not None
                                               and mapped.files.manifest is not None))
        files = {n: got[0] if len(got) == 1 else tuple(got) for n, got in zip(names, pieces)}
        mine = None
        if comm.rank == 0:
            assert mapped is not None
            hashes = {n: d for n, d in zip(names, digests) if n != MANIFEST} if digests is not None else None
            _, mine = status(lambda: integrity(mapped, hashes=hashes), 0)
    if settle(comm, src, mine, "agreeing on integrity"):
        return None, plan

    loaded, mine = status(lambda: parse_files(directory, files, trust_pickle=trust_pickle,
                                               map_location=device if device is not None else "cpu"), comm.rank)
    if settle(comm, src, mine, "agreeing on the parsed checkpoint"):
        return None, plan
    assert loaded is not None
    log.debug("rank %d loaded %s (step %s) by %s: %d files, %d bytes", comm.rank, plan.path, plan.step, chosen,
              len(sizes), sum(sizes))
    return loaded, plan


def _rebuilt(comm: Comm, src: _Source | None, loaded: Loaded, plan: Plan, *, verify: bool,
             device: torch.device | None) -> Loaded | None:
    """A policy delta step (every rank holds its ``delta.safetensors``): rank 0, which holds the catalog read and
    its lease, rebuilds it from its chain (:func:`registry.ops.policy.rebuild`) and sends every rank the tensors.

    None when rank 0's rebuild failed and was judged (a corrupt ``@latest`` falls back): go round again.
    A directory read without the catalog has no chain: every rank refuses it alike.
    """
    state: dict[str, torch.Tensor] | None = None
    mine: Failure | None = None
    if comm.rank == 0:
        assert src is not None
        if src.read is None or plan.info is None:
            def refuse() -> None:
                raise InvalidStateError(f"{plan.path} is a policy delta step: its weights are rebuilt through the "
                                        "catalog (Registry.load), not from the directory alone")
            _, mine = status(refuse, 0)
        else:
            from registry.ops.policy import rebuild
            read, info = src.read, plan.info
            state, mine = status(lambda: rebuild(read.access, info, loaded, verify=verify,
                                                 map_location="cpu").state_dict, 0)
    if settle(comm, src, mine, "rebuilding a policy delta step"):
        return None
    spec = comm.broadcast_object([(n, t.dtype, tuple(t.shape)) for n, t in state.items()]
                                 if state is not None else None, "sending a rebuilt policy step's layout")
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in spec:
        numel = 1
        for d in shape:
            numel *= d
        if state is not None:
            buf = state[name].contiguous().reshape(-1).view(torch.uint8).to(comm.device)
        else:
            buf = torch.empty(numel * dtype.itemsize, dtype=torch.uint8, device=comm.device)
        if buf.numel():
            comm.broadcast(buf, "sending a rebuilt policy step")
        tensor = buf.view(dtype).reshape(shape)
        out[name] = tensor.to(device) if device is not None else tensor.cpu()
    return replace(loaded, state_dict=out, delta=None)


# --------------------------------------------------------------------------- entry points


def distributed_load(access: Access, ref: Ref, *, verify: bool, map_location: Any, trust_pickle: bool,
                     strategy: str = "auto", timeout: float | timedelta | None = None,
                     bucket_bytes: int | None = None, extras: Extras = True,
                     fallback: bool = True) -> Read:
    """``Registry.load(ref, broadcast=True)``: the same step and bit-identical contents on every rank.

    ``access`` is used on rank 0 only; a rank's ``fallback`` is rank 0's record.
    """
    if not active():
        return load_local(access, ref, verify=verify, map_location=map_location, trust_pickle=trust_pickle,
                          extras=extras, fallback=fallback)
    loaded, plan = collective_load(
        request=("ref", str(ref), verify, trust_pickle, strategy, bucket_bytes, extras, fallback),
        source=lambda: _Source(read=CatalogRead(access, ref, fallback=fallback)),
        verify=verify, map_location=map_location, trust_pickle=trust_pickle, strategy=strategy, timeout=timeout,
        bucket_bytes=bucket_bytes, extras=extras, fetched=not access.home.can.directories)
    if dist.get_rank() == 0:
        report(plan.fallback)
    assert plan.info is not None, "a plan for a ref names the step's row"
    return Read(loaded=loaded, info=plan.info, fallback=plan.fallback)


def broadcast_directory(path: Path, *, verify: bool, trust_pickle: bool, map_location: Any,
                        strategy: str = "auto", timeout: float | timedelta | None = None,
                        bucket_bytes: int | None = None, extras: Extras = True) -> Loaded:
    """``Checkpoint.load(dir, broadcast=True)``: rank 0 checks ``dir``; every rank gets its contents."""
    if not active():
        return read_directory(path, verify=verify, trust_pickle=trust_pickle, map_location=map_location,
                              extras=extras)
    loaded, _ = collective_load(
        request=("directory", str(path), verify, trust_pickle, strategy, bucket_bytes, extras),
        source=lambda: _Source(directory=path.absolute()), verify=verify, map_location=map_location,
        trust_pickle=trust_pickle, strategy=strategy, timeout=timeout, bucket_bytes=bucket_bytes,
        extras=extras)
    return loaded


__all__ = ["BUCKET_BYTES", "STRATEGIES", "Plan", "broadcast_directory", "collective_load",
           "distributed_load", "fetch_checkpoint", "map_checkpoint", "target_device"]
