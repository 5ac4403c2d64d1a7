"""Checks at the door of a publish: everything that can be refused is refused before the claim.

A publish that fails after its catalog row was claimed leaves a ``failed``
row (and, with ``blocking=False``, an error that only shows on the future);
one that succeeds with a value the reader refuses condemns the step at its
first load. So every argument is checked here, on the caller's thread,
against the rules of whatever will read it back: ``config`` and ``meta`` are
encoded once to the JSON bytes the writer stores (``registry.fs.payloadfiles.json_bytes``),
the fields that reach ``manifest.json`` go through the manifest's own parser,
the numbers that reach the catalog must fit its 64-bit columns, and every
``extra`` must load under ``torch.load(weights_only=True)`` unless the caller
says ``trust_pickle=True``.

``meta`` is the caller's; the registry's own keys in ``meta.json``
(:data:`RESERVED_META`) come from the keyword arguments. ``meta`` may repeat
one of them only with the very value recorded (so a loaded checkpoint's meta
can be passed on), never with another (it would contradict the catalog).
``timestamp`` is always the time of the publish: a string there (a loaded
checkpoint's) is replaced by it, anything else is refused.
"""

from __future__ import annotations

import functools
import io
import math
import numbers
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import InvalidStateError, ManifestError, UnsafePathError, UnsafePickleError
from registry.format.refs import MAX_STEP, check_metric_key, check_tag_name
from registry.fs.store import now_timestamp

# The manifest's, the safetensors writer's and the payload's modules are imported by the checks that use them:
# check_flags is also what every Registry.open runs, and a listing never writes a payload.
if TYPE_CHECKING:
    from registry.fs.payloadfiles import Payload
    import torch

RESERVED_META = ("epoch", "consumed_samples", "timestamp", "optimizer_step", "policy_version")
MAX_FILE_NAME = 255  # bytes in one path component on every filesystem we write to


@functools.cache
def _always_accepted() -> tuple[frozenset[type], frozenset[type]]:
    """The leaves the weights-only unpickler always accepts, and the tensor types it accepts without attributes.

    Anything else is tried for real (``_loads_weights_only``).
    """
    import torch
    return (frozenset({str, int, float, bool, type(None), bytes, torch.Size, torch.dtype, torch.device}),
            frozenset({torch.Tensor, torch.nn.Parameter}))


def check_count(value: object, what: str, *, optional: bool = False) -> int | None:
    """A non-negative integer that fits the catalog's 64-bit columns (``None`` too if ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        raise InvalidStateError(f"{what} must be a non-negative 64-bit integer{' or None' if optional else ''}, "
                                f"got {value!r}")
    return value


def check_flags(**flags: object) -> None:
    """Options that must be booleans: a string such as ``"no"`` would otherwise count as true."""
    for name, value in flags.items():
        numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
        if not isinstance(value, bool) and not numpy_bool:
            raise InvalidStateError(f"{name} must be True or False, got {value!r}")


def check_timeout(timeout: object) -> None:
    """A wait's ``timeout``: a non-negative number of seconds, or None (wait as long as it takes)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or math.isnan(timeout) or timeout < 0):
        raise InvalidStateError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")


def check_lease_ttl(ttl: object, what: str = "ttl") -> timedelta:
    """How long a reader's lease lasts: a ``timedelta`` >= 0 (0: one that has expired as it is taken)."""
    if not isinstance(ttl, timedelta) or ttl < timedelta(0):
        raise InvalidStateError(f"{what} must be a timedelta >= 0, got {ttl!r}")
    return ttl


def check_full_every(full_every: object) -> int:
    """``Registry.open(full_every=...)``: a policy publish stores a full at least every that many versions."""
    if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
        raise InvalidStateError(f"full_every must be a positive number of versions, got {full_every!r}")
    return full_every


def check_keep_days(days: object) -> float:
    """A number of days a log keeps what it may forget (``Registry.open(policy_loads_keep_days=...)``)."""
    if isinstance(days, bool) or not isinstance(days, (int, float)) or not days >= 0 or days == float("inf"):
        raise InvalidStateError(f"keep_days must be a finite number of days >= 0, got {days!r}")
    return float(days)


def check_tags(tags: object) -> tuple[str, ...]:
    """Tag names, each checked; a lone string is refused rather than read as one tag per character."""
    if isinstance(tags, (str, bytes)):
        raise InvalidStateError(f"tags must be a list of tag names, not the string {tags!r}; "
                                f"write tags=[{tags!r}]")
    try:
        names = list(tags)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidStateError(f"tags must be a list of tag names, got {type(tags).__name__}") from None
    return tuple(dict.fromkeys(check_tag_name(t) for t in names))


def check_metrics(run: str, step: int, metrics: Mapping[str, Any] | None) -> list[tuple[int, str, float]]:
    """``metrics`` as the catalog records them: ``(step, key, value)`` with finite float values."""
    if metrics is None:
        return []
    if not isinstance(metrics, Mapping):
        raise InvalidStateError(f"metrics for {run}@{step} must be a mapping of names to numbers")
    import torch
    out = []
    for key, value in metrics.items():
        check_metric_key(key)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
            value = value.item()
        # numbers.Real admits numpy scalars; bools are numbers to Python but never a metric
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InvalidStateError(f"metric {key!r} at {run}@{step} is {value!r}, not a number", run=run, step=step)
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise InvalidStateError(f"metric {key!r} at {run}@{step} is {value!r}; only finite values can be ranked",
                                    run=run, step=step)
        out.append((step, key, number))
    return out


def check_max_shard_size(value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise InvalidStateError(f"max_shard_size must be a positive number of bytes, got {value!r}")
    return value


def _mapping(value: object, what: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidStateError(f"{what} must be a mapping (a JSON object), got {type(value).__name__}")
    return value


def publish_meta(meta: object, *, epoch: object, consumed_samples: object, optimizer_step: object,
                 policy_version: object, timestamp: str) -> dict[str, Any]:
    """The whole ``meta.json``: the caller's ``meta`` plus the registry's keys, each checked.

    Raises ``InvalidStateError`` for a bad number, for a reserved key in
    ``meta`` whose value differs from the one recorded, and for any
    ``timestamp`` in ``meta`` that is not a string; the header fields are then parsed by the
    manifest's own parser, as a reader will parse them.
    """
    user = _mapping(meta, "meta")
    own: dict[str, Any] = {
        "epoch": check_count(epoch, "epoch"),
        "consumed_samples": check_count(consumed_samples, "consumed_samples"),
        "timestamp": timestamp,
        "optimizer_step": check_count(optimizer_step, "optimizer_step"),
        "policy_version": check_count(policy_version, "policy_version", optional=True),
    }
    for key in RESERVED_META:
        if key not in user:
            continue
        value, recorded = user[key], own[key]
        if key == "timestamp":
            if not isinstance(value, str):
                raise InvalidStateError(f"meta['timestamp'] is {value!r}: the registry records the time of the "
                                        "publish there; store your own time under another key")
            continue  # a loaded checkpoint's time, passed on: replaced by this publish's
        if type(value) is not type(recorded) or value != recorded:
            raise InvalidStateError(f"meta[{key!r}] is {value!r} but this publish records {key}={recorded!r}; "
                                    f"pass {key}= to publish instead of setting it in meta")
    check_manifest_fields(own)
    return {**own, **user, "timestamp": timestamp}


def check_manifest_fields(meta: Mapping[str, Any]) -> None:
    """Run the reader's manifest parser over the fields ``meta`` puts into ``manifest.json``.

    The writer copies ``timestamp``, ``optimizer_step`` and ``policy_version``
    from ``meta.json``'s document into the manifest (``registry.fs.store.write_payload``).
    """
    from registry.format.manifest import MANIFEST, META, FileEntry, Manifest, parse_manifest

    probe = Manifest(files={META: FileEntry(name=META, size=0, sha256="0" * 64)},
                     created_at=meta.get("timestamp"), optimizer_step=meta.get("optimizer_step"),
                     policy_version=meta.get("policy_version"))
    try:
        parse_manifest(probe.encode(), path=Path(MANIFEST))
    except ManifestError as exc:
        raise InvalidStateError(f"meta would make manifest.json invalid: {str(exc).split(': ', 1)[-1]}") from None


def encode_json(value: object, what: str) -> tuple[dict[str, Any], bytes]:
    """A shallow copy of the mapping ``value`` and the JSON bytes the writer will store for it."""
    from registry.fs.payloadfiles import json_bytes

    doc = dict(_mapping(value, what))
    return doc, json_bytes(doc, what)


def check_extra_names(extra: Mapping[Any, Any]) -> None:
    from registry.format.manifest import check_file_name

    for key in extra:
        if not isinstance(key, str) or not key or key.startswith("."):
            raise InvalidStateError(f"invalid extra name {key!r}: it becomes the file name NAME.pt")
        try:
            check_file_name(f"{key}.pt")
        except UnsafePathError:
            raise InvalidStateError(f"invalid extra name {key!r}: it becomes the file name NAME.pt, "
                                    "which must be a plain file name") from None
        if len(f"{key}.pt".encode("utf-8", "surrogatepass")) > MAX_FILE_NAME:
            raise InvalidStateError(f"extra name {key[:40]!r}... is too long: NAME.pt must fit "
                                    f"{MAX_FILE_NAME} bytes")


def check_extras(extra: object, *, trust_pickle: bool) -> dict[str, Any]:
    """``extra`` as a dict, once every value is known to save, and to load without ``trust_pickle``.

    Walks each value: plain containers, tensors and the primitives the
    weights-only unpickler always accepts pass at the cost of a type check;
    any other object is pickled (tensor storages by reference, so no tensor
    data is copied) and run through torch's weights-only unpickler itself,
    which decides. With ``trust_pickle`` only picklability is checked.
    """
    extras = dict(_mapping(extra, "extra"))
    check_extra_names(extras)
    for key, value in extras.items():
        if trust_pickle:
            _pickle(key, key, value)
            continue
        odd = _first_refused(key, value)
        if odd is not None:
            where, obj = odd
            kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
            raise UnsafePickleError(
                f"extra {key!r} holds a {kind} at {where}, which torch.load(weights_only=True) refuses, so "
                "every load of this step would need trust_pickle=True; convert it to tensors or plain data, "
                "or pass trust_pickle=True to publish to accept that")
    return extras


def _first_refused(key: str, value: Any) -> tuple[str, Any] | None:
    """The first object inside ``value`` that the weights-only unpickler refuses, with where it is."""
    # a path is (parent path, step) and is spelt out only for the object refused
    stack: list[tuple[Any, Any]] = [(value, None)]
    seen: set[int] = set()
    plain, tensors = _always_accepted()
    while stack:
        obj, path = stack.pop()
        kind = type(obj)
        if kind in plain:
            continue
        if id(obj) in seen:
            continue
        if kind in tensors and not obj.__dict__:
            continue
        seen.add(id(obj))
        if kind is dict or kind is OrderedDict:
            if kind is OrderedDict and obj.__dict__:  # a module state dict's _metadata: rebuilt by BUILD
                stack.extend((v, (path, f".{k}")) for k, v in obj.__dict__.items())
            for k, v in obj.items():
                stack.append((k, (path, k, "key")))
                stack.append((v, (path, k)))
        elif kind is list or kind is tuple:
            stack.extend((v, (path, i)) for i, v in enumerate(obj))
        else:
            where = _spell(key, path)
            if not _loads_weights_only(key, where, obj):
                return where, obj
    return None


def _spell(key: str, path: Any) -> str:
    parts: list[str] = []
    while path is not None:
        step = path[1]
        parts.append(step if isinstance(step, str) and step.startswith(".") and len(path) == 2
                     else f"[{step!r}]" + (" (a key)" if len(path) == 3 else ""))
        path = path[0]
    return key + "".join(reversed(parts))


class _Probe(pickle.Pickler):
    """Pickles like ``torch.save`` (protocol 2) but keeps tensor storages by reference."""

    def __init__(self, file: io.BytesIO) -> None:
        import torch
        super().__init__(file, protocol=2)
        self.storages: list[Any] = []
        self._storage_types = (torch.storage.TypedStorage, torch.storage.UntypedStorage)

    def persistent_id(self, obj: Any) -> tuple[str, int] | None:
        if isinstance(obj, self._storage_types):
            self.storages.append(obj)
            return ("storage", len(self.storages) - 1)
        return None


def _pickle(key: str, where: str, obj: Any) -> tuple[bytes, list[Any]]:
    """``obj`` pickled as ``torch.save`` would, and the storages it refers to."""
    out = io.BytesIO()
    probe = _Probe(out)
    try:
        probe.dump(obj)
    except Exception as exc:  # noqa: BLE001 - whatever torch.save would raise on it
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InvalidStateError(f"extra {key!r} cannot be saved: {where}: {text}") from None
    return out.getvalue(), probe.storages


def _loads_weights_only(key: str, where: str, obj: Any) -> bool:
    """Whether torch's weights-only unpickler (the one ``torch.load`` uses) accepts ``obj``.

    It only ever calls the functions torch allows, so running it on a
    caller's object is as safe as loading the step would be.
    """
    raw, storages = _pickle(key, where, obj)
    try:
        try:
            from torch._weights_only_unpickler import Unpickler
        except ImportError:  # a torch that moved it: the public way, which copies the tensors' data
            import torch
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
            return True
        unpickler = Unpickler(io.BytesIO(raw), encoding="utf-8")
        unpickler.persistent_load = lambda pid: storages[pid[1]]  # type: ignore[method-assign]
        unpickler.load()
    except Exception:  # noqa: BLE001 - refused, or a rebuild that would fail at load too
        return False
    return True


def checked_payload(*, step: int, state_dict: dict[str, torch.Tensor], extra: object, config: object,
                    meta: object, epoch: object, consumed_samples: object, optimizer_step: object,
                    policy_version: object, max_shard_size: object, trust_pickle: bool,
                    timestamp: str) -> Payload:
    """The ``Payload`` of a publish, with ``meta.json`` and ``config.json`` already encoded."""
    from registry.fs.payloadfiles import Payload, json_bytes

    full_meta = publish_meta(meta, epoch=epoch, consumed_samples=consumed_samples,
                             optimizer_step=step if optimizer_step is None else optimizer_step,
                             policy_version=policy_version, timestamp=timestamp)
    meta_raw = json_bytes(full_meta, "meta")
    config_doc, config_raw = encode_json(config, "config")
    return Payload(state_dict=state_dict, meta=full_meta, config=config_doc,
                   extra=check_extras(extra, trust_pickle=trust_pickle),
                   max_shard_size=check_max_shard_size(max_shard_size),
                   meta_json=meta_raw, config_json=config_raw)


def saved_payload(state_dict: Mapping[str, torch.Tensor], *, epoch: int, consumed_samples: int,
                  meta: Mapping[str, Any], config: Mapping[str, Any], extra: Mapping[str, Any],
                  policy_version: int | None, max_shard_size: int | None) -> Payload:
    """The ``Payload`` of a catalog-free save (``Checkpoint.save``, an export): ``meta.json`` as the
    reference module writes it, stamped now and checked against what a manifest may hold."""
    from registry.format.safetensors import check_state_dict
    from registry.fs.payloadfiles import Payload

    full_meta = {"epoch": epoch, "consumed_samples": consumed_samples, "timestamp": now_timestamp(), **meta}
    if policy_version is not None:
        full_meta.setdefault("policy_version", policy_version)
    check_manifest_fields(full_meta)
    return Payload(state_dict=check_state_dict(state_dict), meta=full_meta, config=config, extra=extra,
                   max_shard_size=max_shard_size)
