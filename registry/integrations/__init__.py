"""The registry inside the trainers people already use.

- :mod:`registry.integrations.lightning`: a PyTorch Lightning callback that
  publishes, and a ``CheckpointIO`` plugin that resumes from
  ``ckpt_path="registry:RUN@latest"`` (extra ``registry[lightning]``).
- :mod:`registry.integrations.transformers`: a Hugging Face ``TrainerCallback``
  that publishes every save, and ``resume_from()`` for
  ``trainer.train(resume_from_checkpoint=...)`` (extra ``registry[transformers]``).

Each module imports its framework; importing ``registry`` imports neither.
They use only the public :class:`registry.Registry` API.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from registry.format.refs import METRIC_KEY_RE


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


__all__ = ["numeric_metrics"]
