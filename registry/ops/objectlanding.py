"""Phases 2 and 3 of the publish sequence on an object-store root: an attempt prefix, no rename.

A publish uploads to ``RUN/step-N/a-<16 hex>/``, a prefix no other attempt
can use (:func:`registry.format.layout.attempt_relpath`); the claim names it, so fsck knows an
in-flight attempt's keys. Nothing is installed: the catalog commit that
names the prefix is what makes the step visible. An overwrite leaves the old
prefix alone until the commit has happened and then deletes its keys; a
failure before the commit deletes the new prefix's keys and the old payload
was never touched. A crash in between leaves an orphan prefix for fsck.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from registry.catalog import Claim
from registry.errors import PublishError, RegistryError, StorageError
from registry.fs.objects import ObjectRoot
from registry.fs.objectwrite import check_uploaded
from registry.fs.prefixes import remove_prefix
from registry.fs.store import FileProblem
from registry.fs.payloadfiles import Written
from registry.records import HAS_PAYLOAD

log = logging.getLogger(__name__)


@dataclass
class ObjectLanding:
    """The :class:`registry.ops.protocol.Landing` of an ``s3://`` root for one attempt prefix ``rel``."""

    root: ObjectRoot
    rel: str
    links: bool = False  # objects share nothing: there is no dedup on an object store
    _old: str | None = None

    @property
    def where(self) -> str:
        return self.root.url(self.rel)

    @property
    def path(self) -> Path | None:
        return None

    def prepare(self, claim: Claim) -> str:
        if claim.previous_status in HAS_PAYLOAD and claim.previous_path not in (None, self.rel):
            self._old = claim.previous_path
        return self.rel

    def check(self, dest: str, written: Written) -> list[FileProblem]:
        return check_uploaded(self.root, dest, written)

    def install(self, dest: str) -> str | None:
        return self._old  # retired once the commit has happened

    def discard(self, dest: str) -> None:
        self._delete(dest, "a failed attempt's")

    def old_intact(self) -> bool:
        return True  # an upload never touches the old prefix

    def undo(self, dest: object, retired: str | None) -> bool:
        self._delete(self.rel, "an uncommitted attempt's")
        return retired is not None

    def settle(self, retired: str) -> None:
        self._delete(retired, "the overwritten payload's")

    def failure(self, exc: OSError) -> RegistryError:
        return PublishError(f"could not publish {self.where}: {exc.strerror or exc}", errno=exc.errno)

    def _delete(self, rel: str, what: str) -> None:
        try:
            remove_prefix(self.root, rel)
        except (StorageError, OSError) as exc:  # never masks the outcome: fsck finds the orphan prefix
            log.warning("could not delete %s objects under %s: %s; 'registry fsck --repair' removes them",
                        what, self.root.url(rel), exc)
