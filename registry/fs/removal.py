"""Removing a checkpoint directory safely: retire it out of sight, then remove it, only while it holds the
payload the caller means to remove.

Shared by retention's execute and fsck's repairs; knows files, not the catalog.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Literal

from registry.crashpoints import crashpoint
from registry.errors import CorruptCheckpointError
from registry.format.layout import hidden_sibling
from registry.format.manifest import MANIFEST, MAX_MANIFEST_BYTES, digest_bytes, open_regular
from registry.fs.store import fsync_dir


def remove_tree(path: Path) -> None:
    """``shutil.rmtree`` that tolerates a concurrent gc (or fsck) removing the same tree.

    Whatever vanishes under it was being removed anyway; any other error is raised.
    """
    def vanished_ok(exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _fn, _path, exc: vanished_ok(exc))
    else:
        shutil.rmtree(path, onerror=lambda _fn, _path, info: vanished_ok(info[1]))


def manifest_digest(directory: Path) -> str | None:
    """The sha256 of ``directory``'s manifest as it is now; None when there is none to read.

    Opened like any checkpoint file: never through a symlink, never blocking on a FIFO.
    """
    try:
        with os.fdopen(open_regular(directory, MANIFEST, what="manifest"), "rb") as f:
            return digest_bytes(f.read(MAX_MANIFEST_BYTES + 1))
    except (OSError, CorruptCheckpointError):
        return None


def remove_checkpoint_dir(final: Path, manifest_sha256: str | None = None) -> bool:
    """Rename ``final`` to a hidden retired sibling (atomic for readers), then remove it.

    False when there was nothing to remove (or a concurrent gc renamed it
    first). ``manifest_sha256`` is the digest of the payload the catalog
    marked deleted: a step re-published in the meantime (a ``deleted`` row can
    be claimed again) has installed a different manifest, and that directory
    is put back instead of removed. See :func:`retire_and_remove` for which.
    """
    return retire_and_remove(final, manifest_sha256) == "removed"


def retire_and_remove(final: Path, manifest_sha256: str | None) -> Literal["removed", "absent", "kept"]:
    """:func:`remove_checkpoint_dir`, saying what happened: ``kept`` is a different payload put back.

    The digest is read before the rename too, so a payload re-published long
    after the caller read the row is never hidden from readers, even briefly;
    read again after the rename, it catches one installed in between.
    """
    if not final.exists():
        return "absent"
    if manifest_sha256 is not None and manifest_digest(final) not in (None, manifest_sha256):
        return "kept"
    retired = hidden_sibling(final, "retired")
    try:
        os.replace(final, retired)
    except FileNotFoundError:
        return "absent"
    digest = manifest_digest(retired) if manifest_sha256 is not None else None
    if digest is not None and digest != manifest_sha256:
        try:
            os.replace(retired, final)
        except OSError:
            pass  # something new is in place already; fsck sorts out the retired copy
        return "kept"
    fsync_dir(final.parent)
    crashpoint("gc-after-retire")
    remove_tree(retired)
    return "removed"


__all__ = ["manifest_digest", "remove_checkpoint_dir", "remove_tree", "retire_and_remove"]
