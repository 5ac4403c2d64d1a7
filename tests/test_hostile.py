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
import math
import os
import re
import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import registry.format.safetensors as safetensors_mod
from registry import (Checkpoint, CorruptCheckpointError, DcpMetadataError, ManifestError, Registry, RegistryError,
                      SafetensorsFormatError, UnsafePathError, UnsafePickleError)
from registry.format.manifest import check_file_name, parse_manifest, read_manifest
from registry.format.pieces import MIN_PIECE_SIZE, piece_count
from registry.fs.filemaps import read_directory
from registry.fs.store import verify_directory
from registry.format.safetensors import read_safetensors_header
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


def _hex(n: int) -> st.SearchStrategy[str]:
    return st.text("0123456789abcdef", min_size=n, max_size=n)


# plain names the format allows: anything but a path separator, NUL, a leading "~", "." and ".."
_plain_names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\\\x00"), min_size=1,
                       max_size=12).filter(lambda n: not n.startswith("~") and n not in (".", "..", "manifest.json"))


@st.composite
def _valid_entry(draw: st.DrawFn) -> dict[str, Any]:
    size = draw(st.integers(0, 2**40))
    entry: dict[str, Any] = {"size": size, "sha256": draw(_hex(64))}
    if draw(st.booleans()):
        entry["xxh3_128"] = draw(_hex(32))
    if draw(st.booleans()):  # at most 8 pieces, whatever the size
        piece_size = draw(st.integers(max(MIN_PIECE_SIZE, -(-size // 8)), 2**41))
        n = piece_count(size, piece_size)
        entry["xxh3_128_pieces"] = {"piece_size": piece_size,
                                    "digests": draw(st.lists(_hex(32), min_size=n, max_size=n))}
    return entry


_valid_manifests = st.fixed_dictionaries(
    {"format_version": st.just(1), "files": st.dictionaries(_plain_names, _valid_entry(), min_size=1, max_size=4)},
    optional={"tensors": st.lists(st.text(max_size=8), max_size=4), "created_at": st.none() | st.text(max_size=20),
              "optimizer_step": st.none() | st.integers(), "policy_version": st.none() | st.integers(),
              "new_field": _json})


@st.composite
def _damaged_manifests(draw: st.DrawFn) -> dict[str, Any]:
    """A valid manifest with one field replaced, removed or added: near misses that reach every check."""
    doc = draw(_valid_manifests)
    where = draw(st.sampled_from(["field", "entry", "name"]))
    if where == "field":
        key = draw(st.sampled_from(["format_version", "files", "tensors", "created_at", "optimizer_step",
                                    "policy_version"]))
        if draw(st.booleans()):
            doc[key] = draw(_json)
        else:
            doc.pop(key, None)
    elif where == "entry":
        entry = doc["files"][draw(st.sampled_from(sorted(doc["files"])))]
        key = draw(st.sampled_from(["size", "sha256", "xxh3_128", "xxh3_128_pieces"]))
        entry[key] = draw(st.one_of(_json, st.integers(-5, 5), _hex(63), _hex(64).map(str.upper)))
    else:
        doc["files"][draw(_names)] = draw(st.one_of(_valid_entry(), _entries))
    return doc


_hostile_manifests = st.builds(
    lambda files, extra: {**manifest_doc(), "files": files, **extra}, st.dictionaries(_names, _entries, max_size=5),
    st.dictionaries(st.sampled_from(["format_version", "tensors", "optimizer_step", "policy_version", "created_at",
                                     "files", "new_field"]), _json, max_size=3))


def assert_well_formed(manifest: Any) -> None:
    """An accepted manifest: every name a plain file inside the directory, every field what the format says."""
    assert manifest.files
    for name, entry in manifest.files.items():
        assert check_file_name(name) == name == entry.name and name != "manifest.json"
        assert type(entry.size) is int and entry.size >= 0
        assert isinstance(entry.sha256, str) and re.fullmatch("[0-9a-f]{64}", entry.sha256)
        assert entry.xxh3_128 is None or re.fullmatch("[0-9a-f]{32}", entry.xxh3_128)
        if entry.xxh3_128_pieces is not None:
            assert type(entry.piece_size) is int and entry.piece_size >= MIN_PIECE_SIZE
            assert len(entry.xxh3_128_pieces) == piece_count(entry.size, entry.piece_size)
    assert all(isinstance(t, str) for t in manifest.tensors)
    assert manifest.created_at is None or isinstance(manifest.created_at, str)
    assert all(v is None or type(v) is int for v in (manifest.optimizer_step, manifest.policy_version))


def assert_refusal(exc: RegistryError, *kinds: type[RegistryError]) -> None:
    assert isinstance(exc, kinds) and "\n" not in str(exc) and str(exc), repr(exc)


def test_manifest_parser_fuzz() -> None:
    """Valid manifests are accepted as written; near misses and hostile ones are refused or well formed."""
    seen = {"valid": 0, "other accepted": 0, "refused": 0}

    @settings(max_examples=FUZZ, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=st.one_of(_valid_manifests.map(lambda d: (d, True)),
                          st.one_of(_damaged_manifests(), _hostile_manifests).map(lambda d: (d, False))))
    def check(case: tuple[dict[str, Any], bool]) -> None:
        doc, valid = case
        try:
            manifest = parse_manifest(json.dumps(doc).encode(), path=Path("m.json"))
        except RegistryError as exc:
            assert not valid, f"a valid manifest was refused: {exc}"
            assert_refusal(exc, ManifestError, UnsafePathError)
            seen["refused"] += 1
            return
        assert_well_formed(manifest)
        if not valid:
            seen["other accepted"] += 1
            return
        seen["valid"] += 1  # accepted as written: every field read back unchanged
        assert {n: (e.size, e.sha256, e.xxh3_128, e.piece_size, e.xxh3_128_pieces)
                for n, e in manifest.files.items()} == {
            n: (e["size"], e["sha256"], e.get("xxh3_128"), e.get("xxh3_128_pieces", {}).get("piece_size"),
                tuple(e["xxh3_128_pieces"]["digests"]) if "xxh3_128_pieces" in e else None)
            for n, e in doc["files"].items()}
        assert manifest.tensors == tuple(doc.get("tensors", []))
        assert (manifest.created_at, manifest.optimizer_step, manifest.policy_version) == (
            doc.get("created_at"), doc.get("optimizer_step"), doc.get("policy_version"))
        assert manifest.extra_fields == ({"new_field": doc["new_field"]} if "new_field" in doc else {})

    check()
    print(f"\nmanifest fuzz: {seen}")  # figures for RELIABILITY.md
    assert seen["valid"] >= FUZZ // 5 and seen["refused"] >= FUZZ // 5, seen


@st.composite
def _edited(draw: st.DrawFn, raw: st.SearchStrategy[bytes]) -> bytes:
    """``raw`` with up to three bytes set, removed or inserted at random places."""
    out = bytearray(draw(raw))
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(out)))
        op = draw(st.sampled_from(["set", "delete", "insert"]) if i < len(out) else st.just("insert"))
        if op == "insert":
            out[i:i] = bytes([draw(st.integers(0, 255))])
        elif op == "delete":
            del out[i]
        else:
            out[i] = draw(st.integers(0, 255))
    return bytes(out)


def test_manifest_parser_random_bytes() -> None:
    """Any bytes, or a valid manifest's bytes with a few edits: a one-line refusal, or a well-formed manifest."""
    seen = {"accepted": 0, "refused": 0}

    @settings(max_examples=FUZZ, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(raw=st.one_of(st.binary(max_size=300), _edited(_valid_manifests.map(lambda d: json.dumps(d).encode()))))
    def check(raw: bytes) -> None:
        try:
            manifest = parse_manifest(raw, path=Path("m.json"))
        except RegistryError as exc:
            assert_refusal(exc, ManifestError, UnsafePathError)
            seen["refused"] += 1
            return
        assert_well_formed(manifest)
        seen["accepted"] += 1

    check()
    print(f"\nmanifest random bytes: {seen}")
    assert seen["accepted"] >= FUZZ // 10 and seen["refused"] >= FUZZ // 5, seen


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


_dtypes = st.sampled_from(sorted(safetensors_mod.dtypes()))
_spec = st.fixed_dictionaries({"dtype": st.one_of(_dtypes, _json), "shape": st.one_of(
    st.lists(st.integers(-2, 6), max_size=3), _json), "data_offsets": st.one_of(
    st.lists(st.integers(-4, 300), min_size=2, max_size=2), _json)})


@st.composite
def _valid_safetensors(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, str, list[int], int, int]]]:
    """A well-formed file (entries in any order, tiling the data area) and the entries it holds."""
    names = draw(st.lists(st.text(max_size=6).filter(lambda n: n != "__metadata__"), unique=True, max_size=4))
    entries, cursor = [], 0
    for name in names:
        dtype, shape = draw(_dtypes), draw(st.lists(st.integers(0, 5), max_size=3))
        n = math.prod(shape) * safetensors_mod.dtypes()[dtype].itemsize
        entries.append((name, dtype, shape, cursor, cursor + n))
        cursor += n
    header: dict[str, Any] = {name: {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
                              for name, dtype, shape, begin, end in draw(st.permutations(entries))}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
    raw = json.dumps(header).encode() + b" " * draw(st.integers(0, 7))  # padding, as writers align the data
    return struct.pack("<Q", len(raw)) + raw + bytes(cursor), entries


@st.composite
def _damaged_safetensors(draw: st.DrawFn) -> bytes:
    """A valid file with one thing wrong: the header length, the data length, or one field of one entry."""
    blob, entries = draw(_valid_safetensors())
    (size,) = struct.unpack("<Q", blob[:8])
    header, data = json.loads(blob[8:8 + size]), blob[8 + size:]
    what = draw(st.sampled_from(["length", "data", "entry"] if entries else ["length", "data"]))
    if what == "entry":
        spec = header[draw(st.sampled_from([e[0] for e in entries]))]
        key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        spec[key] = draw(st.one_of(_json, _dtypes, st.lists(st.integers(-2, 6), max_size=3),
                                   st.lists(st.integers(-4, 300), min_size=2, max_size=2)))
    raw = json.dumps(header).encode()
    skew = draw(st.integers(-3, 3)) if what == "length" else 0
    if what == "data":
        data = bytes(draw(st.integers(0, 300)))
    return struct.pack("<Q", max(0, len(raw) + skew)) + raw + data


def by_offset(entry: tuple[str, str, list[int], int, int]) -> tuple[int, int, str]:
    return entry[3], entry[4], entry[0]


def assert_tiles(parsed: Any, file_size: int) -> None:
    """An accepted header: its entries tile the data area exactly, each as long as its shape and dtype say."""
    cursor = 0
    for e in parsed.entries:
        assert e.begin == cursor and e.end - e.begin == math.prod(e.shape) * e.dtype.itemsize
        cursor = e.end
    assert parsed.data_start + cursor == file_size


def test_safetensors_header_fuzz() -> None:
    """Valid files are read as written; near misses and random headers are refused or tile the data exactly."""
    seen = {"valid": 0, "other accepted": 0, "refused": 0}
    hostile = st.builds(lambda header, data_len, skew: struct.pack("<Q", max(0, len(json.dumps(header)) + skew))
                        + json.dumps(header).encode() + bytes(data_len),
                        st.dictionaries(st.text(max_size=6), _spec, max_size=4), st.integers(0, 300),
                        st.integers(-3, 3))

    @settings(max_examples=FUZZ, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=st.one_of(_valid_safetensors().map(lambda v: (v[0], v[1])),
                          st.one_of(_damaged_safetensors(), hostile).map(lambda b: (b, None))))
    def check(case: tuple[bytes, list[tuple[str, str, list[int], int, int]] | None]) -> None:
        blob, expected = case
        try:
            parsed = read_safetensors_header(io.BytesIO(blob), len(blob), Path("f"))
        except SafetensorsFormatError as exc:
            assert expected is None, f"a valid file was refused: {exc}"
            assert_refusal(exc, SafetensorsFormatError)
            seen["refused"] += 1
            return
        assert_tiles(parsed, len(blob))
        if expected is None:
            seen["other accepted"] += 1
            return
        seen["valid"] += 1
        names = {v: k for k, v in safetensors_mod.dtypes().items()}
        got = [(e.name, names[e.dtype], list(e.shape), e.begin, e.end) for e in parsed.entries]
        assert sorted(got, key=by_offset) == sorted(expected, key=by_offset)  # empty tensors share an offset

    check()
    print(f"\nsafetensors header fuzz: {seen}")
    assert seen["valid"] >= FUZZ // 5 and seen["refused"] >= FUZZ // 5, seen


def test_safetensors_random_bytes() -> None:
    """Any bytes, or a valid file with a few bytes edited: a one-line refusal, or entries that tile the data."""
    seen = {"accepted": 0, "refused": 0}

    @settings(max_examples=FUZZ, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(blob=st.one_of(st.binary(max_size=200), _edited(_valid_safetensors().map(lambda v: v[0]))))
    def check(blob: bytes) -> None:
        try:
            parsed = read_safetensors_header(io.BytesIO(blob), len(blob), Path("f"))
        except SafetensorsFormatError as exc:
            assert_refusal(exc, SafetensorsFormatError)
            seen["refused"] += 1
            return
        assert_tiles(parsed, len(blob))
        seen["accepted"] += 1

    check()
    print(f"\nsafetensors random bytes: {seen}")
    assert seen["accepted"] >= FUZZ // 10 and seen["refused"] >= FUZZ // 5, seen


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
    from registry.roots.dirscan import check_directory
    return check_directory(directory, checksums=True).valid is None


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


def flip_bit(raw: bytes, i: int) -> bytes:
    """``raw`` with one bit of byte ``i`` flipped (a different bit from byte to byte)."""
    damaged = bytearray(raw)
    damaged[i] ^= 1 << (i % 8)
    return bytes(damaged)


def payload(loaded: Any) -> dict[str, Any]:
    """What a load returns from the files: tensors, extras, meta and config."""
    return {"state_dict": loaded.state_dict, "extra": loaded.extra, "meta": loaded.meta, "config": loaded.config}


def same_tree(a: Any, b: Any) -> bool:
    """Equal values; tensors of the same dtype and shape and equal element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    return bool(type(a) is type(b) and a == b)


def assert_same_payload(got: Any, want: Any, why: str) -> None:
    assert same_tree(got, want), f"{why}: the load returned something else than was published"


CATALOG_STRIDE = 128  # every 128th flip also goes through Registry.load, besides those only the catalog catches


def test_every_manifest_flip_is_refused(reg: Registry) -> None:
    """A bit flipped in every byte of manifest.json, in turn: no load returns anything but the published payload.

    The directory alone (``read_directory``, a catalog-free load) refuses most
    flips with a ``CorruptCheckpointError``; the flips it accepts change only
    what the load does not read (a sha256 digit that only scrubs check, the
    timestamp, the tensors list, a field name that becomes an unknown field),
    so what it returns is bit-exact. ``Registry.load``, which also matches
    the manifest's digest against the catalog's, refuses every flip and marks
    the step corrupt: it runs for the first flip on each manifest line that the
    directory accepts, and every ``CATALOG_STRIDE``-th flip.
    """
    info = reg.publish("run", 1, make_state(1, n=1), extra={"optimizer": {"m": torch.ones(2)}})
    path = info.path / "manifest.json"
    original = path.read_bytes()
    published = payload(read_directory(info.path))
    assert same_tree(published["state_dict"], make_state(1, n=1)) and published["meta"]
    refused: dict[str, int] = {}
    accepted: list[int] = []
    through_catalog = 0
    lines_seen: set[int] = set()
    for i in range(len(original)):
        path.write_bytes(flip_bit(original, i))
        why = f"flip of byte {i} ({original[i:i + 1]!r}) of the manifest"
        try:
            loaded = read_directory(info.path, verify=True)
        except CorruptCheckpointError as exc:
            refused[type(exc).__name__] = refused.get(type(exc).__name__, 0) + 1
            first_on_line = False
        else:
            assert_same_payload(payload(loaded), published, why)
            accepted.append(i)
            line = original.count(b"\n", 0, i)
            first_on_line = line not in lines_seen
            lines_seen.add(line)
        if first_on_line or i % CATALOG_STRIDE == 0:
            with pytest.raises(CorruptCheckpointError):
                reg.load("run@1")
            assert reg.resolve("run@1").status == "corrupt", why  # marked for the digest it read
            path.write_bytes(original)
            assert reg.verify("run@1")[0].ok, why  # the intact payload is verified again for the next flip
            through_catalog += 1
    path.write_bytes(original)
    print(f"\nmanifest flips: {len(original)}, refused by the directory alone: {sum(refused.values())} {refused}, "
          f"accepted bit-exact: {len(accepted)}, through Registry.load: {through_catalog} "
          f"({len(lines_seen)} lines with an accepted flip)")  # figures for RELIABILITY.md
    assert len(original) > 1000 and sum(refused.values()) > len(original) // 2 and len(lines_seen) > 10
    assert_same_payload(payload(reg.load("run@1")), published, "the intact checkpoint")


@pytest.mark.parametrize("name", ["meta.json", "config.json", "optimizer.pt"])
def test_a_manifest_entry_renamed_away_from_its_file_is_refused(tmp_path: Path, name: str) -> None:
    """One damaged name in the file table must not pass for a checkpoint without that file.

    Without the catalog's digest to catch it, a load that skipped the unlisted
    ``meta.json`` would resume from epoch 0 without a word.
    """
    directory = checkpoint_dir(tmp_path, optimizer={"lr": 1.0})
    doc = json.loads((directory / "manifest.json").read_text())
    doc["files"]["x" + name[1:]] = doc["files"].pop(name)
    (directory / "manifest.json").write_text(json.dumps(doc))
    for extras in (True, False):
        with pytest.raises(CorruptCheckpointError, match="missing"):
            read_directory(directory, verify=True, extras=extras)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        Checkpoint.load(directory, verify_checksums=True)


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


# --------------------------------------------------------------------------- DCP .metadata


class Shell:
    """A pickle that runs a shell command when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def dcp_dir(tmp_path: Path, name: str = "dcp", **state: Any) -> Path:
    from tests.helpers import dcp_state, write_dcp
    directory = tmp_path / name
    write_dcp(directory, state or dcp_state())
    return directory


def rewrite_metadata(directory: Path, edit: Any) -> None:
    """Apply ``edit`` to the directory's real ``Metadata`` and pickle it back as DCP does."""
    import pickle
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written by this test from dcp.save's own output
    edit(metadata)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("payload", [Sentinel, Shell])
def test_code_running_dcp_metadata_never_runs(sqlite_reg: Registry, tmp_path: Path, payload: type) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from registry.format.dcp_metadata import RestrictedFileSystemReader, load_dcp_state_dict
    marker = tmp_path / "pwned"
    directory = dcp_dir(tmp_path)
    rewrite_metadata(directory, lambda md: setattr(md, "planner_data", payload(marker)))
    with pytest.raises(UnsafePickleError, match="refusing to unpickle") as info:
        sqlite_reg.import_checkpoint(directory, run="run", step=1)
    assert_refusal(info.value, UnsafePickleError)
    assert sqlite_reg.runs() == [] and not (sqlite_reg.store.root / "run").exists()
    with pytest.raises(UnsafePickleError):
        load_dcp_state_dict(directory)
    reader = RestrictedFileSystemReader(directory)
    from torch.distributed.checkpoint.api import CheckpointException
    with pytest.raises(CheckpointException):  # how DCP reports any failure
        dcp.load({}, storage_reader=reader, no_dist=True)
    assert isinstance(reader.refusal, UnsafePickleError)
    assert not marker.exists()
    with open(directory / ".metadata", "rb") as f:
        pickle.load(f)  # what DCP's own FileSystemReader does
    assert marker.exists()  # the payload was armed: the refusal is what protected us


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _pwned_build() -> bytes:
    """``(None, {"pwned_": 1})`` then BUILD: set ``pwned_`` on whatever is on the stack, as a slot state."""
    return b"N}X\x06\x00\x00\x00pwned_K\x01s\x86b."


@pytest.mark.parametrize("target", ["record class", "enum member", "path class", "layout function"])
def test_dcp_metadata_cannot_set_attributes_on_what_the_process_shares(target: str) -> None:
    """BUILD on an object the unpickler hands out that the whole process shares (a class object, an enum
    member, a function) would change it for every later user: each such global is refused as a target."""
    import pathlib
    import pickle

    import torch.serialization
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    from registry.format.dcp_metadata import load_dcp_metadata
    module = "torch.distributed.checkpoint.metadata"
    raw, shared = {
        "record class": (_global(module, "Metadata"), Metadata),
        "enum member": (_global(module, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R",
                        _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT),
        "path class": (_global("pathlib", "PurePosixPath"), pathlib.PurePosixPath),
        "layout function": (_global("torch.serialization", "_get_layout"), torch.serialization._get_layout),
    }[target]
    raw = b"\x80\x02" + raw + _pwned_build()
    with pytest.raises((UnsafePickleError, DcpMetadataError)) as info:
        load_dcp_metadata(raw)
    assert_refusal(info.value, RegistryError)
    assert not hasattr(shared, "pwned_")
    try:
        pickle.loads(raw)
        assert shared.pwned_ == 1  # type: ignore[union-attr]  # the attack is real
    finally:
        if hasattr(shared, "pwned_"):
            delattr(shared, "pwned_")


def test_dcp_metadata_records_hold_only_their_fields() -> None:
    """A record's state naming anything but its fields is refused, and what is checked has its real class."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from registry.format.dcp_metadata import load_dcp_metadata
    good = Metadata(state_dict_metadata={}, storage_data={})
    assert type(load_dcp_metadata(pickle.dumps(good))) is Metadata
    bad = pickle.dumps(good).replace(b"version", b"__class")
    with pytest.raises(DcpMetadataError, match="not a complete DCP Metadata"):
        load_dcp_metadata(bad)


def test_dcp_metadata_path_whose_slots_a_pickle_set_is_refused() -> None:
    """A path the unpickler built is fresh, but a BUILD may still set its slots (its text among them): the
    checkpoint id is made again from its text, and one whose text is not a string is refused."""
    import pathlib
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    from registry.format.dcp_metadata import load_dcp_metadata
    good = pickle.dumps(Metadata(state_dict_metadata={}, storage_data={},
                                 storage_meta=StorageMeta(checkpoint_id=pathlib.PurePosixPath("/x"))), protocol=2)
    loaded = load_dcp_metadata(good)
    assert loaded.storage_meta is not None and loaded.storage_meta.checkpoint_id == pathlib.PurePosixPath("/x")
    reduce_at = good.index(b"R", good.index(b"PurePosixPath"))
    bad = good[:reduce_at + 1] + b"N}X\x04\x00\x00\x00_strK\x01s\x86b" + good[reduce_at + 1:]
    with pytest.raises(DcpMetadataError, match="storage_meta is malformed"):
        load_dcp_metadata(bad)


def test_every_dcp_metadata_truncation_is_refused(sqlite_reg: Registry, tmp_path: Path) -> None:
    from registry.errors import DcpMetadataError
    from registry.format.dcp_metadata import load_dcp_metadata
    directory = dcp_dir(tmp_path)
    raw = (directory / ".metadata").read_bytes()
    for length in range(len(raw)):
        with pytest.raises(DcpMetadataError) as info:
            load_dcp_metadata(raw[:length])
        assert_refusal(info.value, DcpMetadataError)
    (directory / ".metadata").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(DcpMetadataError, match="truncated"):
        sqlite_reg.import_checkpoint(directory, run="run", step=1)
    assert sqlite_reg.runs() == []
    print(f"\nDCP .metadata truncations refused: {len(raw)}")


@pytest.mark.parametrize("damage, error, match", [
    ("missing", "DcpMetadataError", "missing"),
    ("short", "DcpMetadataError", "needs at least"),
    ("outside", "UnsafePathError", "unsafe file name"),
    ("past-the-end", "DcpMetadataError", "needs at least"),
    ("huge-tensor", "DcpMetadataError", "claims"),
])
def test_dcp_metadata_naming_files_that_are_not_there(sqlite_reg: Registry, tmp_path: Path, opened: list[Path],
                                                      damage: str, error: str, match: str) -> None:
    from registry import errors
    directory = dcp_dir(tmp_path)
    data = directory / "__0_0.distcp"
    if damage == "missing":
        rewrite_metadata(directory, lambda md: [setattr(i, "relative_path", "__1_0.distcp")
                                                for i in md.storage_data.values()])
    elif damage == "short":
        data.write_bytes(data.read_bytes()[:-1])
    elif damage == "outside":
        (tmp_path / "x.distcp").write_bytes(data.read_bytes())  # would "work" if followed
        rewrite_metadata(directory, lambda md: [setattr(i, "relative_path", "../x.distcp")
                                                for i in md.storage_data.values()])
    elif damage == "past-the-end":
        rewrite_metadata(directory, lambda md: [setattr(i, "length", i.length + (1 << 40))
                                                for i in md.storage_data.values()])
    else:  # a load would allocate 4 TiB before reading a byte
        def huge(md: Any) -> None:
            entry = md.state_dict_metadata["model.embed.weight"]
            entry.size = entry.chunks[0].sizes = torch.Size([1 << 20, 1 << 20])
        rewrite_metadata(directory, huge)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    opened.clear()
    with pytest.raises(getattr(errors, error), match=match) as info:
        sqlite_reg.import_checkpoint(directory, run="run", step=1)
    assert_refusal(info.value, getattr(errors, error))
    assert_inside([p for p in opened if p.name.endswith(".distcp")], directory)
    assert sqlite_reg.runs() == []
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


def test_dcp_value_needing_full_unpickling_is_refused(sqlite_reg: Registry, tmp_path: Path) -> None:
    """DCP's default planner reads non-tensor values with ``weights_only=False``; ours never does."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from registry.format.dcp_metadata import FileSystemReader, load_dcp_state_dict
    marker = tmp_path / "pwned"
    directory = dcp_dir(tmp_path, w=torch.ones(2), obj=Sentinel(marker))
    info = sqlite_reg.import_checkpoint(directory, run="run", step=1)  # nothing of the data is unpickled
    assert info.status == "verified" and not marker.exists()
    for where in (directory, info.path):
        with pytest.raises(UnsafePickleError, match="full unpickling") as refused:
            load_dcp_state_dict(where)
        assert_refusal(refused.value, UnsafePickleError)
    assert not marker.exists()
    _load_state_dict({}, storage_reader=FileSystemReader(directory), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)  # what dcp.load does by default
    assert marker.exists()


def test_dcp_metadata_random_edits(tmp_path: Path) -> None:
    """A real ``.metadata`` with a few bytes edited: a one-line refusal, or a ``Metadata`` that loads or is refused."""
    from registry.errors import DcpMetadataError
    from registry.format.dcp_metadata import check_metadata, load_dcp_metadata, load_dcp_state_dict
    directory = dcp_dir(tmp_path)
    raw = (directory / ".metadata").read_bytes()
    seen = {"accepted": 0, "refused": 0, "loaded": 0}

    @settings(max_examples=FUZZ, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(edited=_edited(st.just(raw)))
    def check(edited: bytes) -> None:
        try:
            metadata = load_dcp_metadata(edited)
        except RegistryError as exc:
            assert_refusal(exc, DcpMetadataError, UnsafePickleError, UnsafePathError)
            seen["refused"] += 1
            return
        check_metadata(metadata, where="again")
        seen["accepted"] += 1
        (directory / ".metadata").write_bytes(edited)
        try:
            load_dcp_state_dict(directory)  # the data file is intact: the edit either still loads, or is refused
            seen["loaded"] += 1
        except RegistryError as exc:
            assert_refusal(exc, CorruptCheckpointError, UnsafePickleError, UnsafePathError)

    check()
    print(f"\nDCP .metadata random edits: {seen}")
    assert seen["refused"] >= FUZZ // 5, seen


def test_dcp_reader_does_not_follow_a_symlinked_data_file(tmp_path: Path, opened: list[Path]) -> None:
    from registry.format.dcp_metadata import load_dcp_state_dict
    directory = dcp_dir(tmp_path)
    outside = tmp_path / "outside.distcp"
    (directory / "__0_0.distcp").rename(outside)  # the very bytes expected: following the link would "work"
    (directory / "__0_0.distcp").symlink_to(outside)
    opened.clear()
    with pytest.raises(UnsafePathError, match="symlink") as info:
        load_dcp_state_dict(directory)
    assert_refusal(info.value, UnsafePathError)
    assert_inside(opened, directory)
