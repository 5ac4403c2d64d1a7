"""Faults on an ``s3://`` root, against a real SeaweedFS (a private one where the test kills it).

The server killed in the middle of an upload, a 503 SlowDown storm (a
loopback proxy answers 503 for a while, then forwards), the bucket gone, the
server down under fsck, gc and verify: each is one line of ``StorageError``,
the claimed row ends ``failed`` (or is restored, for an overwrite), what was
published is untouched, a retry works once the server is back, and
``fsck --repair`` then leaves no orphan prefix and no incomplete upload.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from registry import Registry
from registry.errors import StorageError
from registry.fs import multipart
from registry.records import Status
from registry.retention import KeepLast
from tests import s3proxy, s3server
from tests.helpers import assert_state_equal, make_state
from tests.test_s3_maintenance import prefixes, repaired_clean, uploads

FAST = {"max_retries": 2, "retry_timeout": 5}  # a dead server answers in seconds


def big_state(seed: int) -> dict[str, torch.Tensor]:
    """Three 8 MiB parts' worth: uploaded as a multipart upload."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5 << 20, generator=g), "b": torch.randn(16, generator=g)}


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and s3server.SECRET_KEY not in text and s3server.ACCESS_KEY not in text
    return text


class Private:
    """A server of a test's own, which the test kills and starts again (same ports, same data)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.server = s3server.start(directory)
        self.marker = s3server.put_marker(self.server)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def kill(self) -> None:
        self.server.stop(kill=True)

    def restart(self) -> None:
        """Start it again; back once it serves what it held (a loaded machine answers 500 for a while before)."""
        self.server = s3server.start(self.directory, ports=self.server.ports)
        s3server.wait_readable(self.server, self.marker)


@pytest.fixture
def private(tmp_path: Path, s3_env: s3server.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Private]:
    """A private server, with the AWS environment pointed at it."""
    server = Private(tmp_path / "weed")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
    try:
        yield server
    finally:
        server.kill()


@pytest.mark.usefixtures("migrated_url")
def test_server_killed_mid_upload(catalog_url: str, private: Private) -> None:
    bucket = s3server.new_bucket(private.server)
    with s3proxy.running(private.endpoint) as proxy:
        options = {**FAST, "endpoint": proxy.endpoint}
        with Registry.open(catalog_url, root=f"s3://{bucket}/ckpt", storage_options=options) as reg:
            reg.publish("run", 1, make_state(1))
            reg.publish("run", 2, make_state(2))
            before = {s: reg.resolve(f"run@{s}") for s in (1, 2)}
            parts = 0

            def kill_at_second_part(seen: s3proxy.Seen) -> None:
                nonlocal parts
                if "partNumber" in seen.query:
                    parts += 1
                    if parts == 2:
                        private.kill()

            proxy.before = kill_at_second_part
            with pytest.raises(StorageError) as caught:
                reg.publish("run", 3, big_state(3))
            assert "s3://" in one_line(caught.value)
            assert reg.catalog.get("run", 3).status == Status.FAILED
            with pytest.raises(StorageError):  # an overwrite of a published step, server still down
                reg.publish("run", 2, big_state(22), overwrite=True)
            two = reg.catalog.get("run", 2)
            assert (two.status, two.path, two.manifest_sha256) == (before[2].status, before[2].path,
                                                                    before[2].manifest_sha256)
            with pytest.raises(StorageError):
                reg.fsck()  # the server's trouble: fsck judges nothing
            assert [reg.catalog.get("run", s).status for s in (1, 2)] == [before[1].status, before[2].status]

            proxy.before = None
            private.restart()
            assert_state_equal(reg.load("run@2").state_dict, make_state(2))
            info = reg.publish("run", 3, big_state(3))  # the retry works
            assert info.status == Status.VERIFIED
            assert_state_equal(reg.load("run@3").state_dict, big_state(3))
            repaired_clean(reg)


@pytest.mark.usefixtures("migrated_url")
def test_slow_down_storm(catalog_url: str, s3_env: s3server.Server) -> None:
    bucket = s3server.new_bucket(s3_env)
    with s3proxy.running(s3_env.endpoint) as proxy:
        options = {**FAST, "endpoint": proxy.endpoint}
        with Registry.open(catalog_url, root=f"s3://{bucket}/ckpt", storage_options=options) as reg:
            reg.publish("run", 1, make_state(1))
            published = reg.resolve("run@1")

            proxy.slow_down = 2  # within the retries: S3 says retry, and the retry succeeds
            assert reg.publish("run", 2, make_state(2)).status == Status.VERIFIED
            assert proxy.slow_down == 0

            proxy.slow_down = 10_000  # a storm longer than the retries
            with pytest.raises(StorageError) as caught:
                reg.publish("run", 3, make_state(3))
            assert "503" in one_line(caught.value)
            with pytest.raises(StorageError):
                reg.publish("run", 1, make_state(11), overwrite=True)
            assert reg.catalog.get("run", 3).status == Status.FAILED
            with pytest.raises(StorageError):
                reg.fsck()
            assert reg.catalog.get("run", 1).manifest_sha256 == published.manifest_sha256

            proxy.slow_down = 0
            assert_state_equal(reg.load("run@1").state_dict, make_state(1))
            assert reg.publish("run", 3, make_state(3)).status == Status.VERIFIED
            proxy.slow_down = 2
            assert reg.objects is not None
            assert uploads(reg) == []  # the signed listing retries through the storm too
            repaired_clean(reg)


@pytest.mark.usefixtures("migrated_url")
def test_credentials_refused_after_open(catalog_url: str, s3_env: s3server.Server) -> None:
    bucket = s3server.new_bucket(s3_env)
    with s3proxy.running(s3_env.endpoint) as proxy:
        options = {**FAST, "endpoint": proxy.endpoint}
        with Registry.open(catalog_url, root=f"s3://{bucket}/ckpt", storage_options=options) as reg:
            reg.publish("run", 1, make_state(1))
            proxy.wrong_signature = True
            with pytest.raises(StorageError, match="access denied") as caught:
                reg.publish("run", 2, make_state(2))
            one_line(caught.value)
            with pytest.raises(StorageError, match="access denied"):
                reg.publish("run", 1, make_state(11), overwrite=True)
            assert reg.catalog.get("run", 2).status == Status.FAILED
            with pytest.raises(StorageError):
                reg.fsck(repair=True)
            assert [r.status for r in reg.verify("run")] == ["unreadable"]
            assert reg.catalog.get("run", 1).status == Status.VERIFIED

            proxy.wrong_signature = False
            assert_state_equal(reg.load("run@1").state_dict, make_state(1))
            assert reg.publish("run", 2, make_state(2)).status == Status.VERIFIED
            repaired_clean(reg)


@pytest.mark.usefixtures("migrated_url")
@pytest.mark.parametrize("size", ["small", "multipart"])
def test_a_byte_changed_on_the_wire_is_refused_not_published(catalog_url: str, s3_env: s3server.Server,
                                                             size: str) -> None:
    """Every PUT and part carries its body's sha256, which the server checks: a flipped byte on the wire fails
    the request (a server need not check the signed payload hash, and SeaweedFS does not)."""
    bucket = s3server.new_bucket(s3_env)
    state = make_state if size == "small" else big_state
    with s3proxy.running(s3_env.endpoint) as proxy:
        options = {**FAST, "endpoint": proxy.endpoint}
        with Registry.open(catalog_url, root=f"s3://{bucket}/ckpt", storage_options=options) as reg:
            reg.publish("run", 1, state(1))
            published = reg.resolve("run@1")
            proxy.flip_put_bodies = 1
            with pytest.raises(StorageError) as caught:
                reg.publish("run", 2, state(2))
            one_line(caught.value)
            assert proxy.flip_put_bodies == 0
            assert reg.catalog.get("run", 2).status == Status.FAILED
            assert reg.resolve("run@latest").manifest_sha256 == published.manifest_sha256
            assert reg.publish("run", 2, state(2)).status == Status.VERIFIED
            assert_state_equal(reg.load("run@2").state_dict, state(2))
            assert [r.status for r in reg.verify("run")] == [Status.VERIFIED] * 2
            repaired_clean(reg)


@pytest.mark.usefixtures("migrated_url")
def test_without_body_checksums_a_changed_byte_is_stored_and_verify_finds_it(catalog_url: str,
                                                                            s3_env: s3server.Server) -> None:
    """What the checksum header guards against: the server stores what it got, signed or not."""
    bucket = s3server.new_bucket(s3_env)
    with s3proxy.running(s3_env.endpoint) as proxy:
        options = {**FAST, "endpoint": proxy.endpoint, "checksum_algorithm": "none"}
        with Registry.open(catalog_url, root=f"s3://{bucket}/ckpt", storage_options=options) as reg:
            proxy.flip_put_bodies = 1  # the first PUT of a publish is its largest file, the weights
            reg.publish("run", 1, make_state(1))
            assert [r.status for r in reg.verify("run")] == [Status.CORRUPT]


@pytest.mark.usefixtures("migrated_url")
def test_bucket_gone_after_open(catalog_url: str, s3_env: s3server.Server) -> None:
    """fsck, verify and load never take a missing bucket for missing steps. (SeaweedFS makes a bucket on
    the first PUT, so a publish here would recreate it; on AWS that PUT fails NoSuchBucket.)"""
    bucket = s3server.new_bucket(s3_env)
    with Registry.open(catalog_url, root=f"s3://{bucket}/ckpt", storage_options=FAST) as reg:
        reg.publish("run", 1, make_state(1))
        reg.publish("run", 2, make_state(2))
        assert reg.objects is not None
        reg.objects.delete(e.rel for e in reg.objects.list())
        multipart.request(reg.objects.config, "DELETE", ok=frozenset({204}))  # DeleteBucket
        with pytest.raises(StorageError, match="bucket does not exist") as caught:
            reg.fsck(repair=True)
        one_line(caught.value)
        with pytest.raises(StorageError, match="bucket does not exist"):
            reg.objects.check_bucket()
        assert [r.status for r in reg.verify("run")] == ["unreadable"] * 2
        assert [reg.catalog.get("run", s).status for s in (1, 2)] == [Status.VERIFIED, Status.VERIFIED]


@pytest.mark.usefixtures("migrated_url")
def test_server_down_under_gc_and_verify(catalog_url: str, private: Private) -> None:
    bucket = s3server.new_bucket(private.server)
    with Registry.open(catalog_url, root=f"s3://{bucket}/ckpt", storage_options=FAST) as reg:
        for step in (1, 2, 3):
            reg.publish("run", step, make_state(step))
        private.kill()
        results = reg.verify("run")
        assert [r.status for r in results] == ["unreadable"] * 3  # never a verdict on the server's trouble
        assert all(reg.catalog.get("run", s).status == Status.VERIFIED for s in (1, 2, 3))
        result = reg.apply_retention("run", KeepLast(1))
        assert result.deleted == (1, 2) and set(result.errors) == {1, 2}  # marked; keys not deleted yet
        assert all("s3://" in one_line(Exception(e)) for e in result.errors.values())

        private.restart()
        assert {k[1] for k in prefixes(reg)} == {1, 2, 3}
        result = reg.apply_retention("run", KeepLast(1))  # the next gc finishes the job
        assert result.healed == (1, 2) and not result.errors
        assert {k[1] for k in prefixes(reg)} == {3}
        repaired_clean(reg)
