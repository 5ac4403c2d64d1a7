"""Phases 2 and 3 of a publish, per kind of root: where a payload is written and how it becomes the step's.

The publish sequence (``registry.ops.protocol``) claims, asks the root for
a :class:`Landing`, writes into what it prepared, installs, and commits; a
directory root's landing stages a hidden sibling and renames it into place
(``registry.roots.directory``), an object store's uploads to a fresh attempt
prefix whose catalog row is the commit (``registry.roots.objectstore``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from registry.errors import RegistryError

if TYPE_CHECKING:  # a listing imports the roots and never writes: the writers' modules stay out
    from registry.fs.payloadfiles import Written
    from registry.fs.store import FileProblem


class Previous(Protocol):
    """What a claim says of the payload the step held before it (an overwrite retires it)."""

    @property
    def previous_status(self) -> str | None: ...

    @property
    def previous_path(self) -> str | None: ...


class Landing(Protocol):
    """Where phases 2 and 3 put a payload: how it is prepared, checked, installed, discarded and retired.

    ``prepare`` returns what ``write`` fills (a staging directory, an attempt
    prefix); ``install`` makes it the step's payload and returns the retired
    old one (or None), kept until the commit; ``undo`` reverses ``install``
    after a failed commit, returning whether the old payload is back;
    ``settle`` discards the retired payload once the commit happened.
    ``shares_inodes``: payloads may share inodes (dedup), so the fallback chain is kept apart.
    """

    shares_inodes: bool

    @property
    def where(self) -> str: ...

    @property
    def path(self) -> Path | None: ...

    def prepare(self, claim: Previous) -> Any: ...

    def check(self, dest: Any, written: Written) -> list[FileProblem]: ...

    def install(self, dest: Any) -> Any: ...

    def discard(self, dest: Any) -> None: ...

    def old_intact(self) -> bool: ...

    def undo(self, dest: Any, retired: Any) -> bool: ...

    def settle(self, retired: Any) -> None: ...

    def failure(self, exc: OSError) -> RegistryError: ...


def os_cause(exc: OSError, path: Path) -> str:
    """``exc``'s cause in words, and the file it concerns when that is not ``path``."""
    cause = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is not None and str(exc.filename) != str(path):
        cause += f": {exc.filename}"
    return cause


__all__ = ["Landing", "Previous", "os_cause"]
