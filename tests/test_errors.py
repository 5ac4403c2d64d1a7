"""Bad input gets a clear RegistryError and touches nothing."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from registry import (CatalogError, InvalidNameError, InvalidRefError, InvalidStateError, Registry,
                      RegistryError, RootError)
from registry.checkpoint import Checkpoint
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


# Options of the facade's calls given the wrong kind of value: a string where a flag goes would count as true
# (fsck(repair="no") repairing), an empty path would name the current directory. Each call is refused in one
# line, before it reads or changes anything.
BAD_CALLS = {
    "fsck repair='no'": (lambda reg, tmp: reg.fsck(repair="no"), "repair must be True or False"),
    "fsck checksums='x'": (lambda reg, tmp: reg.fsck(checksums="x"), "checksums must be True or False"),
    "load verify='no'": (lambda reg, tmp: reg.load("run@1", verify="no"), "verify must be True or False"),
    "load trust_pickle=1": (lambda reg, tmp: reg.load("run@1", trust_pickle=1), "trust_pickle must be"),
    "metrics key=5": (lambda reg, tmp: reg.metrics("run", 5), "invalid metric key"),
    "metrics history='y'": (lambda reg, tmp: reg.metrics("run", history="y"), "history must be"),
    "checkpoints include_deleted='x'": (lambda reg, tmp: reg.checkpoints("run", include_deleted="x"),
                                        "include_deleted must be"),
    "checkpoints policy_version='1'": (lambda reg, tmp: reg.checkpoints("run", policy_version="1"), "invalid step"),
    "events step='1'": (lambda reg, tmp: reg.events("run", step="1"), "invalid step"),
    "events run='../x'": (lambda reg, tmp: reg.events("../x"), "invalid run name"),
    "search_runs where=5": (lambda reg, tmp: reg.search_runs(where=5), "must be text"),
    "checkout ttl=5": (lambda reg, tmp: reg.checkout("run@1", tmp / "co", ttl=5), "ttl must be a timedelta >= 0"),
    "checkout ttl<0": (lambda reg, tmp: reg.checkout("run@1", tmp / "co", ttl=timedelta(days=-1)),
                       "ttl must be a timedelta >= 0"),
    "descendants forks_only='x'": (lambda reg, tmp: reg.descendants("run@1", forks_only="x"), "forks_only must be"),
    "add_webhook url=5": (lambda reg, tmp: reg.add_webhook(5), "a webhook URL is text"),
    "webhook_log limit=-5": (lambda reg, tmp: reg.webhook_log(limit=-5), "limit must be"),
    "import_checkpoint ''": (lambda reg, tmp: reg.import_checkpoint("", run="imp", step=1),
                             "import source must name a directory"),
    "diff values='x'": (lambda reg, tmp: reg.diff("run@1", "run@1", values="x"), "values must be True or False"),
    "Checkpoint.save ''": (lambda reg, tmp: reg.load("run@1").save(""), "save_dir must name a directory"),
    "Checkpoint.save max_shard_size=-1": (lambda reg, tmp: reg.load("run@1").save(tmp / "co", max_shard_size=-1),
                                          "max_shard_size must be a positive"),
    "Checkpoint.load ''": (lambda reg, tmp: Checkpoint.load(""), "save_dir must name a directory"),
    "Checkpoint.load 5": (lambda reg, tmp: Checkpoint.load(5), "save_dir must name a directory"),
    "Checkpoint.load verify_checksums='x'": (lambda reg, tmp: Checkpoint.load(reg.resolve("run@1").path,
                                                                              verify_checksums="x"),
                                             "verify_checksums must be True or False"),
    "publish timeout=-1": (lambda reg, tmp: reg.publish("run", 2, make_state(2), timeout=-1), "timeout must be"),
    "publish_files ''": (lambda reg, tmp: reg.publish_files("", run="pf", step=1, files=["model.safetensors"]),
                         "publish_files source must name a directory"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_a_call_given_the_wrong_kind_of_value_is_refused_in_one_line(reg: Registry, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     name: str) -> None:
    reg.publish("run", 1, make_state(1), metrics={"loss": 1.0})
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # where '' would have pointed
    call, says = BAD_CALLS[name]
    before = [(i.step, i.status, i.manifest_sha256) for r in reg.runs() for i in reg.checkpoints(r.name)]
    with pytest.raises(RegistryError, match=says) as raised:
        call(reg, tmp_path)
    assert "\n" not in str(raised.value)
    assert [(i.step, i.status, i.manifest_sha256) for r in reg.runs() for i in reg.checkpoints(r.name)] == before
    assert not (tmp_path / "co").exists() and list((tmp_path / "cwd").iterdir()) == []


def test_a_lease_ttl_that_is_no_duration_is_refused_at_open(tmp_path: Path) -> None:
    for ttl in (timedelta(seconds=-1), 30):
        with pytest.raises(InvalidStateError, match="lease_ttl must be a timedelta >= 0"):
            Registry.open(root=tmp_path / "r", lease_ttl=ttl)  # type: ignore[arg-type]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("options", "says"), [
    ({"root": ""}, "root must be a directory or an s3:// URL"), ({"root": 5}, "root must be a directory"),
    ({"durable": 5}, "durable must be a directory or an s3:// URL"), ({"create": "x"}, "create must be True or"),
    ({"read_only": "no"}, "read_only must be True or False"), ({"migrate": 1}, "migrate must be True or False"),
])
def test_open_refuses_options_of_the_wrong_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                options: dict[str, object], says: str) -> None:
    """root='' would be the current directory: a catalog and a root were made there."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidStateError, match=says) as raised:
        Registry.open(**{"root": tmp_path / "r", **options})  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)
    assert list(tmp_path.iterdir()) == []
