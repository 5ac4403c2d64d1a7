"""Policy deltas (``registry.format.delta``): exact round trips, every dtype, and every way a delta can be wrong.

A decode must give the target's bytes exactly (NaN payloads and -0.0
included) or raise: ``DeltaBaseError`` for a base that is not the delta's,
``CorruptCheckpointError`` for a damaged or lying file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from registry import Registry
from registry.errors import CorruptCheckpointError, DeltaBaseError
from registry.format import delta
from registry.format.safetensors import safetensors_header
from tests.helpers import make_state

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
          *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Any bit pattern of ``dtype`` (NaNs with payloads, infinities, -0.0), a bool only 0 or 1."""
    n = 1
    for d in shape:
        n *= d
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def changed_at(t: torch.Tensor, count: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` with exactly ``count`` elements, at random positions, set to other bit patterns; and the positions."""
    out = t.clone()
    flat = out.reshape(-1).view(torch.uint8).reshape(t.numel(), t.element_size())
    where = torch.randperm(t.numel(), generator=g)[:count]
    if t.dtype == torch.bool:
        flat[where, 0] ^= 1
    else:
        flips = torch.randint(0, 256, (count, t.element_size()), dtype=torch.uint8, generator=g)
        flips[:, 0] |= (flips == 0).all(dim=1).to(torch.uint8)  # never all zero: the element must change
        flat[where] ^= flips
    return out, where


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of ``a`` and ``b`` whose bytes differ."""
    rows = (a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).reshape(a.numel(), -1)
    return int(rows.any(dim=1).sum())


def assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert raw(got[name]) == raw(t), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("percent", [0, 1, 3, 20, 100])
def test_round_trip_at_every_rate_and_dtype(dtype: torch.dtype, percent: int) -> None:
    g = torch.Generator().manual_seed(percent)
    base = {"w": random_tensor((40, 50), dtype, g), "scalar": random_tensor((), dtype, g),
            "empty": random_tensor((0, 3), dtype, g), "other": random_tensor((7,), torch.float32, g)}
    count = 2000 * percent // 100
    target = dict(base)
    target["w"], where = changed_at(base["w"], count, g)
    data = delta.encode(base, target)
    header = delta.read_header(data)
    assert header.changed == count == header.tensors["w"].changed
    assert header.tensors["other"].changed == 0 and header.tensors["empty"].changed == 0
    assert header.base_sha256 == delta.full_sha256(base) and header.target_sha256 == delta.full_sha256(target)
    assert header.tensors["w"].digest == xxhash.xxh3_128_hexdigest(raw(target["w"]))
    decoded = delta.decode(base, data)
    assert_exact(decoded, target)
    if count:
        assert decoded["w"] is not base["w"] and raw(base["w"]) != raw(decoded["w"])
    assert decoded["other"] is base["other"]  # unchanged: the base's own tensor


def test_nan_payloads_and_signed_zeros_are_changes_and_come_back_exactly() -> None:
    for dtype, bits, unsigned in ((torch.bfloat16, [0x7FC0, 0x7FC1, 0x0000, 0xFFC0], np.uint16),
                                  (torch.float32, [0x7FC00000, 0x7FC00001, 0x00000000, 0xFFC00000], np.uint32)):
        base = {"x": torch.from_numpy(np.array(bits, dtype=unsigned).view(f"<i{dtype.itemsize}")).view(dtype)}
        target = {"x": base["x"].clone()}
        as_int = target["x"].view({2: torch.int16, 4: torch.int32}[dtype.itemsize])
        as_int[1] ^= 1                            # NaN with another payload
        as_int[2] ^= torch.iinfo(as_int.dtype).min  # 0.0 -> -0.0
        assert torch.equal(target["x"][2], base["x"][2])  # equal as numbers, different as bytes
        data = delta.encode(base, target)
        assert delta.read_header(data).changed == 2
        assert_exact(delta.decode(base, data), target)


def test_non_contiguous_inputs_give_the_contiguous_result() -> None:
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(30, 20, generator=g).to(torch.bfloat16)
    base = {"t": wide.t(), "s": torch.randn(40, generator=g)[::2]}
    assert not base["t"].is_contiguous() and not base["s"].is_contiguous()
    target = {"t": (base["t"] * 1.5).t().contiguous().t(), "s": base["s"].clone()}
    target["s"][3] = 99.0
    data = delta.encode(base, target)
    assert data == delta.encode({k: v.contiguous() for k, v in base.items()},
                                {k: v.contiguous() for k, v in target.items()})
    assert_exact(delta.decode(base, data), {k: v.contiguous() for k, v in target.items()})


@pytest.mark.parametrize("chunk", [8, 1000, delta.CHUNK])
def test_any_chunk_size_gives_the_same_delta_and_advance_leaves_the_base_equal_to_the_target(
        monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    g = torch.Generator().manual_seed(7)
    base = {"w": random_tensor((1000, 37), torch.bfloat16, g), "t": random_tensor((50, 30), torch.float32, g).t(),
            "x": random_tensor((5,), torch.int8, g), "same": random_tensor((9,), torch.int64, g)}
    target = {name: changed_at(t, t.numel() // 10, g)[0] if name != "same" else t.clone() for name, t in base.items()}
    kept = {name: t.clone() for name, t in base.items()}
    want = delta.encode(base, target)
    monkeypatch.setattr(delta, "CHUNK", chunk)
    assert delta.encode(base, target) == want
    owned = {name: t.clone() for name, t in base.items()}  # "t" stays non-contiguous: advanced by a copy
    assert not owned["t"].is_contiguous()
    assert delta.encode(owned, target, advance=True) == want
    assert_exact(owned, target)
    assert_exact(delta.decode(kept, want), target)


def test_no_change_is_an_empty_delta_that_decodes_to_the_base(tmp_path: Path) -> None:
    base = make_state(0)
    data = delta.encode(base, {k: v.clone() for k, v in base.items()})
    header = delta.read_header(data)
    assert header.changed == 0 and header.base_sha256 == header.target_sha256
    decoded = delta.decode(base, data)
    assert all(decoded[k] is base[k] for k in base)
    path = tmp_path / "empty.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), "pt") as f:
        assert list(f.keys()) == [] and f.metadata()["format"] == delta.FORMAT


def test_the_file_opens_with_safetensors_as_uint8_streams(tmp_path: Path) -> None:
    base = make_state(0)
    target = make_state(1)
    data = delta.encode(base, target)
    path = tmp_path / "d.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert set(meta) == {"format", "version", "base_sha256", "target_sha256", "tensors", "content_sha256"}
        changed = [n for n, spec in json.loads(meta["tensors"]).items() if spec.get("changed")]
        keys = f.keys()
        assert sorted(keys) == sorted(kind + n for n in changed for kind in (delta.POSITIONS, delta.VALUES))
        for key in keys:
            t = f.get_tensor(key)
            assert t.dtype == torch.uint8 and t.dim() == 1 and t.numel() > 0
            assert raw(t)[:4] == b"\x28\xb5\x2f\xfd"  # a zstd frame


def test_full_sha256_is_the_digest_a_full_publish_writes(sqlite_reg: Registry) -> None:
    state = make_state(3)
    sqlite_reg.publish("run", 1, state)
    written = (sqlite_reg.resolve("run@1").path / "model.safetensors").read_bytes()
    assert delta.full_sha256(state) == hashlib.sha256(written).hexdigest()


@pytest.mark.parametrize("change", ["name added", "name removed", "name renamed", "shape", "dtype"])
def test_a_changed_name_shape_or_dtype_needs_a_full_publish(change: str) -> None:
    base = make_state(0)
    target = dict(base)
    if change == "name added":
        target["new"] = torch.zeros(2)
    elif change == "name removed":
        del target["embed"]
    elif change == "name renamed":
        target["embedding"] = target.pop("embed")
    elif change == "shape":
        target["embed"] = base["embed"].reshape(4, 16)
    else:
        target["embed"] = base["embed"].float()
    with pytest.raises(DeltaBaseError, match="publish a full"):
        delta.encode(base, target)


def test_a_wrong_base_is_refused() -> None:
    base, target, other = make_state(0), make_state(1), make_state(2)
    data = delta.encode(base, target)
    with pytest.raises(DeltaBaseError, match="not this delta's"):
        delta.decode(other, data)                    # same tensors, other bytes: its digest tells
    with pytest.raises(DeltaBaseError, match="not this delta's"):
        delta.decode(base, data, base_sha256="0" * 64)
    with pytest.raises(DeltaBaseError, match="not this delta's"):
        delta.decode({**base, "embed": base["embed"].float()}, data)
    with pytest.raises(DeltaBaseError, match="not this delta's"):
        delta.decode({k: v for k, v in base.items() if k != "mask"}, data)
    # a caller that vouches for a base it did not check: every decoded tensor is checked all the same
    with pytest.raises(CorruptCheckpointError, match="do not match its xxh3_128"):
        delta.decode(other, data, base_sha256=delta.full_sha256(base))
    assert_exact(delta.decode(base, data, base_sha256=delta.full_sha256(base)), target)


def test_every_flipped_bit_or_byte_of_a_delta_is_caught() -> None:
    g = torch.Generator().manual_seed(5)
    base = {"a": random_tensor((64,), torch.bfloat16, g), "b": random_tensor((9,), torch.int8, g)}
    target = {"a": changed_at(base["a"], 6, g)[0], "b": changed_at(base["b"], 2, g)[0]}
    data = delta.encode(base, target)
    base_sha = delta.full_sha256(base)
    for i in range(len(data)):
        for flip in (0x01, 0xFF):
            damaged = bytearray(data)
            damaged[i] ^= flip
            with pytest.raises(CorruptCheckpointError):
                delta.decode(base, damaged, base_sha256=base_sha)
    for cut in (0, 7, 8, len(data) // 2, len(data) - 1):
        with pytest.raises(CorruptCheckpointError):
            delta.decode(base, data[:cut])


def rebuilt(data: bytes, *, streams: dict[str, bytes] | None = None, tensors: dict[str, dict] | None = None,
            **meta: str) -> bytes:
    """``data`` with other streams, tensor records or metadata, and a content digest that fits them: what a
    writer that lies (not a damaged file) makes."""
    header = delta.read_header(data)
    metadata = {"format": delta.FORMAT, "version": delta.VERSION, "base_sha256": header.base_sha256,
                "target_sha256": header.target_sha256,
                "tensors": json.dumps(tensors if tensors is not None else
                                      {n: r.to_json() for n, r in header.tensors.items()}, separators=(",", ":")),
                **meta}
    if streams is None:
        parsed = delta._parse(data, None)
        streams = {kind + n: bytes(s[i]) for n, s in parsed.streams.items()
                   for i, kind in enumerate((delta.POSITIONS, delta.VALUES))}
    placeholders = delta._placeholders(streams)
    _, order, _ = safetensors_header(placeholders)
    blobs = [streams[n] for n in order]
    metadata["content_sha256"] = delta._content_sha256(metadata, blobs)
    head, _, _ = safetensors_header(placeholders, metadata)
    return b"".join([head, *blobs])


def test_a_delta_that_lies_is_corrupt_never_wrong_weights() -> None:
    base = {"w": torch.arange(100, dtype=torch.float32)}
    target = {"w": base["w"].clone()}
    target["w"][[3, 50, 99]] = -1.0
    data = delta.encode(base, target)
    assert rebuilt(data) == data
    z = zstandard.ZstdCompressor()
    values = delta._planes(np.array([0, 0, 0], dtype=np.int32), 4)
    past_end = delta._planes(np.array([3, 46, 60], dtype=np.int64), 1)  # 3, 50, 111 > 99
    records = {n: r.to_json() for n, r in delta.read_header(data).tensors.items()}
    liars = {
        "values that decode to other bytes": rebuilt(data, streams={
            "positions:w": z.compress(delta._planes(np.array([3, 46, 48], dtype=np.int64), 1)),
            "values:w": z.compress(values)}),
        "positions past the end": rebuilt(data, streams={"positions:w": z.compress(past_end),
                                                         "values:w": z.compress(values)}),
        "a frame of another size": rebuilt(data, streams={"positions:w": z.compress(b"\x00" * 4),
                                                          "values:w": z.compress(values)}),
        "bytes after a frame": rebuilt(data, streams={
            "positions:w": z.compress(delta._planes(np.array([3, 46, 48], dtype=np.int64), 1)) + b"\x00",
            "values:w": z.compress(values)}),
        "another version": rebuilt(data, version="3"),
        "a stream of an unchanged tensor": rebuilt(data, tensors={"w": {**records["w"], "changed": 0,
                                                                         "gap_width": 0}}),
        "a count beyond the tensor": rebuilt(data, tensors={"w": {**records["w"], "changed": 101}}),
        "an odd gap width": rebuilt(data, tensors={"w": {**records["w"], "gap_width": 3}}),
        "an unknown dtype": rebuilt(data, tensors={"w": {**records["w"], "dtype": "F128"}}),
    }
    for why, liar in liars.items():
        with pytest.raises(CorruptCheckpointError):
            delta.decode(base, liar)
            pytest.fail(why)
    with pytest.raises(CorruptCheckpointError, match="version '3'"):
        delta.read_header(liars["another version"])

    # a bool element of 2 whose digest the liar wrote to match: still refused
    flags = {"f": torch.zeros(4, dtype=torch.bool)}
    data = delta.encode(flags, {"f": torch.tensor([False, True, False, False])})
    two = xxhash.xxh3_128_hexdigest(bytes([0, 2, 0, 0]))
    liar = rebuilt(data, streams={"positions:f": z.compress(bytes([1])), "values:f": z.compress(bytes([2]))},
                   tensors={"f": {**delta.read_header(data).tensors["f"].to_json(), "xxh3_128": two}})
    with pytest.raises(CorruptCheckpointError, match="bool element"):
        delta.decode(flags, liar)


def test_a_version_1_file_with_sha256_tensor_digests_still_reads_and_is_checked() -> None:
    g = torch.Generator().manual_seed(3)
    base = {"w": random_tensor((300,), torch.bfloat16, g), "n": random_tensor((4,), torch.float32, g)}
    target = {"w": changed_at(base["w"], 20, g)[0], "n": base["n"]}
    data = delta.encode(base, target)
    old = {n: {k: v for k, v in r.to_json().items() if k != "xxh3_128"} | {"sha256": hashlib.sha256(
        raw(target[n])).hexdigest()} for n, r in delta.read_header(data).tensors.items()}
    v1 = rebuilt(data, version="1", tensors=old)
    header = delta.read_header(v1)
    assert {r.algorithm for r in header.tensors.values()} == {"sha256"}
    assert header.tensors["w"].to_json() == old["w"]
    assert_exact(delta.decode(base, v1), target)
    wrong = rebuilt(data, version="1", tensors={**old, "w": {**old["w"], "sha256": "0" * 64}})
    with pytest.raises(CorruptCheckpointError, match="do not match its sha256"):
        delta.decode(base, wrong)
    mixed = rebuilt(data, version="1")  # version 1 with version 2's records
    with pytest.raises(CorruptCheckpointError, match="malformed fields"):
        delta.read_header(mixed)


def test_fold_is_the_delta_from_first_to_last() -> None:
    g = torch.Generator().manual_seed(7)
    a = {"w": random_tensor((500,), torch.bfloat16, g), "n": random_tensor((10,), torch.float32, g)}
    b = {"w": a["w"].clone(), "n": a["n"]}
    b["w"].view(torch.int16)[:40] ^= 0x0101
    c = {"w": b["w"].clone(), "n": changed_at(a["n"], 3, g)[0]}
    c["w"][:10] = a["w"][:10]  # changed a->b, changed back b->c: no change a->c
    ab, bc = delta.encode(a, b), delta.encode(b, c)
    ac = delta.fold(ab, bc, a)
    assert ac == delta.encode(a, c)
    assert_exact(delta.decode(a, ac), c)
    assert delta.read_header(ac).changed == differing(a["w"], c["w"]) + differing(a["n"], c["n"]) == 30 + 3
    cd = delta.encode(c, {"w": c["w"], "n": a["n"]})
    assert delta.fold(ac, cd, a) == delta.fold(ab, delta.fold(bc, cd, b), a)
    with pytest.raises(DeltaBaseError, match="do not chain"):
        delta.fold(ab, cd, a)
    with pytest.raises(DeltaBaseError, match="not this delta's"):
        delta.fold(ab, bc, c)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), numel=st.integers(0, 3000), rates=st.lists(st.floats(0, 1), min_size=2,
       max_size=2), seed=st.integers(0, 2**31 - 1))
def test_property_round_trips_and_folds(dtype: torch.dtype, numel: int, rates: list[float], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    a = {"x": random_tensor((numel,), dtype, g), "y": random_tensor((3,), torch.float64, g)}
    b = {"x": changed_at(a["x"], int(rates[0] * numel), g)[0], "y": a["y"]}
    c = {"x": changed_at(b["x"], int(rates[1] * numel), g)[0], "y": changed_at(a["y"], 1, g)[0]}
    ab, bc = delta.encode(a, b), delta.encode(b, c)
    assert_exact(delta.decode(a, ab), b)
    assert_exact(delta.decode(b, bc), c)
    ac = delta.fold(ab, bc, a)
    assert ac == delta.encode(a, c)
    assert_exact(delta.decode(a, ac), c)
