"""The policy loads audit does not grow without end: loads that protect nothing and ended long ago are forgotten
(``Registry.prune_policy_loads``, ``registry policy prune``, and a process's hub at most hourly); a load that keeps
a version from retention, and the load of the version a consumer serves, never are.

Thirty days cannot pass in a test: the rows' times are moved back in the catalog instead, as they would be then.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from registry import Registry
from registry.catalog.models import PolicyConsumer, PolicyLoad
from registry.catalog.session import utcnow
from registry.errors import InvalidStateError
from registry.retention import KeepLast
from tests.helpers import make_state

RUN = "rl"
OLD = timedelta(days=40)


def _publish(reg: Registry, version: int) -> int:
    step = (version + 1) * 10
    reg.publish(RUN, step, make_state(version), policy_version=version)
    return step


def _age_everything(reg: Registry) -> None:
    """Every load and consumer time moved back ``OLD``, as after forty days (heartbeats too: see ``_revive``)."""
    from registry.catalog.session import aware

    def fn(conn) -> None:  # type: ignore[no-untyped-def]
        for table, columns in ((PolicyLoad, ("leased_at", "released_at", "applied_at")),
                               (PolicyConsumer, ("registered_at", "heartbeat_at", "expires_at", "ended_at"))):
            for row in conn.execute(select(table.c.id, *(table.c[c] for c in columns))).all():
                moved = {c: aware(getattr(row, c)) - OLD for c in columns if getattr(row, c) is not None}
                conn.execute(update(table).where(table.c.id == row.id).values(**moved))
    reg.catalog.write(fn)


def _revive(reg: Registry, *names: str) -> None:
    """The consumers ``names`` heartbeat now: they are live (their leases and what they serve are as old)."""
    def fn(conn) -> None:  # type: ignore[no-untyped-def]
        pc = PolicyConsumer.c
        conn.execute(update(PolicyConsumer).where(pc.name.in_(names))
                     .values(heartbeat_at=utcnow(), expires_at=utcnow() + timedelta(hours=1)))
    reg.catalog.write(fn)


def _left(reg: Registry) -> list[tuple[str, int]]:
    return sorted((x.consumer, x.version) for x in reg.loads(RUN))


def _fleet(reg: Registry) -> list[object]:
    """A: serves 1 (its lease of 0 released); B: leases 1, serves nothing; C: served 0, then closed (its lease
    of 1 released by closing); D: leases 1, then stopped heartbeating (expired)."""
    _publish(reg, 0)
    subs = {n: reg.subscribe(RUN, consumer=n, ttl=3600) for n in "ABCD"}
    first = {n: next(s.versions(timeout=0)) for n, s in subs.items() if n in "AC"}
    for lease in first.values():
        lease.materialize()
        lease.applied()
    _publish(reg, 1)
    for n in "ABCD":
        lease = next(subs[n].versions(timeout=0))
        assert lease.policy_version == 1
        if n == "A":
            lease.materialize()
            lease.applied()
    subs["C"].close()
    subs["D"].stop_heartbeat()
    return list(subs.values())


def test_prune_forgets_only_loads_that_protect_nothing(reg: Registry) -> None:
    subs = _fleet(reg)
    assert _left(reg) == [("A", 0), ("A", 1), ("B", 1), ("C", 0), ("C", 1), ("D", 1)]
    assert reg.prune_policy_loads(RUN) == 0  # all of it recent
    _age_everything(reg)
    _revive(reg, "A", "B")
    before = reg.plan_retention(RUN, KeepLast(1)).keep
    # gone: A's released lease of 0, C's released lease of 1, expired D's unreleased lease of 1
    assert reg.prune_policy_loads("other-run") == 0
    assert reg.prune_policy_loads(RUN) == 3
    # kept: A's applied 1 (live, unreleased), B's lease of 1 (live, unreleased), C's served 0 (its current load)
    assert _left(reg) == [("A", 1), ("B", 1), ("C", 0)]
    assert reg.plan_retention(RUN, KeepLast(1)).keep == before  # nothing that protected a version went
    assert "leased by A, B" in before[20] and "served by A" in before[20]
    (c_load,) = reg.loads(RUN, policy_version=0)
    assert c_load.consumer == "C" and c_load.applied_at is not None
    assert reg.prune_policy_loads(RUN) == 0
    for sub in subs:
        sub.close()  # type: ignore[attr-defined]


def test_recent_loads_stay_and_older_than_is_checked(reg: Registry) -> None:
    _publish(reg, 0)
    with reg.subscribe(RUN, consumer="A", ttl=3600) as sub:
        next(sub.versions(timeout=0)).release()
    assert reg.prune_policy_loads(older_than=timedelta(days=1)) == 0
    assert reg.prune_policy_loads(older_than=timedelta(0)) == 1  # released: forgotten at once when asked
    with pytest.raises(InvalidStateError):
        reg.prune_policy_loads(older_than=-timedelta(days=1))
    with pytest.raises(InvalidStateError):
        reg.prune_policy_loads(older_than=30)  # type: ignore[arg-type]


def test_the_prune_command(reg: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    subs = _fleet(reg)
    _age_everything(reg)
    _revive(reg, "A", "B")
    out = cli("policy", "prune", RUN, "--older-than-days", "50")
    assert out.exit_code == 0 and "forgot 0 policy loads" in out.output
    assert json.loads(cli("policy", "prune", "--json").output) == {"forgotten": 3}
    assert cli("policy", "prune", RUN, "--older-than-days", "-1").exit_code == 2
    for sub in subs:
        sub.close()  # type: ignore[attr-defined]


def test_a_hub_prunes_at_most_hourly(reg: Registry) -> None:
    from registry.ops.consumers import ConsumerHub
    subs = _fleet(reg)
    _age_everything(reg)
    _revive(reg, "A", "B")
    hub = ConsumerHub(reg.catalog, keep_days=50)
    try:
        assert hub.prune_now_and_then() == 0  # 40 days old: kept for 50
        _revive(reg, "A", "B")
        assert hub.prune_now_and_then() is None  # not an hour yet: not even asked
        assert len(_left(reg)) == 6
    finally:
        hub.close()
    with pytest.raises(InvalidStateError):
        ConsumerHub(reg.catalog, keep_days=-1)
    for sub in subs:
        sub.close()  # type: ignore[attr-defined]


def test_registry_open_sets_how_long_loads_are_kept(reg: Registry) -> None:
    subs = _fleet(reg)
    _age_everything(reg)
    _revive(reg, "A", "B")
    with Registry.open(url=reg.url, root=reg.root_url, policy_loads_keep_days=50) as other:
        assert other._consumers().prune_now_and_then() == 0  # 40 days old: kept for 50
    assert len(_left(reg)) == 6
    with Registry.open(url=reg.url, root=reg.root_url, policy_loads_keep_days=10) as other:
        assert other._consumers().prune_now_and_then() == 3
    assert len(_left(reg)) == 3
    for bad in (-1, float("nan"), float("inf"), True, "30"):
        with pytest.raises(InvalidStateError, match="keep_days"):
            Registry.open(url=reg.url, root=reg.root_url, policy_loads_keep_days=bad)  # type: ignore[arg-type]
    for sub in subs:
        sub.close()  # type: ignore[attr-defined]


def test_the_heartbeat_thread_prunes_with_the_default_keep_days(reg: Registry) -> None:
    for sub in _fleet(reg):
        sub.close()  # type: ignore[attr-defined]
    _age_everything(reg)
    # a new process's hub: its heartbeat thread prunes after its first beat
    with Registry.open(url=reg.url, root=reg.root_url) as other, other.subscribe("another-run", consumer="E", ttl=0.3):
        deadline = time.monotonic() + 60
        while len(_left(reg)) > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert _left(reg) == [("A", 1), ("C", 0)]  # what each closed consumer served last stays


def test_applying_a_lease_whose_record_was_pruned_is_a_one_line_refusal(reg: Registry) -> None:
    _publish(reg, 0)
    sub = reg.subscribe(RUN, consumer="gone", ttl=60)
    lease = next(sub.versions(timeout=0))
    lease.materialize()
    sub.close()  # ended: its unreleased load protects nothing any more
    _age_everything(reg)
    assert reg.prune_policy_loads(older_than=timedelta(days=30)) == 1
    with pytest.raises(InvalidStateError, match="no longer on record"):
        lease.applied()
