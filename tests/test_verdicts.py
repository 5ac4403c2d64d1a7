"""Verdicts on bytes: what differs as received is read again from storage before anything is marked; a copy is
condemned, not the step, while another verified copy stands; verify restores what reads intact again; a
condemnation keeps a deduplicated run's fallback apart; a full cache disk is one line. Real SeaweedFS behind a
real proxy that damages one answer, both catalogs."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from registry import Registry
from registry.catalog.replicas import DURABLE, ReplicaCatalog
from registry.errors import CorruptCheckpointError, StorageError
from registry.records import Status
from registry.retention import KeepLast
from tests import s3proxy, s3server
from tests.helpers import assert_state_equal, flip_stored_byte, make_state
from tests.test_dedup_fate import flip, inodes_of, publish as publish_linked
from tests.test_tiers import damage_durable

WEIGHTS = "model.safetensors"


@contextmanager
def proxied(s3_env: s3server.Server) -> Iterator[tuple[s3proxy.Proxy, str, dict[str, Any]]]:
    """A proxy in front of the real server, a fresh bucket, and the storage options that go through it."""
    bucket = s3server.new_bucket(s3_env)
    with s3proxy.running(s3_env.endpoint) as proxy:
        yield proxy, f"s3://{bucket}/ckpt", {"endpoint": proxy.endpoint, "max_retries": 2, "retry_timeout": 5}


def kinds(reg: Registry, run: str, step: int) -> list[str]:
    return [e.kind for e in reg.events(run, step=step)]


def durable_rows(reg: Registry, run: str, step: int) -> list[str]:
    return [r.status for r in reg.replicas(run, step) if r.location == DURABLE]


# --------------------------------------------------------------------------- an s3:// root


@pytest.mark.usefixtures("migrated_url")
def test_a_byte_damaged_on_the_wire_is_read_again_and_the_step_stands(catalog_url: str,
                                                                      s3_env: s3server.Server) -> None:
    with proxied(s3_env) as (proxy, root, options), \
            Registry.open(catalog_url, root=root, storage_options=options) as reg:
        for step in (1, 2):
            reg.publish("run", step, make_state(step))
        proxy.flip_get_suffix = f"/{WEIGHTS}"
        ck = reg.load("run@latest")
        assert proxy.flip_get_suffix == ""  # the damaged answer was received
        assert ck.step == 2 and ck.fallback is None
        assert_state_equal(ck.state_dict, make_state(2))
        assert reg.catalog.get("run", 2).status == Status.VERIFIED  # type: ignore[union-attr]
        assert "corrupt" not in kinds(reg, "run", 2)
        reg.publish("run", 3, make_state(3))
        assert reg.apply_retention("run", KeepLast(2)).deleted == (1,)  # the good step is not taken for bad

        proxy.flip_get_suffix = f"/{WEIGHTS}"  # verify too: one damaged answer is no verdict
        assert [r.status for r in reg.verify("run@3")] == [Status.VERIFIED]
        assert proxy.flip_get_suffix == ""


@pytest.mark.usefixtures("migrated_url")
def test_bytes_changed_in_the_bucket_still_condemn_the_step(catalog_url: str, s3_env: s3server.Server) -> None:
    with proxied(s3_env) as (_, root, options), Registry.open(catalog_url, root=root, storage_options=options) as reg:
        for step in (1, 2):
            reg.publish("run", step, make_state(step))
        flip_stored_byte(reg, reg.resolve("run@2"), WEIGHTS)
        with pytest.warns(RuntimeWarning, match="falling back"):
            ck = reg.load("run@latest")
        assert ck.step == 1 and ck.fallback is not None
        assert reg.catalog.get("run", 2).status == Status.CORRUPT  # type: ignore[union-attr]


# --------------------------------------------------------------------------- a tiered root


@pytest.mark.usefixtures("migrated_url")
@pytest.mark.parametrize("damage", ["wire", "stored"])
def test_a_durable_copy_read_on_a_host_with_no_fast_copy(catalog_url: str, s3_env: s3server.Server, tmp_path: Path,
                                                        damage: str) -> None:
    """Host B holds no fast copy: it downloads the durable copy. One damaged answer is downloaded again, and the
    step loads from it; bytes changed in the bucket condemn the durable copy (not the step: host A's fast copy
    stands) and ``@latest`` goes on to the older step."""
    with proxied(s3_env) as (proxy, durable, options):
        with Registry.open(catalog_url, root=tmp_path / "host-a", durable=durable, storage_options=options) as a:
            for step in (1, 2):
                a.publish("run", step, make_state(step), durable=True)
            if damage == "stored":
                damage_durable(a, "run", 2)
        with Registry.open(catalog_url, root=tmp_path / "host-b", durable=durable, storage_options=options) as b:
            if damage == "wire":
                proxy.flip_get_suffix = f"/{WEIGHTS}"
                ck = b.load("run@latest")
                assert proxy.flip_get_suffix == ""
                assert ck.step == 2 and ck.fallback is None
                assert_state_equal(ck.state_dict, make_state(2))
                assert durable_rows(b, "run", 2) == ["verified"]
                assert "replica-corrupt" not in kinds(b, "run", 2)
            else:
                with pytest.warns(RuntimeWarning):
                    ck = b.load("run@latest")
                assert ck.step == 1 and ck.fallback is not None
                assert durable_rows(b, "run", 2) == ["corrupt"]
            assert b.catalog.get("run", 2).status == Status.VERIFIED  # type: ignore[union-attr]


@pytest.mark.usefixtures("migrated_url")
def test_verify_on_another_host_restores_a_durable_copy_marked_corrupt_whose_bytes_are_intact(
        catalog_url: str, s3_root: str, tmp_path: Path) -> None:
    with Registry.open(catalog_url, root=tmp_path / "host-a", durable=s3_root) as a:
        info = a.publish("run", 1, make_state(1), durable=True)
        copy = a.wait_durable("run", 1)
        assert ReplicaCatalog(a.catalog).set_replica_status(  # what a damaged answer once made of it
            "run", 1, DURABLE, "corrupt", path=copy.path, manifest_sha256=info.manifest_sha256,
            only_from=("verified",), reason="checksum mismatch as received")
    with Registry.open(catalog_url, root=tmp_path / "host-b", durable=s3_root) as b:
        [result] = b.verify("run@1")
        assert (result.status, result.ok) == (Status.VERIFIED, True), result
        assert durable_rows(b, "run", 1) == ["verified"]
        assert "replica-verified" in kinds(b, "run", 1)
        ck = b.load("run@latest")
        assert ck.step == 1 and ck.fallback is None
        assert_state_equal(ck.state_dict, make_state(1))


@pytest.mark.usefixtures("migrated_url")
def test_verify_restores_this_hosts_fast_copy_marked_corrupt_whose_bytes_are_intact(catalog_url: str,
                                                                                   s3_root: str,
                                                                                   tmp_path: Path) -> None:
    with Registry.open(catalog_url, root=tmp_path / "fast", durable=s3_root) as reg:
        info = reg.publish("run", 1, make_state(1), durable=True)
        assert reg.tiers is not None
        fast = next(r for r in reg.replicas("run", 1) if r.location == reg.tiers.location)
        assert ReplicaCatalog(reg.catalog).set_replica_status(
            "run", 1, reg.tiers.location, "corrupt", path=fast.path, manifest_sha256=info.manifest_sha256,
            only_from=("verified",))
        assert [r.status for r in reg.verify("run@1")] == [Status.VERIFIED]
        assert [(r.location == DURABLE, r.status) for r in reg.replicas("run", 1)] == [(True, "verified"),
                                                                                    (False, "verified")]


# --------------------------------------------------------------------------- dedup: the fallback stays apart


@pytest.mark.usefixtures("migrated_url")
@pytest.mark.parametrize("by", ["load", "verify", "fsck"])
def test_a_condemned_middle_step_leaves_the_newest_two_independent(catalog_url: str, root: Path, by: str) -> None:
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        states = {step: publish_linked(reg, "run", step) for step in (1, 2, 3)}
        one, two, three = (reg.resolve(f"run@{s}").path for s in (1, 2, 3))
        assert not inodes_of(one).isdisjoint(inodes_of(three))  # 3 linked 1's base (2 was in between)
        own = [f for f in sorted(two.iterdir()) if f.suffix == ".safetensors" and os.stat(f).st_nlink == 1]
        assert own, "step 2 must hold weights of its own for this test to mean anything"
        flip(own[0])
        if by == "load":
            with pytest.raises(CorruptCheckpointError):
                reg.load("run@2")
        elif by == "verify":
            assert [r.status for r in reg.verify("run@2")] == [Status.CORRUPT]
        else:
            assert reg.fsck(repair=True, checksums=True).repaired
        assert reg.catalog.get("run", 2).status == Status.CORRUPT  # type: ignore[union-attr]
        assert inodes_of(one).isdisjoint(inodes_of(three))
        for path in sorted(three.iterdir()):  # one bad byte anywhere in 3 now takes 3 alone
            original = path.read_bytes()
            flip(path)
            try:
                ck = reg.load("run@latest", resume=False)
                assert ck.step in (1, 3)
                assert_state_equal(ck.state_dict, states[ck.step])
            finally:
                with open(path, "r+b") as f:
                    f.write(original)
                if reg.catalog.get("run", 3).status == Status.CORRUPT:  # type: ignore[union-attr]
                    reg.verify("run@3")


# --------------------------------------------------------------------------- a full cache disk


@pytest.mark.usefixtures("migrated_url")
def test_a_download_onto_a_full_fast_disk_is_one_line_and_leaves_nothing(
        catalog_url: str, s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Registry.open(catalog_url, root=tmp_path / "host-a", durable=s3_root) as a:
        a.publish("run", 1, make_state(1), durable=True)
    fast_b = tmp_path / "host-b"
    with Registry.open(catalog_url, root=fast_b, durable=s3_root) as b:
        def full(fd: int, data: Any, *args: Any) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with monkeypatch.context() as m:
            m.setattr(os, "pwrite", full)
            m.setattr(os, "write", full)
            with pytest.raises(StorageError) as caught:
                b.load("run@1")
        text = str(caught.value)
        assert "\n" not in text and "No space left on device" in text
        cache = fast_b / ".registry" / "cache" / "run"
        assert str(cache) in text
        assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == []
        assert b.catalog.get("run", 1).status == Status.VERIFIED  # type: ignore[union-attr]
        assert durable_rows(b, "run", 1) == ["verified"]
        assert_state_equal(b.load("run@1").state_dict, make_state(1))  # room again: the download goes through
