from __future__ import annotations

import html
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from registry import InvalidRefError, Registry
from registry.errors import CheckpointNotFoundError, InvalidNameError
from registry.format.refs import check_run_name, check_step, check_tag_name, missing_tag, parse_ref, selector_hint
from tests.helpers import make_state


@pytest.mark.parametrize("text,kind,extra", [
    ("run", "latest", {}),
    ("run@latest", "latest", {}),
    ("run@latest-published", "latest-published", {}),
    ("run@1000", "step", {"step": 1000}),
    ("run@0", "step", {"step": 0}),
    ("run@best:eval/loss", "best", {"metric": "eval/loss", "mode": "min"}),
    ("run@best:eval/loss:min", "best", {"metric": "eval/loss", "mode": "min"}),
    ("run@best:acc:max", "best", {"metric": "acc", "mode": "max"}),
    ("run@release", "tag", {"tag": "release"}),
    ("my.run-2_b@best-eval", "tag", {"tag": "best-eval"}),
])
def test_parse_every_ref_form(text: str, kind: str, extra: dict[str, object]) -> None:
    ref = parse_ref(text)
    assert ref.kind == kind
    for key, value in extra.items():
        assert getattr(ref, key) == value
    assert parse_ref(str(ref)) == ref


@pytest.mark.parametrize("text", [
    "", "@latest", "run@", "-run", "run@best:", "run@best:a:b:c", "run@a@b", "run@la:test",
    "r" * 129, "run@best:eval loss", "ru n", "run@-1", 42, None,
])
def test_bad_refs_are_rejected(text: object) -> None:
    with pytest.raises(InvalidRefError):
        parse_ref(text)


@pytest.mark.parametrize("name", ["123", "latest", "latest-published", "a@b", "a:b", "", "-x", "a b"])
def test_reserved_and_invalid_tag_names(name: str) -> None:
    with pytest.raises(InvalidNameError):
        check_tag_name(name)


def test_run_names_and_steps() -> None:
    assert check_run_name("A.b-c_9") == "A.b-c_9"
    for bad in ("", ".hidden", "a/b", "../x", "a" * 129, "x\x00"):
        with pytest.raises(InvalidNameError):
            check_run_name(bad)
    assert check_step(0) == 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidNameError):
            check_step(bad)


@pytest.mark.parametrize(("ref", "intent"), [("run@lastest", "run@latest"), ("run@best", "run@best:METRIC"),
                                             ("run@latest-publish", "run@latest-published"),
                                             ("run@Latest", "run@latest"), ("new@lastest", "new@latest")])
def test_a_misspelt_keyword_is_an_invalid_ref_never_nothing_yet(reg: Registry, ref: str, intent: str) -> None:
    """A trainer that resumes with ``except CheckpointNotFoundError: start fresh`` must not start over on a typo."""
    reg.publish("run", 1, make_state(1))
    for call in (reg.load, reg.resolve):
        with pytest.raises(InvalidRefError, match=f"did you mean {re.escape(intent)}") as info:
            call(ref)
        assert not isinstance(info.value, CheckpointNotFoundError) and "\n" not in str(info.value)
    if ref == "run@best":  # a tag of that name is a tag like any other
        reg.tag("run", 1, "best")
        assert reg.resolve("run@best").step == 1


# ---------------------------------------------------------------------- a typo, wherever a ref is taken

TYPOS = [("run@lastest", "run@latest"), ("run@best", "run@best:METRIC"), ("run@latest-publish", "run@latest-published"),
         ("run@Latest", "run@latest"), ("run@lastet", "run@latest"), ("run@latest-verified", "run@latest")]


def published_run(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    reg.publish("run", 2, make_state(2))
    reg.tag("run", 1, "release")
    reg.tag("run", 2, "test")


def test_a_typo_is_never_a_checkpoint_not_found() -> None:
    """``except CheckpointNotFoundError: start fresh`` (the Quickstart's resume) must let a typo through."""
    assert not issubclass(InvalidRefError, CheckpointNotFoundError)
    assert not issubclass(CheckpointNotFoundError, InvalidRefError)


@pytest.mark.parametrize(("ref", "intent"), TYPOS)
def test_every_python_entry_point_names_the_intent(reg: Registry, tmp_path: Path, ref: str, intent: str) -> None:
    published_run(reg)
    calls: dict[str, Callable[[], object]] = {
        "load": lambda: reg.load(ref), "resolve": lambda: reg.resolve(ref),
        "checkout": lambda: reg.checkout(ref, tmp_path / "co"), "export": lambda: reg.export(ref, tmp_path / "ex"),
        "diff": lambda: reg.diff("run@1", ref), "diff first": lambda: reg.diff(ref, "run@1"),
        "verify": lambda: reg.verify(ref), "lineage": lambda: reg.lineage(ref),
        "load_into": lambda: reg.load_into(ref, {}), "broadcast load": lambda: reg.load(ref, broadcast=True),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidRefError) as info:
            call()
        message = str(info.value)
        assert f"did you mean {intent}?" in message and "\n" not in message, name
    assert not (tmp_path / "co").exists() and not (tmp_path / "ex").exists()


def test_the_quickstart_resume_idiom_does_not_start_over_on_a_typo(reg: Registry) -> None:
    published_run(reg)

    def resume(ref: str) -> int | None:
        try:
            return reg.load(ref).step
        except CheckpointNotFoundError:
            return 0  # a new run
    assert resume("run@latest") == 2 and resume("fresh@latest") == 0
    with pytest.raises(InvalidRefError, match=r"did you mean run@latest\?"):
        resume("run@lastest")
    with pytest.raises(InvalidRefError, match=r"did you mean fresh@latest\?"):
        resume("fresh@lastest")  # no such run either: still the typo, not "nothing yet"


@pytest.mark.parametrize(("ref", "hint"), [
    ("run@relese", "did you mean run@release?"),  # close to a tag of the run
    ("run@Release", "did you mean run@release?"),  # tags are case-sensitive
    ("run@Test", "did you mean run@test?"),  # an existing tag closer than the keyword it also resembles
    ("run@publishd", "did you mean run@latest-published?"),  # near a keyword, not a misspelling of it
    ("run@durable", "did you mean run@latest-durable?"),
    ("run@best-loss", "did you mean run@best:loss?"),
    ("run@nightly", None),  # near nothing: nothing suggested
])
def test_a_missing_tag_says_what_it_is_near(reg: Registry, ref: str, hint: str | None) -> None:
    published_run(reg)
    with pytest.raises(CheckpointNotFoundError) as info:
        reg.resolve(ref)
    message = str(info.value)
    assert not isinstance(info.value, InvalidRefError) and f"no tag {ref.partition('@')[2]!r}" in message
    if hint is None:
        assert "did you mean" not in message
    else:
        assert message.endswith(hint), message


def test_a_tag_that_exists_is_a_tag_whatever_it_looks_like(reg: Registry) -> None:
    reg.publish("run", 1, make_state(1))
    for name in ("lastest", "Latest", "latest-verified", "best-loss"):
        reg.tag("run", 1, name)
        assert reg.resolve(f"run@{name}").step == 1


def test_missing_tag_weighs_the_keyword_against_the_run_tags() -> None:
    assert missing_tag("r", "lastest", []) == (True, "did you mean r@latest?")
    assert missing_tag("r", "LATEST", ["release"]) == (True, "did you mean r@latest?")
    assert missing_tag("r", "bets", []) == (True, "did you mean r@best:METRIC?")  # a transposition
    assert missing_tag("r", "lastest", ["lastest2"]) == (False, "did you mean r@lastest2?")
    assert missing_tag("r", "relese", ["release", "test"]) == (False, "did you mean r@release?")
    assert missing_tag("r", "bestloss", []) == (False, "did you mean r@best:loss?")
    assert missing_tag("r", "nightly", ["release"]) == (False, None)
    assert selector_hint("r", "latest:published") == "did you mean r@latest-published?"


def test_the_cli_prints_one_line_and_exits_1(reg: Registry, cli, tmp_path: Path) -> None:
    published_run(reg)
    for args in (["resolve", "run@lastest"], ["show", "run@lastest"], ["show", "run@lastest", "--json"],
                 ["checkout", "run@lastest", str(tmp_path / "co")], ["export", "run@lastest", str(tmp_path / "ex")],
                 ["diff", "run@1", "run@lastest"], ["verify", "run@lastest"], ["lineage", "run@lastest"]):
        result = cli(*args)
        assert result.exit_code == 1, (args, result.output)
        assert result.output.count("\n") == 1, (args, result.output)
        assert result.output.startswith("registry: error: invalid ref 'run@lastest'"), (args, result.output)
        assert result.output.rstrip().endswith("did you mean run@latest?"), (args, result.output)
    result = cli("show", "run@relese")
    assert result.exit_code == 1 and result.output == ("registry: error: run@relese: no tag 'relese'; "
                                                       "did you mean run@release?\n")


def test_the_web_view_answers_4xx_with_the_message(reg: Registry) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from registry.web import create_app
    published_run(reg)
    client = TestClient(create_app(reg), base_url="http://127.0.0.1:8765")
    typo = "invalid ref 'run@lastest': no tag 'lastest'; did you mean run@latest?"
    for url in ("/api/show?ref=run@lastest", "/api/diff?a=run@1&b=run@lastest"):
        response = client.get(url)
        assert response.status_code == 400 and response.json() == {"error": typo}, url
    response = client.get("/api/show?ref=run@relese")
    assert response.status_code == 404
    assert response.json() == {"error": "run@relese: no tag 'relese'; did you mean run@release?"}
    for url in ("/diff?a=run@1&b=run@lastest", "/runs/run@lastest"):  # pages: the same line, escaped
        response = client.get(url, follow_redirects=False)
        assert response.status_code == 400 and html.escape(typo) in response.text, url
    assert client.get("/runs/run@relese", follow_redirects=False).status_code == 404
    response = client.get("/runs/run@release", follow_redirects=False)  # a good ref in a run's place: its step
    assert response.status_code == 303 and response.headers["location"] == "/runs/run/steps/1"


def test_the_resume_helpers_refuse_a_typo(reg: Registry, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    from registry.integrations.lightning import RegistryCheckpoint
    from registry.integrations.transformers import RegistryCallback

    published_run(reg)
    for run in ("run", "fresh"):  # a run with steps, and one with none: a typo never starts fresh
        with pytest.raises(InvalidRefError, match=rf"did you mean {run}@latest\?"):
            RegistryCallback(reg, run).resume_from(f"{run}@lastest", dest=tmp_path / run)
        for ref in (f"{run}@lastest", f"registry:{run}@lastest"):
            with pytest.raises(InvalidRefError, match=rf"did you mean {run}@latest\?"):
                RegistryCheckpoint(reg, run).resume_path(ref)
        with pytest.raises(InvalidRefError, match=rf"did you mean {run}@best:METRIC\?"):
            RegistryCheckpoint(reg, run).resume_path(f"{run}@best:")
    with pytest.raises(CheckpointNotFoundError, match=r"did you mean run@release\?"):
        RegistryCheckpoint(reg, "run").resume_path("run@relese")
    with pytest.raises(CheckpointNotFoundError, match=r"did you mean run@release\?"):
        RegistryCallback(reg, "run").resume_from("run@relese", dest=tmp_path / "co")
    assert RegistryCheckpoint(reg, "run").resume_path("run@release") == "registry:run@release"
    assert RegistryCheckpoint(reg, "fresh").resume_path() is None  # no step yet, no ref: a fresh start
