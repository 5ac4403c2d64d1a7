"""Policy consumers: subscribe, leases of verified versions, one fetch per host, lag, retention, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from registry import Registry
from registry.errors import InvalidStateError, LagTimeoutError, RegistryError
from registry.ops.hostcopies import HOST_CACHE
from registry.retention import KeepLast
from tests.helpers import child_env, flip_stored_byte, make_state

RUN = "rl"


def _publish(reg: Registry, version: int, *, step: int | None = None) -> int:
    step = (version + 1) * 10 if step is None else step
    reg.publish(RUN, step, make_state(version), policy_version=version)
    return step


def test_subscribe_lease_materialize_apply_release(reg: Registry) -> None:
    _publish(reg, 0)
    reg.publish(RUN, 15, make_state(99))  # a step without a policy version is no version
    with reg.subscribe(RUN, consumer="rollout-0", ttl=60) as sub:
        versions = sub.versions(timeout=0)
        lease = next(versions)
        assert (lease.policy_version, lease.step) == (0, 10)
        path = lease.materialize()
        assert (path / "model.safetensors").is_file() and path.parent.parent.name == "policy"
        lease.applied()
        lag = reg.policy_lag(RUN)
        assert (lag.newest_version, lag.oldest_applied, lag.lag, lag.pending) == (0, 0, 0, ())
        (me,) = lag.consumers
        assert me.live and me.applied_version == 0 and me.applied_step == 10 and me.pid is not None
        assert next(versions, None) is None  # nothing new: the timeout ends the iteration
        _publish(reg, 1)
        _publish(reg, 2)
        newest = next(sub.versions(timeout=0))
        assert newest.policy_version == 2  # newest_only skips version 1
        assert reg.policy_lag(RUN).lag == 2
        newest.materialize()
        newest.applied()
        assert reg.wait_lag(RUN, 0, timeout=0).lag == 0
        lease.release()
        newest.release()
    (first, second) = reg.loads(RUN)
    assert (first.version, second.version) == (0, 2) and first.consumer == "rollout-0"
    assert first.verified and first.bytes_fetched > 0 and first.committed_at is not None
    assert first.committed_at <= first.notified_at <= first.leased_at <= first.fetched_at  # type: ignore[operator]
    assert first.applied_at is not None and first.released_at is not None
    assert [x.version for x in reg.loads(RUN, policy_version=2)] == [2]
    (ended,) = reg.policy_lag(RUN).consumers
    assert ended.ended_at is not None and not ended.live
    assert reg.wait_lag(RUN, 0, timeout=0).lag == 0  # no live consumer: nothing to wait for
    with reg.subscribe(RUN, consumer="rollout-0", ttl=60) as again:  # the same name revives its row
        (revived,) = reg.policy_lag(RUN).consumers
        assert revived.live and revived.applied_version is None and revived.ended_at is None
        assert reg.policy_lag(RUN).pending == ("rollout-0",)
        with pytest.raises(LagTimeoutError, match="rollout-0 \\(nothing\\)"):
            reg.wait_lag(RUN, 5, timeout=0)
        assert next(again.versions(timeout=0)).policy_version == 2


def test_newest_only_false_yields_every_version_and_only_verified_ones(reg: Registry) -> None:
    _publish(reg, 0)
    with reg.subscribe(RUN, consumer="every", ttl=60) as sub:
        assert next(sub.versions(newest_only=False, timeout=0)).policy_version == 0
        for version in (1, 2, 3):
            _publish(reg, version)
        reg.publish(RUN, 100, make_state(7), policy_version=7, verify=False)  # published, not verified
        assert [x.policy_version for x in sub.versions(newest_only=False, timeout=0)] == [1, 2, 3]
        skipped = [x for x in reg.loads(RUN) if x.version in (1, 2)]
        assert all(x.released_at is not None and x.applied_at is None for x in skipped)  # skipped: released


def test_a_version_published_while_waiting_wakes_the_consumer(reg: Registry) -> None:
    got: list[int] = []
    with reg.subscribe(RUN, consumer="waiter", ttl=60) as sub:
        waiting = threading.Thread(target=lambda: got.append(next(sub.versions(timeout=60)).policy_version))
        waiting.start()
        _publish(reg, 3)
        waiting.join(timeout=120)
    assert got == [3]


CHILD = textwrap.dedent("""
    import json, sys
    from registry import Registry
    url, root, name = sys.argv[1:]
    with Registry.open(url=url, root=root, create=False) as reg, reg.subscribe("rl", consumer=name) as sub:
        lease = next(sub.versions(timeout=60))
        path = lease.materialize()
        lease.applied()
        print(json.dumps({"path": str(path), "version": lease.policy_version}))
""")


def test_four_consumer_processes_on_one_host_fetch_once(reg: Registry, migrated_url: str, root: Path) -> None:
    _publish(reg, 4)
    children = [subprocess.Popen([sys.executable, "-c", CHILD, migrated_url, str(root), f"rollout-{i}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
                for i in range(4)]
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert {o["path"] for o in outputs} == {str(root / ".registry" / "policy" / RUN / "v4")}
    loads = reg.loads(RUN, policy_version=4)
    assert len(loads) == 4 and all(x.verified and x.applied_at is not None for x in loads)
    assert len([x for x in loads if x.bytes_fetched > 0]) == 1
    assert sorted(x.source for x in loads if x.bytes_fetched == 0) == [HOST_CACHE] * 3
    lag = reg.policy_lag(RUN)
    assert len(lag.consumers) == 4 and not any(c.live for c in lag.consumers)  # each closed on exit


def test_wait_lag_keeps_consumers_of_different_speeds_within_k(reg: Registry) -> None:
    k, last = 2, 7
    subs = [reg.subscribe(RUN, consumer=f"speed-{i}", ttl=60) for i in range(3)]
    errors: list[BaseException] = []

    def consume(sub: object, pause: float) -> None:
        try:
            for lease in sub.versions(timeout=60):  # type: ignore[attr-defined]
                lease.materialize()
                time.sleep(pause)  # an engine that reloads slowly
                lease.applied()
                if lease.policy_version == last:
                    return
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    workers = [threading.Thread(target=consume, args=(s, p)) for s, p in zip(subs, (0.0, 0.02, 0.1))]
    for w in workers:
        w.start()
    for version in range(last + 1):
        reg.wait_lag(RUN, k - 1, timeout=60)  # so that publishing the next keeps every consumer within k
        _publish(reg, version)
    for w in workers:
        w.join(timeout=120)
    for s in subs:
        s.close()
    assert not errors, errors
    committed = {c.policy_version: c.verified_at for c in reg.checkpoints(RUN)}
    loads = reg.loads(RUN)
    for sub in subs:
        applied = [(x.applied_at, x.version) for x in loads if x.consumer == sub.consumer and x.applied_at]
        assert applied[-1][1] == last
        for version, at in committed.items():
            if version == 0:
                continue
            served = max((v for when, v in applied if when < at), default=None)  # type: ignore[operator]
            assert served is not None and version - served <= k, (sub.consumer, version, applied)


def test_retention_keeps_what_a_live_consumer_leases_or_serves(reg: Registry) -> None:
    _publish(reg, 0)
    with reg.subscribe(RUN, consumer="rollout-3", ttl=60) as sub:
        lease = next(sub.versions(timeout=0))
        for version in (1, 2):
            _publish(reg, version)
        reg.publish(RUN, 40, make_state(40))  # newer than every policy step, no version
        plan = reg.plan_retention(RUN, KeepLast(1))
        assert "leased by rollout-3" in plan.keep[10]
        assert "@latest-policy" in plan.keep[30] and 20 in plan.delete
        lease.materialize()
        lease.applied()
        lease.release()
        assert "served by rollout-3" in reg.plan_retention(RUN, KeepLast(1)).keep[10]
        newer = next(sub.versions(timeout=0))
        newer.materialize()
        newer.applied()  # serves version 2 now: version 0 is free
        result = reg.apply_retention(RUN, KeepLast(1))
        assert set(result.deleted) == {10, 20}
        assert reg.plan_retention(RUN, KeepLast(1)).keep[30].count("rollout-3") == 2  # leased and served


def test_an_expired_consumer_protects_nothing(reg: Registry) -> None:
    _publish(reg, 0)
    sub = reg.subscribe(RUN, consumer="hung", ttl=0.05)
    lease = next(sub.versions(timeout=0))
    for version in (1, 2):
        _publish(reg, version)
    sub.stop_heartbeat()
    deadline = time.monotonic() + 60
    while reg.policy_lag(RUN).consumers[0].live:  # until its last heartbeat is ttl old
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert 10 in reg.plan_retention(RUN, KeepLast(1)).delete
    assert reg.wait_lag(RUN, 0, timeout=0).pending == ()  # an expired consumer counts for no lag
    assert lease.load.version == 0
    sub.close()


def test_a_load_that_fails_its_check_is_recorded_and_cannot_be_applied(reg: Registry) -> None:
    _publish(reg, 0)
    flip_stored_byte(reg, reg.resolve(f"{RUN}@10"), "model.safetensors")
    with reg.subscribe(RUN, consumer="careful", ttl=60) as sub:
        lease = next(sub.versions(timeout=0))
        with pytest.raises(RegistryError):
            lease.materialize()
        with pytest.raises(InvalidStateError, match="did not verify"):
            lease.applied()
    (load,) = reg.loads(RUN)
    assert not load.verified and load.error and load.applied_at is None and load.bytes_fetched == 0
    assert not (reg.root.local_dir / ".registry" / "policy" / RUN / "v0").exists()  # type: ignore[operator]


def test_bad_arguments(reg: Registry) -> None:
    assert reg.wait_lag("not-yet", 0, timeout=0).newest_version is None  # a trainer before its first publish
    with pytest.raises(RegistryError, match="no run named"):
        reg.policy_lag("not-yet")
    with pytest.raises(InvalidStateError, match="max_lag"):
        reg.wait_lag(RUN, -1)
    with pytest.raises(InvalidStateError, match="ttl"):
        reg.subscribe(RUN, consumer="x", ttl=0)
    with pytest.raises(InvalidStateError, match="consumer"):
        reg.subscribe(RUN, consumer="")
    with pytest.raises(RegistryError, match="run"):
        reg.subscribe("bad name", consumer="x")
    with reg.subscribe(RUN, consumer="x") as sub, pytest.raises(InvalidStateError, match="timeout"):
        next(sub.versions(timeout=-1))


def test_policy_commands(reg: Registry, cli, root: Path) -> None:  # type: ignore[no-untyped-def]
    _publish(reg, 0)
    _publish(reg, 1)
    with reg.subscribe(RUN, consumer="rollout-1", ttl=60) as sub:
        lease = next(sub.versions(timeout=0))
        lease.materialize()
        lease.applied()
        out = cli("policy", "ls", RUN)
        assert out.exit_code == 0 and "VERSION" in out.output and "full" in out.output
        assert [v["version"] for v in json.loads(cli("policy", "ls", RUN, "--json").output)] == [0, 1]
        out = cli("policy", "lag", RUN)
        assert out.exit_code == 0 and "newest version 1, oldest served 1, lag 0" in out.output
        out = cli("policy", "consumers", RUN)
        assert out.exit_code == 0 and "rollout-1" in out.output and "live" in out.output
        (who,) = json.loads(cli("policy", "who", f"{RUN}@pv:1", "--json").output)
        assert who["consumer"] == "rollout-1" and who["verified"]
        assert "rollout-1" in cli("policy", "who", RUN, "--version", "1").output
        assert cli("policy", "who", RUN).exit_code == 2
        out = cli("policy", "pull", f"{RUN}@pv:1", str(root.parent / "pulled"))
        assert out.exit_code == 0 and (root.parent / "pulled" / "model.safetensors").is_file()
        assert cli("policy", "lag", "nope").exit_code == 1


def test_the_run_page_shows_versions_and_consumers(reg: Registry, migrated_url: str, root: Path) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from registry.web import create_app
    _publish(reg, 0)
    reg.publish("plain", 1, make_state(1))
    with reg.subscribe(RUN, consumer="rollout-7", ttl=60), \
            Registry.open(url=migrated_url, root=root, read_only=True, create=False) as ro:
        client = TestClient(create_app(ro), base_url="http://127.0.0.1:8765")
        page = client.get(f"/runs/{RUN}").text
        assert 'id="policy-channel"' in page and "rollout-7" in page and "pending rollout-7" in page
        assert 'id="policy-channel"' not in client.get("/runs/plain").text


def test_a_process_beats_for_all_its_consumers_at_once(reg: Registry) -> None:
    from sqlalchemy import event
    subs = [reg.subscribe(RUN, consumer=f"c{i}", ttl=0.6) for i in range(3)]
    beaters = [t for t in threading.enumerate() if t.name == "registry-policy-heartbeat"]
    assert len(beaters) == 1  # one thread for every subscription of the registry
    first = {c.name: c.heartbeat_at for c in reg.policy_lag(RUN).consumers}
    deadline = time.monotonic() + 60
    while any(c.heartbeat_at == first[c.name] for c in reg.policy_lag(RUN).consumers):  # the thread beats alone
        assert time.monotonic() < deadline
        time.sleep(0.05)
    statements: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if (statement.lstrip().upper().startswith("UPDATE POLICY_CONSUMERS")
                and threading.current_thread() is threading.main_thread()):  # this beat's, not the thread's
            statements.append(statement)
    event.listen(reg.catalog.engine, "before_cursor_execute", record)
    try:
        subs[0].stop_heartbeat()
        hub = reg._consumer_hub
        assert hub is not None and hub.beat() == 2 and len(statements) == 1  # one UPDATE for both
    finally:
        event.remove(reg.catalog.engine, "before_cursor_execute", record)
    for sub in subs:
        sub.close()
    assert not [c for c in reg.policy_lag(RUN).consumers if c.live]


def test_a_hosts_copies_of_versions_no_consumer_holds_are_removed(reg: Registry, root: Path) -> None:
    cache = root / ".registry" / "policy" / RUN
    _publish(reg, 0)
    with reg.subscribe(RUN, consumer="fast", ttl=60) as fast, reg.subscribe(RUN, consumer="slow", ttl=60) as slow:
        for sub in (fast, slow):
            lease = next(sub.versions(timeout=0))
            lease.materialize()
            lease.applied()
        _publish(reg, 1)
        newer = next(fast.versions(timeout=0))
        newer.materialize()
        newer.applied()
        assert (cache / "v0").is_dir()  # "slow" still serves version 0
        newer = next(slow.versions(timeout=0))
        newer.materialize()
        newer.applied()
        assert not (cache / "v0").exists() and (cache / "v1" / "model.safetensors").is_file()


def test_a_marker_counts_as_the_newest_version(reg: Registry) -> None:
    _publish(reg, 0)
    reg.publish_policy_marker(RUN, 3, note="broadcast over NCCL")
    lag = reg.policy_lag(RUN)
    assert (lag.newest_version, lag.newest_step) == (3, None)
    assert [(v.version, v.kind, v.step) for v in reg.policy_versions(RUN)] == [(0, "full", 10), (3, "marker", None)]


def test_a_leased_delta_version_keeps_its_base(reg: Registry) -> None:
    reg.publish(RUN, 10, make_state(0), policy_version=0, delta=False)
    reg.publish(RUN, 20, make_state(0), policy_version=1, delta=True)
    with reg.subscribe(RUN, consumer="rollout-9", ttl=60) as sub:
        lease = next(sub.versions(timeout=0))
        assert lease.step == 20 and (lease.materialize() / "model.safetensors").is_file()
        reg.publish(RUN, 30, make_state(2), policy_version=2, delta=False)
        reg.publish(RUN, 40, make_state(3))
        keep = reg.plan_retention(RUN, KeepLast(1)).keep
        assert "leased by rollout-9" in keep[20] and "base of delta step 20" in keep[10]
        lease.release()
        assert set(reg.plan_retention(RUN, KeepLast(1)).delete) == {10, 20}


def test_a_consumer_leases_and_applies_a_marker_version(reg: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    _publish(reg, 1)
    with reg.subscribe(RUN, consumer="engine-0", ttl=60) as sub:
        first = next(sub.versions(timeout=0))
        assert (first.policy_version, first.step, first.marker) == (1, 20, False)
        first.materialize()
        first.applied()
        reg.publish_policy_marker(RUN, 2, note="broadcast over NCCL")
        with pytest.raises(LagTimeoutError, match="engine-0 \\(1\\)"):
            reg.wait_lag(RUN, 0, timeout=0.1)  # the consumer serves 1, the newest version is the marker's
        marker = next(sub.versions(timeout=0))
        assert (marker.policy_version, marker.step, marker.marker) == (2, None, True) and "marker" in repr(marker)
        with pytest.raises(InvalidStateError, match="version 2 of rl is a marker.*got them elsewhere"):
            marker.materialize()
        (leased,) = reg.loads(RUN, policy_version=2)
        assert leased.step is None and not leased.verified and leased.error is None and leased.fetched_at is None
        assert leased.committed_at is not None and leased.committed_at <= leased.leased_at
        marker.applied()
        lag = reg.wait_lag(RUN, 0, timeout=10)
        assert (lag.lag, lag.newest_version, lag.newest_step, lag.oldest_applied) == (0, 2, None, 2)
        (me,) = lag.consumers
        assert (me.applied_version, me.applied_step, me.lag) == (2, None, 0)
        (served,) = reg.loads(RUN, policy_version=2)
        assert served.consumer == "engine-0" and served.applied_at is not None and served.released_at is None
        assert reg.loads(RUN, policy_version=1)[0].released_at is not None  # applying 2 released the lease of 1
        (who,) = json.loads(cli("policy", "who", f"{RUN}@pv:2", "--json").output)
        assert who["consumer"] == "engine-0" and who["step"] is None and who["applied_at"] is not None
        out = cli("policy", "who", f"{RUN}@pv:2")
        assert out.exit_code == 0 and "engine-0" in out.output and "marker" in out.output
        out = cli("policy", "consumers", RUN)
        assert out.exit_code == 0 and "engine-0" in out.output
        _publish(reg, 3)  # a step after the marker
        third = next(sub.versions(timeout=0))
        assert (third.policy_version, third.step, third.marker) == (3, 40, False)
        assert (third.materialize() / "model.safetensors").is_file()
        third.applied()
        assert reg.wait_lag(RUN, 0, timeout=0).oldest_applied == 3
    (done,) = reg.loads(RUN, policy_version=3)
    assert done.verified and done.step == 40


def test_newest_only_false_interleaves_steps_and_markers_by_version(reg: Registry) -> None:
    _publish(reg, 0)
    with reg.subscribe(RUN, consumer="every", ttl=60) as sub:
        assert next(sub.versions(newest_only=False, timeout=0)).policy_version == 0
        _publish(reg, 1)
        reg.publish_policy_marker(RUN, 2)
        _publish(reg, 3)
        got = [(x.policy_version, x.step, x.marker) for x in sub.versions(newest_only=False, timeout=0)]
        assert got == [(1, 20, False), (2, None, True), (3, 40, False)]
        skipped = [x for x in reg.loads(RUN) if x.version in (1, 2)]
        assert len(skipped) == 2 and all(x.released_at is not None and x.applied_at is None for x in skipped)
        reg.publish_policy_marker(RUN, 4)
        reg.publish_policy_marker(RUN, 5)
        (newest,) = list(sub.versions(timeout=0))  # newest_only: the newest version is marker 5's
        assert (newest.policy_version, newest.marker) == (5, True)


def test_a_marker_published_while_waiting_wakes_the_consumer(reg: Registry) -> None:
    _publish(reg, 0)
    got: list[tuple[int, bool]] = []
    with reg.subscribe(RUN, consumer="waiter", ttl=60) as sub:
        assert next(sub.versions(timeout=0)).policy_version == 0

        def wait() -> None:
            lease = next(sub.versions(timeout=60))
            got.append((lease.policy_version, lease.marker))
        waiting = threading.Thread(target=wait)
        waiting.start()
        reg.publish_policy_marker(RUN, 1)
        waiting.join(timeout=120)
    assert got == [(1, True)]


def test_retention_with_a_consumer_serving_a_marker(reg: Registry) -> None:
    _publish(reg, 1)
    with reg.subscribe(RUN, consumer="engine-1", ttl=60) as sub:
        first = next(sub.versions(timeout=0))
        first.materialize()
        first.applied()
        reg.publish_policy_marker(RUN, 2)
        marker = next(sub.versions(timeout=0))
        assert "served by engine-1" in reg.plan_retention(RUN, KeepLast(1)).keep[20]  # a marker's lease holds no step
        marker.applied()
        keep = reg.plan_retention(RUN, KeepLast(1)).keep
        assert "engine-1" not in keep[20] and "@latest-policy" in keep[20]  # serves the marker: no step of its
        _publish(reg, 3)
        plan = reg.plan_retention(RUN, KeepLast(1))
        assert 20 in plan.delete and not any("engine-1" in why for why in plan.keep.values())
        assert set(reg.apply_retention(RUN, KeepLast(1)).deleted) == {20}
        lag = reg.policy_lag(RUN)
        assert (lag.newest_version, lag.newest_step, lag.oldest_applied, lag.lag) == (3, 40, 2, 1)
        (served,) = reg.loads(RUN, policy_version=2)
        assert served.applied_at is not None and served.released_at is None
        assert reg.prune_policy_loads(RUN, older_than=timedelta(0)) == 1  # the released load of 1, not the marker's
        assert [x.version for x in reg.loads(RUN)] == [2]


def test_a_load_records_the_copy_it_read_or_the_hosts_copy(reg: Registry) -> None:
    step = _publish(reg, 0)
    with reg.subscribe(RUN, consumer="first", ttl=60) as a, reg.subscribe(RUN, consumer="second", ttl=60) as b:
        next(a.versions(timeout=0)).materialize()
        next(b.versions(timeout=0)).materialize()
    sources = {x.consumer: x.source for x in reg.loads(RUN)}
    assert sources == {"first": str(reg.resolve(f"{RUN}@{step}").path), "second": HOST_CACHE}


def test_on_a_tiered_root_a_load_records_the_fast_copy_or_the_download_of_the_durable_one(
        treg: Registry, migrated_url: str, durable: str, tmp_path: Path) -> None:
    from registry.ops.tiercache import cache_relpath
    step = _publish(treg, 0)
    copy = treg.wait_durable(RUN, step, timeout=60)
    info = treg.resolve(f"{RUN}@{step}")
    with treg.subscribe(RUN, consumer="on-a", ttl=60, host="a") as sub:
        next(sub.versions(timeout=0)).materialize()
    host_b = tmp_path / "host-b"  # shares the catalog and the durable tier; holds no fast copy of the step
    with Registry.open(migrated_url, root=host_b, durable=durable) as b:
        with b.subscribe(RUN, consumer="on-b", ttl=60, host="b") as sub:
            path = next(sub.versions(timeout=0)).materialize()
        assert (path / "model.safetensors").is_file()
        sources = {x.consumer: x.source for x in b.loads(RUN)}
    assert sources == {"on-a": str(info.path), "on-b": str(host_b / cache_relpath(info))}
    # a reader that keeps no cache on its host reads a download of the durable copy: its URL is what it read
    with Registry.open(migrated_url, root=tmp_path / "host-c", durable=durable, read_only=True) as c:
        _, where = c._materialize_traced(f"{RUN}@{step}", tmp_path / "out")
    assert treg.tiers is not None and where == treg.tiers.durable.url(copy.path) != treg.root_url
