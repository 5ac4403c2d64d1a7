"""The documentation holds together: its Python runs as written, its links resolve, and every page can be found.

Every ```python block of ``README.md`` and of every page under ``docs/`` runs, in a fresh directory, in a child process
of its own per page (so a page may start a process group, as under ``torchrun``, or log, without touching this
one): the blocks of one page in order, in one namespace. A block the page marks with ``<!-- no-run: why -->`` on
the line before is left out, and says why where a reader sees it. The guides write the reader's own servers as
the stand-ins below; a page that names one runs against the test servers (PostgreSQL, SeaweedFS) instead.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env, free_port, pg_schema_url
from tests.killharness import context
from tests.test_architecture_doc import FENCE, LINK, broken_links

README = REPO / "README.md"
DOCS = REPO / "docs"
RUN_PAGES = [README, *sorted(DOCS.rglob("*.md"))]
LINKED_PAGES = [README, *sorted(DOCS.rglob("*.md")), REPO / "BENCHMARKS.md", REPO / "RELIABILITY.md"]

PG_STAND_IN = "postgresql://db/registry"
S3_STAND_IN = "s3://ckpt-bucket"
ENDPOINT_STAND_IN = "http://minio.local:9000"
NVME_STAND_IN = "/nvme/"  # a host's fast local disk
MOUNT_STAND_IN = "/mnt/ckpt"  # a shared filesystem, mounted on every host
ERRORS = DOCS / "reference" / "errors.md"

PYTHON = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NO_RUN = re.compile(r"<!-- no-run: (.*?) -->\n$")
ANY_NO_RUN = re.compile(r"^<!-- no-run:(.*?)-->", re.MULTILINE)
# a marker is an exception to the rule that guide code runs; more than a few means the guides stopped being tested
MAX_NO_RUN = 4


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the block's first code line, 1-based
    code: str
    no_run: str | None  # why it is not run, from its marker


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in PYTHON.finditer(text):
        before = text[:match.start()]
        marker = NO_RUN.search(before[-300:])
        found.append(Block(page, before.count("\n") + 2, match.group(1), marker.group(1).strip() if marker else None))
    return found


def stand_ins(text: str, request: pytest.FixtureRequest, tmp_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The replacements for the stand-ins ``text`` names, and the environment the page needs for them."""
    replace: dict[str, str] = {NVME_STAND_IN: f"{tmp_path}/nvme/", MOUNT_STAND_IN: f"{tmp_path}/mnt/ckpt"}
    env: dict[str, str] = {}
    if PG_STAND_IN in text:
        replace[PG_STAND_IN] = pg_schema_url(request.getfixturevalue("pg_database"))
    if S3_STAND_IN in text or ENDPOINT_STAND_IN in text:
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        replace[S3_STAND_IN] = f"s3://{bucket}/{uuid.uuid4().hex[:12]}"
        replace[ENDPOINT_STAND_IN] = server.endpoint
        env.update(server.env)
    return replace, env


def substitute(code: str, replace: dict[str, str]) -> str:
    for old, new in replace.items():
        code = code.replace(old, new)
    return code


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


# the trainers' pages train real models (seconds each), as the slow integration test modules do
SLOW_PAGES = {DOCS / "guide" / "integrations.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=[pytest.mark.slow] if p in SLOW_PAGES else [])
                                  for p in RUN_PAGES if any(b.no_run is None for b in blocks(p))], ids=page_id)
def test_every_python_block_runs_as_written(page: Path, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    runnable = [b for b in blocks(page) if b.no_run is None]
    replace, env = stand_ins("".join(b.code for b in runnable), request, tmp_path)
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([{"page": page_id(b.page), "line": b.line, "code": substitute(b.code, replace)}
                                for b in runnable]))
    work = tmp_path / "work"
    work.mkdir()
    base = {k: v for k, v in child_env().items() if not k.startswith(("REGISTRY_", "AWS_"))}
    # what torchrun sets for one process, so a page may call init_process_group() as a launched script does
    launched = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
                "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    # a child of the kill harness's forkserver, which imported torch and the registry once: a fresh interpreter
    # per page spent seconds importing them
    out = tmp_path / "output.txt"
    child = context().Process(target=run_page, args=(str(spec), str(work), {**base, **launched, **env}, str(out)))
    child.start()
    child.join(280)
    if child.exitcode is None:
        child.kill()
        child.join()
    printed = out.read_text(errors="replace") if out.exists() else ""
    print(printed)  # what the page's comments say it prints, for a reader running with -s
    assert child.exitcode == 0, f"{page_id(page)}: a block failed (exit {child.exitcode})\n{printed[-8000:]}"


def run_page(spec: str, cwd: str, env: dict[str, str], out: str) -> None:
    """In a forkserver child: run a page's blocks in ``cwd`` with exactly ``env``, printing into ``out``."""
    import os
    import traceback

    import torch
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    namespace: dict[str, object] = {"__name__": "__main__"}
    try:
        for block in json.loads(Path(spec).read_text()):
            # padded so a traceback names the Markdown file and its line
            exec(compile("\n" * (block["line"] - 1) + block["code"], block["page"], "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_no_run_markers_are_few_and_each_stands_before_a_python_block() -> None:
    marked = [b for page in RUN_PAGES for b in blocks(page) if b.no_run is not None]
    assert all(b.no_run for b in marked), "a no-run marker must say why"
    assert len(marked) <= MAX_NO_RUN, [f"{page_id(b.page)}:{b.line}" for b in marked]
    stray = [page_id(page) for page in RUN_PAGES for _ in ANY_NO_RUN.finditer(page.read_text())]
    assert len(stray) == len(marked), f"a no-run marker that stands before no ```python block: {stray}"


def test_every_relative_link_resolves() -> None:
    broken = [f"{page_id(page)}: {link}" for page in LINKED_PAGES if page.exists() for link in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def reachable(start: Path, *, root: Path = REPO) -> Iterator[Path]:
    """Every Markdown file inside ``root`` reached from ``start`` by following relative links, ``start`` included."""
    seen = {start.resolve()}
    pending = [start.resolve()]
    while pending:
        page = pending.pop()
        yield page
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            file = target.partition("#")[0]
            if not file or re.match(r"^[a-z][a-z+.-]*:", file) or not file.endswith(".md"):
                continue
            found = (page.parent / file).resolve()
            if found.is_file() and found.is_relative_to(root) and found not in seen:
                seen.add(found)
                pending.append(found)


def test_every_page_under_docs_is_reachable_from_the_readme() -> None:
    found = set(reachable(README))
    lost = sorted(str(p.relative_to(REPO)) for p in DOCS.rglob("*.md") if p.resolve() not in found)
    assert not lost, f"pages no link from README.md leads to: {', '.join(lost)}"


def test_the_errors_reference_names_every_error_with_its_bases() -> None:
    """docs/reference/errors.md's tables list every error class the registry defines, each with its direct bases."""
    import registry.errors
    from registry.cli.terminal import MissingExtraError
    from registry.retention import RetentionWarning
    from registry.web.server import BindError, UnsafeBindError

    defined = [c for c in vars(registry.errors).values()
               if isinstance(c, type) and issubclass(c, Exception) and c.__module__ == registry.errors.__name__]
    defined += [UnsafeBindError, BindError, MissingExtraError, RetentionWarning]
    rows = {}
    for name, bases in re.findall(r"^\| (?:&nbsp;)*`([\w.]+)` \| ([^|]+) \|", ERRORS.read_text(), re.MULTILINE):
        rows[name.rsplit(".", 1)[-1]] = set(re.findall(r"`(\w+)`", bases))
    for cls in defined:
        assert cls.__name__ in rows, f"{cls.__name__} is not in {ERRORS.name}"
        assert rows[cls.__name__] == {b.__name__ for b in cls.__bases__}, cls.__name__
    assert set(rows) == {c.__name__ for c in defined}, "errors.md names a class that does not exist"


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The extraction and the reachability walk themselves: a marked block is skipped, an unlinked page is lost."""
    page = tmp_path / "page.md"
    page.write_text("# T\n\n```python\nx = 1\n```\n\n<!-- no-run: needs a GPU -->\n```python\ny = 2\n```\n\n"
                    "```bash\nz\n```\n[next](next.md) [code](x.py)\n")
    (tmp_path / "next.md").write_text("[back](page.md#t) [far](sub/far.md)\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "far.md").write_text("the end\n")
    (tmp_path / "lost.md").write_text("nobody links here\n")
    assert [(b.line, b.code, b.no_run) for b in blocks(page)] == [(4, "x = 1\n", None), (9, "y = 2\n", "needs a GPU")]
    assert {p.name for p in reachable(page, root=tmp_path)} == {"page.md", "next.md", "far.md"}
    assert substitute(f"url = '{PG_STAND_IN}'", {PG_STAND_IN: "sqlite:///x"}) == "url = 'sqlite:///x'"
