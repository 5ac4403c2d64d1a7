"""Dedup never gives two checkpoints one fate: one bad inode takes at most one of a run's two newest
verified steps, so ``RUN@latest`` still loads; dedup is opt-in; bytes are counted as the disk holds them."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from registry import Registry
from registry.catalog.lineage import identical_files
from registry.crashpoints import arm
from registry.errors import PublishError
from registry.fs import dedup
from registry.fs.inodes import inodes
from registry.retention import KeepTagged, MaxBytes, Policy, RetentionContext
from registry.views import plan_shared_bytes, step_view
from tests.helpers import assert_state_equal
from tests.killharness import context, settle, worker_url

CONFIG = {"model": "tiny", "layers": 2}
SHARD = 1 << 20  # the frozen base is a shard of its own, and at least the link threshold


def base() -> torch.Tensor:
    return torch.arange(SHARD // 4, dtype=torch.float32)  # 1 MiB, the same bytes in every step and run


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.base": base(), "b.head": torch.randn(8, 8, generator=g)}


def publish(reg: Registry, run: str, step: int, **options: object) -> dict[str, torch.Tensor]:
    sd = state(hash((run, step)) % 1000)
    reg.publish(run, step, sd, config=CONFIG, max_shard_size=SHARD, **options)  # type: ignore[arg-type]
    return sd


def step_files(root: Path) -> Iterator[Path]:
    for run in sorted(p for p in root.iterdir() if not p.name.startswith(".")):
        for step in sorted(run.iterdir()):
            yield from sorted(f for f in step.rglob("*") if f.is_file())


def flip(path: Path) -> int:
    """Flip one byte of ``path`` in place (bit rot under every name of the inode); returns the offset."""
    size = path.stat().st_size
    offset = size - 1 if path.suffix == ".safetensors" else size // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
    return offset


def inodes_of(directory: Path) -> set[tuple[int, int]]:
    return set(inodes(directory))


def disk_bytes(root: Path) -> int:
    """What the step directories hold on disk: each inode once."""
    seen: dict[tuple[int, int], int] = {}
    for f in step_files(root):
        st = os.stat(f)
        seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


@pytest.mark.usefixtures("migrated_url")
def test_identical_configs_across_steps_and_runs_never_share_one_fate(catalog_url: str, root: Path) -> None:
    """The issue's case: every step has the same config.json. One flipped byte of it takes one step, not
    the run, and never another run."""
    for dedup_on in (False, True):
        a, b = f"a{int(dedup_on)}", f"b{int(dedup_on)}"
        with Registry.open(url=catalog_url, root=root, dedup=dedup_on) as reg:
            states = {(run, step): publish(reg, run, step) for run in (a, b) for step in (1, 2, 3)}
            flip(reg.resolve(f"{a}@3").path / "config.json")
            ck = reg.load(f"{a}@latest", resume=False)
            assert ck.step == 2
            assert_state_equal(ck.state_dict, states[(a, 2)])
            assert_state_equal(reg.load(f"{b}@latest", resume=False).state_dict, states[(b, 3)])
            assert [r.status for r in reg.verify(f"{a}@2", f"{a}@1", b)] == ["verified"] * 5


@pytest.mark.usefixtures("migrated_url")
@pytest.mark.parametrize("threshold", [dedup.MIN_LINK_BYTES, 1])
def test_one_bad_inode_anywhere_never_takes_a_runs_fallback(catalog_url: str, root: Path, threshold: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A deduplicated root (two runs, a frozen base shard in every step, identical configs): corrupt each
    inode of it in turn; every run with two verified steps still loads ``@latest`` bit-exact."""
    monkeypatch.setattr(dedup, "MIN_LINK_BYTES", threshold)
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        states = {(run, step): publish(reg, run, step) for run, steps in (("a", 4), ("b", 3))
                  for step in range(1, steps + 1)}
        states[("a", 5)] = publish(reg, "a", 5, verify=False)  # never linked, nor linked to while published
        states[("b", 2)] = publish(reg, "b", 2, overwrite=True)
        shared = {(os.stat(f).st_dev, os.stat(f).st_ino) for f in step_files(root) if os.stat(f).st_nlink > 1}
        assert shared, "the root must hold shared inodes for this test to mean anything"
        assert all(os.stat(f).st_nlink == 1 for f in step_files(root) if f.name in dedup.NEVER_LINKED)
        runs = {r: [i.path for i in reg.checkpoints(r)] for r in ("a", "b")}
        a_inodes = {k for p in runs["a"] for k in inodes_of(p)}
        assert a_inodes.isdisjoint(k for p in runs["b"] for k in inodes_of(p)), "links never cross runs"

        seen: set[tuple[int, int]] = set()
        for path in list(step_files(root)):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            original = path.read_bytes()
            flip(path)
            try:
                for run in ("a", "b"):
                    verified = {i.step for i in reg.checkpoints(run) if i.status == "verified"}
                    assert len(verified) >= 2
                    ck = reg.load(f"{run}@latest", resume=False)
                    assert ck.step in verified, (path, run)
                    assert_state_equal(ck.state_dict, states[(run, ck.step)])
            finally:
                _restore(path, original)
                for run in ("a", "b"):
                    if any(i.status == "corrupt" for i in reg.checkpoints(run, include_deleted=True)):
                        reg.verify(run)   # the condemned step is whole again
            assert all(i.status in ("verified", "published") for r in ("a", "b") for i in reg.checkpoints(r))
        assert not reg.fsck(checksums=True).problems


def _restore(path: Path, original: bytes) -> None:
    """Put the bytes back in place, under every name of the inode (a rewrite would split the link)."""
    with open(path, "r+b") as f:
        f.write(original)


@pytest.mark.usefixtures("migrated_url")
def test_dedup_is_off_by_default(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        for step in (1, 2, 3):
            publish(reg, "run", step)
        files = list(step_files(root))
        assert all(os.stat(f).st_nlink == 1 for f in files)
        assert len({os.stat(f).st_ino for f in files}) == len(files)
        publish(reg, "run", 4, dedup=True)   # one publish may ask for it: step 2 holds the same base
        four = reg.resolve("run@4").path
        assert os.stat(next(four.glob("model-00001-*"))).st_ino == \
            os.stat(next(reg.resolve("run@2").path.glob("model-00001-*"))).st_ino
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        publish(reg, "run", 5, dedup=False)
        five = next(reg.resolve("run@5").path.glob("model-00001-*"))
        assert os.stat(five).st_nlink == 1


@pytest.mark.usefixtures("migrated_url")
def test_max_bytes_counts_a_frozen_shard_once(catalog_url: str, root: Path) -> None:
    """Five steps over a frozen 1 MiB base: the budget of what the disk holds deletes nothing; one byte
    less deletes only the oldest step, and the bytes reported freed are the bytes the disk got back."""
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        for step in range(1, 6):
            publish(reg, "run", step)
        total = disk_bytes(root)
        assert total < 3 * SHARD < sum(i.total_bytes for i in reg.checkpoints("run"))
        plan = reg.plan_retention("run", MaxBytes(total))
        assert not plan.delete and plan.bytes_kept == total
        plan = reg.plan_retention("run", MaxBytes(total - 1))
        assert sorted(plan.delete) == [1]
        one = reg.resolve("run@1").path
        private = sum(os.stat(f).st_size for f in one.rglob("*") if f.is_file() and os.stat(f).st_nlink == 1)
        assert plan.bytes_freed == private
        result = plan.execute()
        assert result.deleted == (1,) and result.bytes_freed == private == total - disk_bytes(root)


@pytest.mark.usefixtures("migrated_url")
def test_retention_deleting_the_second_newest_leaves_the_newest_two_independent(catalog_url: str,
                                                                                root: Path) -> None:
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        states = {step: publish(reg, "run", step) for step in (1, 2, 3)}
        one, three = reg.resolve("run@1").path, reg.resolve("run@3").path
        assert not inodes_of(one).isdisjoint(inodes_of(three))  # 3 linked 1's base (2 was in between)
        reg.tag("run", 1, "keep")
        result = reg.apply_retention("run", KeepTagged("keep"))
        assert result.deleted == (2,)
        assert inodes_of(one).isdisjoint(inodes_of(three))
        assert [r.status for r in reg.verify("run")] == ["verified", "verified"]
        assert not reg.fsck(checksums=True).problems
        for step in (1, 3):
            assert_state_equal(reg.load(f"run@{step}").state_dict, states[step])


@pytest.mark.usefixtures("migrated_url")
def test_an_overwrite_that_leaves_the_chain_keeps_the_newest_two_independent(catalog_url: str,
                                                                            root: Path) -> None:
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        for step in (1, 2, 3):
            publish(reg, "run", step)
        publish(reg, "run", 2, overwrite=True, verify=False)   # 2 is only published now: 3 and 1 are the pair
        assert inodes_of(reg.resolve("run@1").path).isdisjoint(inodes_of(reg.resolve("run@3").path))


def _gc_killed(url: str, root: str) -> None:
    arm("unshare-after-copy")
    with Registry.open(url=url, root=root, dedup=True) as reg:
        reg.apply_retention("run", KeepTagged("keep"))


@pytest.mark.usefixtures("migrated_url")
@pytest.mark.both_backends
def test_kill_while_unsharing_leaves_every_step_whole(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        states = {step: publish(reg, "run", step) for step in (1, 2, 3)}
        reg.tag("run", 1, "keep")
        child = context().Process(target=_gc_killed, args=(worker_url(catalog_url), str(root)))
        child.start()
        child.join()
        assert child.exitcode == -9
        settle(reg)
        for step in (1, 2, 3):
            assert_state_equal(reg.load(f"run@{step}").state_dict, states[step])
        assert not reg.fsck(checksums=True).problems
        assert reg.apply_retention("run", KeepTagged("keep")).deleted == (2,)
        assert inodes_of(reg.resolve("run@1").path).isdisjoint(inodes_of(reg.resolve("run@3").path))
        assert [r.status for r in reg.verify("run")] == ["verified", "verified"]


@pytest.mark.usefixtures("migrated_url")
def test_identical_files_is_bounded_per_digest(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        for step in range(1, 13):
            publish(reg, "run", step)
        f = next(x for x in reg.catalog.files("run", 1) if x.name.startswith("model-00001"))
        hits = identical_files(reg.catalog, [(f.size, f.sha256)])
        assert 0 < len(hits) <= 8
        assert [h.step for h in hits] == sorted((h.step for h in hits), reverse=True)
        assert hits[0].step == 12


class _Only(Policy):
    def __init__(self, *steps: int) -> None:
        self.steps = steps

    def keep(self, checkpoints: object, context: RetentionContext) -> dict[int, str]:
        return {s: "kept" for s in self.steps}


@pytest.mark.usefixtures("migrated_url")
def test_shared_bytes_count_only_what_kept_steps_hold(catalog_url: str, root: Path, tmp_path: Path) -> None:
    """Two doomed steps linking only each other free their file; a name outside the steps (a checkout's
    link) is not a step sharing it."""
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        for step in (1, 2, 3, 4):
            publish(reg, "run", step)   # 1 and 3 hold one base, 2 and 4 another
        three = reg.resolve("run@3").path
        shard = next(three.glob("model-00001-*"))
        plan = reg.plan_retention("run", _Only(2, 4))   # 1 and 3 go, and only they hold their base
        assert sorted(plan.delete) == [1, 3]
        assert plan_shared_bytes(plan) == 0
        assert plan.bytes_freed == sum(s for d in (reg.resolve("run@1").path, three)
                                       for s in inodes(d).values()) - shard.stat().st_size
        outside = tmp_path / "checkout"
        outside.mkdir()
        four = reg.resolve("run@4").path
        os.link(next(four.glob("model-00002-*")), outside / "head.safetensors")  # as a linking checkout does
        assert step_view(reg, "run@4").shared_bytes == next(four.glob("model-00001-*")).stat().st_size


@pytest.mark.usefixtures("migrated_url")
def test_a_failed_rename_of_a_link_fails_the_publish_and_leaves_nothing(catalog_url: str, root: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        for step in (1, 2):
            publish(reg, "run", step)
        real = os.replace

        def failing(src: object, dst: object) -> None:
            if ".link-" in str(src):
                raise OSError(errno.EIO, "injected", str(src))
            real(src, dst)  # type: ignore[arg-type]
        monkeypatch.setattr(os, "replace", failing)
        with pytest.raises(PublishError) as info:
            publish(reg, "run", 3)
        assert "\n" not in str(info.value) and info.value.errno == errno.EIO
        monkeypatch.undo()
        assert reg.resolve("run").step == 2 and not reg.store.step_dir("run", 3).exists()
        assert [p.name for p in (root / "run").iterdir() if p.name.startswith(".")] == []
        assert reg.fsck(checksums=True).clean


@pytest.mark.usefixtures("migrated_url")
def test_a_copy_that_cannot_be_made_keeps_the_step_instead(catalog_url: str, root: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while gc would give step 3 its own copy: step 2, the fallback's independent copy, stays."""
    with Registry.open(url=catalog_url, root=root, dedup=True) as reg:
        states = {step: publish(reg, "run", step) for step in (1, 2, 3)}
        reg.tag("run", 1, "keep")
        real = os.open

        def full(path: object, flags: int, mode: int = 0o777, **kw: object) -> int:
            if ".unshare-" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(path, flags, mode, **kw)  # type: ignore[arg-type]
        monkeypatch.setattr(os, "open", full)
        result = reg.apply_retention("run", KeepTagged("keep"))
        monkeypatch.undo()
        assert result.deleted == () and "fallback" in result.skipped[2]
        assert [p.name for p in reg.resolve("run@3").path.iterdir() if p.name.startswith(".")] == []
        assert reg.apply_retention("run", KeepTagged("keep")).deleted == (2,)
        assert inodes_of(reg.resolve("run@1").path).isdisjoint(inodes_of(reg.resolve("run@3").path))
        for step in (1, 3):
            assert_state_equal(reg.load(f"run@{step}").state_dict, states[step])
