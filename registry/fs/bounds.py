"""Where a command may write: never inside the checkpoint root, never over a directory that holds it.

Export, import (``--move``) and a checkout into a caller's directory all
write, replace or remove files at a path the user typed. Aimed into the
root, an export ``--overwrite`` replaces a run's steps or a payload, and an
export at ``ROOT/run/step-N`` is later adopted by ``fsck --repair`` as a new
step; aimed at a directory that contains the root, it would replace the
catalog and every run. The check compares real paths (symlinks resolved,
the path need not exist yet), so a link into the root is refused too.
"""

from __future__ import annotations

import os
from pathlib import Path

from registry.errors import InvalidStateError


def real(path: Path) -> Path:
    """``path`` with every symlink of the part that exists resolved (the rest appended as given)."""
    return Path(path).absolute().resolve(strict=False)


def as_directory(dest: object, *, what: str) -> Path:
    """The directory a caller named for a command to write into or read from, made absolute. An empty string
    names none (it would be the current directory, where an export with ``overwrite`` replaces everything), so
    it is refused with one line, as is anything that is not a ``str`` or ``os.PathLike`` of text."""
    if isinstance(dest, (str, os.PathLike)):
        text = os.fspath(dest)
        if isinstance(text, str) and text:
            return Path(text).absolute()
    raise InvalidStateError(f"{what} must name a directory (a str or os.PathLike), got {dest!r}")


def check_outside_root(path: Path, root: Path, *, what: str, allowed: Path | None = None,
                       catalog: Path | None = None) -> None:
    """Refuse ``path`` when it is inside ``root`` or contains it, with one line naming both.

    ``allowed``: a directory inside the root that the registry owns for
    this purpose (the registry-owned checkouts); a path inside it passes.
    ``catalog``: a SQLite catalog file kept outside the root, which ``path``
    may not contain either.
    """
    mine, theirs = real(path), real(root)
    if allowed is not None and mine.is_relative_to(real(allowed)) and mine != real(allowed):
        return
    if mine.is_relative_to(theirs):
        raise InvalidStateError(f"{what} {path} is inside the checkpoint root {root}, where writing it could "
                                "replace or remove published checkpoints; choose a directory outside the root")
    if theirs.is_relative_to(mine):
        raise InvalidStateError(f"{what} {path} contains the checkpoint root {root}, whose runs and catalog it "
                                "could replace or remove; choose a directory outside the root")
    if catalog is not None and real(catalog).is_relative_to(mine):
        raise InvalidStateError(f"{what} {path} contains the catalog {catalog}, which writing it could replace "
                                "or remove; choose a directory that does not hold it")


__all__ = ["as_directory", "check_outside_root", "real"]
