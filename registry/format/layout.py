"""The names the registry gives directories under a checkpoint root, and the scan of a run directory.

A step's payload lives in ``RUN/step-00001000`` (:func:`step_dirname`). While
it is written it is a hidden staging sibling ``.step-00001000.tmp-XXXX``; a
payload being replaced or deleted is first renamed to a hidden retired
sibling ``.step-00001000.retired-XXXX``, so it vanishes from its final path at
once. Publish, gc and fsck build and read these names only through this
module. Knows nothing of SQL or torch.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REGISTRY_DIR = ".registry"  # the registry's own files under a root; no run name can start with "."
ROOT_MARKER = "root.json"  # in REGISTRY_DIR: {"catalog_id": ...}, the catalog this root is bound to
# The default SQLite catalog's file name, in REGISTRY_DIR. Roots made before the catalog moved there keep it
# (and SQLite's ``-wal``/``-shm``/``-journal`` siblings) at the top, beside the runs.
CATALOG_FILE = "catalog.db"

HiddenKind = Literal["tmp", "retired"]
StepDirKind = Literal["final", "tmp", "retired"]

_STEP_RE = re.compile(r"step-([0-9]{1,64})")
_HIDDEN_RE = re.compile(r"\.(.+?)\.(tmp|retired)-(.+)", re.DOTALL)


def step_dirname(step: int) -> str:
    """``step-00001000``: zero-padded so a plain ``ls`` sorts by step."""
    return f"step-{step:08d}"


def hidden_sibling(final: Path, kind: HiddenKind) -> Path:
    """An unused name for a hidden ``.NAME.KIND-XXXX`` sibling of ``final`` (``tmp`` or ``retired``), not created."""
    return final.parent / f".{final.name}.{kind}-{secrets.token_hex(6)}"


def parse_hidden(name: str) -> tuple[str, HiddenKind] | None:
    """``(NAME, kind)`` for a hidden ``.NAME.tmp-XXXX`` or ``.NAME.retired-XXXX`` name; None for any other."""
    m = _HIDDEN_RE.fullmatch(name)
    if m is None:
        return None
    kind: HiddenKind = "tmp" if m.group(2) == "tmp" else "retired"
    return m.group(1), kind


def parse_step_dirname(name: str) -> tuple[int, StepDirKind] | None:
    """The step of a directory name the registry writes, and which kind it is; None for any other name.

    ``step-00001000`` is a step's final directory (exactly what :func:`step_dirname`
    gives); ``.step-00001000.tmp-XXXX`` a publish's staging directory and
    ``.step-00001000.retired-XXXX`` a payload being replaced or deleted. The step
    may exceed the catalog's largest step (a directory nobody published): callers check.
    """
    hidden = parse_hidden(name)
    final = hidden[0] if hidden is not None else name
    m = _STEP_RE.fullmatch(final)
    if m is None:
        return None
    step = int(m.group(1))
    if step_dirname(step) != final:
        return None
    kind: StepDirKind = hidden[1] if hidden is not None else "final"
    return step, kind


def hidden_siblings(final: Path, kind: HiddenKind) -> list[Path]:
    """The existing hidden ``kind`` siblings of ``final``; none when its parent cannot be listed."""
    try:
        names = os.listdir(final.parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [final.parent / n for n in sorted(names) if parse_hidden(n) == (final.name, kind)]


@dataclass(frozen=True, kw_only=True)
class StepDir:
    """One directory of a run directory that the registry named: a step's final, staging or retired directory."""

    step: int
    kind: StepDirKind
    path: Path


def scan_run(run_dir: Path) -> list[StepDir]:
    """The step directories in ``run_dir``, by name, without following symlinks or reading any file.

    Anything else (files, symlinks, names the registry does not write) is
    left out. Raises ``OSError`` when ``run_dir`` cannot be listed.
    """
    with os.scandir(run_dir) as listing:
        entries = sorted(listing, key=lambda e: e.name)
    found = []
    for entry in entries:
        parsed = parse_step_dirname(entry.name)
        if parsed is not None and entry.is_dir(follow_symlinks=False):
            found.append(StepDir(step=parsed[0], kind=parsed[1], path=Path(entry.path)))
    return found


# --------------------------------------------------------------------------- object-store roots
#
# No rename on object storage: each publish attempt uploads to a prefix of its own,
# ``RUN/step-00001000/a-<16 hex>/``, which its claim names; the catalog row decides which is the step.

_ATTEMPT_RE = re.compile(r"a-[0-9a-f]{16}")


PARTS_DIR = f"{REGISTRY_DIR}/parts"  # under a fast root: a host's parts of steps published from several hosts


def part_relpath(run: str, step: int) -> str:
    """A fresh part directory ``.registry/parts/RUN/step-00001000/a-<16 hex>`` under a fast root, the same path on
    every host of one publish from several hosts."""
    return f"{PARTS_DIR}/{attempt_relpath(run, step)}"


def in_part(path: Path) -> bool:
    """Whether ``path`` lies in a host's part (under ``<fast>/.registry/parts/``)."""
    return f"/{PARTS_DIR}/" in path.as_posix()


def attempt_relpath(run: str, step: int) -> str:
    """A fresh attempt prefix ``RUN/step-00001000/a-<16 hex>`` (relative to the root, no slash at either end)."""
    return f"{run}/{step_dirname(step)}/a-{secrets.token_hex(8)}"


@dataclass(frozen=True, kw_only=True)
class AttemptKey:
    """A key under an attempt prefix, split: which run and step, the prefix, and the file name under it."""

    run: str
    step: int
    prefix: str   # RUN/step-00001000/a-<hex>, as the catalog row's path records it
    name: str     # the rest of the key (a file name; "" for the prefix itself)


def parse_attempt_key(rel: str) -> AttemptKey | None:
    """``rel`` (a key relative to the root) as an :class:`AttemptKey`; None for a key publish never writes.

    The run name is checked by the caller (``format.refs``); this only checks the shape.
    """
    parts = rel.split("/", 3)
    if len(parts) < 3 or not parts[0] or parts[0].startswith("."):
        return None
    step = parse_step_dirname(parts[1])
    if step is None or step[1] != "final" or not _ATTEMPT_RE.fullmatch(parts[2]):
        return None
    return AttemptKey(run=parts[0], step=step[0], prefix="/".join(parts[:3]), name=parts[3] if len(parts) > 3 else "")


__all__ = ["PARTS_DIR", "AttemptKey", "HiddenKind", "StepDir", "StepDirKind", "attempt_relpath", "hidden_sibling",
           "hidden_siblings", "in_part", "parse_attempt_key", "parse_hidden", "parse_step_dirname", "scan_run",
           "step_dirname"]
