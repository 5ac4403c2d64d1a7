"""The root interface: what every kind of root answers, and the one table of what a kind cannot do.

A capability a root lacks is refused by :meth:`Root.require` with one line
from :data:`REFUSALS`, never hidden behind a silent no-op; callers never ask
which kind a root is, only whether it can.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from registry.errors import InvalidStateError, RootError
from registry.records import CheckpointInfo

if TYPE_CHECKING:
    from registry.fs.objects import ObjectRoot
    from registry.format.manifest import Manifest
    from registry.roots.aside import Aside
    from registry.fs.filemaps import Extras, Loaded
    from registry.fs.payloadfiles import Payload, Written
    from registry.fs.store import FileProblem, Reuse, Store
    from registry.roots.landing import Landing
    from registry.roots.scan import Scan
    from registry.roots.shards import Shards

Capability = Literal["links", "sharded", "local_import", "directories", "tiers"]


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a kind of root can do.

    ``links``: files of two steps may be one inode (dedup); ``sharded``: DCP
    sharded publish and ``load_into``; ``local_import``: a local directory is
    adopted by staging it beside the step; ``directories``: every step this
    host reads is a directory of its filesystem (checkout, export, diff, the
    shared-filesystem broadcast); ``tiers``: a durable tier that steps are
    replicated to, with per-tier retention.
    """

    links: bool = False
    sharded: bool = False
    local_import: bool = False
    directories: bool = False
    tiers: bool = False

    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


# capability -> (error class, the line): "{what}" is the request, "{url}" the root, "{named}" the root with its kind
REFUSALS: dict[Capability, tuple[type[Exception], str]] = {
    "links": (InvalidStateError, "{what} is not supported on {named}: objects cannot be hard-linked"),
    "sharded": (InvalidStateError, "{what} is not supported on {named}; publish a full state dict, or use a "
                                   "filesystem root"),
    "local_import": (RootError, "{what} needs a filesystem checkpoint root; {url} is an object-store root"),
    "directories": (RootError, "{what} needs a filesystem checkpoint root; {url} is an object-store root"),
    "tiers": (InvalidStateError, "{url} has no durable tier: {what} needs one (open it with durable=s3://...)"),
}


class Gone(Protocol):
    """A step marked ``deleted`` whose payload is to be removed: where it was, and which payload."""

    @property
    def step(self) -> int: ...

    @property
    def path(self) -> str: ...

    @property
    def manifest_sha256(self) -> str | None: ...


class Removal(Protocol):
    """What retention needs of a root's storage: what located steps hold, and removing what a deletion left."""

    def held(self, info: CheckpointInfo) -> Mapping[Any, int]:
        """What a located step occupies, by storage unit (an inode), with sizes; empty: use its catalog size."""

    def freed_bytes(self, doomed: Sequence[CheckpointInfo]) -> int:
        """The bytes removing the located ``doomed`` steps would free."""

    def kept_bytes(self, kept: Sequence[CheckpointInfo]) -> int:
        """The bytes the located ``kept`` steps hold, each unit once."""

    def shared_bytes(self, doomed: Sequence[Path], kept: Sequence[Path]) -> int:
        """Of what the ``doomed`` steps hold, the bytes ``kept`` steps hold too (they stay)."""

    def remove(self, gone: Gone) -> bool:
        """Remove what ``gone`` left; False when nothing was there. Raises ``OSError``."""

    def finish(self, run: str, gone: Sequence[Gone]) -> tuple[set[int], dict[int, str]]:
        """Finish killed deletions of ``gone`` (the run's ``deleted`` rows): steps healed, and errors."""


class Root(Protocol):
    """A place payloads live. ``url`` is what users see: an absolute directory or ``s3://BUCKET/PREFIX``."""

    @property
    def url(self) -> str: ...

    @property
    def kind(self) -> str:
        """How messages name the kind: ``directory``, ``s3`` or ``tiered``."""

    @property
    def can(self) -> Capabilities: ...

    def place(self, info: CheckpointInfo) -> CheckpointInfo:
        """A catalog row (its path relative to the root) as readers find it: an absolute path, or its URL set."""

    def reopen(self) -> dict[str, str]:
        """The ``Registry.open`` arguments (besides the catalog's ``url``) that open this root again, as a user
        writes them: ``root``, and ``durable`` for a tiered root."""

    def new_relpath(self, run: str, step: int) -> str:
        """Where a new publish of ``run@step`` lands, relative to the root (what the catalog records)."""

    def scan(self) -> Scan:
        """What the root's storage holds, as fsck's one judge reads it (see :mod:`registry.roots.scan`)."""

    def removal(self) -> Removal:
        """How retention measures and removes this root's payloads."""

    def landing(self, relpath: str) -> Landing:
        """Phases 2-3 of a publish to ``relpath`` (see :mod:`registry.roots.landing`)."""

    def aside(self) -> Aside:
        """Where the root keeps files beside its steps (a run's policy folds): see :mod:`registry.roots.aside`."""

    def write(self, dest: Any, payload: Payload, reuse: Reuse | None) -> Written:
        """Fill what :meth:`Landing.prepare` returned with ``payload``, hashing as it writes."""

    def shards(self) -> Shards:
        """How a sharded (DCP) step's files are written where :meth:`Landing.prepare` said, and read back."""

    def require(self, capability: Capability, what: str) -> None:
        """Return if the root can do ``capability``; else raise the one-line refusal of :data:`REFUSALS`."""

    @property
    def local_dir(self) -> Path | None:
        """The root's directory on this host (a tiered root's fast one); None for an object store."""

    def manifest_bytes(self, info: CheckpointInfo) -> tuple[bytes, Path]:
        """The stored manifest of the placed step ``info``, unparsed, and where it was read (for messages)."""

    def stored_manifest(self, info: CheckpointInfo) -> tuple[Manifest | None, str]:
        """The placed step's manifest as stored now and the sha256 of its bytes, or None and why it is not a
        valid one (the step's fault); ``CheckpointReadError`` when this host cannot read it (never the step's)."""

    def rehash(self, info: CheckpointInfo, manifest: Manifest, *, on_bytes: Callable[[int], None]) -> list[FileProblem]:
        """Re-read and hash every file ``manifest`` lists as stored now: what differs. ``CheckpointReadError``
        when this host cannot read them (gone while being read included)."""

    def read(self, info: CheckpointInfo, *, verify: bool, trust_pickle: bool, map_location: Any,
             extras: Extras = True) -> Loaded:
        """The placed step's payload as stored here, matched against the catalog's manifest digest (a tiered
        root's fast copy; its nearest copy is ``registry.ops.tiers.nearest``'s to find)."""

    def holds(self, relpath: str) -> bool:
        """Whether a payload is at ``relpath`` (the binding's evidence that this is the catalog's root)."""

    def read_marker(self) -> str | None:
        """The id of the catalog the root is bound to (``.registry/root.json``), or None for an unbound root."""

    def write_marker(self, catalog_id: str, *, bound_from: str, overwrite: bool = False) -> None:
        """Bind the root to ``catalog_id``; ``overwrite`` rebinds a root bound to another catalog."""

    def remove_marker(self) -> None:
        """Undo :meth:`write_marker` (a binding the catalog did not record)."""

    def local_store(self, what: str) -> Store:
        """This host's directory of the root (a tiered root's fast one); refused where there is none."""

    def object_store(self) -> ObjectRoot | None:
        """The object store the root is, or None (a tiered root's durable tier is not the root)."""

    def tiered(self) -> Tiered | None:
        """The root as a fast directory over a durable tier, or None."""


class Tiered(Root, Protocol):
    """A root that is a fast directory on this host (``store``) over a durable object store (``objects``);
    ``tier_id`` names this host's fast directory among those sharing the durable one."""

    @property
    def store(self) -> Store: ...

    @property
    def objects(self) -> ObjectRoot: ...

    @property
    def tier_id(self) -> str: ...

    @property
    def cached(self) -> bool: ...

    def durable_scan(self) -> Scan:
        """What the durable tier holds, as fsck's one judge reads it (:meth:`scan` is the fast directory's)."""


def refusal(root: Root, capability: Capability, what: str) -> Exception:
    """The one-line error that refuses ``what``, which needs ``capability``, on ``root``."""
    cls, text = REFUSALS[capability]
    named = f"an s3:// root ({root.url})" if root.kind == "s3" else f"a {root.kind} root ({root.url})"
    return cls(text.format(what=what, url=root.url, named=named))


def refuse(root: Root, capability: Capability, what: str) -> None:
    """:meth:`Root.require`, written once for every kind."""
    if not getattr(root.can, capability):
        raise refusal(root, capability, what)


__all__ = ["Capabilities", "Capability", "Gone", "REFUSALS", "Removal", "Root", "Tiered", "refusal", "refuse"]
