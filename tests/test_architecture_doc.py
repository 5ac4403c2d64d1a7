"""docs/architecture.md stays complete: every module of ``registry/`` is named there, and nothing else is.

A module is named as its dotted name in backticks (```registry.ops.fsck```); a backticked dotted name may also
name something a module defines at its top level (```registry.api.Registry```). Its links, and every link to it
from the repository's other Markdown files, point at files (and headings) that exist.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "registry"
DOC = REPO / "docs" / "architecture.md"

DOTTED = re.compile(r"`(registry(?:\.\w+)*)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name; a package is named by its ``__init__.py``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (``TYPE_CHECKING`` blocks included)."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            body.extend(node.body)
            body.extend(node.orelse)
    return names


def unknown(name: str, known: dict[str, Path]) -> bool:
    """Whether ``name`` is neither a module nor a top-level name of the longest module it starts with."""
    if name in known:
        return False
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if module in known:
            return cut != len(parts) - 1 or parts[cut] not in top_level_names(known[module])
    return True


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", path.read_text()))}


def broken_links(path: Path, *, root: Path = REPO) -> list[str]:
    """Each relative link of the Markdown file ``path`` whose file is missing, outside ``root``, or has no
    heading its ``#anchor`` names."""
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"^[a-z][a-z+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.is_relative_to(root) or not resolved.exists():
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.relative_to(root)})")
    return broken


def test_every_module_is_named_and_every_name_is_a_module() -> None:
    known = modules()
    named = set(DOTTED.findall(DOC.read_text()))
    missing = sorted(set(known) - named)
    invented = sorted(n for n in named if unknown(n, known))
    assert not missing, f"docs/architecture.md does not name these modules of registry/: {', '.join(missing)}"
    assert not invented, f"docs/architecture.md names modules that do not exist: {', '.join(invented)}"


def test_every_relative_link_of_the_doc_resolves() -> None:
    broken = broken_links(DOC)
    assert not broken, f"docs/architecture.md has broken links: {'; '.join(broken)}"


def test_every_link_to_the_doc_resolves() -> None:
    """README.md and the other docs link to headings of architecture.md; a renamed heading breaks them."""
    sources = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("*.md"))]
    broken = [f"{source.relative_to(REPO)}: {link}" for source in dict.fromkeys(sources)
              for link in broken_links(source) if "architecture.md" in link]
    assert not broken, f"links to docs/architecture.md that do not resolve: {'; '.join(broken)}"


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The checks themselves: a missing module, an invented one, a dead link and a dead anchor are all found."""
    known = modules()
    assert "registry.roots.open" in known and "registry" in known and "registry.__main__" in known
    assert not unknown("registry.api.Registry", known) and not unknown("registry.ops", known)
    assert unknown("registry.ops.nosuchmodule", known) and unknown("registry.api.NoSuchName", known)
    assert unknown("registry.api.Registry.open", known)  # only a module's own top-level names
    assert slug("Roots: where payloads live") == "roots-where-payloads-live"
    root = tmp_path / "repo"
    page = root / "docs" / "page.md"
    page.parent.mkdir(parents=True)
    page.write_text("# Top `x`\n[a](page.md#top-x) [b](nope.md) [c](#gone) [d](https://example.com/x) [e](../../out.md)"
                    "\n```\n[f](fenced.md)\n```\n")
    (tmp_path / "out.md").write_text("outside the repository")
    assert broken_links(page, root=root) == ["nope.md (no such file in the repository)",
                                             "#gone (no heading #gone in docs/page.md)",
                                             "../../out.md (no such file in the repository)"]
