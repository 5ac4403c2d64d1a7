"""Names and references: the grammar of the public contract (docs/reference/refs.md).

Everything here is pure string handling so it can be used by the CLI, the
loader and the catalog alike without importing torch or SQL.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from registry.errors import InvalidNameError, InvalidRefError
from registry.format.layout import CATALOG_FILE
from registry.format.numbers import shown

RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TAG_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
METRIC_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./\-]{0,254}")
RESERVED_TAGS = frozenset({"latest", "latest-published", "latest-durable", "latest-policy"})
MAX_STEP = 2**63 - 1  # the catalog stores steps as 64-bit integers

RefKind = Literal["latest", "latest-published", "latest-durable", "latest-policy", "best", "step", "tag", "pv"]
POLICY_PREFIX = "pv:"  # RUN@pv:N, the step of policy version N (a tag cannot hold ':', so none is taken)


def check_run_name(name: object) -> str:
    if not isinstance(name, str) or not RUN_NAME_RE.fullmatch(name):
        raise InvalidNameError(
            f"invalid run name {name!r}: use letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, at most 128 characters")
    if name.lower() == CATALOG_FILE or name.lower().startswith(CATALOG_FILE + "-"):
        raise InvalidNameError(f"invalid run name {name!r}: {CATALOG_FILE!r} and {CATALOG_FILE + '-*'!r} "
                               "are reserved for the catalog's own files")
    return name


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidNameError(f"invalid step {step!r}: steps are non-negative 64-bit integers")
    return step


def check_tag_name(name: object) -> str:
    if not isinstance(name, str) or not TAG_NAME_RE.fullmatch(name):
        raise InvalidNameError(
            f"invalid tag name {name!r}: use letters, digits, '.', '_', '/' or '-', "
            "at most 128 characters")
    if name.isdigit():
        raise InvalidNameError(f"invalid tag name {name!r}: a tag may not be all digits")
    if name in RESERVED_TAGS:
        raise InvalidNameError(f"invalid tag name {name!r}: {name!r} is a reserved ref")
    return name


def check_metric_key(key: object) -> str:
    if not isinstance(key, str) or not METRIC_KEY_RE.fullmatch(key):
        raise InvalidNameError(
            f"invalid metric key {key!r}: use letters, digits, '_', '.', '/' or '-'")
    return key


# "the newest good one", of four kinds (latest-policy: the newest verified step that carries a policy version)
LATEST_KINDS = ("latest", "latest-published", "latest-durable", "latest-policy")


@dataclass(frozen=True, kw_only=True)
class Ref:
    """A parsed reference. ``value`` is the step, tag or metric as fits ``kind``."""

    run: str
    kind: RefKind
    step: int | None = None
    tag: str | None = None
    metric: str | None = None
    mode: Literal["min", "max"] = "min"
    version: int | None = None  # kind "pv": the policy version

    @property
    def names_one_step(self) -> bool:
        """True when the ref names a single step rather than "the newest good one"."""
        return self.kind not in LATEST_KINDS

    def __str__(self) -> str:
        if self.kind in LATEST_KINDS:
            return f"{self.run}@{self.kind}"
        if self.kind == "step":
            return f"{self.run}@{self.step}"
        if self.kind == "tag":
            return f"{self.run}@{self.tag}"
        if self.kind == "pv":
            return f"{self.run}@{POLICY_PREFIX}{self.version}"
        return f"{self.run}@best:{self.metric}:{self.mode}"


REF_GRAMMAR = ("expected RUN[@latest|@latest-published|@latest-durable|@latest-policy|@STEP|@TAG|@pv:N"
               "|@best:METRIC[:min|max]]")
_SELECTOR_WORDS = ("latest", "latest-published", "latest-durable", "latest-policy", "best")


def _bad_ref(text: object, why: str, hint: str | None = None) -> InvalidRefError:
    """One line: what is wrong, the likely intent when there is one, then the grammar."""
    return InvalidRefError(f"invalid ref {text!r}: {why}; {hint + '; ' if hint else ''}{REF_GRAMMAR}")


def close_match(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The one of ``candidates`` that ``name`` most likely misspells (case ignored), or None.

    The one home of every "did you mean": refs, keywords, runs, tags and metric keys.
    """
    import difflib  # only an error message needs it

    by_folded: dict[str, str] = {}
    for candidate in candidates:
        by_folded.setdefault(candidate.lower(), candidate)
    close = difflib.get_close_matches(name.lower(), list(by_folded), n=1, cutoff=cutoff)
    return by_folded[close[0]] if close and by_folded[close[0]] != name else None


def did_you_mean(name: str, candidates: Iterable[str], *, shown: str = "{}") -> str:
    """``"; did you mean 'wide-64'?"`` for the closest of ``candidates`` (``shown`` formats it), else ``""``."""
    match = close_match(name, candidates)
    return f"; did you mean {shown.format(match)}?" if match is not None else ""


def _folded_ratio(a: str, b: str) -> float:
    import difflib  # only an error message needs it
    return difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio()


# What people write for a keyword that has another name here: ``@latest`` is already the newest verified step.
_KEYWORD_ALIASES = {"latest-verified": "latest", "latest_verified": "latest"}


def _keyword_intent(selector: str, *, cutoff: float = 0.75) -> tuple[str, float] | None:
    """The keyword selector that ``selector`` most likely misspells (``latest``, ``best:METRIC``...) and how
    close it is (0 to 1), or None. A transposition (``lastet``) counts as close, whatever difflib makes of it."""
    lowered = selector.lower()
    if lowered.startswith("best") and (lowered == "best" or ":" in lowered):
        body = selector[len("best"):].lstrip("-_./:")
        return f"best:{body or 'METRIC'}", 1.0
    if lowered in _KEYWORD_ALIASES:
        return _KEYWORD_ALIASES[lowered], 1.0
    score, word = max((_folded_ratio(lowered, word), word) for word in _SELECTOR_WORDS)
    swapped = next((w for w in _SELECTOR_WORDS if sorted(w) == sorted(lowered) and w[0] == lowered[0]), None)
    if swapped is not None and score < 0.9:
        score, word = 0.9, swapped
    if score < cutoff:
        return None
    return (word if word != "best" else "best:METRIC"), score


def selector_hint(run: str, selector: str) -> str | None:
    """``did you mean RUN@...?`` for a selector that looks like a misspelt keyword, else None.

    ``RUN@best`` and ``RUN@lastest`` are legal tag refs, so the catalog asks
    :func:`missing_tag` too when such a tag does not exist.
    """
    intent = _keyword_intent(selector)
    return f"did you mean {run}@{intent[0]}?" if intent is not None else None


_POLICY_TYPO = re.compile(r"(?i:pv)[-_.]?([0-9]{1,18})")


def missing_tag(run: str, tag: str, tags: Iterable[str]) -> tuple[bool, str | None]:
    """What ``RUN@TAG`` meant when ``run`` has no tag ``tag`` (``tags`` are the ones it has).

    Returns whether it is a misspelt keyword (an ``InvalidRefError``, never
    "nothing yet": a trainer whose resume starts fresh when nothing is found
    must not start over on a typo), and ``did you mean RUN@...?`` or None.
    An existing tag closer than the keyword wins (``RUN@Test`` with a tag
    ``test`` means that tag); a tag further from a keyword than a misspelling
    still says which keyword it is near.
    """
    policy = _POLICY_TYPO.fullmatch(tag)
    if policy is not None:  # pv3, PV-3, pv_3: legal tags, but what was meant is the version
        return True, f"did you mean {run}@{POLICY_PREFIX}{int(policy.group(1))}?"
    keyword = _keyword_intent(tag)
    near = close_match(tag, tags)
    if keyword is not None and (near is None or keyword[1] >= _folded_ratio(tag, near)):
        return True, f"did you mean {run}@{keyword[0]}?"
    if near is not None:
        return False, f"did you mean {run}@{near}?"
    if tag.lower().startswith("best") and len(tag) > len("best"):  # best-loss, bestloss
        return False, f"did you mean {run}@best:{tag[len('best'):].lstrip('-_./') or 'METRIC'}?"
    weak = _keyword_intent(tag, cutoff=0.65)
    return False, f"did you mean {run}@{weak[0]}?" if weak is not None else None


def _best_hint(run: str, body: str) -> str | None:
    """The likely intent of a malformed ``best:`` body: ``loss:maxx`` -> ``loss:max``."""
    metric, _, mode = body.rpartition(":")
    if metric and ":" not in metric and METRIC_KEY_RE.fullmatch(metric):
        if not mode:
            return f"did you mean {run}@best:{metric}?"
        close = close_match(mode, ("min", "max"), cutoff=0.5)
        if close is not None:
            return f"did you mean {run}@best:{metric}:{close}?"
    return None


def _colon_hint(text: str) -> str | None:
    """``toy:latest`` (Docker's and W&B's spelling) -> ``did you mean toy@latest?``."""
    run, _, selector = text.partition(":")
    if not selector:
        return None
    try:
        parse_ref(f"{run}@{selector}")
    except InvalidRefError:
        return None
    return f"did you mean {run}@{selector}?"


def _policy_ref(text: str, run: str, selector: str) -> Ref:
    """``RUN@pv:N``; anything else that starts like it (``pv:x``, ``PV:3``, ``pv3``) is refused with the intent."""
    body = selector[3:]
    number = body.isdigit() and body.isascii()
    if selector.startswith(POLICY_PREFIX) and number:
        if len(body.lstrip("0")) > len(str(MAX_STEP)) or int(body) > MAX_STEP:
            raise InvalidRefError(f"invalid ref {shown(text)}: the policy version does not fit in 64 bits; "
                                  f"{REF_GRAMMAR}")
        return Ref(run=run, kind="pv", version=int(body))
    hint = f"did you mean {run}@{POLICY_PREFIX}{int(body)}?" if number else f"did you mean {run}@pv:N?"
    why = "a policy version is a non-negative integer after 'pv:'" if not number else "write it 'pv:N'"
    raise _bad_ref(text, why, hint)


def parse_ref(text: object) -> Ref:
    """Parse ``RUN``, ``RUN@latest``, ``RUN@latest-published``, ``RUN@1000``,
    ``RUN@best:METRIC[:min|max]`` or ``RUN@TAG``.

    A malformed ref is an :class:`InvalidRefError` of one line: what is wrong,
    the likely intent when one is apparent, and the grammar.
    """
    if isinstance(text, Ref):
        return text
    if not isinstance(text, str) or not text:
        raise _bad_ref(text, "a ref is a non-empty string")
    run, sep, selector = text.partition("@")
    try:
        check_run_name(run)
    except InvalidNameError as exc:
        colon = None if sep else _colon_hint(text)
        raise _bad_ref(text, "a step or tag follows '@', not ':'" if colon else str(exc), colon) from None
    if not sep:
        return Ref(run=run, kind="latest")
    if not selector:
        raise _bad_ref(text, "nothing after '@'", f"did you mean {run}@latest?")
    if "@" in selector:
        raise _bad_ref(text, "more than one '@'")
    if selector in LATEST_KINDS:
        return Ref(run=run, kind=selector)  # type: ignore[arg-type]
    if selector.isdigit() and selector.isascii():
        if len(selector.lstrip("0")) > len(str(MAX_STEP)) or int(selector) > MAX_STEP:
            raise InvalidRefError(f"invalid ref {shown(text)}: the step does not fit in 64 bits; {REF_GRAMMAR}")
        return Ref(run=run, kind="step", step=int(selector))
    if selector.startswith("-") and selector[1:].isdigit():
        raise _bad_ref(text, "steps are non-negative")
    if selector.lower().startswith(("pv:", "pv=")):  # never a tag: a tag holds neither ':' nor '='
        return _policy_ref(text, run, selector)
    if selector.startswith("best:"):
        body = selector[len("best:"):]
        metric, mode = body, "min"
        moded = body.endswith((":min", ":max"))
        if moded:
            metric, mode = body[:-4], body[-3:]
        if not metric:
            raise _bad_ref(text, "no METRIC after 'best:'", f"did you mean {run}@best:METRIC?")
        try:
            check_metric_key(metric)
        except InvalidNameError:
            why = (f"{body.rpartition(':')[2]!r} is not min or max" if ":" in body and not moded
                   else f"{metric!r} is not a metric key (letters, digits, '_', '.', '/', '-')")
            raise _bad_ref(text, why, _best_hint(run, body)) from None
        return Ref(run=run, kind="best", metric=metric, mode=mode)  # type: ignore[arg-type]
    try:
        check_tag_name(selector)
    except InvalidNameError as exc:
        raise _bad_ref(text, str(exc), selector_hint(run, selector)) from None
    return Ref(run=run, kind="tag", tag=selector)
