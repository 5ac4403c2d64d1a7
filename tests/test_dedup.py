"""Dedup (opt-in): identical large files of a run's verified steps are stored once, as hard links, and
stay correct under retention, verify, fsck and SIGKILL at each phase of a publish or a gc."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from registry import Registry
from registry.crashpoints import arm
from registry.fs.dedup import link_identical, shared_bytes
from registry.retention import KeepLast
from tests.helpers import assert_state_equal, make_state
from tests.killharness import context, settle, worker_url

CONFIG = {"model": "tiny", "layers": 4}


def big_state(seed: int) -> dict[str, torch.Tensor]:
    """A state whose weights file is above the link threshold (smaller files are never linked)."""
    return {**make_state(seed), "base": torch.full((1 << 18,), float(seed))}


@pytest.fixture
def reg(catalog_url: str, root: Path) -> Iterator[Registry]:
    with Registry.open(url=catalog_url, root=root, dedup=True) as registry:
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
