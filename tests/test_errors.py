"""Bad input gets a clear RegistryError and touches nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from registry import (CatalogError, InvalidNameError, InvalidRefError, InvalidStateError, Registry,
                      RegistryError, RootError)
from tests.helpers import make_state


def test_error_hierarchy() -> None:
    from registry import errors
    for name in dir(errors):
        cls = getattr(errors, name)
        if (isinstance(cls, type) and issubclass(cls, Exception) and cls is not errors.RegistryError
                and cls.__module__ == errors.__name__):
            assert issubclass(cls, errors.RegistryError), name
    assert issubclass(errors.CheckpointNotFoundError, LookupError)
    assert issubclass(errors.StepExistsError, FileExistsError)


@pytest.mark.parametrize("run", ["", "../x", "a/b", ".hidden", "x" * 200])
def test_invalid_run_name(reg: Registry, run: str) -> None:
    with pytest.raises(InvalidNameError):
        reg.publish(run, 1, make_state(1))


def test_negative_step(reg: Registry) -> None:
    with pytest.raises(InvalidNameError, match="non-negative"):
        reg.publish("run", -1, make_state(1))


@pytest.mark.parametrize("state", [{"w": [1, 2, 3]}, {"w": 3.0}, [torch.zeros(1)], {"": torch.zeros(1)},
                                   {"w": torch.zeros(2).to_sparse()}])
def test_non_tensor_state(reg: Registry, state: object) -> None:
    with pytest.raises(InvalidStateError):
        reg.publish("run", 1, state)  # type: ignore[arg-type]
    assert reg.runs() == []


def test_bad_ref(reg: Registry) -> None:
    with pytest.raises(InvalidRefError):
        reg.resolve("run@best:")
    with pytest.raises(InvalidRefError):
        reg.load("@@")


def test_root_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(RootError):
        Registry.open(root=tmp_path / "file", url=f"sqlite:///{tmp_path / 'c.db'}")


def test_unreachable_catalog(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot reach"):
        Registry.open(url="postgresql+psycopg://nobody@127.0.0.1:1/none", root=tmp_path)
    with pytest.raises(CatalogError):
        Registry.open(url="mysql://x/y", root=tmp_path)
    with pytest.raises(CatalogError):
        Registry.open(url="not a url", root=tmp_path)


def test_messages_are_one_line(reg: Registry) -> None:
    with pytest.raises(RegistryError) as info:
        reg.resolve("run\n@x")
    assert "\n" not in str(info.value)
