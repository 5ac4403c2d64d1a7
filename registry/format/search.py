"""The grammar of a search of runs: conditions, sort keys and columns over parameters and metrics.

The command line (``registry runs --where/--sort/--columns``), :meth:`Registry.search_runs` and the web
view's runs table all read it. A field is a run parameter, ``params.KEY`` (a flattened key such as
``params.optimizer.lr``), or a metric of the run's live (published or verified) checkpoints:

- ``KEY:min`` / ``KEY:max``: the lowest (highest) value at a live checkpoint, and that step: the step
  ``RUN@best:KEY[:max]`` names. A point logged at a step without a live checkpoint does not count.
- ``KEY:last``: the value at the newest live checkpoint that has one, and that step.
- ``KEY`` alone is ``KEY:min``, as ``RUN@best:KEY`` is.

- ``where``: conditions ``FIELD OP VALUE`` joined by ``and`` (or commas), with OP one of
  ``< <= > >= = !=``. VALUE is a number, ``true``, ``false``, ``null``, a
  quoted string (``'adamw'``) or a bare word (``adamw``, taken as a string).
  Metrics compare with numbers only; ``< <= > >=`` compare numbers only. A run
  without the field matches no condition on it, ``!=`` included.
- ``sort``: fields separated by commas, best first: ``KEY:max`` highest first,
  everything else lowest first; a leading ``-`` turns one round. Runs without
  the value come last either way; ties go by run name.
- ``columns``: fields separated by commas.

It is parsed by hand into values that are bound as SQL parameters, never
evaluated; anything else is an :class:`InvalidQueryError` naming the part.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from registry.errors import InvalidQueryError
from registry.format.refs import METRIC_KEY_RE

Summary = Literal["min", "max", "last"]
Value = float | str | bool | None

PARAMS = "params."
SUMMARIES: tuple[Summary, ...] = ("min", "max", "last")
OPERATORS = ("<=", ">=", "!=", "=", "<", ">")
MAX_TEXT = 4096  # characters of one where, sort or columns text
MAX_CLAUSES = 32
MAX_FIELDS = 32
MAX_KEY = 255

_TOKEN = re.compile(r"""\s*(?:(?P<op><=|>=|!=|==|=|<|>)|(?P<comma>,)|(?P<quoted>'[^']*'|"[^"]*")"""
                    r"""|(?P<word>[^\s<>=!'",]+))""")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_PARAM_KEY = re.compile(r"[^\s<>=!'\",]+")


@dataclass(frozen=True)
class Field:
    """``params.KEY`` (``summary`` None) or ``KEY:min|max|last`` of a metric at the run's live checkpoints."""

    key: str
    summary: Summary | None = None

    @property
    def is_param(self) -> bool:
        return self.summary is None

    @property
    def spec(self) -> str:
        """The field as it is written, and the key of its column in a found run's ``values``."""
        return PARAMS + self.key if self.summary is None else f"{self.key}:{self.summary}"


@dataclass(frozen=True)
class Clause:
    field: Field
    op: str  # one of OPERATORS ("==" is read as "=")
    value: Value

    def __str__(self) -> str:
        value = "null" if self.value is None else str(self.value).lower() if isinstance(self.value, bool) \
            else f"{self.value:g}" if isinstance(self.value, float) else repr(self.value)
        return f"{self.field.spec} {self.op} {value}"


@dataclass(frozen=True)
class SortKey:
    field: Field
    descending: bool

    def __str__(self) -> str:
        return ("-" if self.descending != (self.field.summary == "max") else "") + self.field.spec


@dataclass(frozen=True)
class Search:
    """A parsed search: what to keep, in what order, with which columns."""

    where: tuple[Clause, ...] = ()
    sort: tuple[SortKey, ...] = ()
    columns: tuple[Field, ...] = ()


def parse_search(where: str | Sequence[str] | None = None, sort: str | Sequence[str] | None = None,
                 columns: str | Sequence[str] | None = None) -> Search:
    """``where``, ``sort`` and ``columns`` as the command line and :meth:`Registry.search_runs` take them.

    Without ``columns``, the fields the conditions and the sort name are the columns.
    """
    clauses = parse_where(where) if where else ()
    keys = parse_sort(sort) if sort else ()
    shown = parse_columns(columns) if columns else ()
    if not shown:
        shown = tuple(dict.fromkeys([*(c.field for c in clauses), *(k.field for k in keys)]))
    return Search(where=clauses, sort=keys, columns=shown)


def parse_field(text: str) -> Field:
    """``params.KEY``, ``KEY:min|max|last``, or ``KEY`` (read as ``KEY:min``, as ``RUN@best:KEY`` ranks)."""
    text = text.strip()
    if text.startswith(PARAMS):
        key = text[len(PARAMS):]
        if not key or len(key) > MAX_KEY or not _PARAM_KEY.fullmatch(key):
            raise InvalidQueryError(f"invalid field {_shown(text)}: expected params.KEY, KEY without spaces, "
                                    "quotes, commas or < > = !")
        return Field(key)
    key, colon, summary = text.rpartition(":")
    if colon and METRIC_KEY_RE.fullmatch(key) and summary in SUMMARIES:
        return Field(key, summary)
    if colon and METRIC_KEY_RE.fullmatch(key):
        raise InvalidQueryError(f"invalid field {_shown(text)}: a metric is summarised as {key}:min, {key}:max "
                                f"or {key}:last")
    if METRIC_KEY_RE.fullmatch(text):
        return Field(text, "min")
    raise InvalidQueryError(f"invalid field {_shown(text)}: expected params.KEY or METRIC[:min|:max|:last], "
                            "a METRIC of letters, digits, '_', '.', '/' or '-'")


def parse_columns(texts: str | Sequence[str]) -> tuple[Field, ...]:
    """Fields separated by commas (in one text or several), each once, in order."""
    fields = tuple(dict.fromkeys(parse_field(t) for text in _texts(texts, "columns") for t in text.split(",")
                                 if t.strip()))
    if len(fields) > MAX_FIELDS:
        raise InvalidQueryError(f"at most {MAX_FIELDS} columns, got {len(fields)}")
    return fields


def parse_sort(texts: str | Sequence[str]) -> tuple[SortKey, ...]:
    """Sort keys separated by commas: a field, best first (``KEY:max`` highest first, everything else lowest
    first), or with a leading ``-`` the other way round."""
    keys: list[SortKey] = []
    for text in _texts(texts, "sort"):
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            flip = part.startswith("-")
            field = parse_field(part.removeprefix("-"))
            keys.append(SortKey(field, (field.summary == "max") != flip))
    if len(keys) > MAX_FIELDS:
        raise InvalidQueryError(f"at most {MAX_FIELDS} sort keys, got {len(keys)}")
    return tuple(keys)


def parse_where(texts: str | Sequence[str]) -> tuple[Clause, ...]:
    """Conditions ``FIELD OP VALUE`` joined by ``and`` or commas; several texts are joined by ``and``."""
    text = " and ".join(t for t in _texts(texts, "where") if t.strip())
    if not text:
        return ()
    tokens = _tokens(text)
    clauses: list[Clause] = []
    i = 0
    while True:
        if len(tokens) - i < 3:
            rest = " ".join(t for _, t in tokens[i:])
            raise InvalidQueryError(f"cannot search by {_shown(text)}: {_shown(rest) if rest else 'nothing'} is "
                                    "not a condition FIELD OP VALUE (e.g. 'params.lr < 1e-3', "
                                    "'eval/loss:min <= 0.5')")
        (k1, field_text), (k2, op), (k3, value_text) = tokens[i:i + 3]
        if k1 != "word" or k2 != "op" or k3 not in ("word", "quoted"):
            raise InvalidQueryError(f"cannot search by {_shown(text)}: expected FIELD OP VALUE at "
                                    f"{_shown(' '.join(t for _, t in tokens[i:i + 3]))}, with OP one of "
                                    f"{' '.join(OPERATORS)}")
        field = parse_field(field_text)
        clauses.append(_clause(field, "=" if op == "==" else op, k3, value_text))
        i += 3
        if i == len(tokens):
            break
        kind, word = tokens[i]
        if kind != "comma" and (kind != "word" or word.lower() != "and"):
            hint = " (only 'and' joins conditions)" if word.lower() in ("or", "not", "(", ")") else ""
            raise InvalidQueryError(f"cannot search by {_shown(text)}: expected 'and' before {_shown(word)}{hint}")
        i += 1
        if len(clauses) >= MAX_CLAUSES:
            raise InvalidQueryError(f"at most {MAX_CLAUSES} conditions")
    return tuple(clauses)


def _clause(field: Field, op: str, kind: str, text: str) -> Clause:
    value: Value
    if kind == "quoted":
        value = text[1:-1]
    elif _NUMBER.fullmatch(text):
        value = float(text)
    else:
        value = {"true": True, "false": False, "null": None}.get(text.lower(), text)
    shown = f"{field.spec} {op} {text}"
    if not isinstance(value, float) or isinstance(value, bool):
        if not field.is_param:
            raise InvalidQueryError(f"cannot search by {_shown(shown)}: a metric compares with a number")
        if op not in ("=", "!="):
            raise InvalidQueryError(f"cannot search by {_shown(shown)}: {op} compares numbers; "
                                    "text, true, false and null compare with = or !=")
    elif value in (float("inf"), float("-inf")):
        raise InvalidQueryError(f"cannot search by {_shown(shown)}: the number is out of range")
    return Clause(field, op, value)


def _tokens(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise InvalidQueryError(f"cannot search by {_shown(text)}: unexpected {_shown(text[pos:].strip()[:20])}"
                                    " (an unclosed quote?)")
        kind = match.lastgroup
        assert kind is not None
        tokens.append((kind, match[kind]))
        pos = match.end()
    return tokens


def _texts(texts: str | Sequence[str], what: str) -> list[str]:
    """The texts given (one, or several), each checked: not too long, no control characters."""
    if not isinstance(texts, (str, list, tuple)):
        raise InvalidQueryError(f"{what} must be text or a list of texts, got {type(texts).__name__}")
    given = [texts] if isinstance(texts, str) else list(texts)
    for text in given:
        if not isinstance(text, str):
            raise InvalidQueryError(f"{what} must be text, got {type(text).__name__}")
        if len(text) > MAX_TEXT:
            raise InvalidQueryError(f"{what} is {len(text)} characters long, more than {MAX_TEXT}")
        if any(ord(ch) < 32 and ch not in "\t\n" or ord(ch) == 127 for ch in text):
            raise InvalidQueryError(f"{what} {_shown(text)} holds a control character")
    return given


def _shown(text: str) -> str:
    """``text`` quoted for a one-line message, clipped."""
    text = " ".join(text.split())
    return repr(text if len(text) <= 80 else text[:77] + "...")


__all__ = ["OPERATORS", "PARAMS", "SUMMARIES", "Clause", "Field", "Search", "SortKey", "parse_columns",
           "parse_field", "parse_search", "parse_sort", "parse_where"]
