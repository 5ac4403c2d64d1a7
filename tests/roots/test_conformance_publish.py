"""Conformance, publishing and reading: the same cases, the same answers, on a directory, an ``s3://`` and a
tiered root, each on SQLite and PostgreSQL (see ``tests/roots/conftest.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from registry import Registry
from registry.errors import (CheckpointNotFoundError, InvalidNameError, InvalidRefError, InvalidStateError,
                             RegistryError, StepExistsError)
from registry.records import Status
from tests import s3proxy
from tests.helpers import assert_state_equal, make_state
from tests.roots.kinds import (WEIGHTS, Copy, Kind, copies, failing_weights_write, one_line_registry_error, orphans,
                               present, read_copy, rows, settle, stored)


def test_publish_load_round_trip_and_every_ref_form(kind: Kind, kind_reg: Registry) -> None:
    reg = kind_reg
    sd = make_state(1)
    moment = torch.arange(6, dtype=torch.float32)
    extra = {"optimizer": {"lr": 0.25, "moment": moment}}
    first = reg.publish("run", 10, sd, extra=extra, config={"width": 8, "act": "gelu"}, meta={"note": "first"},
                        metrics={"loss": 0.5, "acc": 0.7}, epoch=2, consumed_samples=640, tags=("release",))
    assert first.status == Status.VERIFIED and first.tags == ("release",)
    reg.publish("run", 20, make_state(2), metrics={"loss": 0.3, "acc": 0.6})
    reg.publish("run", 30, make_state(3), metrics={"loss": 0.4, "acc": 0.9}, verify=False)
    reg.publish("other", 1, make_state(4))

    refs = {"run@latest": 20, "run": 20, "run@latest-published": 30, "run@10": 10, "run@release": 10,
            "run@best:loss": 20, "run@best:loss:max": 10, "run@best:acc:max": 30, "run@best:acc": 20}
    assert {ref: reg.resolve(ref).step for ref in refs} == refs
    assert [(i.step, i.status) for i in reg.checkpoints("run")] == [
        (10, Status.VERIFIED), (20, Status.VERIFIED), (30, Status.PUBLISHED)]
    assert [r.name for r in reg.runs()] == ["other", "run"]
    assert [(m.step, m.key, m.value) for m in reg.metrics("run", key="loss")] == [(10, "loss", 0.5), (20, "loss", 0.3),
                                                                                  (30, "loss", 0.4)]
    settle(reg, "run")
    with kind.open() as second:  # another process's registry on the same root and catalog reads the same
        for opened in (reg, second):
            ck = opened.load("run@release")
            assert ck.step == 10 and ck.epoch == 2 and ck.consumed_samples == 640
            assert_state_equal(ck.state_dict, sd)
            assert ck.extra["optimizer"]["lr"] == 0.25
            assert torch.equal(ck.extra["optimizer"]["moment"], moment)
            assert ck.config == {"width": 8, "act": "gelu"} and ck.meta["note"] == "first"
            assert ck.info is not None and ck.info.metrics == {"loss": 0.5, "acc": 0.7}
            assert ck.info.tags == ("release",)
            assert_state_equal(opened.load("run@latest-published").state_dict, make_state(3))


def test_hostile_input_gets_the_same_one_line_error_and_changes_nothing(kind_reg: Registry) -> None:
    reg = kind_reg
    reg.publish("run", 1, make_state(1), metrics={"loss": 1.0}, tags=("release",))
    settle(reg, "run")
    before_rows, before_stored, before_events = rows(reg), stored(reg), len(reg.events())
    cases = [
        (InvalidRefError, lambda: reg.resolve("run@")),
        (InvalidRefError, lambda: reg.load("run@best:")),
        (InvalidRefError, lambda: reg.resolve("run@latest@1")),
        (StepExistsError, lambda: reg.publish("run", 1, make_state(9))),
        (InvalidNameError, lambda: reg.publish("..", 2, make_state(2))),
        (InvalidNameError, lambda: reg.publish("../escape", 2, make_state(2))),
        (InvalidNameError, lambda: reg.publish("run/../../escape", 2, make_state(2))),
        (InvalidStateError, lambda: reg.publish("run", 2, {"w": [1.0, 2.0]})),  # type: ignore[dict-item]
        (InvalidStateError, lambda: reg.publish("run", 2, {"w": torch.zeros(2), "name": "not a tensor"})),  # type: ignore[dict-item]
    ]
    for expected, call in cases:
        with pytest.raises(RegistryError) as caught:
            call()
        assert isinstance(caught.value, expected), (expected, caught.value)
        one_line_registry_error(caught.value)
    assert rows(reg) == before_rows
    assert stored(reg) == before_stored
    assert len(reg.events()) == before_events
    assert_state_equal(reg.load("run@release").state_dict, make_state(1))


def test_overwrite_loads_the_new_payload_and_the_old_one_leaves_storage(kind_reg: Registry) -> None:
    reg = kind_reg
    reg.publish("run", 1, make_state(1), metrics={"loss": 1.0})
    reg.publish("run", 2, make_state(2))
    settle(reg, "run")
    old = reg.resolve("run@1")
    old_copies = copies(reg, old)
    old_manifests = {str(c): read_copy(reg, c, "manifest.json") for c in old_copies}
    new = reg.publish("run", 1, make_state(11), overwrite=True, metrics={"loss": 0.1})
    assert new.manifest_sha256 != old.manifest_sha256

    def old_payload_gone(copy: Copy) -> bool:
        # a directory root reuses the step's directory: it must hold the new payload only
        return not present(reg, copy) or read_copy(reg, copy, "manifest.json") != old_manifests[str(copy)]
    # the copy the publish replaced goes at its commit; a tiered root's durable copy is replaced when the new
    # payload's durable copy commits (the replicator deletes the old prefix then)
    replaced = [c for c in old_copies if not (reg.root.can.tiers and c.prefix is not None)]
    assert replaced and [str(c) for c in replaced if not old_payload_gone(c)] == []
    assert_state_equal(reg.load("run@1").state_dict, make_state(11))
    settle(reg, "run")
    assert [str(c) for c in old_copies if not old_payload_gone(c)] == []
    assert reg.resolve("run@1").metrics == {"loss": 0.1}
    assert reg.resolve("run@latest").step == 2
    assert orphans(reg, "run") == []
    assert reg.fsck(checksums=True).clean


def test_a_publish_failing_midway_leaves_a_failed_row_and_the_next_one_succeeds(
        kind: Kind, kind_reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = kind_reg
    reg.publish("run", 1, make_state(1))
    settle(reg, "run")
    before = stored(reg)
    if reg.root.local_dir is not None:  # a directory root, or a tiered root's fast tier: the disk fills up
        with failing_weights_write(reg, monkeypatch) as hit, pytest.raises(RegistryError) as caught:
            reg.publish("run", 2, make_state(2))
        assert hit, "the weights were never written: the fault was not injected"
    else:  # the server refuses the PUT of the weights (after the files before them were stored)
        assert reg.objects is not None
        with s3proxy.running(os.environ["AWS_ENDPOINT_URL"]) as proxy:
            proxy.deny = lambda seen: seen.method in ("PUT", "POST") and seen.path.endswith(f"/{WEIGHTS}")
            options = {"endpoint": proxy.endpoint, "max_retries": 1, "retry_timeout": 5}
            with kind.open(storage_options=options) as bad, pytest.raises(RegistryError) as caught:
                bad.publish("run", 2, make_state(2))
            assert proxy.count(lambda seen: seen.method == "PUT" and seen.path.endswith("meta.json")) == 1
    one_line_registry_error(caught.value)
    row = reg.catalog.get("run", 2)
    assert row is not None and row.status == Status.FAILED
    assert reg.resolve("run@latest").step == 1 and reg.resolve("run@latest-published").step == 1
    with pytest.raises(CheckpointNotFoundError):
        reg.resolve("run@2")
    assert stored(reg) == before  # nothing of the failed attempt is left
    again = reg.publish("run", 2, make_state(22))
    assert again.status == Status.VERIFIED
    settle(reg, "run")
    assert_state_equal(reg.load("run@latest").state_dict, make_state(22))
    assert orphans(reg, "run") == []
    assert reg.fsck(checksums=True).clean
