"""Several real processes overlap every operation on one catalog; nothing may be lost, condemned or refused.

Size: ``REGISTRY_STRESS_SECONDS`` per backend (default 6); ``scripts/stresstest``
runs long ones with the same harness.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.stressharness import StressTally, stress

SECONDS = float(os.environ.get("REGISTRY_STRESS_SECONDS", "6"))


def test_overlapping_actors_lose_and_condemn_nothing(catalog_url: str, root: Path) -> None:
    check(stress(catalog_url, root, seconds=SECONDS, workers=4, seed=7))


def test_overlapping_actors_on_an_s3_root(catalog_url: str, s3_root: str) -> None:
    """The same actors on an ``s3://`` root (no dedup there); afterwards fsck finds no orphan prefix or upload."""
    check(stress(catalog_url, s3_root, seconds=SECONDS, workers=4, seed=11))


def check(tally: StressTally) -> None:
    assert not tally.violations, "\n".join(tally.violations[:20])
    assert tally.condemned == 0 and tally.lost == 0
    # the run must have exercised what it claims to: every operation ran, and operations overlapped
    assert set(tally.operations) >= {"publish", "overwrite", "gc", "fsck", "verify", "load", "tag"}
    assert tally.overlaps > 0
