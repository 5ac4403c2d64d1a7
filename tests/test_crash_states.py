"""Power-cut crash states of a publish, an overwrite, a gc deletion and an fsck repair: none loses a step.

Each operation runs once in a child process that records its file-system
operations and catalog commits (``tests/crashstates.py`` has the recorder and
the crash model). Every crash state the model allows is built in a temporary
directory with the catalog as it was at that moment, repaired with
``fsck --repair`` and checked: every live step loads verified and bit-exact
as the old or the new payload, no step live before the crash or committed at
the crash is lost, no hidden staging or retired directory is left, and a
second ``fsck --checksums`` is clean.

SQLite only: the crash state pairs the root with a byte copy of the catalog
taken at each commit (the ``sqlite3`` backup API); PostgreSQL's durability is
its server's, and a commit that returned is durable there by the same rule.
The CI run uses one safetensors file per payload; ``scripts/crashstates``
runs the same enumeration on sharded payloads with an extra.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.crashstates import RUN, SCENARIOS, Recording, explore, record

LIMIT = 4096  # crash states per crash point: far above what these small operations have, so all of them


class Recordings(dict[str, Recording]):
    """Each operation recorded once per module, when first asked for."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, name: str) -> Recording:
        self[name] = record(name, self.factory.mktemp(f"rec-{name}"))
        return self[name]


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Recordings:
    return Recordings(tmp_path_factory)


# what each recording must hold for its crash states to mean anything (a broken recorder records nothing)
EXPECTED_EVENTS = {
    "publish": ("link", "write", "fsync", "rename", "catalog"),
    "overwrite": ("link", "write", "fsync", "rename", "unlink", "catalog"),
    "gc": ("rename", "fsync", "unlink", "catalog"),
    "fsck": ("rename", "fsync", "unlink", "catalog"),
    "new-run": ("link", "write", "fsync", "rename", "catalog"),
    "overwrite-failed-commit": ("link", "write", "fsync", "rename", "unlink", "catalog"),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_crash_state_loses_a_step(name: str, tmp_path: Path, recordings: dict[str, Recording]) -> None:
    rec = recordings[name]
    kinds = {e[0] for e in rec.events}
    assert set(EXPECTED_EVENTS[name]) <= kinds, f"{name}: recorded only {sorted(kinds)}"
    outcome = explore(name, tmp_path, limit=LIMIT, rec=rec)
    assert outcome.crash_points == len(rec.events) + 1
    assert outcome.states >= outcome.crash_points // 2, outcome  # distinct states, not one state many times
    assert not outcome.failures, "\n".join(f"{state}: {problems}" for state, problems in outcome.failures)


def _run_dir_fsync(rec: Recording) -> tuple[int, int]:
    """(index of the run directory's fsync after the rename that installs step 2, the renamed staging inode)."""
    rename = next(i for i, e in enumerate(rec.events) if e[0] == "rename" and e[4] == "step-00000002")
    _, run_dir, staging_name = rec.events[rename][:3]
    fsync = next(i for i in range(rename, len(rec.events)) if rec.events[i] == ("fsync", run_dir))
    staging = next(e[3] for e in rec.events if e[0] == "link" and e[1:3] == (run_dir, staging_name))
    return fsync, staging


def test_a_publish_that_fsyncs_the_renamed_directory_instead_of_its_parent_loses_its_step(
        tmp_path: Path, recordings: dict[str, Recording]) -> None:
    """The checker is not vacuous: the publish as it would be recorded with that bug loses a committed step."""
    rec = recordings["publish"]
    fsync, renamed = _run_dir_fsync(rec)
    events = list(rec.events)
    events[fsync] = ("fsync", renamed)
    buggy = dataclasses.replace(rec, events=events)
    outcome = explore("publish", tmp_path, limit=LIMIT, rec=buggy, stride=len(events))
    lost = [problems for _, problems in outcome.failures if any("step 2 lost" in p for p in problems)]
    assert lost, f"no crash state of the buggy publish loses {RUN}@2: {outcome}"


def test_a_publish_that_never_fsyncs_its_files_loses_its_step(tmp_path: Path,
                                                               recordings: dict[str, Recording]) -> None:
    rec = recordings["publish"]
    files = {e[3] for e in rec.events if e[0] == "link" and rec.kinds[e[3]] == "f"}
    buggy = dataclasses.replace(rec, events=[e for e in rec.events if not (e[0] == "fsync" and e[1] in files)])
    outcome = explore("publish", tmp_path, limit=LIMIT, rec=buggy, stride=len(buggy.events))
    assert any(any("step 2" in p for p in problems) for _, problems in outcome.failures), outcome
