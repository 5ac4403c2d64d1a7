"""A run's parameters as the catalog keeps them: flattened keys, JSON values, numbers where they are numbers.

``{"optimizer": {"lr": 1e-3, "betas": [0.9, 0.99]}, "batch": 32}`` is kept as
``optimizer.lr = 0.001``, ``optimizer.betas = [0.9, 0.99]`` and
``batch = 32``: nested mappings are flattened with dots (an empty one is kept
as ``{}``), anything else is one value. A value is what JSON holds (None,
booleans, finite numbers, strings, lists and mappings of those); a number
(not a boolean) is also kept as a number, which is what a search compares.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

from registry.errors import InvalidStateError

MAX_KEY = 255  # the catalog's column
MAX_VALUE = 65536  # characters of one value's JSON: parameters, not data


def flatten_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` flattened and checked; ``InvalidStateError`` names the first key that cannot be kept."""
    if not isinstance(params, Mapping):
        raise InvalidStateError(f"params must be a mapping of names to values, got {type(params).__name__}")
    flat: dict[str, Any] = {}
    _flatten(params, "", flat, strict=True)
    return flat


def json_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The part of a framework's hyperparameters that can be kept (see :func:`flatten_params`), flattened;
    values JSON cannot hold (modules, dtypes, NaN) are left out rather than refused."""
    flat: dict[str, Any] = {}
    if isinstance(params, Mapping):
        _flatten(params, "", flat, strict=False)
    return flat


def encode(value: Any) -> str:
    """A checked value as the catalog stores it (and as a search compares it for equality)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def number_of(value: Any) -> float | None:
    """The value as a number where it is one (a boolean is not), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _flatten(params: Mapping[Any, Any], prefix: str, flat: dict[str, Any], *, strict: bool) -> None:
    for key, value in params.items():
        if not isinstance(key, str) or not key or any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
            if strict:
                raise InvalidStateError(f"invalid param name {prefix}{key!r}: use non-empty text without "
                                        "control characters")
            continue
        name = prefix + key
        if isinstance(value, Mapping) and value:
            _flatten(value, name + ".", flat, strict=strict)
            continue
        if len(name) > MAX_KEY:
            if strict:
                raise InvalidStateError(f"param name {name[:40]!r}... is longer than {MAX_KEY} characters")
            continue
        try:
            checked = _json_value(value)
            size = len(encode(checked))
        except (TypeError, ValueError) as exc:
            if strict:
                raise InvalidStateError(f"param {name!r}: {exc}") from None
            continue
        if size > MAX_VALUE:
            if strict:
                raise InvalidStateError(f"param {name!r}: its value is {size} characters of JSON, more than "
                                        f"{MAX_VALUE}; keep data elsewhere")
            continue
        flat[name] = checked


def _json_value(value: Any) -> Any:
    """``value`` as plain JSON types (numpy scalars become numbers, tuples lists); TypeError or ValueError
    where JSON cannot hold it."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"{number} is not a finite number")
        return number
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a mapping inside a value must have text keys")
        return {k: _json_value(v) for k, v in value.items()}
    raise TypeError(f"a {type(value).__name__} is not a JSON value (None, bool, number, text, list, mapping)")


__all__ = ["MAX_KEY", "MAX_VALUE", "encode", "flatten_params", "json_params", "number_of"]
