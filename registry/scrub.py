"""``registry verify``: re-hash checkpoints from storage and record the verdict.

Publish-time ``verified`` trusts the hashes computed while writing (see
``store.check_written``); a scrub is the full re-read that catches what
storage did afterwards: bit rot, truncation, a file replaced behind our back,
or a manifest that no longer matches the catalog's record of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from registry.catalog import Catalog
from registry.errors import CorruptCheckpointError
from registry.manifest import read_manifest
from registry.records import CheckpointInfo
from registry.store import verify_directory


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    run: str
    step: int
    ok: bool
    status: str
    problems: tuple[str, ...] = ()


def _problems(catalog: Catalog, info: CheckpointInfo) -> tuple[str, ...]:
    if not info.path.is_dir():
        return ("directory missing",)
    try:
        manifest, digest = read_manifest(info.path)
    except CorruptCheckpointError as exc:
        return (f"manifest.json: {exc}",)
    damaged = verify_directory(info.path, manifest)
    if damaged:
        return tuple(f"{p.name}: {p.problem}" for p in damaged)
    files = {f.name: (f.size, f.sha256) for f in catalog.files(info.run, info.step)}
    if (info.manifest_sha256 and digest != info.manifest_sha256) or (
            files and files != {n: (e.size, e.sha256) for n, e in manifest.files.items()}):
        return ("manifest does not match the catalog",)
    return ()


def scrub(catalog: Catalog, infos: Sequence[CheckpointInfo], *, actor: str) -> list[VerifyResult]:
    """Re-hash each checkpoint (a few in parallel); intact ones become ``verified``, damaged ``corrupt``.

    A corrupt step that hashes clean again (restored from a backup) is verified again.
    """
    def check(info: CheckpointInfo) -> VerifyResult:
        problems = _problems(catalog, info)
        ok = not problems
        status = "verified" if ok else "corrupt"
        catalog.set_status(info.run, info.step, status, kind="verify" if ok else "corrupt", actor=actor,
                           only_from=("published", "verified", "corrupt"), problems=list(problems))
        return VerifyResult(run=info.run, step=info.step, ok=ok, status=status, problems=problems)

    with ThreadPoolExecutor(max_workers=min(4, max(1, len(infos)))) as pool:
        return list(pool.map(check, infos))
