"""The registry in PyTorch Lightning: a callback that publishes, a ``CheckpointIO`` that resumes.

::

    ckpt = RegistryCheckpoint(reg, "run", every_n_epochs=1, keep=KeepLast(3) | KeepBest(2, "val_loss"))
    trainer = L.Trainer(callbacks=[ckpt], enable_checkpointing=False)
    trainer.fit(model, data, ckpt_path=ckpt.resume_path())  # "registry:run@latest", None on a fresh start

:class:`RegistryCheckpoint` publishes ``run@global_step`` every N steps or
epochs through ``trainer.save_checkpoint``, so Lightning assembles its full
checkpoint (model, optimizers, schedulers, loops, callbacks' state,
hyper-parameters) as it does for a file, with ``trainer.callback_metrics``
committed in the same transaction; validation metrics that arrive after the
step was published are logged as late metrics. ``keep`` (a retention
policy) replaces ``save_top_k``, and never deletes the newest step, a
tagged step, or one being read. It also saves the RNG states (torch, numpy,
Python) in its own callback state, so a resumed run draws what the
uninterrupted one would have. When training starts it records the
LightningModule's ``hparams`` as the run's parameters (``Registry.set_params``;
what JSON cannot hold is left out).

:class:`RegistryCheckpointIO` (installed by the callback at ``setup``, or
passed as ``plugins=[...]``) writes ``registry:RUN@STEP`` targets to the
registry and reads ``registry:REF`` paths from it: ``ckpt_path=
"registry:run@latest"`` resumes the newest verified step, falling back past
a corrupt one with a warning. Any other path goes to the ``CheckpointIO``
it wraps (Lightning's default). On disk, the weights are the step's
``model.safetensors``, the optimizer states the ``optimizer`` extra, every
other part that is plain data (loops, schedulers, hyper-parameters) JSON in
``meta.json``, and what is not (a callback's tensors) the ``lightning``
extra, read back with ``torch.load(weights_only=True)``: a part that needs
full unpickling is refused with ``UnsafePickleError`` unless
``trust_pickle=True``.

Distributed (DDP): global rank 0 publishes (Lightning's strategy calls the
``CheckpointIO`` there only) and every rank waits at the barrier after it;
a resume loads with ``broadcast=True``, so rank 0 resolves and verifies one
step and every rank restores that very step.

Sharded (``ModelParallelStrategy``: FSDP2, tensor parallel): every rank
publishes its shard collectively with ``publish(..., sharded=True)`` and a
resume loads every rank's shard with ``load_into``, resharding from any world
size; see :mod:`registry.integrations.lightning_sharded`. ``FSDPStrategy``
and ``DeepSpeedStrategy`` are refused at ``setup``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.plugins.io.torch_plugin import TorchCheckpointIO

from registry.errors import InvalidStateError, UnsafePickleError
from registry.format.refs import parse_ref
from registry.integrations import has_checkpoint, nothing_to_resume, numeric_metrics

if TYPE_CHECKING:
    from registry.api import Registry
    from registry.retention import Policy

PREFIX = "registry:"
META_KEY = "lightning"  # meta.json: the plain-data parts of Lightning's checkpoint
EXTRA_REST = "lightning"  # lightning.pt: the parts that are not plain data
EXTRA_OPTIMIZERS = "optimizer"  # optimizer.pt: the list of optimizer states


def is_registry_path(path: object) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def _refuse_converted(path: object) -> None:
    """A ``registry:`` target that a strategy turned into a ``Path`` (``FSDPStrategy`` does) is refused.

    Such a strategy reads and writes its own checkpoint files; passed on,
    the target would become a local file named ``registry:...``.
    """
    if isinstance(path, PurePath) and str(path).startswith(PREFIX):
        raise InvalidStateError(f"{str(path)!r} reached the CheckpointIO as a file path: the strategy writes and "
                                "reads its own checkpoint files (FSDPStrategy does), so it cannot publish to the "
                                "registry; for sharded training use ModelParallelStrategy")


def _is_plain(value: Any) -> bool:
    """Whether ``value`` survives a JSON round trip unchanged (types included)."""
    if value is None or isinstance(value, (bool, str)):
        return True
    if isinstance(value, int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if type(value) is list:
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict) and (type(value) is dict or type(value).__name__ == "AttributeDict"):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def split_plain(parts: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parts of Lightning's checkpoint as (the JSON parts, the rest)."""
    plain: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in parts.items():
        if _is_plain(value):
            plain[key] = dict(value) if isinstance(value, dict) else value
        else:
            rest[key] = value
    return plain, rest


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any],
                                                              dict[str, Any]]:
    """Lightning's checkpoint as (weights, the JSON parts, the extras)."""
    plain, rest = split_plain({k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")})
    extra: dict[str, Any] = {}
    if "optimizer_states" in checkpoint:
        extra[EXTRA_OPTIMIZERS] = checkpoint["optimizer_states"]
    if rest:
        extra[EXTRA_REST] = rest
    return dict(checkpoint.get("state_dict", {})), plain, extra


def _step_target(path: str) -> tuple[str, int]:
    ref = parse_ref(path[len(PREFIX):])
    if ref.kind != "step" or ref.step is None:
        raise InvalidStateError(f"save to {path!r}: name one step, as registry:RUN@STEP")
    return ref.run, ref.step


def _trust_hint(exc: UnsafePickleError) -> UnsafePickleError:
    return UnsafePickleError(f"{exc}; for Lightning pass RegistryCheckpoint(..., trust_pickle=True) "
                             "(or RegistryCheckpointIO(..., trust_pickle=True))")


class RegistryCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` for ``registry:`` paths; anything else goes to ``wrapped``."""

    def __init__(self, registry: Registry, *, trust_pickle: bool = False,
                 wrapped: CheckpointIO | None = None) -> None:
        self.registry = registry
        self.trust_pickle = trust_pickle
        self.wrapped = wrapped if wrapped is not None else TorchCheckpointIO()
        self.loaded_step: int | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if not is_registry_path(path):
            _refuse_converted(path)
            self.wrapped.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        run, step = _step_target(path)
        options = dict(storage_options or {})
        state, plain, extra = split_checkpoint(checkpoint)
        try:
            self.registry.publish(
                run, step, state, extra=extra, meta={META_KEY: plain},
                config=plain.get("hyper_parameters") or {}, epoch=int(checkpoint.get("epoch", 0)),
                optimizer_step=int(checkpoint.get("global_step", step)), trust_pickle=self.trust_pickle,
                **options)
        except UnsafePickleError as exc:
            raise _trust_hint(exc) from None

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if not is_registry_path(path):
            _refuse_converted(path)
            return self.wrapped.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        broadcast = torch.distributed.is_available() and torch.distributed.is_initialized()
        try:
            ckpt = self.registry.load(path[len(PREFIX):], broadcast=broadcast, trust_pickle=self.trust_pickle,
                                      map_location="cpu" if map_location is None else map_location)
        except UnsafePickleError as exc:
            raise _trust_hint(exc) from None
        out: dict[str, Any] = dict(ckpt.meta.get(META_KEY) or {})
        out.update(ckpt.extra.get(EXTRA_REST) or {})
        out["state_dict"] = ckpt.state_dict
        if EXTRA_OPTIMIZERS in ckpt.extra:
            out["optimizer_states"] = ckpt.extra[EXTRA_OPTIMIZERS]
        self.loaded_step = ckpt.step
        return out

    def attach_sharded(self, trainer: pl.Trainer) -> None:
        """Take ``registry:`` paths under a sharded strategy, which calls no ``CheckpointIO`` (see
        :mod:`registry.integrations.lightning_sharded`): every rank publishes and loads its own shard."""
        from registry.integrations import lightning_sharded as sharded
        strategy = trainer.strategy

        def save(checkpoint: dict[str, Any], path: str, storage_options: Any) -> None:
            run, step = _step_target(path)
            try:
                sharded.publish_checkpoint(self.registry, strategy, run=run, step=step,
                                           checkpoint=checkpoint, split=split_plain, meta_key=META_KEY,
                                           trust_pickle=self.trust_pickle, options=dict(storage_options or {}))
            except UnsafePickleError as exc:
                raise _trust_hint(exc) from None

        def load(path: str) -> dict[str, Any]:
            try:
                out, self.loaded_step = sharded.load_checkpoint(self.registry, trainer, path[len(PREFIX):],
                                                                meta_key=META_KEY, trust_pickle=self.trust_pickle)
            except UnsafePickleError as exc:
                raise _trust_hint(exc) from None
            return out

        sharded.route_registry_paths(strategy, save=save, load=load, is_registry_path=is_registry_path)

    def remove_checkpoint(self, path: Any) -> None:
        if not is_registry_path(path):  # the registry's retention removes steps, never Lightning
            self.wrapped.remove_checkpoint(path)

    def teardown(self) -> None:
        self.wrapped.teardown()


def _rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss],
            "numpy": [str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                      float(cached)]}


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


class RegistryCheckpoint(pl.Callback):
    """Publish Lightning's checkpoint to ``registry`` as ``run@global_step``; see the module docstring.

    ``every_n_steps`` publishes after that many optimizer steps (in
    ``on_train_batch_end``), ``every_n_epochs`` at the end of that many
    epochs (default 1 when neither is given). ``blocking=False`` publishes in
    the background (snapshotting the tensors first), so training goes on
    while the files are written and fsync'd.
    """

    def __init__(self, registry: Registry, run: str, *, every_n_steps: int | None = None,
                 every_n_epochs: int | None = None, keep: Policy | None = None, blocking: bool = True,
                 trust_pickle: bool = False, save_rng: bool = True) -> None:
        from registry.format.refs import check_run_name
        check_run_name(run)
        for name, value in (("every_n_steps", every_n_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidStateError(f"{name} must be a positive integer, got {value!r}")
        self.registry = registry
        self.run = run
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None or every_n_steps else 1
        self.keep = keep
        self.blocking = blocking
        self.save_rng = save_rng
        self.io = RegistryCheckpointIO(registry, trust_pickle=trust_pickle)
        self.published: set[int] = set()
        self.resumed_at: int | None = None
        self._val_keys: set[str] = set()  # what validation logs (learnt at the first one, the sanity check too)
        self._keys_before: set[str] = set()
        self._validated: tuple[int, dict[str, float]] | None = None  # a validation's step and values, not yet sent

    @property
    def state_key(self) -> str:
        return f"RegistryCheckpoint[{self.run}]"

    def resume_path(self, ref: str | None = None, *, create: bool = True) -> str | None:
        """``registry:RUN@latest`` (or ``ref``) for ``ckpt_path``; None when the run has no step yet.

        ``create=False`` (a restart, which must resume) raises ``CheckpointNotFoundError`` instead of None.
        A ``ref`` given is resolved here, before ``fit`` starts: a malformed or misspelt one (``RUN@lastest``)
        raises ``InvalidRefError``, one that names no step ``CheckpointNotFoundError``.
        """
        if ref is None:
            if has_checkpoint(self.registry, self.run):
                return f"{PREFIX}{self.run}@latest"
            if not create:
                raise nothing_to_resume(self.registry, self.run)
            return None
        target = ref[len(PREFIX):] if isinstance(ref, str) and ref.startswith(PREFIX) else ref
        self.registry.resolve(target)
        return PREFIX + target

    # ------------------------------------------------------------------ hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from registry.integrations.lightning_sharded import sharded_strategy
        sharded = sharded_strategy(trainer.strategy)
        if sharded and not self.blocking:
            raise InvalidStateError(f"RegistryCheckpoint({self.run!r}) under {type(trainer.strategy).__name__} "
                                    "publishes collectively, so blocking=False does not apply")
        current = trainer.strategy.checkpoint_io
        if isinstance(current, RegistryCheckpointIO):
            self.io = current  # the user's own, passed as a plugin
        else:
            self.io.wrapped = current
            trainer.strategy.checkpoint_io = self.io
        if sharded:
            self.io.attach_sharded(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a resume from the registry: steps above the resumed one belong to the abandoned timeline.

        They are replaced when this attempt publishes them again (say, a
        corrupt newest step the resume fell back past), and the metrics that
        the dead attempt logged for them stop counting (``begin_attempt``).
        """
        step = self.io.loaded_step
        if step is not None and self.resumed_at is None:
            self.resumed_at = step
            if trainer.is_global_zero:
                self.registry.begin_attempt(self.run, resumed_from=step)
        if trainer.is_global_zero:
            from registry.format.params import json_params
            hparams = json_params(getattr(pl_module, "hparams", None))
            if hparams:
                self.registry.set_params(self.run, hparams)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and step not in self.published:
            self.publish(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epochs = trainer.current_epoch + 1
        if self.every_n_epochs and epochs % self.every_n_epochs == 0 and trainer.global_step not in self.published:
            self.publish(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._keys_before = set(trainer.callback_metrics)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remember which metrics validation logs, and give this validation's values to its own step.

        ``callback_metrics`` keeps a validation's values until the next
        validation, so a publish between two validations would otherwise
        record the older weights' scores as its own. They go to the step
        that was validated: as late metrics when it is already published,
        with its publish when that comes next, else as points of their own.
        """
        self._val_keys |= set(trainer.callback_metrics) - self._keys_before
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        step = trainer.global_step
        points = numeric_metrics({k: v for k, v in trainer.callback_metrics.items() if k in self._val_keys})
        if self._validated is not None and self._validated[0] != step:
            self.registry.log_metrics(self.run, *self._validated)  # never published: kept at its own step
        self._validated = None
        if not points:
            return
        if step in self.published:
            self.registry.log_metrics(self.run, step, points, flush=True)  # late: best: re-ranks at once
        else:
            self._validated = (step, points)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.registry.wait()
            if self._validated is not None:  # the last validation's step was never published
                self.registry.log_metrics(self.run, *self._validated, flush=True)
                self._validated = None

    def state_dict(self) -> dict[str, Any]:
        return {"rng": _rng_state()} if self.save_rng else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.save_rng and "rng" in state_dict:
            _set_rng_state(state_dict["rng"])

    # ------------------------------------------------------------------ publish

    def publish(self, trainer: pl.Trainer) -> None:
        """Publish the trainer's full checkpoint as ``run@global_step`` (rank 0 writes; all ranks must call).

        With it go the training metrics of ``callback_metrics`` and the
        validation metrics only if validation ran at this very step.
        """
        step = trainer.global_step
        metrics = numeric_metrics({k: v for k, v in trainer.callback_metrics.items() if k not in self._val_keys})
        if self._validated is not None:
            validated, points = self._validated
            if validated == step:
                metrics.update(points)
            elif trainer.is_global_zero:
                self.registry.log_metrics(self.run, validated, points)  # an older step's: its own points
            self._validated = None
        options = {"metrics": metrics, "retention": self.keep, "blocking": self.blocking,
                   "overwrite": self.resumed_at is not None and step > self.resumed_at}
        # weights_only=False said, not defaulted: Lightning logs its default on every save otherwise
        trainer.save_checkpoint(f"{PREFIX}{self.run}@{step}", weights_only=False, storage_options=options)
        self.published.add(step)


__all__ = ["PREFIX", "RegistryCheckpoint", "RegistryCheckpointIO", "is_registry_path", "split_checkpoint"]
