"""A host's copies of policy versions: ``<cache>/<run>/v<N>/``, filled once per host, removed when no one holds them.

Every consumer of a host reads one copy of a version (see
:mod:`registry.ops.consumers`): the first to ask fills it under an ``fcntl``
lock on ``.v<N>.lock`` through ``Registry.materialize`` (into a staging
sibling, renamed into place, then ``.v<N>.done`` written last, naming the
step), and the others wait on the lock and find it complete. Locks hold
across processes and across threads (each opens the lock file anew). The
lock files stay: removing one another process may be about to lock would let
two fillers run at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from registry.format.layout import REGISTRY_DIR

POLICY_CACHE = f"{REGISTRY_DIR}/policy"  # a host's copies of policy versions, under its local root
HOST_CACHE = "host-cache"  # a load's source when this host already had the version

#: ``(ref, dest) -> (dest, where)``: writes a policy version's full weights into ``dest``, checked, as
#: ``Registry.materialize`` does; ``where`` names the copy its bytes were read from
#: (:func:`registry.ops.export.materialize_traced`)
Materialize = Callable[[str, Path], tuple[Path, str]]


def host_copy(cache: Path, run: str, version: int, step: int, materialize: Materialize) -> tuple[Path, str, int]:
    """``<cache>/<run>/v<version>``, filled once per host: (its path, its source, bytes fetched now). The source
    is the copy it was filled from, or ``host-cache`` when the host had it already."""
    base = cache / run
    base.mkdir(parents=True, exist_ok=True)
    final = base / f"v{version}"
    done = base / f".v{version}.done"  # written last: the directory is complete, and of which step
    with open(base / f".v{version}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if final.is_dir() and done.is_file() and _done_step(done) == step:
                return final, HOST_CACHE, 0
            staging = Path(tempfile.mkdtemp(prefix=f".v{version}.tmp-", dir=base))
            try:
                seeded = _seed(base, version, staging)
                _, source = materialize(f"{run}@{step}", staging)
                fetched = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file() and p.stat().st_ino != seeded)
                done.unlink(missing_ok=True)
                if final.exists():  # a stale copy (the version's step was published again)
                    stale = Path(tempfile.mkdtemp(prefix=f".v{version}.stale-", dir=base))
                    os.replace(final, stale / "old")
                    shutil.rmtree(stale, ignore_errors=True)
                os.replace(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            marker = done.with_name(done.name + ".tmp")
            marker.write_text(json.dumps({"step": step, "bytes": fetched}))
            os.replace(marker, done)
            return final, source, fetched
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prune_host_copies(base: Path, floor: int) -> list[int]:
    """Remove ``base``'s ``v<N>`` copies with N < ``floor``, each under its lock and only when no one holds
    that lock (a fill in progress); the versions removed."""
    removed = []
    for entry in sorted(base.glob("v*")):
        number = entry.name[1:]
        if not (number.isdigit() and int(number) < floor and entry.is_dir()):
            continue
        with open(base / f".v{number}.lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            try:
                (base / f".v{number}.done").unlink(missing_ok=True)
                gone = Path(tempfile.mkdtemp(prefix=f".v{number}.stale-", dir=base))
                os.replace(entry, gone / "old")
                shutil.rmtree(gone, ignore_errors=True)
                removed.append(int(number))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return removed


def _seed(base: Path, version: int, staging: Path) -> int | None:
    """Link the newest earlier host copy's ``model.safetensors`` into ``staging``, so that materialize starts
    from it (one delta or fold, not the chain from its full); the inode linked, or None.

    A link, not a copy: materialize never writes into a file it holds, it replaces it (a temporary name, then a
    rename), so the earlier copy is not changed. A copy pruned meanwhile fails to link and the next older one
    is tried; a file someone changed does not match its version's digest and is ignored by materialize.
    """
    from registry.format.manifest import WEIGHTS
    older = sorted((int(e.name[1:]) for e in base.glob("v*") if e.name[1:].isdigit() and int(e.name[1:]) < version),
                   reverse=True)
    for number in older:
        try:
            os.link(base / f"v{number}" / WEIGHTS, staging / WEIGHTS)
        except OSError:
            continue
        return (staging / WEIGHTS).stat().st_ino
    return None


def _done_step(done: Path) -> int | None:
    try:
        step = json.loads(done.read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


__all__ = ["HOST_CACHE", "Materialize", "POLICY_CACHE", "host_copy", "prune_host_copies"]
