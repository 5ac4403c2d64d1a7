"""Loads under faults and races, on SQLite and PostgreSQL.

A reader's own trouble (no file descriptors, no permission, the shared root
not mounted) must never be written into the catalog as corruption; a step
overwritten between a reader's resolve and its read must never be condemned,
locally or on rank 0 of a distributed load; a fall-back says how far it went;
resumption is explicit; an evaluator can leave the extras unread.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from registry import Checkpoint, CorruptCheckpointError, InvalidStateError, Registry
from registry.errors import CheckpointReadError, ExtraNotFoundError
from tests._dist_worker import fingerprint
from tests.helpers import assert_state_equal, child_env, free_port, make_state, optimizer_state

REPO = Path(__file__).resolve().parents[1]


class Weird:
    """Not a tensor container: loading it needs full unpickling."""


def flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def statuses(reg: Registry, run: str = "run") -> dict[int, str]:
    return {i.step: i.status for i in reg.checkpoints(run, include_deleted=True)}


def corrupt_events(reg: Registry, run: str = "run") -> list[int | None]:
    return [e.step for e in reg.events(run) if e.kind == "corrupt"]


# --------------------------------------------------------------------------- a reader's own trouble


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.EACCES, errno.EIO])
@pytest.mark.parametrize("name", ["manifest.json", "meta.json", "model.safetensors", "optimizer.pt"])
def test_a_readers_os_error_marks_nothing_and_does_not_fall_back(
        reg: Registry, monkeypatch: pytest.MonkeyPatch, code: int, name: str) -> None:
    reg.publish("run", 1, make_state(1), extra={"optimizer": optimizer_state()})
    latest = reg.publish("run", 2, make_state(2), extra={"optimizer": optimizer_state()})
    real_open = os.open

    def failing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(path) == latest.path / name:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    with pytest.raises(CheckpointReadError, match="nothing was marked") as caught:
        reg.load("run@latest")
    assert caught.value.errno == code and caught.value.step == 2
    assert isinstance(caught.value, OSError)
    monkeypatch.undo()
    assert statuses(reg) == {1: "verified", 2: "verified"}
    assert corrupt_events(reg) == []
    assert reg.catalog.leased_steps("run") == set()
    assert reg.load("run@latest").step == 2


def test_a_manifest_not_the_catalogs_is_refused_before_any_other_file_is_opened(
        reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    reg.publish("run", 1, make_state(1), extra={"optimizer": optimizer_state()})
    second = reg.publish("run", 2, make_state(2), extra={"optimizer": optimizer_state()})
    shutil.rmtree(second.path)
    shutil.copytree(reg.resolve("run@1").path, second.path)  # intact, but not the payload the catalog recorded
    opened: list[str] = []
    real_open = os.open

    def recording_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(path).parent == second.path:
            opened.append(Path(path).name)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    with pytest.raises(CorruptCheckpointError, match="does not match the catalog"):
        reg.load("run@2", verify=True)
    assert set(opened) == {"manifest.json"}  # nothing hashed, mapped or unpickled first


def test_an_unmounted_root_is_not_corruption_and_is_not_created(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2))
    root = reg.store.root
    away = root.with_name("elsewhere")
    root.rename(away)  # what a reader sees on a node where the shared filesystem is not mounted
    try:
        for ref in ("run@latest", "run@1"):
            with pytest.raises(CheckpointReadError, match="mounted"):
                reg.load(ref)
        assert not root.exists(), "a read created the missing mount point"
        assert statuses(reg) == {1: "verified", 2: "verified"}
        assert corrupt_events(reg) == []
    finally:
        away.rename(root)
    assert_state_equal(reg.load("run").state_dict, make_state(2))


def test_a_missing_step_directory_fails_the_load_and_leaves_the_verdict_to_fsck(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    info = reg.publish("run", 2, make_state(2))
    shutil.rmtree(info.path)
    with pytest.raises(CheckpointReadError, match="fsck"):
        reg.load("run@latest")
    assert statuses(reg) == {1: "verified", 2: "verified"}
    assert corrupt_events(reg) == []


# --------------------------------------------------------------------------- races with a writer


@pytest.mark.usefixtures("migrated_url")
def test_overwrite_between_resolve_and_read_loads_the_new_payload(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reader, Registry.open(url=catalog_url, root=root) as writer:
        writer.publish("run", 5, make_state(1))
        real_resolve = reader.catalog.resolve_leased
        raced: list[int] = []

        def resolve_then_overwrite(*args: Any, **kwargs: Any) -> Any:
            info, lease = real_resolve(*args, **kwargs)
            if not raced:
                raced.append(info.step)
                writer.publish("run", 5, make_state(2), overwrite=True)
            return info, lease

        reader.catalog.resolve_leased = resolve_then_overwrite  # type: ignore[method-assign]
        ckpt = reader.load("run@5")
        assert raced == [5]
        assert_state_equal(ckpt.state_dict, make_state(2))
        assert statuses(reader) == {5: "verified"}
        assert corrupt_events(reader) == []


def test_a_step_deleted_between_resolve_and_lease_is_resolved_again(reg: Registry) -> None:
    """No lease for a step that resolved (PostgreSQL: gc deleted it between the two statements): the
    load resolves again and reads what is live then, marking nothing."""
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2))
    real = reg.catalog.resolve_leased
    calls: list[int] = []

    def deleted_in_between(*args: Any, **kwargs: Any) -> Any:
        info, lease = real(*args, **kwargs)
        calls.append(info.step)
        if len(calls) == 1:
            reg.catalog.release_lease(lease)
            reg.catalog.set_status("run", info.step, "deleted", kind="delete", actor="gc")
            return info, None
        return info, lease
    reg.catalog.resolve_leased = deleted_in_between  # type: ignore[method-assign]
    ckpt = reg.load("run@latest")
    assert calls == [2, 1] and ckpt.step == 1
    assert_state_equal(ckpt.state_dict, make_state(1))
    assert statuses(reg) == {1: "verified", 2: "deleted"} and corrupt_events(reg) == []


@pytest.mark.usefixtures("migrated_url")
def test_corrupt_verdict_is_compare_and_set_on_the_digest_read(catalog_url: str, root: Path) -> None:
    """The reader finds real damage, but a writer replaces the step just before the verdict is written."""
    with Registry.open(url=catalog_url, root=root) as reader, Registry.open(url=catalog_url, root=root) as writer:
        info = writer.publish("run", 5, make_state(1))
        flip_byte(info.path / "model.safetensors")
        real_set_status = reader.catalog.set_status
        raced: list[str] = []

        def overwrite_then_set(*args: Any, **kwargs: Any) -> bool:
            if not raced:
                raced.append(args[2])
                writer.publish("run", 5, make_state(2), overwrite=True)
            return real_set_status(*args, **kwargs)

        reader.catalog.set_status = overwrite_then_set  # type: ignore[method-assign]
        ckpt = reader.load("run@5")
        assert raced == ["corrupt"]
        assert_state_equal(ckpt.state_dict, make_state(2))
        assert statuses(reader) == {5: "verified"}
        assert corrupt_events(reader) == []


@pytest.mark.usefixtures("migrated_url")
@pytest.mark.both_backends
def test_two_readers_condemning_the_same_payload_both_fall_back(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as first, Registry.open(url=catalog_url, root=root) as second:
        first.publish("run", 1, make_state(1))
        flip_byte(first.publish("run", 2, make_state(2)).path / "model.safetensors")
        real_set_status = first.catalog.set_status
        other: list[Checkpoint] = []

        def other_reader_first(*args: Any, **kwargs: Any) -> bool:
            if not other:
                other.append(second.load("run"))  # condemns step 2 just before this reader does
            return real_set_status(*args, **kwargs)

        first.catalog.set_status = other_reader_first  # type: ignore[method-assign]
        with pytest.warns(RuntimeWarning):
            ckpt = first.load("run")
        for got in (ckpt, other[0]):
            assert got.step == 1 and got.fallback is not None and [s.step for s in got.fallback.skipped] == [2]
        assert corrupt_events(first) == [2]


# --------------------------------------------------------------------------- fall-back


def test_fallback_is_logged_recorded_and_can_be_refused(reg: Registry, caplog: pytest.LogCaptureFixture) -> None:
    for step in (100, 200, 300):
        reg.publish("run", step, make_state(step))
    for step in (200, 300):
        flip_byte(reg.resolve(f"run@{step}").path / "model.safetensors")

    with pytest.raises(CorruptCheckpointError):
        reg.load("run@latest", fallback=False)
    assert statuses(reg) == {100: "verified", 200: "verified", 300: "corrupt"}  # the verdict stands

    with caplog.at_level(logging.WARNING, logger="registry.ops.reading"), pytest.warns(RuntimeWarning):
        ckpt = reg.load("run@latest")
    assert ckpt.step == 100
    assert ckpt.fallback is not None
    assert [s.step for s in ckpt.fallback.skipped] == [200]  # 300 was already known corrupt
    assert ckpt.fallback.steps == 100 and ckpt.fallback.age is not None
    assert any("fell back 100 steps" in r.getMessage() for r in caplog.records), caplog.text
    assert reg.load("run@latest").fallback is None
    with pytest.raises(InvalidStateError):
        reg.load("run@latest", fallback="no")  # type: ignore[arg-type]


def test_a_fallback_record_spans_every_step_skipped(reg: Registry) -> None:
    for step in (10, 20, 30):
        reg.publish("run", step, make_state(step))
    for step in (20, 30):
        flip_byte(reg.resolve(f"run@{step}").path / "model.safetensors")
    with pytest.warns(RuntimeWarning):
        ckpt = reg.load("run")
    assert ckpt.fallback is not None and [s.step for s in ckpt.fallback.skipped] == [30, 20]
    assert ckpt.fallback.from_step == 30 and ckpt.fallback.steps == 20 and ckpt.step == 10
    assert "checksum" in ckpt.fallback.skipped[0].reason


# --------------------------------------------------------------------------- explicit resumption


@pytest.mark.usefixtures("migrated_url")
def test_loading_a_reference_step_does_not_resume_from_it(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as dead:
        for step, loss in ((100, 4.0), (200, 3.0), (300, 1.0), (400, 2.0)):
            dead.publish("run", step, make_state(step), metrics={"eval/loss": loss})
    with Registry.open(url=catalog_url, root=root) as trainer:
        assert trainer.load("run@latest").step == 400          # the resume
        assert trainer.load("run@100").step == 100             # a reference policy, not a resume
        trainer.publish("run", 500, make_state(500), metrics={"eval/loss": 1.5})
        assert trainer.resolve("run@best:eval/loss").step == 300
        assert {p.step for p in trainer.metrics("run", "eval/loss")} == {100, 200, 300, 400, 500}
        resumes = [e.detail["resumed_from"] for e in trainer.events("run") if e.kind == "resume"]
        assert resumes == [400]


@pytest.mark.usefixtures("migrated_url")
def test_resume_can_be_forced_or_refused(catalog_url: str, root: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as dead:
        for step, loss in ((100, 4.0), (200, 1.0), (300, 2.0)):
            dead.publish("run", step, make_state(step), metrics={"eval/loss": loss})
    with Registry.open(url=catalog_url, root=root) as evaluator:
        evaluator.load("run@latest", resume=False)
        evaluator.publish("other", 1, make_state(1))  # publishing to another run resumes nothing here
        assert evaluator.resolve("run@best:eval/loss").step == 200
    with Registry.open(url=catalog_url, root=root) as trainer:
        trainer.load("run@100", resume=True)  # rolling back past a loss spike, on purpose
        trainer.publish("run", 150, make_state(150), metrics={"eval/loss": 3.0})
        assert {p.step for p in trainer.metrics("run", "eval/loss")} == {100, 150}
        assert trainer.resolve("run@best:eval/loss").step == 150
        trainer.load("run@100", resume=True)  # after publishing: a new attempt, resumed from 100 again
        trainer.publish("run", 120, make_state(120), metrics={"eval/loss": 3.5})
        assert {p.step for p in trainer.metrics("run", "eval/loss")} == {100, 120}
        resumes = [e.detail["resumed_from"] for e in trainer.events("run") if e.kind == "resume"]
        assert resumes == [100, 100]
        with pytest.raises(InvalidStateError):
            trainer.load("run@100", resume="yes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- extras


def test_an_evaluator_never_reads_unwanted_extras(reg: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    reg.publish("run", 1, make_state(1), extra={"optimizer": optimizer_state(), "rng": {"seed": 7},
                                                "custom": {"x": Weird()}}, trust_pickle=True)
    opened: list[str] = []
    real_open = os.open

    def spy(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        opened.append(Path(path).name)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    ckpt = reg.load("run@1", extras=False)
    assert ckpt.extra == {} and not any(n.endswith(".pt") for n in opened)
    assert_state_equal(ckpt.state_dict, make_state(1))
    opened.clear()
    ckpt = reg.load("run@1", extras=["rng"])
    assert ckpt.extra == {"rng": {"seed": 7}}
    assert [n for n in opened if n.endswith(".pt")] == ["rng.pt"]
    monkeypatch.undo()

    with pytest.raises(ExtraNotFoundError, match="'nope'"):
        reg.load("run@1", extras=["nope"])
    for bad in ("rng", [1], ["../x"], None):
        with pytest.raises(InvalidStateError):
            reg.load("run@1", extras=bad)  # type: ignore[arg-type]
    assert statuses(reg) == {1: "verified"}
    assert set(reg.load("run@1", trust_pickle=True).extra) == {"optimizer", "rng", "custom"}
    assert Checkpoint.load(reg.resolve("run@1").path, extras=["rng"]).extra == {"rng": {"seed": 7}}


# --------------------------------------------------------------------------- rank 0 of a distributed load


WORKER = textwrap.dedent("""
    import json, os, sys, warnings
    from datetime import timedelta
    from pathlib import Path
    import torch
    import torch.distributed as dist
    rank, world, port, spec = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    from registry import Registry
    from tests._dist_worker import fingerprint
    from tests.helpers import make_state
    # only rank 0 may consult the catalog: the others get an empty one (and, since a root belongs
    # to one catalog, an empty root) of their own
    url = spec["url"] if rank == 0 else "sqlite:///" + spec["out"] + f"/empty-{rank}.db"
    root = spec["root"] if rank == 0 else spec["out"] + f"/empty-root-{rank}"
    results = {}
    with Registry.open(url=url, root=root) as reg:
        if rank == 0:
            real_resolve = reg.catalog.resolve_leased
            raced = []
            def resolve_then_overwrite(ref, **kwargs):
                info, lease = real_resolve(ref, **kwargs)
                if ref.run == "race" and not raced:  # a second writer, at the exact moment
                    raced.append(info.step)
                    with Registry.open(url=spec["url"], root=spec["root"]) as writer:
                        writer.publish("race", 5, make_state(2), overwrite=True)
                return info, lease
            reg.catalog.resolve_leased = resolve_then_overwrite
        for name, ref, options in (("race", "race@5", {}), ("extras", "main@1", {"extras": ["rng"]}),
                                   ("no-fallback", "fb@latest", {"fallback": False}),
                                   ("fallback", "fb2@latest", {})):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ck = reg.load(ref, broadcast=True, strategy="broadcast", timeout=30, **options)
                fb = ck.fallback
                results[name] = {"ok": True, "step": ck.step, "state": fingerprint(ck.state_dict),
                                 "extra": sorted(ck.extra),
                                 "skipped": [s.step for s in fb.skipped] if fb is not None else None}
            except Exception as exc:
                results[name] = {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
        if rank == 0:
            results["raced"] = raced
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(results))
    os._exit(0)
""")


def run_group(world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    port = free_port()
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world), str(port), json.dumps(spec)],
                              cwd=REPO, env=env) for r in range(world)]
    end = time.monotonic() + 240  # a hang detector, far above the per-collective timeouts
    try:
        codes = [p.wait(timeout=max(1.0, end - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * world, codes
    return [json.loads((Path(spec["out"]) / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.usefixtures("migrated_url")
@pytest.mark.distributed
def test_rank_zero_shares_the_local_read_path(catalog_url: str, root: Path, tmp_path: Path) -> None:
    with Registry.open(url=catalog_url, root=root) as reg:
        reg.publish("race", 5, make_state(1))
        reg.publish("main", 1, make_state(3), extra={"optimizer": optimizer_state(), "rng": {"seed": 1},
                                                    "custom": {"x": Weird()}}, trust_pickle=True)
        for step in (1, 2):
            reg.publish("fb", step, make_state(10 + step))
            reg.publish("fb2", step, make_state(20 + step))
        flip_byte(reg.resolve("fb@2").path / "model.safetensors")
        flip_byte(reg.resolve("fb2@2").path / "model.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    results = run_group(2, {"url": catalog_url, "root": str(root), "out": str(out)})

    assert results[0]["raced"] == [5]
    race = [r["race"] for r in results]
    assert all(g["ok"] and g["step"] == 5 for g in race), race
    assert {g["state"] for g in race} == {fingerprint(make_state(2))}  # the new payload, on every rank
    extras = [r["extras"] for r in results]
    assert all(g["ok"] and g["extra"] == ["rng"] for g in extras), extras  # custom.pt never unpickled
    refused = [r["no-fallback"] for r in results]
    assert [g["type"] for g in refused] == ["CorruptCheckpointError"] * 2, refused
    fell = [r["fallback"] for r in results]
    assert all(g["ok"] and g["step"] == 1 and g["skipped"] == [2] for g in fell), fell
    with Registry.open(url=catalog_url, root=root) as reg:
        assert statuses(reg, "race") == {5: "verified"} and corrupt_events(reg, "race") == []
        assert statuses(reg, "fb") == {1: "verified", 2: "corrupt"}
        assert statuses(reg, "fb2") == {1: "verified", 2: "corrupt"}
        assert all(reg.catalog.leased_steps(run) == set() for run in ("race", "main", "fb", "fb2"))
