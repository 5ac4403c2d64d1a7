"""A sharded publish from ranks on several hosts of a tiered root, each host writing to its own fast directory.

On a tiered root every rank writes to its host's fast directory. When the
ranks of one publish are on several hosts (their fast tiers' ids differ,
gathered once per publish by :func:`find_hosts`), no host can hold the step
whole, so none holds it at the step's path: each host's ranks write their
shards into a staging directory of their own host, rank 0 writes the tail
(``.metadata`` is its, with meta, config and the manifest, last) and sends
those small files to the other hosts, whose first rank writes them beside its
host's shards, checks that host's files as a publish checks its own, and
renames the staging directory to the host's *part*
(``<fast>/.registry/parts/RUN/step-N/a-<hex>``, the same path on every host)
before rank 0 commits. The commit records one ``part:<tier id>`` row per host
with the data files it holds (:class:`~registry.catalog.records.PartRecord`),
and no ``fast:`` copy: a part is never a copy of the step. A load on the
hosts that hold the parts reads each host's share from its part
(:func:`part_read`: the few ranges a rank reads of another host's files are
sent by that host, checked there and on arrival), with the durable copy
for the rest once there is one; a part that fails a read is read around,
never a verdict on the step; a load whose hosts lack a part before the step
is durable finds no copy (``NoCopyError``, which ``@latest`` passes over
and which never condemns the step). A failed publish is undone on every
host: rank 0's landing removes its part, the other hosts remove theirs when
they hear the failure.
A rank killed mid-way leaves at most parts no row names, which ``fsck`` of
that host removes once no live claim is publishing the step.

Replication (:class:`PartReplication`) runs on every rank in the background,
after each such publish, on a gloo group of its own (the trainer's collectives
and the background publishes' keep theirs): rank 0 lists the run's steps with
parts and no durable copy whose every part is on a host of this group, oldest
first; for each it claims the durable copy (the replication queue's own
compare-and-set, :meth:`~registry.catalog.replicas.ReplicaCatalog.claim_durable`),
every rank uploads its share of its host's files into that attempt prefix,
hashed while uploading and compared with the manifest, and rank 0 uploads the
small files, the manifest last, checks what the server stored and commits
the one durable copy. So the step becomes durable, once, when every host's
shards are up. A failure anywhere removes the prefix and ends the claim; the
next publish's round tries again. A job killed mid-way leaves a claim of a
dead writer, which ``fsck`` gives up (its objects removed) and the next round
takes over. A host lost before its part was uploaded makes the step never
durable: loads fall back to the newest step with a copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from registry.catalog.records import CommitRecord, PartRecord, PayloadRecord
from registry.distributed.collectives import Comm, Failure, Solo, first_failure, status
from registry.errors import CorruptCheckpointError, PublishError, RegistryError, StorageError
from registry.format.layout import attempt_relpath, part_relpath
from registry.format.manifest import CONFIG, MANIFEST, META, Manifest, digest_bytes, parse_manifest
from registry.format.sharding import DCP_METADATA
from registry.fs.store import FileProblem, check_written, discard, fsync_dir, install
from registry.pools import Pool
from registry.roots.directory import DirectoryLanding
from registry.roots.shards import PartShards, Shards

if TYPE_CHECKING:
    from registry.catalog import Catalog
    from registry.catalog.replicas import DurableClaim, Queued
    from registry.fs.objects import ObjectRoot
    from registry.fs.payloadfiles import Written
    from registry.ops.protocol import CommitHooks

log = logging.getLogger(__name__)

SMALL = (DCP_METADATA, META, CONFIG)  # rank 0's files every part holds, beside the manifest


@dataclass(frozen=True)
class Hosts:
    """Which host (fast tier id) each rank of the group writes to, and this rank's host's fast directory."""

    ids: tuple[str, ...]
    rank: int
    root: Path

    @property
    def here(self) -> str:
        return self.ids[self.rank]

    @property
    def lead(self) -> bool:
        """Whether this rank installs its host's part: the host's first rank."""
        return self.ids.index(self.here) == self.rank

    def ranks_on(self, host: str) -> list[int]:
        return [r for r, h in enumerate(self.ids) if h == host]

    def share(self, host: str, files: Sequence[str]) -> list[str]:
        """The files of ``host``'s part this rank uploads: every rank of that host takes its turn."""
        ranks = self.ranks_on(host)
        if self.rank not in ranks:
            return []
        return [f for i, f in enumerate(sorted(files)) if i % len(ranks) == ranks.index(self.rank)]


def find_hosts(comm: Comm | Solo, shards: Shards) -> Hosts | None:
    """The ranks' hosts when they are several (one collective, on a root whose ranks write to their own host);
    None when every rank writes to one place."""
    host = shards.host()
    if host is None:
        return None
    ids = tuple(comm.all_gather_object(host.id, "finding each rank's host"))
    return Hosts(ids, comm.rank, host.root) if len(set(ids)) > 1 else None


# --------------------------------------------------------------------------- publish


@dataclass(frozen=True)
class PartStart:
    """What rank 0 sends every rank: its staging directory and the part's path, both relative to a fast root."""

    staging: str
    part: str


@dataclass
class PartLanding(DirectoryLanding):
    """Rank 0's host's part as the publish sequence's landing: a directory root's (a staging sibling renamed to
    the part), checking only this host's files (``mine``, set once every rank wrote); the other hosts check
    theirs (:func:`install_part`)."""

    mine: set[str] = field(default_factory=set)

    def check(self, dest: Path, written: Written) -> list[FileProblem]:
        return check_written(dest, held(written, self.mine))


@dataclass
class PartHooks:
    """The commit hooks of a publish from several hosts: the inner hooks' record, with every host's part."""

    inner: CommitHooks
    parts: list[PartRecord] = field(default_factory=list)

    def record(self, payload: PayloadRecord) -> CommitRecord:
        return replace(self.inner.record(payload), parts=tuple(self.parts))

    def failed(self) -> None:
        self.inner.failed()

    def done(self) -> None:
        self.inner.done()


@dataclass(frozen=True)
class PartPublish:
    """Rank 0's publish from several hosts: the part's path, its landing and hooks (filled as the ranks write)."""

    hosts: Hosts
    relpath: str
    landing: PartLanding
    hooks: PartHooks

    @classmethod
    def of(cls, hosts: Hosts, run: str, step: int, inner: CommitHooks) -> PartPublish:
        rel = part_relpath(run, step)
        return cls(hosts=hosts, relpath=rel, landing=PartLanding(hosts.root / rel, shares_inodes=False),
                   hooks=PartHooks(inner))

    def tail(self, where: str, **tail: Any) -> Written:
        """The tail as a directory's, without a directory's check that every rank's files are here: each host
        checks its own part (:meth:`PartLanding.check`, :func:`install_part`)."""
        from registry.fs.dcpfiles import write_sharded_tail
        return write_sharded_tail(Path(where), **tail)

    def start(self, staging: Path) -> PartStart:
        return PartStart(staging=staging.relative_to(self.hosts.root).as_posix(), part=self.relpath)

    def record(self, files: Sequence[Sequence[str]]) -> None:
        """``files``: each rank's data files as it wrote them; rank 0's host's are checked by the landing."""
        from registry.catalog.replicas import part_location
        hosts = self.hosts
        by_host: dict[str, list[str]] = {}
        for rank, host in enumerate(hosts.ids):
            by_host.setdefault(host, []).extend(f for f in files[rank] if f != DCP_METADATA)
        self.landing.mine.update(by_host[hosts.here])
        self.hooks.parts[:] = [PartRecord(location=part_location(h), path=self.relpath, files=tuple(sorted(fs)))
                               for h, fs in by_host.items()]


def held(written: Written, names: set[str]) -> Written:
    """``written`` as far as one host's part holds it: its data files and the small files."""
    from registry.fs.dcpfiles import part_of
    return replace(written, manifest=part_of(written.manifest, names))


def staging_here(hosts: Hosts, start: PartStart) -> Path:
    """This rank's staging directory: rank 0's path under this host's fast root (made by whichever rank of the
    host comes first)."""
    staging = hosts.root / start.staging
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def small_files(staging: Path, written: Written) -> dict[str, bytes]:
    """Rank 0's small files, sent to every other host's part (the manifest's bytes as written)."""
    found = {name: (staging / name).read_bytes() for name in SMALL if (staging / name).is_file()}
    found[MANIFEST] = raw = (staging / MANIFEST).read_bytes()
    if digest_bytes(raw) != written.manifest_sha256:
        raise PublishError(f"the manifest in {staging} changed after it was written", path=staging / MANIFEST)
    return found


def install_part(hosts: Hosts, start: PartStart, small: Mapping[str, bytes], files: Sequence[Sequence[str]],
                 *, verify: bool) -> None:
    """On another host's first rank: write the small files beside the host's shards (the manifest last),
    fsync, check this host's files against the manifest, and rename the staging directory to the part."""
    from registry.fs.dcpfiles import write_small
    staging, final = hosts.root / start.staging, hosts.root / start.part
    manifest = parse_manifest(small[MANIFEST], path=staging / MANIFEST)
    for name, raw in small.items():
        if name != MANIFEST and write_small(staging / name, raw).sha256 != manifest.files[name].sha256:
            raise PublishError(f"{name} as received on host {hosts.here} differs from the manifest",
                               path=staging / name)
    write_small(staging / MANIFEST, small[MANIFEST])
    fsync_dir(staging)
    mine = {f for rank in hosts.ranks_on(hosts.here) for f in files[rank]}
    if verify:
        from registry.fs.payloadfiles import Written
        written = Written(manifest=manifest, manifest_sha256=digest_bytes(small[MANIFEST]),
                          total_bytes=manifest.total_bytes)
        problems = check_written(staging, held(written, mine))
        if problems:
            raise PublishError(f"read-back of the part {staging} on host {hosts.here} failed: {problems[0].name}: "
                               f"{problems[0].problem}", path=staging)
    install(staging, final)


def undo_part(hosts: Hosts, start: PartStart) -> None:
    """On another host's first rank, after the publish failed: its staging directory or part goes."""
    discard(hosts.root / start.staging)
    discard(hosts.root / start.part)


# --------------------------------------------------------------------------- load

PEER_BYTES = 256 << 20  # the most a load moves between the hosts' parts: replicated values, never a reshard


def part_read(comm: Comm | Solo, part: PartShards | None, wanted: Mapping[str, list[tuple[int, int]]],
              manifest: Manifest, *, verify: bool) -> PartShards | None:
    """Every rank, for a step published from several hosts: this rank's host's part, with the byte ranges it reads
    of files its host does not hold (DCP writes each replicated value, a step counter or an optimizer's scalars,
    on one rank only) sent by a rank of a host that holds them. That rank checks the manifest pieces the ranges lie
    in, as it would check its own, and sends each range with its digest; the reader checks the digest as the
    range lands (the wire's own check). None on every rank alike when some rank's host holds no part, a file no
    host holds is wanted, or more than ``PEER_BYTES`` would cross (a load at another world size: the durable
    copy's)."""
    lacks = part.lacks(wanted) if part is not None else {}
    seen = comm.all_gather_object((None if part is None else sorted(part.files), lacks),
                                  "finding what each host's part holds")
    holder: dict[str, int] = {}
    for rank, (files, _) in enumerate(seen):
        if files is None:
            return None
        for name in files:
            holder.setdefault(name, rank)
    asked: dict[tuple[str, int, int], int] = {}
    for _, lack in seen:
        for name, ranges in lack.items():
            if name not in holder or name not in manifest.files:
                return None
            for offset, length in ranges:
                asked[(name, offset, length)] = holder[name]
    if sum(length for _, _, length in asked) > PEER_BYTES or part is None:
        return None
    mine = sorted(k for k, r in asked.items() if r == comm.rank)
    sent = comm.all_gather_object(_send_ranges(part.where, manifest, mine, verify=verify),
                                  "sending the ranges each host's part holds")
    received: dict[str, dict[tuple[int, int], tuple[bytes, str] | None]] = {}  # a Received
    for ranges in sent:
        for (name, offset, length), data in ranges.items():
            if name in lacks:
                received.setdefault(name, {})[(offset, length)] = data
    return replace(part, received=received)


def _send_ranges(where: Path, manifest: Manifest, keys: Sequence[tuple[str, int, int]], *,
                 verify: bool) -> dict[tuple[str, int, int], tuple[bytes, str] | None]:
    """Byte ranges of this host's part's files, each piece they lie in checked against the manifest first (with
    ``verify``), with each range's digest; None for a range that could not be read or whose piece differs (the
    receiver raises it as the part's trouble)."""
    import xxhash

    from registry.fs.dcpfiles import check_piece
    from registry.fs.dcpobjects import piece_ranges
    from registry.fs.mapping import host_view, map_file
    out: dict[tuple[str, int, int], tuple[bytes, str] | None] = {}
    views: dict[str, memoryview | None] = {}
    checked: set[tuple[str, int]] = set()
    for name, offset, length in keys:
        entry = manifest.files[name]
        if name not in views:
            try:
                views[name] = host_view(map_file(where, name, expected_size=entry.size))
            except (RegistryError, OSError, ValueError):  # whatever it is, every rank must reach the gather
                views[name] = None
        view = views[name]
        try:
            if view is None:
                raise CorruptCheckpointError(f"{where / name} cannot be read", path=where / name)
            for start, end, piece in piece_ranges(entry, [(offset, length)], verify=verify):
                if verify and (name, start) not in checked:
                    check_piece(where / name, entry, piece or 0, view[start:end])
                    checked.add((name, start))
        except CorruptCheckpointError:
            out[(name, offset, length)] = None
            continue
        data = bytes(view[offset:offset + length])
        out[(name, offset, length)] = (data, xxhash.xxh3_128_hexdigest(data))
    return out


# --------------------------------------------------------------------------- replication


@dataclass(frozen=True)
class PartStep:
    """A step rank 0 found with parts and no durable copy: every host's files, at one part path."""

    item: Queued
    path: str
    files: Mapping[str, tuple[str, ...]]  # host (tier id) -> its part's data files


@dataclass(frozen=True)
class Coordinator:
    """What rank 0 replicates with: the catalog and its writer."""

    catalog: Catalog
    writer: Callable[[], str]


_ROUNDS = Pool(1, "registry-part-replication")


class Groups(Protocol):
    """The gloo groups background work runs its collectives on (``registry.distributed.sharded_async``)."""

    def comm(self, comm: Comm | Solo) -> Comm | Solo: ...


class PartReplication:
    """A registry's replication of its parts (see the module's docstring): one round after each publish from
    several hosts, queued on one thread per process, so every rank runs the rounds in the same order."""

    def __init__(self, groups: Groups) -> None:
        self.groups = groups
        self._pending: list[Future[int]] = []

    def after_publish(self, comm: Comm | Solo, hosts: Hosts, *, run: str, objects: ObjectRoot,
                      coordinator: Coordinator | None, after: Future[Any] | None = None) -> None:
        """Queue a round for ``run`` on every rank (in the caller's thread: the group is made there first); with
        ``after`` (a publish in the background), the round starts once that publish ended, however it did."""
        group = self.groups.comm(comm)
        background = Comm(timeout=None, group=group.group) if isinstance(group, Comm) else group

        def round_after() -> int:
            if after is not None:
                after.exception()  # its own failure is the publish's caller's to hear
            return replicate_round(background, hosts, run=run, objects=objects, coordinator=coordinator)
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(_ROUNDS.submit(round_after))

    def wait(self) -> None:
        """Until every queued round ended (a round logs its own failures)."""
        for f in self._pending:
            f.exception()
        self._pending.clear()


def unreplicated(catalog: Catalog, run: str, hosts: Hosts) -> list[PartStep]:
    """Rank 0: ``run``'s verified steps with no durable copy whose payload has a part on every host that wrote it,
    each of those hosts a host of this group and none of those parts found damaged, oldest first."""
    from registry.catalog.replicas import PART, ReplicaCatalog
    replicas = ReplicaCatalog(catalog)
    parts: dict[tuple[int, str], dict[str, tuple[str, ...]]] = {}
    paths: dict[tuple[int, str], str] = {}
    damaged: set[tuple[int, str]] = set()  # a part found damaged (verify): the step cannot be made durable whole
    for r in replicas.replicas(run):
        if r.location.startswith(PART) and r.files is not None and r.manifest_sha256:
            key = (r.step, r.manifest_sha256)
            if r.status == "corrupt":
                damaged.add(key)
            if r.status == "verified":
                parts.setdefault(key, {})[r.location[len(PART):]] = r.files
                paths[key] = r.path
    found = []
    for item in replicas.queue(run=run):
        key = (item.step, item.manifest_sha256)
        if key in parts and key not in damaged and set(parts[key]) <= set(hosts.ids):
            found.append(PartStep(item=item, path=paths[key], files=parts[key]))
    return found


def replicate_round(comm: Comm | Solo, hosts: Hosts, *, run: str, objects: ObjectRoot,
                    coordinator: Coordinator | None) -> int:
    """Every rank: replicate ``run``'s steps that have parts and no durable copy; how many became durable.
    ``coordinator`` is rank 0's."""
    try:
        plan: list[PartStep] | Failure | None = None
        if coordinator is not None:
            got, failure = status(lambda: unreplicated(coordinator.catalog, run, hosts), 0)
            plan = failure if failure is not None else got
        plan = comm.broadcast_object(plan, "sending the steps to replicate")
        if isinstance(plan, Failure):
            raise plan.error()
        done = 0
        for step in plan:
            done += _replicate_step(comm, hosts, step, objects=objects, coordinator=coordinator)
        return done
    except RegistryError as exc:  # a lost peer: the next round (or fsck, for a dead claim) finishes the job
        log.warning("replication of %s's parts stopped on rank %d: %s", run, hosts.rank, exc)
        return 0


def _replicate_step(comm: Comm | Solo, hosts: Hosts, step: PartStep, *, objects: ObjectRoot,
                    coordinator: Coordinator | None) -> int:
    from registry.ops.protocol import beating
    item = step.item
    claim: DurableClaim | Failure | None = None
    if coordinator is not None:
        got, failure = status(lambda: _claim(coordinator, item), 0)
        claim = failure if failure is not None else got
    claim = comm.broadcast_object(claim, "sending the durable claim")
    if isinstance(claim, Failure) and coordinator is not None:
        log.warning("%s@%s was not replicated from its parts: %s; the next publish from these hosts tries again",
                    item.run, item.step, claim.message)
    if claim is None or isinstance(claim, Failure):
        return 0
    where = hosts.root / step.path
    mine = hosts.share(hosts.here, step.files.get(hosts.here, ()))

    def upload() -> None:
        raw = (where / MANIFEST).read_bytes()
        if digest_bytes(raw) != item.manifest_sha256:
            raise PublishError(f"the part {where} holds another payload of {item.run}@{item.step}", path=where)
        from registry.fs.objectwrite import upload_files
        manifest = parse_manifest(raw, path=where / MANIFEST)
        _, problems = upload_files(objects, claim.path, where, manifest, mine)  # DCP files: no safetensors heads
        if problems:
            raise PublishError(f"{item.run}@{item.step}'s part on host {hosts.here} differs from its manifest: "
                               f"{problems[0].name}: {problems[0].problem}", path=where / problems[0].name)

    if coordinator is None:
        _, failure = status(upload, comm.rank)
        comm.all_gather_object(failure, "uploading each host's part")
        return int(comm.broadcast_object(None, "sending the durable copy's outcome"))
    writer = coordinator.writer()
    from registry.catalog.replicas import ReplicaCatalog
    replicas = ReplicaCatalog(coordinator.catalog)
    try:
        with beating(lambda: replicas.touch_durable(claim, writer=writer)):
            _, failure = status(upload, comm.rank)
            failure = first_failure(comm.all_gather_object(failure, "uploading each host's part"))
            if failure is not None:
                raise failure.error()
            _finish_upload(objects, claim, where, step)
    except Exception as exc:  # noqa: BLE001 - whatever failed, the claim ends and its objects go
        log.warning("%s@%s was not replicated from its parts: %s; the next publish from these hosts tries again",
                    item.run, item.step, exc)
        _remove(objects, claim.path)
        replicas.drop_claim(claim, writer=writer)
        comm.broadcast_object(False, "sending the durable copy's outcome")
        return 0
    try:
        ok = replicas.finish_durable(claim, writer=writer)
    except Exception as exc:  # noqa: BLE001 - the commit may have landed: the row decides, not this error
        log.warning("%s@%s: the commit of its durable copy at %s failed (%s); the upload is whole and stays, for "
                    "fsck to record or give up once this process is gone", item.run, item.step,
                    objects.url(claim.path), exc)
        ok = False
    else:
        if not ok:  # the step ended (or the claim was taken over) meanwhile: nothing of it stays durable here
            _remove(objects, claim.path)
        else:
            if claim.stale is not None:
                _remove(objects, claim.stale)
            log.info("%s@%s is durable at %s (from %d hosts' parts)", item.run, item.step, objects.url(claim.path),
                     len(step.files))
    comm.broadcast_object(ok, "sending the durable copy's outcome")
    return int(ok)


def _claim(coordinator: Coordinator, item: Queued) -> DurableClaim | None:
    from registry.catalog.replicas import ReplicaCatalog
    from registry.ops.writers import writer_alive
    replicas = ReplicaCatalog(coordinator.catalog)
    return replicas.claim_durable(item, path=attempt_relpath(item.run, item.step), writer=coordinator.writer(),
                                  writer_alive=writer_alive)


def _finish_upload(objects: ObjectRoot, claim: DurableClaim, where: Path, step: PartStep) -> None:
    """Rank 0, once every host's files are up: the small files, the manifest last, then what the server stored."""
    from registry.fs.objectwrite import check_uploaded, upload_directory
    from registry.fs.payloadfiles import Written
    raw = (where / MANIFEST).read_bytes()
    manifest = parse_manifest(raw, path=where / MANIFEST)
    data = {f for files in step.files.values() for f in files}
    small = replace(manifest, files={n: e for n, e in manifest.files.items() if n not in data})
    _, problems = upload_directory(objects, claim.path, where, small, raw)
    if problems:
        raise PublishError(f"{claim.run}@{claim.step}'s part at {where} differs from its manifest: "
                           f"{problems[0].name}: {problems[0].problem}", path=where / problems[0].name)
    written = Written(manifest=manifest, manifest_sha256=digest_bytes(raw), total_bytes=manifest.total_bytes)
    problems = check_uploaded(objects, claim.path, written)
    if problems:
        raise StorageError(f"the durable tier stored {claim.run}@{claim.step} differently from what was uploaded "
                           f"({problems[0].name}: {problems[0].problem})", url=objects.url(claim.path))


def _remove(objects: ObjectRoot, prefix: str) -> None:
    from registry.fs.prefixes import remove_prefix
    try:
        remove_prefix(objects, prefix)
    except (StorageError, OSError) as exc:
        log.warning("could not delete the objects under %s: %s; 'registry fsck --repair' removes them",
                    objects.url(prefix), exc)


__all__ = ["PEER_BYTES", "Coordinator", "Groups", "Hosts", "PartLanding", "PartPublish", "PartReplication",
           "PartStart", "find_hosts", "install_part", "part_read", "replicate_round", "small_files", "staging_here",
           "undo_part", "unreplicated"]
