"""Dedup (opt-in): identical large files of a run's verified steps are stored once, as hard links, and
stay correct under retention, verify, fsck and SIGKILL at each phase of a publish or a gc."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from registry import Registry
from registry.crashpoints import arm
from registry.fs.dedup import link_identical
from registry.fs.inodes import shared_bytes
from registry.retention import KeepLast
from tests.helpers import assert_state_equal, make_state
from tests.killharness import context, settle, worker_url

CONFIG = {"model": "tiny", "layers": 4}


def big_state(seed: int) -> dict[str, torch.Tensor]:
    """A state whose weights file is above the link threshold (smaller files are never linked)."""
    return {**make_state(seed), "base": torch.full((1 << 18,), float(seed))}


@pytest.fixture
def reg(migrated_url: str, root: Path) -> Iterator[Registry]:
    with Registry.open(url=migrated_url, root=root, dedup=True) as registry:
        yield registry


def inode(info_path: Path, name: str) -> int:
    return os.stat(info_path / name).st_ino


def test_identical_files_are_linked_and_survive_retention(reg: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    frozen = big_state(1)
    one = reg.publish("ft", 1, frozen, config=CONFIG)
    two = reg.publish("ft", 2, frozen, config=CONFIG)
    three = reg.publish("ft", 3, frozen, config=CONFIG)
    assert inode(one.path, "model.safetensors") == inode(three.path, "model.safetensors")
    assert inode(two.path, "model.safetensors") != inode(three.path, "model.safetensors")  # the fallback's copy
    for name in ("config.json", "meta.json"):  # small files are never linked
        assert len({inode(i.path, name) for i in (one, two, three)}) == 3
    event = reg.events("ft", step=3)[-1]
    size = (one.path / "model.safetensors").stat().st_size
    assert event.kind == "publish" and event.detail["linked_bytes"] == size
    assert json.loads(cli("show", "ft@3", "--json").output)["shared_bytes"] == size
    assert "stored once with other steps" in cli("show", "ft@3").output

    reg.tag("ft", 3, "keep")
    four = reg.publish("ft", 4, frozen, config=CONFIG)   # links 2's copy, not 3's
    assert inode(four.path, "model.safetensors") == inode(two.path, "model.safetensors")
    out = cli("gc", "ft", "--keep-last", "1")
    assert out.exit_code == 0 and "stored once with kept steps" in out.output
    assert [i.status for i in reg.checkpoints("ft", include_deleted=True)][:2] == ["deleted", "deleted"]
    assert not one.path.exists()
    assert [r.status for r in reg.verify("ft@3")] == ["verified"]
    assert not reg.fsck(checksums=True).problems
    assert_state_equal(reg.load("ft@3").state_dict, frozen)
    assert shared_bytes(three.path, [four.path]) == 0
    assert os.stat(three.path / "model.safetensors").st_nlink == 1


def test_a_corrupt_shared_file_condemns_every_step_that_links_it(reg: Registry) -> None:
    state = big_state(2)
    one = reg.publish("run", 1, state)
    reg.publish("run", 2, state)
    reg.publish("run", 3, state)
    with open(one.path / "model.safetensors", "r+b") as f:  # bit rot under both names
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert sorted((r.step, r.status) for r in reg.verify("run")) == [(1, "corrupt"), (2, "verified"),
                                                                      (3, "corrupt")]


def test_a_rotten_candidate_is_never_linked(reg: Registry) -> None:
    """The catalog says step 1 holds these bytes, but the disk no longer does: keep our good copy."""
    state = big_state(3)
    one = reg.publish("run", 1, state)
    reg.publish("run", 2, big_state(4))
    with open(one.path / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    three = reg.publish("run", 3, state)
    assert inode(one.path, "model.safetensors") != inode(three.path, "model.safetensors")
    assert [r.status for r in reg.verify("run@3")] == ["verified"]


def test_links_never_cross_filesystems(tmp_path: Path) -> None:
    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem to link across")
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "w.bin").write_bytes(b"x" * 4096)
    theirs = other / f"registry-dedup-test-{os.getpid()}"
    theirs.write_bytes(b"x" * 4096)
    try:
        assert link_identical(staging, {"w.bin": [theirs]}) == []
        assert os.stat(staging / "w.bin").st_nlink == 1
    finally:
        theirs.unlink()


PHASES = ("dedup-after-link", "dedup-after-fsync", "gc-after-mark", "gc-after-retire")


def _killed_child(url: str, root: str, run: str, seed: int, phase: str) -> None:
    """In a forkserver child: publish a duplicate (dedup phases) or run gc (gc phases), dying at ``phase``."""
    arm(phase)
    with Registry.open(url=url, root=root, dedup=True) as reg:
        if phase.startswith("dedup"):
            reg.publish(run, 3, big_state(seed), config={"same": run})
        else:
            reg.apply_retention(run, KeepLast(1))


def test_kill_at_each_phase_of_dedup_and_retention(catalog_url: str, root: Path) -> None:
    """Whatever phase a publish that links, or a gc that deletes a step sharing inodes, dies in, fsck
    and the next gc leave every live step whole, bit-exact, and nothing hidden behind."""
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        for seed, phase in enumerate(PHASES):
            run, state, other = f"p{seed}", big_state(seed), big_state(100 + seed)
            states = {1: state, 2: other, 3: state, 4: big_state(200 + seed)}
            reg.publish(run, 1, state, config={"same": run})
            reg.publish(run, 2, other, config={"same": run})
            if phase.startswith("gc"):
                reg.publish(run, 3, state, config={"same": run})   # links step 1's weights
                reg.tag(run, 3, "keep")
                reg.publish(run, 4, states[4], config={"same": run})
            child = context().Process(target=_killed_child,
                                      args=(worker_url(catalog_url), str(root), run, seed, phase))
            child.start()
            child.join()
            assert child.exitcode == -9, phase
            settle(reg)
            reg.fsck(repair=True)
            if phase.startswith("gc"):
                reg.apply_retention(run, KeepLast(1))  # finishes the interrupted deletion
            else:
                reg.publish(run, 3, state, config={"same": run})
            live = {i.step for i in reg.checkpoints(run)}
            assert live == ({3, 4} if phase.startswith("gc") else {1, 2, 3}), phase
            for step in live:
                assert_state_equal(reg.load(f"{run}@{step}").state_dict, states[step])
            three = reg.resolve(f"{run}@3").path
            assert os.stat(three / "model.safetensors").st_nlink == (1 if phase.startswith("gc") else 2), phase
            assert [p.name for p in (root / run).iterdir() if p.name.startswith(".")] == [], phase
        report = reg.fsck(checksums=True)
        assert not report.problems and not report.unrepaired


def _published_hashing_writers(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[int]]:
    """The files a publish writes through ``HashingWriter``, and the bytes it hands to ``os.write``."""
    import registry.fs.hashing as hashing
    names: list[str] = []
    written: list[int] = []
    real_write = os.write

    class Spy(hashing.HashingWriter):
        def __init__(self, path: Path) -> None:
            names.append(path.name)
            super().__init__(path)

    def counting(fd: int, data: object) -> int:
        n = real_write(fd, data)  # type: ignore[arg-type]
        written.append(n)
        return n
    monkeypatch.setattr(hashing, "HashingWriter", Spy)  # the publish's writer takes it from there
    monkeypatch.setattr(os, "write", counting)
    return names, written


def test_a_hit_is_linked_before_it_is_written(reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes a verified step holds are found from memory: the weights file is never opened for writing,
    its bytes never reach write(), and its manifest entry is the real file's digest."""
    import hashlib
    state = big_state(5)
    one = reg.publish("run", 1, state)
    two = reg.publish("run", 2, big_state(6))
    names, written = _published_hashing_writers(monkeypatch)
    three = reg.publish("run", 3, state)
    monkeypatch.undo()
    weights = three.path / "model.safetensors"
    size = weights.stat().st_size
    assert "model.safetensors" not in names and "manifest.json" in names
    assert sum(written) < size  # meta, config and manifest only
    assert os.stat(weights).st_ino == inode(one.path, "model.safetensors") != inode(two.path, "model.safetensors")
    assert os.stat(weights).st_nlink == 2
    recorded = json.loads((three.path / "manifest.json").read_text())["files"]["model.safetensors"]
    assert recorded["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest() == \
        json.loads((one.path / "manifest.json").read_text())["files"]["model.safetensors"]["sha256"]
    assert reg.events("run", step=3)[-1].detail["linked_bytes"] == size
    assert [r.status for r in reg.verify("run@3")] == ["verified"]
    assert_state_equal(reg.load("run@3").state_dict, state)


def test_a_hit_across_many_pieces_and_tensors(reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces that span tensors and the header are hashed and compared in memory; one differing
    element in the middle piece is a miss, and that step writes its own copy."""
    monkeypatch.setattr("registry.format.pieces.PIECE_SIZE", 64 << 10)
    g = torch.Generator().manual_seed(7)
    state = {f"t{i:02d}": torch.randn(1000 + 37 * i, generator=g) for i in range(40)}
    state["big"] = torch.randn(1 << 18, generator=g)
    one = reg.publish("run", 1, state)
    assert len(json.loads((one.path / "manifest.json").read_text())["files"]["model.safetensors"]
               ["xxh3_128_pieces"]["digests"]) > 16
    reg.publish("run", 2, big_state(8))
    three = reg.publish("run", 3, state)
    assert inode(three.path, "model.safetensors") == inode(one.path, "model.safetensors")
    reg.publish("run", 4, big_state(9))
    almost = {**state, "big": state["big"].clone()}
    almost["big"][len(almost["big"]) // 2] += 1
    five = reg.publish("run", 5, almost)
    assert inode(five.path, "model.safetensors") not in (inode(one.path, "model.safetensors"),
                                                         inode(three.path, "model.safetensors"))
    assert [r.status for r in reg.verify("run")] == ["verified"] * 5
    assert_state_equal(reg.load("run@5").state_dict, almost)


def test_a_rotten_candidate_gets_a_good_copy_written(reg: Registry) -> None:
    """The candidate's recorded pieces match the memory but its bytes on disk do not: the publish writes
    its own copy, whose manifest digest is that of the bytes it holds."""
    import hashlib
    state = big_state(10)
    one = reg.publish("run", 1, state)
    reg.publish("run", 2, big_state(11))
    weights = one.path / "model.safetensors"
    with open(weights, "r+b") as f:  # a byte in the middle of the data, as bit rot leaves it
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    three = reg.publish("run", 3, state)
    mine = three.path / "model.safetensors"
    assert os.stat(mine).st_ino != os.stat(weights).st_ino and os.stat(mine).st_nlink == 1
    recorded = json.loads((three.path / "manifest.json").read_text())["files"]["model.safetensors"]["sha256"]
    assert recorded == hashlib.sha256(mine.read_bytes()).hexdigest()
    assert [(r.step, r.status) for r in reg.verify("run")] == [(1, "corrupt"), (2, "verified"), (3, "verified")]
    assert_state_equal(reg.load("run@3").state_dict, state)


def test_a_candidate_whose_manifest_is_not_the_verified_one_is_not_taken(reg: Registry) -> None:
    """The pieces come from the candidate's manifest only while it is the one the catalog verified."""
    state = big_state(12)
    one = reg.publish("run", 1, state)
    reg.publish("run", 2, big_state(13))
    manifest = one.path / "manifest.json"
    manifest.write_bytes(manifest.read_bytes() + b"\n")  # same document, other bytes: not what was verified
    three = reg.publish("run", 3, state)
    assert inode(three.path, "model.safetensors") != inode(one.path, "model.safetensors")
    assert [r.status for r in reg.verify("run@3")] == ["verified"]


def test_async_and_copied_tensors_link_too(reg: Registry) -> None:
    """An async publish (its snapshot is what is compared) links before writing; tensors that would need
    a copy to be written (a transposed view) are linked after the write, as before."""
    state = big_state(14)
    one = reg.publish("run", 1, state)
    reg.publish("run", 2, big_state(15))
    three = reg.publish("run", 3, state, blocking=False).result()
    assert inode(three.path, "model.safetensors") == inode(one.path, "model.safetensors")

    square = torch.randn(512, 512, generator=torch.Generator().manual_seed(16))
    t_state = {"w": square.t()}  # not contiguous: file_buffers declines, link_duplicates links it
    a = reg.publish("t", 1, t_state)
    reg.publish("t", 2, big_state(17))
    c = reg.publish("t", 3, t_state)
    assert inode(c.path, "model.safetensors") == inode(a.path, "model.safetensors")
    assert_state_equal(reg.load("t@3").state_dict, {"w": square.t().contiguous()})


def test_held_bytes_pieces_are_the_writers() -> None:
    """In-memory pieces over buffers of any lengths equal what the writer records for their concatenation."""
    from registry.format.pieces import HeldBytes, PieceHasher
    g = torch.Generator().manual_seed(3)
    for lengths in ([5000], [1, 4095, 4096, 10000, 3], [0, 8192, 0, 1], [4096] * 5):
        buffers = [memoryview(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy()).cast("B")
                   for n in lengths]
        whole = b"".join(bytes(b) for b in buffers)
        hasher = PieceHasher(4096)
        hasher.update(whole)
        held = HeldBytes([len(b) for b in buffers], buffers.__getitem__, 4096)
        assert held.size == len(whole) and held.matches(hasher.digests())
        if held.count:
            wrong = list(hasher.digests())
            wrong[-1] = "0" * 32
            assert not HeldBytes([len(b) for b in buffers], buffers.__getitem__, 4096).matches(wrong)
            assert not held.matches(wrong[:-1])
        for i in range(held.count):
            assert b"".join(bytes(p) for _, p in held.piece(i)) == whole[i * 4096:(i + 1) * 4096]


def test_a_same_size_miss_is_told_by_a_few_windows_of_the_file_before_a_piece_is_hashed(
        reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """An older step with the same shapes is the usual candidate: its weights differ from the memory's in
    the windows compared first (the start of its data, its end), so no piece of the memory is hashed for
    it. A file that differs only between the windows is still a miss, told by its pieces."""
    from registry.format.pieces import HeldBytes
    hashed: list[int] = []
    real = HeldBytes.digest

    def digest(self: HeldBytes, index: int) -> str:
        hashed.append(index)
        return real(self, index)
    infos = [reg.publish("run", step, big_state(step)) for step in (1, 2, 3)]
    monkeypatch.setattr(HeldBytes, "digest", digest)
    four = reg.publish("run", 4, big_state(4))  # step 1 is a candidate (2 and 3 are its fallback): a miss
    assert hashed == [] and os.stat(four.path / "model.safetensors").st_nlink == 1
    raw = (infos[0].path / "model.safetensors").read_bytes()
    head = 8 + struct.unpack("<Q", raw[:8])[0]
    begin, end = json.loads(raw[8:head])["base"]["data_offsets"]
    windows = sample_windows(len(raw), head)
    between = next(at for at in range(head + begin, head + end, 4) if not any(w <= at < w + n for w, n in windows))
    middle = big_state(1)
    middle["base"][(between - head - begin) // 4] += 1  # differs from step 1 only where no window looks
    five = reg.publish("run", 5, middle)
    assert hashed and os.stat(five.path / "model.safetensors").st_nlink == 1
    hashed.clear()
    six = reg.publish("run", 6, big_state(1))  # a hit: the pieces, then the whole file, then the link
    assert hashed and inode(six.path, "model.safetensors") == inode(infos[0].path, "model.safetensors")
    assert [r.status for r in reg.verify("run")] == ["verified"] * 6
    assert_state_equal(reg.load("run@5").state_dict, middle)


def sample_windows(size: int, data_start: int) -> list[tuple[int, int]]:
    from registry.fs import dedup
    n = min(dedup.SAMPLE, size - data_start)
    return [(data_start + (size - n - data_start) * k // (dedup.SAMPLES - 1), n) for k in range(dedup.SAMPLES)]


@pytest.mark.parametrize("where", ["first byte of the data", "last byte", "inside a middle window", "between windows"])
def test_the_windows_compared_first_are_spread_from_the_datas_first_byte_to_the_files_last(
        tmp_path: Path, where: str) -> None:
    from registry.fs import dedup
    from registry.format.pieces import HeldBytes
    header, data = b"h" * 100, bytearray(os.urandom(3 << 20))
    stored = tmp_path / "f"
    stored.write_bytes(header + data)
    windows = sample_windows(len(header) + len(data), len(header))
    at = {"first byte of the data": len(header), "last byte": len(header) + len(data) - 1,
          "inside a middle window": windows[3][0] + 5,
          "between windows": windows[3][0] + windows[3][1] + 7}[where]
    data[at - len(header)] ^= 1
    buffers = [memoryview(header), memoryview(data)]
    held = HeldBytes([len(b) for b in buffers], buffers.__getitem__, 1 << 20)
    same = dedup._samples_equal(stored, os.stat(stored), held, data_start=len(header))
    assert same is (where == "between windows")


def many_tensors(seed: int, *, count: int = 64) -> dict[str, torch.Tensor]:
    """A state of ``count`` tensors of 32 KiB each, above the link threshold together."""
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i:03d}": torch.randn(8192, generator=g) for i in range(count)}


def test_a_miss_looks_only_at_the_tensors_its_windows_cover(reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a tensor is memory as it is costs Python per tensor: a miss told by the sampled windows asks
    it of the few tensors under them, not of all; a hit asks it of every tensor before hashing them."""
    from registry.format.safetensors import Encoded
    asked: set[int] = set()
    real = Encoded.held

    def held(self: Encoded, index: int) -> memoryview:
        asked.add(index)
        return real(self, index)
    monkeypatch.setattr(Encoded, "held", held)
    one = reg.publish("run", 1, many_tensors(1))
    reg.publish("run", 2, many_tensors(2))
    reg.publish("run", 3, many_tensors(3))
    asked.clear()
    four = reg.publish("run", 4, many_tensors(4))  # step 1 is a candidate of the same size: a miss
    assert os.stat(four.path / "model.safetensors").st_nlink == 1
    assert asked and len(asked - {0}) <= dedup_samples()
    asked.clear()
    five = reg.publish("run", 5, many_tensors(1))  # a hit: every tensor is compared
    assert inode(five.path, "model.safetensors") == inode(one.path, "model.safetensors")
    assert asked >= set(range(1, 65))


def dedup_samples() -> int:
    from registry.fs import dedup
    return dedup.SAMPLES * 2  # a window may straddle two tensors


def test_a_tensor_to_copy_among_many_is_linked_after_the_write(reg: Registry) -> None:
    """One tensor that is not memory as it is (a transposed view), in the middle of many that are: nothing
    is linked before the write (its bytes would need a copy to be compared), and the written file is
    linked after it, compared with the candidate's bytes in full."""
    state = many_tensors(20)
    square = torch.randn(256, 256, generator=torch.Generator().manual_seed(21))
    state["layer032"] = square.t()
    one = reg.publish("run", 1, state)
    reg.publish("run", 2, many_tensors(22))
    three = reg.publish("run", 3, state)
    assert inode(three.path, "model.safetensors") == inode(one.path, "model.safetensors")
    assert [r.status for r in reg.verify("run")] == ["verified"] * 3
    assert_state_equal(reg.load("run@3").state_dict, {**state, "layer032": square.t().contiguous()})
