"""A step as a plain directory: a checkout (the verified files, the caller's own) or an export (a standalone copy).

Tools that want a path (``from_pretrained``, inference servers, evaluation
harnesses, the Hugging Face ``Trainer``'s resume) get one of two things:

- :func:`checkout`: a directory of a step's files, with the step's own
  names (``config.json``, ``model.safetensors`` or the shards and
  ``model.safetensors.index.json``, the ``NAME.pt`` extras). By default each
  file is a reflink where the filesystem clones, a copy otherwise, checked
  against the manifest's sha256 as it is copied, so nothing written into
  the checkout can reach a step; hard links or symlinks only on request
  (``link=``), with the risk that brings (see :mod:`registry.ops.checkouts`).
  The step is resolved and read through
  :class:`~registry.ops.reading.CatalogRead`, so a corrupt ``@latest`` falls
  back to an older step with a warning. A reader lease is held on the step
  until :meth:`Checkout.close` (or the end of a ``with`` block); a process
  that dies leaves a lease that simply expires after its ``ttl``, and
  expired leases protect nothing. A read-only catalog records no lease.
- :func:`export`: a standalone copy written through the same atomic writer
  as a publish (``model.safetensors``, or Hugging Face shards with an index
  when ``max_shard_size`` is given), loadable by ``safetensors``, by the
  reference module and by ``from_pretrained``, owing nothing to the root.

Neither writes inside the checkpoint root or over a directory that holds it
(:func:`registry.fs.bounds.check_outside_root`), except a checkout into the
registry-owned checkouts directory.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from registry.catalog.readonly import ReadOnlyCatalog
from registry.errors import (CheckpointDeletedError, CheckpointReadError, CorruptCheckpointError, InvalidStateError,
                             RegistryError, RootError)
from registry.format.manifest import DELTA, MANIFEST, read_manifest
from registry.fs.bounds import check_outside_root
from registry.fs.filemaps import map_directory
from registry.fs.mapping import read_error
from registry.fs.store import save_directory
from registry.fs.validation import check_lease_ttl, saved_payload
from registry.ops import checkouts
from registry.ops.checkouts import Kind, Link
from registry.ops.reading import CatalogRead, Read, ReadAccess, read_step, report

if TYPE_CHECKING:
    from registry.format.refs import Ref
    from registry.records import CheckpointInfo

ExportFormat = Literal["safetensors", "hf"]
FORMATS: tuple[str, ...] = ("safetensors", "hf")
HF_DEFAULT_SHARD = 5 * 10**9  # what ``save_pretrained`` calls "5GB"


class Checkout(os.PathLike[str]):
    """A checked-out step: a directory of its files, and the reader lease that protects the step.

    Usable wherever a path is (``os.fspath``, ``str``); a context manager
    that releases the lease, and removes the directory when the registry
    chose it (``dest=None``), on exit. ``kind`` says what the files are:
    ``"reflink"`` or ``"copy"`` (the caller's own), ``"hardlink"`` or
    ``"symlink"`` (the step's, on request). ``owned``: the directory is the
    registry's (removed on close, and by gc once the lease has expired).
    """

    def __init__(self, *, access: ReadAccess, info: CheckpointInfo, path: Path, lease: int, kind: Kind,
                 owned: bool, recorded: bool = False) -> None:
        self._access = access
        self.info = info
        self.path = path
        self.kind = kind
        self.owned = owned
        self._recorded = recorded  # has a record in the registry-owned checkouts directory
        self._lease: int | None = lease

    @property
    def step(self) -> int:
        return self.info.step

    @property
    def ttl(self) -> timedelta:
        """The lease time this checkout was asked for (what :meth:`renew` takes by default)."""
        return self._access.lease_ttl

    @property
    def held(self) -> bool:
        """Whether this checkout still holds its lease (it may have expired in the catalog meanwhile)."""
        return self._lease is not None

    def renew(self, ttl: timedelta | None = None) -> None:
        """Take a fresh lease of ``ttl`` (default: the one this checkout was made with), then drop the old one.

        For checkouts that outlive their ttl (a long evaluation): call it
        before the lease expires; once expired, retention may have deleted
        the step (and gc the registry-owned directory) already, which this
        reports as ``CheckpointDeletedError``.
        """
        if self._lease is None:
            raise InvalidStateError(f"checkout {self.path} was closed; check the step out again")
        if ttl is not None:
            check_lease_ttl(ttl)
        catalog = self._access.catalog
        new = catalog.acquire_lease(self.info.run, self.info.step, holder=self._access.holder,
                                    ttl=self._access.lease_ttl if ttl is None else ttl)
        if new is None:
            raise CheckpointDeletedError(f"{self.info.run}@{self.info.step} was deleted; its lease had expired",
                                         run=self.info.run, step=self.info.step, path=self.info.path)
        if self._recorded:
            checkouts.write_record(self.path, run=self.info.run, step=self.info.step, lease=new,
                                   holder=self._access.holder)
        old, self._lease = self._lease, new
        catalog.release_lease(old)

    def close(self) -> None:
        """Release the lease; remove the directory if the registry chose where it is."""
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self._access.catalog.release_lease(lease)
            finally:
                if self._recorded:
                    checkouts.remove_owned(self.path)
                elif self.owned:
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
        return f"Checkout({self.info.run}@{self.info.step} at {str(self.path)!r}, {self.kind})"


def check_checkout_dest(access: ReadAccess, dest: Path) -> None:
    """A caller's checkout directory: outside the root (or in the registry-owned checkouts), empty or absent."""
    if access.home.local_dir is not None:
        check_outside_root(dest, access.root, what="checkout destination", allowed=checkouts.home(access.root))
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InvalidStateError(f"checkout destination {dest} exists and is not an empty directory")


def _target(access: ReadAccess, info: CheckpointInfo, dest: Path | None, lease: int) -> tuple[Path, bool, bool]:
    """The empty directory a checkout fills: (path, whether this call made it, whether it has a record)."""
    if dest is not None:
        check_checkout_dest(access, dest)
        created = not dest.exists()
        dest.mkdir(parents=True, exist_ok=True)
        return dest, created, False
    if isinstance(access.catalog, ReadOnlyCatalog) or not access.home.can.directories:  # not into the root
        return checkouts.temp_dir(info.run, info.step), True, False
    try:
        return checkouts.new_owned(access.root, run=info.run, step=info.step, lease=lease,
                                   holder=access.holder), True, True
    except OSError:  # a root this process may not write: a temporary directory of this host's
        return checkouts.temp_dir(info.run, info.step), True, False


def checkout(access: ReadAccess, ref: Ref, dest: Path | None = None, *, ttl: timedelta | None = None,
             verify: bool = True, fallback: bool = True, link: Link | None = None) -> Checkout:
    """Resolve ``ref``, lease the step, copy (or on request link) its files into a directory, check them.

    ``verify`` checks every file against the manifest's sha256 as it is
    copied (linked files: against the manifest's digests after linking), so
    what is handed out is what was checked; a mismatch marks the step
    corrupt and, for ``@latest``, falls back to the next older step with a
    ``RuntimeWarning``. ``link="hardlink"`` or ``"symlink"`` links instead of
    copying: no bytes spent, but writes through the checkout change the
    registry's step (see :mod:`registry.ops.checkouts`).
    """
    link = checkouts.check_link(link)
    if link is not None and not access.home.can.directories:
        raise InvalidStateError(f"link={link!r} needs a filesystem root; an s3:// root's checkout downloads copies")
    if dest is not None:
        check_checkout_dest(access, dest)  # before anything is resolved or leased
    handed = replace(access, lease_ttl=ttl) if ttl is not None else access
    # Filled under a lease of at least the registry's own ttl: one shorter than the copy takes (a caller's
    # ttl=0) would let gc reclaim the directory while it is being filled. The caller's ttl starts at hand-out.
    access = replace(access, lease_ttl=max(ttl, access.lease_ttl)) if ttl is not None else access
    read = CatalogRead(access, ref, fallback=fallback)
    try:
        while True:
            info = read.candidate()
            assert read.lease is not None
            target: Path | None = None
            made = recorded = False
            try:
                if not access.home.can.directories:  # an s3:// root: download, each file checked as it lands
                    from registry.fs.objectread import download
                    objects = access.home.object_store()
                    assert objects is not None, "a root of no directories is an object store"
                    target, made, recorded = _target(access, info, dest, read.lease)
                    download(objects, info.path.as_posix(), target, expected_digest=info.manifest_sha256)
                    _as_full(access, info, target)
                    report(read.record(info))
                    lease, read.lease = read.lease, None
                    return _hand_out(Checkout(access=handed, info=info, path=target, lease=lease, kind="copy",
                                              owned=dest is None, recorded=recorded), access)
                target, made, recorded = _target(access, info, dest, read.lease)
                fill = functools.partial(_fill, target=target, info=info, link=link,
                                         drop_write_bits=not isinstance(access.catalog, ReadOnlyCatalog))
                kind = access.copies.nearest(info, fill, verify=verify)  # fast, cached, or downloaded now
                _as_full(access, info, target)
            except RegistryError as exc:
                if target is not None:
                    _undo(target, made, recorded)
                read.judge(exc)
                for note in read.notes:
                    warnings.warn(note, RuntimeWarning, stacklevel=3)
                read.notes.clear()
                continue
            except BaseException:
                if target is not None:
                    _undo(target, made, recorded)
                raise
            report(read.record(info))
            lease, read.lease = read.lease, None  # the checkout keeps it
            assert lease is not None
            return _hand_out(Checkout(access=handed, info=info, path=target, lease=lease, kind=kind,
                                      owned=dest is None, recorded=recorded), access)
    finally:
        read.release()


def _as_full(access: ReadAccess, info: CheckpointInfo, target: Path) -> None:
    """A checkout of a policy delta step holds the weights a full publish writes: ``model.safetensors`` (rebuilt
    through the reader, checked against the version's digest) in place of ``delta.safetensors``, and no manifest
    (which lists the delta): what the reference module and ``from_pretrained`` read."""
    if not (target / DELTA).exists():
        return
    from registry.ops.materialize import full_digest, write_full
    loaded = read_step(access, info, verify=True, map_location="cpu", trust_pickle=False, extras=False)
    write_full(target, loaded, expected=full_digest(access, info))
    for name in (DELTA, MANIFEST):
        (target / name).unlink()


def _hand_out(made: Checkout, filled_under: ReadAccess) -> Checkout:
    """``made`` with its lease set to the caller's ttl, when that is shorter than the one it was filled under."""
    if made.ttl < filled_under.lease_ttl:
        try:
            made.renew()
        except BaseException:
            made.close()
            raise
    return made


def _listed(directory: Path) -> list[str]:
    """The files a checkout holds: the manifest and what it lists (whatever a load would read).

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


def _fill(source: Path, verify: bool, *, target: Path, info: CheckpointInfo, link: Link | None,
          drop_write_bits: bool) -> Kind:
    """Copy (or link) the step's files from the directory ``source`` into the empty-or-refilled ``target``,
    checked against the catalog's manifest digest; a file missing from a directory still there is damage."""
    names = _listed(source)
    for child in target.iterdir():  # what an earlier copy of the step left, when that copy proved bad
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    try:
        if link is None:
            return checkouts.copy_step(source, target, expected_digest=info.manifest_sha256, verify=verify)
        kind = checkouts.link_step(source, names, target, link, drop_write_bits=drop_write_bits)
    except FileNotFoundError as exc:
        if not source.is_dir():  # the directory went (an unmounted root): this reader's trouble
            raise read_error(source, exc) from exc
        # a file the manifest lists is gone from a directory still there: the step is damaged
        raise CorruptCheckpointError(f"checkpoint file is missing: {exc.filename}", path=source) from exc
    except OSError as exc:
        raise read_error(source, exc) from exc
    map_directory(source, extras=True, verify=verify, expected_digest=info.manifest_sha256)
    return kind


def _undo(target: Path, made: bool, recorded: bool) -> None:
    if recorded:
        checkouts.remove_owned(target)
    elif made:
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


def check_dest(dest: Path, *, root: Path, overwrite: bool, catalog: Path | None = None) -> None:
    """An export's destination: outside the checkpoint root, holding neither it nor ``catalog`` (a SQLite
    file elsewhere), empty unless ``overwrite``."""
    check_outside_root(dest, root, what="export destination", catalog=catalog)
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not overwrite)):
        raise InvalidStateError(f"export destination {dest} exists and is not empty; pass overwrite=True "
                                "to replace it")


def export(read: Read, dest: Path, *, root: Path, catalog: Path | None = None,
           format: ExportFormat = "safetensors",  # noqa: A002 - the CLI's name
           max_shard_size: int | None = None, overwrite: bool = False) -> Exported:
    """Write the weights and config of the step ``read`` as a standalone directory (atomically, replacing
    ``dest``).

    ``format="safetensors"``: one ``model.safetensors``; ``format="hf"``:
    Hugging Face shards of at most ``max_shard_size`` bytes (default 5 GB)
    and ``model.safetensors.index.json``, or one ``model.safetensors`` when
    the weights fit one shard, as ``save_pretrained`` writes them. Either way with ``config.json``,
    ``meta.json`` (epoch, step, source) and a ``manifest.json``, so the
    registry can import it back. Extras (optimizer state) are left out.
    ``root``: the checkpoint root, which ``dest`` may be neither inside nor contain; nor may it
    contain ``catalog``.
    """
    shard = check_format(format, max_shard_size)
    check_dest(dest, root=root, catalog=catalog, overwrite=overwrite)
    if dest.exists() and not dest.is_dir():
        raise RootError(f"export destination {dest} is not a directory", path=dest)
    loaded, info = read.loaded, read.info
    meta = {k: v for k, v in loaded.meta.items() if k in ("optimizer_step", "policy_version")}
    meta["exported_from"] = f"{info.run}@{info.step}"
    if shard is not None and sum(t.numel() * t.element_size() for t in loaded.state_dict.values()) <= shard:
        shard = None  # as ``save_pretrained`` does: weights that fit one shard are one ``model.safetensors``
    save_directory(dest, saved_payload(loaded.state_dict, epoch=loaded.epoch,
                                       consumed_samples=loaded.consumed_samples, meta=meta, config=loaded.config,
                                       extra={}, policy_version=loaded.policy_version, max_shard_size=shard))
    files = tuple(sorted(p.name for p in dest.iterdir()))
    return Exported(run=info.run, step=info.step, path=dest, format=format, files=files)


def materialize(access: ReadAccess, ref: Ref, dest: Path) -> Path:
    """Write into the directory ``dest`` the very ``model.safetensors`` and ``config.json`` a full publish of the
    step ``ref`` names writes (see :func:`registry.ops.policy.write_full`).

    Read like an export (verified, a delta step rebuilt from its chain, a
    corrupt ``@latest``/``@latest-policy`` falling back), then checked against
    the version's ``full_sha256`` before it replaces what ``dest`` held.
    """
    return materialize_traced(access, ref, dest)[0]


def materialize_traced(access: ReadAccess, ref: Ref, dest: Path) -> tuple[Path, str]:
    """:func:`materialize`, and the copy the step's own bytes were read from (:class:`registry.ops.copies.Traced`:
    a directory, this host's cached download of a durable copy, or an ``s3://`` URL). For a delta step that is
    the copy of its delta, the chain's last link; the earlier links are read from their own nearest copies, or
    not at all when ``dest`` held an earlier version."""
    from registry.ops.copies import Traced
    traced = Traced(access.copies)
    access = replace(access, copies=traced)
    written, info = _materialize(access, ref, dest)
    return written, traced.read[(info.run, info.step)]


def _materialize(access: ReadAccess, ref: Ref, dest: Path) -> tuple[Path, CheckpointInfo]:
    from registry.ops.hostcopies import POLICY_CACHE
    from registry.ops.materialize import full_digest, held_digest, held_in, materialize_patched, write_full
    from registry.ops.policy import Held, read_rebuilt
    if access.home.local_dir is not None:  # a host's policy copies (registry.ops.consumers) live under the root
        check_outside_root(dest, access.root, what="materialize destination", allowed=access.root / POLICY_CACHE)
    if dest.exists() and not dest.is_dir():
        raise InvalidStateError(f"materialize destination {dest} exists and is not a directory")
    held: Held | None = None  # a consumer's previous version, hashed: a rebuild starts there
    hint = held_digest(dest) if dest.is_dir() else None  # recorded when materialize wrote it: read, not hashed
    if hint is None and dest.is_dir():
        held = held_in(dest)
        hint = held[0] if held is not None else None
    read = CatalogRead(access, ref, fallback=True)
    try:
        while True:
            info = read.candidate()
            if hint is not None:  # one delta from what dest holds, XORed into a copy of it, the result checked
                try:
                    patched = materialize_patched(access, info, dest, hint)
                except RegistryError:
                    patched = None  # read again below, where a damaged step is judged
                if patched is not None:
                    read.release()
                    report(read.record(info))
                    return patched, info
                hint = None
                if held is None:
                    held = held_in(dest)
            try:
                loaded = read_rebuilt(access, info, verify=True, extras=False, held=held)
            except RegistryError as exc:
                if held is not None:  # what dest held may have changed under us: never the step's fault
                    held = None
                    continue
                read.judge(exc)
                for note in read.notes:
                    warnings.warn(note, RuntimeWarning, stacklevel=3)
                read.notes.clear()
                continue
            expected = full_digest(access, info)
            written = write_full(dest, loaded, expected=expected,
                                 unchanged=held is not None and held[0] == expected)
            read.release()
            report(read.record(info))
            return written, info
    finally:
        read.release()


__all__ = ["Checkout", "Exported", "FORMATS", "check_checkout_dest", "check_dest", "check_format",
           "checkout", "export", "materialize", "materialize_traced"]
