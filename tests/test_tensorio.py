"""The streaming writer and reader: format-exact files, digests of exactly the bytes on disk."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as hs

import registry.format.pieces as pieces_mod
import registry.format.safetensors as safetensors_mod
import registry.fs.hashing as tio
from registry.errors import SafetensorsFormatError
from registry.fs.filemaps import tensors_of
from registry.fs.mapping import map_file
from registry.format.safetensors import write_safetensors
from registry.fs.hashing import HashingWriter, hash_file
from tests.helpers import write_raw_safetensors


def every_dtype_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for name, dtype in safetensors_mod.dtypes().items():
        raw = torch.randint(0, 256, (3, 5), dtype=torch.uint8, generator=g)
        if dtype == torch.bool:
            state[f"t.{name}"] = raw > 127
        else:  # any bit pattern, NaNs included: the format stores bytes, not values
            state[f"t.{name}"] = raw.view(-1).repeat(dtype.itemsize)[:15 * dtype.itemsize].view(dtype).view(3, 5)
    base = torch.randn(6, 8, generator=g)
    state.update({
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 7),
        "empty_int": torch.empty(4, 0, dtype=torch.int64),
        "transposed": base.t(),
        "strided": base[:, ::3],
        "expanded": torch.randn(3, 1, generator=g).expand(3, 4),
        "negated": torch.randn(4, generator=g).neg(),
    })
    return state


def write(path: Path, state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> HashingWriter:
    with HashingWriter(path) as out:
        write_safetensors(out, state, metadata)
    return out


def mapped(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file as every load gets them: parsed over its private mapping."""
    return tensors_of(map_file(path.parent, path.name), path)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_every_dtype_loads_with_safetensors(tmp_path: Path) -> None:
    state = every_dtype_state()
    path = tmp_path / "m.safetensors"
    write(path, state, {"format": "pt"})
    loaded = st.load_file(str(path))
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert bits_equal(loaded[name], tensor), name
    ours = mapped(path)
    for name, tensor in state.items():
        assert bits_equal(ours[name], tensor), name


def test_file_layout_is_exactly_the_format(tmp_path: Path) -> None:
    """8-byte LE header length, space-padded JSON header, then the data area tiled in header order."""
    state = every_dtype_state()
    path = tmp_path / "m.safetensors"
    out = write(path, state, {"format": "pt"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8 + n - 1:8 + n] in (b"}", b" ")
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == {"format": "pt"}
    data = raw[8 + n:]
    spans = sorted((spec["data_offsets"], name) for name, spec in header.items())
    cursor = 0
    for (begin, end), name in spans:
        assert begin == cursor
        tensor = state[name].contiguous()
        assert header[name]["shape"] == list(tensor.shape)
        assert safetensors_mod.dtypes()[header[name]["dtype"]] == tensor.dtype
        assert data[begin:end] == tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else True
        assert begin % tensor.element_size() == 0  # every tensor aligned to its element size
        cursor = end
    assert cursor == len(data)
    assert out.size == len(raw)
    assert out.sha256 == hashlib.sha256(raw).hexdigest()
    assert out.xxh3_128_pieces == (xxhash.xxh3_128_hexdigest(raw),)  # one piece: smaller than PIECE_SIZE


def test_same_tensors_as_save_file(tmp_path: Path) -> None:
    state = {k: v.contiguous() for k, v in every_dtype_state().items()}
    st.save_file(state, str(tmp_path / "ref.safetensors"))
    write(tmp_path / "ours.safetensors", state)
    ref, ours = st.load_file(str(tmp_path / "ref.safetensors")), st.load_file(str(tmp_path / "ours.safetensors"))
    assert set(ref) == set(ours)
    assert all(bits_equal(ref[k], ours[k]) for k in ref)


@settings(max_examples=25, deadline=None)
@given(sizes=hs.lists(hs.integers(min_value=0, max_value=9000), max_size=30))
def test_writer_digests_match_bytes_for_any_write_pattern(tmp_path_factory: pytest.TempPathFactory,
                                                          sizes: list[int]) -> None:
    """Small writes coalesce, large ones split into chunks: the file and digests stay exact."""
    old = (tio.CHUNK, tio.SMALL, tio.MAX_PENDING, tio.WRITEBACK, pieces_mod.PIECE_SIZE)
    tio.CHUNK, tio.SMALL, tio.MAX_PENDING, tio.WRITEBACK, pieces_mod.PIECE_SIZE = 4096, 1024, 2, 3000, 5000
    try:
        path = tmp_path_factory.mktemp("w") / "f.bin"
        pieces = [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
        with HashingWriter(path) as out:
            for piece in pieces:
                assert out.write(piece) == len(piece)
        expected = b"".join(pieces)
        assert path.read_bytes() == expected
        assert out.size == len(expected)
        assert out.sha256 == hashlib.sha256(expected).hexdigest()
        assert out.piece_size == 5000  # pieces end inside writes, across coalesced and chunked ones
        assert out.xxh3_128_pieces == tuple(xxhash.xxh3_128_hexdigest(expected[i:i + 5000])
                                            for i in range(0, len(expected), 5000))
    finally:
        tio.CHUNK, tio.SMALL, tio.MAX_PENDING, tio.WRITEBACK, pieces_mod.PIECE_SIZE = old


def test_large_tensor_spans_many_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tio, "CHUNK", 1 << 12)
    monkeypatch.setattr(tio, "SMALL", 1 << 10)
    monkeypatch.setattr(tio, "MAX_PENDING", 3)
    state = {"big": torch.randn(257, 129), "small": torch.arange(10), "flag": torch.tensor(True)}
    path = tmp_path / "m.safetensors"
    write(path, state)
    raw = path.read_bytes()
    tensors = mapped(path)
    assert all(bits_equal(tensors[k], state[k]) for k in state)
    for digest, fn in (("sha256", lambda b: hashlib.sha256(b).hexdigest()),
                       ("xxh3_128", xxhash.xxh3_128_hexdigest)):
        assert hash_file(path, digest) == (len(raw), fn(raw))


def test_truncated_file_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write(path, {"a": torch.randn(100)})
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    with pytest.raises(SafetensorsFormatError):
        mapped(path)


def test_aborted_writer_leaves_no_digest(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    with pytest.raises(RuntimeError), HashingWriter(path) as out:
        out.write(b"x" * 5000)
        raise RuntimeError("boom")
    assert out.sha256 is None


def test_unknown_digest_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write(path, {"a": torch.randn(3)})
    with pytest.raises(ValueError):
        hash_file(path, "md5")


def test_mapped_tensors_are_private_views(tmp_path: Path) -> None:
    state = every_dtype_state()
    path = tmp_path / "m.safetensors"
    write(path, state)
    before = path.read_bytes()
    tensors = mapped(path)
    assert set(tensors) == set(state) and all(bits_equal(tensors[k], state[k]) for k in state)
    tensors["transposed"].add_(1)  # copy-on-write: never reaches the file
    assert path.read_bytes() == before


def test_mapped_unaligned_tensor_is_copied(tmp_path: Path) -> None:
    """The format allows any header length; an odd one misaligns every wider dtype."""
    data = torch.arange(6, dtype=torch.float32)
    header = json.dumps({"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}).encode() + b"  "
    header += b" " * (1 - len(header) % 2)  # odd length: the data starts at an odd offset
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data.numpy().tobytes())
    tensors = mapped(path)
    assert torch.equal(tensors["x"], data.view(2, 3))
    assert torch.equal(st.load_file(str(path))["x"], data.view(2, 3))


def test_mapped_runs_of_mixed_dtypes_in_any_order(tmp_path: Path) -> None:
    """Runs of one dtype are cut together; a run starting off its element size is copied first."""
    parts = [("a", torch.arange(3, dtype=torch.float32)), ("b", torch.arange(3, dtype=torch.float16)),
             ("c", torch.tensor([[1.5, -2.0]], dtype=torch.float32)), ("d", torch.tensor(True)),
             ("e", torch.empty(0, 4, dtype=torch.float64)), ("f", torch.arange(4, dtype=torch.int16).view(2, 2)),
             ("g", torch.tensor([7], dtype=torch.int16))]
    path = tmp_path / "mixed.safetensors"
    write_raw_safetensors(path, parts)  # "c" starts at byte 18, off its 4-byte size
    tensors = mapped(path)
    assert list(tensors) == [name for name, _ in parts]
    for name, tensor in parts:
        assert tensors[name].dtype == tensor.dtype and bits_equal(tensors[name], tensor), name


def test_mapped_file_must_tile_the_mapping(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write(path, {"a": torch.randn(100)})
    with open(path, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(SafetensorsFormatError, match="covers"):
        mapped(path)
    path.write_bytes(b"\1\0")
    with pytest.raises(SafetensorsFormatError):
        mapped(path)
