"""A trainer's save published by adoption: ``Registry.publish_files`` and ``RegistryCallback`` on a directory root.

The files of a ``checkpoint-N`` folder become the step's own without a
second copy of their bytes (hard links, each file read once to hash it);
what cannot be linked (another filesystem, a folder the caller keeps) is
copied. A SIGKILL at every crash point of the publish leaves the step as the
publish protocol's table says (absent, old or new) and the trainer's folder
exactly as it was. The folders are laid out as the ``Trainer`` writes them,
without the ``Trainer`` (whose own test, at the end, needs transformers).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import tempfile
from fractions import Fraction
from types import SimpleNamespace
from pathlib import Path
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from registry import Registry
from registry.crashpoints import arm
from registry.errors import (AsyncPublishError, CorruptCheckpointError, InvalidStateError, UnsafePathError,
                             UnsafePickleError)
from registry.format.manifest import read_manifest
from tests.helpers import IN_CI
from tests.killharness import (CRASH_TABLE, Tally, catalog_view, check_before_repair, check_invariants, context,
                               latest_verified, settle, snapshot_live, state, worker_url)

RUN = "hf"
ADOPTED = ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt"]
OVERWRITTEN = 5  # the step the overwrite kills replace


def trainer_folder(path: Path, seed: int) -> dict[str, bytes]:
    """A folder laid out as the ``Trainer``'s ``checkpoint-N`` (weights: ``killharness.state(seed)``); its bytes."""
    path.mkdir(parents=True)
    save_file(state(seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "tiny", "seed": seed}))
    torch.save({"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": torch.full((64,), float(seed))}},
                "param_groups": [{"lr": 0.1, "params": [0]}]}, path / "optimizer.pt")
    torch.save({"last_epoch": seed}, path / "scheduler.pt")
    torch.save({"cpu": torch.arange(4)}, path / "rng_state.pth")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": seed}))
    (path / "training_args.bin").write_bytes(pickle.dumps({"learning_rate": 0.1}))
    return contents(path)


def contents(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def publish(reg: Registry, folder: Path, step: int, seed: int, *, overwrite: bool = False,
            blocking: bool = True) -> Any:
    """What the callback does with a save: adopt it (on the background publisher unless ``blocking``), then remove
    the folder once the publish committed."""
    done = reg.publish_files(folder, run=RUN, step=step, files=ADOPTED, meta={"seed": seed},
                             extra={"rng_state": {"cpu": torch.arange(4)}}, adopt=True, overwrite=overwrite,
                             blocking=blocking)
    info = done.result() if isinstance(done, Future) else done
    shutil.rmtree(folder)
    return info


def adopt_worker(url: str, root: str, folder: str, step: int, seed: int, overwrite: bool, crash_at: str,
                 blocking: bool) -> None:
    arm(crash_at)
    with Registry.open(url=url, root=root) as reg:
        publish(reg, Path(folder), step, seed, overwrite=overwrite, blocking=blocking)


def test_adopted_files_become_the_steps_own_without_a_copy(reg: Registry, tmp_path: Path) -> None:
    folder = tmp_path / "out" / "checkpoint-2"
    files = trainer_folder(folder, 2)
    inodes = {name: os.stat(folder / name).st_ino for name in ADOPTED}
    reg.log_metrics(RUN, 2, {"eval_loss": 0.25})
    info = reg.publish_files(folder, run=RUN, step=2, files=ADOPTED, meta={"seed": 2}, epoch=1,
                             extra={"rng_state": {"cpu": torch.arange(4)}}, adopt=True)
    step_dir = Path(info.path)
    assert {name: os.stat(step_dir / name).st_ino for name in ADOPTED} == inodes  # linked, not copied
    assert contents(folder) == files  # the caller's folder is untouched: it removes it
    assert info.status == "verified" and info.metrics == {"eval_loss": 0.25}  # buffered metrics in the commit
    # the Trainer's own bookkeeping stays out; the publish writes meta.json and the extras itself
    assert sorted(os.listdir(step_dir)) == sorted([*ADOPTED, "manifest.json", "meta.json", "rng_state.pt"])
    manifest = read_manifest(step_dir)[0]
    assert all(manifest.files[name].xxh3_128_pieces for name in ADOPTED)  # hashed like a publish's own files
    shutil.rmtree(folder)
    assert all(os.stat(step_dir / name).st_nlink == 1 for name in ADOPTED)
    ckpt = reg.load(f"{RUN}@2", verify=True)
    assert all(torch.equal(ckpt.state_dict[k], v) for k, v in state(2).items()) and len(ckpt.state_dict) == 3
    assert ckpt.meta["seed"] == 2 and ckpt.epoch == 1 and ckpt.meta["optimizer_step"] == 2
    assert ckpt.extra["scheduler"] == {"last_epoch": 2} and ckpt.config == {"model_type": "tiny", "seed": 2}
    assert [r.ok for r in reg.verify(f"{RUN}@2")] == [True]


def second_filesystem(path: Path) -> Path | None:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and os.stat(shm).st_dev != os.stat(path).st_dev:
        return shm
    return None


def test_a_folder_on_another_filesystem_or_kept_is_copied(sqlite_reg: Registry, tmp_path: Path) -> None:
    kept = tmp_path / "checkpoint-1"
    files = trainer_folder(kept, 1)
    info = sqlite_reg.publish_files(kept, run=RUN, step=1, files=ADOPTED, meta={"seed": 1}, adopt=False)
    assert all(os.stat(Path(info.path) / n).st_ino != os.stat(kept / n).st_ino for n in ADOPTED)
    assert contents(kept) == files
    other = second_filesystem(tmp_path)
    if other is None:
        if IN_CI:
            pytest.fail("CI needs /dev/shm on a filesystem of its own to check a cross-filesystem adoption")
        pytest.skip("no second filesystem (/dev/shm) to adopt a folder from")
    away = Path(tempfile.mkdtemp(dir=other)) / "checkpoint-2"
    try:
        files = trainer_folder(away, 2)
        info = sqlite_reg.publish_files(away, run=RUN, step=2, files=ADOPTED, meta={"seed": 2}, adopt=True)
        assert contents(away) == files
        assert {n: (Path(info.path) / n).read_bytes() for n in ADOPTED} == {n: files[n] for n in ADOPTED}
    finally:
        shutil.rmtree(away.parent)
    assert [r.ok for r in sqlite_reg.verify(f"{RUN}@1", f"{RUN}@2")] == [True, True]


def test_what_cannot_be_adopted_is_refused_before_anything_is_claimed(sqlite_reg: Registry, tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-3"
    files = trainer_folder(folder, 3)
    (folder / "meta.json").write_text("{}")
    (folder / "link.pt").symlink_to(folder / "scheduler.pt")
    torch.save({"lr": Fraction(1, 3)}, folder / "unsafe.pt")  # needs full unpickling
    cases: list[tuple[list[str], type[Exception], str]] = [
        ([*ADOPTED, "meta.json"], InvalidStateError, "written by the publish itself"),
        (["config.json", "optimizer.pt"], CorruptCheckpointError, "model.safetensors is read by a load"),
        ([*ADOPTED, "missing.pt"], CorruptCheckpointError, "missing"),
        ([*ADOPTED, "link.pt"], UnsafePathError, "symlink"),
        ([*ADOPTED, "unsafe.pt"], UnsafePickleError, "trust_pickle"),
    ]
    for names, error, words in cases:
        with pytest.raises(error, match=words):
            sqlite_reg.publish_files(folder, run=RUN, step=3, files=names, adopt=True)
    with pytest.raises(InvalidStateError, match="list of file names"):
        sqlite_reg.publish_files(folder, run=RUN, step=3, files="model.safetensors", adopt=True)
    assert RUN not in {r.name for r in sqlite_reg.runs()}
    assert {n: (folder / n).read_bytes() for n in files} == files
    info = sqlite_reg.publish_files(folder, run=RUN, step=3, files=[*ADOPTED, "unsafe.pt"], adopt=True,
                                    trust_pickle=True)
    assert sqlite_reg.load(f"{RUN}@3", trust_pickle=True).extra["unsafe"] == {"lr": Fraction(1, 3)}
    assert info.status == "verified"


def test_a_background_adoption_links_hashes_and_commits_on_the_publisher(sqlite_reg: Registry,
                                                                          tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-3"
    files = trainer_folder(folder, 3)
    inodes = {name: os.stat(folder / name).st_ino for name in ADOPTED}
    future = sqlite_reg.publish_files(folder, run=RUN, step=3, files=ADOPTED, meta={"seed": 3}, adopt=True,
                                      blocking=False)
    assert isinstance(future, Future)
    info = future.result()
    assert info.status == "verified" and sqlite_reg.resolve(f"{RUN}@latest").step == 3
    assert {name: os.stat(Path(info.path) / name).st_ino for name in ADOPTED} == inodes
    assert contents(folder) == files  # the caller removes it once the future is done
    # a failure in the background: nothing claimed, the folder as it was, the error raised by the next call
    bad = tmp_path / "checkpoint-4"
    files = trainer_folder(bad, 4)
    torch.save({"lr": Fraction(1, 3)}, bad / "unsafe.pt")  # needs full unpickling
    future = sqlite_reg.publish_files(bad, run=RUN, step=4, files=[*ADOPTED, "unsafe.pt"], adopt=True,
                                      blocking=False)
    with pytest.raises(UnsafePickleError, match="trust_pickle"):
        future.result()
    assert contents(bad) == {**files, "unsafe.pt": (bad / "unsafe.pt").read_bytes()}
    with pytest.raises(AsyncPublishError, match=f"{RUN}@4"):
        sqlite_reg.publish_files(bad, run=RUN, step=4, files=ADOPTED, adopt=True)
    assert [i.step for i in sqlite_reg.checkpoints(RUN)] == [3]
    with pytest.raises(CorruptCheckpointError, match="missing"):  # checked before anything is queued
        sqlite_reg.publish_files(bad, run=RUN, step=4, files=[*ADOPTED, "missing.pt"], adopt=True, blocking=False)


def test_a_background_adoption_that_fails_gives_the_trainer_its_folder_back(sqlite_reg: Registry,
                                                                            tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from registry.integrations.transformers import RegistryCallback
    callback = RegistryCallback(sqlite_reg, RUN, blocking=False)
    folder = tmp_path / "out" / "checkpoint-5"
    trainer_folder(folder, 5)
    torch.save({"state": {}, "param_groups": [{"lr": Fraction(1, 3)}]}, folder / "optimizer.pt")  # full unpickling
    files = contents(folder)
    callback.publish_directory(folder, step=5, epoch=0)
    with pytest.warns(RuntimeWarning, match="is kept: publishing it failed"), \
            pytest.raises(AsyncPublishError, match="trust_pickle"):  # the end of training raises it, after the folder
        callback.on_train_end(None, SimpleNamespace(is_world_process_zero=True), None)  # type: ignore[arg-type]
    assert contents(folder) == files and [p.name for p in folder.parent.iterdir()] == ["checkpoint-5"]
    assert RUN not in {r.name for r in sqlite_reg.runs()}


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
def test_a_sigkill_at_every_crash_point_leaves_the_step_whole_and_the_folder_as_it_was(catalog_url: str,
                                                                                     tmp_path: Path,
                                                                                     blocking: bool) -> None:
    root = tmp_path / "root"
    tally = Tally()
    with Registry.open(url=catalog_url, root=root) as reg:
        trainer_folder(tmp_path / "first", 0)
        publish(reg, tmp_path / "first", OVERWRITTEN, 0)
        stored: dict[int, dict[str, bytes]] = {OVERWRITTEN: {n: (Path(reg.resolve(f"{RUN}@{OVERWRITTEN}").path) / n)
                                                             .read_bytes() for n in ADOPTED}}
        for i, ((op, point), expect) in enumerate(CRASH_TABLE.items()):
            seed = 100 + i
            step = OVERWRITTEN if op == "overwrite" else 10 * (i + 1)
            folder = tmp_path / "out" / f"checkpoint-{seed}"
            files = trainer_folder(folder, seed)
            view = catalog_view(reg, (RUN,))
            before, latest = snapshot_live(view), latest_verified(view)
            proc = context().Process(target=adopt_worker, daemon=True, args=(
                worker_url(catalog_url), str(root), str(folder), step, seed, op == "overwrite", point, blocking))
            proc.start()
            proc.join(120)
            assert proc.exitcode == -signal.SIGKILL, f"{op} at {point}: exit code {proc.exitcode}"
            settle(reg)
            assert contents(folder) == files, f"{op} at {point}: the trainer's folder changed"
            check_before_repair(reg, tally=tally, runs=(RUN,))
            check_invariants(reg, before=before, latest_before=latest, may_delete=False, tally=tally, runs=(RUN,))
            assert contents(folder) == files, f"{op} at {point}: fsck changed the trainer's folder"
            live = {info.step: info for info in reg.checkpoints(RUN) if info.status in ("published", "verified")}
            now = {n: (Path(live[step].path) / n).read_bytes() for n in ADOPTED} if step in live else None
            new = {n: files[n] for n in ADOPTED}
            want = {"absent": None, "new": new, "old": stored.get(step)}[expect]
            assert now == want, f"{op} killed at {point}: the step should be {expect}"
            if now is not None:
                stored[step] = now
            tally.kills += 1
    assert tally.kills == len(CRASH_TABLE) and tally.checked_before_repair == len(CRASH_TABLE)


def test_the_callback_adopts_each_save_and_training_resumes_from_it(reg: Registry, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from registry.integrations.transformers import RegistryCallback
    from tests._hf_worker import datasets, model

    class Probe(TrainerCallback):
        """Before the registry's callback: what the Trainer's folder holds at each save."""

        def __init__(self) -> None:
            self.seen: dict[int, dict[str, tuple[int, bytes]]] = {}

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            self.seen[state.global_step] = {p.name: (p.stat().st_ino, p.read_bytes()) for p in folder.iterdir()}

    def trainer(steps: int, run: str, **options: Any) -> tuple[Trainer, RegistryCallback, Probe]:
        args = TrainingArguments(output_dir=str(tmp_path / run), max_steps=steps, per_device_train_batch_size=2,
                                 save_strategy="steps", save_steps=2, report_to="none", use_cpu=True,
                                 disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0)
        cb, probe = RegistryCallback(reg, run, **options), Probe()
        return Trainer(model=model(), args=args, train_dataset=datasets()[0], callbacks=[probe, cb]), cb, probe

    t, cb, probe = trainer(2, RUN)
    t.train(resume_from_checkpoint=cb.resume_from())
    step_dir = Path(reg.resolve(f"{RUN}@2").path)
    adopted = {name: ino for name, (ino, _) in probe.seen[2].items() if (step_dir / name).exists()}
    assert sorted(adopted) == ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt"]
    assert all(os.stat(step_dir / name).st_ino == ino for name, ino in adopted.items())
    assert all((step_dir / name).read_bytes() == probe.seen[2][name][1] for name in adopted)
    assert not (tmp_path / RUN / "checkpoint-2").exists()  # removed once committed, as before

    t, cb, _ = trainer(4, RUN)
    t.train(resume_from_checkpoint=cb.resume_from(create=False))
    assert cb.resumed_at == 2 and [i.step for i in reg.checkpoints(RUN)] == [2, 4]

    t, cb, probe = trainer(4, "background", blocking=False)  # adopted from a held folder on the publisher
    t.train(resume_from_checkpoint=cb.resume_from())
    for step in (2, 4):
        step_dir = Path(reg.resolve(f"background@{step}").path)
        assert {n: os.stat(step_dir / n).st_ino for n in adopted} == {n: probe.seen[step][n][0] for n in adopted}
    assert list((tmp_path / "background").iterdir()) == []  # neither checkpoint-N nor a held folder is left

    t, cb, probe = trainer(2, "kept", remove_trainer_checkpoints=False)  # a folder kept is a folder copied
    t.train(resume_from_checkpoint=cb.resume_from())
    step_dir = Path(reg.resolve("kept@2").path)
    assert all(os.stat(step_dir / name).st_ino != probe.seen[2][name][0] for name in adopted)
    assert contents(tmp_path / "kept" / "checkpoint-2") == {n: b for n, (_, b) in probe.seen[2].items()}


def test_a_folder_left_linked_to_its_published_step_is_removed_before_training(reg: Registry, tmp_path: Path) -> None:
    """A kill between the commit and the folder's removal leaves ``checkpoint-N`` holding the step's own files:
    a Trainer saving that folder again would rewrite the published bytes in place."""
    pytest.importorskip("transformers")
    from registry.integrations.transformers import RegistryCallback
    out = tmp_path / "out"
    leftover = out / "checkpoint-2"
    trainer_folder(leftover, 2)
    info = reg.publish_files(leftover, run=RUN, step=2, files=ADOPTED, meta={"seed": 2}, adopt=True)  # not removed
    published = contents(Path(info.path))
    unpublished = trainer_folder(out / "checkpoint-3", 3)  # the Trainer's own save, not yet published
    copied = out / "checkpoint-4"
    own = trainer_folder(copied, 4)
    reg.publish_files(copied, run=RUN, step=4, files=ADOPTED, meta={"seed": 4})  # copied: its files are its own

    held = out / ".registry-adopting-checkpoint-6"  # killed after its background publish committed
    trainer_folder(held, 6)
    reg.publish_files(held, run=RUN, step=6, files=ADOPTED, meta={"seed": 6}, adopt=True)
    not_committed = trainer_folder(out / ".registry-adopting-checkpoint-7", 7)  # killed before
    trainer_folder(out / ".registry-adopting-checkpoint-8", 8)
    taken = trainer_folder(out / "checkpoint-8", 18)  # its name was taken since: both stay

    removed = RegistryCallback(reg, RUN).remove_adopted_leftovers(out)

    assert removed == [held, leftover] and not leftover.exists() and not held.exists()
    assert contents(out / "checkpoint-7") == not_committed and not (out / ".registry-adopting-checkpoint-7").exists()
    assert contents(out / "checkpoint-8") == taken and (out / ".registry-adopting-checkpoint-8").is_dir()
    assert contents(Path(info.path)) == published
    assert reg.load(f"{RUN}@2", verify=True).step == 2
    assert contents(out / "checkpoint-3") == unpublished and contents(copied) == own
