"""Every ref form, tags and policy versions, on SQLite and PostgreSQL (docs/reference/refs.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from registry import (CheckpointNotFoundError, CorruptCheckpointError, InvalidNameError, InvalidRefError,
                      Registry, parse_ref)
from registry.cli import main
from tests.helpers import assert_state_equal, make_state


def publish_steps(reg: Registry, losses: dict[int, float], *, run: str = "run") -> None:
    for step, loss in losses.items():
        reg.publish(run, step, make_state(step), metrics={"eval/loss": loss}, policy_version=step // 10)


def test_every_ref_form(reg: Registry) -> None:
    publish_steps(reg, {10: 3.0, 20: 1.0, 30: 2.0})
    reg.publish("run", 40, make_state(40), metrics={"eval/loss": 5.0}, verify=False)
    reg.tag("run", 20, "release")
    expected = {"run": 30, "run@latest": 30, "run@latest-published": 40, "run@10": 10, "run@release": 20,
                "run@best:eval/loss": 20, "run@best:eval/loss:min": 20, "run@best:eval/loss:max": 40}
    assert {ref: reg.resolve(ref).step for ref in expected} == expected
    for ref, step in expected.items():
        ckpt = reg.load(ref, verify=True)
        assert ckpt.step == step, ref
        assert_state_equal(ckpt.state_dict, make_state(step))
    info = reg.resolve("run@release")
    assert info.tags == ("release",) and info.metrics == {"eval/loss": 1.0} and info.status == "verified"


def test_status_reads_as_the_plain_string(reg: Registry) -> None:
    reg.publish("run", 10, make_state(10))
    info = reg.resolve("run@10")
    assert info.status == "verified" and str(info.status) == f"{info.status:>8}" == "verified"
    assert {"verified": 1}[info.status] == 1 and info.status.upper() == "VERIFIED"
    doc = info.to_json()
    assert type(doc["status"]) is str and json.loads(json.dumps(doc))["status"] == "verified"


def test_best_ties_go_to_the_newest_step(reg: Registry) -> None:
    publish_steps(reg, {10: 1.0, 20: 0.5, 30: 0.5, 40: 2.0, 50: 2.0, 60: 0.7})
    assert reg.resolve("run@best:eval/loss").step == 30
    assert reg.resolve("run@best:eval/loss:max").step == 50


def test_metrics_at_steps_without_checkpoints_never_resolve(reg: Registry) -> None:
    publish_steps(reg, {10: 1.0, 20: 2.0})
    reg.log_metrics("run", 15, {"eval/loss": 0.1, "train/loss": 0.3}, flush=True)
    reg.log_metrics("run", 25, {"eval/loss": 9.0})
    reg.flush()
    assert reg.resolve("run@best:eval/loss").step == 10
    assert reg.resolve("run@best:eval/loss:max").step == 20
    with pytest.raises(CheckpointNotFoundError, match="train/loss"):
        reg.resolve("run@best:train/loss")
    assert {(p.step, p.key) for p in reg.metrics("run")} >= {(15, "train/loss"), (25, "eval/loss")}


def test_deleted_and_corrupt_steps_never_resolve_for_latest_and_best(reg: Registry) -> None:
    publish_steps(reg, {10: 0.1, 20: 0.2, 30: 0.3, 40: 0.4})
    reg.catalog.set_status("run", 40, "corrupt", kind="corrupt")
    reg.catalog.set_status("run", 10, "deleted", kind="delete")
    assert reg.resolve("run@latest").step == 30
    assert reg.resolve("run@latest-published").step == 30
    assert reg.resolve("run@best:eval/loss").step == 20
    assert reg.resolve("run@best:eval/loss:max").step == 30
    with pytest.raises(CheckpointNotFoundError, match="step 10 is deleted"):
        reg.resolve("run@10")
    # A corrupt step named exactly resolves (to be shown, re-verified) but never loads.
    assert reg.resolve("run@40").status == "corrupt"
    with pytest.raises(CorruptCheckpointError):
        reg.load("run@40")
    for step in (20, 30):
        reg.catalog.set_status("run", step, "deleted", kind="delete")
    with pytest.raises(CheckpointNotFoundError, match="no verified checkpoint"):
        reg.resolve("run@latest")
    with pytest.raises(CheckpointNotFoundError, match="eval/loss"):
        reg.resolve("run@best:eval/loss")


def test_staging_and_failed_steps_do_not_resolve(reg: Registry) -> None:
    publish_steps(reg, {10: 1.0})
    reg.catalog.claim("run", 20, path="run/step-00000020", writer="elsewhere:1", overwrite=False)
    claim = reg.catalog.claim("run", 30, path="run/step-00000030", writer="elsewhere:1", overwrite=False)
    reg.catalog.abort_claim(claim, reason="test", old_payload_intact=False)
    reg.log_metrics("run", 20, {"eval/loss": 0.0}, flush=True)
    with pytest.raises(CheckpointNotFoundError, match="step 20 is staging"):
        reg.resolve("run@20")
    with pytest.raises(CheckpointNotFoundError, match="step 30 is failed"):
        reg.resolve("run@30")
    assert reg.resolve("run@latest-published").step == 10
    assert reg.resolve("run@best:eval/loss").step == 10


def test_tag_moves_are_recorded(reg: Registry) -> None:
    publish_steps(reg, {10: 1.0, 20: 2.0})
    reg.tag("run", 10, "release")
    reg.tag("run", 10, "release")  # no move, no event
    reg.tag("run", 20, "release")
    assert reg.resolve("run@release").step == 20
    assert reg.resolve("run@10").tags == ()
    moves = [(e.kind, e.detail.get("old_step"), e.detail.get("new_step"), e.step) for e in reg.events("run")
             if e.kind in ("tag", "untag")]
    assert moves == [("tag", None, 10, 10), ("tag", 10, 20, 20)]
    assert all(e.created_at is not None for e in reg.events("run"))
    reg.untag("run", "release")
    with pytest.raises(CheckpointNotFoundError, match="no tag 'release'"):
        reg.resolve("run@release")
    last = reg.events("run")[-1]
    assert (last.kind, last.detail["old_step"], last.step) == ("untag", 20, 20)
    with pytest.raises(CheckpointNotFoundError):
        reg.untag("run", "release")
    with pytest.raises(CheckpointNotFoundError, match="no published checkpoint"):
        reg.tag("run", 15, "release")


def test_tag_on_a_step_deleted_later(reg: Registry) -> None:
    publish_steps(reg, {10: 1.0, 20: 2.0})
    reg.tag("run", 10, "keep")
    reg.catalog.set_status("run", 10, "deleted", kind="delete")
    with pytest.raises(CheckpointNotFoundError, match="step 10 is deleted"):
        reg.resolve("run@keep")
    with pytest.raises(CheckpointNotFoundError):
        reg.tag("run", 10, "other")
    reg.tag("run", 20, "keep")  # moving it to a live step makes it resolve again
    assert reg.resolve("run@keep").step == 20


BAD_TAGS = ["latest", "latest-published", "123", "0", "a@b", "a:b", "", "-x", "a b", "x" * 129, 7, None]


def test_reserved_and_invalid_tag_names(reg: Registry) -> None:
    publish_steps(reg, {10: 1.0})
    for name in BAD_TAGS:
        with pytest.raises(InvalidNameError):
            reg.tag("run", 10, name)  # type: ignore[arg-type]
        with pytest.raises(InvalidNameError):
            reg.publish("run", 20, make_state(2), tags=[name])  # type: ignore[list-item]
    assert [i.tags for i in reg.checkpoints("run")] == [()]
    assert [e.kind for e in reg.events("run")] == ["publish"]


@pytest.mark.parametrize("ref", ["run@a:b", "run@best:", "run@best::max", "run@", "@10", "run@x@y",
                                 "run@99999999999999999999", "run@latest:x", "run@-1"])
def test_invalid_refs(ref: str) -> None:
    with pytest.raises(InvalidRefError):
        parse_ref(ref)


def test_unknown_run_and_step(reg: Registry) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no run named"):
        reg.resolve("ghost@latest")
    publish_steps(reg, {10: 1.0})
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at step 11"):
        reg.resolve("run@11")
    with pytest.raises(CheckpointNotFoundError, match="no tag"):
        reg.resolve("run@nothing")


def test_policy_versions(reg: Registry) -> None:
    for step, version in ((10, 1), (20, 1), (30, 2), (40, None)):
        reg.publish("run", step, make_state(step), policy_version=version)
    reg.publish("run", 50, make_state(50), policy_version=3, verify=False)
    assert [i.step for i in reg.checkpoints("run", policy_version=1)] == [10, 20]
    assert reg.latest("run").step == 40
    assert reg.latest("run", min_policy_version=1).step == 30
    assert reg.latest("run", min_policy_version=3, published=True).step == 50
    with pytest.raises(CheckpointNotFoundError, match="policy version >= 3"):
        reg.latest("run", min_policy_version=3)
    with pytest.raises(InvalidNameError):
        reg.latest("run", min_policy_version=-1)


def test_cli_show_metrics_tags(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        publish_steps(reg, {10: 1.0, 20: 0.5})
        reg.log_metrics("run", 20, {"eval/acc": 0.9}, flush=True)
    runner = CliRunner()

    def cli(*args: str):  # type: ignore[no-untyped-def]
        return runner.invoke(main, ["--url", catalog_url, "--root", str(root), *args], catch_exceptions=False)

    assert cli("tag", "run", "10", "release").exit_code == 0
    assert cli("tag", "run", "20", "release").exit_code == 0
    doc = json.loads(cli("show", "run@best:eval/loss", "--json").output)
    assert doc["step"] == 20 and doc["tags"] == ["release"] and doc["status"] == "verified"
    assert doc["metrics"] == {"eval/acc": 0.9, "eval/loss": 0.5}
    assert doc["manifest"]["tensors"] == len(make_state(0)) and doc["manifest"]["format_version"] == 1
    assert doc["total_bytes"] == sum(f["size"] for f in doc["files"]) + len(
        (root / "run" / "step-00000020" / "manifest.json").read_bytes())
    tag_events = [e["detail"] for e in doc["events"] if e["kind"] == "tag"]
    assert tag_events == [{"tag": "release", "old_step": 10, "new_step": 20}]
    text = cli("show", "run@release").output
    assert "release" in text and "eval/acc=0.9" in text and "manifest: format 1" in text
    assert "release" in cli("ls", "run").output
    assert [c["step"] for c in json.loads(cli("ls", "run", "--policy-version", "1", "--json").output)] == [10]
    points = json.loads(cli("metrics", "run", "--key", "eval/loss", "--json").output)
    assert [(p["step"], p["value"], p["current"]) for p in points] == [(10, 1.0, True), (20, 0.5, True)]
    for bad in (["tag", "run", "10", "latest"], ["tag", "run", "10", "12"], ["untag", "run", "nope"],
                ["show", "run@best:nope"]):
        result = cli(*bad)
        assert result.exit_code == 1 and result.output.startswith("registry: error:"), (bad, result.output)
    for ref, step in (("run@best:eval/loss:max", 10), ("run@latest-published", 20), ("run@release", 20),
                      ("run@10", 10), ("run", 20)):
        assert cli("resolve", ref).output.strip() == str(root.absolute() / "run" / f"step-{step:08d}"), ref
    assert json.loads(cli("verify", "run@release", "--json").output)[0]["step"] == 20
    assert cli("untag", "run", "release").exit_code == 0


def test_a_resolve_on_the_sqlite_driver_reads_what_sqlalchemy_reads(sqlite_reg: Registry) -> None:
    """The load's resolve runs its statements on the driver connection; every kind of ref reads the same
    record through SQLAlchemy (timestamps converted back, metrics, tags), and a ref that finds nothing
    is explained as SQLAlchemy's read explains it."""
    from registry.format.refs import parse_ref
    catalog = sqlite_reg.catalog
    assert catalog._driver_reads is not None
    for step in (1, 2, 3):
        sqlite_reg.publish("r", step, {"w": torch.full((2,), float(step))}, metrics={"loss": 1.0 / step,
                           "acc": step / 10}, tags=["keep"] if step == 2 else [], policy_version=step)
    for text in ("r@latest", "r@latest-published", "r@2", "r@keep", "r@best:loss", "r@best:acc:max"):
        ref = parse_ref(text)
        via_driver = catalog.resolve(ref)
        via_sqlalchemy = catalog.read(lambda conn, ref=ref: catalog._resolve_in(conn, ref, below=None,
                                                                                 min_policy_version=None))
        assert via_driver == via_sqlalchemy, text
        assert via_driver.created_at.tzinfo is not None and via_driver.verified_at is not None
    assert catalog.resolve(parse_ref("r@latest"), below=3).step == 2
    assert catalog.resolve(parse_ref("r@latest"), min_policy_version=3).step == 3
    with pytest.raises(CheckpointNotFoundError, match=r"no tag 'kepe'; did you mean r@keep\?"):
        catalog.resolve(parse_ref("r@kepe"))


def test_a_driver_read_refuses_a_list_that_varies_per_call(sqlite_reg: Registry) -> None:
    """An IN list whose values the caller gives could expand to another length at every call, so a driver
    statement (its SQL built once) refuses it rather than bind a stale expansion."""
    from sqlalchemy import bindparam, select

    from registry.catalog.models import CheckpointRow
    steps = select(CheckpointRow.c.step).where(CheckpointRow.c.step.notin_(bindparam("skip", expanding=True)))
    sqlite_reg.publish("r", 1, {"w": torch.zeros(3)})
    driver = sqlite_reg.catalog._driver_reads
    assert driver is not None
    with pytest.raises(TypeError, match=r"cannot bind a list given per call \(skip\)"):
        driver.run(lambda conn: conn.execute(steps, {"skip": [1, 2]}))
