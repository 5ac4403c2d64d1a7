"""Metrics aligned with publication, late metrics and resume semantics, on SQLite and PostgreSQL."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from registry import CheckpointNotFoundError, InvalidStateError, Registry
from tests.helpers import make_state


def run_child(catalog_url: str, root: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh Python process with ``reg`` open on the same catalog and root."""
    script = textwrap.dedent("""
        import sys, torch
        from registry import Registry
        from registry.crashpoints import arm
        reg = Registry.open(url=sys.argv[1], root=sys.argv[2])
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script, catalog_url, str(root)], capture_output=True,
                          text=True, timeout=300)


def current(reg: Registry, key: str | None = None) -> dict[tuple[int, str], float]:
    return {(p.step, p.key): p.value for p in reg.metrics("run", key)}


@pytest.mark.usefixtures("migrated_url")
def test_crash_leaves_no_metrics_for_an_unpublished_step(catalog_url: str, root: Path) -> None:
    child = run_child(catalog_url, root, """
        reg.log_metrics("run", 5, {"train/loss": 5.0})
        reg.publish("run", 10, {"w": torch.zeros(2)})
        reg.log_metrics("run", 15, {"train/loss": 1.5})
        reg.log_metrics("run", 20, {"train/loss": 2.0})
        arm("after-write")
        reg.publish("run", 20, {"w": torch.ones(2)}, metrics={"eval/loss": 0.1})
    """)
    assert child.returncode == -signal.SIGKILL, child.stderr
    with Registry.open(url=catalog_url, root=root) as reg:
        assert current(reg) == {(5, "train/loss"): 5.0}
        assert reg.resolve("run@latest-published").step == 10
        with pytest.raises(CheckpointNotFoundError):
            reg.resolve("run@best:eval/loss")


def test_late_metrics_from_another_process_change_best(reg: Registry, catalog_url: str, root: Path) -> None:
    reg.publish("run", 10, make_state(10), metrics={"eval/loss": 2.0})
    reg.publish("run", 20, make_state(20), metrics={"eval/loss": 1.0})
    assert reg.resolve("run@best:eval/loss").step == 20
    child = run_child(catalog_url, root, """
        ckpt = reg.load("run@10")
        reg.log_metrics("run", ckpt.step, {"eval/loss": 0.5, "eval/acc": 0.75}, flush=True)
        print(reg.resolve("run@best:eval/loss").step)
        reg.close()
    """)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "10"
    assert reg.resolve("run@best:eval/loss").step == 10
    assert reg.resolve("run@10").metrics == {"eval/loss": 0.5, "eval/acc": 0.75}
    history = [p for p in reg.metrics("run", "eval/loss", history=True) if p.step == 10]
    assert [(p.value, p.current) for p in history] == [(2.0, False), (0.5, True)]
    assert history[0].attempt != history[1].attempt
    # The evaluator loaded step 10 but never published: it superseded nothing else.
    assert current(reg, "eval/loss") == {(10, "eval/loss"): 0.5, (20, "eval/loss"): 1.0}


def test_flush_and_publish_boundaries(reg: Registry, catalog_url: str, root: Path) -> None:
    reg.log_metrics("run", 10, {"train/loss": 3.0})
    reg.log_metrics("run", 10, {"train/loss": 2.5})  # newer point for the same step wins
    reg.log_metrics("run", 30, {"train/loss": 1.0})
    reg.publish("run", 20, make_state(20))
    with Registry.open(url=catalog_url, root=root) as other:
        assert current(other) == {(10, "train/loss"): 2.5}
        assert [(p.value, p.current) for p in other.metrics("run", history=True)] == [(2.5, True)]
    reg.flush("run")
    assert current(reg) == {(10, "train/loss"): 2.5, (30, "train/loss"): 1.0}


BAD_VALUES = [float("nan"), float("-inf"), 10**400, "1.0", None, True, np.bool_(True), torch.tensor(float("nan")),
              torch.tensor([1.0, 2.0]), torch.tensor(True), complex(1, 0), [1.0]]


def test_bad_values_are_clear_errors_and_buffer_nothing(reg: Registry) -> None:
    for bad in BAD_VALUES:
        with pytest.raises(InvalidStateError, match="'loss'"):
            reg.log_metrics("run", 1, {"ok": 1.0, "loss": bad})
        with pytest.raises(InvalidStateError, match="'loss'"):
            reg.publish("run", 1, make_state(1), metrics={"loss": bad})
    reg.flush()
    with pytest.raises(CheckpointNotFoundError):
        reg.metrics("run")


def test_numeric_scalars_are_accepted(reg: Registry) -> None:
    reg.log_metrics("run", 1, {"a": np.float32(0.5), "b": np.int64(3), "c": torch.tensor(0.25),
                               "d": Fraction(1, 4), "e": 7}, flush=True)
    assert current(reg) == {(1, "a"): 0.5, (1, "b"): 3.0, (1, "c"): 0.25, (1, "d"): 0.25, (1, "e"): 7.0}


@pytest.mark.usefixtures("migrated_url")
def test_resume_supersedes_the_dead_attempts_later_points(catalog_url: str, root: Path) -> None:
    dead = Registry.open(url=catalog_url, root=root)
    for step, loss in ((10, 3.0), (20, 2.0), (30, 0.5)):
        dead.log_metrics("run", step - 5, {"train/loss": loss + 1})
        dead.publish("run", step, make_state(step), metrics={"eval/loss": loss})
    dead.log_metrics("run", 35, {"train/loss": 0.1}, flush=True)
    dead.catalog.close()  # the trainer dies here: no flush, no goodbye

    with Registry.open(url=catalog_url, root=root) as evaluator:
        evaluator.load("run@20")
        evaluator.log_metrics("run", 20, {"eval/acc": 0.9}, flush=True)
        assert evaluator.resolve("run@best:eval/loss").step == 30  # evaluators never supersede

    with Registry.open(url=catalog_url, root=root) as trainer:
        trainer.load("run@10", resume=True)  # resuming from a named step says so
        trainer.log_metrics("run", 15, {"train/loss": 2.2})
        assert trainer.resolve("run@best:eval/loss").step == 30  # nothing changes before the first publish
        trainer.publish("run", 20, make_state(21), metrics={"eval/loss": 1.5}, overwrite=True)
        assert current(trainer) == {(5, "train/loss"): 4.0, (10, "eval/loss"): 3.0,
                                    (15, "train/loss"): 2.2, (20, "eval/loss"): 1.5}
        # Step 30 of the dead attempt is still there but no longer ranks.
        assert trainer.resolve("run@best:eval/loss").step == 20
        assert trainer.resolve("run@30").metrics == {}
        history = {(p.step, p.key): p for p in trainer.metrics("run", history=True) if not p.current}
        assert set(history) == {(15, "train/loss"), (20, "eval/loss"), (20, "eval/acc"), (25, "train/loss"),
                                (30, "eval/loss"), (35, "train/loss")}
        # Loading again after publishing does not move the resume point.
        trainer.load("run@10")
        trainer.publish("run", 40, make_state(40), metrics={"eval/loss": 1.0})
        assert current(trainer, "eval/loss") == {(10, "eval/loss"): 3.0, (20, "eval/loss"): 1.5,
                                                 (40, "eval/loss"): 1.0}
        resumes = [e.detail for e in trainer.events("run") if e.kind == "resume"]
        assert [(d["resumed_from"], d["superseded_points"]) for d in resumes] == [(10, 6)]


def test_begin_attempt_without_loading(reg: Registry, catalog_url: str, root: Path) -> None:
    for step, loss in ((10, 1.0), (20, 0.2)):
        reg.publish("run", step, make_state(step), metrics={"eval/loss": loss})
    with Registry.open(url=catalog_url, root=root) as trainer:
        first = trainer.begin_attempt("run", resumed_from=10)
        trainer.publish("run", 15, make_state(15), metrics={"eval/loss": 0.9})
        assert trainer.resolve("run@best:eval/loss").step == 15
        points = trainer.metrics("run", "eval/loss")
        assert [(p.step, p.attempt) for p in points] == [(10, points[0].attempt), (15, first)]
        assert points[0].attempt != first
        second = trainer.begin_attempt("run", resumed_from=None)  # a fresh start supersedes nothing
        assert second != first
        trainer.publish("run", 16, make_state(16), metrics={"eval/loss": 0.8})
        assert trainer.resolve("run@best:eval/loss").step == 16
        assert len(trainer.metrics("run", "eval/loss")) == 3


def test_overwrite_supersedes_other_attempts_scores_of_the_old_weights(reg: Registry, catalog_url: str,
                                                                      root: Path) -> None:
    reg.publish("run", 10, make_state(10), metrics={"eval/loss": 1.0})
    with Registry.open(url=catalog_url, root=root) as evaluator:
        evaluator.log_metrics("run", 10, {"eval/acc": 0.5}, flush=True)
    reg.log_metrics("run", 10, {"train/loss": 2.0}, flush=True)
    reg.publish("run", 10, make_state(11), overwrite=True)
    # the old weights' own score goes too; the trainer's point logged after that publish is for the new ones
    assert reg.resolve("run@10").metrics == {"train/loss": 2.0}


@pytest.mark.usefixtures("migrated_url")
def test_racing_writers_leave_one_current_point(catalog_url: str, root: Path) -> None:
    """Two processes' worth of writers (own Registry, own connections) log the same (step, key) at once."""
    import threading

    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def writer(offset: int) -> None:
        try:
            with Registry.open(url=catalog_url, root=root) as reg:
                for i in range(15):
                    barrier.wait()  # every write overlaps the other thread's
                    reg.log_metrics("run", 1, {"eval/loss": float(offset + i)}, flush=True)
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the test thread
            errors.append(exc)

    with Registry.open(url=catalog_url, root=root) as reg:
        reg.log_metrics("run", 0, {"x": 0.0}, flush=True)  # the run exists before the race
        threads = [threading.Thread(target=writer, args=(offset,)) for offset in (0, 100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        history = reg.metrics("run", "eval/loss", history=True)
        assert len(history) == 30
        assert len([p for p in history if p.current]) == 1
