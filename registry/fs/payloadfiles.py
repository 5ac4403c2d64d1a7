"""What a checkpoint's files are, written once wherever they go: the payload, its JSON, the manifest last.

:func:`write_files` is the one list of a payload's files (meta, config, the
weights or their shards and index, the extras, the manifest); the
filesystem's staging directory (:func:`registry.fs.store.write_payload`) and
an object store's attempt prefix (:mod:`registry.fs.objectwrite`) each give
it a ``put`` that stores one file. Knows nothing of SQL or of where files go.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from registry.errors import InvalidStateError
from registry.format.manifest import (CONFIG, DELTA, MANIFEST, MAX_JSON_BYTES, META, WEIGHTS, WEIGHTS_INDEX,
                                      FileEntry, Manifest, check_file_name)
from registry.format.safetensors import PUBLISH_METADATA, Encoded
from registry.fs.hashing import HashingWriter

if TYPE_CHECKING:
    import torch


def json_bytes(doc: Mapping[str, Any], what: str) -> bytes:
    """The bytes of a JSON file that the reader (``registry.fs.filemaps.json_object``) gives back as ``doc``.

    So: string keys only (``json`` would turn ``1`` into ``"1"``), finite
    numbers, at most ``MAX_JSON_DEPTH`` levels and ``MAX_JSON_BYTES`` bytes.
    """
    try:
        raw = (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode()
        _check_keys(doc)  # after dumps, which refuses cycles
    except (TypeError, ValueError) as exc:
        raise InvalidStateError(f"{what} is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise InvalidStateError(f"{what} is not JSON-serialisable: it is nested too deeply") from None
    if len(raw) > MAX_JSON_BYTES:
        raise InvalidStateError(f"{what} is {len(raw)} bytes as JSON; at most {MAX_JSON_BYTES} can be stored")
    return raw


MAX_JSON_DEPTH = 200  # far inside what json.loads parses from any reader's stack depth


def _check_keys(doc: Any) -> None:
    stack = [(doc, 1)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, (dict, list, tuple)) and depth > MAX_JSON_DEPTH:
            raise ValueError(f"it is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(obj, dict):
            for key, value in obj.items():
                if not isinstance(key, str):
                    raise TypeError(f"key {key!r} ({type(key).__name__}) is not a string; JSON object keys are strings")
                stack.append((value, depth + 1))
        elif isinstance(obj, (list, tuple)):
            stack.extend((value, depth + 1) for value in obj)


@dataclass(frozen=True, kw_only=True)
class Payload:
    """Everything that goes into one checkpoint directory."""

    state_dict: Mapping[str, torch.Tensor]
    meta: Mapping[str, Any]
    config: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    max_shard_size: int | None = None
    meta_json: bytes | None = None  # ``meta`` already encoded by ``json_bytes``, when the caller checked it
    config_json: bytes | None = None
    # a policy delta step: this file (registry.format.delta) is stored as ``delta.safetensors`` in place of the
    # weights; ``state_dict`` is still the whole target, whose names the manifest lists
    delta: bytes | None = None
    manifest_fields: Mapping[str, Any] = field(default_factory=dict)  # more top-level manifest fields


@dataclass(frozen=True, kw_only=True)
class Written:
    manifest: Manifest
    manifest_sha256: str
    total_bytes: int  # every file, the manifest included
    heads: Mapping[str, bytes] = field(default_factory=dict)  # safetensors file -> the header bytes written


def _shards(state_dict: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(state_dict):
        t = state_dict[name]
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def entry_of(name: str, out: HashingWriter) -> FileEntry:
    """The manifest entry of a file ``out`` has finished writing (and hashing)."""
    assert out.sha256 is not None
    return FileEntry(name=name, size=out.size, sha256=out.sha256, piece_size=out.piece_size,
                     xxh3_128_pieces=out.xxh3_128_pieces)


def write_files(payload: Payload, put: Callable[[str, Callable[[Any], object]], FileEntry], *,
                reuse: Callable[[str, Encoded], FileEntry | None] | None = None) -> Written:
    """Every file of ``payload``, manifest last, through ``put(name, fill)``: what a checkpoint holds, once.

    ``put`` opens file ``name`` wherever the payload goes (a staging
    directory, an attempt prefix in a bucket), lets ``fill(out)`` write it
    and returns its finished entry. Each safetensors file is first offered to
    ``reuse(name, encoded)`` (dedup), which may store it without writing it and
    return its entry.
    """
    entries: dict[str, FileEntry] = {}
    heads: dict[str, bytes] = {}

    def add(name: str, writer_fn: Any) -> str:
        entries[name] = put(name, writer_fn)
        return entries[name].sha256

    def add_tensors(name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        encoded = Encoded(tensors, PUBLISH_METADATA)
        heads[name] = encoded.head
        entry = reuse(name, encoded) if reuse is not None else None
        if entry is not None:
            entries[name] = entry
        else:
            add(name, encoded.write)

    meta_raw = payload.meta_json if payload.meta_json is not None else json_bytes(payload.meta, "meta")
    config_raw = payload.config_json if payload.config_json is not None else json_bytes(payload.config, "config")
    add(META, lambda out: out.write(meta_raw))
    add(CONFIG, lambda out: out.write(config_raw))
    state = payload.state_dict
    if payload.delta is not None:
        delta = payload.delta
        add(DELTA, lambda out: out.write(delta))
    elif payload.max_shard_size is None:
        add_tensors(WEIGHTS, state)
    else:
        groups = _shards(state, payload.max_shard_size)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(groups, start=1):
            shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            add_tensors(shard, {n: state[n] for n in names})
            weight_map.update({n: shard for n in names})
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        index_raw = json_bytes(index, "weights index")
        add(WEIGHTS_INDEX, lambda out: out.write(index_raw))
    import torch
    for key, value in payload.extra.items():
        name = check_file_name(f"{key}.pt")
        try:
            add(name, lambda out, value=value: torch.save(value, out))
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise InvalidStateError(f"extra {key!r} cannot be saved: {exc}") from None

    manifest = Manifest(
        files=dict(entries), tensors=tuple(sorted(state)),
        created_at=payload.meta.get("timestamp"),
        optimizer_step=payload.meta.get("optimizer_step"),
        policy_version=payload.meta.get("policy_version"),
        extra_fields=dict(payload.manifest_fields),
    )
    raw = manifest.encode()
    manifest_sha256 = add(MANIFEST, lambda out: out.write(raw))
    return Written(manifest=manifest, manifest_sha256=manifest_sha256,
                   total_bytes=manifest.total_bytes + len(raw), heads=heads)
