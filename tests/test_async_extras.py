"""A background publish writes each ``.pt`` extra with only its own tensors (a trainer's optimizer and RNG state)."""

from __future__ import annotations

import os

import torch

from registry import Registry


def test_background_extras_hold_only_their_own_bytes_and_mixed_dtypes(sqlite_reg: Registry) -> None:
    weights = {"w": torch.ones(1 << 18)}  # 1 MiB that must not end up inside the extra's file
    extra = {"state": {"f": torch.arange(3.0), "u8": torch.arange(4, dtype=torch.uint8), "scalar": torch.tensor(7),
                       "empty": torch.zeros(0, 2)}}
    info = sqlite_reg.publish("run", 1, weights, extra=extra, blocking=False).result()
    blocking = sqlite_reg.publish("run", 2, weights, extra=extra)
    assert os.path.getsize(info.path / "state.pt") == os.path.getsize(blocking.path / "state.pt")
    back = sqlite_reg.load("run@1").extra["state"]
    for key, value in extra["state"].items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
