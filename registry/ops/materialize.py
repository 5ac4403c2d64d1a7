"""Writing a policy version's full files into a directory (``Registry.materialize``): the very
``model.safetensors`` and ``config.json`` a full publish writes, checked against the version's digest.

Two ways, the same bytes: the full way (:func:`write_full`: the version's
tensors, rebuilt through :mod:`registry.ops.policy`, encoded as a publish
encodes them), and, when the directory holds the delta's base already (a
consumer's previous version), the patch way (:func:`materialize_patched`: a
chunked copy of the held file with one delta's changes XORed in, hashed
once and checked whole before the rename, so whatever the held file holds,
only the version's exact bytes pass).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.catalog.policy import folds, policy_steps
from registry.errors import CorruptCheckpointError, RegistryError
from registry.format.manifest import CONFIG, WEIGHTS
from registry.ops.policy import Access, Held, buffer_view, read_fold
from registry.pools import Pool
from registry.records import CheckpointInfo

if TYPE_CHECKING:
    from registry.format.delta import Patch
    from registry.fs.filemaps import Loaded

log = logging.getLogger(__name__)


def held_in(dest: Path) -> Held | None:
    """The ``model.safetensors`` a directory holds (a version materialized there before) and its digest; None
    without one (or with one that does not parse). Hashed once over its mapping, never copied."""
    from registry.fs.filemaps import tensors_of
    from registry.fs.hashing import hash_bytes
    from registry.fs.mapping import host_view, map_file
    if not (dest / WEIGHTS).is_file() or (dest / WEIGHTS).is_symlink():
        return None
    try:
        buf = map_file(dest, WEIGHTS)
        return hash_bytes(host_view(buf)), tensors_of(buf, dest / WEIGHTS)
    except (OSError, CorruptCheckpointError):
        return None





def full_digest(access: Access, info: CheckpointInfo) -> str | None:
    """What a full ``model.safetensors`` of ``info``'s weights must hash to: its version's ``full_sha256``, else
    (a step outside the channel) its own ``model.safetensors``'s digest; None for a step that has neither."""
    row = policy_steps(access.catalog, info.run, [info.step]).get(info.step)
    if row is not None:
        return row.full_sha256
    wanted = [f.sha256 for f in access.catalog.files(info.run, info.step) if f.name == WEIGHTS]
    return wanted[0] if wanted else None


HELD = "user.registry.sha256"  # an extended attribute of a materialized model.safetensors (see held_digest)
_RELEASE = Pool(1, "registry-release")  # closes a replaced file's last descriptor, off the caller's path
PATCH_CHUNK = 8 << 20          # bytes copied, patched, hashed and written at a time on the patch path
PATCH_SLOTS = 4                # chunks in flight between the patching thread and the hashing one
# bytes per write(): an 8 MiB write now and then took 5 to 10 times as long (the page cache's large folios, it
# seems); 1 MiB writes never did, and cost no more
PATCH_WRITE = 1 << 20


def _write_atomic(dest: Path, name: str, fill: Any, expected: str | None) -> None:
    """``dest/name`` written under a temporary name by ``fill(out)``, fsync'd, checked, then renamed into place."""
    import secrets

    from registry.fs.hashing import HashingWriter
    tmp = dest / f".{name}.tmp-{secrets.token_hex(4)}"
    out = HashingWriter(tmp)
    try:
        fill(out)
        out.close()
        if expected is not None and out.sha256 != expected:
            raise CorruptCheckpointError(f"materialized {name} has sha256 {out.sha256}, not the version's "
                                         f"{expected}: nothing was written to {dest}", path=dest / name)
        if name == WEIGHTS and out.sha256 is not None:
            _remember(tmp, out.sha256)
        os.replace(tmp, dest / name)
    except BaseException:
        out.abort()
        tmp.unlink(missing_ok=True)
        raise


def write_full(dest: Path, loaded: Loaded, *, expected: str | None, unchanged: bool = False) -> Path:
    """Write into the directory ``dest`` the ``model.safetensors`` and ``config.json`` a full publish of
    ``loaded`` writes, byte for byte, ``model.safetensors`` checked against ``expected`` (atomic per file).
    ``unchanged``: ``dest`` holds that very ``model.safetensors`` already (only ``config.json`` is written)."""
    from registry.format.safetensors import PUBLISH_METADATA, Encoded
    dest.mkdir(parents=True, exist_ok=True)
    if not unchanged:
        encoded = Encoded(loaded.state_dict, PUBLISH_METADATA)
        _write_atomic(dest, WEIGHTS, encoded.write, expected)
    return _write_config(dest, loaded)


def _write_config(dest: Path, loaded: Loaded) -> Path:
    from registry.fs.payloadfiles import json_bytes
    from registry.fs.store import fsync_dir
    config = json_bytes(loaded.config, "config")
    _write_atomic(dest, CONFIG, lambda out: out.write(config), None)
    fsync_dir(dest)
    return dest


def _remember(path: Path, digest: str) -> None:
    """Record on the file ``path`` that its bytes hash to ``digest`` while it is this inode at this size and
    mtime (:func:`held_digest`); where the filesystem keeps no extended attributes, nothing is recorded."""
    if not hasattr(os, "setxattr"):
        return
    try:
        st = os.stat(path, follow_symlinks=False)
        os.setxattr(path, HELD, f"{digest} {st.st_ino} {st.st_size} {st.st_mtime_ns}".encode(),
                    follow_symlinks=False)
    except OSError:
        pass


def held_digest(dest: Path) -> str | None:
    """The digest :func:`_remember` recorded on ``dest``'s ``model.safetensors``, while the file is still that
    inode at that size and mtime; None otherwise. Read in microseconds where :func:`held_in` hashes the file.

    Never trusted: it only picks the delta :func:`materialize_patched` tries,
    and what that writes is checked whole against the version's digest, so
    a file changed under an unchanged mtime gives a result that fails the
    check and is thrown away, never wrong weights.
    """
    import stat
    if not hasattr(os, "getxattr"):
        return None
    path = dest / WEIGHTS
    try:
        st = os.stat(path, follow_symlinks=False)
        parts = os.getxattr(path, HELD, follow_symlinks=False).decode("ascii").split()
    except (OSError, UnicodeDecodeError):
        return None
    if not stat.S_ISREG(st.st_mode) or parts[1:] != [str(st.st_ino), str(st.st_size), str(st.st_mtime_ns)]:
        return None
    return parts[0]


def materialize_patched(access: Access, info: CheckpointInfo, dest: Path, held: str) -> Path | None:
    """Write ``info``'s version into ``dest`` as :func:`write_full` does, from the ``model.safetensors`` there,
    which should be the version whose full digest is ``held``: a copy of that file with one delta's changes
    XORed in (``info``'s own delta when ``held`` is its base, else a stored fold from that version), hashed
    once as it is written and checked against the version's ``full_sha256`` before it replaces the held file.

    That one check is all the checking it needs: whatever the held file
    holds, only the version's exact bytes pass it, so the held file itself
    is not hashed first (``held`` may come from :func:`held_digest`). None
    when no delta starts at ``held``, the held file is not laid out as the
    delta's base, or the result does not pass: ``dest`` is as it was and the
    caller writes the full way. Raises what reading ``info``'s delta raises.
    """
    from registry.format.delta import Patch
    from registry.format.manifest import DELTA
    row = policy_steps(access.catalog, info.run, [info.step]).get(info.step)
    if row is None or row.kind != "delta" or row.base_step is None or row.full_sha256 == held:
        return None
    base = policy_steps(access.catalog, info.run, [row.base_step]).get(row.base_step)
    loaded = access.copies.load(info, verify=True, map_location="cpu", trust_pickle=False, extras=False)
    if loaded.delta is None:
        return None
    own = base is not None and base.full_sha256 == held
    data = buffer_view(loaded.delta) if own else _fold_from(access, info, held)
    if data is None:
        return None
    patch = Patch(data, path=info.path / DELTA)
    if patch.header.base_sha256 != held or patch.header.target_sha256 != row.full_sha256:
        return None
    if not _write_patched(dest, patch, row.full_sha256):
        return None
    return _write_config(dest, loaded)


def _fold_from(access: Access, info: CheckpointInfo, held: str) -> bytearray | memoryview | None:
    """The bytes of a stored, verified fold from the version whose full digest is ``held`` to ``info``'s."""
    stored = [f for f in folds(access.catalog, info.run)
              if f.to_step == info.step and f.status == "verified" and not f.anchor]
    starts = policy_steps(access.catalog, info.run, [f.from_step for f in stored]) if stored else {}
    for fold_row in stored:
        start = starts.get(fold_row.from_step)
        if start is not None and start.full_sha256 == held:
            data = read_fold(access, fold_row)
            if data is not None:
                return data
    return None


def _write_patched(dest: Path, patch: Patch, expected: str) -> bool:
    """``dest``'s ``model.safetensors`` replaced by a patched copy of itself (a temporary name, fsync'd, checked
    against ``expected``, renamed into place); False, leaving it as it was, when it is not laid out as
    ``patch``'s base or the copy does not hash to ``expected``."""
    import secrets

    from registry.format.manifest import open_regular
    try:
        src = open_regular(dest, WEIGHTS)
    except (OSError, RegistryError):
        return False
    tmp: Path | None = None
    try:
        if os.fstat(src).st_size != patch.size or os.pread(src, len(patch.head), 0) != patch.head:
            return False
        tmp = dest / f".{WEIGHTS}.tmp-{secrets.token_hex(4)}"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            if _copy_patched(src, out, patch) != expected:
                return False
            os.fsync(out)
        finally:
            os.close(out)
        _remember(tmp, expected)
        os.replace(tmp, dest / WEIGHTS)
        tmp = None
        # the held file's last link is gone: closing it frees its blocks (a discard, tens of ms for a large
        # file on a filesystem mounted with it), which no caller needs to wait for
        _RELEASE.submit(os.close, src)
        src = -1
        return True
    finally:
        if src >= 0:
            os.close(src)
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _copy_patched(src: int, out: int, patch: Patch) -> str | None:
    """Copy ``src`` to ``out`` chunk by chunk, each chunk patched before it is written; the sha256 of what was
    written (None when ``src`` ended early). Each chunk is hashed on a second thread while this one reads,
    patches and writes the next, and its writeback to the disk starts as soon as it is written, so the final
    fsync finds little left to do: the cost is about the larger of one sha256 pass and one copy."""
    import hashlib
    import queue

    from registry.crashpoints import crashpoint
    from registry.fs.hashing import start_writeback
    sha = hashlib.sha256()
    slots = _take_slots()
    free = threading.Semaphore(PATCH_SLOTS)  # the hasher takes chunks in order: a freed count frees the oldest
    todo: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
    failed: list[BaseException] = []

    def hashing() -> None:
        while (piece := todo.get()) is not None:
            try:
                if not failed:
                    sha.update(piece)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
                failed.append(exc)
            free.release()

    worker = threading.Thread(target=hashing, name="registry-patch-hash", daemon=True)
    worker.start()
    try:
        for k, offset in enumerate(range(0, patch.size, PATCH_CHUNK)):
            free.acquire()
            piece = memoryview(slots[k % PATCH_SLOTS])[:min(PATCH_CHUNK, patch.size - offset)]
            if os.preadv(src, [piece], offset) != len(piece):
                return None
            patch.apply(piece, offset)
            todo.put(piece)
            for at in range(0, len(piece), PATCH_WRITE):
                view = piece[at:at + PATCH_WRITE]
                while view:
                    view = view[os.write(out, view):]
            start_writeback(out, offset, len(piece))
            crashpoint("materialize-patch-midway")
    finally:
        todo.put(None)
        worker.join()
        if len(_SPARE) < 2:
            _SPARE.append(slots)
    if failed:
        raise failed[0]
    return sha.hexdigest()


_SPARE: list[list[mmap.mmap]] = []  # chunk buffers kept for the next patch (list.pop and append need no lock)


def _take_slots() -> list[mmap.mmap]:
    """``PATCH_SLOTS`` chunk buffers, on huge pages where the kernel gives them: copying from 4 KiB pages into the
    page cache took 1.5 to 5 times as long (TLB misses, and on a VM its host's faults), and allocating huge
    pages costs more than the copy saves, so a set is kept for the next call."""
    try:
        return _SPARE.pop()
    except IndexError:
        pass
    slots = []
    for _ in range(PATCH_SLOTS):
        buf = mmap.mmap(-1, PATCH_CHUNK)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                buf.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        slots.append(buf)
    return slots


__all__ = ["full_digest", "held_digest", "held_in", "materialize_patched", "write_full"]
