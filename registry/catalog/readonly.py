"""A catalog opened read-only: for readers of a copy they may not write, or that must not write.

Every query works. A reader takes no lease, so retention does not know it is
reading and may delete the step under it (the load then fails, or a file is
gone mid-read); a verdict it reaches (a corrupt step) is reported to the
caller but not recorded. Any other write raises :class:`ReadOnlyError`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine

from registry.catalog.queries import Catalog
from registry.catalog.session import open_engine
from registry.format.refs import Ref
from registry.records import LIVE, CheckpointInfo

log = logging.getLogger(__name__)

NO_LEASE = -1  # stands for a lease a read-only reader did not take; real lease ids are positive


class ReadOnlyCatalog(Catalog):
    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        if self._read_engine is not engine:
            self._read_engine.dispose()  # its connections could write; the read-only engine serves reads
            self._read_engine = engine

    @classmethod
    def open(cls, url: str, *, migrate: bool = False) -> ReadOnlyCatalog:
        return cls(open_engine(url, migrate=False, create=False, read_only=True))

    def acquire_lease(self, run: str, step: int, *, holder: str, ttl: timedelta) -> int | None:
        info = self.get(run, step)
        return NO_LEASE if info is not None and info.status in LIVE else None

    def resolve_leased(self, ref: Ref, *, below: int | None = None, holder: str,
                       ttl: timedelta) -> tuple[CheckpointInfo, int | None]:
        info = self.resolve(ref, below=below)
        return info, NO_LEASE if info.status in LIVE else None

    def release_lease(self, lease_id: int) -> None:
        if lease_id != NO_LEASE:
            super().release_lease(lease_id)

    def set_status(self, run: str, step: int, status: str, *, kind: str, actor: str | None = None,
                   only_from: Sequence[str] | None = None, manifest_sha256: str | None = None,
                   **detail: Any) -> bool:
        log.warning("%s@%d would be marked %s, but the catalog is open read-only: not recorded",
                    run, step, status)
        return False
