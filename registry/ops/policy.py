"""The RL policy channel's data path: delta publishes, rebuilding a delta step, materialize, folds, markers.

A publish with ``policy_version=N`` and ``delta="auto"`` (or ``True``)
stores what changed against the run's newest verified policy step (its
base) as ``delta.safetensors`` (:mod:`registry.format.delta`) in place of
``model.safetensors``; everything else about the step (meta, config,
extras, manifest, catalog row) is as for any step, so every check applies.
``"auto"`` stores a full every ``full_every`` versions (a chain never gets
longer than that) and whenever the delta would not pay (more than half the
full's bytes) or cannot be made (another tensor set, shape or dtype).

The publishing process keeps the last state it published of each run
(:class:`PolicyCache`, by its full digest), so a delta publish does not read
its base back; on a miss the base is read through the one reader.

Writing a version's full files (``Registry.materialize``) is
:mod:`registry.ops.materialize`.

A reader of a delta step (:func:`rebuild`, called by
:func:`registry.ops.reading.read_step` for every load, export and diff)
reads the chain back to its full (``policy_steps.base_step``), decodes each
delta in order (each checks its base's digest and every tensor's) and
checks the result against the step's ``full_sha256``: a damaged delta is a
corrupt copy, never wrong weights.

Re-anchoring (:func:`registry.ops.folds.reanchor`) stores a delta step's version whole beside
it, as a fold from the step to itself (the very ``model.safetensors`` a full
publish writes, checked against ``full_sha256`` and read back before it is
relied on): the rebuild then starts there, and retention no longer keeps the
step's bases for it. The step itself is untouched (its row, payload, tags,
metrics, leases and loads), so nothing a reader or consumer holds moves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from registry.catalog.policy import (FoldRecord, PolicyStepInfo, chain_steps, condemn_fold, folds, newest_base,
                                     policy_steps, version_step)
from registry.catalog.records import CommitRecord, PayloadRecord, PolicyRecord
from registry.errors import (CheckpointNotFoundError, CorruptCheckpointError, DeltaBaseError, InvalidStateError,
                             PolicyVersionConflictError, RegistryError)
from registry.format.manifest import POLICY_DELTA, WEIGHTS
from registry.records import LIVE, CheckpointInfo, Status

if TYPE_CHECKING:
    import torch

    from registry.fs.filemaps import Loaded
    from registry.catalog import Catalog
    from registry.ops.copies import Copies
    from registry.ops.protocol import CommitHooks
    from registry.roots.base import Root

DeltaMode = bool | Literal["auto"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class Access(Protocol):
    """What the policy channel reads through: :class:`registry.ops.reading.ReadAccess` has it."""

    @property
    def catalog(self) -> Catalog: ...

    @property
    def home(self) -> Root: ...

    @property
    def copies(self) -> Copies: ...

    @property
    def holder(self) -> str: ...

    @property
    def lease_ttl(self) -> timedelta: ...

FULL_EVERY = 8
PAYS = 0.5          # a delta larger than this share of the full is stored as a full under "auto"
FOLDS = ".policy-folds"  # under a run's directory: derived deltas between two policy steps, and anchors
ANCHOR = "full.safetensors"  # an anchor's file under FOLDS: STEP-STEP.full.safetensors


def check_delta(delta: object, policy_version: int | None) -> DeltaMode | None:
    """``publish(delta=...)``: None (the default), ``"auto"``, True or False; a delta needs a policy version."""
    if delta is None:
        return None
    if delta != "auto" and not isinstance(delta, bool):
        raise InvalidStateError(f"delta must be 'auto', True or False, got {delta!r}")
    if policy_version is None:
        if delta is False:
            return None
        raise InvalidStateError("publish(delta=...) needs policy_version=N: only a policy step is stored as a delta")
    return delta


class PolicyCache:
    """The last policy state this process published of each run, by its full digest (a delta's base)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}

    def get(self, run: str, full_sha256: str) -> dict[str, torch.Tensor] | None:
        with self._lock:
            held = self._states.get(run)
        return held[1] if held is not None and held[0] == full_sha256 else None

    def put(self, run: str, full_sha256: str, state: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._states[run] = (full_sha256, state)

    def forget(self, run: str) -> None:
        with self._lock:
            self._states.pop(run, None)

    def take(self, run: str) -> tuple[str, dict[str, torch.Tensor]] | None:
        """The run's last state and its digest, no longer held: the caller may write into its tensors."""
        with self._lock:
            return self._states.pop(run, None)


@dataclass(frozen=True, kw_only=True)
class PolicyPlan:
    """How one policy publish stores its version: the commit's record, the delta's bytes (None for a full)
    and the state to remember once it commits; ``existing``: the same weights are this step already (a no-op)."""

    record: PolicyRecord | None = None
    delta: bytes | None = None
    manifest: dict[str, Any] | None = None  # the manifest field that makes a delta step self-describing
    remember: dict[str, torch.Tensor] | None = None
    existing: PolicyStepInfo | None = None


def _host_copy(state: Mapping[str, torch.Tensor],
               into: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A CPU copy of ``state`` that later optimizer steps cannot change, written into ``into``'s tensors where
    they fit (an earlier version's copy, no longer needed: fresh memory costs a page fault per page, which
    took most of a copy's time)."""
    import torch
    out = {}
    for name, t in state.items():
        t = t.detach()
        held = into.get(name) if into is not None else None
        if held is None or held.dtype != t.dtype or held.shape != t.shape or not held.is_contiguous():
            held = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        out[name] = held.copy_(t)
    return out


def _on_cpu(state: Mapping[str, torch.Tensor]) -> bool:
    return all(t.device.type == "cpu" for t in state.values())


def _nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def plan_publish(access: Access, cache: PolicyCache, run: str, step: int, state: Mapping[str, torch.Tensor], *,
                 version: int, mode: DeltaMode, full_every: int, sharded_weights: bool) -> PolicyPlan:
    """Decide how ``run@step`` stores policy version ``version`` (see the module's docstring)."""
    from registry.format.delta import encode, full_sha256, read_header
    if sharded_weights:
        raise InvalidStateError("a policy channel publish (delta=...) writes one model.safetensors; "
                                "max_shard_size does not apply")
    catalog = access.catalog
    same = version_step(catalog, run, version)
    if same is not None:
        digest = full_sha256(state)
        if digest != same.full_sha256:
            raise PolicyVersionConflictError(
                f"policy version {version} of {run!r} is already step {same.step} with other weights "
                f"({same.full_sha256[:12]}, these are {digest[:12]}); a version names one set of weights: "
                "publish these as a new version", run=run, step=same.step)
        if same.status != Status.CORRUPT and (same.step == step or same.status in LIVE):
            return PolicyPlan(existing=same)
    # the run's last state, no longer held for another publish: the base when it is this delta's, else memory
    # the copy to remember is written into (a failed publish leaves nothing held: the next reads its base back)
    held = cache.take(run)

    def full(into: Mapping[str, torch.Tensor] | None) -> PolicyPlan:
        return PolicyPlan(record=PolicyRecord(kind="full", full_sha256="", immutable=True),
                          remember=_host_copy(state, into))
    found = newest_base(catalog, run, below=step) if mode is not False else None
    if found is None or mode == "auto" and found[1] >= full_every:
        return full(held[1] if held is not None else None)
    base_row, _length = found
    mine = held[1] if held is not None and held[0] == base_row.full_sha256 else None
    # on CPU, the delta is encoded from the state as it is and each base tensor then takes its bytes: the base's
    # memory becomes the copy remembered as the next delta's base (no second copy, no fresh memory)
    owned = mine is not None and _on_cpu(state)
    base = mine if mine is not None else _read_base(access, run, base_row.step)
    target: Mapping[str, torch.Tensor] = state if owned else _host_copy(state)
    try:
        data = encode(base, target, base_sha256=base_row.full_sha256, advance=owned)
    except DeltaBaseError as exc:  # raised before any base tensor was written
        if mode is True:
            if held is not None:
                cache.put(run, *held)  # untouched: still the run's last state
            raise DeltaBaseError(f"{run}@{step} cannot be a delta against step {base_row.step} "
                                 f"(policy version {base_row.version}): {exc}") from None
        return full(held[1] if held is not None else None)
    remember = base if owned else dict(target)
    if mode == "auto" and len(data) > PAYS * _nbytes(remember):
        return PolicyPlan(record=PolicyRecord(kind="full", full_sha256="", immutable=True), remember=remember)
    digest = read_header(data).target_sha256
    return PolicyPlan(record=PolicyRecord(kind="delta", full_sha256=digest, base_step=base_row.step, immutable=True),
                      delta=data, remember=remember,
                      manifest={POLICY_DELTA: {"base_sha256": base_row.full_sha256, "full_sha256": digest}})


def legacy_record(files: Mapping[str, str]) -> PolicyRecord | None:
    """The row of a plain publish that carries a policy version: a full, when it wrote one ``model.safetensors``
    (``files``: name -> sha256); a later delta publish may use it as its base."""
    digest = files.get(WEIGHTS)
    return PolicyRecord(kind="full", full_sha256=digest) if digest is not None else None


def _read_base(access: Access, run: str, step: int) -> dict[str, torch.Tensor]:
    """A delta's base read back through the reader (when this process does not hold it), under a reader lease."""
    info = access.catalog.get(run, step)
    lease = access.catalog.acquire_lease(run, step, holder=access.holder, ttl=access.lease_ttl)
    if info is None or lease is None:
        raise CheckpointNotFoundError(f"{run}@{step}, the base of a delta, is gone", run=run, step=step)
    try:
        return read_rebuilt(access, access.home.place(info), verify=True, extras=False).state_dict
    finally:
        access.catalog.release_lease(lease)


def read_rebuilt(access: Access, info: CheckpointInfo, *, verify: bool, extras: Any = True,
                 trust_pickle: bool = False, map_location: Any = "cpu", held: Held | None = None) -> Loaded:
    """A placed step from its nearest copy, a delta step rebuilt (what ``registry.ops.reading.read_step`` does);
    ``held``: a version the caller holds already, where the rebuild may start (see
    :func:`registry.ops.materialize.held_in`)."""
    loaded = access.copies.load(info, verify=verify, map_location=map_location, trust_pickle=trust_pickle,
                                extras=extras)
    return loaded if loaded.delta is None else rebuild(access, info, loaded, verify=verify,
                                                       map_location=map_location, held=held)


Held = tuple[str, Mapping[str, "torch.Tensor"]]  # a version's full_sha256 and its tensors, held outside the root


class PolicyHooks:
    """A publish's commit hooks that also record its policy row, and remember its state once it committed."""

    def __init__(self, inner: CommitHooks, plan: PolicyPlan | None, cache: PolicyCache, run: str) -> None:
        self.inner, self.plan, self.cache, self.run = inner, plan, cache, run
        self.recorded: PolicyRecord | None = None

    def _record_of(self, payload: PayloadRecord) -> PolicyRecord | None:
        files = {f.name: f.sha256 for f in payload.files}
        if self.plan is None or self.plan.record is None:
            return legacy_record(files)
        record = self.plan.record
        if record.kind == "full":
            if WEIGHTS not in files:
                raise InvalidStateError("a policy full publish wrote no model.safetensors")
            record = replace(record, full_sha256=files[WEIGHTS])
        return record

    def record(self, payload: PayloadRecord) -> CommitRecord:
        self.recorded = self._record_of(payload)
        return replace(self.inner.record(payload), policy=self.recorded)

    def failed(self) -> None:
        self.inner.failed()

    def done(self) -> None:
        self.inner.done()
        if self.plan is not None and self.plan.remember is not None and self.recorded is not None:
            self.cache.put(self.run, self.recorded.full_sha256, self.plan.remember)


# ---------------------------------------------------------------------------------------------------- reading


def buffer_view(buf: torch.Tensor) -> memoryview:
    from registry.fs.mapping import host_view
    return host_view(buf.cpu() if buf.device.type != "cpu" else buf)


def rebuild(access: Access, info: CheckpointInfo, loaded: Loaded, *, verify: bool, map_location: Any,
            held: Held | None = None) -> Loaded:
    """The delta step ``info`` (read as ``loaded``) with the tensors a full publish of its version gives.

    ``held``: a version the caller holds (by its ``full_sha256``); when it is
    a step of the chain, the rebuild starts there instead of at the full.

    Raises ``CorruptCheckpointError`` when the chain cannot be rebuilt: a
    damaged delta, a base that is gone, a result other than the version's
    ``full_sha256``.
    """
    from registry.format.delta import decode, read_header
    assert loaded.delta is not None
    run = info.run
    chain = chain_steps(access.catalog, run, info.step)
    rows = policy_steps(access.catalog, run, chain)
    row = rows.get(info.step)
    where = info.path

    def broken(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{run}@{info.step} cannot be rebuilt from its delta chain: {why}",
                                      run=run, step=info.step, path=where)

    if row is None or row.kind != "delta" or len(chain) < 2:
        raise broken("the catalog records no delta chain for its delta.safetensors")
    if any(s not in rows for s in chain):
        raise broken("a step of its chain has no policy record")
    folded = _from_fold(access, info, row, held) if held is not None else None
    if folded is not None:  # one decode from what the caller holds, straight to this version
        return replace(loaded, state_dict=_placed(folded, map_location), delta=None)
    start = next((i for i in range(len(chain) - 1, -1, -1)
                  if held is not None and rows[chain[i]].full_sha256 == held[0]), None)
    anchored = _anchored(access, run, chain, rows, after=start)
    state: Mapping[str, torch.Tensor]
    if anchored is not None:
        start, state = anchored
    elif held is not None and start is not None:
        state = held[1]
    else:
        start = 0
        state = _read_part(access, run, chain[0], verify=verify, broken=broken).state_dict
    digest = rows[chain[start]].full_sha256
    for s in chain[start + 1:]:
        part = loaded if s == info.step else _read_part(access, run, s, verify=verify, broken=broken)
        if part.delta is None:
            raise broken(f"step {s} of its chain holds no delta.safetensors")
        try:  # every tensor's digest is checked at the last link, which a wrong element of any link reaches
            state = decode(state, buffer_view(part.delta), base_sha256=digest, path=f"{run}@{s}/delta.safetensors",
                           check_tensors=s == info.step)
        except DeltaBaseError as exc:
            raise broken(f"step {s}: {exc}") from None
        digest = rows[s].full_sha256
    if read_header(buffer_view(loaded.delta), path=where).target_sha256 != row.full_sha256:
        raise broken("its delta does not end at the digest the catalog records for its version")
    return replace(loaded, state_dict=_placed(state, map_location), delta=None)


def _anchored(access: Access, run: str, chain: list[int], rows: Mapping[int, PolicyStepInfo], *,
              after: int | None) -> tuple[int, dict[str, torch.Tensor]] | None:
    """The newest step of ``chain`` past index ``after`` with a usable anchor, as (its index, its tensors); None
    when there is none (an anchor that cannot be read is passed over: the chain is read instead)."""
    import torch

    from registry.fs.filemaps import tensors_of
    stored = {f.to_step: f for f in anchors(access.catalog, run)}
    for i in range(len(chain) - 1, 0 if after is None else after, -1):
        fold_row = stored.get(chain[i])
        if fold_row is None or fold_row.sha256 != rows[chain[i]].full_sha256:
            continue
        data = read_fold(access, fold_row)
        if data is None:
            continue
        try:
            tensors = tensors_of(torch.frombuffer(data, dtype=torch.uint8),
                                 Path(access.home.aside().where(fold_row.path)))
        except RegistryError:
            continue
        return i, tensors
    return None


def anchors(catalog: Catalog, run: str) -> list[FoldRecord]:
    """The run's verified anchors (folds from a step to itself, see the module's docstring)."""
    return [f for f in folds(catalog, run) if f.anchor and f.status == "verified"]


def _placed(state: Mapping[str, torch.Tensor], map_location: Any) -> dict[str, torch.Tensor]:
    if map_location is not None and map_location != "cpu":
        return {k: v.to(map_location) for k, v in state.items()}
    return dict(state)


def _from_fold(access: Access, info: CheckpointInfo, row: PolicyStepInfo, held: Held) -> dict[str, torch.Tensor] | None:
    """The version of ``info`` from a stored fold that starts at the version ``held`` is, when there is one and
    it reads back whole; None otherwise (the chain is read instead: a bad fold is never the step's fault)."""
    from registry.format.delta import decode, read_header
    stored = [f for f in folds(access.catalog, info.run)
              if f.to_step == info.step and f.status == "verified" and not f.anchor]
    starts = policy_steps(access.catalog, info.run, [f.from_step for f in stored]) if stored else {}
    for fold_row in stored:
        start = starts.get(fold_row.from_step)
        if start is None or start.full_sha256 != held[0]:
            continue
        data = read_fold(access, fold_row)
        if data is None:
            continue
        try:
            if read_header(data).target_sha256 != row.full_sha256:
                continue
            return decode(held[1], data, base_sha256=held[0])
        except RegistryError:
            continue
    return None


def read_fold(access: Access, fold_row: FoldRecord) -> bytearray | memoryview | None:
    """A stored fold's bytes, read through the root and checked against its row (its pieces' xxh3 on every
    core where the row records them, else its sha256); None when they cannot be used. Bytes that differ are
    read once more from storage: a mismatch that stands marks the row ``corrupt`` (never used again), one that
    does not was this host's or the wire's; a read that fails (a file gone, a server down) says nothing about
    the fold and marks nothing. The bytes are one buffer (:meth:`~registry.roots.aside.Aside.whole`): an
    anchor (a model whole) is never held twice, and its tensors are views over what this returns."""
    aside = access.home.aside()
    where = aside.where(fold_row.path)

    def checked() -> bytearray | memoryview:
        data = aside.whole(fold_row.path, fold_row.size)
        _check_fold(data, fold_row, where)
        return data
    return _checked_fold(access, fold_row, checked)


def _check_fold(data: bytearray | memoryview, fold_row: FoldRecord, where: str) -> None:
    import hashlib

    from registry.format.pieces import first_mismatch
    if fold_row.piece_size is not None and fold_row.xxh3_128_pieces is not None:
        bad = first_mismatch(data, fold_row.piece_size, fold_row.xxh3_128_pieces)
        if bad is not None:
            which = "its piece count" if bad < 0 else f"piece {bad} (bytes from {bad * fold_row.piece_size})"
            raise CorruptCheckpointError(f"policy fold {where}: {which} differs from its row", run=fold_row.run)
        return
    _check_sha256(hashlib.sha256(data).hexdigest(), fold_row, where)


def _check_sha256(digest: str, fold_row: FoldRecord, where: str) -> None:
    if digest != fold_row.sha256:
        raise CorruptCheckpointError(f"policy fold {where} has sha256 {digest}, its row records {fold_row.sha256}",
                                     run=fold_row.run)


def fold_intact(access: Access, fold_row: FoldRecord) -> bool:
    """Whether a stored fold reads back as its row's sha256, with :func:`read_fold`'s verdicts; read as a stream,
    never held whole (an anchor is a whole model)."""
    import hashlib
    aside = access.home.aside()
    where = aside.where(fold_row.path)

    def streamed() -> bool:
        sha = hashlib.sha256()
        for block in aside.chunks(fold_row.path):
            sha.update(block)
        _check_sha256(sha.hexdigest(), fold_row, where)
        return True
    return _checked_fold(access, fold_row, streamed) is not None


def _checked_fold(access: Access, fold_row: FoldRecord, read: Callable[[], _T]) -> _T | None:
    """What ``read`` gives (it raises ``CorruptCheckpointError`` for bytes that are not the row's), with the
    verdicts of :func:`read_fold`."""
    from registry.ops.verdicts import read_again
    where = access.home.aside().where(fold_row.path)
    try:
        try:
            return read()
        except CorruptCheckpointError as first:
            return read_again(first, read, what=f"policy fold {where}")
    except CorruptCheckpointError as stands:
        log.warning("%s; marked corrupt, never used", stands)
        condemn_fold(access.catalog, fold_row, to="corrupt")
        return None
    except OSError as exc:
        log.warning("cannot read policy fold %s: %s", where, exc)
        return None


def _read_part(access: Access, run: str, step: int, *, verify: bool, broken: Any) -> Loaded:
    """One earlier step of a chain, as stored (a delta's bytes unapplied), from this host's nearest copy."""
    info = access.catalog.get(run, step)
    if info is None or info.status not in LIVE:
        raise broken(f"its base step {step} is {info.status if info is not None else 'gone'}")
    placed = access.home.place(info)
    try:
        return access.copies.load(placed, verify=verify, map_location="cpu", trust_pickle=False, extras=False)
    except CorruptCheckpointError as exc:
        _condemn_base(access, placed, exc)
        raise broken(f"its base step {step} is damaged ({exc})") from exc


def _condemn_base(access: Access, info: CheckpointInfo, exc: CorruptCheckpointError) -> None:
    """A base step whose bytes did not match: read again from storage and, when the mismatch stands, marked
    ``corrupt`` itself (by compare-and-set on its digest), as a load of it would, so the verdict is on the
    step that is damaged and not only on the delta that could not be rebuilt."""
    from registry.ops.scrub import recheck
    from registry.ops.verdicts import read_again
    try:
        read_again(exc, lambda: recheck(info, home=access.home), what=f"{info.run}@{info.step}")
    except CorruptCheckpointError as stands:
        if not access.copies.condemn(info, info.manifest_sha256 or "", str(stands)):
            access.catalog.set_status(info.run, info.step, Status.CORRUPT, kind="corrupt", actor=access.holder,
                                      only_from=LIVE, manifest_sha256=info.manifest_sha256, reason=str(stands))
    except RegistryError:
        pass  # no verdict rests on a read that failed for another reason


__all__ = ["ANCHOR", "FOLDS", "FULL_EVERY", "DeltaMode", "Held", "PolicyCache", "PolicyHooks", "PolicyPlan",
           "anchors", "buffer_view", "check_delta", "fold_intact", "legacy_record", "plan_publish", "read_fold",
           "read_rebuilt", "rebuild"]
