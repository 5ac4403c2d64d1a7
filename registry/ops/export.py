"""A step as a plain directory: a checkout (links to the verified files) or an export (a standalone copy).

Tools that want a path (``from_pretrained``, inference servers, evaluation
harnesses, the Hugging Face ``Trainer``'s resume) get one of two things:

- :func:`checkout`: a directory of links to a step's files, with the
  step's own names (``config.json``, ``model.safetensors`` or the shards
  and ``model.safetensors.index.json``, the ``NAME.pt`` extras). The files
  are hard links where the filesystem allows it (the checkout then survives
  the step's deletion, at the cost of its bytes until the checkout is
  removed) and absolute symlinks otherwise. The step is resolved and read
  through :class:`~registry.ops.reading.CatalogRead`, so a corrupt
  ``@latest`` falls back to an older step with a warning, and the linked
  files are checked against the manifest the catalog recorded before the
  directory is handed out. A reader lease is held on the step until
  :meth:`Checkout.close` (or the end of a ``with`` block); a process that
  dies leaves a lease that simply expires after its ``ttl``, and expired
  leases protect nothing. A read-only catalog records no lease.
- :func:`export`: a standalone copy written through the same atomic writer
  as a publish (``model.safetensors``, or Hugging Face shards with an index
  when ``max_shard_size`` is given), loadable by ``safetensors``, by the
  reference module and by ``from_pretrained``, owing nothing to the root.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from registry.errors import (CheckpointDeletedError, CheckpointReadError, CorruptCheckpointError, InvalidStateError,
                             RegistryError, RootError)
from registry.format.manifest import MANIFEST, read_manifest
from registry.fs.filemaps import map_directory
from registry.fs.mapping import read_error
from registry.format.layout import REGISTRY_DIR
from registry.ops.reading import CatalogRead, ReadAccess, report

if TYPE_CHECKING:
    from registry.checkpoint import Checkpoint
    from registry.format.refs import Ref
    from registry.records import CheckpointInfo

CHECKOUTS = "checkouts"  # under <root>/.registry/: same filesystem as the steps, so hard links work
ExportFormat = Literal["safetensors", "hf"]
FORMATS: tuple[str, ...] = ("safetensors", "hf")
HF_DEFAULT_SHARD = 5 * 10**9  # what ``save_pretrained`` calls "5GB"


class Checkout(os.PathLike[str]):
    """A checked-out step: a directory of links, and the reader lease that protects the step.

    Usable wherever a path is (``os.fspath``, ``str``); a context manager
    that releases the lease, and removes the directory when the registry
    chose it (``dest=None``), on exit.
    """

    def __init__(self, *, access: ReadAccess, info: CheckpointInfo, path: Path, lease: int,
                 links: Literal["hard", "symbolic"], owned: bool) -> None:
        self._access = access
        self.info = info
        self.path = path
        self.links = links
        self.owned = owned
        self._lease: int | None = lease

    @property
    def step(self) -> int:
        return self.info.step

    @property
    def held(self) -> bool:
        """Whether this checkout still holds its lease (it may have expired in the catalog meanwhile)."""
        return self._lease is not None

    def renew(self, ttl: timedelta | None = None) -> None:
        """Take a fresh lease of ``ttl`` (default: the one this checkout was made with), then drop the old one.

        For checkouts that outlive their ttl (a long evaluation): call it
        before the lease expires; once expired, retention may have deleted
        the step already, which this reports as ``CheckpointDeletedError``.
        """
        if self._lease is None:
            raise InvalidStateError(f"checkout {self.path} was closed; check the step out again")
        catalog = self._access.catalog
        new = catalog.acquire_lease(self.info.run, self.info.step, holder=self._access.holder,
                                    ttl=ttl or self._access.lease_ttl)
        if new is None:
            raise CheckpointDeletedError(f"{self.info.run}@{self.info.step} was deleted; its lease had expired",
                                         run=self.info.run, step=self.info.step, path=self.info.path)
        old, self._lease = self._lease, new
        catalog.release_lease(old)

    def close(self) -> None:
        """Release the lease; remove the directory if the registry chose where it is."""
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self._access.catalog.release_lease(lease)
            finally:
                if self.owned:
                    shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Checkout:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __copy__(self) -> Checkout:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Checkout:
        return self  # a handle on one lease: a tool copying its arguments (``from_pretrained``) shares it

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"Checkout({self.info.run}@{self.info.step} at {str(self.path)!r}, {self.links} links)"


def _target(access: ReadAccess, info: CheckpointInfo, dest: Path | None) -> tuple[Path, bool]:
    """The empty directory a checkout fills, and whether it is this call's to remove on failure."""
    if dest is not None:
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise InvalidStateError(f"checkout destination {dest} exists and is not an empty directory")
        created = not dest.exists()
        dest.mkdir(parents=True, exist_ok=True)
        return dest, created
    home = access.root / REGISTRY_DIR / CHECKOUTS
    prefix = f"{info.run}-step-{info.step:08d}-"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=home)), True
    except OSError:  # a root this process may not write (a read-only reader): symlinks from the temp dir
        return Path(tempfile.mkdtemp(prefix=f"registry-checkout-{prefix}")), True


def _link_all(source: Path, names: list[str], target: Path) -> Literal["hard", "symbolic"]:
    """Link every file; hard links unless the filesystem refuses one, then symlinks for all."""
    kind: Literal["hard", "symbolic"] = "hard"
    for name in names:
        src, dst = source / name, target / name
        if kind == "hard":
            try:
                os.link(src, dst, follow_symlinks=False)
                _drop_write_bits(dst)
                continue
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.ENOTSUP):
                    raise
                kind = "symbolic"
                for done in names[:names.index(name)]:  # one kind per checkout, so it is easy to reason about
                    (target / done).unlink()
                    os.symlink(source / done, target / done)
        os.symlink(src, dst)
    return kind


def _drop_write_bits(path: Path) -> None:
    """Make the shared inode read-only, so a tool writing into the checkout fails instead of editing the step.

    Root ignores the bits; the checksums still catch such an edit at the next verified load.
    """
    try:
        mode = path.stat().st_mode
        if mode & 0o222:
            os.chmod(path, mode & ~0o222)
    except OSError:
        pass  # not ours to change: leave it


def checkout(access: ReadAccess, ref: Ref, dest: Path | None = None, *, ttl: timedelta | None = None,
             verify: bool = True, fallback: bool = True) -> Checkout:
    """Resolve ``ref``, lease the step, link its files into a directory, check them; see the module doc.

    ``verify`` checks every linked file against the manifest's digests
    (the fast ones a load uses) after linking, so what is handed out is what
    was checked; a mismatch marks the step corrupt and, for ``@latest``,
    falls back to the next older step with a ``RuntimeWarning``.
    """
    access = replace(access, lease_ttl=ttl) if ttl is not None else access
    read = CatalogRead(access, ref, fallback=fallback)
    try:
        while True:
            info = read.candidate()
            target: Path | None = None
            made = False
            try:
                manifest_files = _listed(info.path)
                target, made = _target(access, info, dest)
                try:
                    links = _link_all(info.path, manifest_files, target)
                except FileNotFoundError as exc:
                    if not info.path.is_dir():  # the directory went (an unmounted root): this reader's trouble
                        raise read_error(info.path, exc) from exc
                    # a file the manifest lists is gone from a directory still there: the step is damaged
                    raise CorruptCheckpointError(f"checkpoint file is missing: {exc.filename}",
                                                 path=info.path) from exc
                except OSError as exc:
                    raise read_error(info.path, exc) from exc
                map_directory(info.path, extras=True, verify=verify, expected_digest=info.manifest_sha256)
            except RegistryError as exc:
                if target is not None:
                    _undo(target, made)
                read.judge(exc)
                for note in read.notes:
                    warnings.warn(note, RuntimeWarning, stacklevel=3)
                read.notes.clear()
                continue
            except BaseException:
                if target is not None:
                    _undo(target, made)
                raise
            report(read.record(info))
            lease, read.lease = read.lease, None  # the checkout keeps it
            assert lease is not None
            return Checkout(access=access, info=info, path=target, lease=lease, links=links, owned=dest is None)
    finally:
        read.release()


def _listed(directory: Path) -> list[str]:
    """The files a checkout links: the manifest and what it lists (whatever a load would read).

    A directory that is not there is this reader's trouble (an unmounted
    root), never evidence against the step.
    """
    if not directory.is_dir():
        raise CheckpointReadError(f"checkpoint directory is missing: {directory}", errno=errno.ENOENT,
                                  path=directory)
    try:
        manifest, _ = read_manifest(directory)
    except FileNotFoundError as exc:
        raise read_error(directory, exc) from exc
    return [MANIFEST, *sorted(manifest.files)]


def _undo(target: Path, made: bool) -> None:
    if made:
        shutil.rmtree(target, ignore_errors=True)
    else:  # the caller's directory was empty: empty it again
        for child in target.iterdir():
            child.unlink()


@dataclass(frozen=True, kw_only=True)
class Exported:
    """Where an export went and what it holds."""

    run: str | None
    step: int | None
    path: Path
    format: str
    files: tuple[str, ...]


def check_format(fmt: object, max_shard_size: object) -> int | None:
    """The shard size an export of ``fmt`` writes with (None: one ``model.safetensors``)."""
    if fmt not in FORMATS:
        raise InvalidStateError(f"export format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if max_shard_size is not None and (isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int)
                                       or max_shard_size <= 0):
        raise InvalidStateError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    if fmt == "safetensors":
        if max_shard_size is not None:
            raise InvalidStateError("max_shard_size needs format='hf'; format='safetensors' writes one file")
        return None
    return max_shard_size if max_shard_size is not None else HF_DEFAULT_SHARD


def check_dest(dest: Path, *, overwrite: bool) -> None:
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not overwrite)):
        raise InvalidStateError(f"export destination {dest} exists and is not empty; pass overwrite=True "
                                "to replace it")


def export(ckpt: Checkpoint, dest: Path, *, format: ExportFormat = "safetensors",  # noqa: A002 - the CLI's name
           max_shard_size: int | None = None, overwrite: bool = False) -> Exported:
    """Write ``ckpt``'s weights and config as a standalone directory (atomically, replacing ``dest``).

    ``format="safetensors"``: one ``model.safetensors``; ``format="hf"``:
    Hugging Face shards of at most ``max_shard_size`` bytes (default 5 GB)
    and ``model.safetensors.index.json``, or one ``model.safetensors`` when
    the weights fit one shard, as ``save_pretrained`` writes them. Either way with ``config.json``,
    ``meta.json`` (epoch, step, source) and a ``manifest.json``, so the
    registry can import it back. Extras (optimizer state) are left out.
    """
    from registry.checkpoint import Checkpoint
    shard = check_format(format, max_shard_size)
    check_dest(dest, overwrite=overwrite)
    if dest.exists() and not dest.is_dir():
        raise RootError(f"export destination {dest} is not a directory", path=dest)
    meta = {k: v for k, v in ckpt.meta.items() if k in ("optimizer_step", "policy_version")}
    if ckpt.info is not None:
        meta["exported_from"] = f"{ckpt.info.run}@{ckpt.info.step}"
    out = Checkpoint(state_dict=ckpt.state_dict, epoch=ckpt.epoch, consumed_samples=ckpt.consumed_samples,
                     meta=meta, config=ckpt.config, policy_version=ckpt.policy_version)
    if shard is not None and sum(t.numel() * t.element_size() for t in ckpt.state_dict.values()) <= shard:
        shard = None  # as ``save_pretrained`` does: weights that fit one shard are one ``model.safetensors``
    out.save(dest, max_shard_size=shard)
    files = tuple(sorted(p.name for p in dest.iterdir()))
    return Exported(run=ckpt.info.run if ckpt.info else None, step=ckpt.step, path=dest, format=format,
                    files=files)


__all__ = ["CHECKOUTS", "Checkout", "Exported", "FORMATS", "check_format", "checkout", "export"]
