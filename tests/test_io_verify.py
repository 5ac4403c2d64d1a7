"""Checksums on the publish and load paths: sha256 for compatibility and scrubs, xxh3 pieces for loads."""

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

import registry.format.pieces as pieces_mod
from registry import CorruptCheckpointError, ManifestError, Registry
from registry.format.manifest import MANIFEST, WEIGHTS, read_manifest
from registry.fs.filemaps import read_directory
from registry.fs.store import check_written, verify_directory, write_payload
from registry.fs.payloadfiles import Payload
from tests.helpers import assert_state_equal, make_state


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
        size = entry["xxh3_128_pieces"]["piece_size"]
        assert entry == {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                         "xxh3_128_pieces": {"piece_size": size, "digests": [
                             xxhash.xxh3_128_hexdigest(raw[i:i + size]) for i in range(0, len(raw), size)]}}
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
    assert all(e.xxh3_128_pieces for e in manifest.files.values())
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


@pytest.mark.parametrize("fast", ["none", "whole-file xxh3"])
def test_older_manifests_are_checked_with_the_digest_they_have(tmp_path: Path, fast: str) -> None:
    """Directories written before pieces (whole-file xxh3) or by the reference module (sha256 only)."""
    staging = tmp_path / "s"
    staging.mkdir()
    write_payload(staging, payload(2))
    doc = json.loads((staging / MANIFEST).read_text())
    for name, entry in doc["files"].items():
        del entry["xxh3_128_pieces"]
        if fast != "none":
            entry["xxh3_128"] = xxhash.xxh3_128_hexdigest((staging / name).read_bytes())
    (staging / MANIFEST).write_text(json.dumps(doc))
    assert_state_equal(read_directory(staging, verify=True).state_dict, make_state(2))
    flip_byte(staging / WEIGHTS)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        read_directory(staging, verify=True)
    read_directory(staging, verify=False)  # sizes only


def test_a_flip_in_any_piece_is_caught_by_the_parallel_check(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces_mod, "PIECE_SIZE", 4096)  # the weights span many pieces, hashed on the pool
    staging = tmp_path / "s"
    staging.mkdir()
    weights = torch.randn(64, 256)
    write_payload(staging, Payload(state_dict={"w": weights}, meta={}, config={}, extra={}))
    entry = read_manifest(staging)[0].files[WEIGHTS]
    assert entry.piece_size == 4096 and entry.xxh3_128_pieces is not None and len(entry.xxh3_128_pieces) > 8
    pristine = (staging / WEIGHTS).read_bytes()
    data_start = 8 + int.from_bytes(pristine[:8], "little")  # a flip in the header is a format error
    for offset in (data_start, 4095, 4096, len(pristine) // 2, len(pristine) - 1):  # edges of pieces, middle, last
        flip_byte(staging / WEIGHTS, offset)
        with pytest.raises(CorruptCheckpointError, match="checksum") as caught:
            read_directory(staging, verify=True)
        assert f"(bytes {offset // 4096 * 4096}-" in str(caught.value)  # the damaged piece is named
        (staging / WEIGHTS).write_bytes(pristine)
    assert torch.equal(read_directory(staging, verify=True).state_dict["w"], weights)


@pytest.mark.parametrize("pieces", [
    "not an object", {"piece_size": 4096}, {"piece_size": 0, "digests": []}, {"piece_size": True, "digests": []},
    {"piece_size": 4096, "digests": ["0" * 32] * 1000}, {"piece_size": 1 << 24, "digests": ["../../etc"]}])
def test_invalid_piece_digests_are_a_manifest_error(tmp_path: Path, pieces: object) -> None:
    staging = tmp_path / "s"
    staging.mkdir()
    write_payload(staging, payload())
    doc = json.loads((staging / MANIFEST).read_text())
    doc["files"][WEIGHTS]["xxh3_128_pieces"] = pieces
    (staging / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="xxh3_128_pieces"):
        read_directory(staging)


def test_invalid_xxh3_field_is_a_manifest_error(tmp_path: Path) -> None:
    staging = tmp_path / "s"
    staging.mkdir()
    write_payload(staging, payload())
    doc = json.loads((staging / MANIFEST).read_text())
    doc["files"][WEIGHTS]["xxh3_128"] = "../../etc"
    (staging / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="xxh3_128"):
        read_directory(staging)


def test_reference_module_verifies_our_checksums(sqlite_reg: Registry, reference_path: Path) -> None:
    info = sqlite_reg.publish("run", 1, make_state(1), extra={"optimizer": {"m": torch.randn(5)}})
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import checkpoint_reference as r; "
            "c = r.Checkpoint.load(sys.argv[2], verify_checksums=True); print(sorted(c.state_dict))")
    out = subprocess.run([sys.executable, "-c", code, str(reference_path.parent), str(info.path)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""}, check=True)
    assert out.stdout.strip() == str(sorted(make_state(1)))
