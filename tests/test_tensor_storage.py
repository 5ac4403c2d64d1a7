"""Loaded tensors are independent, as ``safetensors.torch.load_file``'s are.

Each tensor of a loaded state dict has a storage of exactly its own bytes
(offset 0), so ``torch.save`` works on a state dict of mixed dtypes and
writes only what it holds, and a retained tensor keeps nothing else alive;
while a local load stays zero-copy (every tensor lies inside the file's
mapping) and the values stay bit-exact. Covered for local loads, the
low-level readers, and real 2-rank gloo groups (broadcast and shared-fs).
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from registry import Checkpoint, Registry
from registry.fs.filemaps import layout, tensors_of
from registry.fs.mapping import map_file
from tests._dist_worker import fingerprint
from tests.helpers import child_env, write_raw_safetensors

REPO = Path(__file__).resolve().parents[1]
ONE_SAVE_LIMIT = 8 << 10  # torch.save of a few-byte tensor: ~1.5 KiB of zip framing, far below any file here


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w.weight": torch.randn(256, 256, generator=g),
        "w.bias": torch.randn(256, generator=g),
        "embed": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "norm.half": torch.randn(7, generator=g).to(torch.float16),
        "steps": torch.tensor(7, dtype=torch.int64),            # the usual int64 buffer beside float weights
        "counts": torch.arange(5, dtype=torch.int32),
        "mask": torch.rand(13, generator=g) > 0.5,
        "ids": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "none.f64": torch.zeros(0, 3, dtype=torch.float64),     # empty tensors sit at their neighbours' offsets
        "none.i32": torch.zeros(0, dtype=torch.int32),
        "scalar": torch.tensor(1.5),
    }


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and (
        a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def assert_independent(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(state) == set(expected)
    for name, t in state.items():
        assert bits_equal(t, expected[name]), name
        assert t.storage_offset() == 0, name
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
    whole = io.BytesIO()
    torch.save(state, whole)  # mixed dtypes: fails when tensors of two dtypes share a storage
    back = torch.load(io.BytesIO(whole.getvalue()), weights_only=True)
    assert all(bits_equal(back[k], expected[k]) for k in expected)
    one = io.BytesIO()
    torch.save(state["steps"], one)  # writes only its own 8 bytes, not the file's
    assert len(one.getvalue()) < ONE_SAVE_LIMIT


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    target = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n") == target:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def assert_inside_mapping(tensors: dict[str, torch.Tensor], path: Path, *,
                          copied: frozenset[str] = frozenset()) -> None:
    """Zero-copy: every non-empty tensor's bytes lie inside a mapping of ``path``, except those named."""
    ranges = mapped_ranges(path)
    assert ranges, f"{path} is not mapped"
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        ptr, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        inside = any(lo <= ptr and end <= hi for lo, hi in ranges)
        assert inside == (name not in copied), name


needs_maps = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")


# --------------------------------------------------------------------------- local loads


@needs_maps
@pytest.mark.parametrize("verify", [False, True])
def test_local_load_gives_independent_tensors_over_the_mapping(reg: Registry, verify: bool) -> None:
    state = mixed_state()
    info = reg.publish("run", 1, state, extra={"opt": {"step": torch.tensor(3)}})
    ckpt = reg.load("run@1", verify=verify)
    assert_independent(ckpt.state_dict, state)
    assert_inside_mapping(ckpt.state_dict, info.path / "model.safetensors")


@needs_maps
def test_sharded_and_directory_loads_give_independent_tensors(sqlite_reg: Registry) -> None:
    state = mixed_state()
    info = sqlite_reg.publish("run", 1, state, max_shard_size=64 << 10)
    shards = sorted(info.path.glob("model-*.safetensors"))
    assert len(shards) > 1
    for ckpt in (sqlite_reg.load("run@1", verify=True), Checkpoint.load(info.path, verify_checksums=True)):
        assert_independent(ckpt.state_dict, state)
        for shard in shards:
            names = tensors_of(map_file(shard.parent, shard.name), shard)
            assert_inside_mapping({k: ckpt.state_dict[k] for k in names}, shard)


def hand_written(path: Path) -> dict[str, torch.Tensor]:
    """A file no writer of ours makes: dtypes interleaved, one tensor off its element size, empties between."""
    parts = [("a", torch.arange(3, dtype=torch.float32)), ("b", torch.arange(3, dtype=torch.float16)),
             ("c", torch.tensor([[1.5, -2.0]], dtype=torch.float32)), ("steps", torch.tensor(9, dtype=torch.int64)),
             ("e", torch.empty(0, 4, dtype=torch.float64)), ("f", torch.arange(4, dtype=torch.int16).view(2, 2)),
             ("g", torch.empty(0, dtype=torch.int32)), ("h", torch.tensor([True, False]))]
    write_raw_safetensors(path, parts)  # "c" starts at byte 18, off its 4-byte size: it must be copied
    return dict(parts)


@needs_maps
def test_readers_give_independent_tensors_of_any_layout(tmp_path: Path) -> None:
    path = tmp_path / "mixed.safetensors"
    expected = hand_written(path)
    mapped = tensors_of(map_file(path.parent, path.name), path)
    assert_independent(mapped, expected)
    assert_inside_mapping(mapped, path, copied=frozenset({"c", "steps"}))  # both lie off their element size

    # one retained tensor keeps the mapping it lies in alive, and only its own bytes are its storage
    kept = mapped["f"]
    del mapped
    gc.collect()
    assert mapped_ranges(path) and bits_equal(kept, expected["f"])
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()


def test_pieces_for_the_wire_and_their_tensors(tmp_path: Path) -> None:
    """A broadcast cuts a safetensors file into header + one piece per tensor; a bad cut is joined, not trusted."""
    path = tmp_path / "mixed.safetensors"
    expected = hand_written(path)
    raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    lengths = layout("model.safetensors", raw)
    assert sum(lengths) == raw.numel() and len(lengths) == 1 + sum(1 for t in expected.values() if t.numel())
    assert layout("optimizer.pt", raw) == [raw.numel()]
    cuts = [0, *itertools.accumulate(lengths)]
    pieces = tuple(raw[a:b].clone() for a, b in zip(cuts, cuts[1:]))
    assert_independent(tensors_of(pieces, path), expected)
    wrong = (torch.cat(pieces[:2]), *pieces[2:])  # cut elsewhere than the header says
    assert_independent(tensors_of(wrong, path), expected)

    # a header whose offsets do not tile the file is sent whole, for the full parse to refuse alike everywhere
    bad = bytearray(path.read_bytes())
    at = bad.index(b'"data_offsets": [0, 12]')
    bad[at:at + 23] = b'"data_offsets": [0, 99]'
    assert layout("model.safetensors", torch.frombuffer(bad, dtype=torch.uint8)) == [len(bad)]


# --------------------------------------------------------------------------- distributed loads

CHILD = r"""
import gc, io, json, os, sys
from datetime import timedelta
from pathlib import Path
import torch
import torch.distributed as dist

rank, world, port, spec_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
spec = json.loads(Path(spec_path).read_text())
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
from registry import Registry
from registry.distributed import loader
from tests._dist_worker import fingerprint


def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024


def report(state):
    own = [k for k, t in state.items()
           if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size()]
    try:
        torch.save(state, io.BytesIO())
        saved = "ok"
    except Exception as exc:
        saved = str(exc).splitlines()[0]
    one = io.BytesIO()
    torch.save(state["steps"], one)
    return {"not_own": own, "saved": saved, "one": len(one.getvalue()), "fp": fingerprint(state),
            "devices": sorted({t.device.type for t in state.values()})}


url = spec["url"] if rank == 0 else f"sqlite:///{spec['out']}/empty-{rank}.db"
results = {}
root = spec["root"] if rank == 0 else f"{spec['out']}/empty-root-{rank}"  # a root belongs to one catalog
with Registry.open(url=url, root=root) as reg:
    for sc in spec["scenarios"]:
        loader.BUCKET_BYTES = sc["bucket"]
        try:
            if sc.get("retain"):
                gc.collect()
                before = rss_anon()
                ckpt = reg.load(sc["ref"], broadcast=True, strategy=sc["strategy"], verify=sc["verify"])
                kept = ckpt.state_dict["steps"]
                loaded = rss_anon() - before
                del ckpt
                gc.collect()
                results[sc["name"]] = {"ok": True, "loaded": loaded, "retained": rss_anon() - before,
                                       "value": int(kept)}
            else:
                ckpt = reg.load(sc["ref"], broadcast=True, strategy=sc["strategy"], verify=sc["verify"],
                                map_location=sc.get("where", "cpu"))
                results[sc["name"]] = {"ok": True, **report(ckpt.state_dict)}
                del ckpt
        except Exception as exc:
            results[sc["name"]] = {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
        Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(results))
sys.stdout.flush()
os._exit(0)
"""

BIG_MIB = 96


def scenarios(where: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"name": "broadcast-verify", "ref": "run@1", "strategy": "broadcast", "verify": True, "bucket": 128 << 20},
        # tiny buckets: small tensors packed and copied out, big ones received alone and in several buckets
        {"name": "broadcast-small-buckets", "ref": "run@1", "strategy": "broadcast", "verify": True,
         "bucket": 4096},
        {"name": "broadcast-no-verify", "ref": "run@1", "strategy": "broadcast", "verify": False, "bucket": 1 << 20},
        {"name": "broadcast-sharded", "ref": "sharded@1", "strategy": "broadcast", "verify": True, "bucket": 1 << 20},
        {"name": "shared-fs", "ref": "run@1", "strategy": "shared-fs", "verify": True, "bucket": 1 << 20},
        {"name": "retain", "ref": "big@1", "strategy": "broadcast", "verify": False, "bucket": 128 << 20,
         "retain": True},
    ]
    if where is not None:
        out += [{"name": f"{s}-{where}", "ref": "run@1", "strategy": s, "verify": True, "bucket": 1 << 20,
                 "where": where} for s in ("broadcast", "shared-fs")]
    return out


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("storage")
    root, url = base / "ckpt", f"sqlite:///{base / 'catalog.db'}"
    state = mixed_state()
    with Registry.open(url=url, root=root) as reg:
        reg.publish("run", 1, state)
        reg.publish("sharded", 1, state, max_shard_size=64 << 10)
        reg.publish("big", 1, {"big": torch.ones(BIG_MIB << 18), "steps": torch.tensor(5, dtype=torch.int64)})
    where = "cuda" if torch.cuda.is_available() else None
    spec_path = base / "spec.json"
    spec_path.write_text(json.dumps({"root": str(root), "url": url, "out": str(base),
                                     "scenarios": scenarios(where)}))
    port = free_port()
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), "2", str(port), str(spec_path)], cwd=REPO, env=env)
             for r in range(2)]
    end = time.monotonic() + 180  # a hang detector, far above the collectives' own timeouts
    try:
        codes = [p.wait(timeout=max(1.0, end - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("a rank was still running after 180s: a rank hung")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0], codes
    results = [json.loads((base / f"rank{r}.json").read_text()) for r in range(2)]
    return {"results": results, "fp": fingerprint(state), "where": where}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["broadcast-verify", "broadcast-small-buckets", "broadcast-no-verify",
                                  "broadcast-sharded", "shared-fs"])
def test_distributed_load_gives_independent_tensors(group: dict[str, Any], name: str) -> None:
    for rank, result in enumerate(group["results"]):
        got = result[name]
        assert got["ok"], (rank, got)
        assert got["not_own"] == [], (rank, got["not_own"])
        assert got["saved"] == "ok", (rank, got["saved"])
        assert got["one"] < ONE_SAVE_LIMIT, (rank, got["one"])
        assert got["fp"] == group["fp"], f"rank {rank} loaded other values"


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_retained_small_tensor_keeps_no_received_buffer_alive(group: dict[str, Any]) -> None:
    """Rank 1 receives a 96 MiB file, keeps only its 8-byte tensor: the memory must go back."""
    got = group["results"][1]["retain"]
    assert got["ok"] and got["value"] == 5, got
    assert got["loaded"] > (BIG_MIB << 20) // 2, got  # the bytes were received into this process's memory
    assert got["retained"] < (BIG_MIB << 20) // 4, got


@pytest.mark.distributed
@pytest.mark.cuda
def test_distributed_load_to_cuda_gives_independent_tensors(group: dict[str, Any]) -> None:
    if group["where"] is None:
        pytest.skip("no CUDA device")
    for strategy in ("broadcast", "shared-fs"):
        for rank, result in enumerate(group["results"]):
            got = result[f"{strategy}-cuda"]
            assert got["ok"] and got["devices"] == ["cuda"], (rank, got)
            assert got["not_own"] == [] and got["saved"] == "ok" and got["fp"] == group["fp"], (rank, got)
