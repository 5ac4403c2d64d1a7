"""Lightning's sharded strategy in the registry: every rank publishes its shard, every rank loads its own.

Under ``ModelParallelStrategy`` (FSDP2's ``fully_shard`` and tensor
parallelism, DTensor parameters) Lightning never calls a ``CheckpointIO``:
the strategy writes ``torch.distributed.checkpoint`` files to a path itself,
and reads them back. So :class:`~registry.integrations.lightning.RegistryCheckpoint`
routes the strategy's ``save_checkpoint`` and ``load_checkpoint`` for
``registry:`` paths (on that strategy object only; every other path goes to
the strategy's own) to a collective sharded publish and a collective
resharding load:

- publish (``Registry.publish(..., sharded=True)``, on every rank): the DCP
  state is ``{"model": ..., "optimizer_0": ..., "lightning": BYTES}``; model
  and optimizer states are the ones Lightning's strategy dumps
  (``get_model_state_dict`` / ``get_optimizer_state_dict``, sharded);
  Lightning's plain-data parts (loops, schedulers, hyper-parameters) go to
  ``meta.json`` as for any Lightning step, the rest (callbacks' tensors, the
  RNG states) pickled as one value, rank 0's, checked to load with
  ``torch.load(weights_only=True)`` unless ``trust_pickle``.
- load (``Registry.load_into``, on every rank): templates are built from the
  live model and optimizers the same way, the step reshards into them from
  whatever world size it was saved at, then ``set_model_state_dict`` /
  ``set_optimizer_state_dict`` apply them; a corrupt ``@latest`` falls back to
  an older step on every rank alike.

``FSDPStrategy`` (FSDP1) and ``DeepSpeedStrategy`` write their own files too
but are not routed: :func:`sharded_strategy` refuses them at ``setup``.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from registry.errors import InvalidStateError, UnsafePickleError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from registry.api import Registry

STATE_MODEL = "model"
STATE_REST = "lightning"  # the pickled parts of Lightning's checkpoint that are not plain data


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def sharded_strategy(strategy: object) -> bool:
    """Whether checkpoints under ``strategy`` are published collectively; raise for a strategy that cannot be.

    ``ModelParallelStrategy(save_distributed_checkpoint=False)`` would gather
    the whole model on rank 0 for each publish: refused, as are the strategies
    whose checkpoint files the registry does not write.
    """
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
    name = type(strategy).__name__
    if isinstance(strategy, ModelParallelStrategy):
        if not getattr(strategy, "_save_distributed_checkpoint", True):
            raise InvalidStateError(f"RegistryCheckpoint publishes sharded under {name}: construct it with "
                                    "save_distributed_checkpoint=True (the default)")
        return True
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
        raise InvalidStateError(f"RegistryCheckpoint cannot publish under {name}, which writes its own checkpoint "
                                "files; for sharded training use ModelParallelStrategy (FSDP2's fully_shard in "
                                "configure_model)")
    return False


def route_registry_paths(strategy: Any, *, save: Callable[[dict[str, Any], str, Any], None],
                         load: Callable[[str], dict[str, Any]], is_registry_path: Callable[[object], bool]) -> None:
    """Send the strategy's ``save_checkpoint`` / ``load_checkpoint`` for ``registry:`` paths to ``save`` / ``load``.

    Set on the strategy object, so the trainer's own ``save_checkpoint`` (which
    dumps Lightning's checkpoint on every rank) and ``fit(ckpt_path=...)``
    reach the registry; any other path goes to the strategy's own method.
    """
    cls = type(strategy)

    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if is_registry_path(filepath):
            save(checkpoint, filepath, storage_options)
        else:
            cls.save_checkpoint(strategy, checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if is_registry_path(checkpoint_path):
            return load(checkpoint_path)
        return cls.load_checkpoint(strategy, checkpoint_path, weights_only=weights_only)

    strategy.save_checkpoint = save_checkpoint
    strategy.load_checkpoint = load_checkpoint


def _pack(rest: Mapping[str, Any], *, trust_pickle: bool) -> bytes | str:
    """``rest`` pickled as ``torch.save`` does, or why a load without ``trust_pickle`` would refuse it."""
    from registry.fs.validation import check_extras
    try:
        check_extras({STATE_REST: dict(rest)}, trust_pickle=trust_pickle)
    except (UnsafePickleError, InvalidStateError) as exc:
        return f"{type(exc).__name__}:{exc}"
    out = io.BytesIO()
    torch.save(dict(rest), out)
    return out.getvalue()


def publish_checkpoint(registry: Registry, strategy: Any, *, run: str, step: int, checkpoint: dict[str, Any],
                       split: Callable[[Mapping[str, Any]], tuple[dict[str, Any], dict[str, Any]]],
                       meta_key: str, trust_pickle: bool, options: Mapping[str, Any]) -> None:
    """Publish Lightning's dumped ``checkpoint`` as ``run@step``, collectively (every rank calls it).

    ``split`` parts the checkpoint into (plain data, the rest); rank 0's rest
    is broadcast first, so every rank writes the same value and a rest that
    cannot be published raises on every rank before any file is written.
    """
    checkpoint = dict(checkpoint)
    state: dict[str, Any] = {STATE_MODEL: checkpoint.pop("state_dict", {})}
    for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[optimizer_key(index)] = optimizer_state
    plain, rest = split(checkpoint)
    packed = strategy.broadcast(_pack(rest, trust_pickle=trust_pickle) if strategy.is_global_zero else None)
    if isinstance(packed, str):
        kind, _, text = packed.partition(":")
        raise (UnsafePickleError if kind == UnsafePickleError.__name__ else InvalidStateError)(text)
    state[STATE_REST] = packed
    registry.publish(run, step, state, sharded=True, meta={meta_key: plain},
                     config=plain.get("hyper_parameters") or {}, epoch=int(checkpoint.get("epoch", 0)),
                     optimizer_step=int(checkpoint.get("global_step", step)), trust_pickle=trust_pickle,
                     **dict(options))


def load_checkpoint(registry: Registry, trainer: pl.Trainer, ref: str, *, meta_key: str,
                    trust_pickle: bool) -> tuple[dict[str, Any], int | None]:
    """Load ``ref`` into the trainer's model and optimizers on every rank; Lightning's checkpoint dict and the step.

    The dict holds the plain parts and the rest for Lightning to restore
    (loops, schedulers, callbacks, hyper-parameters); model and optimizers are
    already set, as the strategy's own ``load_checkpoint`` leaves them.
    """
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    strategy = trainer.strategy
    model = strategy.model
    assert model is not None and trainer.lightning_module is not None
    optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in strategy.optimizers]
    state: dict[str, Any] = {STATE_MODEL: get_model_state_dict(model), STATE_REST: b""}
    for index, optimizer in enumerate(optimizers):
        state[optimizer_key(index)] = get_optimizer_state_dict(model, optimizer)
    strict = bool(trainer.lightning_module.strict_loading)
    got = registry.load_into(ref, state, keys=sorted(state), strict=strict, trust_pickle=trust_pickle)
    set_model_state_dict(model, state[STATE_MODEL], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[optimizer_key(index)])
    where = f"{got.info.run}@{got.step}" if got.info is not None else ref
    try:
        rest = torch.load(io.BytesIO(state[STATE_REST]), weights_only=not trust_pickle) if state[STATE_REST] else {}
    except pickle.UnpicklingError:
        raise UnsafePickleError(f"the Lightning state of {where} needs full unpickling, which can run arbitrary "
                                "code; pass trust_pickle=True only if you trust its author") from None
    out: dict[str, Any] = dict(got.meta.get(meta_key) or {})
    out.update(rest)
    out["state_dict"] = state[STATE_MODEL]
    return out, got.step


__all__ = ["load_checkpoint", "publish_checkpoint", "route_registry_paths", "sharded_strategy"]
