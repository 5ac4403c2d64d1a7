"""The registry in the Hugging Face ``Trainer``: every save becomes a registry step.

::

    cb = RegistryCallback(reg, "run", keep=KeepLast(3) | KeepBest(1, "eval_loss"))
    trainer = Trainer(..., callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_from())  # None on a fresh start

At each save the ``Trainer`` writes ``checkpoint-N`` as usual; the callback
publishes what it wrote (the model's safetensors and ``config.json``, the
optimizer, scheduler and scaler state, the RNG states and the trainer state)
as ``run@N`` with the evaluation metrics of step N in the same transaction,
then removes ``checkpoint-N`` (the registry's copy is the checkpoint now;
``remove_trainer_checkpoints=False`` keeps it). On a filesystem root the
files are adopted, not rewritten (``Registry.publish_files``): hard-linked
into the step and read once to hash them, so a save costs the Trainer's
write, one read and the fsync. With ``blocking=False`` the Trainer waits
for none of that: ``checkpoint-N`` is renamed to a hidden
``.registry-adopting-checkpoint-N`` (out of the Trainer's way) and adopted
from there on the background publisher. An evaluation after step N
was published lands as a late metric, so ``run@best:eval_loss`` re-ranks at
once. ``save_total_limit`` is replaced by ``keep``, a retention policy
applied after each publish (which never deletes the newest step, a tagged
one or one being read). When training starts the main process records the
``TrainingArguments`` (``to_dict()``, the JSON scalars) as the run's
parameters (``Registry.set_params``).

Resuming goes through :meth:`registry.Registry.checkout`: the newest
verified step (falling back past a corrupt one with a warning) as a
directory laid out as ``checkpoint-N`` is, with ``trainer_state.json`` and
``rng_state.pth`` restored beside the linked files. Only the main process
publishes; each process of a multi-process job checks out on its own.

Non-tensor state is read back with ``torch.load(weights_only=True)``; an
optimizer or scheduler state that needs full unpickling is refused with
``UnsafePickleError`` unless ``trust_pickle=True``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import TrainerCallback

from registry.errors import CheckpointNotFoundError, InvalidStateError
from registry.integrations import has_checkpoint, nothing_to_resume, numeric_metrics

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from registry.api import Registry
    from registry.ops.export import Checkout
    from registry.retention import Policy

TRAINER_STATE = "trainer_state.json"  # the Trainer's names for what it reads back on resume
RNG_FILE = "rng_state.pth"
RNG_EXTRA = "rng_state"  # published as rng_state.pt: extras are NAME.pt
PUBLISHED_EXTRAS = ("optimizer", "scheduler", "scaler")  # the Trainer's NAME.pt files, kept under their names
WEIGHTS, WEIGHTS_INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"
META_KEY = "hf_trainer_state"
# what the Trainer's speed_metrics() adds to every evaluation: timings of this machine, not of the model
SPEED_SUFFIXES = ("_runtime", "_samples_per_second", "_steps_per_second", "_tokens_per_second")

log = logging.getLogger(__name__)


def model_metrics(metrics: dict[str, Any] | None, *, speed: bool = False) -> dict[str, float]:
    """The numbers of an evaluation worth ranking by: without ``epoch`` and, unless ``speed``, the timings."""
    return numeric_metrics({k: v for k, v in (metrics or {}).items()
                            if k != "epoch" and (speed or not k.endswith(SPEED_SUFFIXES))})


def _plain_rng(state: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's RNG file with numpy's state as plain numbers, so it loads with ``weights_only=True``."""
    out = dict(state)
    numpy_state = out.get("numpy")
    if numpy_state is not None:
        name, keys, pos, has_gauss, cached = numpy_state
        out["numpy"] = (str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                        float(cached))
    return out


def _read_rng(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    from transformers.trainer_pt_utils import safe_globals
    with safe_globals():  # the Trainer's own reader of this file: it allows numpy's state
        state = torch.load(path, weights_only=True)
    return _plain_rng(state)


def _numpy_state(state: Any) -> Any:
    """numpy's state tuple back from :func:`_plain_rng`'s form (the Trainer passes it to ``set_state``)."""
    name, keys, pos, has_gauss, cached = state
    keys = keys.numpy().astype(np.uint32) if isinstance(keys, torch.Tensor) else np.asarray(keys, dtype=np.uint32)
    return (name, keys, pos, has_gauss, cached)


class RegistryCallback(TrainerCallback):
    """Publish each ``Trainer`` save to ``registry`` as ``run@global_step``; see the module docstring.

    ``blocking=False`` publishes in the background (``on_train_end`` waits
    for it; a ``checkpoint-N`` directory is removed once its publish
    committed, and one whose publish failed is kept under its name).
    ``keep`` is a retention policy applied after each publish.
    The Trainer's timings (``eval_runtime``, ``eval_samples_per_second``,
    ``eval_steps_per_second``, ...) are not stored as metrics unless
    ``speed_metrics=True``.
    """

    def __init__(self, registry: Registry, run: str, *, keep: Policy | None = None, blocking: bool = True,
                 remove_trainer_checkpoints: bool = True, trust_pickle: bool = False,
                 tags: tuple[str, ...] = (), speed_metrics: bool = False) -> None:
        from registry.format.refs import check_run_name
        check_run_name(run)
        self.registry = registry
        self.run = run
        self.keep = keep
        self.blocking = blocking
        self.remove_trainer_checkpoints = remove_trainer_checkpoints
        self.trust_pickle = trust_pickle
        self.tags = tags
        self.speed_metrics = speed_metrics
        self.published: set[int] = set()
        self.checkout: Checkout | None = None
        # (publish result or future, the directory to remove once it committed, checkpoint-N)
        self._pending: list[tuple[Any, Path, Path]] = []
        self.resumed_at: int | None = None  # steps above it belong to the abandoned timeline: replaced

    # ------------------------------------------------------------------ resume

    def resume_from(self, ref: str | None = None, *, dest: str | os.PathLike[str] | None = None,
                    create: bool = True) -> str | None:
        """A ``checkpoint-N`` style directory of ``ref`` (default ``RUN@latest``) for ``resume_from_checkpoint``.

        None when the run has no checkpoint yet, so the same line starts a
        fresh training and resumes a killed one; ``create=False`` (a restart,
        which must resume) raises ``CheckpointNotFoundError`` instead. The
        reader lease is held until training ends.
        """
        try:
            checkout = self.registry.checkout(ref or f"{self.run}@latest", dest)
        except CheckpointNotFoundError:
            if ref is None and not has_checkpoint(self.registry, self.run):
                if not create:
                    raise nothing_to_resume(self.registry, self.run) from None
                return None
            raise
        try:
            restore_trainer_files(checkout.path)
        except BaseException:
            checkout.close()
            raise
        if checkout.info.run == self.run:
            self.registry.begin_attempt(self.run, resumed_from=checkout.step)
            self.resumed_at = checkout.step
        self.checkout = checkout
        log.info("resuming %s from %s@%d (%s; asked for %s)", self.run, checkout.info.run, checkout.step,
                 checkout.info.status, ref or f"{self.run}@latest")
        return str(checkout.path)

    # ------------------------------------------------------------------ hooks

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.registry.set_params(self.run, training_params(args))
        if not self.remove_trainer_checkpoints:
            return
        if state.is_world_process_zero:
            self.remove_adopted_leftovers(Path(args.output_dir or "."))
        if args.load_best_model_at_end:
            raise InvalidStateError("load_best_model_at_end needs the Trainer's checkpoint-N directories: pass "
                                    "RegistryCallback(..., remove_trainer_checkpoints=False), or load "
                                    f"'{self.run}@best:eval_loss' from the registry after training")
        if args.save_total_limit:
            warnings.warn("save_total_limit has no effect with RegistryCallback: the checkpoint-N directories "
                          "are removed once published; pass keep= (a retention policy) instead", UserWarning,
                          stacklevel=2)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        points = model_metrics(metrics, speed=self.speed_metrics)
        if points:  # late when the step is already published: written now, so best: re-ranks at once
            self.registry.log_metrics(self.run, state.global_step, points,
                                      flush=state.global_step in self.published)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        folder = Path(args.output_dir or ".") / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        self.publish_directory(folder, step=state.global_step, epoch=int(state.epoch or 0))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if state.is_world_process_zero:
            # the folders first: one whose background publish failed gets its name back before wait() raises
            self._remove_published(wait=True)
            self.registry.wait()
            self.registry.flush(self.run)
        if self.checkout is not None:
            checkout, self.checkout = self.checkout, None
            checkout.close()

    # ------------------------------------------------------------------ publish

    def publish_directory(self, folder: Path, *, step: int, epoch: int) -> None:
        """Publish a ``checkpoint-N`` directory the ``Trainer`` wrote as ``run@step``, then remove it.

        A blocking publish to a filesystem root (without a durable tier or
        dedup) adopts the Trainer's files: the weights, ``config.json`` and
        the optimizer, scheduler and scaler states become the step's own,
        each read once to hash it, hard-linked when the output directory is on
        the root's filesystem (copied when not, or when the directory is
        kept). Otherwise they are read through the registry's directory reader
        (weights mapped, not copied; ``NAME.pt`` files with
        ``weights_only=True``) and published. In the background mode the
        directory is removed once its publish committed.
        """
        extra: dict[str, Any] = {}
        rng = _read_rng(folder / RNG_FILE)
        if rng is not None:
            extra[RNG_EXTRA] = rng
        meta: dict[str, Any] = {}
        if (folder / TRAINER_STATE).is_file():
            meta[META_KEY] = json.loads((folder / TRAINER_STATE).read_text())
        overwrite = self.resumed_at is not None and step > self.resumed_at
        files = self._adoptable(folder)
        held = folder if self.blocking or files is None else _hold(folder)
        result: Any
        if files is not None and held is not None:
            try:
                result = self.registry.publish_files(
                    held, run=self.run, step=step, files=files, meta=meta, extra=extra, epoch=epoch,
                    optimizer_step=step, retention=self.keep, tags=self.tags, overwrite=overwrite,
                    adopt=self.remove_trainer_checkpoints, trust_pickle=self.trust_pickle, blocking=self.blocking)
            except BaseException:
                _release(held, folder)
                raise
        else:
            held = folder
            from registry.checkpoint import Checkpoint
            names = [n for n in PUBLISHED_EXTRAS if (folder / f"{n}.pt").is_file()]
            ckpt = Checkpoint.load(folder, trust_pickle=self.trust_pickle, extras=names)
            result = self.registry.publish(
                self.run, step, ckpt.state_dict, extra={**ckpt.extra, **extra}, config=ckpt.config, meta=meta,
                epoch=epoch, optimizer_step=step, retention=self.keep, tags=self.tags, blocking=self.blocking,
                trust_pickle=self.trust_pickle, overwrite=overwrite)
        self.published.add(step)
        if self.remove_trainer_checkpoints:
            self._pending.append((result, held, folder))
        self._remove_published()

    def _adoptable(self, folder: Path) -> list[str] | None:
        """The files of ``folder`` a publish adopts as they are, or None where it reads and republishes them.

        Adopting needs the root's filesystem on this host; in the background,
        a folder the callback may take from the Trainer (one it removes
        anyway), so that the Trainer rotates nothing away meanwhile. The
        weights are one ``model.safetensors`` or an index and its shards.
        """
        root = self.registry.root
        if not root.can.local_import or root.can.tiers or self.registry.dedup:
            return None
        if not (self.blocking or self.remove_trainer_checkpoints):
            return None
        if (folder / WEIGHTS).is_file():
            weights = [WEIGHTS]
        elif (folder / WEIGHTS_INDEX).is_file():
            try:
                shards = json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"].values()
                weights = [WEIGHTS_INDEX, *sorted({str(name) for name in shards})]
            except (ValueError, KeyError, TypeError, AttributeError):
                return None  # the reader's error, as the registry words it
        else:
            return None  # no safetensors weights: the reader's error, as the registry words it
        present = [name for name in (CONFIG, *(f"{n}.pt" for n in PUBLISHED_EXTRAS)) if (folder / name).is_file()]
        return [*weights, *present]

    def remove_adopted_leftovers(self, output_dir: Path) -> list[Path]:
        """Remove the ``checkpoint-N`` folders of ``output_dir`` that share their files with the published step N.

        A process killed between a publish's commit and the removal of the
        folder it adopted leaves that folder holding hard links to the step's
        files. A ``Trainer`` that saves ``checkpoint-N`` again (resumed at an
        earlier step) rewrites those files in place, and with them the
        published step's bytes: the leftovers go before training starts. A
        folder whose step is not published, or whose files are its own, is
        the ``Trainer``'s and stays; one held for a background publish that
        did not commit gets its name back. Returns what was removed.
        """
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        removed = []
        prefix = f"{PREFIX_CHECKPOINT_DIR}-"
        for folder in sorted([*output_dir.glob(f"{prefix}*"), *output_dir.glob(f"{HELD}{prefix}*")]):
            name = folder.name.removeprefix(HELD)
            suffix = name[len(prefix):]
            if not suffix.isdigit() or not folder.is_dir() or folder.is_symlink():
                continue
            try:
                info = self.registry.resolve(f"{self.run}@{int(suffix)}")
            except CheckpointNotFoundError:
                info = None
            if info is not None and _shares_files(folder, Path(info.path)):
                log.warning("removing %s: a leftover of %s@%s's publish (killed before it was removed), whose "
                            "files are the step's own", folder, self.run, suffix)
                shutil.rmtree(folder)
                removed.append(folder)
            elif folder.name != name:
                _release(folder, output_dir / name)
        return removed

    def _remove_published(self, *, wait: bool = False) -> None:
        """Remove the ``checkpoint-N`` directories whose publish committed; a failed one is kept, under its name."""
        left = []
        for result, held, folder in self._pending:
            if isinstance(result, Future):
                if not (wait or result.done()):
                    left.append((result, held, folder))
                    continue
                if result.exception() is not None:
                    _release(held, folder)
                    warnings.warn(f"{folder} is kept: publishing it failed: {result.exception()}", RuntimeWarning,
                                  stacklevel=2)
                    continue
            shutil.rmtree(held, ignore_errors=True)
        self._pending = left


HELD = ".registry-adopting-"  # the name a checkpoint-N folder takes while it is adopted in the background


def _hold(folder: Path) -> Path | None:
    """``folder`` renamed out of the Trainer's sight (its rotation lists ``checkpoint-*``), or None if it cannot be."""
    held = folder.with_name(HELD + folder.name)
    try:
        if held.exists():
            return None
        os.rename(folder, held)
    except OSError:
        return None
    return held


def _release(held: Path, folder: Path) -> None:
    """A held folder given back its ``checkpoint-N`` name, unless that name was taken since (then it stays held)."""
    if held == folder:
        return
    try:
        if not folder.exists():
            os.rename(held, folder)
            return
    except OSError:
        pass
    log.warning("%s stays as it is: %s exists", held, folder)


def _shares_files(folder: Path, step_dir: Path) -> bool:
    """Whether a file of ``folder`` is the very file (same inode) of the same name in ``step_dir``."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    for name in names:
        try:
            mine, theirs = os.stat(folder / name), os.stat(step_dir / name)
        except OSError:
            continue
        if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
            return True
    return False


def training_params(args: TrainingArguments) -> dict[str, Any]:
    """The ``TrainingArguments`` as run parameters: its JSON scalars (None, booleans, finite numbers, text);
    lists and mappings (``report_to``, ``fsdp_config``) and what JSON cannot hold are left out."""
    from registry.format.params import json_params
    return json_params({k: v for k, v in args.to_dict().items() if v is None or isinstance(v, (bool, int, float, str))})


def restore_trainer_files(directory: Path) -> None:
    """Give a checked-out step the files the ``Trainer`` reads on resume under its own names.

    ``trainer_state.json`` is written from the step's ``meta.json``;
    ``rng_state.pth`` is written from the ``rng_state`` extra in the
    Trainer's numpy form. The weights, ``config.json``, ``optimizer.pt`` and
    ``scheduler.pt`` are the linked files themselves.
    """
    meta = json.loads((directory / "meta.json").read_text())
    state = meta.get(META_KEY)
    if isinstance(state, dict):
        (directory / TRAINER_STATE).write_text(json.dumps(state, indent=2))
    rng_file = directory / f"{RNG_EXTRA}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        if "numpy" in rng:
            rng["numpy"] = _numpy_state(rng["numpy"])
        torch.save(rng, directory / RNG_FILE)


__all__ = ["RegistryCallback", "restore_trainer_files"]
