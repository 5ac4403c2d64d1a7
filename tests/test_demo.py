"""``scripts/demo`` works in a directory of its own and never removes one it did not make."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from registry import Registry
from tests.helpers import REPO, child_env, make_state

DEMO = REPO / "scripts" / "demo.py"


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("registry_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def foreign_root(path: Path) -> Path:
    """A root with two runs of somebody's, and its own catalog."""
    with Registry.open(root=path, url=f"sqlite:///{path / '.registry' / 'catalog.db'}") as reg:
        reg.publish("a", 1, make_state(1))
        reg.publish("b", 2, make_state(2))
    return path


def assert_intact(path: Path) -> None:
    with Registry.open(root=path, url=f"sqlite:///{path / '.registry' / 'catalog.db'}", create=False) as reg:
        assert sorted(r.name for r in reg.runs()) == ["a", "b"]
        for run, step in (("a", 1), ("b", 2)):
            loaded = reg.load(f"{run}@latest").state_dict
            assert all(torch.equal(loaded[k], v) for k, v in make_state(step).items())
    assert not (path / "demo").exists()


def test_a_root_that_holds_other_runs_is_refused_in_one_line_and_left_alone(
        demo: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = foreign_root(tmp_path / "theirs")
    monkeypatch.setenv("REGISTRY_ROOT", str(root))
    with pytest.raises(SystemExit) as caught:
        demo.main(["--root", str(root)])
    message = str(caught.value.code)
    assert "\n" not in message and "holds other runs (a, b)" in message and "--root" in message
    assert_intact(root)


@pytest.mark.parametrize("keep", [False, True])
def test_only_a_directory_the_demo_marked_is_emptied(demo: ModuleType, tmp_path: Path, keep: bool) -> None:
    unmarked = tmp_path / "unmarked"
    (unmarked / "demo").mkdir(parents=True)  # a run called demo, of somebody else's
    with pytest.raises(SystemExit) as caught:
        demo.prepare_root(unmarked, keep=keep)
    assert "was not made by the demo" in str(caught.value.code)
    assert (unmarked / "demo").is_dir()

    ours = tmp_path / "ours"
    demo.prepare_root(ours, keep=keep)
    assert (ours / demo.MARK).is_file()
    (ours / "demo" / "step-1").mkdir(parents=True)
    demo.prepare_root(ours, keep=keep)  # the demo run again, where it ran before
    assert (ours / "demo" / "step-1").exists() == keep and (ours / demo.MARK).is_file()

    (ours / "other-run").mkdir()  # somebody published into the demo's directory since
    with pytest.raises(SystemExit) as caught:
        demo.prepare_root(ours, keep=keep)
    assert "holds other runs (other-run)" in str(caught.value.code)
    assert (ours / "other-run").is_dir()


def test_an_empty_directory_is_taken_and_a_file_refused(demo: ModuleType, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    demo.prepare_root(empty, keep=False)
    assert sorted(p.name for p in empty.iterdir()) == [demo.MARK]
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        demo.prepare_root(tmp_path / "file", keep=False)
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.slow
def test_the_demo_ignores_registry_root_and_leaves_it_intact(tmp_path: Path) -> None:
    root = foreign_root(tmp_path / "theirs")
    env = {**child_env(), "REGISTRY_ROOT": str(root), "REGISTRY_URL": f"sqlite:///{root / '.registry/catalog.db'}"}
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, str(DEMO), "--steps", "20", "--every", "10", "--crash-at", "20"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ignoring $REGISTRY_ROOT" in done.stdout and "ignoring $REGISTRY_URL" in done.stdout
    assert_intact(root)
    own = work / "demo-checkpoints"
    assert (own / "demo").is_dir() and (own / ".made-by-registry-demo").is_file()
    assert f"created a new catalog {own / '.registry' / 'catalog.db'}" in done.stderr
    assert "--root demo-checkpoints ls demo" in done.stdout  # the next commands name the directory it used
