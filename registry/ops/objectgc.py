"""Retention on an ``s3://`` root: the :class:`~registry.ops.retention.Deletion` for an object-store root.

The plan, the re-check inside the marking transaction and the catalog states
are retention's own (:mod:`registry.ops.retention`); what differs is the
removal. There is no rename on object storage, so a ``deleted`` row's payload
goes by deleting the keys under its attempt prefix, manifest first
(:func:`registry.fs.prefixes.remove_prefix`). Attempt prefixes are never
reused (a re-publish of the step gets a fresh one), so a deleted row's prefix
holds only the payload it deleted and needs no digest check before it goes.
A gc killed after marking left a ``deleted`` row whose keys are still there:
the next gc (or ``fsck --repair``) lists the run once and deletes them.

No dedup on object storage: a step holds its own objects, and its bytes are
the catalog's sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.catalog import Catalog
from registry.catalog.retention import DeletedRow
from registry.fs.objects import ObjectRoot
from registry.fs.prefixes import remove_prefix, scan
from registry.records import CheckpointInfo


@dataclass(frozen=True)
class ObjectDeletion:
    """:class:`~registry.ops.retention.Deletion` for an object-store root."""

    root: ObjectRoot

    def locate(self, info: CheckpointInfo) -> CheckpointInfo:
        return info.at(self.root.url(info.path.as_posix()))

    def held(self, info: CheckpointInfo) -> Mapping[Any, int]:
        return {}  # no object is shared between steps: the catalog's size is the step's

    def freed_bytes(self, doomed: Sequence[CheckpointInfo]) -> int:
        return sum(c.total_bytes for c in doomed)

    def kept_bytes(self, kept: Sequence[CheckpointInfo]) -> int:
        return sum(c.total_bytes for c in kept)

    def shared_bytes(self, doomed: Sequence[Path], kept: Sequence[Path]) -> int:
        return 0

    def guard(self, catalog: Catalog, run: str, doomed: Sequence[int]) -> dict[int, str]:
        return {}

    def after_mark(self, catalog: Catalog, run: str) -> None:
        pass

    def reclaim(self, catalog: Catalog, run: str) -> tuple[Path, ...]:
        return ()

    def remove(self, row: DeletedRow) -> bool:
        return remove_prefix(self.root, row.path, point="gc-after-retire")

    def finish(self, run: str, rows: Sequence[DeletedRow]) -> tuple[set[int], dict[int, str]]:
        """One listing of the run; the keys of every ``deleted`` row's prefix still there are deleted."""
        if not rows:
            return set(), {}
        healed: set[int] = set()
        errors: dict[int, str] = {}
        try:
            present = scan(self.root, run)
        except OSError as exc:
            return set(), {r.step: f"cannot list {self.root.url(run)}: {exc}" for r in rows}
        for row in rows:
            found = present.get(row.path)
            if found is None:
                continue
            try:
                remove_prefix(self.root, row.path, [e.rel for e in found.entries], point="gc-after-retire")
                healed.add(row.step)
            except OSError as exc:
                errors[row.step] = f"cannot delete {self.root.url(row.path)}: {exc}"
        return healed, errors


__all__ = ["ObjectDeletion"]
