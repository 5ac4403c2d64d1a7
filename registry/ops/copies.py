"""Which copy of a step this host reads, and what a bad read of that copy condemns: one object per root.

Every reader above the roots (a load, a distributed load, a checkout, a diff,
verify) asks the same questions of a step: which directory of this host holds
its payload, and, when the bytes read there are bad, is that a verdict on one
copy or on the step? The answers differ by root, so they are answered by one
object per root, chosen once (:func:`copies_of`), instead of at each reader:

- :class:`OneCopy` (a directory or an ``s3://`` root): the root's copy is the
  step's only copy. It is read where the root places it, and bad bytes there
  (read again first, see :mod:`registry.ops.verdicts`) are the step's verdict.
- :class:`HostCopies` (a root with tiers): a step has a fast copy on the host
  that wrote it, this host's cached download, and a durable copy. The nearest
  verified one is read (:func:`registry.ops.tiers.nearest`); a bad copy is
  condemned alone while another verified copy of the same payload stands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from registry.records import CheckpointInfo
from registry.roots.base import refusal

if TYPE_CHECKING:
    from registry.catalog import Catalog
    from registry.fs.filemaps import Extras, Loaded
    from registry.ops.tiers import Tiers
    from registry.roots.base import Root

T = TypeVar("T")


class Copies(Protocol):
    """A root's copies of each step, as this host reads and judges them."""

    @property
    def several(self) -> bool:
        """Whether a step may have copies besides the one this host reads (a bad one is then that copy's fault
        alone while another stands)."""

    @property
    def tiers(self) -> Tiers | None:
        """The fast and durable roots of a root with tiers; None for a root whose copy is the step's only one."""

    def tiered(self, what: str) -> Tiers:
        """:attr:`tiers`, or the root's one-line refusal of ``what``, which needs them."""

    def load(self, info: CheckpointInfo, *, verify: bool, map_location: Any, trust_pickle: bool,
             extras: Extras, on_read: Callable[[str], None] | None = None) -> Loaded:
        """The placed step's tensors from its nearest verified copy, matched against the catalog's digest;
        ``on_read`` is told which copy that was (a directory of this host, else the copy's URL)."""

    def nearest(self, info: CheckpointInfo, read: Callable[[Path, bool], T], *, verify: bool) -> T:
        """``read(directory, check)`` of the directory of this host nearest to the step's payload; ``read`` raises
        ``CorruptCheckpointError`` on bytes that do not match and may be called again on another copy."""

    def mapped(self, info: CheckpointInfo, read: Callable[[Path, bool], T], *, verify: bool, fast: bool) -> T:
        """:meth:`nearest` for a mapped (distributed) read, which checks what it maps itself: the copy here is
        read unchecked; ``fast`` False when that copy proved bad (read another)."""

    def condemn(self, info: CheckpointInfo, digest: str, reason: str) -> bool:
        """Record this host's copy of ``info`` bad instead of the step, when another verified copy of the same
        payload stands; False (nothing recorded): the verdict is the step's."""

    def restore(self, info: CheckpointInfo, digest: str) -> None:
        """This host's copy of ``info``, marked bad, read intact again: recorded good again."""

    def holds(self, info: CheckpointInfo) -> bool:
        """Whether this host's directory of the placed step is a copy of its payload (a damaged one included)."""

    def located(self, info: CheckpointInfo) -> CheckpointInfo:
        """Where this host finds the placed step: a directory that holds its payload, else where a load reads."""

    def local(self, info: CheckpointInfo) -> CheckpointInfo:
        """The placed step at a directory of this host holding its payload, fetched now if it needs to be."""


@dataclass(frozen=True)
class OneCopy:
    """:class:`Copies` of a root whose copy of a step is the step's only copy."""

    home: Root
    several = False
    tiers = None

    def tiered(self, what: str) -> Tiers:
        raise refusal(self.home, "tiers", what)

    def load(self, info: CheckpointInfo, *, verify: bool, map_location: Any, trust_pickle: bool,
             extras: Extras, on_read: Callable[[str], None] | None = None) -> Loaded:
        loaded = self.home.read(info, verify=verify, trust_pickle=trust_pickle, map_location=map_location,
                                extras=extras)
        if on_read is not None:
            on_read(info.url or str(info.path))
        return loaded

    def nearest(self, info: CheckpointInfo, read: Callable[[Path, bool], T], *, verify: bool) -> T:
        return read(info.path, verify)

    def mapped(self, info: CheckpointInfo, read: Callable[[Path, bool], T], *, verify: bool, fast: bool) -> T:
        return read(info.path, False)

    def condemn(self, info: CheckpointInfo, digest: str, reason: str) -> bool:
        return False

    def restore(self, info: CheckpointInfo, digest: str) -> None:
        return None

    def holds(self, info: CheckpointInfo) -> bool:
        return True

    def located(self, info: CheckpointInfo) -> CheckpointInfo:
        return info

    def local(self, info: CheckpointInfo) -> CheckpointInfo:
        return info


@dataclass(frozen=True)
class HostCopies:
    """:class:`Copies` of a root with tiers, as this host (``holder``) sees them: see :mod:`registry.ops.tiers`."""

    tiers: Tiers
    catalog: Catalog
    holder: str
    several = True

    def tiered(self, what: str) -> Tiers:
        return self.tiers

    def load(self, info: CheckpointInfo, *, verify: bool, map_location: Any, trust_pickle: bool,
             extras: Extras, on_read: Callable[[str], None] | None = None) -> Loaded:
        from registry.ops.tiers import read_nearest

        def read_from(directory: Path) -> None:
            if on_read is not None:  # a temporary download of the durable copy is gone once read: name that copy
                fast = directory.is_relative_to(self.tiers.fast.root)
                on_read(str(directory) if fast else self.located(info).url or str(directory))
        return read_nearest(self.tiers, self.catalog, info, verify=verify, map_location=map_location,
                            trust_pickle=trust_pickle, extras=extras, holder=self.holder, on_read=read_from)

    def nearest(self, info: CheckpointInfo, read: Callable[[Path, bool], T], *, verify: bool) -> T:
        from registry.ops.tiers import nearest
        return nearest(self.tiers, self.catalog, info, read, verify=verify, holder=self.holder)

    def mapped(self, info: CheckpointInfo, read: Callable[[Path, bool], T], *, verify: bool, fast: bool) -> T:
        from registry.ops.tiers import read_local
        return read_local(self.tiers, self.catalog, info, read, verify=verify, holder=self.holder, fast=fast)

    def condemn(self, info: CheckpointInfo, digest: str, reason: str) -> bool:
        from registry.ops.tiers import mark_fast_copy
        return mark_fast_copy(self.tiers, self.catalog, info.run, info.step, info.path, digest, reason,
                              actor=self.holder)

    def restore(self, info: CheckpointInfo, digest: str) -> None:
        from registry.ops.tiers import restore_fast_copy
        restore_fast_copy(self.tiers, self.catalog, info.run, info.step, info.path, digest, actor=self.holder)

    def holds(self, info: CheckpointInfo) -> bool:
        from registry.catalog.replicas import ReplicaCatalog
        from registry.ops.tiers import older_payload_here
        return info.path.is_dir() and not older_payload_here(self.tiers, ReplicaCatalog(self.catalog), info.run,
                                                             info.step, info.path, info.manifest_sha256)

    def located(self, info: CheckpointInfo) -> CheckpointInfo:
        from registry.ops.tiers import located_here
        return located_here(self.tiers, self.catalog, info)

    def local(self, info: CheckpointInfo) -> CheckpointInfo:
        from registry.ops.tiers import local_copy
        return local_copy(self.tiers, self.catalog, info, holder=self.holder)


class Traced:
    """:class:`Copies` that remember which copy each step's bytes were last read from (:attr:`read`; see
    :meth:`Copies.load`'s ``on_read``). Everything else is the wrapped copies' own."""

    def __init__(self, inner: Copies) -> None:
        self.inner = inner
        self.read: dict[tuple[str, int], str] = {}

    @property
    def several(self) -> bool:
        return self.inner.several

    @property
    def tiers(self) -> Tiers | None:
        return self.inner.tiers

    def tiered(self, what: str) -> Tiers:
        return self.inner.tiered(what)

    def load(self, info: CheckpointInfo, *, verify: bool, map_location: Any, trust_pickle: bool,
             extras: Extras, on_read: Callable[[str], None] | None = None) -> Loaded:
        def record(where: str) -> None:
            self.read[(info.run, info.step)] = where
            if on_read is not None:
                on_read(where)
        return self.inner.load(info, verify=verify, map_location=map_location, trust_pickle=trust_pickle,
                               extras=extras, on_read=record)

    def nearest(self, info: CheckpointInfo, read: Callable[[Path, bool], T], *, verify: bool) -> T:
        return self.inner.nearest(info, read, verify=verify)

    def mapped(self, info: CheckpointInfo, read: Callable[[Path, bool], T], *, verify: bool, fast: bool) -> T:
        return self.inner.mapped(info, read, verify=verify, fast=fast)

    def condemn(self, info: CheckpointInfo, digest: str, reason: str) -> bool:
        return self.inner.condemn(info, digest, reason)

    def restore(self, info: CheckpointInfo, digest: str) -> None:
        self.inner.restore(info, digest)

    def holds(self, info: CheckpointInfo) -> bool:
        return self.inner.holds(info)

    def located(self, info: CheckpointInfo) -> CheckpointInfo:
        return self.inner.located(info)

    def local(self, info: CheckpointInfo) -> CheckpointInfo:
        return self.inner.local(info)


def copies_of(root: Root, catalog: Catalog, *, holder: str) -> Copies:
    """The :class:`Copies` of ``root``: the one place a reader's behaviour is chosen by the kind of root."""
    tiered = root.tiered()
    if not root.can.tiers or tiered is None:
        return OneCopy(root)
    from registry.ops.tiers import Tiers
    tiers = Tiers(fast=tiered.store, durable=tiered.objects, tier_id=tiered.tier_id, cached=tiered.cached)
    return HostCopies(tiers, catalog, holder)


__all__ = ["Copies", "HostCopies", "OneCopy", "Traced", "copies_of"]
