"""Numbers typed by people: counts and byte sizes from options, query strings and policy text.

The one parser behind the command line's numeric options, the web view's
queries and retention policy text. It reads ASCII digits only (``str.isdigit``
accepts ``²`` and ``int`` accepts ``١٢``), refuses more digits than the bound
allows before converting (Python refuses to convert past 4300 digits), computes
sizes in integers (a float of 400 digits is ``inf``), and fails with one short
line that quotes at most the start of what it was given.
"""

from __future__ import annotations

import re

from registry.errors import InvalidNumberError

MAX_INT = 2**63 - 1  # what the catalog's 64-bit columns hold: steps, byte counts
SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
              "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
MAX_FRACTION_DIGITS = 12  # below a byte of a TiB; more says nothing

_INT_RE = re.compile(r"([+-]?)([0-9]+)", re.ASCII)
_SIZE_RE = re.compile(r"([0-9]+)(?:\.([0-9]+))?\s*([A-Za-z]*)", re.ASCII)
_SHOWN = 40


def shown(text: str) -> str:
    """``text`` quoted for a message, cut short when long: ``'99999...' (5000 characters)``."""
    if len(text) <= _SHOWN:
        return repr(text)
    return f"{text[:_SHOWN]!r}... ({len(text)} characters)"


def _too_many_digits(digits: str, bound: int) -> bool:
    return len(digits.lstrip("0")) > len(str(abs(bound)))


def parse_int(text: str, *, what: str | None = None, minimum: int = 0, maximum: int = MAX_INT) -> int:
    """``"42"`` -> 42: a whole number of ASCII digits (an optional sign), ``minimum <= n <= maximum``.

    Anything else raises :class:`~registry.errors.InvalidNumberError`;
    ``what`` names the value in its message (``keep-last '²' is not ...``).
    """
    label = f"{what} " if what else ""
    match = _INT_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise InvalidNumberError(f"{label}{shown(str(text))} is not a whole number (digits 0-9)")
    sign, digits = match.groups()
    negative = sign == "-" and digits.strip("0") != ""
    if _too_many_digits(digits, minimum if negative else maximum):
        bound = f"at least {minimum}" if negative else f"at most {maximum}"
        raise InvalidNumberError(f"{label}{shown(text.strip())} is out of range: {bound}")
    value = -int(digits) if negative else int(digits)
    if value < minimum:
        raise InvalidNumberError(f"{label}{value} is too small: at least {minimum}")
    if value > maximum:
        raise InvalidNumberError(f"{label}{value} is too large: at most {maximum}")
    return value


def parse_size(text: str, *, what: str | None = None, minimum: int = 0, maximum: int = MAX_INT) -> int:
    """``10G``, ``1.5GB``, ``500MiB``, ``123`` -> bytes (decimal units, ``*iB`` binary), ``minimum <= n <= maximum``.

    Anything else raises :class:`~registry.errors.InvalidNumberError`.
    """
    label = f"{what} " if what else ""
    match = _SIZE_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or match.group(3).lower() not in SIZE_UNITS:
        raise InvalidNumberError(f"{label}{shown(str(text))} is not a size like 500M, 10G or 2TiB")
    whole, fraction, unit = match.group(1), match.group(2) or "", SIZE_UNITS[match.group(3).lower()]
    if len(fraction) > MAX_FRACTION_DIGITS:
        raise InvalidNumberError(f"{label}{shown(text.strip())} has more than {MAX_FRACTION_DIGITS} decimals")
    if _too_many_digits(whole, maximum):
        raise InvalidNumberError(f"{label}{shown(text.strip())} is out of range: at most {maximum} bytes")
    scale = 10 ** len(fraction)
    value = (int(whole) * scale + int(fraction or "0")) * unit // scale
    if value < minimum:
        raise InvalidNumberError(f"{label}{shown(text.strip())} is too small: at least {minimum} bytes")
    if value > maximum:
        raise InvalidNumberError(f"{label}{shown(text.strip())} is too large: at most {maximum} bytes")
    return value


__all__ = ["MAX_INT", "SIZE_UNITS", "parse_int", "parse_size", "shown"]
