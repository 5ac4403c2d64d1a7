"""CLI start-up: read-only commands in a fresh interpreter on a small SQLite catalog, against their floors.

Each command is what an engineer types (``registry --root R ls RUN``), run as a new process as a shell would run
it, so the figure is the interpreter, the imports, the catalog open and the work together. The catalog holds
``--runs-in-catalog`` runs of three steps. Floors, measured in the same rounds: ``python -c pass`` (the
interpreter) and ``python -c 'import sqlalchemy.engine, sqlalchemy.sql'`` (the SQL toolkit every catalog
command needs). ``--against DIR`` also runs the commands from another checkout's ``registry`` package (its
directory goes first on ``PYTHONPATH``), interleaved round by round, for a before/after in one run.

Reported: medians over ``--rounds`` (after one warm-up) of wall time and of CPU time (user + system, from
``wait4``), which moves less than wall time when other work shares the cores. ``--instructions`` also counts
each variant's instructions once under valgrind's callgrind, with ``PYTHONHASHSEED=0``: a count that other work
on the machine does not move (about 0.235 ms a million instructions on the development machine, from the floor).

Each tree's ``registry`` package is byte-compiled first, as ``pip install`` does for an installed package: an
editable checkout run under ``PYTHONDONTWRITEBYTECODE=1`` (this machine's environment sets it) would otherwise
compile every module from source in every process, 70 ms of a 350 ms ``ls`` here, which no installed copy pays.

    ./scripts/bench cli [--rounds 9] [--runs-in-catalog 10] [--against DIR] [--instructions]
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one child process.

    ``cwd`` is outside every checkout: ``python -m`` puts the working directory first on ``sys.path``, so a
    child started in a checkout would import that checkout's package whatever ``PYTHONPATH`` says.
    """
    t = time.perf_counter()
    child = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed with status {status}")
    return wall, usage.ru_utime + usage.ru_stime


def instructions(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    """Millions of instructions one child process runs, counted by callgrind (the hash seed fixed, so that set
    and dict orders, and with them the count, repeat from run to run)."""
    done = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv],
                          env=dict(env, PYTHONHASHSEED="0"), cwd=cwd, capture_output=True, text=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"valgrind {' '.join(argv)} failed with status {done.returncode}: {done.stderr[-500:]}")
    return int(found.group(1)) / 1e6


def build(root: Path, runs: int) -> None:
    code = ("import sys, torch; from registry import Registry\n"
            "with Registry.open(root=sys.argv[1]) as reg:\n"
            f"    for r in range({runs}):\n"
            "        for s in range(3):\n"
            "            reg.publish(f'run{r}', s, {'w': torch.zeros(4)}, metrics={'loss': 1.0 / (s + 1)})\n")
    subprocess.run([sys.executable, "-c", code, str(root)], check=True, capture_output=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--runs-in-catalog", type=int, default=10)
    parser.add_argument("--against", default=None, help="another checkout, for a before/after in the same run")
    parser.add_argument("--instructions", action="store_true",
                        help="also count each variant's instructions once (valgrind; about 20 s a variant)")
    args = parser.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind")
    work = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        root = work / "root"
        build(root, args.runs_in_catalog)
        py, r = sys.executable, str(root)
        commands = {"ls RUN": ["ls", "run3"], "show RUN@latest": ["show", "run3@latest"], "runs": ["runs"],
                    "resolve RUN": ["resolve", "run3"], "--help": ["--help"]}
        trees = {"this checkout": str(REPO)}
        if args.against:
            trees["against"] = str(Path(args.against).resolve())
        for tree in trees.values():
            compileall.compile_dir(Path(tree) / "registry", quiet=1)
        variants: dict[str, tuple[list[str], dict[str, str]]] = {
            "python -c pass": ([py, "-c", "pass"], dict(os.environ)),
            "import sqlalchemy (floor)": ([py, "-c", "import sqlalchemy.engine, sqlalchemy.sql"], dict(os.environ))}
        for tree_name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=tree)
            for name, argv in commands.items():
                label = name if tree_name == "this checkout" else f"{name} [against]"
                variants[label] = ([py, "-m", "registry", "--root", r, *argv], env)
        walls: dict[str, list[float]] = {k: [] for k in variants}
        cpus: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for rnd in range(args.rounds + 1):
            shift = rnd % len(names)
            for name in names[shift:] + names[:shift]:
                wall, cpu = timed(*variants[name], cwd=work)
                if rnd:
                    walls[name].append(wall)
                    cpus[name].append(cpu)
        counts = {name: instructions(*variants[name], cwd=work) for name in names} if args.instructions else {}
        load = os.getloadavg()
        print(f"CLI start-up, SQLite catalog of {args.runs_in_catalog} runs x 3 steps, fresh interpreter each; "
              f"median of {args.rounds} rounds after a warm-up; {os.cpu_count()} CPUs, "
              f"load average {load[0]:.1f} / {load[1]:.1f}")
        print(f"{'command':<28} {'wall ms':>8} {'cpu ms':>8}" + (f" {'M instr':>8}" if counts else ""))
        for name in names:
            wall, cpu = statistics.median(walls[name]) * 1e3, statistics.median(cpus[name]) * 1e3
            print(f"{name:<28} {wall:>8.0f} {cpu:>8.0f}" + (f" {counts[name]:>8.1f}" if counts else ""))
        extra = (f" --against {args.against}" if args.against else "") + (" --instructions" if counts else "")
        print(f"command: ./scripts/bench cli --rounds {args.rounds} --runs-in-catalog {args.runs_in_catalog}{extra}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
