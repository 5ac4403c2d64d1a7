"""Where the code decides which kind of root it is on: inside ``registry/roots/``, and as few places as possible
elsewhere. A decision is an ``if``/``while``/conditional expression whose test asks for a kind of root or one of
its parts (``objects is None``, ``isinstance(x, Store)``, ``root.tiered() is not None``, ``root.kind``, an
``s3://`` check ...). Asking what a root can do (``root.can.links``) is the interface, not a decision on its kind.
The goal is at most five outside ``registry/roots/`` (see docs/architecture.md); each change that moves decisions
into a root lowers ``CEILING``, and a change that adds one outside fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "registry"
DECISION = re.compile(
    r"\b(objects|tiers|_store|durable)\b\s+is\s+(not\s+)?None"
    r"|is_object_url|_names_object_root|['\"]s3://['\"]\s+(not\s+)?in\b|\.startswith\(['\"]s3://"
    r"|isinstance\([^)]*\b(Store|ObjectRoot|Tiers|DirectoryRoot|ObjectStoreRoot|TieredRoot)\b"
    r"|(?<!can)\.links\b|\btier\s*==|\bremote\b"
    r"|\b(object_store|tiered)\(\)\s+is\s+(not\s+)?None|\broot\.kind\b")
GOAL = 5
CEILING = 1  # lower it as decisions move into registry/roots/; never raise it


def decisions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                test = ast.unparse(node.test)
                if DECISION.search(test):
                    found.setdefault(rel, []).append(f"{rel}:{node.lineno}: {test}")
    return found


def test_the_pattern_sees_a_decision_of_each_shape() -> None:
    for text in ("self.objects is not None", "tiers is None", "isinstance(store, Store)", "reg.root.kind == 's3'",
                 "root.tiered() is None", "is_object_url(x)", "'s3://' in text", "plan.tier == 'fast'"):
        assert DECISION.search(text), text
    for text in ("parsed.kind == 'step'", "not self.root.can.links"):
        assert not DECISION.search(text), text


def test_backend_decisions_outside_the_roots_stay_under_the_ceiling() -> None:
    outside = [line for rel, lines in decisions().items() if not rel.startswith("registry/roots/") for line in lines]
    assert len(outside) <= CEILING, "a new decision on the kind of root outside registry/roots/:\n" + "\n".join(outside)
    assert CEILING <= GOAL
