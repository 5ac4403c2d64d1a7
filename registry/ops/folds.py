"""Derived files of the policy channel, stored beside a run's steps under ``.policy-folds/`` (the root's
:meth:`~registry.roots.base.Root.aside`): folds, a delta from one version to another for a consumer that holds the
first, and anchors, a delta step's version stored whole so it reads without its chain (see
:mod:`registry.ops.policy`, which reads both). Each is checked against its target's digest before it is stored,
recorded with its sha256, and lives only while its steps do (retention and fsck end it with them).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.crashpoints import crashpoint
from registry.catalog.policy import FoldRecord, PolicyStepInfo, folds, record_fold, version_step
from registry.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidStateError
from registry.format.pieces import PIECE_SIZE, PieceHasher, piece_digests
from registry.ops.policy import ANCHOR, FOLDS, Access, anchors, fold_intact, read_fold, read_rebuilt
from registry.records import LIVE, CheckpointInfo

if TYPE_CHECKING:
    import torch

    from registry.roots.aside import Aside, AsideWrite


@dataclass(frozen=True, kw_only=True)
class FoldInfo:
    """A stored fold: the delta from policy version ``from_version`` (step ``from_step``) to ``to_version``."""

    run: str
    from_version: int
    to_version: int
    from_step: int
    to_step: int
    path: Path | None  # on this host's filesystem; None on an object store (``url`` names it)
    size: int
    sha256: str
    base_sha256: str
    target_sha256: str
    url: str = ""  # where the root keeps it: an absolute path, or an s3:// URL


def _version_row(access: Access, run: str, version: int) -> PolicyStepInfo:
    row = version_step(access.catalog, run, version)
    if row is None or row.status not in LIVE:
        raise CheckpointNotFoundError(f"{run}@pv:{version}: no published or verified checkpoint with policy "
                                      f"version {version}", run=run)
    return row


def fold(access: Access, run: str, a: int, b: int) -> FoldInfo:
    """The delta from policy version ``a`` to ``b`` of ``run``, stored under the run's ``.policy-folds/``.

    Both versions are read through the reader (a delta step rebuilt from its
    chain), the fold is ``encode(a, b)`` and is checked against ``b``'s
    ``full_sha256`` before it is written (atomically) and recorded.
    """
    from registry.format.delta import encode, read_header
    if a == b:
        raise InvalidStateError(f"fold({run!r}, {a}, {b}) needs two different versions")
    ra, rb = _version_row(access, run, a), _version_row(access, run, b)
    rel = f"{run}/{FOLDS}/{ra.step}-{rb.step}.delta.safetensors"
    with _leased(access, run, (ra.step, rb.step), "folded") as infos:
        states = [read_rebuilt(access, access.home.place(info), verify=True, extras=False).state_dict
                  for info in infos]
        data = encode(states[0], states[1], base_sha256=ra.full_sha256)
        del states
        header = read_header(data)
        if header.target_sha256 != rb.full_sha256:
            raise CorruptCheckpointError(f"the fold of {run} from version {a} to {b} does not end at version {b}'s "
                                         "digest; nothing was stored", run=run, step=rb.step)
        digest = hashlib.sha256(data).hexdigest()
        record = FoldRecord(run=run, from_step=ra.step, to_step=rb.step, path=rel, size=len(data), sha256=digest,
                            status="verified", created_at=None, piece_size=PIECE_SIZE,
                            xxh3_128_pieces=piece_digests(data, PIECE_SIZE))
        access.home.aside().put(rel, data)
        _record(access, record)
    aside = access.home.aside()
    return FoldInfo(run=run, from_version=a, to_version=b, from_step=ra.step, to_step=rb.step,
                    path=aside.local(rel), size=len(data), sha256=digest, base_sha256=header.base_sha256,
                    target_sha256=header.target_sha256, url=aside.where(rel))


def stored_fold(access: Access, run: str, a: int, b: int) -> bytes:
    """The checked bytes of the stored fold from version ``a`` of ``run`` to ``b`` (:func:`read_fold`);
    ``CheckpointNotFoundError`` when none is stored, or the one stored cannot be used."""
    ra, rb = _version_row(access, run, a), _version_row(access, run, b)
    for row in folds(access.catalog, run):
        if (row.from_step, row.to_step, row.status) == (ra.step, rb.step, "verified") and not row.anchor:
            data = read_fold(access, row)
            if data is not None:
                return bytes(data)
            raise CheckpointNotFoundError(f"the fold of {run} from version {a} to {b} cannot be read (see the log); "
                                          "fold it again", run=run, step=rb.step)
    raise CheckpointNotFoundError(f"no stored fold of {run} from version {a} to {b}: Registry.fold makes one",
                                  run=run, step=rb.step)


@dataclass(frozen=True, kw_only=True)
class AnchorInfo:
    """A stored anchor: policy version ``version`` (step ``step``) whole, as a full publish writes it."""

    run: str
    version: int
    step: int
    path: Path | None  # on this host's filesystem; None on an object store (``url`` names it)
    size: int
    sha256: str
    url: str = ""


def reanchor(access: Access, run: str, version: int) -> AnchorInfo:
    """Store policy version ``version`` of ``run`` whole beside its delta step (see the module's docstring).

    The version is rebuilt through the reader and encoded as a full publish
    encodes it, streamed under the run's ``.policy-folds/`` while it is
    hashed (the encoding is never held in memory beside the state), stored
    only if it hashes to the version's ``full_sha256``, recorded, and read
    back from storage (streamed too) before this returns; an anchor stored
    and readable already is kept. The step stays leased throughout. A full
    step has no chain: ``InvalidStateError``.
    """
    row = _version_row(access, run, version)
    if row.kind != "delta":
        raise InvalidStateError(f"{run}@pv:{version} (step {row.step}) is stored whole already: no chain to "
                                "re-anchor", run=run, step=row.step)
    aside = access.home.aside()
    for stored in anchors(access.catalog, run):
        if stored.to_step == row.step and stored.sha256 == row.full_sha256 and fold_intact(access, stored):
            return _anchor_info(aside, run, version, stored)
    rel = f"{run}/{FOLDS}/{row.step}-{row.step}.{ANCHOR}"
    with _leased(access, run, (row.step,), "re-anchored") as (info,):
        state = read_rebuilt(access, access.home.place(info), verify=True, extras=False).state_dict
        size, digest, pieces = _write_whole(aside, rel, state, expected=row.full_sha256,
                                            what=f"{run}@pv:{version} rebuilt whole", run=run, step=row.step)
        del state
        record = FoldRecord(run=run, from_step=row.step, to_step=row.step, path=rel, size=size, sha256=digest,
                            status="verified", created_at=None, piece_size=PIECE_SIZE, xxh3_128_pieces=pieces)
        _record(access, record, point="reanchor-after-store")
    if not fold_intact(access, record):  # what storage holds, before any base may go for it
        raise CorruptCheckpointError(f"the anchor of {run}@pv:{version} at {aside.where(rel)} did not read back "
                                     "as written (see the log); its chain is kept", run=run, step=row.step)
    return _anchor_info(aside, run, version, record)


@contextlib.contextmanager
def _leased(access: Access, run: str, steps: tuple[int, ...], doing: str) -> Iterator[list[CheckpointInfo]]:
    """The rows of ``run``'s ``steps``, each under a reader lease until the block ends: retention keeps them
    while their fold is read and stored, and fsck leaves the unfinished write of a leased step's fold alone."""
    leases: list[int] = []
    try:
        infos = []
        for step in steps:
            info = access.catalog.get(run, step)
            lease = access.catalog.acquire_lease(run, step, holder=access.holder, ttl=access.lease_ttl)
            if lease is not None:
                leases.append(lease)
            if info is None or lease is None:
                raise CheckpointNotFoundError(f"{run}@{step} was deleted while being {doing}", run=run, step=step)
            infos.append(info)
        yield infos
    finally:
        for lease in leases:
            access.catalog.release_lease(lease)


class _Digesting:
    """A writer that hashes what it passes on (sha256, and the xxh3-128 of each ``PIECE_SIZE`` piece), and counts
    it."""

    def __init__(self, out: AsideWrite) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.pieces = PieceHasher(PIECE_SIZE)
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.pieces.update(view)
        self.size += self.out.write(view)
        return len(view)


def _write_whole(aside: Aside, rel: str, state: Mapping[str, torch.Tensor], *, expected: str, what: str, run: str,
                 step: int) -> tuple[int, str, tuple[str, ...]]:
    """``state`` encoded as a full publish encodes it, streamed to ``rel`` while it is hashed, and stored only
    if it hashes to ``expected``: the encoding is never held in memory beside the state. Returns its size,
    sha256 and piece digests."""
    from registry.format.safetensors import PUBLISH_METADATA, Encoded
    out = aside.writer(rel)
    try:
        sink = _Digesting(out)
        Encoded(state, PUBLISH_METADATA).write(sink)
        digest = sink.sha.hexdigest()
        if digest != expected:
            raise CorruptCheckpointError(f"{what} hashes to {digest[:12]}, not its version's {expected[:12]}; "
                                         "nothing was stored", run=run, step=step)
    except BaseException:
        out.abort()
        raise
    out.commit()
    return sink.size, digest, sink.pieces.digests()


def _record(access: Access, record: FoldRecord, *, point: str | None = None) -> None:
    """The row of a fold (or an anchor) whose bytes are stored at ``record.path``; ``CheckpointNotFoundError``
    (the file removed again) when one of its steps was deleted meanwhile. A crash before it (``point``)
    leaves a file no row names, which fsck removes as an orphan."""
    if point is not None:
        crashpoint(point)
    try:
        record_fold(access.catalog, record)
    except CheckpointNotFoundError:
        try:  # no row names it: left behind, fsck --repair would remove it as an orphan
            access.home.aside().delete(record.path)
        except OSError:
            pass
        raise


def _anchor_info(aside: Any, run: str, version: int, record: FoldRecord) -> AnchorInfo:
    return AnchorInfo(run=run, version=version, step=record.to_step, path=aside.local(record.path),
                      size=record.size, sha256=record.sha256, url=aside.where(record.path))


__all__ = ["AnchorInfo", "FoldInfo", "fold", "reanchor", "stored_fold"]
