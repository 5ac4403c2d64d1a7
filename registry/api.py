"""``Registry``: the public API, composing the catalog, the store and the loader.

A publish validates the call here, then runs the four phases of the publish
protocol (claim, write, install, commit; :mod:`registry.ops.protocol`) on the
caller's thread, or on the background publisher's for
``publish(..., blocking=False)`` (see ``registry.ops.background``), after the
state has been copied (``registry.fs.snapshot``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict, TypeVar, overload

from registry.ops.background import BackgroundPublisher
from registry.catalog import Catalog, CommitRecord, PayloadRecord
from registry.catalog.lineage import LineageCatalog, LineageHop
from registry.catalog.records import LineageRecord
from registry.errors import CheckpointNotFoundError, InvalidStateError, ReadOnlyError, RegistryError, StepExistsError
from registry.format.layout import step_dirname
from registry.ops.attempts import Attempts, Fork
from registry.records import HAS_PAYLOAD, CheckpointInfo, EventInfo, MetricPoint, RunInfo
from registry.records import AttemptInfo, FoundRun, TagInfo
from registry.format.refs import Ref, check_metric_key, check_run_name, check_step, check_tag_name, parse_ref
from registry.fs.bounds import as_directory, check_outside_root
from registry.fs.store import Store, now_timestamp
from registry.roots.base import Root
from registry.roots.open import locate, locations
from registry.ops.writers import close_writer, open_writer, writer_alive, writer_id
from registry.fs.validation import (check_count, check_flags, check_full_every, check_keep_days, check_lease_ttl,
                                     check_metrics, check_tags, check_timeout, checked_payload)

if TYPE_CHECKING:  # and what only some methods use, imported there: a CLI listing never loads or publishes
    from typing_extensions import Unpack  # typing's from Python 3.11; only the type checker reads it here
    from registry.fs.payloadfiles import Payload, Written
    from registry.fs.snapshot import Snapshotter
    from registry.checkpoint import Checkpoint
    from registry.ops import reading
    from registry.ops.protocol import CommitHooks, Target
    from registry.ops.scrub import VerifyResult
    import torch

    from registry.catalog.replicas import Queued, ReplicaInfo
    from registry.fs.objects import ObjectRoot
    from registry.ops.replicator import Replicator
    from registry.ops.tierretention import TierPlan
    from registry.ops.copies import Copies
    from registry.ops.tiers import Tiers
    from registry.catalog.outbox import OutboxEntry, WebhookInfo
    from registry.ops.webhooks import BackgroundDelivery, DeliveryReport, WebhookOptions
    from registry.ops.sysmetrics import SystemSampler
    from registry.ops.consumers import ConsumerHub, Subscription
    from registry.records import LoadInfo, PolicyLag, PolicyVersionInfo

    from registry.distributed.sharded import ShardedLoad
    from registry.distributed.collectives import Comm, Solo
    from registry.distributed.parts import Hosts, PartPublish, PartReplication
    from registry.distributed.sharded_async import PublishGroups
    from registry.roots.shards import Shards
    from registry.ops.diff import CheckpointDiff
    from registry.ops.export import Checkout, Exported
    from registry.ops.fsck import FsckReport
    from registry.progress import ProgressFn
    from registry.ops.retention import RetentionPlan, RetentionResult
    from registry.retention import Policy
    from registry.ops.folds import AnchorInfo, FoldInfo
    from registry.ops.policy import PolicyCache, PolicyPlan
    from registry.catalog.policy import MarkerInfo

log = logging.getLogger(__name__)


class _Anchors(Protocol):
    @property
    def anchorable(self) -> tuple[int, ...]: ...


P = TypeVar("P", bound=_Anchors)  # a retention plan (plain, or a tier's)

MAX_NOTE = 4096  # characters of a tag's note


def _done(info: CheckpointInfo) -> Future[CheckpointInfo]:
    """A future that already holds ``info`` (a background publish that had nothing to do)."""
    future: Future[CheckpointInfo] = Future()
    future.set_result(info)
    return future


def _bound_catalog(url: str, root: Root, *, migrate: bool, create: bool, read_only: bool,
                   rebind: bool) -> Catalog:
    """The catalog at ``url``, checked (or bound) to ``root`` (see :mod:`registry.ops.binding`); closed if refused."""
    from registry.ops.binding import check_binding
    from registry.catalog.readonly import ReadOnlyCatalog
    from registry.catalog.session import open_engine

    catalog: Catalog | None = None
    try:
        catalog = (ReadOnlyCatalog.open(url) if read_only
                   else Catalog(open_engine(url, migrate=migrate, create=create)))
        check_binding(catalog, root, bind=create and not read_only, rebind=rebind and not read_only)
    except BaseException:
        if catalog is not None:
            catalog.close()
        raise
    return catalog


class PublishOptions(TypedDict, total=False):
    """The keyword options of :meth:`Registry.publish` besides ``blocking``, typed once: its overloads differ only
    in what ``blocking`` makes it return (``tests/test_publish_signature.py`` keeps this the implementation's)."""

    extra: Mapping[str, Any] | None
    config: Mapping[str, Any] | None
    meta: Mapping[str, Any] | None
    metrics: Mapping[str, Any] | None
    epoch: int
    consumed_samples: int
    policy_version: int | None
    optimizer_step: int | None
    tags: Iterable[str]
    overwrite: bool
    verify: bool
    max_shard_size: int | None
    retention: Policy | None
    trust_pickle: bool
    parent: str | Ref | None
    sharded: bool
    group: Any
    timeout: float | None
    dedup: bool | None
    durable: bool
    delta: bool | Literal["auto"] | None


@dataclass(frozen=True, kw_only=True)
class _PublishJob:
    """A validated publish: everything the publish sequence needs (``payload.meta`` holds the numbers)."""

    run: str
    step: int
    overwrite: bool
    payload: Payload
    verify: bool
    new_metrics: tuple[tuple[int, str, float], ...]
    tags: tuple[str, ...]
    retention: Policy | None = None
    lineage: LineageRecord | None = None  # an explicit ``parent=``
    dedup: bool = False
    policy: PolicyPlan | None = None  # a policy channel publish: how it stores its version (registry.ops.policy)


@dataclass(frozen=True)
class _Publishing:
    """A registry as :class:`registry.distributed.driver.Publisher`: what every publish from it goes through."""

    reg: Registry

    @property
    def groups(self) -> PublishGroups:
        if self.reg._publish_groups is None:
            from registry.distributed.sharded_async import PublishGroups
            self.reg._publish_groups = PublishGroups()
        return self.reg._publish_groups

    @property
    def snapshots(self) -> Snapshotter:
        return self.reg._snapshots

    @property
    def shards(self) -> Shards:
        return self.reg.root.shards()

    def check_retention(self, retention: object) -> None:
        self.reg._check_retention(retention)

    def settle_queue(self, *, wait: bool) -> None:
        if wait:
            self.reg._background.wait()
        self.reg._background.raise_error()

    def job(self, run: str, step: int, payload: Payload, tags: tuple[str, ...], *, overwrite: bool, verify: bool,
            metrics: Mapping[str, Any] | None, parent: str | Ref | None, dedup: bool) -> _PublishJob:
        lineage = self.reg._parent_lineage(parent)
        return _PublishJob(run=run, step=step, overwrite=overwrite, payload=payload, verify=verify,
                           new_metrics=tuple(check_metrics(run, step, metrics)), tags=tags, lineage=lineage,
                           dedup=dedup)

    def reserve(self, run: str, step: int, job: _PublishJob) -> Callable[[], None]:
        return self.reg._reserve(job)

    def commit(self, job: _PublishJob, write: Callable[[Any], Written], *,
               parts: PartPublish | None = None) -> CheckpointInfo:
        from registry.ops.protocol import publish_sequence
        reg, target = self.reg, self.reg._target(job)
        if parts is not None:  # no host holds the step: each holds a part, replicated by the ranks together
            info = publish_sequence(reg.catalog, target, lambda staging, _reuse: write(staging), parts.hooks,
                                    parts.landing)
            return reg.root.place(info)
        info = publish_sequence(reg.catalog, target, lambda staging, _reuse: write(staging), reg._hooks(job),
                                reg.root.landing(target.relpath))
        reg._kick_replication()  # a sharded step is replicated in the background like any other
        return reg.root.place(info)

    def parts(self, job: _PublishJob, hosts: Hosts) -> PartPublish:
        from registry.distributed.parts import PartPublish
        return PartPublish.of(hosts, job.run, job.step, self.reg._hooks(job, copy=False))

    def replicate_parts(self, comm: Comm | Solo, hosts: Hosts, run: str,
                        after: Future[CheckpointInfo] | None = None) -> None:
        reg = self.reg
        if reg._part_replication is None:
            from registry.distributed.parts import PartReplication
            from registry.distributed.sharded_async import PublishGroups
            reg._part_replication = PartReplication(PublishGroups())
        from registry.distributed.parts import Coordinator
        coordinator = Coordinator(catalog=reg.catalog, writer=reg._writer) if comm.rank == 0 else None
        reg._part_replication.after_publish(comm, hosts, run=run, objects=reg._tiers("parts").durable,
                                            coordinator=coordinator, after=after)

    def retain(self, run: str, step: int, policy: Policy) -> object:
        return self.reg._retention_after_publish(run, step, policy)

    def submit(self, name: str, fn: Callable[[], CheckpointInfo]) -> Future[CheckpointInfo]:
        return self.reg._background.submit(name, fn)


class Registry:
    """A catalog plus a checkpoint root. Use :meth:`open`; close it (or use ``with``)."""

    def __init__(self, *, catalog: Catalog, root: Root, url: str,
                 lease_ttl: timedelta = timedelta(minutes=30), read_only: bool = False, dedup: bool = False,
                 full_every: int = 8, policy_loads_keep_days: float = 30.0) -> None:
        self.catalog = catalog
        self.full_every = full_every  # a policy channel publish under delta="auto" stores a full every N versions
        self.policy_loads_keep_days = policy_loads_keep_days  # how long the policy load audit keeps ended loads
        self._policy_cache_made: PolicyCache | None = None
        self.root = root  # where payloads live: a directory, s3://, or a fast directory over a durable tier
        self._replicator: Replicator | None = None
        self.dedup = dedup
        self.url = url
        self.read_only = read_only
        self.lease_ttl = lease_ttl
        # this registry as a writer: its own token, so another registry of the process never takes over its
        # live claims, and they may be taken over once it is closed (or collected unclosed)
        self._writer_token = open_writer()
        weakref.finalize(self, close_writer, self._writer_token)
        self._writer = functools.partial(writer_id, self._writer_token)
        self._attempts = Attempts(catalog, self._writer)
        self._queued: set[tuple[str, int]] = set()  # (run, step) of background publishes not yet finished
        self._closed = False
        self._lock = threading.Lock()  # the queued steps, shared with the background publisher; _snapshots
        self._background = BackgroundPublisher()
        self._snapshotter: Snapshotter | None = None  # made by the first background publish: see _snapshots
        self._publish_groups: PublishGroups | None = None  # background sharded publishes' groups, made on first use
        self._part_replication: PartReplication | None = None  # parts of publishes from several hosts, replicated
        # how webhooks are delivered (None: the defaults of registry.ops.webhooks.WebhookOptions), and this
        # process's background deliverer, started by the first commit that owes a webhook an event
        self.webhook_options: WebhookOptions | None = None
        self._webhook_delivery: BackgroundDelivery | None = None
        self._samplers: dict[str, SystemSampler] = {}  # run -> its system-metrics sampler (sample_system_metrics)
        self._consumer_hub: ConsumerHub | None = None  # policy consumers' heartbeat and listener, made on first use
        if not read_only:
            me = weakref.ref(self)

            def outbox_written() -> None:
                reg = me()
                if reg is not None:
                    reg._deliver_in_background()
            catalog.on_outbox = outbox_written

    @classmethod
    def open(cls, url: str | None = None, root: str | os.PathLike[str] | None = None, *,
             migrate: bool = True, lease_ttl: timedelta = timedelta(minutes=30), create: bool = True,
             read_only: bool = False, rebind_root: bool = False, dedup: bool = False,
             storage_options: Mapping[str, Any] | None = None, durable: str | None = None,
             full_every: int = 8, policy_loads_keep_days: float = 30.0) -> Registry:
        """Open the catalog and the root, and check that they belong together.

        ``root`` defaults to ``$REGISTRY_ROOT`` or ``./checkpoints``; ``url`` to
        ``$REGISTRY_URL`` or ``sqlite:///<root>/.registry/catalog.db``
        (``<root>/catalog.db`` where an older root has one).

        ``create=True`` (for trainers and other writers) creates the root and
        the catalog if they do not exist, logging a WARNING that names each
        one created, and migrates the schema; ``create=False`` (for readers,
        and for a trainer's restart, which must find its root) refuses a root
        or catalog that does not exist, creating nothing. ``read_only=True``, implied for a SQLite catalog this process
        cannot write, opens without creating, migrating or writing anything:
        queries and loads work, loads take no reader lease (so retention may
        delete a step while it is read), and writes raise ``ReadOnlyError``.
        The root is bound to the catalog at the first creating open; a root
        bound to another catalog, or one without a marker where the catalog
        has a bound root, raises ``RootMismatchError`` (see
        ``registry.ops.binding``); ``rebind_root=True`` binds this root anyway.
        ``dedup=True`` makes :meth:`publish` and :meth:`import_checkpoint` store
        large files a verified step of the same run holds as hard links (see
        :mod:`registry.fs.dedup` for what is never linked); off by default.

        ``root`` may be ``s3://BUCKET/PREFIX``: an object-store root, which
        needs an explicit ``url`` (or ``$REGISTRY_URL``). Its endpoint and
        credentials come from the standard AWS environment, overridden by
        ``storage_options`` (obstore's S3 configuration keys); they are never
        logged, stored or shown. The bucket must exist. Dedup does not apply.

        ``durable`` (default ``$REGISTRY_DURABLE``): an ``s3://`` root that is
        the durable tier of the filesystem root ``root`` (the fast tier): every
        step published here is replicated there in the background, and loads
        read the nearest verified copy (see :mod:`registry.ops.tiers`). The
        durable root is the one bound to the catalog; ``storage_options``
        apply to it.

        ``full_every``: a policy publish with ``delta="auto"`` stores a full
        every that many versions, so no delta chain grows longer (default 8).
        ``policy_loads_keep_days``: how long the policy channel's audit of
        consumers' loads keeps a load that ended and protects nothing (its
        consumers' processes forget older ones about once an hour; default 30).
        """
        from registry.catalog.session import cannot_write

        check_flags(dedup=dedup, migrate=migrate, create=create, read_only=read_only, rebind_root=rebind_root)
        check_lease_ttl(lease_ttl, "lease_ttl")
        for name, where in (("root", root), ("durable", durable)):
            if where is not None and not (isinstance(where, (str, os.PathLike)) and os.fspath(where)):
                raise InvalidStateError(f"{name} must be a directory or an s3:// URL (a str or os.PathLike), "
                                        f"got {where!r}")
        full_every = check_full_every(full_every)
        policy_loads_keep_days = check_keep_days(policy_loads_keep_days)
        located, url = locations(url, root)
        read_only = read_only or cannot_write(url)
        opening = locate(located, durable, storage_options=storage_options, create=create, read_only=read_only,
                         dedup=bool(dedup))
        catalog: Catalog | None = None
        try:
            catalog = _bound_catalog(url, opening.bind_to, migrate=migrate, create=create, read_only=read_only,
                                     rebind=rebind_root)
            opened = catalog
            if opening.tiered:
                from registry.catalog.identity import read_identity
                from registry.ops.tiers import known_tier, open_tier
                catalog_id = read_identity(opened.engine).catalog_id
                # a host new to a durable tier its catalog knows names its fast directory whenever it may write;
                # a read-only open there writes nothing and keeps no cache
                built = opening.finish(lambda fast: known_tier(fast, catalog_id=catalog_id) if read_only
                                       else open_tier(fast, catalog_id=catalog_id, create=True))
            else:
                if opening.directory is None:
                    from registry.ops.tiers import refuse_durable_as_root
                    refuse_durable_as_root(opened, str(located))
                built = opening.finish()
        except BaseException:
            if catalog is not None:
                catalog.close()
            opening.undo()
            raise
        opening.announce()
        reg = cls(catalog=catalog, root=built, url=url, lease_ttl=lease_ttl, read_only=read_only,
                  dedup=bool(dedup), full_every=full_every, policy_loads_keep_days=policy_loads_keep_days)
        if built.can.tiers and create and not read_only:
            reg._replication().kick()  # a queue left by an earlier process (killed, or its tier was down)
        return reg

    def _replication(self) -> Replicator:
        """The tiered root's replicator (made on first use); ``InvalidStateError`` without a durable tier."""
        tiers = self._tiers("replication")
        if self.read_only:
            raise ReadOnlyError("this registry is read-only: it replicates nothing")
        if self._replicator is None:
            from registry.ops.replicator import Replicator
            self._replicator = Replicator(catalog=self.catalog, fast_root=tiers.fast.root,
                                          durable=tiers.durable, writer=self._writer)
        return self._replicator

    @property
    def store(self) -> Store:
        """The filesystem root's :class:`Store` (a tiered root's fast one); an ``s3://`` root has none
        (``RootError`` says so)."""
        return self._directory_root("this")

    def _directory_root(self, what: str) -> Store:
        return self.root.local_store(what)

    @property
    def objects(self) -> ObjectRoot | None:
        """The object-store root when the root is ``s3://``; None for a directory or a tiered root."""
        return self.root.object_store()

    @property
    def tiers(self) -> Tiers | None:
        """A tiered root's fast and durable roots (:class:`registry.ops.tiers.Tiers`); None for other roots."""
        return self._copies().tiers

    def _tiers(self, what: str) -> Tiers:
        """:attr:`tiers`, or the root's one-line refusal of ``what``."""
        return self._copies().tiered(what)

    def _copies(self) -> Copies:
        """The root's copies as this process reads and judges them (:mod:`registry.ops.copies`)."""
        from registry.ops.copies import copies_of
        return copies_of(self.root, self.catalog, holder=self.writer)

    @property
    def root_url(self) -> str:
        """The root as given to :meth:`open`: an absolute directory, or ``s3://BUCKET/PREFIX``."""
        return self.root.url

    def placed(self, info: CheckpointInfo) -> CheckpointInfo:
        """A catalog row as the API hands it out: its absolute path, or on an ``s3://`` root its URL."""
        return self.root.place(info)

    def close(self) -> None:
        """Wait for background publishes, flush metrics, release everything.

        A background publish that failed and was not yet reported is raised
        (as :class:`AsyncPublishError`) after everything is closed.
        """
        if self._closed:
            return
        try:
            for sampler in list(self._samplers.values()):
                sampler.stop()  # before the flush, which then takes their last samples
            self._background.wait()
            if self._part_replication is not None:
                self._part_replication.wait()  # every rank closes alike: a round's collectives finish first
            self.flush()
        finally:
            self._closed = True
            self._background.shutdown()
            if self._webhook_delivery is not None:
                self._webhook_delivery.close()
            if self._consumer_hub is not None:
                self._consumer_hub.close()  # ends this process's policy consumers while the catalog is open
            if self._replicator is not None:
                self._replicator.close(wait=True)
            if self._snapshotter is not None:
                self._snapshotter.clear()
            self.catalog.close()
            close_writer(self._writer_token)
        self._background.raise_error()

    @property
    def _snapshots(self) -> Snapshotter:
        """The arenas background publishes copy the state into (``registry.fs.snapshot``), made on first use."""
        with self._lock:
            if self._snapshotter is None:
                from registry.fs.snapshot import Snapshotter
                self._snapshotter = Snapshotter()
            return self._snapshotter

    @property
    def _policy_cache(self) -> PolicyCache:
        """The last policy state this registry published of each run (a delta's base), made on first use."""
        with self._lock:
            if self._policy_cache_made is None:
                from registry.ops.policy import PolicyCache
                self._policy_cache_made = PolicyCache()
            return self._policy_cache_made

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    @property
    def writer(self) -> str:
        """This registry's writer identity in this process: asked each time, so a forked child never claims as
        its parent."""
        return self._writer()

    # ------------------------------------------------------------------ publish

    @overload
    def publish(self, run: str, step: int, state_dict: Mapping[str, torch.Tensor], *,
                blocking: Literal[True] = True, **options: Unpack[PublishOptions]) -> CheckpointInfo: ...

    @overload
    def publish(self, run: str, step: int, state_dict: Mapping[str, torch.Tensor], *,
                blocking: Literal[False], **options: Unpack[PublishOptions]) -> Future[CheckpointInfo]: ...

    @overload
    def publish(self, run: str, step: int, state_dict: Mapping[str, torch.Tensor], *,
                blocking: bool, **options: Unpack[PublishOptions]) -> CheckpointInfo | Future[CheckpointInfo]: ...

    def publish(self, run: str, step: int, state_dict: Mapping[str, torch.Tensor], *,
                extra: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
                meta: Mapping[str, Any] | None = None, metrics: Mapping[str, Any] | None = None,
                epoch: int = 0, consumed_samples: int = 0, policy_version: int | None = None,
                optimizer_step: int | None = None, tags: Iterable[str] = (), overwrite: bool = False,
                verify: bool = True, max_shard_size: int | None = None,
                retention: Policy | None = None, blocking: bool = True,
                trust_pickle: bool = False, parent: str | Ref | None = None, sharded: bool = False,
                group: Any = None, timeout: float | None = None,
                dedup: bool | None = None, durable: bool = False,
                delta: bool | Literal["auto"] | None = None) -> CheckpointInfo | Future[CheckpointInfo]:
        """Atomically publish ``state_dict`` and friends as ``run@step``.

        Returns the ``CheckpointInfo``; with ``blocking=False`` a
        ``Future[CheckpointInfo]`` instead, as soon as the state is copied
        (see "async publish" below). ``verify=True`` makes the step
        ``verified`` at once when the written files pass
        :func:`registry.fs.store.check_written`; ``verify=False`` leaves it
        ``published`` until ``registry verify`` re-hashes it.
        ``retention``: a ``registry.retention.Policy`` applied to the run after
        the publish commits (see :meth:`_retention_after_publish`).

        Every argument is checked before anything is written (see
        :mod:`registry.fs.validation`): a refused call leaves no row, event or
        file. ``meta`` may not contradict the keyword arguments it sits beside
        in ``meta.json`` (``epoch``, ``optimizer_step``, ...); its ``timestamp``
        is always the time of the publish. An ``extra`` that ``torch.load(weights_only=True)``
        would refuse raises ``UnsafePickleError`` unless ``trust_pickle=True``,
        after which every load of the step needs ``trust_pickle=True`` too.
        ``parent``: a ref to the checkpoint this step was derived from (a
        fine-tune's base, possibly of another run), resolved now and recorded
        as the step's lineage (``forked``); without it the attempt's fork or
        resume point is recorded (see :meth:`begin_attempt`, :meth:`lineage`).

        ``sharded=True``: a collective publish by every rank of ``group`` (the
        default process group if None; works without one too) of a nested
        ``state_dict`` as ``get_state_dict(model, optimizer)`` gives it
        (DTensors, sharded optimizer state, plain tensors and values), written
        with ``torch.distributed.checkpoint``; see :mod:`registry.distributed.sharded`.
        ``extra`` and ``max_shard_size`` do not apply; metrics, tags, meta,
        config and the numbers are rank 0's. ``timeout`` bounds each of the
        registry's own collectives. Returns the same ``CheckpointInfo`` on every rank.
        With ``blocking=False`` every rank copies its shards and returns a
        future; the publish runs in the background on a gloo group of its own
        (see :mod:`registry.distributed.sharded_async`), and every rank's future
        holds the same ``CheckpointInfo`` or raises the same error.

        ``dedup``: link large files a verified step of the run already holds
        (see :mod:`registry.fs.dedup`); None takes the registry's ``dedup``.

        On a root with a durable tier the publish returns once the fast tier's
        commit is done and the step is replicated in the background;
        ``durable=True`` waits for its durable copy too (see :meth:`wait_durable`).

        ``delta`` (with ``policy_version=N``: the RL policy channel, see
        :mod:`registry.ops.policy`): ``"auto"`` stores what changed against the
        run's newest verified policy step as ``delta.safetensors`` when that
        pays, a full every ``full_every`` versions (:meth:`open`) and whenever
        the tensor names, shapes or dtypes changed; ``True`` always a delta when
        there is a base (a changed tensor set raises ``DeltaBaseError``);
        ``False`` a full. Each of them makes the version immutable: publishing
        version N again with the same weights is a no-op that returns the step
        already there, with other weights ``PolicyVersionConflictError``. The
        default (None) is a plain full step, as without the channel (a version
        may then repeat), whose directory the reference module loads; a delta
        step's does not: :meth:`materialize` writes its full files. Every load,
        export and diff of a delta step gives exactly the tensors a full gives.
        """
        if dedup is not None:
            check_flags(dedup=dedup)
        check_flags(durable=durable)
        if durable and (not self.root.can.tiers or blocking is False or sharded is not False):
            raise InvalidStateError("publish(durable=True) needs a root with a durable tier and a blocking, "
                                    "unsharded publish; call wait_durable() after the future instead")
        dedup = self.dedup if dedup is None else bool(dedup)
        if sharded is not False:
            self.root.require("sharded", "sharded publish")
        if dedup:
            self.root.require("links", "dedup")
        if sharded is not False:
            if delta not in (None, False):
                raise InvalidStateError("publish(delta=...) needs an unsharded publish")
            return self._publish_sharded(run, step, state_dict, group=group, timeout=timeout, parent=parent,
                                         extra=extra,
                                         config=config, meta=meta, metrics=metrics, epoch=epoch,
                                         consumed_samples=consumed_samples, policy_version=policy_version,
                                         optimizer_step=optimizer_step, tags=tags, overwrite=overwrite,
                                         verify=verify, max_shard_size=max_shard_size, retention=retention,
                                         blocking=blocking, trust_pickle=trust_pickle, sharded=sharded,
                                         dedup=dedup)
        self._background.raise_error()
        check_run_name(run)
        self._check_retention(retention)
        check_step(step)
        check_flags(overwrite=overwrite, verify=verify, blocking=blocking, trust_pickle=trust_pickle)
        check_timeout(timeout)  # a sharded publish's ranks agree on theirs (every rank fails alike)
        from registry.format.safetensors import check_state_dict
        state = check_state_dict(state_dict)
        tags = check_tags(tags)
        new_metrics = check_metrics(run, step, metrics)
        lineage = self._parent_lineage(parent)
        payload = checked_payload(step=step, state_dict=state, extra=extra, config=config, meta=meta, epoch=epoch,
                                  consumed_samples=consumed_samples, optimizer_step=optimizer_step,
                                  policy_version=policy_version, max_shard_size=max_shard_size,
                                  trust_pickle=trust_pickle, timestamp=now_timestamp())
        policy = None
        if delta is not None:
            from registry.ops.policy import check_delta, plan_publish
            mode = check_delta(delta, policy_version)
            if mode is not None and policy_version is not None:
                self._background.wait()  # the base is the newest policy step committed, background ones included
                self._background.raise_error()
                policy = plan_publish(self._reader(), self._policy_cache, run, step, state, version=policy_version,
                                      mode=mode, full_every=self.full_every,
                                      sharded_weights=max_shard_size is not None)
                if policy.existing is not None:  # the same weights are this version already: nothing to do
                    same = self.placed(self.catalog.resolve(Ref(run=run, kind="step", step=policy.existing.step)))
                    return same if blocking else _done(same)
                if policy.delta is not None:
                    payload = replace(payload, delta=policy.delta, manifest_fields=policy.manifest or {})

        job = _PublishJob(run=run, step=step, overwrite=overwrite, payload=payload, verify=verify,
                          new_metrics=tuple(new_metrics), tags=tags, retention=retention, lineage=lineage, dedup=dedup,
                          policy=policy)
        if not blocking:
            return self._submit_publish(job)
        self._background.wait()  # publishes commit in call order, background ones first
        self._background.raise_error()
        info = self._run_publish(job)
        if durable:
            self.wait_durable(run, step)
        return info

    def _parent_lineage(self, parent: str | Ref | None) -> LineageRecord | None:
        """``publish(..., parent=REF)``: the fork this step records, resolved before anything is claimed."""
        if parent is None:
            return None
        origin = self.resolve(parent)
        return LineageRecord(how="forked", parent_run=origin.run, parent_step=origin.step)

    def _publish_sharded(self, run: str, step: int, state_dict: Any, *, group: Any, timeout: float | None,
                         parent: str | Ref | None, dedup: bool = False,
                         **options: Any) -> CheckpointInfo | Future[CheckpointInfo]:
        """``publish(..., sharded=True)``: the driver in :mod:`registry.distributed.driver`, publishing through
        this registry's checks, queue and publish sequence (:class:`_Publishing`)."""
        from registry.distributed.driver import publish_sharded_call
        return publish_sharded_call(_Publishing(self), run, step, state_dict, group=group, timeout=timeout,
                                    parent=parent, dedup=dedup, **options)

    def _reserve(self, job: _PublishJob) -> Callable[[], None]:
        """Queue ``job``'s step for a background publish: refused when it is queued already or cannot be claimed
        (a read, no commit). Returns what takes it off the queue again."""
        key = (job.run, job.step)
        with self._lock:
            if key in self._queued:
                raise StepExistsError(f"{job.run}@{job.step} is already queued for publishing",
                                      run=job.run, step=job.step)
            self._queued.add(key)

        def unqueue() -> None:
            with self._lock:
                self._queued.discard(key)
        try:
            self.catalog.check_claimable(job.run, job.step, overwrite=job.overwrite, writer_alive=writer_alive)
        except BaseException:
            unqueue()
            raise
        return unqueue

    def _run_publish(self, job: _PublishJob) -> CheckpointInfo:
        """The publish sequence (on the caller's thread, or the background publisher's), then its retention.

        The root says where the payload lands and how it is written (:mod:`registry.roots.landing`): a staging
        directory renamed into place, or a fresh attempt prefix on an object store.
        """
        from registry.ops.protocol import publish_sequence
        target = self._target(job)
        root = self.root
        info = publish_sequence(self.catalog, target, lambda dest, reuse: root.write(dest, job.payload, reuse),
                                self._hooks(job), root.landing(target.relpath))
        self._kick_replication()
        if job.retention is not None:
            self._retention_after_publish(job.run, job.step, job.retention)
        return self.placed(info)

    def _kick_replication(self) -> None:
        """Wake the replicator for what was just published here (a root with a durable tier, opened to write)."""
        if self.root.can.tiers and not self.read_only:
            self._replication().kick()

    def _target(self, job: _PublishJob) -> Target:
        from registry.ops.protocol import Target
        return Target(run=job.run, step=job.step, root=self._local_root(),
                      relpath=self.root.new_relpath(job.run, job.step), writer=self.writer,
                      overwrite=job.overwrite, verify=job.verify, dedup=job.dedup, epoch=job.payload.meta["epoch"],
                      consumed_samples=job.payload.meta["consumed_samples"])

    def _hooks(self, job: _PublishJob, *, copy: bool = True) -> CommitHooks:
        """The commit hooks of ``job``; ``copy``: recording the copy it leaves here (every publish but one from
        several hosts, which leaves parts)."""
        hooks = self._attempts.hooks(job.run, job.step, metrics=job.new_metrics, tags=job.tags, lineage=job.lineage)
        if job.payload.meta.get("policy_version") is not None:
            from registry.ops.policy import PolicyHooks
            hooks = PolicyHooks(hooks, job.policy, self._policy_cache, job.run)
        return self._copy_hooks(hooks, job.run, job.step) if copy else hooks

    def _copy_hooks(self, hooks: CommitHooks, run: str, step: int) -> CommitHooks:
        """``hooks`` that also record the copy a publish leaves on this host's fast tier, on a tiered root: every
        path that lands a payload here (publish, sharded publish, import) commits through this."""
        if not self.root.can.tiers:
            return hooks
        from registry.ops.tiers import FastCopyHooks
        return FastCopyHooks(hooks, location=self._tiers("a fast copy").location,
                             path=self.root.new_relpath(run, step))

    # ------------------------------------------------------------------ tiers

    def wait_durable(self, run: str, step: int, *, timeout: float | None = None) -> ReplicaInfo:
        """Wait until ``run@step`` has a verified copy on the durable tier; returns that copy.

        Replication runs on this registry's background thread (started here
        if needed); a copy made by another process counts too. Raises
        ``DurableTimeoutError`` (a ``TimeoutError``) when ``timeout`` seconds pass first (the queue keeps
        the step: it becomes durable later).
        """
        from registry.catalog.replicas import DURABLE, ReplicaCatalog
        from registry.errors import DurableTimeoutError
        check_run_name(run)
        check_step(step)
        check_timeout(timeout)
        info = self.catalog.resolve(Ref(run=run, kind="step", step=step))
        replicator = self._replication()
        if not replicator.wait_durable(run, step, info.manifest_sha256, timeout=timeout):
            refused = [d.error for d in replicator.deferred(run=run) if d.item.step == step]
            failing = refused[0] if refused else replicator.failing
            why = f": {failing}" if failing is not None else ""
            raise DurableTimeoutError(f"{run}@{step} has no durable copy after {timeout} s{why}")
        copy = ReplicaCatalog(self.catalog).copy(run, step, DURABLE, manifest_sha256=info.manifest_sha256)
        if copy is None:  # durable, then deleted or overwritten at once by another process
            raise CheckpointNotFoundError(f"{run}@{step}'s durable copy is gone again (deleted or replaced since "
                                          "it was made)", run=run, step=step)
        return copy

    def replicate(self, run: str | None = None, *, wait: bool = False, timeout: float | None = None) -> int:
        """Replicate the queued steps whose fast copy is on this root, here and now; how many were.

        ``registry replicate``. Without ``wait`` a ``StorageError`` (the durable
        tier down, or a step it refused, after the steps it took) is raised;
        with it the queue is retried with backoff until it drained or
        ``timeout`` seconds passed (then ``DurableTimeoutError``, a ``TimeoutError``).
        """
        import time

        from registry.ops.replicator import BACKOFF_MAX, BACKOFF_START
        from registry.errors import DurableTimeoutError, StorageError
        if run is not None:
            check_run_name(run)
        check_flags(wait=wait)
        check_timeout(timeout)
        replicator = self._replication()
        deadline = None if timeout is None else time.monotonic() + timeout
        before, backoff = replicator.replicated, BACKOFF_START
        while True:
            try:
                replicator.drain(run=run, now=True)
                refused = replicator.deferred(run=run)
                if refused:
                    first = refused[0]
                    raise StorageError(f"{first.item.run}@{first.item.step} was not replicated: {first.error}",
                                       url=first.error.url, run=first.item.run, step=first.item.step)
                return replicator.replicated - before
            except StorageError as exc:
                if not wait or (deadline is not None and time.monotonic() + backoff > deadline):
                    if wait:
                        raise DurableTimeoutError(f"the queue did not drain in {timeout} s: {exc}") from exc
                    raise
                log.warning("replicate: %s; retrying in %.1f s", exc, backoff)
                time.sleep(backoff)
                backoff = min(BACKOFF_MAX, backoff * 2)

    def replication_queue(self, run: str | None = None) -> list[Queued]:
        """The steps of this fast root (of ``run``, or of every run) still waiting for their durable copy, in order."""
        if run is not None:
            check_run_name(run)
        return self._replication().local_queue(run=run)

    def replicas(self, run: str, step: int | None = None) -> list[ReplicaInfo]:
        """Every recorded copy of ``run``'s steps (of one ``step``): tier, status, path, when it became durable."""
        from registry.catalog.replicas import ReplicaCatalog
        check_run_name(run)
        if step is not None:
            check_step(step)
        return ReplicaCatalog(self.catalog).replicas(run, step)

    # ------------------------------------------------------------------ metrics

    def log_metrics(self, run: str, step: int, metrics: Mapping[str, Any], *, flush: bool = False) -> None:
        """Buffer metric points; durable at the next publish of a step >= ``step``, or at ``flush()``.

        Buffering is what ties metrics to publication: a published step always
        carries the points logged up to it (same transaction), and a trainer
        that dies before publishing step S leaves no points claiming S.
        ``flush=True`` writes this run's buffer at once: the call for late
        metrics from an evaluator in another process, which ``best:`` then
        uses immediately. Non-numeric and non-finite values raise
        ``InvalidStateError`` and nothing of the call is buffered.
        """
        check_run_name(run)
        check_step(step)
        self._attempts.buffer(run, check_metrics(run, step, metrics))
        if flush:
            self.flush(run)

    def flush(self, run: str | None = None) -> None:
        """Make every buffered metric point (of ``run``, or of every run) durable."""
        self._attempts.flush(run)

    def metrics(self, run: str, key: str | None = None, *, history: bool = False) -> list[MetricPoint]:
        """The metric points of ``run`` (of one ``key``, or all), ordered by step.

        ``history=True`` also returns the points that a later attempt at the run
        superseded, so a restarted training's curve can be inspected whole.
        """
        check_run_name(run)
        if key is not None:
            check_metric_key(key)
        check_flags(history=history)
        return self.catalog.metrics(run, key=key, history=history)

    # ------------------------------------------------------------------ queries

    def resolve(self, ref: str | Ref) -> CheckpointInfo:
        """The live checkpoint that ``ref`` (``RUN@latest``, ``@STEP``, ``@TAG``, ``@best:METRIC``) names.

        Raises ``CheckpointNotFoundError`` where it names none; reads no payload. On a tiered root its ``path``
        (or ``url``) is where this host finds the step: its fast copy, its cached copy, or its durable copy.
        """
        return self._copies().located(self.placed(self.catalog.resolve(parse_ref(ref))))

    def checkpoints(self, run: str, include_deleted: bool = False, *,
                    policy_version: int | None = None) -> list[CheckpointInfo]:
        """The live checkpoints of ``run``, oldest first; with ``include_deleted``, those of every status.

        ``policy_version`` keeps only the steps published under that version of the training policy.
        """
        check_run_name(run)
        check_flags(include_deleted=include_deleted)
        if policy_version is not None:
            check_step(policy_version)
        return [self.placed(i) for i in self.catalog.checkpoints(
            run, include_deleted=include_deleted, policy_version=policy_version)]

    def runs(self) -> list[RunInfo]:
        """Every run, by name, with the count, newest step and total size of its live checkpoints."""
        return self.catalog.runs()

    def events(self, run: str | None = None, *, step: int | None = None) -> list[EventInfo]:
        """The newest 1000 events (publishes, tags, deletions, repairs) of a run or step, or of all, oldest first."""
        if run is not None:
            check_run_name(run)
        if step is not None:
            check_step(step)
        return self.catalog.events(run, step=step)

    def tag(self, run: str, step: int, name: str, *, note: str | None = None) -> None:
        """Point tag ``name`` of ``run`` at the live ``step`` (moving it if set), so ``run@name`` resolves there.

        ``note``: what to say about it, kept with the tag (see :meth:`tags`) and in its event. A tag moved
        without a note loses the one it had; one set again where it is keeps it unless a note is given
        (``""`` removes it).
        """
        check_run_name(run)
        check_step(step)
        if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE):
            got = f"{len(note)} characters" if isinstance(note, str) else type(note).__name__
            raise InvalidStateError(f"a tag's note is text of at most {MAX_NOTE} characters, got {got}")
        self.catalog.tag(run, step, check_tag_name(name), actor=self.writer, note=note)

    def tags(self, run: str) -> list[TagInfo]:
        """Every tag of ``run`` by name, with the step it points at, when it was set there and its note."""
        from registry.catalog.params import ParamsCatalog
        check_run_name(run)
        return ParamsCatalog(self.catalog).tags(run)

    # ------------------------------------------------------------------ runs as experiments

    def set_params(self, run: str, params: Mapping[str, Any]) -> None:
        """Merge ``params`` into ``run``'s parameters (its hyperparameters; the run is created if need be).

        Nested mappings are flattened with dots (``{"optimizer": {"lr": 1e-3}}`` is ``optimizer.lr``), which is
        how :meth:`params` returns them and a search names them (``params.optimizer.lr``); a key set again
        takes the new value. Values are what JSON holds (None, booleans, finite numbers, text, lists and
        mappings of those); anything else raises ``InvalidStateError`` and nothing of the call is kept.
        """
        from registry.catalog.params import ParamsCatalog
        from registry.format.params import flatten_params
        check_run_name(run)
        ParamsCatalog(self.catalog).set_params(run, flatten_params(params))

    def params(self, run: str) -> dict[str, Any]:
        """``run``'s parameters by flattened key (``{"optimizer.lr": 0.001, ...}``), sorted; ``{}`` for a run
        that has none, ``CheckpointNotFoundError`` for an unknown run."""
        from registry.catalog.params import ParamsCatalog
        check_run_name(run)
        return ParamsCatalog(self.catalog).params(run)

    def search_runs(self, where: str | Sequence[str] | None = None, *, sort: str | Sequence[str] | None = None,
                    columns: str | Sequence[str] | None = None) -> list[FoundRun]:
        """The runs that meet ``where``, ordered by ``sort``, each with the value of every column.

        ``where``: conditions on parameters and metric summaries joined by ``and``
        (``"params.lr < 1e-3 and eval/loss:min <= 0.5"``); ``sort``: fields best first
        (``"eval/loss:min"``; ``KEY:max`` is highest first, a leading ``-`` turns one round); ``columns``:
        fields separated by commas (default: those that ``where`` and ``sort`` name). A field is
        ``params.KEY`` or a metric at the run's live checkpoints: ``KEY:min``/``KEY:max`` the best value, at
        the step ``RUN@best:KEY[:max]`` loads (``KEY`` alone is ``KEY:min``), ``KEY:last`` the value at the
        newest live checkpoint that has one; each found run's ``steps`` says where. The grammar is in
        :mod:`registry.format.search`; what does not parse raises ``InvalidQueryError``. The filtering and the
        order are one SQL query; the web view's runs table is this search too.
        """
        from registry.catalog.params import ParamsCatalog
        from registry.format.search import parse_search
        return ParamsCatalog(self.catalog).search(parse_search(where, sort, columns))

    def attempts(self, run: str, *, step: int | None = None) -> list[AttemptInfo]:
        """Every attempt at ``run`` (see :meth:`begin_attempt`), oldest first, each with the code and
        environment it ran in (``environment``: git commit and dirty flag, host, versions, command line,
        packages digest; see :mod:`registry.ops.environment`). With ``step``: the attempt that published it."""
        from registry.catalog.params import ParamsCatalog
        check_run_name(run)
        if step is not None:
            check_step(step)
        return ParamsCatalog(self.catalog).attempts(run, step)

    def sample_system_metrics(self, run: str, *, every: float = 10.0,
                              step: Callable[[], int] | None = None) -> SystemSampler:
        """Log ``sys/*`` metrics of this machine for ``run`` every ``every`` seconds, on a daemon thread, until
        the returned sampler's ``stop()`` or :meth:`close`.

        CPU, memory, disk and network I/O, and CUDA memory where torch uses it (the keys are in
        :mod:`registry.ops.sysmetrics`), through :meth:`log_metrics` at ``step()`` (default: the highest step
        this registry logged or published at for ``run``), so they become durable with the next publish or
        :meth:`flush`, as every metric does. Uses psutil (extra ``system``), else Linux's ``/proc``.
        """
        from registry.ops.sysmetrics import SystemSampler
        check_run_name(run)
        if self.read_only:
            raise ReadOnlyError("this registry is read-only: it logs no metrics")
        current = self._samplers.get(run)
        if current is not None and current.running:
            raise InvalidStateError(f"system metrics of {run!r} are sampled already: stop() that sampler first")
        at = step if step is not None else functools.partial(self._attempts.last_step, run)
        me = weakref.ref(self)  # a registry dropped unclosed is not kept alive by its sampler

        def log_values(values: Mapping[str, float]) -> None:
            reg = me()
            if reg is None or reg._closed:
                sampler.stop()
                return
            reg.log_metrics(run, at(), values)
        sampler = SystemSampler(log_values, every=every, name=f"registry-sys-metrics-{run}")
        self._samplers[run] = sampler
        return sampler

    def untag(self, run: str, name: str) -> None:
        """Remove tag ``name`` from ``run`` (``CheckpointNotFoundError`` if unset); the step is untouched."""
        check_run_name(run)
        self.catalog.untag(run, check_tag_name(name), actor=self.writer)

    # ------------------------------------------------------------------ webhooks

    def add_webhook(self, url: str, events: Iterable[str] | str | None = None, *, secret: str | None = None,
                    max_attempts: int = 8, allow_hosts: Iterable[str] = ()) -> WebhookInfo:
        """POST each of ``events`` (default every one: ``step.published``, ``step.verified``, ``step.condemned``,
        ``step.deleted``, ``step.durable``, ``tag.set``, ``tag.moved``, ``tag.removed``) to ``url`` from now on,
        signed with ``secret``, at least once and in order per run, dead-lettered after ``max_attempts``.

        Only a loopback host is allowed, unless the host is in ``allow_hosts`` or
        ``$REGISTRY_WEBHOOK_ALLOW_HOSTS``: ``WebhookError`` otherwise. See :mod:`registry.ops.webhooks`.
        """
        from registry.ops.webhooks import add_webhook
        return add_webhook(self.catalog, url, events, secret=secret, max_attempts=max_attempts,
                           allow_hosts=allow_hosts)

    def webhooks(self) -> list[WebhookInfo]:
        """Every webhook (its URL without credentials), with how many deliveries are pending and dead."""
        from registry.catalog.outbox import WebhookCatalog
        return WebhookCatalog(self.catalog).webhooks()

    def remove_webhook(self, webhook_id: int) -> None:
        """Forget a webhook, its pending deliveries and its log (``WebhookError`` if there is no such id)."""
        from registry.ops.webhooks import remove_webhook
        remove_webhook(self.catalog, webhook_id)

    def webhook_log(self, webhook_id: int | None = None, *, run: str | None = None,
                    limit: int = 50) -> list[OutboxEntry]:
        """The newest ``limit`` events owed to webhooks (to one, of one run), oldest first, each with its status
        (pending, delivered, dead) and every attempt at delivering it."""
        from registry.catalog.outbox import WebhookCatalog
        check_count(webhook_id, "webhook_id", optional=True)
        if run is not None:
            check_run_name(run)
        check_count(limit, "limit")
        return WebhookCatalog(self.catalog).log(webhook_id, run=run, limit=limit)

    def prune_webhook_log(self, *, older_than: timedelta = timedelta(days=30)) -> int:
        """Forget the events delivered or dead-lettered more than ``older_than`` ago, with their attempts (a
        deliverer does this itself, at most hourly, for ``WebhookOptions.keep_days``); pending events stay.
        How many were forgotten."""
        from registry.catalog.outbox import WebhookCatalog
        from registry.catalog.session import utcnow
        from registry.errors import WebhookError
        if not (isinstance(older_than, timedelta) and older_than >= timedelta(0)):
            raise WebhookError(f"older_than must be a timedelta >= 0, got {older_than!r}")
        return WebhookCatalog(self.catalog).prune(finished_before=utcnow() - older_than)

    def deliver_webhooks(self, *, follow: bool = False, max_seconds: float | None = None,
                         poll: float = 1.0) -> DeliveryReport:
        """Deliver the events due now, for every process (each run's in order); with ``follow``, keep delivering
        until ``max_seconds`` have passed (or forever), asking the outbox every ``poll`` seconds."""
        from registry.ops.webhooks import WebhookOptions, deliver
        return deliver(self.catalog, name=self.writer, options=self.webhook_options or WebhookOptions(),
                       follow=follow, max_seconds=max_seconds, poll=poll)

    def _deliver_in_background(self) -> None:
        """A commit owes webhooks events: the background deliverer (started on first use) delivers them."""
        from registry.ops.webhooks import BackgroundDelivery, WebhookOptions
        options = self.webhook_options or WebhookOptions()
        if not options.background or self._closed:
            return
        with self._lock:
            if self._webhook_delivery is None:
                self._webhook_delivery = BackgroundDelivery(self.catalog, name=self.writer, options=options)
        self._webhook_delivery.kick()

    # ------------------------------------------------------------------ load

    def load(self, ref: str | Ref, broadcast: bool = False, verify: bool = True,
             map_location: Any = "cpu", *, trust_pickle: bool = False, strategy: str = "auto",
             timeout: float | None = None, extras: bool | Collection[str] = True, fallback: bool = True,
             resume: bool | None = None) -> Checkpoint:
        """Resolve ``ref`` and load it; a corrupt ``@latest`` falls back to an older step.

        ``extras``: load every ``.pt`` extra (True), none (False), or only the
        names given (``["rng"]``); the others are never read nor unpickled, so
        an evaluator need not pay for, or trust, the optimizer state. Asking
        for an extra the step lacks raises ``ExtraNotFoundError``.

        ``fallback``: a corrupt ``@latest`` (or ``@latest-published``) is
        marked ``corrupt`` and the next older step is loaded; how far that
        went is logged (logger ``registry.ops.reading``) and kept in
        ``Checkpoint.fallback``. With ``fallback=False`` the load raises
        ``CorruptCheckpointError`` instead. A ref naming one step never falls
        back. A failure of this process to read (root not mounted, out of
        file descriptors, no permission) raises ``CheckpointReadError``,
        marks nothing and tries no older step.

        ``resume``: whether this load is the trainer resuming the run (see
        :meth:`begin_attempt`). By default only a load of the run's own
        ``@latest`` or ``@latest-published`` before this process's first
        publish to the run is a resume; ``resume=True`` makes any ref one,
        ``resume=False`` none (a reference policy, an evaluation).

        With ``broadcast`` inside a process group, ``strategy`` ("auto",
        "broadcast", "shared-fs") and ``timeout`` (seconds per collective) are
        described in :mod:`registry.distributed.loader`; every rank must pass the same
        options.
        """
        from registry.checkpoint import Checkpoint
        from registry.fs.filemaps import check_extras
        from registry.ops import reading
        parsed = parse_ref(ref)
        extras = check_extras(extras)
        check_flags(broadcast=broadcast, verify=verify, fallback=fallback, trust_pickle=trust_pickle)
        if resume is not None and not isinstance(resume, bool):
            raise InvalidStateError(f"resume must be True, False or None, got {resume!r}")
        if broadcast:
            from registry.distributed.loader import distributed_load
            read = distributed_load(self._reader(), parsed, verify=verify, map_location=map_location,
                                    trust_pickle=trust_pickle, strategy=strategy, timeout=timeout,
                                    extras=extras, fallback=fallback)
        else:
            read = reading.load(self._reader(), parsed, verify=verify, map_location=map_location,
                                trust_pickle=trust_pickle, extras=extras, fallback=fallback)
        self._attempts.note_resume(parsed, read.info.step, resume)
        return Checkpoint.from_read(read)

    def checkout(self, ref: str | Ref, dest: str | os.PathLike[str] | None = None, *,
                 ttl: timedelta | None = None, verify: bool = True, fallback: bool = True,
                 link: str | None = None) -> Checkout:
        """A directory of ``ref``'s verified files, under a reader lease (see :mod:`registry.ops.export`).

        The files are the caller's own (reflinks where the filesystem clones,
        checked copies otherwise): writing into the checkout never changes a
        step. ``link="hardlink"`` or ``"symlink"`` links them instead, which
        costs no bytes but aliases the step: a write through the checkout
        (``save_pretrained`` into it; root ignores file modes) rewrites the
        registry's files (see :mod:`registry.ops.checkouts`).
        ``dest`` must be empty or absent, and outside the root; by default one
        is made under ``<root>/.registry/checkouts/`` (a temporary directory for
        a read-only registry) and removed on ``close()``, or by gc and
        ``fsck --repair`` once its lease has expired. The lease lasts ``ttl``
        (default: this registry's ``lease_ttl``); ``renew()`` it for longer
        work. Use as a context manager or as a path.
        """
        from registry.ops.export import checkout
        check_flags(verify=verify, fallback=fallback)
        if ttl is not None:
            check_lease_ttl(ttl)
        return checkout(self._reader(), parse_ref(ref),
                        as_directory(dest, what="checkout destination") if dest is not None else None,
                        ttl=ttl, verify=verify, fallback=fallback, link=link)  # type: ignore[arg-type]

    def release_checkout(self, path: str | os.PathLike[str]) -> None:
        """End the registry-owned checkout at ``path`` now (``registry checkout --release DIR``).

        Releases its reader lease and removes the directory; a directory of
        the caller's is refused (it is the caller's to remove).
        """
        from registry.ops.checkouts import release
        if self.read_only:
            raise ReadOnlyError("this registry is read-only; its checkouts are temporary directories, "
                                "removed when closed")
        release(self.catalog, self.store.root, Path(path).absolute())

    def export(self, ref: str | Ref, dest: str | os.PathLike[str], *, format: str = "safetensors",  # noqa: A002
               max_shard_size: int | None = None, overwrite: bool = False) -> Exported:
        """Write ``ref``'s weights and config to ``dest`` as a standalone checkpoint (see :mod:`registry.ops.export`).

        Read through :meth:`load` (verified, falling back past a corrupt
        ``@latest``), without the extras. ``dest`` may be neither inside the
        root nor contain it.
        """
        from registry.ops.export import check_dest, check_format, export
        check_format(format, max_shard_size)
        check_flags(overwrite=overwrite)
        from registry.ops import reading
        where = as_directory(dest, what="export destination")
        check_dest(where, root=self.store.root, catalog=self._catalog_file(), overwrite=overwrite)
        read = reading.load(self._reader(), parse_ref(ref), verify=True, map_location="cpu", trust_pickle=False,
                            extras=False, fallback=True)  # no extra is read, so none needs trusting
        return export(read, where, root=self.store.root, catalog=self._catalog_file(),
                      format=format, max_shard_size=max_shard_size, overwrite=overwrite)  # type: ignore[arg-type]

    def materialize(self, ref: str | Ref, dest: str | os.PathLike[str]) -> Path:
        """Write into the directory ``dest`` exactly the ``model.safetensors`` and ``config.json`` a full publish
        of ``ref``'s version writes (a delta step rebuilt from its chain), checked against the version's digest;
        each file lands atomically (temporary name, fsync, rename). Returns ``dest``."""
        from registry.ops.export import materialize
        return materialize(self._reader(), parse_ref(ref), as_directory(dest, what="materialize destination"))

    def _materialize_traced(self, ref: str, dest: Path) -> tuple[Path, str]:
        """:meth:`materialize`, and the copy it read (a policy consumer's load records it as its source)."""
        from registry.ops.export import materialize_traced
        return materialize_traced(self._reader(), parse_ref(ref), Path(dest).absolute())

    def fold(self, run: str, a: int, b: int) -> FoldInfo:
        """A delta from policy version ``a`` of ``run`` to version ``b``, checked against ``b``'s digest and stored
        under the run's ``.policy-folds/`` (for a consumer that holds ``a``); see :mod:`registry.ops.folds`."""
        from registry.ops.folds import fold
        check_run_name(run)
        check_step(a)
        check_step(b)
        self._require_writable("fold")
        return fold(self._reader(), run, a, b)

    def fold_bytes(self, run: str, a: int, b: int) -> bytes:
        """The stored fold from policy version ``a`` of ``run`` to ``b`` (see :meth:`fold`), read through the root
        (a file, or an object on an ``s3://`` or tiered root) and checked against its recorded sha256; a fold
        whose bytes differ is marked corrupt. ``CheckpointNotFoundError`` when no usable fold is stored."""
        from registry.ops.folds import stored_fold
        check_run_name(run)
        check_step(a)
        check_step(b)
        return stored_fold(self._reader(), run, a, b)

    def publish_policy_marker(self, run: str, version: int, *, note: str | None = None) -> MarkerInfo:
        """Record that policy ``version`` of ``run`` was published outside the registry (its bytes moved over
        NCCL or RDMA), so lag and audit cover it; ``PolicyVersionConflictError`` when it is a stored step.
        The run's consumers lease it as its version (``Lease.marker``), and apply it without materializing."""
        from registry.catalog.consumers import ConsumersCatalog
        from registry.catalog.policy import add_marker
        check_run_name(run)
        check_step(version)
        if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE):
            raise InvalidStateError(f"note must be a string of at most {MAX_NOTE} characters")
        self._require_writable("a policy marker")
        info = add_marker(self.catalog, run, version, note=note, writer=self.writer)
        ConsumersCatalog(self.catalog).wake(run)
        return info

    def _require_writable(self, what: str) -> None:
        if self.read_only:
            raise ReadOnlyError(f"this registry is read-only: it records no {what}")

    def _catalog_file(self) -> Path | None:
        """The SQLite catalog's file (None for a server): no export or import --move may take it."""
        url = self.catalog.engine.url
        return Path(url.database) if url.get_backend_name() == "sqlite" and url.database else None

    def load_into(self, ref: str | Ref, state: Any, *, group: Any = None, keys: Collection[str] | None = None,
                  strict: bool = True, verify: bool = True, trust_pickle: bool = False,
                  timeout: float | None = None, fallback: bool = True) -> ShardedLoad:
        """Load a sharded step into ``state`` in place, collectively on every rank of ``group``.

        Each rank passes its own template (as ``get_state_dict`` gives it, sharded
        any way, or plain full tensors); the step reshards from whatever world
        size it was saved with. Rank 0 resolves ``ref`` (falling back past a
        corrupt ``@latest`` for everyone) and holds the reader lease. ``keys``
        loads only those flat keys (``model`` covers ``model.*``); ``strict``
        refuses a template whose keys differ from the step's, otherwise the
        difference is reported (``missing_keys``, ``unexpected_keys``). Without
        a process group it runs in this process. See :mod:`registry.distributed.sharded`.
        """
        from registry.distributed.sharded import comm_for, load_sharded, set_timeout
        comm = comm_for(group)
        parsed: Ref | None = None
        error: RegistryError | None = None
        try:
            set_timeout(comm, timeout)
            parsed = parse_ref(ref)
            check_flags(strict=strict, verify=verify, trust_pickle=trust_pickle, fallback=fallback)
            if keys is not None and (isinstance(keys, str) or not all(isinstance(k, str) for k in keys)):
                raise InvalidStateError(f"keys must be a list of flat key names, got {keys!r}")
            if not isinstance(state, Mapping):
                raise InvalidStateError(f"state must be a mapping to load into, got {type(state).__name__}")
        except RegistryError as exc:
            error = exc
        result = load_sharded(comm, self._reader() if comm.rank == 0 else None, parsed, str(ref), state,
                              shards=self.root.shards(), keys=keys, strict=strict, verify=verify,
                              trust_pickle=trust_pickle, fallback=fallback, local_error=error)
        if comm.rank == 0 and parsed is not None and result.step is not None:
            self._attempts.note_resume(parsed, result.step, None)
        return result

    def _local_root(self) -> Path:
        """This host's root directory; ``Path()`` on an object-store root, whose readers never look at one."""
        return self.root.local_dir or Path()

    def _reader(self) -> reading.ReadAccess:
        from registry.ops import reading
        return reading.ReadAccess(catalog=self.catalog, home=self.root, root=self._local_root(),
                                  holder=self.writer, lease_ttl=self.lease_ttl, copies=self._copies())

    # ------------------------------------------------------------------ verify

    def verify(self, *refs: str, progress: ProgressFn | None = None) -> list[VerifyResult]:
        """Re-hash checkpoints from storage: every live step of a ``RUN``, or the step a ``REF`` names.

        Intact steps become ``verified``; damaged ones ``corrupt`` (see :mod:`registry.ops.scrub`).
        ``progress`` hears of the bytes hashed (see :mod:`registry.progress`).
        """
        targets: list[CheckpointInfo] = []
        for ref in refs:
            parsed = parse_ref(ref)
            if "@" in ref:
                targets.append(self.placed(self.catalog.resolve(parsed)))  # the row, not where this host reads it
            else:
                targets.extend(i for i in self.checkpoints(parsed.run)
                               if i.status in HAS_PAYLOAD)
        from registry.ops.scrub import scrub
        return scrub(self.catalog, targets, actor=self.writer, progress=progress, home=self.root,
                     copies=self._copies())

    # ------------------------------------------------------------------ followers

    def begin_attempt(self, run: str, *, resumed_from: int | None = None,
                      fork_from: str | Ref | None = None) -> int:
        """Start a new attempt at ``run`` from this process; returns its id.

        An attempt is one process's stint of training (or evaluating) a run;
        every metric point records the attempt that logged it. When an attempt
        that resumed from step N publishes for the first time, the current
        metric points at steps > N logged by *other* attempts (the dead
        trainer's, evaluators' scores of its abandoned steps) become
        superseded: kept in ``metrics(history=True)``, ignored by ``metrics()``
        and ``best:``. Checkpoints of the abandoned steps stay as they are.

        Resuming is explicit, so that loading another step for reference (a
        reference policy, an evaluation) never rewrites the run's history: a
        :meth:`load` of the run's own ``@latest`` or ``@latest-published``
        before this process's first publish to it sets ``resumed_from`` by
        itself, and so does a load of any ref with ``resume=True``; other
        loads do not (``resume=False`` opts out entirely). Call this when the
        trainer resumed some other way (from a directory, from its own
        files), with the step it resumed from, or ``resumed_from=None`` for a
        fresh start that supersedes nothing. Points still buffered are flushed under the
        previous attempt first. An evaluator that never publishes never
        supersedes anything.

        ``fork_from``: a ref to the checkpoint this attempt starts from, of
        another run (fine-tuning a base model) or of this one; it is resolved
        now and every step the attempt publishes records it as its parent
        (``forked``; see :meth:`lineage`), which retention then keeps. A fork
        from this run's own step also resumes from it.
        """
        check_run_name(run)
        if resumed_from is not None:
            check_step(resumed_from)
        fork: Fork | None = None
        if fork_from is not None:
            if resumed_from is not None:
                raise InvalidStateError(f"begin_attempt({run!r}): pass resumed_from or fork_from, not both")
            origin = self.resolve(fork_from)
            fork = (origin.run, origin.step, origin.manifest_sha256)
            if origin.run == run:
                resumed_from = origin.step
        return self._attempts.begin(run, resumed_from=resumed_from, fork=fork)

    def latest(self, run: str, *, min_policy_version: int | None = None,
               published: bool = False) -> CheckpointInfo:
        """``run@latest`` (or ``@latest-published``), optionally only steps whose policy version is at
        least ``min_policy_version``: what an RL rollout worker may act with."""
        check_run_name(run)
        if min_policy_version is not None:
            check_step(min_policy_version)
        ref = Ref(run=run, kind="latest-published" if published else "latest")
        return self.placed(self.catalog.resolve(ref, min_policy_version=min_policy_version))

    def wait_for_new(self, run: str, after_step: int | None = None, timeout: float | None = None, *,
                     newest: bool = False, min_policy_version: int | None = None) -> CheckpointInfo | None:
        """Block until ``run`` has a ``verified`` step above ``after_step``; return it.

        Returns the *next* such step (the lowest, so an evaluator sees every
        one), or with ``newest=True`` the newest (a rollout worker skipping
        ahead). Returns ``None`` when ``timeout`` seconds pass first
        (``None`` waits forever), so a caller loops without try/except. The
        run need not exist yet. PostgreSQL wakes on the NOTIFY sent in the
        publish transaction; SQLite polls with backoff. Either way the answer
        comes from the catalog, never from a notification's payload, so a
        step is never returned before its publish committed.
        """
        from registry.ops.follow import Follower
        with Follower(self.catalog, run, newest=newest, min_policy_version=min_policy_version) as follower:
            info = follower.wait(after_step, timeout=timeout)
        return self.placed(info) if info is not None else None

    def follow(self, run: str, after_step: int | None = None, *, timeout: float | None = None,
               newest: bool = False, min_policy_version: int | None = None,
               durable: bool = False) -> Iterator[CheckpointInfo]:
        """Yield each new verified step of ``run`` above ``after_step`` as it is published.

        Stops when ``timeout`` seconds pass without a new step (``None``: never).
        Keeps one listener open across steps, so nothing published between two
        yields is missed. ``durable=True`` yields only steps with a verified
        copy on the durable tier, as each becomes durable.
        """
        from registry.ops.follow import Follower
        check_flags(durable=durable)
        with Follower(self.catalog, run, newest=newest, min_policy_version=min_policy_version,
                      durable=durable) as follower:
            while (info := follower.wait(after_step, timeout=timeout)) is not None:
                after_step = info.step
                yield self.placed(info)

    # ------------------------------------------------------------------ policy consumers

    def _consumers(self) -> ConsumerHub:
        """This registry's one heartbeat thread and listener for every policy consumer of the process."""
        with self._lock:
            if self._closed:
                raise InvalidStateError("this registry is closed")
            if self._consumer_hub is None:
                from registry.ops.consumers import ConsumerHub
                self._consumer_hub = ConsumerHub(self.catalog, keep_days=self.policy_loads_keep_days)
            return self._consumer_hub

    def subscribe(self, run: str, *, consumer: str, ttl: float = 120.0, host: str | None = None,
                  cache_dir: str | os.PathLike[str] | None = None) -> Subscription:
        """Register ``consumer`` (a rollout worker) of ``run``'s policy versions; a ``Subscription``.

        ``sub.versions()`` yields a lease on each new verified policy version;
        ``lease.materialize()`` is this host's copy of it (under ``cache_dir``,
        default ``ROOT/.registry/policy/``), fetched once per host;
        ``lease.applied()`` records that the consumer serves it. The consumer
        heartbeats on this registry's shared thread and expires ``ttl``
        seconds after its last heartbeat; subscribing the same name again
        revives it. See :mod:`registry.ops.consumers`.
        """
        from registry.ops.consumers import Subscription
        from registry.ops.hostcopies import POLICY_CACHE
        if self.read_only:
            raise ReadOnlyError("this registry is read-only: it registers no policy consumer")
        if cache_dir is None and self.root.local_dir is not None:
            cache_dir = self.root.local_dir / POLICY_CACHE
        return Subscription(self._consumers(), run, consumer, ttl=ttl, host=host,
                            cache_dir=None if cache_dir is None else Path(cache_dir),
                            materialize=self._materialize_traced, source=self.root_url)

    def policy_lag(self, run: str) -> PolicyLag:
        """How far ``run``'s live policy consumers lag behind its newest verified version (``PolicyLag``)."""
        from registry.catalog.consumers import ConsumersCatalog
        return ConsumersCatalog(self.catalog).lag(check_run_name(run))

    def wait_lag(self, run: str, max_lag: int, timeout: float | None = None) -> PolicyLag:
        """Block until no live consumer of ``run`` lags more than ``max_lag`` versions; the lag then.

        A live consumer that serves nothing yet holds this back once a version
        exists (so a trainer that calls ``wait_lag(run, k - 1)`` before each
        publish never lets any consumer fall more than ``k`` behind);
        expired and closed consumers count for nothing, and with no live
        consumer (or no such run yet) it returns at once. ``LagTimeoutError``
        (a ``TimeoutError``) after ``timeout`` seconds.
        """
        from registry.ops.consumers import wait_lag
        return wait_lag(self._consumers(), run, max_lag, timeout=timeout)

    def loads(self, run: str, policy_version: int | None = None) -> list[LoadInfo]:
        """Every consumer's loads of ``run``'s policy versions (or of one), oldest first (``LoadInfo``)."""
        from registry.catalog.consumers import ConsumersCatalog
        if policy_version is not None:
            check_step(policy_version)
        return ConsumersCatalog(self.catalog).loads(check_run_name(run), policy_version=policy_version)

    def prune_policy_loads(self, run: str | None = None, *, older_than: timedelta = timedelta(days=30)) -> int:
        """Forget the policy loads (of ``run``, or of every run) that protect nothing and ended more than
        ``older_than`` ago: released, or of a consumer that ended or expired. Never an unreleased load of a live
        consumer, nor the load of the version a consumer serves. A process with subscriptions does this itself,
        at most hourly, for 30 days. How many were forgotten."""
        from registry.catalog.consumers import ConsumersCatalog
        from registry.catalog.session import utcnow
        if not (isinstance(older_than, timedelta) and older_than >= timedelta(0)):
            raise InvalidStateError(f"older_than must be a timedelta >= 0, got {older_than!r}")
        self._require_writable("prune_policy_loads")
        return ConsumersCatalog(self.catalog).prune_loads(None if run is None else check_run_name(run),
                                                          before=utcnow() - older_than)

    def policy_versions(self, run: str) -> list[PolicyVersionInfo]:
        """Every policy version of ``run`` by version: its step, full/delta/marker, base, size and status."""
        from registry.catalog.consumers import ConsumersCatalog
        return ConsumersCatalog(self.catalog).versions(check_run_name(run))

    # ------------------------------------------------------------------ retention

    def plan_retention(self, run: str, policy: Policy, *, now: datetime | None = None,
                       protect: Mapping[int, str] | None = None, allow_missing_metrics: bool = False,
                       keep_fork_parents: bool = True, reanchor: bool = False) -> RetentionPlan:
        """What ``policy`` would keep and delete in ``run`` (a ``RetentionPlan``); changes nothing.

        ``protect`` adds ``{step: reason}`` protections on top of the invariants;
        ``now`` (timezone-aware) pins the clock for age-based policies. A
        ``KeepBest`` over a metric none of the run's checkpoints has raises
        ``UnknownMetricError`` (a ``PolicyError``) unless ``allow_missing_metrics``.
        A step that a live fork names as its parent is kept unless ``keep_fork_parents=False``.
        A kept policy delta step keeps its chain; with ``reanchor`` the delta steps whose chain stays only for
        them (``plan.anchorable``) are re-anchored first (:meth:`reanchor`, which stores a file), and the plan
        then deletes the chains' older steps.
        """
        from registry.ops.retention import RetentionScope, RootDeletion, make_plan
        if self.root.can.tiers:
            raise InvalidStateError(f"{self.root_url} has a durable tier: retention is per tier, "
                                    "plan_tier_retention(run, policy, tier='fast' or 'durable')")
        check_flags(reanchor=reanchor)
        scope = RetentionScope(catalog=self.catalog, storage=RootDeletion(self.root), actor=self.writer)

        def plan() -> RetentionPlan:
            return make_plan(scope, run, policy, now=now, protect=protect or {},
                             allow_missing_metrics=allow_missing_metrics, keep_fork_parents=keep_fork_parents)
        return self._reanchored(run, plan) if reanchor else plan()

    def _reanchored(self, run: str, plan: Callable[[], P]) -> P:
        """``plan()`` again after re-anchoring what the first one names ``anchorable``; a re-anchoring that fails
        is logged and its chain kept."""
        from registry.catalog.policy import policy_steps
        first = plan()
        steps = first.anchorable
        if not steps:
            return first
        self._require_writable("reanchor")
        for step, row in policy_steps(self.catalog, run, steps).items():
            try:
                if row.version is not None:
                    self.reanchor(run, row.version)
            except RegistryError as exc:
                log.warning("%s@%d was not re-anchored, so its chain stays: %s", run, step, exc)
        return plan()

    def reanchor(self, run: str, version: int) -> AnchorInfo:
        """Store policy version ``version`` of ``run`` whole beside its delta step (the ``model.safetensors`` a full
        publish writes, checked against the version's digest and read back), so the step reads without its chain
        and retention may take the chain's older steps. The step itself is untouched: its row, payload, tags,
        metrics, leases and loads. See :mod:`registry.ops.folds`."""
        from registry.ops.folds import reanchor
        check_run_name(run)
        check_step(version)
        self._require_writable("reanchor")
        return reanchor(self._reader(), run, version)

    def plan_tier_retention(self, run: str, policy: Policy, *, tier: str = "fast", force: bool = False,
                            now: datetime | None = None, protect: Mapping[int, str] | None = None,
                            allow_missing_metrics: bool = False, keep_fork_parents: bool = True,
                            reanchor: bool = False) -> TierPlan:
        """What ``policy`` keeps and deletes of ``run``'s copies on one tier (``fast`` or ``durable``).

        See :mod:`registry.ops.tierretention`: deleting a copy of a step that
        has another good copy leaves the step live; deleting its last copy
        ends it. The fast tier keeps what is not yet durable unless ``force``. The other options are
        :meth:`plan_retention`'s.
        """
        from registry.ops.tierretention import make_tier_plan
        tiers = self._tiers("plan_tier_retention (use plan_retention)")
        check_flags(force=force, allow_missing_metrics=allow_missing_metrics, keep_fork_parents=keep_fork_parents,
                    reanchor=reanchor)

        def plan() -> TierPlan:
            return make_tier_plan(self.catalog, tiers, run, policy, tier=tier,  # type: ignore[arg-type]
                                  force=force, aside=self.root.aside(), now=now, protect=protect or {},
                                  allow_missing_metrics=allow_missing_metrics, keep_fork_parents=keep_fork_parents,
                                  actor=self.writer)
        return self._reanchored(run, plan) if reanchor else plan()

    def apply_retention(self, run: str, policy: Policy, *, protect: Mapping[int, str] | None = None,
                        allow_missing_metrics: bool = False, keep_fork_parents: bool = True,
                        reanchor: bool = False) -> RetentionResult:
        """Plan and execute at once; returns the ``RetentionResult``."""
        return self.plan_retention(run, policy, protect=protect, allow_missing_metrics=allow_missing_metrics,
                                   keep_fork_parents=keep_fork_parents, reanchor=reanchor).execute()

    @staticmethod
    def _check_retention(retention: object) -> None:
        if retention is not None:
            from registry.retention import Policy
            if not isinstance(retention, Policy):
                raise InvalidStateError(f"retention must be a registry.retention.Policy, got {retention!r}")

    def _retention_after_publish(self, run: str, step: int, policy: Policy) -> RetentionResult | None:
        """Apply ``policy`` after ``run@step`` committed, never deleting ``step`` itself.

        The publish has already succeeded when this runs, so a retention
        failure must not make it look failed: a ``RegistryError`` or ``OSError``
        becomes a ``RetentionWarning`` and the publish returns normally (the
        next publish, or ``registry gc``, retries; a half-done deletion is
        finished by the next gc). Returns the result, or None after a failure.
        """
        from registry.retention import RetentionWarning
        try:
            if self.root.can.tiers:  # a trainer's policy is its fast tier's
                self.plan_tier_retention(run, policy, protect={step: "just published"}).execute()
                return None
            return self.apply_retention(run, policy, protect={step: "just published"})
        except (RegistryError, OSError) as exc:
            warnings.warn(f"retention after publishing {run}@{step} failed: {exc}", RetentionWarning,
                          stacklevel=3)
            return None

    # ------------------------------------------------------------------ import

    def import_checkpoint(self, path: str | os.PathLike[str], *, run: str, step: int, move: bool = False,
                          overwrite: bool = False, tags: Iterable[str] = (),
                          progress: ProgressFn | None = None) -> CheckpointInfo:
        """Adopt a checkpoint directory written elsewhere as ``run@step``.

        Accepts the reference module's layout (its manifest checksums are
        checked), a legacy directory without a manifest, and a Hugging Face
        style one with shards (see :mod:`registry.fs.importer`). The files go
        through the same two-phase publish as :meth:`publish` and get a
        manifest of their own. By default they are copied; with ``move`` they
        are hard-linked into the staging directory (same filesystem only) and
        the originals removed once the catalog has committed, so a crash at
        any moment leaves the source intact.
        """
        from registry.fs.importer import int_field, provenance, remove_originals, scan, stage
        from registry.ops.protocol import RecordOnly, Target, publish_sequence
        self.root.require("local_import", "import")
        check_run_name(run)
        check_step(step)
        check_flags(move=move, overwrite=overwrite)
        tags = check_tags(tags)
        source = as_directory(path, what="import source")
        if move:  # moving takes the files away: never from a published checkpoint, never the root itself
            check_outside_root(source, self.store.root, what="import --move source", catalog=self._catalog_file())
        foreign = scan(source)
        relpath = self.root.new_relpath(run, step)
        if (self.store.root / relpath).resolve() == foreign.directory.resolve():
            raise InvalidStateError(f"{foreign.directory} already is {run}@{step}'s directory; "
                                    "'registry fsck --repair' adopts directories written outside the catalog")
        meta = foreign.meta
        target = Target(run=run, step=step, root=self.store.root, relpath=relpath,
                        writer=self.writer, overwrite=overwrite, dedup=self.dedup,
                        epoch=int_field(meta, "epoch", 0) or 0,
                        consumed_samples=int_field(meta, "consumed_samples", 0) or 0)

        def record(payload: PayloadRecord) -> CommitRecord:
            source = provenance(foreign, {f.name: f.sha256 for f in payload.files})
            return CommitRecord(payload=payload, tags=tags, lineage=LineageRecord(how="imported", source=source))
        info = publish_sequence(self.catalog, target, lambda staging, _reuse: stage(foreign, staging, move=move,
                                                                                    progress=progress),
                                self._copy_hooks(RecordOnly(record), run, step), self.root.landing(relpath))
        if move:
            remove_originals(foreign)
        self._kick_replication()
        return self.placed(info)

    @overload
    def publish_files(self, path: str | os.PathLike[str], *, run: str, step: int, files: Collection[str],
                      meta: Mapping[str, Any] | None = ..., extra: Mapping[str, Any] | None = ...,
                      epoch: int = ..., optimizer_step: int | None = ..., tags: Iterable[str] = ...,
                      retention: Policy | None = ..., overwrite: bool = ..., adopt: bool = ...,
                      trust_pickle: bool = ..., blocking: Literal[True] = ...) -> CheckpointInfo: ...

    @overload
    def publish_files(self, path: str | os.PathLike[str], *, run: str, step: int, files: Collection[str],
                      meta: Mapping[str, Any] | None = ..., extra: Mapping[str, Any] | None = ...,
                      epoch: int = ..., optimizer_step: int | None = ..., tags: Iterable[str] = ...,
                      retention: Policy | None = ..., overwrite: bool = ..., adopt: bool = ...,
                      trust_pickle: bool = ..., blocking: Literal[False]) -> Future[CheckpointInfo]: ...

    @overload
    def publish_files(self, path: str | os.PathLike[str], *, run: str, step: int, files: Collection[str],
                      meta: Mapping[str, Any] | None = ..., extra: Mapping[str, Any] | None = ...,
                      epoch: int = ..., optimizer_step: int | None = ..., tags: Iterable[str] = ...,
                      retention: Policy | None = ..., overwrite: bool = ..., adopt: bool = ...,
                      trust_pickle: bool = ..., blocking: bool = ...) -> CheckpointInfo | Future[CheckpointInfo]: ...

    def publish_files(self, path: str | os.PathLike[str], *, run: str, step: int, files: Collection[str],
                      meta: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
                      epoch: int = 0, optimizer_step: int | None = None, tags: Iterable[str] = (),
                      retention: Policy | None = None, overwrite: bool = False, adopt: bool = False,
                      trust_pickle: bool = False, blocking: bool = True) -> CheckpointInfo | Future[CheckpointInfo]:
        """Publish ``files`` of a directory a trainer just saved (its weights among them) as ``run@step``.

        As :meth:`publish` does (the run's buffered metrics in the same
        commit, ``retention`` after it), but the files go in as they are, each
        read once to hash it; ``meta`` and ``extra`` are written beside them
        as a publish writes them, and every ``NAME.pt`` among the files must
        load with ``weights_only`` unless ``trust_pickle``. With ``adopt``
        the files are hard-linked into the step when the directory is on the
        root's filesystem (copied otherwise): write them no more, and remove
        the directory once this returns. A crash leaves the directory as it was.

        ``blocking=False`` returns a future once the arguments are checked and
        the files found: the hashing, the pickle check and the commit run on
        the background publisher, in call order with :meth:`publish`'s. The
        files must stay as they are until the future is done (remove an
        adopted directory then); :meth:`wait` waits for it and a failure is
        raised as by a background publish.
        """
        from registry.fs.importer import Hashing, Own, check_pickles, scan, stage
        from registry.ops.protocol import Target, publish_sequence
        self.root.require("local_import", "publish_files")
        self._background.raise_error()
        check_run_name(run)
        check_step(step)
        check_flags(overwrite=overwrite, adopt=adopt, trust_pickle=trust_pickle, blocking=blocking)
        self._check_retention(retention)
        tags = check_tags(tags)
        source = as_directory(path, what="publish_files source")
        if adopt:  # the step will share the files' inodes: never a published checkpoint's
            check_outside_root(source, self.store.root, what="publish_files(adopt=True) source",
                               catalog=self._catalog_file())
        foreign = scan(source, files)
        own = Own.checked(meta=meta, extra=extra, epoch=epoch, trust_pickle=trust_pickle,
                          optimizer_step=step if optimizer_step is None else optimizer_step, timestamp=now_timestamp())
        own.check_beside(foreign)

        def publish(queued: bool) -> CheckpointInfo:
            # on one filesystem the files are read (hashed) from now on: the checks and the claim overlap the reads
            hashing = Hashing(foreign) if adopt and os.stat(foreign.directory).st_dev == os.stat(
                self.store.root).st_dev else None
            try:
                check_pickles(foreign, trust_pickle=trust_pickle)
                relpath = self.root.new_relpath(run, step)
                target = Target(run=run, step=step, root=self._local_root(), relpath=relpath, writer=self.writer,
                                overwrite=overwrite, epoch=own.meta["epoch"])
                hooks = self._copy_hooks(self._attempts.hooks(run, step, metrics=(), tags=tags, lineage=None), run,
                                         step)
                if not queued:
                    self._background.wait()  # publishes commit in call order, background ones first
                    self._background.raise_error()
                info = publish_sequence(self.catalog, target, lambda staging, _reuse: stage(
                    foreign, staging, move=adopt, own=own, copy_across=True, hashing=hashing), hooks,
                    self.root.landing(relpath))
            finally:
                if hashing is not None:
                    hashing.wait()
            self._kick_replication()
            if retention is not None:
                self._retention_after_publish(run, step, retention)
            return self.placed(info)

        if not blocking:
            return self._background.submit(f"{run}@{step}", lambda: publish(queued=True))
        return publish(queued=False)

    # ------------------------------------------------------------------ lineage and diff

    def lineage(self, ref: str | Ref) -> list[LineageHop]:
        """The step ``ref`` names and its ancestors up to the root, nearest first (see
        :mod:`registry.catalog.lineage`): one record per hop, with how it came from the next one
        (``resumed``, ``forked``, ``imported``...), when, and its status now. A numbered ref also
        names a deleted step, whose history stays."""
        parsed = parse_ref(ref)
        step = parsed.step if parsed.kind == "step" and parsed.step is not None else self.resolve(parsed).step
        hops = LineageCatalog(self.catalog).chain(parsed.run, step)
        if not hops:
            self.resolve(parsed)  # raises the not-found error that names what is missing
        return hops

    def descendants(self, ref: str | Ref, *, forks_only: bool = True) -> list[LineageHop]:
        """The steps forked from the step ``ref`` names (any run); ``forks_only=False`` adds resumes."""
        check_flags(forks_only=forks_only)
        parsed = parse_ref(ref)
        step = parsed.step if parsed.kind == "step" and parsed.step is not None else self.resolve(parsed).step
        return LineageCatalog(self.catalog).descendants(parsed.run, step, forks_only=forks_only)

    def diff(self, ref_a: str | Ref, ref_b: str | Ref, *, values: bool = False) -> CheckpointDiff:
        """What changed from ``ref_a`` to ``ref_b``: tensors, files, config and metrics (see
        :mod:`registry.ops.diff`). Unchanged tensors are found from the manifests' piece digests
        without reading them; ``values`` adds the size of each content change."""
        from registry.ops.diff import diff_checkpoints
        check_flags(values=values)
        self.root.require("directories", "diff")  # it reads directories
        copies = self._copies()  # a step with no copy on this host is fetched into its cache first
        a, b = (copies.local(self.placed(self.catalog.resolve(parse_ref(ref)))) for ref in (ref_a, ref_b))
        return diff_checkpoints(self._reader(), a, b, values=values)

    # ------------------------------------------------------------------ fsck

    def fsck(self, repair: bool = False, *, checksums: bool = False,
             progress: ProgressFn | None = None) -> FsckReport:
        """Reconcile the catalog with the root (docs/reference/protocol.md); ``repair`` fixes what it finds.

        Never called implicitly: :meth:`open` does not repair, and publish and
        load stay correct while problems are pending. ``checksums`` re-hashes
        every live step instead of checking sizes and manifest digests;
        ``progress`` hears of the bytes re-hashed.
        """
        from registry.ops.fsck import run_fsck
        check_flags(repair=repair, checksums=checksums)
        if self.root.can.tiers:  # the fast directory as on any root, then the copies on each tier
            from registry.ops.tierfsck import run_tier_fsck
            tiered = self.root.tiered()
            assert tiered is not None, "a root that can do tiers is a Tiered"
            return run_tier_fsck(catalog=self.catalog, tiers=self._tiers("fsck"), scan=tiered.scan(),
                                 durable_scan=tiered.durable_scan(),
                                 replicator=None if self.read_only else self._replication(),
                                 repair=repair, checksums=checksums, actor=self.writer, progress=progress)
        return run_fsck(catalog=self.catalog, scan=self.root.scan(), repair=repair, checksums=checksums,
                        progress=progress, actor=self.writer)

    # ------------------------------------------------------------------ async publish
    #
    # ``publish(..., blocking=False)`` validates on the caller's thread and
    # refuses a step that exists or is already queued (a read, no commit), then
    # copies every tensor of the state dict and of ``extra`` into a reusable
    # CPU arena (pinned when the source is on CUDA; see ``registry.fs.snapshot``)
    # and returns a future. Everything durable, the claim included, happens on
    # one background thread per registry, which runs the queued publishes one
    # at a time, in call order, so a trainer's steps commit in step order and
    # the trainer never waits for an fsync. A step another process claims in
    # between fails on the future. ``wait()`` and ``close()`` wait for the
    # queue; a blocking publish waits for it first. A failed background
    # publish sets its future's exception and is raised once more, as
    # ``AsyncPublishError``, by the next ``publish``, ``wait`` or ``close``.

    def wait(self) -> None:
        """Block until every background publish has committed or failed; raise the first failure."""
        self._background.wait()
        self._background.raise_error()

    def pending_publishes(self) -> int:
        """How many background publishes have not finished yet."""
        return self._background.pending()

    def _submit_publish(self, job: _PublishJob) -> Future[CheckpointInfo]:
        unqueue = self._reserve(job)
        try:
            snap = self._snapshots.take(job.payload.state_dict, job.payload.extra)
        except BaseException:
            unqueue()
            raise
        # meta and config were encoded at the door: only the tensors need copying
        payload = replace(job.payload, state_dict=snap.state_dict, extra=snap.extra)
        snapped = replace(job, payload=payload)

        def run() -> CheckpointInfo:
            try:
                return self._run_publish(snapped)
            finally:
                snap.release()
                unqueue()
        try:
            return self._background.submit(f"{job.run}@{job.step}", run)
        except BaseException:
            snap.release()
            unqueue()
            raise

    def __repr__(self) -> str:
        from registry.catalog.session import safe_url
        return f"Registry(url={safe_url(self.catalog.engine.url)!r}, root={self.root_url!r})"


__all__ = ["PublishOptions", "Registry", "RegistryError", "step_dirname"]
