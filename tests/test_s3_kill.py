"""SIGKILL real workers on an ``s3://`` root (SeaweedFS) at every crash point of publish, overwrite and gc,
in the middle of a multipart upload, and at random moments; then fsck: nothing lost, nothing half-visible,
no orphan prefix and no incomplete upload left.

The harness is the filesystem root's (:mod:`tests.killharness`): the same
checks before repair (every live row whole in the bucket, ``@latest`` loads
bit-exact), the same invariants after ``fsck --repair``. On an object store
there is no rename, so the crash points are those of the claim, the upload
and the commit; a dead writer whose payload is all uploaded (``after-write``)
is rolled forward by fsck. Size: ``REGISTRY_S3_KILLS`` random kills (default 6);
``python -m tests.killharness --s3`` (``scripts/killtest --s3``) runs long ones.
"""

from __future__ import annotations

import os

import pytest

from tests import killharness, s3server
from tests.killharness import GC_POINTS, OBJECT_CRASH_TABLE, object_crashpoint_kills, random_kills

KILLS = int(os.environ.get("REGISTRY_S3_KILLS", "6"))


@pytest.fixture
def harness(s3_env: s3server.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(killharness, "WORKER_ENV", dict(s3_env.env))


def test_every_crash_point_and_mid_upload(catalog_url: str, s3_root: str, harness: None) -> None:
    points, mid = object_crashpoint_kills(catalog_url, s3_root, seed=7)
    assert points.kills == len(OBJECT_CRASH_TABLE) + len(GC_POINTS) and points.not_reached == 0
    assert points.checked_before_repair == points.kills and points.loaded_before_repair > 0
    assert {"uncommitted-publish", "abandoned-publish", "interrupted-overwrite", "unfinished-deletion",
            "orphan-prefix"} <= set(points.repairs), points.repairs
    assert mid.kills == 1 and {"abandoned-publish", "incomplete-upload"} <= set(mid.repairs), mid.repairs


def test_random_kills(catalog_url: str, s3_root: str, harness: None) -> None:
    tally = random_kills(catalog_url, s3_root, kills=KILLS, seed=KILLS,
                         mix=("publish", "publish", "overwrite", "gc", "fsck"), max_delay=0.3)
    assert tally.kills >= KILLS and tally.checked_before_repair == tally.kills + tally.not_reached
