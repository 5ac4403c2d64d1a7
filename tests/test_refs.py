from __future__ import annotations

import re

import pytest

from registry import InvalidRefError, Registry
from registry.errors import CheckpointNotFoundError, InvalidNameError
from registry.format.refs import check_run_name, check_step, check_tag_name, parse_ref
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
