"""The integrations say what matters and nothing else: no Trainer timings stored as metrics, a resume that names
what it resumed. (No Lightning notice per publish: tests/test_integration_lightning.py checks its runs' output.)"""

from __future__ import annotations

import logging

import pytest

from registry import Registry
from tests.helpers import make_state


def hf_callback(reg: Registry, **options: object):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    from registry.integrations.transformers import RegistryCallback
    return RegistryCallback(reg, "hf", **options)  # type: ignore[arg-type]


def evaluate(cb, step: int) -> None:  # type: ignore[no-untyped-def]
    from transformers import TrainerControl, TrainerState, TrainingArguments
    state = TrainerState(global_step=step)
    args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    cb.on_evaluate(args, state, TrainerControl(), metrics={
        "eval_loss": 0.5, "eval_accuracy": 0.9, "eval_runtime": 0.12, "eval_samples_per_second": 330.1,
        "eval_steps_per_second": 41.3, "epoch": 1.0})


def test_hf_callback_stores_no_trainer_timings_by_default(reg: Registry) -> None:
    reg.publish("hf", 2, make_state(2))
    evaluate(hf_callback(reg), 2)
    reg.flush("hf")
    assert {p.key for p in reg.metrics("hf")} == {"eval_loss", "eval_accuracy"}
    evaluate(hf_callback(reg, speed_metrics=True), 4)
    reg.flush("hf")
    assert "eval_runtime" in {p.key for p in reg.metrics("hf", history=True) if p.step == 4}


def test_hf_resume_says_what_it_resumed(reg: Registry, caplog: pytest.LogCaptureFixture) -> None:
    reg.publish("hf", 6, make_state(6))
    cb = hf_callback(reg)
    with caplog.at_level(logging.INFO, logger="registry.integrations.transformers"):
        path = cb.resume_from()
    assert path is not None and cb.checkout is not None
    cb.checkout.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "registry.integrations.transformers"]
    assert lines == ["resuming hf from hf@6 (verified; asked for hf@latest)"]
