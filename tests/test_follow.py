"""Followers: waiting for the next checkpoint, across processes, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from registry import CheckpointInfo, InvalidNameError, InvalidStateError, Registry
from tests.helpers import assert_state_equal, make_state, pg_schema_url


def test_follower_process_receives_a_publish_from_this_process(reg: Registry, catalog_url: str,
                                                              root: Path) -> None:
    reg.publish("run", 10, make_state(10))
    script = textwrap.dedent("""
        import json, sys
        from registry import Registry
        with Registry.open(url=sys.argv[1], root=sys.argv[2]) as reg:
            print("waiting", flush=True)
            info = reg.wait_for_new("run", after_step=10, timeout=120)
            seen = reg.resolve(f"run@{info.step}")  # visible to a fresh query at once
            print(json.dumps({"step": info.step, "status": info.status, "seen": seen.status,
                              "path": str(info.path)}), flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", script, catalog_url, str(root)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "waiting", child.stderr.read() if child.stderr else ""
        info = reg.publish("run", 20, make_state(20))
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert json.loads(out) == {"step": 20, "status": "verified", "seen": "verified", "path": str(info.path)}


def test_next_newest_and_follow(reg: Registry) -> None:
    assert reg.wait_for_new("run", timeout=0) is None  # the run does not exist yet: wait, don't fail
    for step in (10, 20, 30):
        reg.publish("run", step, make_state(step), policy_version=step // 10)
    nxt = reg.wait_for_new("run", after_step=10, timeout=0)
    assert nxt is not None and nxt.step == 20 and nxt.path == reg.store.step_dir("run", 20)
    newest = reg.wait_for_new("run", after_step=10, timeout=0, newest=True)
    assert newest is not None and newest.step == 30
    assert_state_equal(reg.load(f"run@{newest.step}").state_dict, make_state(30))
    assert reg.wait_for_new("run", after_step=30, timeout=0.2) is None
    only_v3 = reg.wait_for_new("run", timeout=0, min_policy_version=3)
    assert only_v3 is not None and only_v3.step == 30
    assert [i.step for i in reg.follow("run", timeout=0)] == [10, 20, 30]
    assert [i.step for i in reg.follow("run", after_step=10, newest=True, timeout=0)] == [30]


def test_unpublished_and_unverified_steps_are_never_returned(reg: Registry) -> None:
    reg.publish("run", 10, make_state(10))
    reg.catalog.claim("run", 20, path="run/step-00000020", writer="elsewhere:1", overwrite=False)
    reg.publish("run", 30, make_state(30), verify=False)
    assert reg.wait_for_new("run", after_step=10, timeout=0.3) is None
    got: list[CheckpointInfo | None] = []
    waiter = threading.Thread(target=lambda: got.append(reg.wait_for_new("run", after_step=10, timeout=120)))
    waiter.start()
    reg.verify("run@30")  # published -> verified wakes the follower (a NOTIFY on PostgreSQL)
    waiter.join(timeout=150)
    assert not waiter.is_alive()
    assert got[0] is not None and (got[0].step, got[0].status) == (30, "verified")


def test_bad_arguments(reg: Registry) -> None:
    for timeout in (-1, float("nan"), "5", True):
        with pytest.raises(InvalidStateError, match="timeout"):
            reg.wait_for_new("run", timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(InvalidNameError):
        reg.wait_for_new("run", after_step=-1, timeout=0)
    with pytest.raises(InvalidNameError):
        reg.wait_for_new("../run", timeout=0)


def test_notifications_from_another_schema_are_not_trusted(catalog_url: str, root: Path,
                                                          tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if not catalog_url.startswith("postgresql"):
        pytest.skip("NOTIFY is PostgreSQL's; SQLite followers only poll their own file")
    other_url = pg_schema_url(request.getfixturevalue("pg_database"))
    with Registry.open(url=catalog_url, root=root) as reg, \
            Registry.open(url=other_url, root=tmp_path / "other") as other:
        reg.publish("run", 10, make_state(10))
        got: list[CheckpointInfo | None] = []
        waiter = threading.Thread(target=lambda: got.append(reg.wait_for_new("run", after_step=10, timeout=1.0)))
        waiter.start()
        other.publish("run", 20, make_state(20))  # same run name, other schema: a NOTIFY we also hear
        waiter.join(timeout=60)
        assert got == [None]
