"""The code and environment an attempt runs in, captured once per process and working directory.

What an attempt records (``Registry.attempts``): the git commit, branch and
whether tracked files differ from it, where the working directory is in a
repository (``git`` is None outside one, or where ``git`` is missing or does
not answer within :data:`GIT_TIMEOUT`: never an error); the host; the
Python, torch and registry versions; the command line (credentials in URLs
hidden); the working directory; and a sha256 over the sorted
``name==version`` of every installed distribution, so two attempts ran with
the same packages exactly when their digests agree.

Never imports torch: its version comes from the installed distribution, or
from the module where the process imported it already.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
from typing import Any

GIT_TIMEOUT = 5.0  # seconds; a repository on a hung network filesystem must not hold up training

_DIST_INFO = re.compile(r"(?P<name>.+?)-(?P<version>[^-]+)\.dist-info")
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def environment() -> dict[str, Any]:
    """This process's code and environment, as an attempt records it (computed once per working directory)."""
    try:
        cwd = os.getcwd()
    except OSError:  # the directory was removed under the process
        cwd = ""
    return dict(_captured(cwd, tuple(sys.argv)))


@functools.lru_cache(maxsize=8)
def _captured(cwd: str, argv: tuple[str, ...]) -> dict[str, Any]:
    names = packages()
    return {
        "git": git_state(cwd) if cwd else None,
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "registry": _version("checkpoint-registry"),
        "argv": [hide_credentials(arg) for arg in argv],
        "cwd": cwd,
        "packages": len(names),
        "packages_sha256": hashlib.sha256("\n".join(names).encode()).hexdigest(),
    }


def git_state(directory: str) -> dict[str, Any] | None:
    """``{"commit", "branch", "dirty"}`` of the repository ``directory`` is in; None outside one, without git,
    or when git does not answer in time. ``dirty``: a tracked file differs from the commit (untracked files
    do not count). Takes no lock on the repository."""
    try:
        done = subprocess.run(["git", "status", "--porcelain=v2", "--branch", "--untracked-files=no"],
                              cwd=directory, capture_output=True, text=True, timeout=GIT_TIMEOUT, check=False,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if done.returncode != 0:
        return None
    commit = branch = None
    dirty = False
    for line in done.stdout.splitlines():
        if line.startswith("# branch.oid "):
            oid = line.split(" ", 2)[2]
            commit = oid if re.fullmatch(r"[0-9a-f]{40,64}", oid) else None
        elif line.startswith("# branch.head "):
            head = line.split(" ", 2)[2]
            branch = None if head == "(detached)" else head
        elif line and not line.startswith("#"):
            dirty = True
    return {"commit": commit, "branch": branch, "dirty": dirty}


def packages() -> list[str]:
    """``name==version`` of every installed distribution, names normalised (PEP 503), sorted, each once.

    Read from the ``*.dist-info`` directory names where they say it (a few milliseconds for hundreds of
    packages), from the metadata otherwise.
    """
    found: set[str] = set()
    for dist in importlib.metadata.distributions():
        path = getattr(dist, "_path", None)
        match = _DIST_INFO.fullmatch(path.name) if path is not None else None
        if match is not None:
            name, version = match["name"], match["version"]
        else:
            try:
                name, version = dist.metadata["Name"], dist.version
            except Exception:  # noqa: BLE001 - a broken distribution's metadata is no reason to fail an attempt
                continue
            if not name:
                continue
        found.add(f"{re.sub(r'[-_.]+', '-', name).lower()}=={version}")
    return sorted(found)


def hide_credentials(arg: str) -> str:
    """``arg`` with the credentials of any URL in it (``scheme://user:pass@``) shown as ``***@``."""
    return _URL_CREDENTIALS.sub(lambda m: m["scheme"] + "***@", arg)


def _version(distribution: str) -> str | None:
    if distribution == "torch" and "torch" in sys.modules:
        version = getattr(sys.modules["torch"], "__version__", None)
        if isinstance(version, str):
            return version
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


__all__ = ["GIT_TIMEOUT", "environment", "git_state", "hide_credentials", "packages"]
