"""Tests written to kill the mutants that survived the matching test files (scripts/mutants).

Each test names the behaviour a surviving mutant broke; the mutant itself is listed in RELIABILITY.md.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import subprocess
import sys

import pytest

from registry import Registry
from registry.errors import InvalidNameError, InvalidRefError
from registry.format.layout import hidden_sibling
from registry.format.refs import MAX_STEP, Ref, check_run_name, check_step, parse_ref
from registry.fs.store import writer_alive
from tests.helpers import make_state


# --- registry/format/refs.py ---------------------------------------------------------------------------------

def test_steps_stop_at_the_largest_64_bit_integer() -> None:
    assert MAX_STEP == 2**63 - 1
    assert check_step(2**63 - 1) == 2**63 - 1
    with pytest.raises(InvalidNameError, match="64-bit"):
        check_step(2**63)
    assert parse_ref(f"run@{2**63 - 1}").step == 2**63 - 1
    with pytest.raises(InvalidRefError, match="does not fit in 64 bits"):
        parse_ref(f"run@{2**63}")


@pytest.mark.parametrize("name", ["catalog.db", "CATALOG.DB", "catalog.db-wal", "Catalog.db-journal"])
def test_the_catalogs_file_names_are_refused_as_run_names_with_one_line(name: str) -> None:
    with pytest.raises(InvalidNameError) as info:
        check_run_name(name)
    message = str(info.value)
    assert "\n" not in message
    assert "'catalog.db-*'" in message and "reserved for the catalog" in message


def test_a_ref_is_frozen_and_keyword_only() -> None:
    ref = parse_ref("run@7")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.step = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        Ref("run", "latest")  # type: ignore[misc]


# --- registry/fs/store.py ------------------------------------------------------------------------------------

def test_a_zombie_writer_is_not_alive() -> None:
    """A writer that exited but was not reaped holds its pid and its /proc entry, yet writes nothing."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # wait for the exit but leave the child unreaped: a zombie, state "Z" in /proc/PID/stat
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        assert writer_alive(f"{socket.gethostname()[:128]}:{proc.pid}") is False
    finally:
        proc.wait()
    assert writer_alive(f"{socket.gethostname()[:128]}:{os.getpid()}") is True


def test_a_stale_staging_directory_that_cannot_be_removed_does_not_stop_a_publish(
        reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Removing a dead writer's staging leftovers is best effort: fsck removes what the next publish could not."""
    final = reg.store.step_dir("run", 1)
    final.parent.mkdir(parents=True)
    stale = hidden_sibling(final, "tmp")
    stale.mkdir()
    real_rmdir = os.rmdir

    def rmdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if os.fspath(path) == os.fspath(stale):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        real_rmdir(path, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "rmdir", rmdir)
    assert reg.publish("run", 1, make_state(1)).status == "verified"
    assert stale.is_dir()
