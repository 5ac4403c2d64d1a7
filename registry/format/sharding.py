"""The layout marker of a sharded (``torch.distributed.checkpoint``) step, kept in its manifest.

A sharded step's directory holds DCP's own files (``.metadata`` and one or
more ``__R_N.distcp`` per saving rank) next to ``meta.json``, ``config.json``
and ``manifest.json``. The manifest lists every file like any other, and
records the layout under ``"layout"``::

    "format_version": 2,
    "layout": {"kind": "dcp", "world_size": 2, "files_per_rank": {"0": ["__0_0.distcp"], ...}}

``format_version`` 2 is what makes the reference module (and registry
versions that predate sharding) refuse the directory with "Unsupported
checkpoint format version" instead of reading something that is not there.
Full (safetensors) steps keep format version 1 and no ``layout``, byte for
byte as before. Knows nothing of torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.errors import ManifestError

SHARDED_FORMAT_VERSION = 2
DCP = "dcp"
DCP_METADATA = ".metadata"
_DISTCP_RE = re.compile(r"__([0-9]{1,6})_([0-9]{1,6})\.distcp")


@dataclass(frozen=True, kw_only=True)
class ShardedLayout:
    """How a sharded step was saved: by how many ranks, and which files each wrote."""

    world_size: int
    files_per_rank: tuple[tuple[str, ...], ...]  # index = saving rank
    kind: str = DCP

    @property
    def data_files(self) -> tuple[str, ...]:
        return tuple(name for names in self.files_per_rank for name in names)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "world_size": self.world_size,
                "files_per_rank": {str(r): list(names) for r, names in enumerate(self.files_per_rank)}}


def rank_of(name: str) -> int | None:
    """The saving rank of a DCP data file name (``__1_0.distcp`` -> 1), None for any other name."""
    m = _DISTCP_RE.fullmatch(name)
    return int(m.group(1)) if m is not None else None


def layout_of(files: Mapping[str, object], world_size: int) -> ShardedLayout:
    """The layout of DCP files named in ``files`` (the ``.distcp`` ones), saved by ``world_size`` ranks."""
    per_rank: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(files):
        rank = rank_of(name)
        if rank is not None and rank < world_size:
            per_rank[rank].append(name)
    return ShardedLayout(world_size=world_size, files_per_rank=tuple(tuple(n) for n in per_rank))


def parse_layout(doc: object, files: Mapping[str, object], *, path: Path) -> ShardedLayout:
    """A manifest's ``layout`` field, checked against the files it lists."""
    bad = ManifestError(f"manifest {path} has an invalid sharded layout", path=path)
    if not isinstance(doc, dict) or doc.get("kind") != DCP:
        raise bad
    world, per_rank = doc.get("world_size"), doc.get("files_per_rank")
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= 1 << 20:
        raise bad
    if not isinstance(per_rank, dict) or set(per_rank) != {str(r) for r in range(world)}:
        raise bad
    ranks: list[tuple[str, ...]] = []
    for r in range(world):
        names = per_rank[str(r)]
        if not isinstance(names, list) or not all(isinstance(n, str) and rank_of(n) == r for n in names):
            raise bad
        ranks.append(tuple(names))
    listed = [n for names in ranks for n in names]
    if len(set(listed)) != len(listed) or not set(listed) <= set(files) or DCP_METADATA not in files:
        raise ManifestError(f"manifest {path}: the sharded layout names files the manifest does not list",
                            path=path)
    return ShardedLayout(world_size=world, files_per_rank=tuple(ranks))


__all__ = ["DCP", "DCP_METADATA", "SHARDED_FORMAT_VERSION", "ShardedLayout", "layout_of", "parse_layout", "rank_of"]
