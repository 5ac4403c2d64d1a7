"""The object-store primitives (``registry.fs.objects``) against a real S3 server (SeaweedFS)."""

from __future__ import annotations

import logging

import pytest

from registry.errors import ObjectExistsError, ObjectNotFoundError, RootError, StorageError
from registry.fs.objects import ObjectConfig, ObjectLocation, ObjectRoot, is_object_url
from tests import s3server


def test_location_parses_and_normalises() -> None:
    loc = ObjectLocation.parse("s3://my-bucket/a/b/")
    assert (loc.bucket, loc.prefix) == ("my-bucket", "a/b")
    assert loc.key("run/step-00000001") == "a/b/run/step-00000001"
    assert loc.url("x") == "s3://my-bucket/a/b/x"
    assert ObjectLocation.parse("s3://my-bucket").url() == "s3://my-bucket"
    assert ObjectLocation.parse("s3://my-bucket/").key("k") == "k"
    assert is_object_url("s3://b/x") and not is_object_url("/tmp/x") and not is_object_url(None)


@pytest.mark.parametrize("url", ["s3://", "s3://UPPER/x", "s3://b/x/../y", "s3://bucket//x", "s3://bucket/./x",
                                 "s3://key:secret@bucket/x", "s3://bucket/x?versionId=1", "s3://ab"])
def test_location_refuses_bad_urls_in_one_line(url: str) -> None:
    with pytest.raises(RootError) as info:
        ObjectLocation.parse(url)
    assert "\n" not in str(info.value)
    assert "secret" not in str(info.value)


def test_config_from_environment_and_options_hides_secrets() -> None:
    env = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "very-secret-value",
           "AWS_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ALLOW_HTTP": "true"}
    config = ObjectConfig.resolve("b", {"region": "us-west-2", "token": "session-secret"}, environ=env)
    assert (config.region, config.endpoint, config.allow_http) == ("us-west-2", "http://127.0.0.1:9", True)
    assert config.session_token == "session-secret" and config.access_key_id == "AKIAEXAMPLE"
    shown = repr(config)
    assert "very-secret-value" not in shown and "session-secret" not in shown and "AKIAEXAMPLE" not in shown
    assert ObjectConfig.resolve("b", environ={}).endpoint_url == "https://s3.us-east-1.amazonaws.com"
    with pytest.raises(RootError):
        ObjectConfig.resolve("b", {"max_retries": "many"}, environ={})


def test_body_checksums_are_on_unless_turned_off() -> None:
    assert ObjectConfig.resolve("b", environ={}).store_config()["checksum_algorithm"] == "sha256"
    off = ObjectConfig.resolve("b", {"checksum_algorithm": "NONE"}, environ={})
    assert not off.checksum and "checksum_algorithm" not in off.store_config()
    with pytest.raises(RootError, match="checksum_algorithm"):
        ObjectConfig.resolve("b", {"checksum_algorithm": "md5"}, environ={})


def test_primitives_against_the_server(s3_root: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    root = ObjectRoot.open(s3_root)
    root.put("run/a-1/small", b"hello")
    with pytest.raises(ObjectExistsError):
        root.put("run/a-1/small", b"again")
    assert bytes(root.get("run/a-1/small")) == b"hello"
    big = bytes(range(256)) * (80 * 1024)  # 20 MiB: three parts
    root.upload("run/a-1/big", big)
    out = root.writer("run/a-1/streamed")
    for i in range(0, len(big), 3 << 20):
        out.write(big[i:i + (3 << 20)])
    out.close()
    assert bytes(root.get("run/a-1/streamed")) == big
    head = root.head("run/a-1/big")
    assert head is not None and head.size == len(big)
    assert root.head("run/a-1/missing") is None
    parts = root.get_ranges("run/a-1/big", [0, 100, len(big) - 5], [10, 200, len(big)])
    assert [bytes(p) for p in parts] == [big[0:10], big[100:200], big[-5:]]
    with pytest.raises(ObjectNotFoundError):
        root.get("run/a-1/missing")
    assert [e.rel for e in root.list("run")] == ["run/a-1/big", "run/a-1/small", "run/a-1/streamed"]
    assert root.list("ru") == []  # whole segments only
    root.delete(["run/a-1/big", "run/a-1/small", "run/a-1/never-there"])
    assert [e.rel for e in root.list("run")] == ["run/a-1/streamed"]
    assert s3server.SECRET_KEY not in caplog.text


def test_marker_create_only_then_rebind(s3_root: str) -> None:
    root = ObjectRoot.open(s3_root)
    assert root.read_marker() is None
    root.write_marker("cat-1", bound_from="here")
    root.write_marker("cat-1", bound_from="there")  # the same catalog, bound first by another opener
    with pytest.raises(RootError):
        root.write_marker("cat-2", bound_from="here")
    assert root.read_marker() == "cat-1"
    root.write_marker("cat-2", bound_from="here", overwrite=True)
    assert root.read_marker() == "cat-2"
    root.put(".registry/root.json", b"not json", create_only=False)
    with pytest.raises(RootError):
        root.read_marker()


def test_missing_bucket_and_wrong_secret_are_one_line_storage_errors(s3_env: s3server.Server) -> None:
    with pytest.raises(StorageError) as info:
        ObjectRoot.open("s3://no-such-bucket-here/x", {"max_retries": 0})
    assert "does not exist" in str(info.value) and "\n" not in str(info.value)
    assert "never creates one" in str(info.value) and "aws s3 mb" in str(info.value)  # says how to make it
    bucket = s3server.new_bucket(s3_env)
    with pytest.raises(StorageError) as info:
        ObjectRoot.open(f"s3://{bucket}/x", {"secret_access_key": "wrong-secret-value", "max_retries": 0})
    assert "access denied" in str(info.value)
    assert "wrong-secret-value" not in str(info.value) and s3server.SECRET_KEY not in str(info.value)


def test_server_down_is_a_storage_error_in_seconds(s3_env: s3server.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(StorageError) as info:
        ObjectRoot.open("s3://some-bucket/x", {"max_retries": 1, "retry_timeout": 2})
    assert "s3://some-bucket/x" in str(info.value) and "\n" not in str(info.value)
