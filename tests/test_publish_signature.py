"""``Registry.publish`` has one list of options: the implementation's keywords, which ``PublishOptions`` (what its
typing overloads take) must name with the same types, so the overloads cannot drift from what publish accepts."""

from __future__ import annotations

import inspect
from typing import ForwardRef

from registry.api import PublishOptions, Registry


def annotation(value: object) -> str:
    return value.__forward_arg__ if isinstance(value, ForwardRef) else str(value)


def test_publish_options_are_the_implementations_keyword_options() -> None:
    implementation = inspect.signature(Registry.publish)  # the overloads are typing's alone
    options = {name: p for name, p in implementation.parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "blocking"}
    typed = {name: annotation(value) for name, value in PublishOptions.__annotations__.items()}
    assert set(options) == set(typed)
    assert {name: annotation(p.annotation) for name, p in options.items()} == typed
    assert not PublishOptions.__required_keys__  # every option has a default
    assert all(p.default is not inspect.Parameter.empty for p in options.values())
