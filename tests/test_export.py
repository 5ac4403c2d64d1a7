"""``export`` (a standalone copy) and ``checkout`` (links to the verified files under a reader lease)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import safetensors.torch as st

from registry import Registry
from registry.errors import CorruptCheckpointError, InvalidStateError
from registry.retention import KeepLast
from tests.helpers import assert_state_equal, make_state, optimizer_state

CONFIG = {"model_type": "toy", "hidden_size": 8}


def publish_two(reg: Registry) -> None:
    for step in (1, 2):
        reg.publish("run", step, make_state(step), config=CONFIG, extra={"optimizer": optimizer_state()},
                    metrics={"loss": 1.0 / step})


def test_export_one_file_loads_with_safetensors_and_the_reference(reg: Registry, tmp_path: Path,
                                                                   reference) -> None:  # type: ignore[no-untyped-def]
    publish_two(reg)
    done = reg.export("run@1", tmp_path / "out")
    assert (done.run, done.step, done.format) == ("run", 1, "safetensors")
    assert "model.safetensors" in done.files and "optimizer.pt" not in done.files
    assert_state_equal(st.load_file(str(tmp_path / "out" / "model.safetensors")), make_state(1))
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == CONFIG
    theirs = reference.Checkpoint.load(str(tmp_path / "out"), verify_checksums=True)
    assert_state_equal(theirs.state_dict, make_state(1))


def test_export_hf_shards_with_an_index(reg: Registry, tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    publish_two(reg)
    done = reg.export("run@latest", tmp_path / "hf", format="hf", max_shard_size=300)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and set(shards) <= set(done.files) and "model.safetensors" not in done.files
    assert_state_equal(reference.load_model_weights(str(tmp_path / "hf")), make_state(2))


def test_export_refuses_bad_input_before_reading(reg: Registry, tmp_path: Path) -> None:
    publish_two(reg)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep me")
    with pytest.raises(InvalidStateError, match="not empty"):
        reg.export("run@1", tmp_path / "full")
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep me"
    with pytest.raises(InvalidStateError, match="format"):
        reg.export("run@1", tmp_path / "x", format="pickle")
    with pytest.raises(InvalidStateError, match="needs format='hf'"):
        reg.export("run@1", tmp_path / "x", max_shard_size=10)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("dest", ["", None, 5, b"/tmp/x"])
def test_a_destination_that_names_no_directory_is_refused(reg: Registry, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, dest: object) -> None:
    """'' would be the current directory: an export with overwrite=True would replace it."""
    publish_two(reg)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("keep me")
    before = sorted(os.listdir(tmp_path))
    calls = {"export": lambda: reg.export("run@1", dest, overwrite=True),  # type: ignore[arg-type]
             "materialize": lambda: reg.materialize("run@1", dest)}  # type: ignore[arg-type]
    if dest is not None:  # checkout(dest=None) makes a directory of the registry's own
        calls["checkout"] = lambda: reg.checkout("run@1", dest)  # type: ignore[arg-type]
    for what, call in calls.items():
        with pytest.raises(InvalidStateError, match=f"{what} destination must name a directory"):
            call()
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "mine.txt").read_text() == "keep me"


def test_checkout_copies_the_verified_files_under_a_lease(reg: Registry, tmp_path: Path) -> None:
    publish_two(reg)
    with reg.checkout("run@1") as co:
        path = Path(co)
        assert co.step == 1 and co.kind in ("copy", "reflink") and co.owned
        source = reg.resolve("run@1").path
        for name in ("config.json", "model.safetensors", "optimizer.pt", "manifest.json"):
            assert os.stat(path / name).st_ino != os.stat(source / name).st_ino  # the caller's own file
            assert (path / name).read_bytes() == (source / name).read_bytes()
        assert_state_equal(st.load_file(str(path / "model.safetensors")), make_state(1))
        assert reg.catalog.leased_steps("run") == {1}
        reg.publish("run", 3, make_state(3))
        plan = reg.plan_retention("run", KeepLast(1))
        assert 1 not in plan.delete and 2 in plan.delete  # the lease protects what KeepLast(1) drops
    assert reg.catalog.leased_steps("run") == set()
    assert not path.exists()  # the registry chose the directory, so closing removes it


def test_checkout_into_a_given_directory_stays_after_close(reg: Registry, tmp_path: Path) -> None:
    publish_two(reg)
    co = reg.checkout("run", tmp_path / "co")
    co.renew()
    assert reg.catalog.leased_steps("run") == {2}
    co.close()
    assert reg.catalog.leased_steps("run") == set()
    assert_state_equal(st.load_file(str(tmp_path / "co" / "model.safetensors")), make_state(2))
    with pytest.raises(InvalidStateError, match="not an empty directory"):
        reg.checkout("run@1", tmp_path / "co")


def test_checkout_of_a_corrupt_latest_falls_back_with_a_warning(reg: Registry, tmp_path: Path) -> None:
    publish_two(reg)
    weights = reg.resolve("run@2").path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    os.chmod(weights, 0o644)
    weights.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="falling back"):
        co = reg.checkout("run@latest", tmp_path / "co")
    with co:
        assert co.step == 1
        assert_state_equal(st.load_file(str(tmp_path / "co" / "model.safetensors")), make_state(1))
    assert reg.catalog.get("run", 2).status == "corrupt"  # type: ignore[union-attr]
    with pytest.raises(CorruptCheckpointError):
        reg.checkout("run@2", tmp_path / "co2")
    assert not (tmp_path / "co2").exists()


def test_cli_export_and_checkout(reg: Registry, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    publish_two(reg)
    out = cli("export", "run@1", str(tmp_path / "hf"), "--format", "hf", "--max-shard-size", "300B")
    assert out.exit_code == 0, out.output
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    out = cli("checkout", "run@latest", str(tmp_path / "co"), "--ttl", "60")
    assert out.exit_code == 0, out.output
    assert out.output.strip() == str(tmp_path / "co")
    assert reg.catalog.leased_steps("run") == {2}  # left to expire: the command has exited
    out = cli("export", "run@1", str(tmp_path / "hf"))
    assert out.exit_code == 1 and "not empty" in out.output


def test_an_expired_checkout_lease_protects_nothing_and_its_files_outlive_the_step(reg: Registry,
                                                                                   tmp_path: Path) -> None:
    from datetime import timedelta
    publish_two(reg)
    reg.publish("run", 3, make_state(3))
    co = reg.checkout("run@1", tmp_path / "co", ttl=timedelta(0))  # as a dead reader's lease is, once past its ttl
    assert reg.catalog.leased_steps("run") == set()
    assert 1 in reg.apply_retention("run", KeepLast(1)).deleted
    assert not reg.resolve("run@latest").path.with_name("step-00000001").exists()
    assert_state_equal(st.load_file(str(tmp_path / "co" / "model.safetensors")), make_state(1))
    co.close()


def test_checkout_tells_a_missing_file_from_a_missing_directory(reg: Registry, tmp_path: Path) -> None:
    from registry.errors import CheckpointReadError
    publish_two(reg)
    step2 = reg.resolve("run@2").path
    moved = step2.with_name("elsewhere")
    step2.rename(moved)  # as an unmounted root looks: this reader's trouble, not the step's
    with pytest.raises(CheckpointReadError, match="nothing was marked"):
        reg.checkout("run@latest", tmp_path / "a")
    assert reg.catalog.get("run", 2).status == "verified"  # type: ignore[union-attr]
    moved.rename(step2)
    (step2 / "optimizer.pt").unlink()  # a file the manifest lists is gone: the step is damaged
    with pytest.warns(RuntimeWarning, match="falling back"), reg.checkout("run@latest", tmp_path / "b") as co:
        assert co.step == 1
    assert reg.catalog.get("run", 2).status == "corrupt"  # type: ignore[union-attr]
