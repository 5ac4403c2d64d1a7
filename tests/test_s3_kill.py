"""SIGKILL real workers on an ``s3://`` root (SeaweedFS) at every crash point of publish, overwrite and gc,
in the middle of a multipart upload, and at random moments; then fsck: nothing lost, nothing half-visible,
no orphan prefix and no incomplete upload left.

The harness is the filesystem root's (:mod:`tests.killharness`): the same
checks before repair (every live row whole in the bucket, ``@latest`` loads
bit-exact), the same invariants after ``fsck --repair``. On an object store
there is no rename, so the crash points are those of the claim, the upload
and the commit; a dead writer whose payload is all uploaded (``after-write``)
is rolled forward by fsck. Size: ``REGISTRY_S3_KILLS`` random kills (default 6).
"""

from __future__ import annotations

import os
import random

import pytest

from registry import Registry
from tests import killharness, s3server
from tests.killharness import DEFAULT_MIX, RUNS, Tally, _live_steps, crashpoint_kill, kill_once, op_publish

KILLS = int(os.environ.get("REGISTRY_S3_KILLS", "6"))

# (operation, crash point) -> what the step holds after fsck: a publish killed once its manifest was
# uploaded is rolled forward, as one killed after the rename is on a filesystem
S3_CRASH_TABLE: dict[tuple[str, str], str] = {
    ("publish", "after-claim"): "absent", ("publish", "after-write"): "new", ("publish", "after-commit"): "new",
    ("overwrite", "after-claim"): "old", ("overwrite", "after-write"): "new", ("overwrite", "after-commit"): "new",
}
GC_POINTS = ("gc-after-mark", "gc-after-retire")


@pytest.fixture
def harness(s3_env: s3server.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(killharness, "WORKER_ENV", dict(s3_env.env))
    monkeypatch.setattr(killharness, "CRASH_TABLE", S3_CRASH_TABLE)


def fill(reg: Registry, rng: random.Random, n: int, run: str = RUNS[0]) -> None:
    while len(_live_steps(reg, run)) < n:
        op_publish(reg, rng, run)


def test_every_crash_point(catalog_url: str, s3_root: str, harness: None) -> None:
    rng = random.Random(7)
    tally = Tally()
    with Registry.open(url=catalog_url, root=s3_root) as reg:
        for op, point in S3_CRASH_TABLE:
            crashpoint_kill(reg, catalog_url, op, point, rng=rng, tally=tally)
        for point in GC_POINTS:
            run = f"gc-{point}"
            fill(reg, rng, 6, run)  # steps 10..60: KeepLast(1-3) | KeepEvery(40) deletes 10, 20 and 30 at least
            code = kill_once(reg, catalog_url, rng=rng, mix=DEFAULT_MIX, max_delay=0, tally=tally,
                             crash_at=point, once="gc", runs=(run,))
            assert code == -9, f"gc never reached {point}"
    assert tally.kills == len(S3_CRASH_TABLE) + len(GC_POINTS) and tally.not_reached == 0
    assert tally.checked_before_repair == tally.kills and tally.loaded_before_repair > 0
    assert {"uncommitted-publish", "abandoned-publish", "interrupted-overwrite", "unfinished-deletion",
            "orphan-prefix"} <= set(tally.repairs), tally.repairs


def test_killed_mid_multipart_upload(catalog_url: str, s3_root: str, harness: None) -> None:
    rng = random.Random(11)
    tally = Tally()
    with Registry.open(url=catalog_url, root=s3_root) as reg:
        fill(reg, rng, 2)
        # the op kills itself mid-upload; a crash point it never reaches keeps kill_once from killing it first
        code = kill_once(reg, catalog_url, rng=rng, mix=DEFAULT_MIX, max_delay=0, tally=tally,
                         crash_at="after-commit", once="publish-killed-mid-upload")
        assert code == -9
    assert {"abandoned-publish", "incomplete-upload"} <= set(tally.repairs), tally.repairs


def test_random_kills(catalog_url: str, s3_root: str, harness: None) -> None:
    rng = random.Random(KILLS)
    tally = Tally()
    with Registry.open(url=catalog_url, root=s3_root) as reg:
        fill(reg, rng, 2)
        while tally.kills < KILLS:
            kill_once(reg, catalog_url, rng=rng, mix=("publish", "publish", "overwrite", "gc", "fsck"),
                      max_delay=0.3, tally=tally)
    assert tally.kills == KILLS and tally.checked_before_repair == tally.kills + tally.not_reached
