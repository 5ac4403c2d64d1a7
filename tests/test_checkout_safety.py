"""Checkouts never alias a step writably, registry-owned ones are reclaimed, and nothing writes into the root.

Real files on this machine's filesystems (a loop-mounted XFS image for the
reflink path where this host can make one), both catalog backends, and a
real ``transformers`` model for ``save_pretrained`` into a checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

from registry import Registry
from registry.errors import InvalidStateError
from registry.retention import KeepLast
from tests.helpers import assert_state_equal, make_state

CONFIG = {"model_type": "toy", "hidden_size": 8}


def publish_two(reg: Registry, run: str = "run") -> None:
    for step in (1, 2):
        reg.publish(run, step, make_state(step), config=CONFIG, extra={"optimizer": {"lr": 0.1 * step}})


def snapshot(reg: Registry) -> dict[str, bytes]:
    """Every file of every step, by path: what no checkout may change."""
    return {str(p): p.read_bytes() for p in sorted(reg.store.root.rglob("step-*/*")) if p.is_file()}


def assert_intact(reg: Registry, before: dict[str, bytes]) -> None:
    assert snapshot(reg) == before
    report = reg.fsck(checksums=True)
    assert report.clean, [str(p) for p in report.problems]
    for info in reg.checkpoints("run"):
        assert_state_equal(reg.load(f"run@{info.step}").state_dict, make_state(info.step))


@pytest.mark.parametrize("owned", [True, False])
def test_writes_into_a_checkout_never_reach_a_step(reg: Registry, tmp_path: Path, owned: bool) -> None:
    publish_two(reg)
    before = snapshot(reg)
    with reg.checkout("run@latest", None if owned else tmp_path / "co") as co:
        path = Path(co)
        with open(path / "model.safetensors", "r+b") as f:  # an in-place edit, as root does it
            f.seek(-4, os.SEEK_END)
            f.write(b"\xff\xff\xff\xff")
        st.save_file({"w": torch.zeros(3)}, str(path / "model.safetensors"))  # truncate and rewrite
        with open(path / "optimizer.pt", "r+b") as f:
            f.write(b"garbage")
        (path / "config.json").write_text("{}")
        assert_intact(reg, before)


def test_save_pretrained_into_a_checkout_leaves_every_step_intact(reg: Registry, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    doc = json.loads(config.to_json_string())
    reg.publish("llama", 1, state, config=doc)
    reg.publish("llama", 2, state, config=doc)
    before = {str(p): p.read_bytes() for p in sorted(reg.store.root.rglob("step-*/*")) if p.is_file()}
    with reg.checkout("llama@latest") as co:
        tuned = transformers.AutoModelForCausalLM.from_pretrained(co)
        with torch.no_grad():
            for p in tuned.parameters():
                p.add_(1.0)  # a "fine-tune"
        tuned.save_pretrained(co)
        assert not torch.equal(st.load_file(str(Path(co) / "model.safetensors"))["lm_head.weight"],
                               state["lm_head.weight"])
    after = {str(p): p.read_bytes() for p in sorted(reg.store.root.rglob("step-*/*")) if p.is_file()}
    assert after == before
    assert reg.fsck(checksums=True).clean
    assert_state_equal(reg.load("llama@2").state_dict, state)


def test_links_only_on_request(reg: Registry, tmp_path: Path) -> None:
    publish_two(reg)
    source = reg.resolve("run@2").path
    with reg.checkout("run@2", tmp_path / "hard", link="hardlink") as co:
        assert co.kind == "hardlink"
        assert os.stat(Path(co) / "model.safetensors").st_ino == os.stat(source / "model.safetensors").st_ino
    with reg.checkout("run@2", tmp_path / "sym", link="symlink") as co:
        assert co.kind == "symlink" and (Path(co) / "model.safetensors").is_symlink()
    with pytest.raises(InvalidStateError, match="link must be"):
        reg.checkout("run@2", tmp_path / "x", link="copy")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------- reflinks


@pytest.fixture(scope="module")
def xfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A small loop-mounted XFS (reflinks on), or a skip saying why this host cannot make one."""
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        pytest.skip("reflink path not tested: needs root and mkfs.xfs (apt-get install xfsprogs)")
    base = tmp_path_factory.mktemp("xfs")
    image, mnt = base / "xfs.img", base / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(320 << 20)
    made = subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], capture_output=True, text=True)
    mounted = made.returncode == 0 and subprocess.run(["mount", "-o", "loop", str(image), str(mnt)],
                                                      capture_output=True).returncode == 0
    if not mounted:
        pytest.skip(f"reflink path not tested: cannot make and mount an XFS image here ({made.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_checkout_on_xfs_is_reflinked_and_still_independent(catalog_url: str, xfs: Path) -> None:
    root = xfs / f"root-{uuid.uuid4().hex[:8]}"
    with Registry.open(url=catalog_url, root=root) as reg:
        publish_two(reg)
        before = snapshot(reg)
        with reg.checkout("run@latest") as co:
            assert co.kind == "reflink"
            with open(Path(co) / "model.safetensors", "r+b") as f:
                f.write(b"\x00" * 64)
            assert_intact(reg, before)
        with reg.checkout("run@1", xfs / f"mine-{uuid.uuid4().hex[:8]}") as co:
            assert co.kind == "reflink"


# ---------------------------------------------------------------------- reclaiming


def test_gc_and_fsck_repair_reclaim_expired_registry_owned_checkouts(reg: Registry) -> None:
    publish_two(reg)
    live = reg.checkout("run@2", ttl=timedelta(hours=1))
    dead = reg.checkout("run@1", ttl=timedelta(0))  # as a killed `registry checkout`'s lease is, past its ttl
    home = reg.store.root / ".registry" / "checkouts"
    assert dead.path.parent == home and dead.path.is_dir()
    report = reg.fsck()
    assert [(p.kind, p.step) for p in report.problems] == [("expired-checkout", 1)]
    assert dead.path.is_dir()  # fsck without --repair changes nothing
    report = reg.fsck(repair=True)
    assert [p.kind for p in report.repaired] == ["expired-checkout"]
    assert not dead.path.exists() and live.path.is_dir()
    assert sorted(os.listdir(home)) == sorted([live.path.name, live.path.name + ".json"])
    again = reg.checkout("run@1", ttl=timedelta(0), link="hardlink")
    weights = reg.resolve("run@1").path / "model.safetensors"
    ino = os.stat(weights).st_ino
    result = reg.apply_retention("run", KeepLast(1))
    assert result.deleted == (1,) and result.checkouts_removed == (again.path,)
    assert not again.path.exists()  # its hard links went first, so the step's bytes are really freed
    assert ino not in {os.stat(p).st_ino for p in reg.store.root.rglob("*") if p.is_file()}
    assert live.path.is_dir() and reg.fsck().clean
    live.close()
    assert not live.path.exists() and os.listdir(home) == []


def test_cli_release_ends_a_registry_owned_checkout(reg: Registry, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    publish_two(reg)
    out = cli("checkout", "run@2")
    assert out.exit_code == 0, out.output
    path = Path(out.output.strip())
    assert path.is_dir() and reg.catalog.leased_steps("run") == {2}
    out = cli("checkout", "--release", str(path))
    assert out.exit_code == 0, out.output
    assert not path.exists() and reg.catalog.leased_steps("run") == set()
    mine = reg.checkout("run@1", tmp_path / "mine")
    out = cli("checkout", "--release", str(mine.path))
    assert out.exit_code == 1 and "not a registry-owned checkout" in out.output and len(out.output.splitlines()) == 1
    assert mine.path.is_dir()  # the caller's directory is not the registry's to remove
    mine.close()


def test_a_read_only_registry_checks_out_outside_the_root_and_changes_no_mode(reg: Registry, catalog_url: str,
                                                                             cli) -> None:  # type: ignore[no-untyped-def]
    publish_two(reg)
    root = reg.store.root
    modes = {str(p): p.stat().st_mode for p in root.rglob("*")}
    names = sorted(str(p) for p in root.rglob("*"))
    with Registry.open(url=catalog_url, root=root, read_only=True) as ro:
        with ro.checkout("run@latest") as co:
            assert not Path(co).resolve().is_relative_to(root.resolve())
            assert_state_equal(st.load_file(str(Path(co) / "model.safetensors")), make_state(2))
        assert not Path(co).exists()
    assert sorted(str(p) for p in root.rglob("*")) == names  # nothing written into the root
    assert {str(p): p.stat().st_mode for p in root.rglob("*")} == modes
    out = cli("--read-only", "checkout", "run@1")
    assert out.exit_code == 2 and "read-only" in out.output


# ---------------------------------------------------------------------- destinations


def test_export_refuses_destinations_inside_or_containing_the_root(reg: Registry, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    publish_two(reg, "a")
    publish_two(reg, "b")
    root = reg.store.root
    before = {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and "catalog" not in p.name}
    (tmp_path / "link").symlink_to(root)
    for dest in (root / "b", root / "a" / "step-00000001", root / "a" / "step-00000009", tmp_path,
                 tmp_path / "link" / "b", root):
        with pytest.raises(InvalidStateError, match="checkpoint root") as caught:
            reg.export("a@2", dest, overwrite=True)
        assert str(root) in str(caught.value) and str(dest) in str(caught.value)
    out = cli("export", "a@2", str(root / "a" / "step-00000009"))
    assert out.exit_code == 1 and "inside the checkpoint root" in out.output
    assert not (root / "a" / "step-00000009").exists()
    after = {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and "catalog" not in p.name}
    assert after == before
    assert reg.fsck(repair=True).clean  # nothing for --repair to adopt
    assert [i.step for i in reg.checkpoints("b")] == [1, 2] and [i.step for i in reg.checkpoints("a")] == [1, 2]


def test_checkout_and_import_refuse_the_root_but_not_the_owned_checkouts(reg: Registry, tmp_path: Path) -> None:
    publish_two(reg)
    root = reg.store.root
    for dest in (root / "run" / "step-00000007", root / "other", tmp_path):
        with pytest.raises(InvalidStateError, match="checkpoint root"):
            reg.checkout("run@1", dest)
        assert not (root / "run" / "step-00000007").exists() and not (root / "other").exists()
    with reg.checkout("run@1", root / ".registry" / "checkouts" / "mine") as co:
        assert (Path(co) / "model.safetensors").is_file()
    with pytest.raises(InvalidStateError, match="contains the checkpoint root"):
        reg.import_checkpoint(tmp_path, run="x", step=1, move=True)
    assert reg.fsck(checksums=True).clean


def test_a_renewed_checkout_is_not_reclaimed_and_cli_fsck_says_what_it_removed(reg: Registry, cli) -> None:  # type: ignore[no-untyped-def]
    publish_two(reg)
    kept = reg.checkout("run@2", ttl=timedelta(0))
    kept.renew(timedelta(hours=1))  # the record follows the new lease
    gone = reg.checkout("run@1", ttl=timedelta(0))
    out = cli("fsck", "--repair")
    assert "expired-checkout" in out.output and "run@1" in out.output and "run@2" not in out.output
    assert kept.path.is_dir() and not gone.path.exists()
    again = reg.checkout("run@2", ttl=timedelta(0))
    out = cli("gc", "run", "--keep-last", "1")
    assert out.exit_code == 0 and "removed 1 registry-owned checkout whose lease had expired" in out.output
    assert kept.path.is_dir() and not again.path.exists()
    kept.close()


def test_export_and_import_move_never_take_a_sqlite_catalog_kept_outside_the_root(tmp_path: Path) -> None:
    db = tmp_path / "db"
    db.mkdir()
    with Registry.open(url=f"sqlite:///{db / 'catalog.db'}", root=tmp_path / "ckpt") as reg:
        publish_two(reg)
        reg.export("run@1", tmp_path / "out")
        st.save_file(make_state(5), str(db / "model.safetensors"))  # db/ now also looks like an importable dir
        with pytest.raises(InvalidStateError, match="contains the catalog"):
            reg.export("run@2", db, overwrite=True)
        with pytest.raises(InvalidStateError, match="contains the catalog"):
            reg.import_checkpoint(db, run="x", step=1, move=True)
        assert (db / "catalog.db").is_file() and [i.step for i in reg.checkpoints("run")] == [1, 2]
        reg.export("run@2", tmp_path / "out", overwrite=True)  # an ordinary directory is still replaced
        assert_state_equal(st.load_file(str(tmp_path / "out" / "model.safetensors")), make_state(2))


def test_a_short_ttl_checkout_is_not_reclaimed_while_it_is_being_filled(reg: Registry,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """gc running while a ttl=0 checkout copies its files reclaims nothing of it; once handed out, it may."""
    from registry.ops import checkouts
    reg.publish("run", 1, make_state())
    real = checkouts.copy_file
    reclaimed: list[tuple[Path, ...]] = []

    def copy_then_gc(src: Path, dst: Path, **kw: object):  # type: ignore[no-untyped-def]
        done = real(src, dst, **kw)  # type: ignore[arg-type]
        reclaimed.append(checkouts.reclaim(reg.catalog, reg.store.root))
        return done
    monkeypatch.setattr(checkouts, "copy_file", copy_then_gc)
    co = reg.checkout("run@1", ttl=timedelta(0))
    monkeypatch.undo()
    assert reclaimed and not any(reclaimed), reclaimed
    assert_state_equal(st.load_file(str(Path(co) / "model.safetensors")), make_state())
    assert co.ttl == timedelta(0) and not reg.catalog.lease_live(co._lease)  # type: ignore[arg-type]
    assert checkouts.reclaim(reg.catalog, reg.store.root) == (co.path,)
