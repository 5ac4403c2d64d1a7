"""What a root's storage holds, as fsck's one judge (``registry.ops.fsck``) asks it: the interface of a scan.

fsck judges each step by its catalog row and what storage holds of it; the
*rules* (what a row's state and its payload mean, when to read again before a
verdict, compare-and-set on the state seen) are the judge's, written once.
What a kind of root holds and how it is put right are the scan's:

* :class:`Stored`: one payload of a step (a step directory, a retired one, an
  attempt prefix), checked against its manifest on request;
* :class:`StepFound`: all a root holds of one step, looked at again after the
  catalog was read: the payload at a row's path, an older payload an
  interrupted overwrite left, what a step with no row could adopt, what a
  deletion left, and the leftovers (staging directories, retired payloads,
  orphan prefixes, incomplete uploads), each with its own removal;
* :class:`Scan`: the whole root, listed before the catalog is read (so every
  staging directory or prefix seen belongs to a claim the catalog shows).

A scan knows storage, never the catalog: it reports and removes what it is
told to; whether a row still names a thing is the judge's to ask.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from registry.format.manifest import Manifest
    from registry.roots.aside import Aside

StepKey = tuple[str, int]


@dataclass(frozen=True, kw_only=True)
class Valid:
    """A payload that is whole: its manifest, the sha256 of the manifest's bytes, the manifest file's size and
    ``meta.json``'s document (None without one, or when it cannot be read)."""

    manifest: Manifest
    digest: str
    manifest_size: int
    meta: Any


@dataclass(frozen=True, kw_only=True)
class Checked:
    """What one look at a payload found: ``valid``, or ``why`` not; ``digest``, the sha256 of the manifest bytes
    that look read (None when there were none), which a verdict on it is compared-and-set on; ``vanished``: it
    went away while being read (removed meanwhile: nothing to judge)."""

    valid: Valid | None
    why: str
    digest: str | None
    vanished: bool = False


class Stored(Protocol):
    """One payload of a step in storage."""

    @property
    def rel(self) -> str:
        """Where it is, relative to the root (what a catalog row's path records)."""

    @property
    def path(self) -> Path:
        """How a problem names it: an absolute directory, or the prefix relative to the root."""

    @property
    def url(self) -> str | None:
        """Its URL on an object store, else None."""

    def check(self, *, checksums: bool, on_bytes: Callable[[int], object] | None = None) -> Checked:
        """Whether the payload is valid: its manifest parses, every file it lists is there at its size, and with
        ``checksums`` every byte hashes to the manifest's sha256. A payload that vanishes while being read is
        invalid; any other failure to read raises ``OSError``: it says nothing about the payload."""

    def digest(self) -> str | None:
        """The sha256 of the payload's manifest as stored now; None when there is none to read."""


@dataclass(frozen=True, kw_only=True)
class Leftover:
    """Something a step's payload left in storage that is no payload a row could name: removed by ``remove``,
    which returns False or why when it removed nothing (the thing changed meanwhile)."""

    kind: str                       # the fsck problem kind: abandoned-staging, orphan-prefix, ...
    path: Path
    detail: str
    remove: Callable[[], bool | str]
    url: str | None = None
    rel: str | None = None          # the payload place it is, which a row may name meanwhile; None: never named
    claimed: bool = False           # a claim on the step (even a dead writer's) owns it while it stands
    unadopted: bool = False         # a whole-looking payload: with no row at all, adoption judges it, not removal


class StepFound(Protocol):
    """What a root holds of one step, looked at again once the catalog was read (at the path the step's row
    records, or where a publish would have put a step without a row). Stateful: an older payload handed out by
    :meth:`older` is no leftover any more, nor are the places a deletion left."""

    @property
    def absent(self) -> str:
        """How a message says that nothing is at the step's path ("no directory", "no manifest at URL")."""

    def payload(self) -> Stored | None:
        """The payload at the step's path, or None when nothing is there."""

    def present(self) -> bool:
        """Whether a payload is at the step's path now (looked at again, not from the listing)."""

    def older(self, *, digest: str | None, claim: bool, theirs: Collection[Path] = ()) -> tuple[Stored, str] | None:
        """With nothing at the step's path: an older payload of the step that an interrupted overwrite left, and
        how to say so; or None. ``digest``: the manifest sha256 the row records; ``claim``: the row is a dead
        writer's claim; ``theirs``: places another pass judges (never one of them)."""

    def restore(self, old: Stored) -> Stored:
        """Put ``old`` back as the step's payload; returns it where it is then. Raises ``OSError``."""

    def adoptable(self, *, failed: bool) -> list[Stored]:
        """Payloads a step without a live row could adopt (``failed``: its row is a failed one), best first."""

    def deleted(self, *, digest: str | None) -> list[Leftover]:
        """What a step whose row was deleted still holds at its path (and its retired payloads), each removed only
        while it is that payload (``digest``)."""

    def leftovers(self) -> list[Leftover]:
        """Everything else left of the step: staging directories, retired payloads, prefixes, uploads."""


class Scan(Protocol):
    """A root's storage as fsck reads it."""

    @property
    def local_dir(self) -> Path | None:
        """The root's directory on this host (where its registry-owned checkouts live); None on an object store."""

    def check(self) -> None:
        """Raise (``RootError``, ``StorageError``) when the root is not there: a root that cannot be reached says
        nothing about any step, and judging the steps against it would condemn every one."""

    def still_there(self) -> bool:
        """Asked before each verdict: False (or ``StorageError``) once the root went away meanwhile."""

    def listing(self, failures: list[str]) -> Mapping[StepKey, Any]:
        """Everything listed, by step (read before the catalog); a part that cannot be listed is one line in
        ``failures`` and the rest goes on."""

    def step(self, key: StepKey, listed: Any, rel: str | None) -> StepFound:
        """What the root holds of ``key`` (``listed``: its part of :meth:`listing`, None when it had none), looked
        at again now; ``rel``: the path the step's row records, None without a row."""

    def runs(self, listed: Mapping[StepKey, Any]) -> list[str]:
        """The runs the root holds anything of (their policy folds are judged too). Raises ``OSError``."""

    def aside(self) -> Aside:
        """Where the root keeps files beside its steps (a run's policy folds)."""

    def where(self, rel: str) -> tuple[Path, str | None]:
        """How a problem names ``rel``: its path and, on an object store, its URL."""


__all__ = ["Checked", "Leftover", "Scan", "StepFound", "StepKey", "Stored", "Valid"]
