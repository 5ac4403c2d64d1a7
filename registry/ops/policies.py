"""Retention policies from text: sizes, ``--keep-best`` specs and policy files.

The one parser behind ``registry gc`` and the retention scripts. Retention
itself (:mod:`registry.retention`) is imported only when a policy is built,
so importing this module stays cheap for the command line.
"""

from __future__ import annotations

import re
import runpy
from collections.abc import Sequence
from typing import TYPE_CHECKING

from registry.errors import InvalidNumberError, PolicyError
from registry.format.numbers import parse_int, parse_size, shown

if TYPE_CHECKING:
    from registry.retention import Policy


def parse_keep_best(text: str) -> tuple[str, str, int]:
    """``METRIC[:max|:min]=K`` -> (metric, mode, k); ValueError (a PolicyError) otherwise."""
    metric, sep, count = text.rpartition("=")
    mode = "min"
    for suffix in (":max", ":min"):
        if metric.endswith(suffix):
            metric, mode = metric[:-len(suffix)], suffix[1:]
    try:
        k = parse_int(count, minimum=1) if sep and metric else None
    except InvalidNumberError:
        k = None
    if k is None:
        swapped = metric.isdigit() and not count.isdigit() and count
        example = f"{count}={metric}" if swapped else "eval/loss=2"
        raise PolicyError(f"{shown(text)} is not METRIC[:max]=K with K >= 1 (as in --keep-best {example})")
    return metric, mode, k


def load_policy_file(path: str) -> Policy:
    """Run a Python file and return its ``policy`` variable, which must be a retention Policy."""
    from registry.retention import Policy
    try:
        namespace = runpy.run_path(path, run_name="__registry_policy__")
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported in one line
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise PolicyError(f"cannot load policy file {path}: {type(exc).__name__}: {detail}") from None
    policy = namespace.get("policy")
    if not isinstance(policy, Policy):
        raise PolicyError(f"policy file {path} must define `policy = ...` as a registry.retention Policy, "
                          f"got {type(policy).__name__}")
    return policy


class PolicyOptionError(ValueError):
    """An option of :func:`build_policy` that does not parse; ``option`` is its keyword name."""

    def __init__(self, message: str, *, option: str) -> None:
        super().__init__(message)
        self.option = option


def build_policy(*, keep_last: int | None = None, keep_best: Sequence[str] = (), keep_every: int | None = None,
                 max_bytes: int | str | None = None, policy_file: str | None = None) -> Policy | None:
    """The union of every policy given, under a ``MaxBytes`` budget if one is; None when none is given.

    ``max_bytes`` is bytes or a size as text (``50G``). A ``keep_best`` spec
    or ``max_bytes`` text that does not parse raises
    :class:`PolicyOptionError` naming the option; a policy file that cannot
    be loaded raises :class:`~registry.errors.PolicyError`.
    """
    from registry import retention
    parts: list[Policy] = []
    if keep_last is not None:
        parts.append(retention.KeepLast(keep_last))
    for spec in keep_best:
        try:
            metric, mode, k = parse_keep_best(spec)
        except ValueError as exc:
            raise PolicyOptionError(str(exc), option="keep_best") from None
        parts.append(retention.KeepBest(k, metric, mode=mode))  # type: ignore[arg-type]
    if keep_every is not None:
        parts.append(retention.KeepEvery(keep_every))
    if policy_file is not None:
        parts.append(load_policy_file(policy_file))
    budget = None
    if isinstance(max_bytes, int):
        budget = max_bytes
    elif max_bytes is not None:
        try:
            budget = parse_size(max_bytes)
        except ValueError as exc:
            raise PolicyOptionError(str(exc), option="max_bytes") from None
    if not parts and budget is None:
        return None
    policy = retention.AnyOf(*parts) if len(parts) > 1 else (parts[0] if parts else None)
    return retention.MaxBytes(budget, keep=policy) if budget is not None else policy


POLICY_TEXT_GRAMMAR = ("keep-last N, keep-best METRIC[:max] K, keep-every N, max-bytes SIZE "
                       "(clauses separated by commas or new lines)")


def parse_policy_text(text: str) -> Policy:
    """``keep-last 3, keep-best eval/loss 2``: the ``gc`` options written as one line, built by :func:`build_policy`.

    What a person types into the web view's retention preview; each clause
    is one ``gc`` option with its value after a space (or ``=``). Anything
    else raises :class:`~registry.errors.PolicyError` naming the clause.
    """
    keep_last: int | None = None
    keep_every: int | None = None
    max_bytes: str | None = None
    keep_best: list[str] = []
    for clause in filter(None, (c.strip() for c in re.split(r"[,\n;]", text))):
        name, _, value = clause.replace("=", " ", 1).partition(" ")
        name, value = name.strip().lower().removeprefix("--"), value.strip()
        if name in ("keep-last", "keep-every") and value:
            try:
                count = parse_int(value, what=name, minimum=1)
            except InvalidNumberError as exc:
                raise PolicyError(f"cannot read policy clause: {exc}") from None
            if name == "keep-last":
                keep_last = count
            else:
                keep_every = count
        elif name == "keep-best" and len(value.split()) == 2 and not value.split()[0].isdigit():
            metric, count = value.split()
            keep_best.append(f"{metric}={count}")
        elif name == "keep-best":
            words = value.replace("=", " ").split()
            example = " ".join(reversed(words)) if len(words) == 2 and words[0].isdigit() else "eval/loss 2"
            raise PolicyError(f"cannot read policy clause {clause!r}: keep-best takes METRIC[:max] then K, "
                              f"as in keep-best {example}")
        elif name == "max-bytes" and value:
            max_bytes = value
        else:
            raise PolicyError(f"cannot read policy clause {shown(clause)}: expected {POLICY_TEXT_GRAMMAR}")
    try:
        policy = build_policy(keep_last=keep_last, keep_best=keep_best, keep_every=keep_every, max_bytes=max_bytes)
    except PolicyOptionError as exc:
        raise PolicyError(f"cannot read policy {shown(text.strip())}: {exc}") from None
    if policy is None:
        raise PolicyError(f"empty policy: say what to keep ({POLICY_TEXT_GRAMMAR})")
    return policy


__all__ = ["POLICY_TEXT_GRAMMAR", "PolicyOptionError", "build_policy", "load_policy_file", "parse_keep_best",
           "parse_policy_text", "parse_size"]
