"""``reg.import_checkpoint`` / ``registry import``: adopting foreign directories safely."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
from click.testing import CliRunner

from registry import (CheckpointNotFoundError, CorruptCheckpointError, InvalidStateError, Registry,
                      StepExistsError, UnsafePathError)
from registry.cli import main
from tests.helpers import assert_state_equal, dcp_state, make_state, write_dcp, write_hf_sharded


def write_reference(reference: Any, path: Path, seed: int = 1) -> dict[str, torch.Tensor]:  # noqa: F811
    state = make_state(seed)
    reference.Checkpoint(state_dict=state, epoch=3, consumed_samples=64, extra={"sched": {"last_epoch": 2}},
                         meta={"optimizer_step": 120, "policy_version": 7}, config={"d": 8}).save(str(path))
    return state


def write_hf(path: Path) -> dict[str, torch.Tensor]:
    state = write_hf_sharded(path)
    (path / "tokenizer.json").write_text("{}")
    return state


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_import_reference_directory(reference, reg: Registry, tmp_path: Path) -> None:  # noqa: F811
    src = tmp_path / "src"
    state = write_reference(reference, src)
    before = snapshot(src)
    info = reg.import_checkpoint(src, run="imp", step=120, tags=["seed"])
    assert info.status == "verified" and info.epoch == 3 and info.consumed_samples == 64
    assert info.policy_version == 7 and info.tags == ("seed",)
    assert snapshot(src) == before, "copy mode must leave the source untouched"
    ckpt = reg.load("imp@seed")
    assert_state_equal(ckpt.state_dict, state)
    assert ckpt.extra == {"sched": {"last_epoch": 2}} and ckpt.config == {"d": 8}
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert manifest["imported"]["layout"] == "manifest" and manifest["optimizer_step"] == 120
    assert_state_equal(reference.Checkpoint.load(str(info.path), verify_checksums=True).state_dict, state)
    assert reg.verify("imp@120")[0].ok


def test_import_legacy_directory_without_manifest(reference, sqlite_reg: Registry,  # noqa: F811
                                                  tmp_path: Path) -> None:
    src = tmp_path / "legacy"
    state = write_reference(reference, src, seed=2)
    (src / "manifest.json").unlink()
    info = sqlite_reg.import_checkpoint(src, run="old", step=5)
    assert_state_equal(sqlite_reg.load("old@5").state_dict, state)
    assert json.loads((info.path / "manifest.json").read_text())["imported"]["layout"] == "legacy"
    # the manifest we wrote makes it loadable by the reference module with checksums
    assert_state_equal(reference.Checkpoint.load(str(info.path), verify_checksums=True).state_dict, state)


def test_import_hugging_face_sharded_directory_by_move(sqlite_reg: Registry, tmp_path: Path) -> None:
    src = tmp_path / "hf"
    state = write_hf(src)
    info = sqlite_reg.import_checkpoint(src, run="hf", step=0, move=True)
    assert not src.exists(), "move removes the original directory once the import is committed"
    ckpt = sqlite_reg.load("hf@0")
    assert_state_equal(ckpt.state_dict, state)
    assert ckpt.config == {"hidden_size": 4}
    names = set(json.loads((info.path / "manifest.json").read_text())["files"])
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "model.safetensors.index.json", "config.json", "tokenizer.json"} == names


@pytest.mark.parametrize("move", [False, True])
def test_tampered_directory_is_refused_and_left_intact(reference, sqlite_reg: Registry, tmp_path: Path,  # noqa: F811
                                                       move: bool) -> None:
    src = tmp_path / "src"
    write_reference(reference, src)
    raw = bytearray((src / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (src / "model.safetensors").write_bytes(bytes(raw))
    before = snapshot(src)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        sqlite_reg.import_checkpoint(src, run="t", step=1, move=move)
    assert snapshot(src) == before
    assert sqlite_reg.catalog.get("t", 1).status == "failed"  # type: ignore[union-attr]
    with pytest.raises(CheckpointNotFoundError):
        sqlite_reg.resolve("t@1")
    assert not any((sqlite_reg.store.root / "t").iterdir()), "staging leftovers"


def test_unsafe_directories_are_refused_before_anything_is_touched(sqlite_reg: Registry, tmp_path: Path) -> None:
    outside = tmp_path / "secret.safetensors"
    st.save_file({"x": torch.ones(2)}, str(outside))
    cases = {}
    for case in ("symlink", "subdir", "name"):
        d = tmp_path / case
        write_hf(d)
        cases[case] = d
    os.symlink(outside, cases["symlink"] / "extra.safetensors")
    (cases["subdir"] / ".cache").mkdir()
    (cases["name"] / "~weights").write_text("x")
    for d in cases.values():
        with pytest.raises(UnsafePathError):
            sqlite_reg.import_checkpoint(d, run="u", step=1)
    with pytest.raises(UnsafePathError):
        sqlite_reg.import_checkpoint(cases["symlink"] / "extra.safetensors", run="u", step=1)
    with pytest.raises(CheckpointNotFoundError):
        sqlite_reg.import_checkpoint(tmp_path / "nothing", run="u", step=1)
    assert sqlite_reg.runs() == [], "nothing may reach the catalog"


def test_inconsistent_index_is_refused(sqlite_reg: Registry, tmp_path: Path) -> None:
    src = tmp_path / "hf"
    write_hf(src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.weight"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="do not hold exactly"):
        sqlite_reg.import_checkpoint(src, run="i", step=1)


def test_existing_step_needs_overwrite(sqlite_reg: Registry, tmp_path: Path) -> None:
    sqlite_reg.publish("e", 1, make_state(1))
    src = tmp_path / "hf"
    state = write_hf(src)
    with pytest.raises(StepExistsError):
        sqlite_reg.import_checkpoint(src, run="e", step=1)
    assert_state_equal(sqlite_reg.load("e@1").state_dict, make_state(1))
    sqlite_reg.import_checkpoint(src, run="e", step=1, overwrite=True)
    assert_state_equal(sqlite_reg.load("e@1").state_dict, state)


def test_moving_out_of_the_registry_root_is_refused(sqlite_reg: Registry) -> None:
    info = sqlite_reg.publish("a", 1, make_state(1))
    with pytest.raises(InvalidStateError, match="inside the checkpoint root"):
        sqlite_reg.import_checkpoint(info.path, run="b", step=1, move=True)
    copied = sqlite_reg.import_checkpoint(info.path, run="b", step=1)
    assert_state_equal(sqlite_reg.load("b@1").state_dict, make_state(1))
    assert_state_equal(sqlite_reg.load("a@1").state_dict, make_state(1))
    assert copied.path != info.path
    with pytest.raises(InvalidStateError, match="already is"):
        sqlite_reg.import_checkpoint(info.path, run="a", step=1, overwrite=True)


def test_cli_import(tmp_path: Path) -> None:
    root, url = tmp_path / "ckpt", f"sqlite:///{tmp_path / 'catalog.db'}"
    src = tmp_path / "hf"
    state = write_hf(src)
    runner = CliRunner()
    ok = runner.invoke(main, ["--url", url, "--root", str(root), "import", str(src), "--run", "c", "--step", "9",
                              "--move"], catch_exceptions=False)
    assert ok.exit_code == 0, ok.output
    assert "c@9" in ok.output and not src.exists()
    bad = runner.invoke(main, ["--url", url, "--root", str(root), "import", str(src), "--run", "c", "--step", "10"])
    assert bad.exit_code == 1 and "no checkpoint directory" in bad.output
    usage = runner.invoke(main, ["--url", url, "--root", str(root), "import", str(src), "--run", "c"])
    assert usage.exit_code == 2
    with Registry.open(url=url, root=root) as reg:
        assert_state_equal(reg.load("c@9").state_dict, state)


def assert_nested_equal(got: Any, want: Any, where: str = "state") -> None:
    """Nested dicts and lists of tensors and plain values, equal leaf by leaf (tensors by value and dtype)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            assert_nested_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_nested_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want and type(got) is type(want), where


def test_import_dcp_directory(reg: Registry, tmp_path: Path) -> None:
    """A directory plain ``dcp.save`` wrote (torchtitan's ``step-N``) is adopted, hashed, and loads whole."""
    from registry.format.dcp_metadata import load_dcp_state_dict
    src = tmp_path / "step-3"
    state = dcp_state(3)
    write_dcp(src, state, threads=2)
    before = snapshot(src)
    info = reg.import_checkpoint(src, run="titan", step=3, tags=["seed"])
    assert info.status == "verified" and info.tags == ("seed",)
    assert snapshot(src) == before, "copy mode must leave the source untouched"
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "__0_1.distcp"}
    for name, entry in manifest["files"].items():
        assert entry["size"] == len(before[name]) and entry["xxh3_128_pieces"]["digests"], name
    assert manifest["layout"] == {"kind": "dcp", "world_size": 1,
                                  "files_per_rank": {"0": ["__0_0.distcp", "__0_1.distcp"]}}
    assert manifest["imported"]["layout"] == "dcp"
    assert "model.embed.weight" in manifest["tensors"] and "train_state.step" not in manifest["tensors"]
    assert manifest["format_version"] == 2  # a sharded step: the reference module refuses it, and so it must
    assert_nested_equal(load_dcp_state_dict(info.path), state)
    full = reg.load("titan@3")  # the one read path, as for a step published sharded: flat keys, full tensors
    flat: dict[str, Any] = {}

    def flatten(node: Any, prefix: str) -> None:
        for k, v in node.items():
            (flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else flat.__setitem__(f"{prefix}{k}", v))
    flatten(state, "")
    assert set(full.state_dict) == set(manifest["tensors"])
    for key, tensor in full.state_dict.items():
        assert torch.equal(tensor, flat[key]), key
    assert [r.ok for r in reg.verify("titan@3")] == [True]


def test_import_dcp_directory_by_move_from_the_command_line(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from registry.format.dcp_metadata import load_dcp_state_dict
    src = tmp_path / "step-9"
    state = dcp_state(9)
    write_dcp(src, state)
    result = cli("import", str(src), "--run", "titan", "--step", "9", "--move")
    assert result.exit_code == 0, result.output
    assert not src.exists(), "move removes the original directory once the import is committed"
    path = Path(cli("resolve", "titan@9").output.strip())
    assert_nested_equal(load_dcp_state_dict(path), state)
    size = (path / ".metadata").stat().st_size
    (path / ".metadata").write_bytes(b"\x80\x04" + b"g" * (size - 2))  # a damaged copy, its size kept, is refused
    result = cli("import", str(path), "--run", "titan", "--step", "10")
    assert result.exit_code == 1 and "truncated or damaged" in result.output
    assert len(result.output.strip().splitlines()) == 1


FSDP_SAVE = r"""
import os, socket, sys, warnings
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

def rank(r, port, out):
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 1}, checkpoint_id=out + "/step-1")  # DTensor shards
    full_m, full_o = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if r == 0:
        torch.save({"model": full_m, "optim": full_o, "step": 1}, out + "/full.pt")
    dist.barrier()  # neither rank tears gloo down while the other still talks to it (SIGABRT at exit)
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank, args=(port, sys.argv[1]), nprocs=2)
"""


def test_import_dcp_directory_saved_by_two_fsdp_ranks(sqlite_reg: Registry, tmp_path: Path) -> None:
    """DTensor shards of model and optimizer from two ranks: adopted as world size 2, and they load whole."""
    import subprocess
    import sys

    from registry.format.dcp_metadata import load_dcp_state_dict
    from tests.helpers import child_env
    script = tmp_path / "save.py"
    script.write_text(FSDP_SAVE)
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                         env=child_env(), timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    info = sqlite_reg.import_checkpoint(tmp_path / "step-1", run="fsdp", step=1)
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert manifest["layout"] == {"kind": "dcp", "world_size": 2,
                                  "files_per_rank": {"0": ["__0_0.distcp"], "1": ["__1_0.distcp"]}}
    assert manifest["format_version"] == 2
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    loaded = load_dcp_state_dict(info.path)
    assert_nested_equal(loaded["model"], full["model"])
    assert loaded["step"] == 1
    # DCP keys the optimizer state by parameter name; every moment tensor comes back whole
    for name, moments in full["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["optim"]["state"][name][key], moments[key]), (name, key)
