"""Opening a root: the one place that tells a directory from ``s3://``, and where the root's own refusals live.

A root opens in two steps because a tiered root's fast directory is named
by a tier id that only the catalog can vouch for: :func:`locate` resolves
the user's words (``root``, ``durable``, the environment, the defaults) and
opens the storage, :meth:`Located.bind_to` is what the catalog is bound to,
and :meth:`Located.finish` makes the :class:`~registry.roots.base.Root`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import RootError
from registry.fs.store import Store
from registry.roots.base import Root
from registry.roots.directory import DirectoryRoot

if TYPE_CHECKING:
    from registry.fs.objects import ObjectRoot

DEFAULT_ROOT = "checkpoints"
log = logging.getLogger(__name__)


def is_object_url(text: str) -> bool:
    """Whether ``text`` names an object-store root; the object store's client module is imported only for a text
    that is a URL at all, so a directory root never loads it."""
    if "://" not in text:
        return False
    from registry.fs.objects import is_object_url as named
    return named(text)


def locations(url: str | None, root: str | os.PathLike[str] | None) -> tuple[Path | str, str]:
    """The root and catalog URL after applying the environment and the defaults.

    A directory comes back as an absolute ``Path``, an ``s3://`` root as its URL, whose catalog URL must be
    given: a bucket holds no SQLite file.
    """
    chosen = root if root is not None else os.environ.get("REGISTRY_ROOT", DEFAULT_ROOT)
    if is_object_url(str(chosen)):
        catalog = url or os.environ.get("REGISTRY_URL")
        if not catalog:
            raise RootError(f"an s3:// root ({chosen}) needs an explicit catalog URL (url=, $REGISTRY_URL or "
                            "--url): a SQLite file on this machine for one machine, PostgreSQL for many")
        return str(chosen), catalog
    root_path = Path(chosen).absolute()
    return root_path, url or os.environ.get("REGISTRY_URL") or f"sqlite:///{Store.default_catalog(root_path)}"


@dataclass
class Located:
    """A root whose storage is open and whose catalog is not yet: see the module's docstring."""

    bind_to: Root  # what the catalog is bound to (a tiered root's durable root)
    directory: Store | None = None  # the directory root, or a tiered root's fast one
    objects: ObjectRoot | None = None  # the object-store root, or a tiered root's durable one
    tiered: bool = False
    created: list[Path] = field(default_factory=list)  # directories this open made, newest first

    def finish(self, tier_id: Callable[[Store], str | None] | None = None) -> Root:
        """The root; ``tier_id`` names a tiered root's fast directory (asked of the catalog), None for one no
        writer has named yet (a read-only open on a host new to the tier: it keeps no cache there)."""
        if self.objects is None and self.directory is not None:
            return DirectoryRoot(self.directory)  # the object store's modules stay out of a directory root's process
        from registry.roots.objectstore import ObjectStoreRoot
        if self.objects is not None and self.directory is None:
            return ObjectStoreRoot(self.objects)
        from registry.roots.tiered import TieredRoot
        if self.objects is not None and self.directory is not None and self.tiered and tier_id is not None:
            named = tier_id(self.directory)
            if named is None:
                import secrets
                return TieredRoot(DirectoryRoot(self.directory), ObjectStoreRoot(self.objects),
                                  f"unnamed-{secrets.token_hex(4)}", cached=False)
            return TieredRoot(DirectoryRoot(self.directory), ObjectStoreRoot(self.objects), named)
        raise RootError("a root is a directory, an object store, or a directory over a durable object store")

    def undo(self) -> None:
        """A refused open leaves no empty directory behind (say, at a mistyped path)."""
        for directory in self.created:
            try:
                directory.rmdir()
            except OSError:
                break

    def announce(self) -> None:
        """The WARNING a new directory gets, once the open succeeded."""
        if self.directory is None or self.directory.root not in self.created:
            return
        if self.tiered:
            log.warning("created a new fast tier directory %s for the durable tier %s (a host new to the tier: "
                        "steps it has no copy of are read from the durable tier)", self.directory.root,
                        self.bind_to.url)
        else:
            log.warning("created a new checkpoint root %s (where a root must already exist, "
                        "Registry.open(create=False) refuses a missing one)", self.directory.root)




def locate(located: Path | str, durable: str | None, *, storage_options: Mapping[str, Any] | None,
           create: bool, read_only: bool, dedup: bool) -> Located:
    """Open the storage ``located`` (from :func:`locations`) and ``durable`` name, refusing what cannot be.

    ``create`` makes a missing directory root. A tiered root's fast directory
    is made whenever it is missing and the open may write (``create=False``
    included): a new host joins a durable tier its catalog already knows,
    and the catalog open that follows refuses a durable root it does not.
    ``durable`` None takes ``$REGISTRY_DURABLE``.
    """
    durable = durable if durable is not None else (os.environ.get("REGISTRY_DURABLE") or None)
    if durable is not None:
        if isinstance(located, str):
            raise RootError(f"the fast tier must be a filesystem root, not {located}; pass the s3:// root as "
                            "durable=")
        if not is_object_url(durable):
            raise RootError(f"durable={durable!r}: the durable tier must be an s3:// root (s3://BUCKET/PREFIX)")
        from registry.fs.objects import ObjectRoot
        from registry.roots.objectstore import ObjectStoreRoot
        objects = ObjectRoot.open(durable, storage_options)
        created = [] if read_only else _missing(located)
        store = Store(located, create=not read_only, missing_ok=read_only)
        return Located(bind_to=ObjectStoreRoot(objects), directory=store, objects=objects, tiered=True,
                       created=created)
    if isinstance(located, str):
        from registry.fs.objects import ObjectRoot
        from registry.roots.objectstore import ObjectStoreRoot
        bound = ObjectStoreRoot(ObjectRoot.open(located, storage_options))
        if dedup:
            bound.require("links", "dedup")
        return Located(bind_to=bound, objects=bound.objects)
    if storage_options is not None:
        raise RootError("storage_options apply to an s3:// root only")
    created = _missing(located)
    store = Store(located, create=create and not read_only)
    return Located(bind_to=DirectoryRoot(store), directory=store, created=created)


def _missing(path: Path) -> list[Path]:
    return [p for p in (path, *path.parents) if not p.exists()]


__all__ = ["DEFAULT_ROOT", "Located", "is_object_url", "locate", "locations"]
