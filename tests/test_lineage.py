"""Lineage: resumes after kills, forks across runs, imports, and what retention does with them.

On both backends. A kill is a real SIGKILL of a child publisher at a named
crashpoint; the survivor resumes, and the chain must say from where.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from registry import Checkpoint, Registry
from registry.catalog.lineage import LineageCatalog
from registry.crashpoints import arm
from registry.retention import KeepLast
from tests.helpers import make_state
from tests.killharness import context, settle, worker_url
from tests.s3server import aws_env


def _killed_publisher(url: str, root: str, env: dict[str, str]) -> None:
    """In a forkserver child: publish steps 1-3, then die with step 4 in place (renamed, or every object
    uploaded on an ``s3://`` root) but not committed. ``env`` holds an s3:// root's credentials: the
    forkserver's environment predates the test's."""
    os.environ.update(env)
    with Registry.open(url=url, root=root) as reg:
        for step in (1, 2, 3):
            reg.publish("run", step, make_state(step))
        arm("after-write" if root.startswith("s3://") else "after-rename")
        reg.publish("run", 4, make_state(4))


def hops(reg: Registry, ref: str) -> list[tuple[str, str, str]]:
    return [(h.ref, h.how, h.status) for h in reg.lineage(ref)]


def test_resume_chain_after_kills(catalog_url: str, any_root: str) -> None:
    root = any_root
    child = context().Process(target=_killed_publisher, args=(worker_url(catalog_url), str(root), aws_env()))
    child.start()
    child.join()
    assert child.exitcode == -9
    with Registry.open(url=catalog_url, root=root) as reg:
        settle(reg)
        reg.fsck(repair=True)  # the killed step 4 rolls forward; its dead writer's attempt says where from
        killed = reg.lineage("run@4")
        assert [(h.ref, h.how) for h in killed] == [("run@4", "started")]
        assert killed[0].attempt is not None and killed[0].attempt == reg.lineage("run@3")[0].attempt
        ckpt = reg.load("run@3", resume=True)  # the survivor resumes from 3 and publishes over 4
        assert ckpt.step == 3
        reg.publish("run", 4, make_state(40), overwrite=True)
        reg.publish("run", 5, make_state(5))
        assert hops(reg, "run@5") == [("run@5", "resumed", "verified"), ("run@3", "started", "verified")]
        first_writer = reg.lineage("run@3")[0].attempt
        assert reg.lineage("run@5")[0].attempt != first_writer
        # a second crash: resume from 2 this time
        reg.begin_attempt("run", resumed_from=2)
        reg.publish("run", 3, make_state(30), overwrite=True)
        chain = reg.lineage("run@3")
        assert [(h.ref, h.how) for h in chain] == [("run@3", "resumed"), ("run@2", "started")]
        # run@5 came from the old payload of step 3, which is gone now: it says so, and goes no further
        old = reg.lineage("run@5")
        assert [h.ref for h in old] == ["run@5"] and old[0].parent_replaced
        assert (old[0].parent_run, old[0].parent_step) == ("run", 3)
        assert reg.descendants("run@2", forks_only=False)[0].ref == "run@3"


def test_fork_across_runs_retention_and_deleted_parent(any_reg: Registry) -> None:
    for step in (1, 2, 3):
        any_reg.publish("base", step, make_state(step))
    any_reg.begin_attempt("ft", fork_from="base@1")
    any_reg.publish("ft", 10, make_state(10))
    any_reg.publish("ft", 20, make_state(20))
    assert hops(any_reg, "ft@20") == [("ft@20", "forked", "verified"), ("base@1", "started", "verified")]
    assert [h.ref for h in any_reg.descendants("base@1")] == ["ft@10", "ft@20"]
    assert any_reg.descendants("base@2") == []

    plan = any_reg.plan_retention("base", KeepLast(1))
    assert plan.delete.keys() == {2}
    assert "parent of fork ft@10, ft@20" in plan.keep[1]
    any_reg.apply_retention("base", KeepLast(1))
    assert any_reg.resolve("base@1").status == "verified"

    released = any_reg.apply_retention("base", KeepLast(1), keep_fork_parents=False)
    assert released.deleted == (1,)
    chain = any_reg.lineage("ft@20")
    assert [(h.ref, h.status) for h in chain] == [("ft@20", "verified"), ("base@1", "deleted")]
    assert chain[0].parent_manifest_sha256 == chain[1].manifest_sha256
    assert any_reg.load("ft@20").step == 20  # the fork is whole without its parent
    assert hops(any_reg, "base@1") == [("base@1", "started", "deleted")]


def test_dead_fork_keeps_nothing_and_parent_ref_of_publish(any_reg: Registry) -> None:
    any_reg.publish("base", 1, make_state(1))
    any_reg.publish("base", 2, make_state(2))
    any_reg.publish("ft", 5, make_state(5), parent="base@1", blocking=False).result()  # resolved at the call
    any_reg.publish("ft", 6, make_state(6))
    assert hops(any_reg, "ft@5")[0][1] == "forked" and hops(any_reg, "ft@6")[0][1] == "started"
    assert 1 in any_reg.plan_retention("base", KeepLast(1)).keep
    any_reg.apply_retention("ft", KeepLast(1))  # the fork itself is deleted: it no longer holds its parent
    assert any_reg.plan_retention("base", KeepLast(1)).delete.keys() == {1}
    any_reg.begin_attempt("base", fork_from="base@1")  # within the run: a resume by another name
    any_reg.publish("base", 3, make_state(3))
    assert hops(any_reg, "base@3")[0][1] == "forked"
    assert any_reg.plan_retention("base", KeepLast(1)).delete.keys() == {1, 2}


def test_import_lineage_and_fork_of_an_import(reg: Registry, tmp_path: Path) -> None:
    src = tmp_path / "outside"
    Checkpoint(state_dict=make_state(7), epoch=1).save(src)
    reg.import_checkpoint(src, run="imp", step=7)
    (hop,) = reg.lineage("imp@7")
    assert hop.how == "imported" and hop.parent_run is None
    assert hop.source is not None and hop.source["path"] == str(src) and hop.source["layout"] == "manifest"
    assert len(hop.source["files_sha256"]) == 64
    reg.begin_attempt("tuned", fork_from="imp@7")
    reg.publish("tuned", 1, make_state(8))
    assert hops(reg, "tuned@1") == [("tuned@1", "forked", "verified"), ("imp@7", "imported", "verified")]


def test_lineage_names_a_parent_that_never_was_and_refuses_bad_input(any_reg: Registry) -> None:
    from registry import CheckpointNotFoundError, InvalidStateError
    any_reg.begin_attempt("run", resumed_from=99)  # resumed from its own files
    any_reg.publish("run", 100, make_state(1))
    assert hops(any_reg, "run@100") == [("run@100", "resumed", "verified"), ("run@99", "unknown", "missing")]
    with pytest.raises(CheckpointNotFoundError):
        any_reg.lineage("run@5")
    with pytest.raises(InvalidStateError, match="not both"):
        any_reg.begin_attempt("run", resumed_from=1, fork_from="run@100")
    with pytest.raises(CheckpointNotFoundError):
        any_reg.begin_attempt("other", fork_from="run@7")
    with pytest.raises(CheckpointNotFoundError):
        any_reg.publish("other", 1, make_state(1), parent="nope@1")
    assert any_reg.checkpoints("run")[-1].step == 100


def test_lineage_cli(reg: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    reg.publish("base", 1, make_state(1))
    reg.begin_attempt("ft", fork_from="base@1")
    reg.publish("ft", 2, make_state(2))
    out = cli("lineage", "ft@2")
    assert out.exit_code == 0 and "forked" in out.output and "base@1" in out.output
    doc = json.loads(cli("lineage", "ft@2", "--json").output)
    assert [(h["run"], h["step"], h["how"]) for h in doc] == [("ft", 2, "forked"), ("base", 1, "started")]
    assert doc[0]["parent"] == {"run": "base", "step": 1, "manifest_sha256": doc[1]["manifest_sha256"],
                                "replaced": False, "repeated": False}
    down = json.loads(cli("lineage", "base@1", "--descendants", "--json").output)
    assert [(h["run"], h["step"]) for h in down] == [("ft", 2)]
    missing = cli("lineage", "base@9")
    assert missing.exit_code == 1 and "registry: error:" in missing.output


def test_lineage_is_one_query(any_reg: Registry) -> None:
    """A chain of many hops is walked by one statement, not one per hop."""
    from sqlalchemy import event
    for step in range(1, 13):
        any_reg.begin_attempt("deep", resumed_from=step - 1 if step > 1 else None)
        any_reg.publish("deep", step, make_state(0, n=1), verify=False)
    statements: list[str] = []

    def count(*args: object) -> None:
        statements.append(str(args[2]))
    engines = {any_reg.catalog.engine, any_reg.catalog._read_engine}
    for engine in engines:
        event.listen(engine, "before_cursor_execute", count)
    try:
        chain = LineageCatalog(any_reg.catalog).chain("deep", 12)
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", count)
    assert len(chain) == 12 and chain[-1].how == "started"
    assert len([s for s in statements if "WITH RECURSIVE" in s]) == 1
    assert len([s for s in statements if s.lstrip().upper().startswith(("SELECT", "WITH"))]) == 1



def test_lineage_stops_at_a_replaced_parent(reg: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    """a@4 came from a@2's first payload; a fork of other@1 published over a@2 is not a@4's ancestor."""
    for step in (1, 2, 3):
        reg.publish("a", step, make_state(step))
    reg.publish("other", 1, make_state(9))
    reg.begin_attempt("a", resumed_from=2)
    reg.publish("a", 4, make_state(4))
    before = reg.lineage("a@4")
    assert [h.ref for h in before] == ["a@4", "a@2"] and not before[0].parent_replaced
    reg.begin_attempt("a", fork_from="other@1")
    reg.publish("a", 2, make_state(22), overwrite=True)

    chain = reg.lineage("a@4")
    assert [h.ref for h in chain] == ["a@4"]
    assert chain[0].parent_replaced and (chain[0].parent_run, chain[0].parent_step) == ("a", 2)
    assert chain[0].parent_manifest_sha256 == before[1].manifest_sha256
    assert [h.ref for h in reg.lineage("a@2")] == ["a@2", "other@1"]  # the replacement's own history
    assert [(h.ref, h.parent_replaced) for h in reg.descendants("a@2", forks_only=False)] == [("a@4", True)]
    assert [(h.ref, h.parent_replaced) for h in reg.descendants("other@1")] == [("a@2", False)]
    out = cli("lineage", "a@4")
    assert out.exit_code == 0 and "a@2 (since replaced)" in out.output and "other@1" not in out.output
    doc = json.loads(cli("lineage", "a@4", "--json").output)
    assert len(doc) == 1 and doc[0]["parent"]["replaced"] is True


def test_a_step_resumed_from_itself_came_from_what_it_replaced(any_reg: Registry) -> None:
    any_reg.publish("a", 1, make_state(1))
    any_reg.begin_attempt("a", resumed_from=1)
    any_reg.publish("a", 1, make_state(2), overwrite=True)  # resumed from step 1, then wrote step 1 again
    (hop,) = any_reg.lineage("a@1")
    assert hop.parent_replaced and not hop.parent_repeated and hop.parent_manifest_sha256 != hop.manifest_sha256


def test_descendants_of_a_parent_published_after_the_child(any_reg: Registry) -> None:
    """A resume from files outside the registry names a step that did not exist; one published there later
    is not what the child came from."""
    any_reg.begin_attempt("run", resumed_from=99)
    any_reg.publish("run", 100, make_state(1))
    any_reg.begin_attempt("run")
    any_reg.publish("run", 99, make_state(2))
    assert [(h.ref, h.parent_replaced) for h in any_reg.descendants("run@99", forks_only=False)] == [("run@100", True)]


def _chain_rows(reg: Registry, run: str, step: int) -> int:
    from registry.catalog import lineage
    return len(reg.catalog.read(lambda conn: conn.execute(
        lineage._CHAIN, {"run": run, "step": step, "limit": lineage.MAX_DEPTH}).all()))


def test_lineage_cycle_stops_at_the_first_repeat(reg: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    """b@1 overwritten with parent a@1, a@1 forked from b@1: the walk visits each step once."""
    reg.publish("b", 1, make_state(1))
    reg.publish("a", 1, make_state(2), parent="b@1")
    reg.publish("b", 1, make_state(3), parent="a@1", overwrite=True)
    chain = reg.lineage("b@1")
    assert [(h.ref, h.parent_replaced) for h in chain] == [("b@1", False), ("a@1", True)]
    assert _chain_rows(reg, "b", 1) == 2

    # a cycle whose digests all agree (rows written before a replaced parent was told apart, as the
    # backfill of an overwritten resume writes them): the walk stops at the first repeat and says so
    from sqlalchemy import select, update

    from registry.catalog.models import CheckpointRow, Lineage, Run
    b1 = reg.lineage("b@1")[0]
    a1_id = reg.catalog.read(lambda conn: conn.execute(
        select(CheckpointRow.c.id).join(Run, Run.c.id == CheckpointRow.c.run_id)
        .where(Run.c.name == "a", CheckpointRow.c.step == 1)).scalar_one())
    reg.catalog.write(lambda conn: conn.execute(update(Lineage).where(Lineage.c.checkpoint_id == a1_id)
                                                .values(parent_manifest_sha256=b1.manifest_sha256)))
    for start, order in (("b@1", ["b@1", "a@1"]), ("a@1", ["a@1", "b@1"])):
        hops_ = reg.lineage(start)
        assert [h.ref for h in hops_] == order
        assert [(h.parent_repeated, h.parent_replaced) for h in hops_] == [(False, False), (True, False)]
    assert _chain_rows(reg, "b", 1) == 2 and _chain_rows(reg, "a", 1) == 2
    out = cli("lineage", "a@1")
    assert out.exit_code == 0 and "cycle" in out.output
