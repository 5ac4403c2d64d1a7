"""``publish(..., sharded=True)``'s driver: every rank's checks, then the one collective publish, here or queued.

The facade hands the call to :func:`publish_sharded_call` with a
:class:`Publisher`: what the registry publishing from this process offers
every publish (its checks, its queue of background publishes, the one publish
sequence, retention after a commit). A sharded step is therefore claimed,
committed, recorded and retained exactly as a plain one; what is sharded is
only how the payload is written (:mod:`registry.distributed.sharded`) and how
the ranks agree on one outcome.

Every rank waits for (blocking) or checks (``blocking=False``) its own
background queue first, and a failure there goes through the agreement, so
every rank raises it alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from registry.errors import RegistryError
from registry.records import CheckpointInfo

if TYPE_CHECKING:
    from registry.distributed.collectives import Comm, Solo
    from registry.distributed.parts import Hosts, PartPublish
    from registry.distributed.sharded_async import PublishGroups
    from registry.fs.snapshot import Snapshotter
    from registry.format.refs import Ref
    from registry.fs.payloadfiles import Payload, Written
    from registry.retention import Policy
    from registry.roots.shards import Shards


class Job(Protocol):
    """A validated publish, as the publisher built it."""

    @property
    def payload(self) -> Payload: ...


J = TypeVar("J", bound=Job)


class Publisher(Protocol[J]):
    """What a registry offers every publish from this process (see the module's docstring)."""

    @property
    def groups(self) -> PublishGroups:
        """The gloo groups background sharded publishes run on (made once per process group)."""

    @property
    def snapshots(self) -> Snapshotter:
        """The arenas a background publish copies the state into."""

    @property
    def shards(self) -> Shards:
        """How this process's root writes a rank's DCP files and the tail (its root's ``shards()``)."""

    def check_retention(self, retention: object) -> None:
        """Refuse a ``retention=`` that is not a policy, before anything is written."""

    def settle_queue(self, *, wait: bool) -> None:
        """Wait for this process's background publishes (``wait``), then raise the first that failed."""

    def job(self, run: str, step: int, payload: Payload, tags: tuple[str, ...], *, overwrite: bool, verify: bool,
            metrics: Mapping[str, Any] | None, parent: str | Ref | None, dedup: bool) -> J:
        """The validated publish rank 0 runs (its metrics and lineage checked now)."""

    def reserve(self, run: str, step: int, job: J) -> Callable[[], None]:
        """Queue ``run@step`` for a background publish (refused if it is queued already or cannot be claimed);
        returns what takes it off the queue again."""

    def commit(self, job: J, write: Callable[[Any], Written], *, parts: PartPublish | None = None) -> CheckpointInfo:
        """The publish sequence for ``job`` with ``write`` filling what the root's landing prepared; the placed
        step. ``parts``: a publish from several hosts, landing as this host's part with its commit hooks
        (:meth:`parts`), which ``write`` fills."""

    def parts(self, job: J, hosts: Hosts) -> PartPublish:
        """Rank 0's part landing and commit hooks for ``job`` published from ``hosts``."""

    def replicate_parts(self, comm: Comm | Solo, hosts: Hosts, run: str,
                        after: Future[CheckpointInfo] | None = None) -> None:
        """Queue the background replication of ``run``'s parts (every rank, after a publish from several hosts;
        ``after``: a background publish the round waits for first)."""

    def retain(self, run: str, step: int, policy: Policy) -> object:
        """Retention after a commit (rank 0 only, once every rank has the outcome)."""

    def submit(self, name: str, fn: Callable[[], CheckpointInfo]) -> Future[CheckpointInfo]:
        """Queue ``fn`` on this process's background publisher."""


def publish_sharded_call(publisher: Publisher[J], run: str, step: int, state_dict: Any, *, group: Any,
                         timeout: float | None, parent: str | Ref | None, dedup: bool = False,
                         **options: Any) -> CheckpointInfo | Future[CheckpointInfo]:
    """``publish(..., sharded=True)`` on every rank: checks, then the collective publish, here or queued."""
    from registry.distributed.parts import find_hosts
    from registry.distributed.sharded import comm_for, publish_sharded, set_timeout, sharded_job
    from registry.distributed.sharded_async import publish_in_background, snapshot_sharded
    comm = comm_for(group)
    background = options["blocking"] is False
    job: J | None = None
    error: BaseException | None = None
    snap = None
    release: Callable[[], None] | None = None
    hosts = None
    try:
        set_timeout(comm, timeout)
        hosts = find_hosts(comm, publisher.shards)
        payload, tags = sharded_job(run, step, state_dict, rank=comm.rank, **options)
        publisher.check_retention(options["retention"])
        publisher.settle_queue(wait=not background)
        if payload is not None:
            job = publisher.job(run, step, payload, tags, overwrite=options["overwrite"], verify=options["verify"],
                                metrics=options["metrics"], parent=parent, dedup=dedup)
            if background:
                release = publisher.reserve(run, step, job)
        if background:
            snap = snapshot_sharded(publisher.snapshots, state_dict)
    except RegistryError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - a failed copy (out of memory): every rank hears of it
        error = exc
    request = ("publish", repr(run), repr(step), repr(options["overwrite"]), repr(options["verify"]),
               repr(options["blocking"]))
    publish = None
    parts = publisher.parts(job, hosts) if job is not None and hosts is not None and error is None else None
    if job is not None:  # rank 0's path goes to every rank, as the one outcome
        committing = job

        def publish(write: Callable[[Any], Written]) -> CheckpointInfo:
            return publisher.commit(committing, write, parts=parts)
    policy = options["retention"]
    # retention once every rank has the outcome (rank 0 only): no rank waits for a gc
    after = (lambda info: publisher.retain(run, step, policy)) if job and policy is not None else None
    if background:
        def finished() -> None:
            if release is not None:
                release()
        future = publish_in_background(comm, publisher.groups, run=run, step=step, request=request,
                                       local_error=error, snap=snap, run_publish=publish,
                                       payload=job.payload if job else None, shards=publisher.shards, after=after,
                                       submit=publisher.submit, finished=finished, hosts=hosts, parts=parts,
                                       verify=bool(options["verify"]))
        if hosts is not None:  # queued now (its group made here, on every rank), run once the publish ended
            publisher.replicate_parts(comm, hosts, run, after=future)
        return future
    info = publish_sharded(
        comm, run=run, step=step, state=state_dict if isinstance(state_dict, Mapping) else {},
        request=request, local_error=error, run_publish=publish, payload=job.payload if job else None,
        shards=publisher.shards, after=after, hosts=hosts, parts=parts, verify=bool(options["verify"]))
    if hosts is not None:
        publisher.replicate_parts(comm, hosts, run)
    return info


__all__ = ["Job", "Publisher", "publish_sharded_call"]
