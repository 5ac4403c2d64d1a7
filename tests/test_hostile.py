"""Hostile input: every malformed or malicious file gets a RegistryError, and nothing else happens.

Nothing may run code, allocate what the file merely claims, or read or touch
anything outside the checkpoint directory. Parsers are fuzzed with
hypothesis; payload damage is exhaustive (every bit of the small files,
every truncation length).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import registry.format.tensorio as tensorio
from registry import (Checkpoint, CorruptCheckpointError, ManifestError, Registry, RegistryError,
                      SafetensorsFormatError, UnsafePathError, UnsafePickleError)
from registry.format.manifest import check_file_name, parse_manifest, read_manifest
from registry.fs.store import read_directory, verify_directory
from registry.format.tensorio import read_safetensors_header
from tests.helpers import assert_state_equal, make_state

FUZZ = int(os.environ.get("REGISTRY_FUZZ_EXAMPLES", "300"))
EVERY_BIT = os.environ.get("REGISTRY_EVERY_BIT", "") not in ("", "0")  # all 8 bits of every byte, not one
SHA = "0" * 64


def manifest_doc(**files: Any) -> dict[str, Any]:
    return {"format_version": 1, "created_at": None, "optimizer_step": 1, "policy_version": None,
            "tensors": [], "files": files or {"model.safetensors": {"size": 1, "sha256": SHA}}}


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """The real file behind every successful os.open or open() while the test runs (via /proc)."""
    paths: list[Path] = []
    real_os_open, real_open = os.open, builtins.open

    def spy_os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        fd = real_os_open(path, *args, **kwargs)
        paths.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return fd

    def spy_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, *args, **kwargs)
        if isinstance(file, (str, bytes, os.PathLike)):
            paths.append(Path(os.readlink(f"/proc/self/fd/{f.fileno()}")))
        return f

    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(io, "open", spy_open)
    yield paths


def assert_inside(paths: list[Path], directory: Path) -> None:
    inside = directory.resolve()
    for p in paths:
        assert p.resolve().is_relative_to(inside), f"read {p} outside {directory}"


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("raw, error", [
    (b"", ManifestError), (b"\xff\xfe", ManifestError), (b"[1, 2]", ManifestError), (b"{", ManifestError),
    (b"[" * 100000 + b"]" * 100000, ManifestError), (b'"just a string"', ManifestError),
    (json.dumps({"files": {}}).encode(), ManifestError),
    (json.dumps({**manifest_doc(), "format_version": True}).encode(), ManifestError),
    (json.dumps({**manifest_doc(), "format_version": 2}).encode(), ManifestError),
    (json.dumps({**manifest_doc(), "files": []}).encode(), ManifestError),
    (json.dumps(manifest_doc(**{"w": {"size": -1, "sha256": SHA}})).encode(), ManifestError),
    (json.dumps(manifest_doc(**{"w": {"size": True, "sha256": SHA}})).encode(), ManifestError),
    (json.dumps(manifest_doc(**{"w": {"size": 1.5, "sha256": SHA}})).encode(), ManifestError),
    (json.dumps(manifest_doc(**{"w": {"size": 1, "sha256": "XYZ"}})).encode(), ManifestError),
    (json.dumps(manifest_doc(**{"w": {"size": 1}})).encode(), ManifestError),
    (json.dumps(manifest_doc(**{"w": [1, SHA]})).encode(), ManifestError),
    (json.dumps({**manifest_doc(), "tensors": "abc"}).encode(), ManifestError),
    (json.dumps({**manifest_doc(), "tensors": [1]}).encode(), ManifestError),
    (json.dumps({**manifest_doc(), "optimizer_step": "7"}).encode(), ManifestError),
    (json.dumps({**manifest_doc(), "policy_version": False}).encode(), ManifestError),
    (json.dumps({**manifest_doc(), "created_at": 5}).encode(), ManifestError),
    (json.dumps(manifest_doc(**{"../escape": {"size": 1, "sha256": SHA}})).encode(), UnsafePathError),
    (json.dumps(manifest_doc(**{"..": {"size": 1, "sha256": SHA}})).encode(), UnsafePathError),
    (json.dumps(manifest_doc(**{"/etc/passwd": {"size": 1, "sha256": SHA}})).encode(), UnsafePathError),
    (json.dumps(manifest_doc(**{"a/b": {"size": 1, "sha256": SHA}})).encode(), UnsafePathError),
    (json.dumps(manifest_doc(**{"a\\..\\b": {"size": 1, "sha256": SHA}})).encode(), UnsafePathError),
    (json.dumps(manifest_doc(**{"nul\x00.pt": {"size": 1, "sha256": SHA}})).encode(), UnsafePathError),
    (json.dumps(manifest_doc(**{"~root": {"size": 1, "sha256": SHA}})).encode(), UnsafePathError),
    (json.dumps(manifest_doc(**{"": {"size": 1, "sha256": SHA}})).encode(), UnsafePathError),
    (json.dumps(manifest_doc(**{"manifest.json": {"size": 1, "sha256": SHA}})).encode(), UnsafePathError),
])
def test_bad_manifests(raw: bytes, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        parse_manifest(raw, path=Path("/ckpt/manifest.json"))
    assert "\n" not in str(info.value) and "/ckpt/manifest.json" in str(info.value)


def test_oversized_manifest_is_not_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("registry.format.manifest.MAX_MANIFEST_BYTES", 1024)
    (tmp_path / "manifest.json").write_bytes(b" " * 10_000_000)
    with pytest.raises(ManifestError, match="larger than 1024"):
        read_manifest(tmp_path)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=12)
_names = st.one_of(st.sampled_from(["model.safetensors", "meta.json", "..", ".", "/abs", "a/b", "x\x00y",
                                    "C:\\x", "~u", "", "manifest.json", "ok.pt"]), st.text(max_size=12))
_entries = st.one_of(_json, st.fixed_dictionaries({"size": st.one_of(st.integers(-5, 10**20), _json),
                                                   "sha256": st.one_of(st.just(SHA), st.text(max_size=70))}))


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=st.dictionaries(_names, _entries, max_size=5),
       extra=st.dictionaries(st.sampled_from(["format_version", "tensors", "optimizer_step", "policy_version",
                                              "created_at", "files", "new_field"]), _json, max_size=3))
def test_manifest_parser_fuzz(files: dict[str, Any], extra: dict[str, Any]) -> None:
    doc = {**manifest_doc(), "files": files, **extra}
    try:
        manifest = parse_manifest(json.dumps(doc).encode(), path=Path("m.json"))
    except RegistryError as exc:
        assert isinstance(exc, (ManifestError, UnsafePathError)) and "\n" not in str(exc)
        return
    for name, entry in manifest.files.items():  # accepted: every field is what the format says
        assert check_file_name(name) == name and name != "manifest.json"
        assert isinstance(entry.size, int) and not isinstance(entry.size, bool) and entry.size >= 0
        assert len(entry.sha256) == 64
    assert all(isinstance(t, str) for t in manifest.tensors)


@settings(max_examples=FUZZ, deadline=None)
@given(raw=st.binary(max_size=300))
def test_manifest_parser_random_bytes(raw: bytes) -> None:
    try:
        parse_manifest(raw, path=Path("m.json"))
    except RegistryError:
        pass


# --------------------------------------------------------------------------- safetensors headers


def st_file(header: Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def parse(raw: bytes, tmp_path: Path) -> Any:
    """``raw`` as the weights of a legacy checkpoint directory, read as every load reads it."""
    (tmp_path / "model.safetensors").write_bytes(raw)
    return read_directory(tmp_path, verify=False)


@pytest.mark.parametrize("raw, why", [
    (b"", "8-byte"), (b"\x01\x02", "8-byte"),
    (struct.pack("<Q", 2**63) + b"{}", "exceeds"), (struct.pack("<Q", 200 << 20) + b"{}", "exceeds"),
    (struct.pack("<Q", 50) + b"{}", "exceeds"),  # claims more header than the file holds
    (st_file(b"{not json"), "not valid JSON"), (st_file(b"[]"), "not a JSON object"),
    (st_file(b'{"a": 1}'), "not an object"),
    (st_file({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "unknown dtype"),
    (st_file({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "invalid shape"),
    (st_file({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4), "invalid shape"),
    (st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 4), "data_offsets"),
    (st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4), "do not match"),
    (st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "do not match"),
    (st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 8), "overlaps"),
    (st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8), "overlaps"),
    (st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "gap"),
    (st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 2), "covers"),
    (st_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 9), "covers"),
    (st_file(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
             b' "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8), "duplicate"),
    (st_file({"__metadata__": {"k": 1}}), "__metadata__"),
    # a petabyte tensor claimed by a tiny file: refused before anything is allocated
    (st_file({"a": {"dtype": "F32", "shape": [2**48], "data_offsets": [0, 2**50]}}, b"\0" * 16), "covers"),
])
def test_bad_safetensors(raw: bytes, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    allocations = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocations.append(a) or real_empty(*a, **k))
    with pytest.raises(SafetensorsFormatError, match=why):
        parse(raw, tmp_path)
    assert [a for a in allocations if a != (0,)] == []  # (0,): the buffer of an empty file, not a tensor


_dtypes = st.sampled_from(sorted(tensorio.dtypes()))
_spec = st.fixed_dictionaries({"dtype": st.one_of(_dtypes, _json), "shape": st.one_of(
    st.lists(st.integers(-2, 6), max_size=3), _json), "data_offsets": st.one_of(
    st.lists(st.integers(-4, 300), min_size=2, max_size=2), _json)})


@settings(max_examples=FUZZ, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.text(max_size=6), _spec, max_size=4), data_len=st.integers(0, 300),
       skew=st.integers(-3, 3))
def test_safetensors_header_fuzz(header: dict[str, Any], data_len: int, skew: int) -> None:
    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", max(0, len(raw) + skew)) + raw + bytes(data_len)
    try:
        parsed = read_safetensors_header(io.BytesIO(blob), len(blob), Path("f"))
    except SafetensorsFormatError:
        return
    cursor = 0  # accepted: the entries tile the data area exactly, each matching its shape and dtype
    for e in parsed.entries:
        n = 1
        for d in e.shape:
            n *= d
        assert e.begin == cursor and e.end - e.begin == n * e.dtype.itemsize
        cursor = e.end
    assert parsed.data_start + cursor == len(blob)


@settings(max_examples=FUZZ, deadline=None)
@given(blob=st.binary(max_size=200))
def test_safetensors_random_bytes(blob: bytes) -> None:
    try:
        read_safetensors_header(io.BytesIO(blob), len(blob), Path("f"))
    except SafetensorsFormatError:
        pass


# --------------------------------------------------------------------------- directories


def checkpoint_dir(tmp_path: Path, **extra: Any) -> Path:
    directory = tmp_path / "ckpt"
    Checkpoint(state_dict=make_state(1, n=1), extra=extra, config={"a": 1}).save(directory)
    return directory


def test_symlink_out_of_the_checkpoint_is_refused(tmp_path: Path, opened: list[Path]) -> None:
    directory = checkpoint_dir(tmp_path, optimizer={"lr": 1.0})
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("model.safetensors", "meta.json", "optimizer.pt", "manifest.json"):
        # the outside file has exactly the bytes the manifest expects: following the link would "work"
        (directory / name).rename(outside / name)
        (directory / name).symlink_to(outside / name)
        opened.clear()
        with pytest.raises(UnsafePathError, match="symlink"):
            read_directory(directory, verify=True)
        assert_inside(opened, directory)
        assert verify_directory(directory)[0].name == name
        assert reg_fsck_refuses(directory)
        (directory / name).unlink()
        (outside / name).rename(directory / name)
    assert_state_equal(read_directory(directory).state_dict, make_state(1, n=1))


def test_dangling_manifest_symlink_does_not_make_a_legacy_directory(tmp_path: Path) -> None:
    """A manifest that is a broken link must not turn the directory into one with nothing to verify."""
    directory = checkpoint_dir(tmp_path)
    (directory / "manifest.json").unlink()
    (directory / "manifest.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(UnsafePathError, match="symlink"):
        read_directory(directory, verify=True)


def reg_fsck_refuses(directory: Path) -> bool:
    """fsck's payload check (used to adopt and roll forward) refuses the directory too."""
    from registry.ops.fsck import _check_payload
    return _check_payload(directory, checksums=True)[0] is None


@pytest.mark.parametrize("name", ["manifest.json", "meta.json", "model.safetensors", "optimizer.pt"])
def test_fifo_in_place_of_a_file_does_not_hang(tmp_path: Path, name: str) -> None:
    directory = checkpoint_dir(tmp_path, optimizer={"lr": 1.0})
    (directory / name).unlink()
    os.mkfifo(directory / name)
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"reading a FIFO {name} blocked"))
    signal.alarm(20)
    try:
        with pytest.raises(CorruptCheckpointError):
            read_directory(directory, verify=True)
        assert verify_directory(directory)
        assert reg_fsck_refuses(directory)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_manifest_naming_outside_files_is_refused(tmp_path: Path, opened: list[Path]) -> None:
    directory = checkpoint_dir(tmp_path)
    secret = tmp_path / "secret.pt"
    secret.write_bytes(b"do not read")
    doc = json.loads((directory / "manifest.json").read_text())
    for name in ("../secret.pt", str(secret), "sub/../../secret.pt", "secret\x00.pt"):
        bad = {**doc, "files": {**doc["files"], name: {"size": 11, "sha256": SHA}}}
        (directory / "manifest.json").write_text(json.dumps(bad))
        opened.clear()
        with pytest.raises(UnsafePathError):
            read_directory(directory)
        assert_inside(opened, directory)


def test_index_naming_outside_shards_is_refused(tmp_path: Path, opened: list[Path]) -> None:
    directory = tmp_path / "legacy"
    directory.mkdir()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../x.safetensors"}}))
    with pytest.raises(UnsafePathError):
        read_directory(directory, verify=False)
    assert_inside(opened, directory)


class Sentinel:
    """A pickle that creates a file when unpickled: proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_code_running_pickle_never_runs(sqlite_reg: Registry, tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    info = sqlite_reg.publish("run", 1, make_state(1), extra={"optimizer": Sentinel(sentinel)}, trust_pickle=True)
    assert not sentinel.exists()
    with pytest.raises(UnsafePickleError, match="trust_pickle"):
        sqlite_reg.load("run@1")
    with pytest.raises(UnsafePickleError):
        Checkpoint.load(info.path, verify_checksums=True)
    with pytest.raises(UnsafePickleError):
        sqlite_reg.load("run")  # @latest does not "fall back" past it either: it is not corrupt
    assert not sentinel.exists()
    assert sqlite_reg.resolve("run@1").status == "verified"  # refusing is not damage
    Checkpoint.load(info.path, trust_pickle=True).extra["optimizer"].close()
    assert sentinel.exists()  # the payload was armed: the refusal is what protected us


def test_every_bit_flip_is_detected(tmp_path: Path) -> None:
    directory = checkpoint_dir(tmp_path, optimizer={"m": torch.ones(2)})
    manifest, _ = read_manifest(directory)
    flips = 0
    for name in sorted(manifest.files):
        path = directory / name
        original = path.read_bytes()
        for i in range(len(original)):
            for bit in (range(8) if EVERY_BIT else (i % 8,)):
                damaged = bytearray(original)
                damaged[i] ^= 1 << bit
                path.write_bytes(damaged)
                assert verify_directory(directory, manifest), f"flip of bit {bit} of byte {i} of {name} missed"
                flips += 1
        path.write_bytes(original)
    print(f"\nbit flips detected: {flips}")  # figures for RELIABILITY.md
    assert flips > 1000 and verify_directory(directory) == []


def test_every_manifest_flip_is_detected(sqlite_reg: Registry) -> None:
    info = sqlite_reg.publish("run", 1, make_state(1, n=1))
    path = info.path / "manifest.json"
    original = path.read_bytes()
    for i in range(len(original)):
        damaged = bytearray(original)
        damaged[i] ^= 1 << (i % 8)
        path.write_bytes(damaged)
        if i % 97 == 0:  # end to end, as load does it (a catalog round trip each)
            with pytest.raises(CorruptCheckpointError):
                sqlite_reg.read_checked(info, verify=False, map_location="cpu", trust_pickle=False)
            continue
        try:  # the same check without the catalog: the manifest parses but its digest is not the catalog's
            loaded = read_directory(info.path, verify=False)
        except CorruptCheckpointError:
            continue
        assert loaded.manifest_sha256 != info.manifest_sha256
    path.write_bytes(original)
    print(f"\nmanifest flips detected: {len(original)}")
    assert sqlite_reg.verify("run@1")[0].ok


def test_every_truncation_is_detected(tmp_path: Path) -> None:
    directory = checkpoint_dir(tmp_path)
    path = directory / "model.safetensors"
    original = path.read_bytes()
    for length in range(len(original)):
        path.write_bytes(original[:length])
        with pytest.raises(CorruptCheckpointError):
            read_directory(directory, verify=False)  # the size check alone catches it
        assert verify_directory(directory)
    path.write_bytes(original)
    print(f"\ntruncations detected: {len(original)}")


def test_damaged_latest_falls_back_and_is_marked(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    two = reg.publish("run", 2, make_state(2))
    weights = two.path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    weights.write_bytes(raw)
    with pytest.warns(RuntimeWarning, match="falling back"):
        assert_state_equal(reg.load("run").state_dict, make_state(1))
    assert reg.resolve("run@2").status == "corrupt"
    with pytest.raises(CorruptCheckpointError):
        reg.load("run@2")


@pytest.mark.parametrize("name, content", [
    ("meta.json", b"\xff not utf8"), ("meta.json", b"[1]"), ("config.json", b"{" * 5000),
])
def test_bad_json_sidecars(tmp_path: Path, name: str, content: bytes) -> None:
    directory = tmp_path / "legacy"
    Checkpoint(state_dict=make_state(1, n=1)).save(directory)
    (directory / "manifest.json").unlink()  # legacy: nothing to check the sidecar against
    (directory / name).write_bytes(content)
    with pytest.raises(ManifestError):
        read_directory(directory, verify=False)
