"""The one root interface: each kind says what it can do, refuses the rest in one line, and a host new to a
durable tier is a first-class case. Real SeaweedFS, both catalog backends."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from registry import Registry
from registry.errors import InvalidStateError, RegistryError, RootError
from registry.roots.base import REFUSALS, Capabilities
from tests.helpers import assert_state_equal, make_state


def sqlite_url(tmp_path: Path, name: str) -> str:
    return f"sqlite:///{tmp_path / name}.db"


def exported(tmp_path: Path) -> Path:
    """A checkpoint directory written by another registry, to import."""
    source = tmp_path / "source"
    with Registry.open(sqlite_url(tmp_path, "elsewhere"), root=tmp_path / "elsewhere") as local:
        local.publish("src", 1, make_state(4))
        local.export("src@1", source)
    return source


def test_each_kind_says_what_it_can_do(tmp_path: Path, s3_root: str) -> None:
    with Registry.open(sqlite_url(tmp_path, "plain"), root=tmp_path / "plain") as plain:
        assert plain.root.kind == "directory" and plain.root_url == str(tmp_path / "plain")
        assert plain.root.can == Capabilities(links=True, sharded=True, local_import=True, directories=True)
        assert plain.tiers is None and plain.objects is None
    with Registry.open(sqlite_url(tmp_path, "objects"), root=s3_root) as objects:
        assert objects.root.kind == "s3" and objects.root_url == s3_root
        assert objects.root.can.names() == ("sharded",)
    with Registry.open(sqlite_url(tmp_path, "tiered"), root=tmp_path / "fast", durable=f"{s3_root}-tier") as tiered:
        assert tiered.root.kind == "tiered" and tiered.root_url == str(tmp_path / "fast")
        assert tiered.root.can.tiers and tiered.tiers is not None and tiered.objects is None


def test_what_a_root_cannot_do_is_refused_in_one_line_before_anything_is_written(
        catalog_url: str, s3_root: str, tmp_path: Path) -> None:
    source = exported(tmp_path)
    with Registry.open(catalog_url, root=s3_root) as reg:
        refused: list[tuple[type[Exception], str]] = []
        for call in (lambda: reg.publish("run", 1, make_state(1), dedup=True),
                     lambda: reg.import_checkpoint(source, run="run", step=1),
                     lambda: reg.store,
                     lambda: reg.replicate(),
                     lambda: reg.plan_tier_retention("run", None)):  # type: ignore[arg-type]
            with pytest.raises(RegistryError) as info:
                call()
            message = str(info.value)
            assert "\n" not in message and s3_root in message, message
            refused.append((type(info.value), message))
        assert reg.runs() == []
    assert {cls for cls, _ in refused} <= {cls for cls, _ in REFUSALS.values()} | {InvalidStateError, RootError}


def test_a_new_host_joins_a_durable_tier_with_create_false(catalog_url: str, s3_root: str, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with Registry.open(catalog_url, root=tmp_path / "host-a", durable=s3_root) as a:
        a.publish("run", 1, make_state(1), durable=True)
    (tmp_path / "host-c").mkdir()  # an empty fast directory: a mount point made by the job's launcher
    for host in ("host-b", "host-c"):
        caplog.clear()
        with (caplog.at_level(logging.WARNING, logger="registry"),
              Registry.open(catalog_url, root=tmp_path / host, durable=s3_root, create=False) as reg):
            assert_state_equal(reg.load("run@1").state_dict, make_state(1))
            reg.publish("run", 2 if host == "host-b" else 3, make_state(2), durable=True)
        made = [r.getMessage() for r in caplog.records if "created a new fast tier directory" in r.getMessage()]
        assert len(made) == (1 if host == "host-b" else 0), made  # host-c's directory was there already


def test_create_false_still_refuses_a_catalog_that_does_not_exist_and_leaves_no_directory(
        s3_root: str, tmp_path: Path) -> None:
    missing = f"sqlite:///{tmp_path / 'nowhere' / 'catalog.db'}"
    with pytest.raises(RegistryError):
        Registry.open(missing, root=tmp_path / "host-b", durable=s3_root, create=False)
    assert not (tmp_path / "host-b").exists()


def test_an_import_on_a_tiered_root_records_its_fast_copy_and_is_replicated(
        catalog_url: str, s3_root: str, tmp_path: Path) -> None:
    source = exported(tmp_path)
    with Registry.open(catalog_url, root=tmp_path / "host-a", durable=s3_root) as reg:
        info = reg.import_checkpoint(source, run="run", step=7)
        assert reg.tiers is not None
        here = [c for c in reg.replicas("run", 7) if c.location == reg.tiers.location]
        assert [(c.path, c.manifest_sha256) for c in here] == [("run/step-00000007", info.manifest_sha256)]
        assert reg.wait_durable("run", 7, timeout=60).manifest_sha256 == info.manifest_sha256


ROLL_FORWARD_CHILD = """
import sys, torch
from registry import Registry
with Registry.open(sys.argv[1], root=sys.argv[2], durable=sys.argv[3]) as reg:
    reg.publish("run", 1, {"w": torch.full((8,), 1.0)})
"""


def test_fsck_rolls_a_killed_publish_forward_with_its_fast_copy_on_record_and_it_is_replicated(
        catalog_url: str, s3_root: str, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    import torch

    from tests.helpers import child_env
    host_a = tmp_path / "host-a"
    done = subprocess.run([sys.executable, "-c", ROLL_FORWARD_CHILD, catalog_url, str(host_a), s3_root],
                          capture_output=True, text=True, env={**child_env(), "REGISTRY_CRASH_AT": "after-rename"},
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    with Registry.open(catalog_url, root=host_a, durable=s3_root, create=False) as a:
        report = a.fsck(repair=True)
        assert "uncommitted-publish" in [p.kind for p in report.problems]
        info = a.resolve("run@1")
        assert a.tiers is not None
        here = [c for c in a.replicas("run", 1) if c.location == a.tiers.location]
        assert [(c.path, c.manifest_sha256) for c in here] == [("run/step-00000001", info.manifest_sha256)]
        a.wait_durable("run", 1, timeout=60)
    with Registry.open(catalog_url, root=tmp_path / "host-b", durable=s3_root) as b:  # another host overwrites it
        b.publish("run", 1, {"w": torch.full((8,), 2.0)}, overwrite=True, durable=True)
    with Registry.open(catalog_url, root=host_a, durable=s3_root, create=False) as a:
        assert torch.equal(a.load("run@1").state_dict["w"], torch.full((8,), 2.0))  # B's payload, from durable
        assert a.catalog.get("run", 1).status == "verified"  # type: ignore[union-attr]
        a.fsck(repair=True)
        assert a.fsck().problems == () and a.catalog.get("run", 1).status == "verified"  # type: ignore[union-attr]


def test_a_new_host_is_told_where_it_finds_a_step_and_how_to_load_it(catalog_url: str, s3_root: str,
                                                                     tmp_path: Path) -> None:
    from click.testing import CliRunner

    from registry.cli import main
    from registry.views import load_snippets
    with Registry.open(catalog_url, root=tmp_path / "host-a", durable=s3_root) as a:
        a.publish("run", 1, make_state(1), durable=True)
        here = a.resolve("run@1")
        assert here.url is None and here.path == tmp_path / "host-a" / "run" / "step-00000001"
    with Registry.open(catalog_url, root=tmp_path / "host-b", durable=s3_root) as b:
        durable = b.replicas("run", 1)
        far = b.resolve("run@1")  # no copy on this host: the durable copy, where a load reads it
        assert far.url is not None and far.url.startswith(s3_root + "/run/step-00000001/")
        assert [c.path for c in durable if c.location == "durable"] == [far.url[len(s3_root) + 1:]]
        shown = CliRunner().invoke(main, ["--url", catalog_url, "--root", str(tmp_path / "host-b"),
                                          "--durable", s3_root, "show", "run@1", "--json"])
        assert shown.exit_code == 0, shown.output
        assert '"error"' not in shown.output and '"tensors": ' in shown.output  # the manifest, read from s3
        b.load("run@1")
        cached = b.resolve("run@1")  # now this host's cached copy
        assert cached.url is None and cached.path.is_dir() and ".registry/cache" in cached.path.as_posix()
        lines = load_snippets(cached, root=b.root_url, url=catalog_url, durable=b.root.reopen().get("durable"))
        assert f"--durable {s3_root}" in lines["shell"] and f"durable={s3_root!r}" in lines["python"]


def test_a_new_host_checks_out_diffs_and_resumes_from_the_durable_tier(catalog_url: str, s3_root: str,
                                                                       tmp_path: Path) -> None:
    from registry.integrations.transformers import RegistryCallback
    with Registry.open(catalog_url, root=tmp_path / "host-a", durable=s3_root) as a:
        a.publish("run", 1, make_state(1), config={"lr": 0.1}, durable=True)
        a.publish("run", 2, make_state(2), config={"lr": 0.2}, durable=True)
    with Registry.open(catalog_url, root=tmp_path / "host-b", durable=s3_root) as b:
        with b.checkout("run@1", tmp_path / "out") as out:  # no copy here: downloaded, then copied out
            assert (out.path / "model.safetensors").is_file() and out.info.step == 1
        change = b.diff("run@1", "run@2")
        assert change.a.step == 1 and change.b.step == 2 and change.config
        resumed = RegistryCallback(b, "run").resume_from()
        assert resumed is not None and (Path(resumed) / "model.safetensors").is_file()
        assert b.catalog.get("run", 2).status == "verified"  # type: ignore[union-attr]


def test_a_read_only_open_on_a_new_host_reads_and_writes_nothing_there(catalog_url: str, s3_root: str,
                                                                       tmp_path: Path) -> None:
    from click.testing import CliRunner

    from registry.cli import main
    from registry.errors import ReadOnlyError
    with Registry.open(catalog_url, root=tmp_path / "host-a", durable=s3_root) as a:
        a.publish("run", 1, make_state(1), durable=True)
        a.publish("run", 2, make_state(2), durable=True)
    (tmp_path / "host-c").mkdir()  # an empty mount point: no tier marker yet
    for host in (tmp_path / "host-b", tmp_path / "host-c"):
        listed = CliRunner().invoke(main, ["--url", catalog_url, "--root", str(host), "--durable", s3_root,
                                           "--read-only", "ls", "run"])
        assert listed.exit_code == 0 and "verified" in listed.output, listed.output
        with Registry.open(catalog_url, root=host, durable=s3_root, read_only=True) as b:
            assert_state_equal(b.load("run@latest").state_dict, make_state(2))
            with b.checkout("run@1", tmp_path / f"out-{host.name}") as out:
                assert (out.path / "model.safetensors").is_file()
            with pytest.raises(ReadOnlyError, match="read-only"):
                b.diff("run@1", "run@2")
        assert not host.exists() or list(host.iterdir()) == []  # nothing written on this host's fast tier


def test_verify_on_a_host_holding_only_a_cached_copy_judges_the_durable_copy_not_the_cache(
        catalog_url: str, s3_root: str, tmp_path: Path) -> None:
    with Registry.open(catalog_url, root=tmp_path / "host-a", durable=s3_root) as a:
        a.publish("run", 1, make_state(1), durable=True)
    with Registry.open(catalog_url, root=tmp_path / "host-b", durable=s3_root) as b:
        b.load("run@1")  # this host now holds a cached copy, and no fast copy
        cached = b.resolve("run@1").path
        assert ".registry/cache" in cached.as_posix()
        data = bytearray((cached / "model.safetensors").read_bytes())
        data[-3] ^= 0xFF  # this host's cache is damaged; the step's stored copies are not
        (cached / "model.safetensors").write_bytes(bytes(data))
        [result] = b.verify("run@1")
        assert result.ok, result  # the durable copy was re-hashed, and it is intact
        assert b.catalog.get("run", 1).status == "verified"  # type: ignore[union-attr]
        assert not [c for c in b.replicas("run", 1) if c.status == "corrupt"]
        change = b.diff("run@1", "run@1")
        assert change.a.step == change.b.step == 1
