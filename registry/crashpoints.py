"""Named points of the publish, retention and migration protocols where a test may kill us.

The kill-test harness starts a subprocess with ``REGISTRY_CRASH_AT=<name>``
and the process SIGKILLs itself on reaching that point, so every window of
the two-phase commit is exercised deterministically, not just by luck.
"""

from __future__ import annotations

import os
import signal

_TARGET = os.environ.get("REGISTRY_CRASH_AT") or None

POINTS = (
    "after-claim",           # catalog row is staging, nothing on disk
    "after-write",           # staging dir written and fsynced
    "dedup-after-link",      # dedup: a link to an identical live file made under a temporary name
    "dedup-after-fsync",     # dedup: staged copies replaced by links, staging dir fsynced
    "after-retire",          # old payload renamed to .retired-, new not yet in place
    "after-rename",          # new payload in place, catalog still says staging
    "after-commit",          # catalog says published/verified
    "unshare-after-copy",    # dedup: a step's own copy of a shared file written and checked, not yet renamed
    "gc-after-mark",         # retention: row marked, payload still in place
    "gc-after-retire",       # retention: payload renamed to .retired-
    "fsck-after-restore",    # fsck: retired payload renamed back, catalog row not yet repaired
    "sharded-rank-after-write",   # sharded publish, a rank other than 0: its DCP files written and fsync'd,
                                  # digests not yet sent
    "sharded-after-gather",  # sharded publish, rank 0: every rank's digests in hand, manifest not yet written
    "parts-after-install",   # sharded publish from several hosts, another host's first rank: its part renamed into
                             # place, rank 0 not yet told
    "sharded-upload-midway",  # sharded publish on s3://, any rank: a part of a data file uploaded, the multipart
                              # upload not completed
    "replicate-after-claim",   # tiers: the durable copy's attempt prefix claimed (pending), nothing uploaded
    "replicate-after-upload",  # tiers: every file of the durable copy uploaded, the manifest not yet
    "cache-after-download",    # tiers: a durable copy downloaded into this host's cache, not yet renamed into place
    "cache-evict-after-mark",  # tiers: a stale cached copy's row marked deleted, its directory still in place
    "migrate-before-commit",  # schema migration: every revision applied, its transaction not yet committed
    "outbox-after-commit",    # webhooks: a transaction that wrote outbox rows committed, no deliverer told yet
    "reanchor-after-store",   # policy: a delta step's version stored whole beside it, its anchor row not yet written
    "materialize-patch-midway",  # materialize: a patched copy of the held model.safetensors partly written under a
                                 # temporary name, not yet checked or renamed
)


def arm(name: str | None) -> None:
    """Die at ``name`` from now on (or never, with None); for demos and in-process harnesses."""
    global _TARGET
    _TARGET = name


def armed(name: str) -> bool:
    """Whether this process dies at ``name`` (a point that must first make its window real, e.g. wait for an upload)."""
    return _TARGET is not None and name == _TARGET


def crashpoint(name: str) -> None:
    if _TARGET is not None and name == _TARGET:
        os.kill(os.getpid(), signal.SIGKILL)
