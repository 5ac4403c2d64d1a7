"""The documents behind ``--json`` and the web view: one builder per fact, called by both.

The command line prints these dictionaries; ``registry ui`` serves the very
same ones under ``/api/...``, so a script that reads one can read the other.
Everything here reads through :class:`~registry.api.Registry` and writes
nothing, which is what lets the web view run on a read-only catalog.
"""

from __future__ import annotations

import math
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Literal

from registry.errors import CheckpointNotFoundError, InvalidQueryError, RegistryError
from registry.format.refs import check_metric_key, check_run_name, parse_ref
from registry.format.search import PARAMS, Field, Search, parse_columns, parse_field, parse_where
from registry.format.search import parse_sort as parse_sort_keys
from registry.records import (ENDED, HAS_PAYLOAD, NO_PAYLOAD, AttemptInfo, CheckpointInfo, EventInfo, MetricPoint,
                              Status)

if TYPE_CHECKING:
    from registry.catalog.lineage import LineageHop
    from registry.api import Registry
    from registry.catalog import FileRecord
    from registry.ops.scrub import VerifyResult
    from registry.ops.retention import RetentionPlan, RetentionResult

DEFAULT_CURVE_POINTS = 1200  # what a chart a few hundred pixels wide can show; min and max per bucket


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def format_time(value: datetime | None) -> str:
    """``2026-12-01 04:07:45 UTC``: a time with its zone, as every table shows it."""
    if value is None:
        return "-"
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.strftime("%Y-%m-%d %H:%M:%S %Z").replace("UTC+00:00", "UTC")


def format_age(value: datetime | None, *, now: datetime | None = None) -> str:
    """``3d 4h``, ``12m``: how long ago, to the two biggest units."""
    if value is None:
        return "-"
    seconds = max(0, int(((now or now_utc()) - value).total_seconds()))
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
        if len(parts) == 2:
            break
    return " ".join(parts)


def parse_sort(spec: str | None) -> tuple[str, Literal["min", "max"]] | None:
    """``eval/loss`` or ``eval/acc:max`` (a field of :mod:`registry.format.search` that ``RUN@best`` ranks)
    -> (metric, mode); None for no sort."""
    if not spec:
        return None
    field = parse_field(spec)
    if field.summary not in ("min", "max"):
        raise InvalidQueryError(f"cannot sort by {spec!r}: expected METRIC, METRIC:min or METRIC:max")
    return field.key, "max" if field.summary == "max" else "min"


# ---------------------------------------------------------------------- runs


def runs_doc(reg: Registry, *, sort_by: str | None = None) -> list[dict[str, Any]]:
    """Every run: its counts, newest and latest verified step, and, with ``sort_by``, its best value.

    ``sort_by`` (``METRIC`` or ``METRIC:max``) orders the runs best first by
    the value of ``RUN@best:METRIC`` (runs without the metric last), so runs
    are compared exactly as the ``best:`` ref ranks their checkpoints.
    """
    sort = parse_sort(sort_by)
    runs = reg.runs()
    refs = [parse_ref(f"{r.name}@latest") for r in runs]
    if sort is not None:
        refs += [parse_ref(f"{r.name}@best:{sort[0]}:{sort[1]}") for r in runs]
    found = reg.catalog.resolve_each(refs)  # one transaction, not two round trips per run
    docs = []
    for i, run in enumerate(runs):
        doc = run.to_json()
        latest = found[i]
        doc["latest_verified_step"] = latest.step if latest else None
        if sort is not None:
            metric, mode = sort
            best = found[len(runs) + i]
            doc["best"] = {"metric": metric, "mode": mode, "step": best.step if best else None,
                           "value": best.metrics.get(metric) if best else None}
        docs.append(doc)
    if sort is not None:
        sign = -1.0 if sort[1] == "max" else 1.0
        docs.sort(key=lambda d: (d["best"]["value"] is None, sign * (d["best"]["value"] or 0.0), d["name"]))
    return docs


# ---------------------------------------------------------------------- runs as a table

# a metric whose name holds one of these is ranked highest first when it is picked as the default column
HIGHER_IS_BETTER = ("acc", "auc", "f1", "precision", "recall", "reward", "return", "score", "bleu", "rouge", "iou")
EVAL_PREFIXES = ("eval", "val", "valid", "test")
TRAINING_WINDOW = timedelta(minutes=10)  # a run a trainer wrote to this recently is "training"


def default_column(metric_keys: Iterable[Iterable[str]]) -> Field | None:
    """The column a runs table shows unasked, from each run's metric keys: the loss most runs log (an
    evaluation one first), lowest best; without a loss, the metric most runs log, highest best where its name
    says higher is better (``acc``, ``f1``, ``reward``, ...)."""
    counts: dict[str, int] = {}
    for keys in metric_keys:
        for key in set(keys):
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None

    def rank(key: str) -> tuple[bool, bool, int, str]:
        words = key.lower()
        return ("loss" not in words, not words.startswith(EVAL_PREFIXES), -counts[key], key)
    key = min(counts, key=rank)
    higher = "loss" not in key.lower() and any(w in key.lower() for w in HIGHER_IS_BETTER)
    return Field(key, "max" if higher else "min")


def value_at(doc: Any, path: str) -> tuple[bool, Any]:
    """``(found, value)`` at ``path`` in a JSON document, a path as :func:`registry.ops.diff.json_diff` writes
    them (``optim.betas[1]``); a key that holds a dot is matched whole, as the document spells it."""
    if path == "":
        return True, doc
    if isinstance(doc, list) and path.startswith("["):
        index, bracket, rest = path[1:].partition("]")
        if bracket and index.isdigit() and int(index) < len(doc):
            return value_at(doc[int(index)], rest.removeprefix("."))
        return False, None
    if isinstance(doc, dict):
        for key in sorted((k for k in doc if isinstance(k, str) and path.startswith(k)), key=len, reverse=True):
            rest = path[len(key):]
            if rest == "" or rest[0] in ".[":
                found, value = value_at(doc[key], rest.removeprefix("."))
                if found:
                    return found, value
    return False, None


def run_state(active: datetime | None, ended: datetime | None, *, now: datetime | None = None) -> str:
    """``training`` while a publish or metric arrived within :data:`TRAINING_WINDOW`; ``finished`` once the
    newest attempt ended after its last write; else ``idle``."""
    if ended is not None and (active is None or ended >= active):
        return "finished"
    if active is not None and (now or now_utc()) - active < TRAINING_WINDOW:
        return "training"
    return "idle"


def runs_table(reg: Registry, *, columns: Sequence[str] = (), where: Sequence[str] = (), sort: str | None = None,
               now: datetime | None = None) -> dict[str, Any]:
    """The runs that :meth:`Registry.search_runs` finds for ``where`` and ``sort`` (its grammar,
    :mod:`registry.format.search`, and its one SELECT), each as ``runs_doc`` has it, with its state and the
    value of each of ``columns``: a metric's ``{"value", "step"}`` (``KEY:min``: the best at a live checkpoint,
    the step ``RUN@best:KEY`` loads), a parameter's ``{"value"}`` with no step.

    Without ``columns``, one: :func:`default_column` of the metrics the runs' newest live steps carry.
    """
    from registry.catalog.params import ParamsCatalog
    shown = parse_columns(columns) if columns else ()
    search = Search(where=parse_where(where) if where else (), sort=parse_sort_keys(sort) if sort else (),
                    columns=shown)
    runs = {r.name: r for r in reg.runs()}
    newest = reg.catalog.resolve_each([parse_ref(f"{name}@{kind}") for kind in ("latest", "latest-published")
                                       for name in runs])
    verified, live = dict(zip(runs, newest[:len(runs)])), newest[len(runs):]
    default = None
    if not shown:
        default = default_column(i.metrics for i in live if i is not None)
        search = replace(search, columns=(default,) if default is not None else ())
    found = ParamsCatalog(reg.catalog).search(search)
    activity = reg.catalog.run_activity()
    docs = []
    for f in found:
        run = runs.get(f.name)
        if run is None:  # created since the runs were listed
            continue
        doc = run.to_json()
        latest = verified[f.name]
        doc["latest_verified_step"] = latest.step if latest is not None else None
        active, ended = activity.get(f.name, (None, None))
        doc["state"] = run_state(active, ended, now=now)
        doc["active_at"] = active.isoformat() if active else None
        doc["ended_at"] = ended.isoformat() if ended else None
        doc["values"] = {c.spec: {"value": f.values.get(c.spec), "step": f.steps.get(c.spec)}
                         for c in search.columns}
        docs.append(doc)
    return {"columns": [c.spec for c in search.columns], "default_column": default.spec if default else None,
            "where": [str(c) for c in search.where], "sort": ",".join(str(k) for k in search.sort) or None,
            "metric_keys": sorted({k for i in live if i is not None for k in i.metrics}),
            "training_window_s": int(TRAINING_WINDOW.total_seconds()), "runs": docs}


def checkpoints_doc(infos: Iterable[CheckpointInfo]) -> list[dict[str, Any]]:
    """``ls --json``."""
    return [i.to_json() for i in infos]


def metrics_doc(points: Iterable[MetricPoint]) -> list[dict[str, Any]]:
    """``metrics --json``."""
    return [p.to_json() for p in points]


def events_doc(events: Iterable[EventInfo]) -> list[dict[str, Any]]:
    return [e.to_json() for e in events]


def verify_doc(results: Iterable[VerifyResult]) -> list[dict[str, Any]]:
    """``verify --json``."""
    return [{"run": r.run, "step": r.step, "ok": r.ok, "status": r.status, "problems": list(r.problems)}
            for r in results]


def gc_doc(plan: RetentionPlan, *, dry_run: bool, result: RetentionResult | None,
           shared_bytes: int | None = None) -> dict[str, Any]:
    """``gc --json``: the plan with its reasons, and what executing it did (None for a dry run).

    ``shared_bytes``: :func:`plan_shared_bytes`, measured before the plan ran (after, the links are gone).
    """
    doc = plan.to_json()
    doc["dry_run"] = dry_run
    doc["shared_bytes"] = plan_shared_bytes(plan) if shared_bytes is None else shared_bytes
    doc["result"] = result.to_json() if result is not None else None
    return doc


def plan_shared_bytes(plan: RetentionPlan) -> int:
    """Of the files a plan deletes, the bytes that kept steps hold too (``RetentionPlan.shared_bytes``)."""
    return plan.shared_bytes


def retention_preview(reg: Registry, run: str, policy_text: str, *,
                      allow_missing_metric: bool = False) -> dict[str, Any]:
    """What ``gc RUN --dry-run --json`` prints for the policy typed as text (``keep-last 3, ...``)."""
    from registry.ops.policies import parse_policy_text
    policy = parse_policy_text(policy_text)
    plan = reg.plan_retention(run, policy, allow_missing_metrics=allow_missing_metric)
    return gc_doc(plan, dry_run=True, result=None)


LINEAGE_HEADERS = ("STEP", "STATUS", "HOW", "FROM", "ATTEMPT", "WHEN")


def lineage_rows(hops: Iterable[LineageHop]) -> list[list[Any]]:
    """``lineage REF`` as a table (the CLI's and the step page's): one row per hop, nearest first."""
    rows: list[list[Any]] = []
    for h in hops:
        if h.how == "imported" and h.source:
            origin = f"{h.source.get('path')} ({h.source.get('layout')})"
        elif h.parent_run is not None:
            origin = f"{h.parent_run}@{h.parent_step}" + (" (since replaced)" if h.parent_replaced else
                                                          " (cycle: already above)" if h.parent_repeated else "")
        else:
            origin = "-"
        rows.append([h.ref, h.status.upper() if h.status in ("deleted", "missing", "corrupt") else h.status,
                     h.how, origin, h.attempt if h.attempt is not None else "-", format_time(h.when)])
    return rows


# ---------------------------------------------------------------------- one step


@dataclass(frozen=True, kw_only=True)
class StepView:
    """Everything ``show`` says about one step, including a deleted or failed one."""

    ref: str
    info: CheckpointInfo
    files: tuple[FileRecord, ...]
    events: tuple[EventInfo, ...]
    ended: EventInfo | None
    manifest: dict[str, Any]
    shared_bytes: int = 0  # stored once with other steps of the run (hard links made by dedup)
    copies: tuple[Any, ...] = ()  # on a root with a durable tier: each tier's copy (registry.catalog.replicas)
    tag_notes: Mapping[str, str] = field(default_factory=dict)  # the step's tags that carry a note
    params: Mapping[str, Any] = field(default_factory=dict)  # the run's parameters
    attempt: AttemptInfo | None = None  # the attempt that wrote the step, with its code and environment

    def to_json(self) -> dict[str, Any]:
        doc = self.info.to_json()
        doc["ref"] = self.ref
        doc["files"] = [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files]
        doc["manifest"] = self.manifest
        doc["events"] = events_doc(self.events)
        doc["ended_by"] = self.ended.to_json() if self.ended is not None else None
        doc["shared_bytes"] = self.shared_bytes
        doc["copies"] = [{"location": c.location, "status": c.status, "path": c.path,
                          "manifest_sha256": c.manifest_sha256,
                          "durable_at": c.durable_at.isoformat() if c.durable_at else None}
                         for c in self.copies]
        doc["tag_notes"] = dict(self.tag_notes)
        doc["params"] = dict(self.params)
        doc["attempt"] = self.attempt.to_json() if self.attempt is not None else None
        return doc


def code_summary(env: Mapping[str, Any]) -> str:
    """The code and environment an attempt ran in, in one line:
    ``git 1d6feaa (main, dirty)  python 3.11.7  torch 2.6.0  registry 0.1.0  on HOST``."""
    git = env.get("git")
    if isinstance(git, dict) and git.get("commit"):
        where = ", ".join(x for x in (git.get("branch"), "dirty" if git.get("dirty") else None) if x)
        code = f"git {str(git['commit'])[:12]}" + (f" ({where})" if where else "")
    else:
        code = "no git repository"
    versions = "  ".join(f"{name} {env[name]}" for name in ("python", "torch", "registry") if env.get(name))
    return f"{code}  {versions}  on {env.get('host') or '-'}"


def step_view(reg: Registry, ref: str) -> StepView:
    """``show REF``: a live step by any ref, or a deleted, failed or staging one named by its number."""
    parsed = parse_ref(ref)
    try:
        info = reg.resolve(parsed)
    except CheckpointNotFoundError:
        row = reg.catalog.get(parsed.run, parsed.step) if parsed.step is not None else None
        if row is None or row.status not in NO_PAYLOAD:
            raise
        info = reg.placed(row)
    from registry.fs.inodes import shared_bytes
    events = reg.events(info.run, step=info.step)
    shared = 0
    if info.status not in NO_PAYLOAD and reg.root.can.links:
        others = [i.path for i in reg.checkpoints(info.run, include_deleted=True)
                  if i.status in HAS_PAYLOAD and i.step != info.step]
        shared = shared_bytes(info.path, others)
    copies = tuple(reg.replicas(info.run, info.step)) if reg.root.can.tiers else ()
    manifest = manifest_summary(lambda: reg.root.manifest_bytes(info))
    notes = {t.name: t.note for t in reg.tags(info.run) if t.step == info.step and t.note}
    attempt = next(iter(reg.attempts(info.run, step=info.step)), None)
    return StepView(ref=ref, info=info, files=tuple(reg.catalog.files(info.run, info.step)), events=tuple(events),
                    ended=ending_event(info.status, events), manifest=manifest, shared_bytes=shared, copies=copies,
                    tag_notes=notes, params=reg.params(info.run), attempt=attempt)


def ending_event(status: str, events: Sequence[EventInfo]) -> EventInfo | None:
    """The newest event that put a deleted or failed step in that status, or None."""
    if status not in ENDED:
        return None
    return next((e for e in reversed(events)
                 if e.detail.get("status") == status or (status == Status.FAILED and e.kind == "publish-failed")), None)


def manifest_summary(read: Callable[[], tuple[bytes, Path]]) -> dict[str, Any]:
    """What the manifest that ``read`` returns (its bytes, and where they were) says, or why it cannot be read.

    ``show`` must work on a corrupt step.
    """
    from registry.format.manifest import digest_bytes, parse_manifest
    try:
        raw, where = read()
        manifest, digest = parse_manifest(raw, path=where), digest_bytes(raw)
    except (RegistryError, OSError) as exc:
        return {"error": str(exc)}
    layout = manifest.layout
    return {"format_version": manifest.format_version, "sha256": digest,
            "files": len(manifest.files), "tensors": len(manifest.tensors),
            "created_at": manifest.created_at, "optimizer_step": manifest.optimizer_step,
            "policy_version": manifest.policy_version,
            "layout": None if layout is None else {
                "kind": layout.kind, "world_size": layout.world_size,
                "files_per_rank": [len(names) for names in layout.files_per_rank],
                "bytes": sum(manifest.files[n].size for n in layout.data_files)}}


def load_snippets(info: CheckpointInfo, *, root: Any = None, url: str | None = None,
                  durable: str | None = None) -> dict[str, str]:
    """The exact lines that load this step, from a shell and from Python.

    ``root``, ``url`` and ``durable`` (the registry's, e.g. the ones ``registry ui`` was started with) are
    spelled out, so the lines work from any directory and any host of a tiered root; ``url`` only where it is
    not the root's default catalog, its password hidden.
    """
    ref = f"{info.run}@{info.step}"
    options, args = "", ""
    if root is not None:
        import shlex

        from registry.fs.store import Store
        if url is not None and url == f"sqlite:///{Store.default_catalog(Path(root))}":
            url = None
        if url is not None:
            from registry.catalog.session import safe_url
            url = safe_url(url)
        options = (f" --root {shlex.quote(str(root))}" + (f" --url {shlex.quote(url)}" if url else "")
                   + (f" --durable {shlex.quote(durable)}" if durable else ""))
        args = f"root={str(root)!r}" + (f", url={url!r}" if url else "") + (f", durable={durable!r}" if durable else "")
    return {"shell": f"registry{options} show {ref}\nregistry{options} resolve {ref}",
            "python": ("from registry import Registry\n\n"
                       f"with Registry.open({args}) as reg:\n"
                       f"    ckpt = reg.load({ref!r})\n"
                       "    model.load_state_dict(ckpt.state_dict)")}


# ---------------------------------------------------------------------- curves


def downsample(points: Sequence[tuple[int, float]], *, buckets: int,
               keep_steps: Iterable[int] = ()) -> list[tuple[int, float]]:
    """At most about ``2 * buckets`` points of a curve sorted by step, its shape kept.

    Each of ``buckets`` equal step ranges keeps its lowest and highest point
    (so a spike never disappears), and every point at a step in
    ``keep_steps`` (the checkpoints) is kept whatever its bucket, so a marker
    always sits on the curve. A curve already short enough is returned whole.
    """
    if len(points) <= 2 * buckets:
        return list(points)
    keep = set(keep_steps)
    first, last = points[0][0], points[-1][0]
    width = max(1.0, (last - first + 1) / buckets)
    chosen: dict[int, tuple[int, float]] = {}
    low: tuple[int, float] | None = None
    high: tuple[int, float] | None = None
    bucket = -1
    for point in points:
        b = int((point[0] - first) / width)
        if b != bucket:
            for p in (low, high):
                if p is not None:
                    chosen[p[0]] = p
            bucket, low, high = b, point, point
        else:
            if point[1] < low[1]:  # type: ignore[index]
                low = point
            if point[1] > high[1]:  # type: ignore[index]
                high = point
        if point[0] in keep:
            chosen[point[0]] = point
    for p in (low, high):
        if p is not None:
            chosen[p[0]] = p
    return sorted(chosen.values())


def run_view(reg: Registry, run: str, *, key: str | None = None,
             max_points: int = DEFAULT_CURVE_POINTS) -> dict[str, Any]:
    """The run page's data: every checkpoint (any status), the metric keys, one curve, the events.

    The curve of ``key`` (default: the first key, ``eval/loss`` if logged) is
    downsampled to about ``max_points`` points (see :func:`downsample`);
    ``total_points`` says how many there were. Each checkpoint carries the
    curve's value at its step (None where the metric was not logged there).
    """
    check_run_name(run)
    marks = reg.catalog.checkpoint_marks(run)
    keys = reg.catalog.metric_keys(run)
    if key is None and keys:
        key = "eval/loss" if "eval/loss" in keys else keys[0]
    raw = reg.catalog.curve(run, check_metric_key(key)) if key is not None else []
    values = dict(raw)
    curve = downsample(raw, buckets=max(1, max_points // 2), keep_steps=[m[0] for m in marks])
    return {
        "run": run, "key": key, "keys": keys,
        "checkpoints": [{"step": step, "status": status, "tags": list(tags), "total_bytes": size,
                         "value": values.get(step), "created_at": created.isoformat() if created else None}
                        for step, status, size, created, tags in marks],
        "curve": {"points": [[s, v if math.isfinite(v) else None] for s, v in curve],
                  "total_points": len(raw), "downsampled": len(curve) < len(raw)},
        "events": events_doc(reg.events(run)),
    }


__all__ = ["PARAMS", "StepView", "checkpoints_doc", "default_column", "downsample", "events_doc", "format_age",
           "format_time", "gc_doc", "load_snippets", "metrics_doc", "retention_preview", "run_state", "run_view",
           "runs_doc", "runs_table", "step_view", "value_at", "verify_doc"]
