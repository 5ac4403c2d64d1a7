"""An ``s3://`` checkpoint root against a real S3 server (SeaweedFS), on both catalog backends."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest
import torch

from registry import Registry
from registry.errors import (CorruptCheckpointError, InvalidStateError, RootError, RootMismatchError,
                             StorageError)
from registry.records import Status
from tests import s3server


@pytest.fixture
def s3reg(migrated_url: str, s3_root: str) -> Iterator[Registry]:
    with Registry.open(migrated_url, root=s3_root) as reg:
        yield reg


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(300, 200, generator=g), "layer.bias": torch.arange(7, dtype=torch.int64)}


def keys(reg: Registry, prefix: str = "") -> list[str]:
    assert reg.objects is not None
    return [e.rel for e in reg.objects.list(prefix)]


def test_publish_then_load_round_trip(s3reg: Registry, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    sd = state()
    info = s3reg.publish("run", 5, sd, extra={"opt": {"lr": 0.1, "m": torch.ones(4)}}, config={"d": 1},
                         metrics={"loss": 0.5}, tags=["best"])
    assert info.status == Status.VERIFIED
    assert not info.path.is_absolute() and info.path.parts[:2] == ("run", "step-00000005")
    assert info.url == f"{s3reg.root_url}/{info.path.as_posix()}"
    assert info.to_json()["url"] == info.url
    assert sorted(k.rsplit("/", 1)[1] for k in keys(s3reg, info.path.as_posix())) == [
        "config.json", "manifest.json", "meta.json", "model.safetensors", "opt.pt"]
    for ref in ("run@latest", "run@5", "run@best", "run@best:loss"):
        assert s3reg.resolve(ref).url == info.url
    assert [i.url for i in s3reg.checkpoints("run")] == [info.url]
    ck = s3reg.load("run@latest")
    assert all(torch.equal(ck.state_dict[k], v) for k, v in sd.items())
    assert ck.extra["opt"]["lr"] == 0.1 and torch.equal(ck.extra["opt"]["m"], torch.ones(4))
    assert ck.config == {"d": 1}
    only = s3reg.load("run@5", extras=False)
    assert only.extra == {}
    assert s3server.SECRET_KEY not in caplog.text and s3server.ACCESS_KEY not in caplog.text


def test_sharded_weights_and_unverified_publish(s3reg: Registry) -> None:
    sd = {f"t{i}": torch.full((1000,), float(i)) for i in range(6)}
    info = s3reg.publish("run", 1, sd, max_shard_size=10_000, verify=False)
    assert info.status == Status.PUBLISHED
    names = {k.rsplit("/", 1)[1] for k in keys(s3reg, info.path.as_posix())}
    assert "model.safetensors.index.json" in names and len([n for n in names if n.startswith("model-")]) > 1
    ck = s3reg.load("run@1")
    assert all(torch.equal(ck.state_dict[k], v) for k, v in sd.items())


def test_corrupt_latest_falls_back_and_is_marked(s3reg: Registry) -> None:
    s3reg.publish("run", 1, state(1))
    bad = s3reg.publish("run", 2, state(2))
    assert s3reg.objects is not None
    key = f"{bad.path.as_posix()}/model.safetensors"
    raw = bytearray(s3reg.objects.get(key))
    raw[-3] ^= 0xFF  # same size, one flipped byte in the last tensor
    obstore.put(s3reg.objects.store, key, bytes(raw))
    ck = s3reg.load("run@latest")
    assert ck.step == 1 and ck.fallback is not None and [s.step for s in ck.fallback.skipped] == [2]
    assert s3reg.catalog.get("run", 2).status == Status.CORRUPT
    with pytest.raises(CorruptCheckpointError):
        s3reg.load("run@2")


def test_a_listed_object_gone_is_corruption_a_gone_manifest_is_not(s3reg: Registry) -> None:
    first = s3reg.publish("run", 1, state(1), extra={"rng": {"seed": 1}})
    assert s3reg.objects is not None
    s3reg.objects.delete([f"{first.path.as_posix()}/rng.pt"])
    with pytest.raises(CorruptCheckpointError, match="missing"):
        s3reg.load("run@1", extras=False)
    second = s3reg.publish("run", 2, state(2))
    s3reg.objects.delete([f"{second.path.as_posix()}/manifest.json"])
    with pytest.raises(Exception, match="manifest is missing") as info:
        s3reg.load("run@2")
    assert not isinstance(info.value, CorruptCheckpointError)
    assert s3reg.catalog.get("run", 2).status == Status.VERIFIED


def test_overwrite_uploads_a_new_prefix_and_deletes_the_old(s3reg: Registry) -> None:
    old = s3reg.publish("run", 3, state(1))
    new = s3reg.publish("run", 3, state(2), overwrite=True)
    assert new.path != old.path and new.path.parent == old.path.parent
    assert keys(s3reg, old.path.as_posix()) == []
    assert len(keys(s3reg, new.path.as_posix())) == 4
    assert torch.equal(s3reg.load("run@3").state_dict["layer.weight"], state(2)["layer.weight"])


def test_background_publish(s3reg: Registry) -> None:
    futures = [s3reg.publish("run", step, state(step), blocking=False) for step in (1, 2, 3)]
    s3reg.wait()
    assert [f.result().step for f in futures] == [1, 2, 3]
    assert all(f.result().url is not None for f in futures)
    assert s3reg.load("run@latest").step == 3


def test_dedup_is_refused_in_one_line(s3reg: Registry, catalog_url: str, s3_root: str) -> None:
    with pytest.raises(InvalidStateError, match="dedup is not supported"):
        s3reg.publish("run", 1, state(), dedup=True)
    with pytest.raises(InvalidStateError, match="dedup is not supported on an s3:// root"):
        Registry.open(catalog_url, root=s3_root, dedup=True)
    assert s3reg.catalog.get("run", 1) is None


def test_open_needs_a_catalog_url(s3_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REGISTRY_URL", raising=False)
    with pytest.raises(RootError, match="needs an explicit catalog URL") as info:
        Registry.open(root=s3_root)
    assert "\n" not in str(info.value)
    monkeypatch.setenv("REGISTRY_ROOT", s3_root)
    with pytest.raises(RootError, match="needs an explicit catalog URL"):
        Registry.open()


def test_open_with_storage_options_and_no_environment(catalog_url: str, s3_server: s3server.Server,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3server.new_bucket(s3_server)
    for name in s3_server.env:
        monkeypatch.delenv(name, raising=False)
    with Registry.open(catalog_url, root=f"s3://{bucket}/deep/prefix/", storage_options=s3_server.storage_options,
                       ) as reg:
        info = reg.publish("run", 1, state())
        assert info.url is not None and info.url.startswith(f"s3://{bucket}/deep/prefix/run/step-00000001/a-")
        shown = repr(reg) + repr(reg.objects) + repr(reg.objects.config if reg.objects else None)
        assert s3server.SECRET_KEY not in shown and s3server.ACCESS_KEY not in shown
        assert s3server.SECRET_KEY not in json.dumps(info.to_json())


def test_missing_bucket_and_bad_credentials_fail_at_open(catalog_url: str, s3_env: s3server.Server,
                                                         tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="bucket does not exist") as info:
        Registry.open(catalog_url, root="s3://no-such-bucket-x1/ckpt")
    assert "\n" not in str(info.value)
    bucket = s3server.new_bucket(s3_env)
    with pytest.raises(StorageError, match="access denied") as info:
        Registry.open(catalog_url, root=f"s3://{bucket}/ckpt", storage_options={"secret_access_key": "not-it-at-all"})
    assert "not-it-at-all" not in str(info.value)


def test_root_is_bound_to_its_catalog(catalog_url: str, s3_root: str, tmp_path: Path) -> None:
    with Registry.open(catalog_url, root=s3_root) as reg:
        reg.publish("run", 1, state())
        assert reg.objects is not None and reg.objects.read_marker() is not None
    other = f"sqlite:///{tmp_path / 'other.db'}"
    with pytest.raises(RootMismatchError, match="bound to another catalog"):
        Registry.open(other, root=s3_root)
    with Registry.open(catalog_url, root=s3_root, create=False) as again:  # the same catalog: accepted
        assert again.load("run@1").step == 1
    with Registry.open(other, root=s3_root, rebind_root=True) as rebound:
        assert rebound.objects is not None and rebound.objects.read_marker() is not None
    with pytest.raises(RootMismatchError):
        Registry.open(catalog_url, root=s3_root)


def test_server_trouble_marks_nothing(catalog_url: str, s3_env: s3server.Server, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    server = s3server.start(tmp_path / "private")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        bucket = s3server.new_bucket(server)
        with Registry.open(catalog_url, root=f"s3://{bucket}/ckpt",
                           storage_options={"max_retries": 0, "retry_timeout": 2}) as reg:
            reg.publish("run", 1, state(1))
            reg.publish("run", 2, state(2))
            server.stop(kill=True)
            with pytest.raises(StorageError) as info:
                reg.load("run@latest")
            assert "\n" not in str(info.value)
            assert [reg.catalog.get("run", s).status for s in (1, 2)] == [Status.VERIFIED, Status.VERIFIED]
            with pytest.raises(StorageError):
                reg.publish("run", 3, state(3))
            assert reg.catalog.get("run", 3).status == Status.FAILED
    finally:
        server.stop(kill=True)


def test_broadcast_without_a_process_group_loads_from_the_bucket(s3reg: Registry) -> None:
    s3reg.publish("run", 1, state(1))
    ck = s3reg.load("run@latest", broadcast=True)
    assert ck.step == 1 and torch.equal(ck.state_dict["layer.bias"], state(1)["layer.bias"])


def test_directory_only_operations_refuse_in_one_line_marking_nothing(s3reg: Registry, tmp_path: Path) -> None:
    s3reg.publish("run", 1, state(1))
    # verify works on an s3:// root (tests/test_s3_maintenance.py)
    for call in (lambda: s3reg.diff("run@1", "run@1"), lambda: s3reg.import_checkpoint(tmp_path, run="other", step=1)):
        with pytest.raises(RootError, match="needs a filesystem checkpoint root") as info:
            call()
        assert "\n" not in str(info.value)
    assert s3reg.catalog.get("run", 1).status == Status.VERIFIED
