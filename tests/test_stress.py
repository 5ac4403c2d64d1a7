"""Several real processes overlap every operation on one catalog; nothing may be lost, condemned or refused.

Size: ``REGISTRY_STRESS_SECONDS`` per backend and root (default 3); ``scripts/stresstest``
runs long ones with the same harness.
"""

from __future__ import annotations

import os

import pytest

from tests.stressharness import MIX, OBJECT_MIX, stress

SECONDS = float(os.environ.get("REGISTRY_STRESS_SECONDS", "3"))


def test_overlapping_actors_lose_and_condemn_nothing(catalog_url: str, any_root: str,
                                                     request: pytest.FixtureRequest) -> None:
    on_s3 = any_root.startswith("s3://")
    env = dict(request.getfixturevalue("s3_server").env) if on_s3 else None
    tally = stress(catalog_url, any_root, seconds=SECONDS, workers=4, seed=7, mix=OBJECT_MIX if on_s3 else MIX,
                   env=env)
    assert not tally.violations, "\n".join(tally.violations[:20])
    assert tally.condemned == 0 and tally.lost == 0
    # the run must have exercised what it claims to: every operation ran, and operations overlapped
    assert set(tally.operations) >= {"publish", "overwrite", "gc", "fsck", "verify", "load", "tag"}
    assert tally.overlaps > 0
