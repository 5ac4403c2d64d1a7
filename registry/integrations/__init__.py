"""The registry inside the trainers people already use.

- :mod:`registry.integrations.lightning`: a PyTorch Lightning callback that
  publishes, and a ``CheckpointIO`` plugin that resumes from
  ``ckpt_path="registry:RUN@latest"`` (extra ``checkpoint-registry[lightning]``);
  under ``ModelParallelStrategy`` (FSDP2) every rank publishes and resumes its
  own shard (:mod:`registry.integrations.lightning_sharded`).
- :mod:`registry.integrations.transformers`: a Hugging Face ``TrainerCallback``
  that publishes every save, and ``resume_from()`` for
  ``trainer.train(resume_from_checkpoint=...)`` (extra ``checkpoint-registry[transformers]``).

Each module imports its framework; importing ``registry`` imports neither.
They use only the public :class:`registry.Registry` API.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from registry.format.refs import METRIC_KEY_RE

if TYPE_CHECKING:
    from registry.api import Registry
    from registry.errors import CheckpointNotFoundError


def numeric_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """The finite numbers among a framework's logged values (tensors of one element included).

    Frameworks log strings, lists and NaNs beside the numbers; the catalog
    ranks only finite numbers under plain names, so the rest is left out rather
    than refused.
    """
    out: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        if hasattr(value, "numel") and hasattr(value, "item"):
            if value.numel() != 1:
                continue
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        number = float(value)
        if math.isfinite(number) and METRIC_KEY_RE.fullmatch(str(key)):
            out[str(key)] = number
    return out


def has_checkpoint(registry: Registry, run: str) -> bool:
    """Whether ``run`` has a step with a payload to resume from (or to fail loudly on, when corrupt).

    A fresh run has none, and so has one whose only publishes failed or were
    interrupted (a ``staging`` row): both start from scratch.
    """
    from registry.errors import CheckpointNotFoundError
    from registry.records import HAS_PAYLOAD
    try:
        return any(info.status in HAS_PAYLOAD for info in registry.checkpoints(run))
    except CheckpointNotFoundError:  # no such run yet
        return False


def nothing_to_resume(registry: Registry, run: str) -> CheckpointNotFoundError:
    """The refusal of a resume that must find a step (``create=False``): a wrong root or run, not a fresh start."""
    from registry.errors import CheckpointNotFoundError
    return CheckpointNotFoundError(
        f"run {run!r} has no checkpoint to resume from in checkpoint root {registry.root_url}: a wrong root "
        "or run name? (create=True starts a new run instead)")


__all__ = ["has_checkpoint", "nothing_to_resume", "numeric_metrics"]
