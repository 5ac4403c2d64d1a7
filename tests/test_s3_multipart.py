"""Incomplete multipart uploads on a real S3 server (SeaweedFS): listed under a prefix, paged, aborted."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone

import pytest

from registry.errors import RegistryError, StorageError
from registry.fs import multipart
from tests import s3server


@dataclass(frozen=True, kw_only=True)
class Config:
    """The fields of ``ObjectConfig`` that signing reads, with other values than the root's."""

    endpoint_url: str
    region: str = s3server.REGION
    bucket: str
    access_key_id: str | None = s3server.ACCESS_KEY
    secret_access_key: str | None = s3server.SECRET_KEY
    session_token: str | None = None
    max_retries: int = 2


@pytest.fixture
def config(s3_server: s3server.Server) -> Config:
    return Config(endpoint_url=s3_server.endpoint, bucket=s3server.new_bucket(s3_server))


def test_signature_matches_the_aws_example() -> None:
    """AWS's published SigV4 example for S3 (GET /test.txt with a Range header, examplebucket)."""
    aws = Config(endpoint_url="https://examplebucket.s3.amazonaws.com", bucket="examplebucket",
                 access_key_id="AKIAIOSFODNN7EXAMPLE", secret_access_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    headers = multipart.sign(aws, "GET", "/test.txt", {}, payload_sha256=multipart.EMPTY_SHA256,
                             now=datetime(2013, 5, 24, tzinfo=timezone.utc), extra_headers={"Range": "bytes=0-9"})
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


def test_list_pages_filters_by_prefix_and_aborts(config: Config) -> None:
    started = [multipart.start_upload(config, f"ckpt/r/step-{i:02d}/a-{i:016x}/model.safetensors")
               for i in range(5)]
    multipart.upload_part(config, started[0], 1, b"x" * (5 << 20))
    outside = multipart.start_upload(config, "ckpt-other/r/step-01/a-0/model.safetensors")

    listed = list(multipart.list_uploads(config, "ckpt/", page_size=2))
    assert sorted(u.upload_id for u in listed) == sorted(u.upload_id for u in started)
    assert all(u.initiated is not None for u in listed)
    assert [u.key for u in multipart.list_uploads(config, "ckpt/r/step-03/")] == [started[3].key]

    for upload in listed:
        assert multipart.abort_upload(config, upload)
    assert list(multipart.list_uploads(config, "ckpt/")) == []
    assert [u.upload_id for u in multipart.list_uploads(config, "")] == [outside.upload_id]


def test_keys_with_odd_characters(config: Config) -> None:
    upload = multipart.start_upload(config, "ckpt/run a+b=c/step-1/é ü.pt")
    assert [u.key for u in multipart.list_uploads(config, "ckpt/run a+b=c/")] == [upload.key]
    multipart.abort_upload(config, upload)
    assert list(multipart.list_uploads(config, "ckpt/")) == []


def test_an_upload_left_by_a_killed_writer_is_found_and_aborted(config: Config,
                                                                 s3_server: s3server.Server) -> None:
    """obstore's own multipart writer, in a process that dies after sending parts, never completing."""
    key = "ckpt/r/step-07/a-00000000000000aa/model.safetensors"
    code = (f"import obstore, os\nfrom obstore.store import S3Store\n"
            f"store = S3Store({config.bucket!r}, config={s3_server.storage_options!r})\n"
            f"w = obstore.open_writer(store, {key!r}, buffer_size=5 << 20)\n"
            f"w.write(b'x' * (12 << 20))\nw.flush()\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    uploads = list(multipart.list_uploads(config, "ckpt/"))
    assert [u.key for u in uploads] == [key]
    multipart.abort_upload(config, uploads[0])
    assert list(multipart.list_uploads(config, "ckpt/")) == []


@pytest.mark.parametrize("fault", ["wrong-secret", "missing-bucket", "unreachable"])
def test_faults_are_one_line_storage_errors(config: Config, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multipart, "BACKOFF_S", 0.0)
    bad = {"wrong-secret": Config(endpoint_url=config.endpoint_url, bucket=config.bucket, secret_access_key="wrong"),
           "missing-bucket": Config(endpoint_url=config.endpoint_url, bucket=config.bucket + "-missing"),
           "unreachable": Config(endpoint_url="http://127.0.0.1:9", bucket=config.bucket)}[fault]
    with pytest.raises(StorageError) as caught:
        list(multipart.list_uploads(bad, "ckpt/"))
    assert isinstance(caught.value, RegistryError) and isinstance(caught.value, OSError)
    message = str(caught.value)
    assert "\n" not in message and f"s3://{bad.bucket}/" in message
    assert s3server.SECRET_KEY not in message and "wrong" not in message.split("s3://")[0]
    expected = {"wrong-secret": "403", "missing-bucket": "NoSuchBucket", "unreachable": "cannot reach"}[fault]
    assert expected in message
