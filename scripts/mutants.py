"""A small mutation-testing runner for the registry's core modules (not run in CI).

Each mutant changes one node of one module (a comparison flipped, ``and``/``or`` swapped, a ``not`` dropped,
an ``if`` negated, a constant changed, a call statement or ``raise`` removed, a return value replaced by
``None``), is written into a private copy of the tree, and the module's matching test files run against it with
``-x``. A mutant is *killed* when the tests fail, *survived* when they pass, *timeout* when they run past the
per-mutant limit. Only the changed span of source is rewritten, so every other line stays byte-identical.

The runner imports the heavy dependencies (torch, SQLAlchemy, pytest) once and forks one child per mutant,
which imports ``registry`` afresh from the copy: a mutant costs its tests, not an interpreter start.

    scripts/mutants --modules refs,protocol --max-mutants 30 --seed 1
    scripts/mutants --modules store --tests tests/test_publish.py --list
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# module short name -> (source file, its matching test files); tests/test_mutation_kills.py holds the tests written
# to kill survivors of earlier runs, so it goes with every module
KILLS = "tests/test_mutation_kills.py"
# a mutant that hangs a multi-process test is failed by that test's own deadline (test_distributed: 180 s a group);
# the per-mutant limit stays above it, so the suite's verdict is what counts, not the runner's clock
HANG_DETECTORS_S = 240.0
MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "refs": ("registry/format/refs.py", ("tests/test_refs.py", "tests/test_cli_operator.py", KILLS)),
    "protocol": ("registry/ops/protocol.py",
                 ("tests/test_publish_faults.py", "tests/test_faults.py", "tests/test_publish.py",
                  "tests/test_metrics.py", KILLS)),
    "directory": ("registry/roots/directory.py",
                  ("tests/test_publish.py", "tests/test_publish_faults.py", "tests/test_faults.py",
                   "tests/test_retention.py", "tests/test_retention_crash.py", KILLS)),
    "store": ("registry/fs/store.py",
              ("tests/test_publish.py", "tests/test_faults.py", "tests/test_publish_faults.py",
               "tests/test_io_verify.py", "tests/test_root_binding.py", KILLS)),
    "policies": ("registry/retention.py",
                 ("tests/test_retention.py", "tests/test_retention_cli.py", "tests/test_cli_operator.py", KILLS)),
    "retention": ("registry/ops/retention.py",
                  ("tests/test_retention.py", "tests/test_retention_cli.py", "tests/test_retention_crash.py",
                   "tests/test_cli_operator.py", KILLS)),
    "removal": ("registry/fs/removal.py",
                ("tests/test_retention.py", "tests/test_retention_crash.py", "tests/test_fsck.py",
                 "tests/test_publish_faults.py", KILLS)),
    "fsck": ("registry/ops/fsck.py", ("tests/test_fsck.py", "tests/test_fsck_races.py", KILLS)),
    "queries": ("registry/catalog/queries.py",
                ("tests/test_queries.py", "tests/test_catalog_session.py", "tests/test_catalog_faults.py",
                 "tests/test_metrics.py", "tests/test_migrations.py", KILLS)),
    "loader": ("registry/distributed/loader.py",
               ("tests/test_load_faults.py", "tests/test_io_verify.py", "tests/test_distributed.py", KILLS)),
}

_FLIP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
_BINOP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.BitOr: ast.BitAnd, ast.BitAnd: ast.BitOr,
}


@dataclass(frozen=True)
class Mutant:
    module: str
    index: int
    line: int
    kind: str
    start: tuple[int, int]   # (lineno, col_offset) of the replaced span
    end: tuple[int, int]     # (end_lineno, end_col_offset)
    replacement: str

    def describe(self, source: str) -> str:
        original = _segment(source, self.start, self.end).replace("\n", " ")
        if len(original) > 70:
            original = original[:67] + "..."
        return f"{self.kind}: {original!r} -> {self.replacement!r}"


def _segment(source: str, start: tuple[int, int], end: tuple[int, int]) -> str:
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode()))
    data = source.encode()
    return data[offsets[start[0] - 1] + start[1]:offsets[end[0] - 1] + end[1]].decode()


def _apply(source: str, mutant: Mutant) -> str:
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode()))
    data = source.encode()
    a = offsets[mutant.start[0] - 1] + mutant.start[1]
    b = offsets[mutant.end[0] - 1] + mutant.end[1]
    return (data[:a] + mutant.replacement.encode() + data[b:]).decode()


def _skipped_lines(tree: ast.Module) -> set[int]:
    """Lines no mutant should touch: docstrings, ``TYPE_CHECKING`` blocks, annotations, ``__repr__``/``__all__``."""
    skip: set[int] = set()

    def cover(node: ast.AST) -> None:
        skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            cover(body[0])
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            cover(node)
        if isinstance(node, ast.AnnAssign):
            cover(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == "__repr__":
                cover(node)
            for arg in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]:
                if arg.annotation is not None:
                    cover(arg.annotation)
            if node.returns is not None:
                cover(node.returns)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            cover(node)
    return skip


def _span(node: ast.AST) -> tuple[tuple[int, int], tuple[int, int]]:
    return ((node.lineno, node.col_offset),  # type: ignore[attr-defined]
            (node.end_lineno, node.end_col_offset))  # type: ignore[attr-defined]


def find_mutants(module: str, source: str) -> list[Mutant]:
    tree = ast.parse(source)
    skip = _skipped_lines(tree)
    out: list[tuple[int, str, ast.AST, str]] = []

    def add(node: ast.AST, kind: str, replacement: str) -> None:
        if node.lineno in skip:  # type: ignore[attr-defined]
            return
        out.append((node.lineno, kind, node, replacement))  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                flipped = _FLIP.get(type(op))
                if flipped is None:
                    continue
                ops = list(node.ops)
                ops[i] = flipped()
                add(node, "compare", "(" + ast.unparse(ast.Compare(node.left, ops, node.comparators)) + ")")
        elif isinstance(node, ast.BoolOp):
            other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            add(node, "boolop", "(" + ast.unparse(ast.BoolOp(other, node.values)) + ")")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add(node, "not-drop", "(" + ast.unparse(node.operand) + ")")
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP:
            add(node, "binop", "(" + ast.unparse(ast.BinOp(node.left, _BINOP[type(node.op)](), node.right)) + ")")
        elif isinstance(node, ast.Constant) and not isinstance(node.value, str) and node.value is not None \
                and not isinstance(node.value, bytes):
            if isinstance(node.value, bool):
                add(node, "constant", repr(not node.value))
            elif isinstance(node.value, int):
                add(node, "constant", repr(node.value + 1))
            elif isinstance(node.value, float):
                add(node, "constant", repr(node.value * 2 + 1))
        if isinstance(node, (ast.If, ast.While)) and not isinstance(node.test, (ast.Compare, ast.UnaryOp)):
            add(node.test, "if-negate", "(not (" + ast.unparse(node.test) + "))")
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.Call, ast.Await)):
            add(node, "drop-call", "pass")
        elif isinstance(node, ast.Raise):
            add(node, "drop-raise", "pass")
        elif isinstance(node, ast.Return) and node.value is not None and not isinstance(node.value, ast.Constant):
            add(node, "return-none", "return None")
    mutants = []
    for i, (line, kind, node, replacement) in enumerate(sorted(out, key=lambda t: (t[0], t[2].col_offset, t[1]))):
        start, end = _span(node)
        mutants.append(Mutant(module, i, line, kind, start, end, replacement))
    # a mutant must still compile (e.g. dropping the only statement of a block yields ``pass``, which is fine)
    valid = []
    for m in mutants:
        try:
            compile(_apply(source, m), "<mutant>", "exec")
        except SyntaxError:
            continue
        valid.append(m)
    return valid


def _preload() -> None:
    # import the heavy third-party packages once in the parent; every forked child reuses them
    import pytest  # noqa: F401
    for name in ("torch", "numpy", "safetensors", "sqlalchemy", "alembic", "click", "hypothesis", "psycopg",
                 "xxhash"):
        try:
            __import__(name)
        except ImportError:
            pass


def _run_tests(copy: Path, tests: list[str], timeout: float, verbose: bool) -> tuple[str, float]:
    """Run ``tests`` against the tree at ``copy`` in a forked child; return (status, seconds)."""
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.setsid()
            os.chdir(copy)
            sys.path.insert(0, str(copy))
            os.environ["PYTHONPATH"] = str(copy) + os.pathsep + os.environ.get("PYTHONPATH", "")
            if not verbose:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
            import pytest
            rc = pytest.main([*tests, "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"])
            os._exit(int(rc))
        except BaseException:
            os._exit(99)
    deadline = started + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - started
        time.sleep(0.05)
    code = os.waitstatus_to_exitcode(status)
    elapsed = time.monotonic() - started
    # any failure counts: a test failing, or the mutant breaking import or collection (pytest's 2-4)
    return ("survived" if code == 0 else "killed"), elapsed


def _make_copy() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="registry-mutants-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache", "mutants")
    shutil.copytree(REPO / "registry", tmp / "registry", ignore=ignore)
    shutil.copytree(REPO / "tests", tmp / "tests", ignore=ignore)
    for name in ("pyproject.toml", "conftest.py", "docs"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, tmp / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, tmp / name)
    # the scripts the CLI tests may call
    if (REPO / "scripts").is_dir():
        shutil.copytree(REPO / "scripts", tmp / "scripts", ignore=ignore)
    return tmp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", default=",".join(MODULES),
                        help=f"comma-separated, from: {', '.join(MODULES)} (default: all)")
    parser.add_argument("--tests", nargs="+", default=None,
                        help="test files to run instead of each module's matching ones")
    parser.add_argument("--max-mutants", type=int, default=0, help="random sample of N mutants per module (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--timeout", type=float, default=0,
                        help="per-mutant limit in seconds (default: 3 x the unmutated run + 10, at least "
                             f"{HANG_DETECTORS_S:.0f}s, past the tests' own hang detectors)")
    parser.add_argument("--ids", default="",
                        help="run only these mutants, e.g. refs#1,store#11 (as printed by a run or --list)")
    parser.add_argument("--list", action="store_true", help="list the chosen mutants and exit")
    parser.add_argument("--verbose", action="store_true", help="show pytest output")
    args = parser.parse_args(argv)

    names = [n.strip() for n in args.modules.split(",") if n.strip()]
    if args.ids:
        names = [n for n in names if any(i.startswith(f"{n}#") for i in args.ids.split(","))]
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {', '.join(unknown)}; choose from {', '.join(MODULES)}")

    plans: list[tuple[str, str, list[str], list[Mutant]]] = []
    for name in names:
        path, tests = MODULES[name]
        source = (REPO / path).read_text()
        mutants = find_mutants(name, source)
        total = len(mutants)
        wanted = {int(i.split("#")[1]) for i in args.ids.split(",") if i.startswith(f"{name}#")}
        if args.ids:
            mutants = [m for m in mutants if m.index in wanted]
        elif args.max_mutants and args.max_mutants < total:
            mutants = sorted(random.Random(f"{args.seed}:{name}").sample(mutants, args.max_mutants),
                             key=lambda m: m.index)
        print(f"{name}: {path}: {total} mutants, running {len(mutants)}", flush=True)
        plans.append((name, source, list(args.tests or tests), mutants))
    if args.list:
        for name, source, _, mutants in plans:
            for m in mutants:
                print(f"  {name}#{m.index} line {m.line}: {m.describe(source)}")
        return 0

    _preload()
    copy = _make_copy()
    summary: list[tuple[str, int, int, int, int, list[str]]] = []
    try:
        for name, source, tests, mutants in plans:
            path = copy / MODULES[name][0]
            status, baseline = _run_tests(copy, tests, 3600, args.verbose)
            if status != "survived":
                print(f"{name}: the unmutated tests fail ({status}); skipping the module", flush=True)
                continue
            timeout = args.timeout or max(baseline * 3 + 10, HANG_DETECTORS_S)
            print(f"{name}: unmutated tests pass in {baseline:.1f}s; per-mutant limit {timeout:.0f}s", flush=True)
            counts = {"killed": 0, "survived": 0, "timeout": 0}
            survivors: list[str] = []
            for m in mutants:
                path.write_text(_apply(source, m))
                try:
                    status, secs = _run_tests(copy, tests, timeout, args.verbose)
                finally:
                    path.write_text(source)
                counts[status] += 1
                line = f"{name}#{m.index} line {m.line}: {m.describe(source)}"
                print(f"  {status:8s} {secs:6.1f}s  {line}", flush=True)
                if status == "survived":
                    survivors.append(line)
            summary.append((name, len(mutants), counts["killed"], counts["survived"], counts["timeout"], survivors))
    finally:
        shutil.rmtree(copy, ignore_errors=True)

    print("\nmodule      run  killed  survived  timeout  killed%  detected%")
    for name, run, killed, survived, timed_out, _ in summary:
        pct = 100.0 * killed / run if run else 100.0
        detected = 100.0 * (killed + timed_out) / run if run else 100.0
        print(f"{name:10s} {run:4d} {killed:7d} {survived:9d} {timed_out:8d}  {pct:6.1f}%  {detected:8.1f}%")
    for *_, survivors in summary:
        for line in survivors:
            print(f"survivor {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
