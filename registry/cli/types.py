"""The command line's numeric option types: whole numbers and byte sizes, read by :mod:`registry.format.numbers`.

A value that does not parse, or is out of range, is click's usage error
(exit 2) with the parser's one-line message, never a traceback.
"""

from __future__ import annotations

from typing import Any

import click

from registry.errors import InvalidNumberError
from registry.format.numbers import MAX_INT, parse_int, parse_size


class Count(click.ParamType):
    """A whole number of ASCII digits in ``[minimum, maximum]``."""

    name = "integer"

    def __init__(self, *, minimum: int = 0, maximum: int = MAX_INT) -> None:
        self.minimum = minimum
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):  # a default
            return value
        try:
            return parse_int(str(value), minimum=self.minimum, maximum=self.maximum)
        except InvalidNumberError as exc:
            self.fail(str(exc), param, ctx)

    def __repr__(self) -> str:
        return f"Count(minimum={self.minimum}, maximum={self.maximum})"


class Size(click.ParamType):
    """A byte size: ``123``, ``500MB``, ``1.5GiB``."""

    name = "size"

    def __init__(self, *, minimum: int = 0) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return parse_size(str(value), minimum=self.minimum)
        except InvalidNumberError as exc:
            self.fail(str(exc), param, ctx)


__all__ = ["Count", "Size"]
