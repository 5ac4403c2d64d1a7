"""Which checkpoint root belongs to which catalog, checked at every open.

A catalog has an id (``catalog_identity``); the root bound to it carries the
same id in ``<root>/.registry/root.json``. The binding is by id, not by path:
each host may mount the root anywhere and pass its own path as ``--root`` /
``$REGISTRY_ROOT``; any path whose marker names the catalog is accepted.

The rules, in order:

1. The root's marker names this catalog: accepted.
2. The marker names another catalog: refused (wrong ``--root`` or ``--url``).
3. No marker, and the catalog already has a bound root: refused (a wrong or
   unmounted path, where a verify would otherwise find every step missing).
4. No marker, and no root bound yet (a new catalog, or one made before
   catalogs had ids): refused if the catalog has live checkpoints and none
   of its newest ones is under this root; otherwise a writer (an open that
   may create) binds this root, writing the marker, and a reader is
   accepted without writing anything.

``rebind=True`` (``registry db bind-root``) binds the given root whatever
the rules say: for a root restored without its ``.registry/`` directory.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from registry.catalog.identity import Identity, live_paths, locked_identity, read_identity, record_binding
from registry.catalog.queries import Catalog
from registry.catalog.session import safe_url
from registry.errors import RootMismatchError
from registry.format.layout import REGISTRY_DIR, ROOT_MARKER

if TYPE_CHECKING:
    from registry.roots.base import Root

EVIDENCE_ROWS = 64  # how many of the newest live checkpoints an unbound catalog looks for under a new root


def _mismatch(store: Root, url: str, identity: Identity, marker: str | None) -> RootMismatchError:
    if marker is not None:
        why = (f"it is bound to another catalog (id {marker}), not to {url} (id {identity.catalog_id}); "
               "pass the --root and --url that belong together")
    else:
        why = (f"it has no {REGISTRY_DIR}/{ROOT_MARKER} but catalog {url} is bound to a root "
               f"(bound from {identity.root_hint}); a wrong or unmounted path? Each host passes its own mount "
               "of that root as --root")
    return RootMismatchError(f"checkpoint root {store.url} does not belong to the catalog: {why}",
                             path=store.local_dir)


def _no_evidence(store: Root, url: str, paths: list[str]) -> RootMismatchError | None:
    """Refusal of a root that holds none of ``paths``, the catalog's newest live checkpoints (if it has any)."""
    if not paths or any(store.holds(p) for p in paths):
        return None
    return RootMismatchError(
        f"checkpoint root {store.url} holds none of the newest {len(paths)} checkpoints of catalog {url} "
        f"(such as {paths[0]}): a wrong or unmounted path? If it is the right root, run "
        "'registry db bind-root'", path=store.local_dir)


def check_binding(catalog: Catalog, store: Root, *, bind: bool, rebind: bool = False) -> None:
    """Accept, bind or refuse ``store``'s root for ``catalog`` (see the module's rules).

    ``bind=False`` (readers) checks the same rules and writes nothing.
    """
    url = safe_url(catalog.engine.url)  # how a refusal names the catalog
    identity = read_identity(catalog.engine)
    marker = store.read_marker()
    if marker == identity.catalog_id and identity.root_bound_at is not None and not rebind:
        return
    if not rebind and (marker is not None and marker != identity.catalog_id
                       or marker is None and identity.root_bound_at is not None):
        raise _mismatch(store, url, identity, marker)
    if not bind and not rebind:
        if marker is None:
            with catalog.engine.connect() as conn:
                refusal = _no_evidence(store, url, live_paths(conn, limit=EVIDENCE_ROWS))
            if refusal is not None:
                raise refusal
        return
    hint = f"{socket.gethostname()}:{store.url}"
    wrote = False
    try:
        with locked_identity(catalog.engine) as (conn, identity):
            marker = store.read_marker()  # another opener may have bound a root while we waited
            if not rebind:
                if marker == identity.catalog_id:
                    if identity.root_bound_at is None:
                        record_binding(conn, hint=hint)
                    return
                if marker is not None or identity.root_bound_at is not None:
                    raise _mismatch(store, url, identity, marker)
                refusal = _no_evidence(store, url, live_paths(conn, limit=EVIDENCE_ROWS))
                if refusal is not None:
                    raise refusal
            store.write_marker(identity.catalog_id, bound_from=hint, overwrite=rebind)
            wrote = marker != identity.catalog_id
            record_binding(conn, hint=hint)
    except BaseException:
        if wrote:
            store.remove_marker()  # the catalog did not record the binding: undo the root's half
        raise
