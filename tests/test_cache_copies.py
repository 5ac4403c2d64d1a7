"""A host's cached download of a step is a copy with a row of its own (``cache:<tier id>``), never the row of its
fast directory: a host holding an older payload of a step in its fast directory and the step's new payload in its
cache keeps both rows, so fsck removes the older directory as superseded (never as damage), and a cache copy
never keeps a step alive once its durable copy goes. Real SeaweedFS, both catalog backends."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from sqlalchemy import text

from registry import Registry
from registry.catalog.replicas import DURABLE
from registry.catalog.session import alembic_config, head_revision, make_engine, upgrade
from registry.ops.tiercache import cache_relpath
from registry.records import Status
from registry.retention import KeepLast
from tests.helpers import assert_state_equal, make_state


def test_a_host_that_loads_another_hosts_overwrite_keeps_the_row_of_its_older_fast_copy(
        catalog_url: str, s3_root: str, tmp_path: Path) -> None:
    """B publishes step 1 (durable); A publishes it again (durable); B loads it: A's payload, through B's cache.
    B's older fast directory and B's cached copy are two rows; fsck on B removes the older directory as
    superseded and then finds nothing; durable retention then deletes the durable copy (A's fast copy stays)
    and nothing on B condemns the step."""
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    with Registry.open(catalog_url, root=host_b, durable=s3_root) as b:
        older = b.publish("run", 1, make_state(1), durable=True)
    with Registry.open(catalog_url, root=host_a, durable=s3_root) as a:
        new = a.publish("run", 1, make_state(11), overwrite=True, durable=True)
        a.publish("run", 2, make_state(2), durable=True)  # step 1 is neither @latest nor @latest-durable
    assert older.manifest_sha256 != new.manifest_sha256
    with Registry.open(catalog_url, root=host_b, durable=s3_root) as b:
        assert b.tiers is not None
        assert_state_equal(b.load("run@1").state_dict, make_state(11))
        mine = {r.location: (r.path, r.manifest_sha256, r.status) for r in b.replicas("run", 1)
                if r.location in (b.tiers.location, b.tiers.cache_location)}
        assert mine == {b.tiers.location: ("run/step-00000001", older.manifest_sha256, "verified"),
                        b.tiers.cache_location: (cache_relpath(new), new.manifest_sha256, "verified")}
        repaired = b.fsck(repair=True)
        assert [(p.kind, p.step) for p in repaired.problems] == [("superseded-fast-copy", 1)], repaired.problems
        assert not (host_b / "run" / "step-00000001").exists() and (host_b / cache_relpath(new)).is_dir()
        assert b.fsck().problems == ()
        assert b.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
        result = b.plan_tier_retention("run", KeepLast(1), tier="durable").execute()
        assert result.deleted == (1,) and result.ended == ()  # A's fast copy stays: the step is live
        assert b.fsck(repair=True).problems == () and b.fsck().problems == ()
        [verified] = b.verify("run@1")  # B holds no copy of the step's payload but in its cache: no verdict
        assert verified.status != Status.CORRUPT
        assert b.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
        assert not [e for e in b.events("run", step=1) if e.kind == "corrupt"]
    with Registry.open(catalog_url, root=host_a, durable=s3_root) as a:
        assert_state_equal(a.load("run@1").state_dict, make_state(11))  # from A's fast copy
        assert a.fsck().problems == ()


def test_durable_retention_before_fsck_never_condemns_the_step_on_the_host_with_an_older_payload(
        catalog_url: str, s3_root: str, tmp_path: Path) -> None:
    """As above, but the durable copy goes before B's fsck runs: the older directory is still superseded."""
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    with Registry.open(catalog_url, root=host_b, durable=s3_root) as b:
        b.publish("run", 1, make_state(1), durable=True)
    with Registry.open(catalog_url, root=host_a, durable=s3_root) as a:
        a.publish("run", 1, make_state(11), overwrite=True, durable=True)
        a.publish("run", 2, make_state(2), durable=True)
    with Registry.open(catalog_url, root=host_b, durable=s3_root) as b:
        assert_state_equal(b.load("run@1").state_dict, make_state(11))
        result = b.plan_tier_retention("run", KeepLast(1), tier="durable").execute()
        assert result.deleted == (1,) and result.ended == ()
        repaired = b.fsck(repair=True)
        assert [(p.kind, p.step) for p in repaired.problems] == [("superseded-fast-copy", 1)], repaired.problems
        assert b.fsck().problems == ()
        assert b.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
    with Registry.open(catalog_url, root=host_a, durable=s3_root) as a:
        assert_state_equal(a.load("run@1").state_dict, make_state(11))


def test_a_cached_copy_does_not_keep_a_step_alive_when_its_durable_copy_goes(
        catalog_url: str, s3_root: str, tmp_path: Path) -> None:
    """A publishes steps 1 and 2 (durable); B loads step 1 (its cache); A's fast retention drops A's copy of step
    1. Deleting its durable copy now ends the step: B's cached copy is no copy a load reads without it."""
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    with Registry.open(catalog_url, root=host_a, durable=s3_root) as a:
        one = a.publish("run", 1, make_state(1), durable=True)
        a.publish("run", 2, make_state(2), durable=True)
        with Registry.open(catalog_url, root=host_b, durable=s3_root) as b:
            assert_state_equal(b.load("run@1").state_dict, make_state(1))
            assert (host_b / cache_relpath(one)).is_dir()
            assert a.plan_tier_retention("run", KeepLast(1), tier="fast").execute().deleted == (1,)
            plan = b.plan_tier_retention("run", KeepLast(1), tier="durable")
            assert [(d.step, d.ends_step) for d in plan.decisions if d.action == "delete"] == [(1, True)]
            result = plan.execute()
            assert result.ended == (1,)
            assert b.catalog.get("run", 1).status == Status.DELETED  # type: ignore[union-attr]
            assert not (host_b / cache_relpath(one)).exists()  # B's plan removed B's cached copy with the step
            assert [r.status for r in b.replicas("run", 1)] == ["deleted"] * len(b.replicas("run", 1))
            assert b.fsck().problems == () and a.fsck().problems == ()


def test_fast_retention_deletes_a_cached_copy_as_a_copy_of_its_own(catalog_url: str, s3_root: str,
                                                                   tmp_path: Path) -> None:
    """B caches steps 1 and 2; B's fast-tier plan takes its cached copy of step 1 (its only copy on B), at its
    cache's location: the step stays live on A's fast copy and the durable copy."""
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    with Registry.open(catalog_url, root=host_a, durable=s3_root) as a:
        one = a.publish("run", 1, make_state(1), durable=True)
        a.publish("run", 2, make_state(2), durable=True)
    with Registry.open(catalog_url, root=host_b, durable=s3_root) as b:
        assert b.tiers is not None
        b.load("run@1")
        b.load("run@2")
        plan = b.plan_tier_retention("run", KeepLast(1), tier="fast")
        [doomed] = [d for d in plan.decisions if d.action == "delete"]
        assert (doomed.step, doomed.location, doomed.path, doomed.ends_step) == (
            1, b.tiers.cache_location, cache_relpath(one), False)
        assert plan.execute().deleted == (1,)
        assert not (host_b / cache_relpath(one)).exists()
        rows = {r.location: r.status for r in b.replicas("run", 1)}
        assert rows[b.tiers.cache_location] == "deleted" and rows[DURABLE] == "verified"
        assert b.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
        assert b.fsck().problems == ()
        assert_state_equal(b.load("run@1").state_dict, make_state(1))  # downloaded again


def test_the_upgrade_moves_cache_rows_recorded_at_a_fast_location_to_the_cache(catalog_url: str) -> None:
    """0007 on a catalog written before it: a row at ``fast:<id>`` naming a path in the cache becomes the cache's
    row; a fast copy's row stays. Downgrading puts the cache row back where the step has no fast copy row."""
    engine = make_engine(catalog_url)
    try:
        upgrade(engine, "0006")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name, created_at) VALUES (1, 'r', CURRENT_TIMESTAMP)"))
            for cid in (1, 2):
                conn.execute(text(
                    "INSERT INTO checkpoints (id, run_id, step, status, path, epoch, consumed_samples, "
                    "manifest_sha256, total_bytes, created_at, updated_at) VALUES (:id, 1, :id, 'verified', 'p', "
                    "0, 0, :digest, 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"), {"id": cid, "digest": "a" * 64})
            for cid, location, path in ((1, "fast:t1", ".registry/cache/r/step-00000001-aaaa"),
                                        (2, "fast:t1", "r/step-00000002"), (2, "durable", "r/step-00000002/x")):
                conn.execute(text(
                    "INSERT INTO checkpoint_replicas (checkpoint_id, location, status, path, manifest_sha256, "
                    "created_at, updated_at) VALUES (:cid, :location, 'verified', :path, :digest, "
                    "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"),
                    {"cid": cid, "location": location, "path": path, "digest": "a" * 64})
        assert upgrade(engine) == ("0006", head_revision())

        def rows() -> list[tuple[int, str, str]]:
            with engine.connect() as conn:
                return [tuple(r) for r in conn.execute(text(  # type: ignore[misc]
                    "SELECT checkpoint_id, location, path FROM checkpoint_replicas ORDER BY checkpoint_id, location")
                )]
        assert rows() == [(1, "cache:t1", ".registry/cache/r/step-00000001-aaaa"), (2, "durable", "r/step-00000002/x"),
                          (2, "fast:t1", "r/step-00000002")]
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO checkpoint_replicas (checkpoint_id, location, status, path, manifest_sha256, created_at, "
                "updated_at) VALUES (2, 'cache:t1', 'verified', '.registry/cache/r/step-00000002-aaaa', :digest, "
                "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"), {"digest": "a" * 64})
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0006")
        assert rows() == [(1, "fast:t1", ".registry/cache/r/step-00000001-aaaa"),
                          (2, "durable", "r/step-00000002/x"), (2, "fast:t1", "r/step-00000002")]
    finally:
        engine.dispose()
