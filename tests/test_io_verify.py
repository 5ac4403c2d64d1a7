"""Checksums on the publish and load paths: sha256 for compatibility and scrubs, xxh3 for loads."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from registry import CorruptCheckpointError, ManifestError, Registry
from registry.manifest import MANIFEST, WEIGHTS, read_manifest
from registry.store import Payload, check_written, read_directory, verify_directory, write_payload
from tests.conftest import assert_state_equal, make_state

SEED = Path(__file__).resolve().parents[1].parent / "shared" / "seed"


def payload(seed: int = 0) -> Payload:
    return Payload(state_dict=make_state(seed), meta={"timestamp": "t", "epoch": 0}, config={"a": 1},
                   extra={"optimizer": {"step": torch.tensor(3.0)}})


def flip_byte(path: Path, offset: int = -1) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_manifest_records_both_digests_of_the_bytes_on_disk(tmp_path: Path) -> None:
    staging = tmp_path / "s"
    staging.mkdir()
    written = write_payload(staging, payload())
    doc = json.loads((staging / MANIFEST).read_text())
    assert set(doc) >= {"format_version", "created_at", "optimizer_step", "policy_version", "tensors", "files"}
    for name, entry in doc["files"].items():
        raw = (staging / name).read_bytes()
        assert entry == {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                         "xxh3_128": xxhash.xxh3_128_hexdigest(raw)}
    assert check_written(staging, written) == []
    assert verify_directory(staging) == []


def test_check_written_catches_what_the_filesystem_lost(tmp_path: Path) -> None:
    staging = tmp_path / "s"
    staging.mkdir()
    written = write_payload(staging, payload())
    weights = staging / WEIGHTS
    raw = weights.read_bytes()
    with open(weights, "r+b") as f:
        f.write(b"\xff" * 8)  # header length now absurd; same size
    assert [p.name for p in check_written(staging, written)] == [WEIGHTS]
    weights.write_bytes(raw[:-1])
    assert "size" in check_written(staging, written)[0].problem
    weights.write_bytes(raw)
    (staging / MANIFEST).write_text((staging / MANIFEST).read_text() + " ")
    assert [p.name for p in check_written(staging, written)] == [MANIFEST]


def test_load_checks_xxh3_and_scrub_checks_sha256(reg: Registry) -> None:
    state = make_state(4)
    info = reg.publish("run", 1, state)
    assert info.status == "verified"
    manifest, _ = read_manifest(info.path)
    assert all(e.xxh3_128 for e in manifest.files.values())
    flip_byte(info.path / WEIGHTS)  # same size: only a digest can tell
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        reg.load("run@1")
    assert reg.verify("run@1")[0].problems == (f"{WEIGHTS}: checksum mismatch",)
    assert reg.catalog.get("run", 1).status == "corrupt"  # type: ignore[union-attr]


def test_corrupt_extra_is_caught_by_xxh3(sqlite_reg: Registry) -> None:
    info = sqlite_reg.publish("run", 1, make_state(1), extra={"optimizer": {"m": torch.randn(50)}})
    flip_byte(info.path / "optimizer.pt", 100)
    with pytest.raises(CorruptCheckpointError, match="optimizer.pt"):
        sqlite_reg.load("run@1")


def test_manifest_without_xxh3_falls_back_to_sha256(tmp_path: Path) -> None:
    """Directories written before xxh3 (or by the reference module) are checked with sha256."""
    staging = tmp_path / "s"
    staging.mkdir()
    write_payload(staging, payload(2))
    doc = json.loads((staging / MANIFEST).read_text())
    for entry in doc["files"].values():
        del entry["xxh3_128"]
    (staging / MANIFEST).write_text(json.dumps(doc))
    assert_state_equal(read_directory(staging, verify=True).state_dict, make_state(2))
    flip_byte(staging / WEIGHTS)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        read_directory(staging, verify=True)
    read_directory(staging, verify=False)  # sizes only


def test_invalid_xxh3_field_is_a_manifest_error(tmp_path: Path) -> None:
    staging = tmp_path / "s"
    staging.mkdir()
    write_payload(staging, payload())
    doc = json.loads((staging / MANIFEST).read_text())
    doc["files"][WEIGHTS]["xxh3_128"] = "../../etc"
    (staging / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="xxh3_128"):
        read_directory(staging)


@pytest.mark.skipif(not (SEED / "checkpoint_reference.py").exists(), reason="reference module not present")
def test_reference_module_verifies_our_checksums(sqlite_reg: Registry) -> None:
    info = sqlite_reg.publish("run", 1, make_state(1), extra={"optimizer": {"m": torch.randn(5)}})
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import checkpoint_reference as r; "
            "c = r.Checkpoint.load(sys.argv[2], verify_checksums=True); print(sorted(c.state_dict))")
    out = subprocess.run([sys.executable, "-c", code, str(SEED), str(info.path)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": ""}, check=True)
    assert out.stdout.strip() == str(sorted(make_state(1)))
