"""Cron-style retention across every run of a registry.

Applies one policy to every run (or those matching ``--runs``), one run at a
time: a failure in one run is reported and the others still get collected;
the exit status is 1 if any run failed. Safe to run while trainers publish
and readers load: retention never deletes ``@latest``, ``@latest-published``,
tagged, staging or leased steps, and it re-checks all of that at the moment
it marks a step. Safe to run twice at once, and safe to kill: the next run
finishes any interrupted deletion.

Example crontab line (hourly)::

    17 * * * *  cd /srv/train && .venv/bin/python examples/retention_cron.py \\
                 --keep-last 3 --keep-best eval/loss=2 --keep-every 10000 --max-bytes-per-run 500G
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from registry import Registry, RegistryError  # noqa: E402
from registry.ops import policies  # noqa: E402
from registry.records import human_bytes  # noqa: E402
from registry.retention import Policy  # noqa: E402


def build_policy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Policy:
    try:
        policy = policies.build_policy(keep_last=args.keep_last, keep_best=args.keep_best,
                                       keep_every=args.keep_every, max_bytes=args.max_bytes_per_run)
    except policies.PolicyOptionError as exc:
        parser.error(str(exc))
    if policy is None:
        parser.error("say what to keep: --keep-last, --keep-best, --keep-every or --max-bytes-per-run")
    return policy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="catalog URL (default $REGISTRY_URL or ROOT/.registry/catalog.db)")
    parser.add_argument("--root", default=None, help="checkpoint root (default $REGISTRY_ROOT or ./checkpoints)")
    parser.add_argument("--runs", default="*", metavar="GLOB", help="only runs whose name matches (default all)")
    parser.add_argument("--keep-last", type=int, default=None, metavar="N")
    parser.add_argument("--keep-best", action="append", default=[], metavar="METRIC[:max]=K")
    parser.add_argument("--keep-every", type=int, default=None, metavar="N")
    parser.add_argument("--max-bytes-per-run", default=None, metavar="SIZE",
                        help="byte budget per run (e.g. 500G): drop the oldest kept steps until it fits")
    parser.add_argument("--allow-missing-metric", action="store_true",
                        help="a run none of whose checkpoints has a --keep-best metric is collected anyway "
                             "(default: that run is refused, as a typo would delete its best steps)")
    parser.add_argument("--dry-run", action="store_true", help="plan only; delete nothing")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    try:
        policy = build_policy(args, parser)
    except RegistryError as exc:
        parser.error(str(exc))

    report: list[dict[str, Any]] = []
    failed = 0
    with Registry.open(url=args.url, root=args.root) as reg:
        for run in [r.name for r in reg.runs() if fnmatch.fnmatchcase(r.name, args.runs)]:
            entry: dict[str, Any] = {"run": run}
            try:
                plan = reg.plan_retention(run, policy, allow_missing_metrics=args.allow_missing_metric)
                entry["plan"] = plan.to_json()
                line = f"{run}: delete {len(plan.delete)}/{len(plan.decisions)} ({human_bytes(plan.bytes_freed)})"
                if not args.dry_run:
                    result = plan.execute()
                    entry["result"] = result.to_json()
                    line += f", deleted {len(result.deleted)}, skipped {len(result.skipped)}"
                    if result.errors:
                        failed += 1
                        line += f", {len(result.errors)} error(s): {next(iter(result.errors.values()))}"
            except RegistryError as exc:
                failed += 1
                entry["error"] = str(exc)
                line = f"{run}: error: {exc}"
            report.append(entry)
            if not args.json:
                print(line + (" [dry run]" if args.dry_run else ""))
    if args.json:
        print(json.dumps({"policy": repr(policy), "dry_run": args.dry_run, "runs": report}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
