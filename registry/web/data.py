"""The web view's own documents: run health, several runs compared, a step's tensors, events in words.

Each reads through the registry (the catalog, or the step's files with the
readers a load uses) and writes nothing; :mod:`registry.views` keeps the
documents the command line shares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import InvalidNameError, RegistryError
from registry.format.refs import check_metric_key, check_run_name, parse_ref
from registry.ops.reading import check_digest
from registry.records import CheckpointInfo, EventInfo, Status
from registry.views import (DEFAULT_CURVE_POINTS, downsample, format_time, run_state, runs_doc, runs_table, value_at,
                            TRAINING_WINDOW)

if TYPE_CHECKING:
    from registry.api import Registry

MAX_COMPARED = 12  # runs or keys on one chart: more is not readable


def _with_health(reg: Registry, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    health = reg.catalog.run_health()
    for doc in docs:
        counts, last = health.get(doc["name"], ({}, None))
        doc["statuses"] = {s.value: counts.get(s.value, 0) for s in Status if counts.get(s.value)}
        doc["corrupt"] = counts.get(Status.CORRUPT, 0)
        doc["failed"] = counts.get(Status.FAILED, 0)
        doc["last_updated"] = last.isoformat() if last is not None else None
    return docs


def health_doc(reg: Registry, *, sort_by: str | None = None, now: datetime | None = None) -> list[dict[str, Any]]:
    """``runs_doc`` with each run's checkpoints by status, its damage, when it last changed and its state
    (:func:`~registry.views.run_state`)."""
    docs = _with_health(reg, runs_doc(reg, sort_by=sort_by))
    activity = reg.catalog.run_activity()
    for doc in docs:
        active, ended = activity.get(doc["name"], (None, None))
        doc["state"] = run_state(active, ended, now=now)
        doc["active_at"] = active.isoformat() if active is not None else None
    return docs


def table_doc(reg: Registry, *, columns: Sequence[str] = (), where: Sequence[str] = (), sort: str | None = None,
              now: datetime | None = None) -> dict[str, Any]:
    """The runs page: :func:`~registry.views.runs_table` of the query's ``columns``, ``where`` and ``sort``
    (as written in the URL, in the grammar of ``registry runs``), each run with its health as :func:`health_doc`
    has it."""
    table = runs_table(reg, columns=columns, where=where, sort=sort, now=now)
    _with_health(reg, table["runs"])
    return table


def _names(values: Sequence[str], what: str) -> list[str]:
    names = list(dict.fromkeys(v for v in values if v))
    if len(names) > MAX_COMPARED:
        raise InvalidNameError(f"at most {MAX_COMPARED} {what} on one chart (asked for {len(names)})")
    return names


def compare_doc(reg: Registry, runs: Sequence[str], keys: Sequence[str], *, mode: str = "min",
                max_points: int = DEFAULT_CURVE_POINTS) -> dict[str, Any]:
    """Curves of ``keys`` for each of ``runs`` (one series per pair), their ``@latest`` and ``@best:KEY``
    steps, and a table: per run, the newest step, the latest verified step, and per key its best and last value.

    ``keys`` default to the first run's ``eval/loss`` (or its first key); ``mode`` ``max`` ranks best by
    the highest value. Each curve is downsampled as the run page's is, every checkpoint step kept.
    """
    if mode not in ("min", "max"):
        raise InvalidNameError(f"best is by min or max, not {mode!r}")
    runs = [check_run_name(r) for r in _names(runs, "runs")]
    if not runs:
        raise InvalidNameError("name at least one run to compare (?run=NAME&run=OTHER)")
    keys = [check_metric_key(k) for k in _names(keys, "metrics")]
    if not keys:
        first = reg.catalog.metric_keys(runs[0])
        keys = ["eval/loss"] if "eval/loss" in first else first[:1]
    refs = [parse_ref(f"{run}@latest") for run in runs]
    refs += [parse_ref(f"{run}@best:{key}:{mode}") for run in runs for key in keys]
    found = reg.catalog.resolve_each(refs)
    series, table = [], []
    for i, run in enumerate(runs):
        marks = reg.catalog.checkpoint_marks(run)
        latest = found[i]
        row: dict[str, Any] = {"run": run, "latest_step": marks[-1][0] if marks else None,
                               "latest_verified_step": latest.step if latest else None, "metrics": {}}
        for j, key in enumerate(keys):
            raw = reg.catalog.curve(run, key)
            best = found[len(runs) + i * len(keys) + j]
            values = dict(raw)
            curve = downsample(raw, buckets=max(1, max_points // 2), keep_steps=[m[0] for m in marks])
            series.append({
                "run": run, "key": key, "total_points": len(raw), "downsampled": len(curve) < len(raw),
                "points": [[s, v if math.isfinite(v) else None] for s, v in curve],
                "latest": None if latest is None else {"step": latest.step, "value": values.get(latest.step)},
                "best": None if best is None else {"step": best.step, "value": best.metrics.get(key)},
                "checkpoints": [{"step": step, "status": status, "value": values.get(step)}
                                for step, status, _, _, _ in marks],
            })
            row["metrics"][key] = {"best": None if best is None else best.metrics.get(key),
                                   "best_step": None if best is None else best.step,
                                   "last": raw[-1][1] if raw else None, "last_step": raw[-1][0] if raw else None}
        table.append(row)
    available = sorted({k for run in runs for k in reg.catalog.metric_keys(run)})
    return {"runs": runs, "keys": keys, "available_keys": available, "mode": mode, "series": series,
            "table": table}


def differing_keys(docs: Sequence[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Where JSON documents (one per run; None where unknown) differ, key by key as
    :func:`registry.ops.diff.json_diff` names them, each against the first known one: per key, each
    document's value (``{"value": V}``, ``{"absent": true}``, or None where unknown) and whether it differs
    from the first's."""
    from registry.ops.diff import json_diff
    known = [d for d in docs if d is not None]
    if len(known) < 2:
        return []
    keys = sorted({c.key for d in known[1:] for c in json_diff(known[0], d)})
    rows = []
    for key in keys:
        cells = [None if d is None else dict(zip(("found", "value"), value_at(d, "" if key == "$" else key)))
                 for d in docs]
        first = next(c for c in cells if c is not None)
        rows.append({"key": key,
                     "values": [None if c is None else {"value": c["value"]} if c["found"] else {"absent": True}
                                for c in cells],
                     "differs": [c is not None and _same(c) != _same(first) for c in cells]})
    return rows


def _same(cell: dict[str, Any]) -> tuple[bool, str]:
    """What two cells share when they hold the same JSON: ``1`` is not ``1.0`` nor ``true``."""
    import json
    return cell["found"], json.dumps(cell["value"], sort_keys=True, default=str)


def compare_config(reg: Registry, runs: Sequence[str]) -> dict[str, Any]:
    """The config (and, where the registry records them, the parameters) of each run's newest live step
    (``@latest``, else ``@latest-published``), diffed key by key: what differs, not what all share."""
    runs = [check_run_name(r) for r in _names(runs, "runs")]
    found = reg.catalog.resolve_each([parse_ref(f"{r}@{kind}") for kind in ("latest", "latest-published")
                                      for r in runs])
    steps: list[int | None] = []
    configs: list[dict[str, Any] | None] = []
    notes: dict[str, str] = {}
    for i, run in enumerate(runs):
        info = found[i] or found[len(runs) + i]
        steps.append(info.step if info is not None else None)
        if info is None:
            reg.catalog.read(lambda conn, run=run: reg.catalog.require_run(conn, run))  # no such run: say so
            configs.append(None)
            notes[run] = "no live checkpoint"
            continue
        config, error = step_config(reg.placed(info))
        configs.append(config if error is None else None)
        if error is not None:
            notes[run] = error
        elif not config:
            notes[run] = f"{run}@{info.step} has no config.json"
    params = [reg.params(r) for r in runs]
    return {"runs": runs, "steps": steps, "config": differing_keys(configs), "notes": notes,
            "shared_keys": _leaf_count(next((c for c in configs if c), {})),
            "params": differing_keys(params) if any(params) else None}


def _leaf_count(doc: Any) -> int:
    if isinstance(doc, dict):
        return sum(_leaf_count(v) for v in doc.values())
    if isinstance(doc, list) and doc:
        return sum(_leaf_count(v) for v in doc)
    return 1


def diff_of(reg: Registry, a: str, b: str) -> Any:
    """:meth:`Registry.diff` of the two refs a diff page or ``/api/diff`` names."""
    if not a or not b:
        raise InvalidNameError("name the two steps to diff: ?a=RUN@STEP&b=RUN@STEP (any refs: tags, @latest, ...)")
    return reg.diff(a, b)


def policy_doc(reg: Registry, run: str, *, newest: int = 20) -> dict[str, Any] | None:
    """The run page's Policy section: the ``newest`` policy versions and every consumer with the lag; None when
    the run has neither (or does not exist: the page says so itself)."""
    try:
        versions = reg.policy_versions(run)
        lag = reg.policy_lag(run)
    except RegistryError:
        return None
    if not versions and not lag.consumers:
        return None
    return {"versions": [v.to_json() for v in versions[-newest:]], "lag": lag.to_json()}


def stamp_doc(reg: Registry, run: str, *, now: datetime | None = None) -> dict[str, Any]:
    """What changes when a run moves on (a new checkpoint, event or metric point), and whether it is training
    (:func:`~registry.views.run_state`): the run page polls it."""
    check_run_name(run)
    marks = reg.catalog.checkpoint_marks(run)
    events = reg.catalog.events(run, limit=1)
    counts, last = reg.catalog.run_health(run).get(run, ({}, None))
    active, ended = reg.catalog.run_activity(run).get(run, (None, None))
    return {"run": run, "checkpoints": len(marks), "latest_step": marks[-1][0] if marks else None,
            "last_event": events[-1].id if events else None, "statuses": counts,
            "last_updated": last.isoformat() if last is not None else None,
            "state": run_state(active, ended, now=now), "active_at": active.isoformat() if active else None,
            "training_window_s": int(TRAINING_WINDOW.total_seconds())}


# ---------------------------------------------------------------------- one step


def step_contents(info: CheckpointInfo) -> dict[str, Any]:
    """The step's tensors (name, shape, dtype, bytes, file) and its ``config.json``, read as a load reads them:
    the manifest, then each safetensors header (a few KiB) or a sharded step's DCP ``.metadata``; no tensor data.
    ``error`` says why they cannot be listed (a deleted step, a damaged file); what was read before stays."""
    from registry.format.manifest import CONFIG, read_manifest
    directory = Path(info.path)
    doc: dict[str, Any] = {"tensors": [], "config": None, "error": None}
    if info.status in (Status.DELETED, Status.FAILED, Status.STAGING):
        doc["error"] = f"a {info.status} step has no payload to list"
        return doc
    try:
        manifest, digest = read_manifest(directory)
        check_digest(info, digest)  # another manifest than the catalog's: say so, list nothing
        if manifest.layout is not None:
            doc["tensors"] = _dcp_tensors(directory)
        else:
            doc["tensors"] = _safetensors_tensors(directory, manifest.files)
        if CONFIG in manifest.files:
            from registry.fs.filemaps import read_json
            doc["config"] = read_json(directory, CONFIG)
    except (RegistryError, OSError) as exc:
        doc["error"] = str(exc)
    return doc


def step_config(info: CheckpointInfo) -> tuple[dict[str, Any], str | None]:
    """The step's ``config.json`` (``{}`` without one) read as :func:`step_contents` reads it, and why it
    cannot be read (None when it can)."""
    from registry.format.manifest import CONFIG, read_manifest
    from registry.fs.filemaps import read_json
    directory = Path(info.path)
    try:
        manifest, digest = read_manifest(directory)
        check_digest(info, digest)
        return (read_json(directory, CONFIG) if CONFIG in manifest.files else {}), None
    except (RegistryError, OSError) as exc:
        return {}, str(exc)


def _safetensors_tensors(directory: Path, files: dict[str, Any]) -> list[dict[str, Any]]:
    from registry.format.manifest import open_regular
    from registry.format.safetensors import read_safetensors_header
    out = []
    for name in sorted(n for n in files if n.endswith(".safetensors")):
        fd = open_regular(directory, name)
        with open(fd, "rb", buffering=0) as f:
            header = read_safetensors_header(f, files[name].size, directory / name)
        for e in sorted(header.entries, key=lambda e: e.name):
            out.append({"name": e.name, "shape": list(e.shape), "dtype": str(e.dtype).removeprefix("torch."),
                        "bytes": e.end - e.begin, "file": name})
    return out


def _dcp_tensors(directory: Path) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from registry.format.dcp_metadata import load_dcp_metadata
    out = []
    for name, meta in sorted(load_dcp_metadata(directory).state_dict_metadata.items()):
        if type(meta) is not TensorStorageMetadata:
            continue  # bytes (a pickled object): not a tensor
        shape = [int(d) for d in meta.size]
        properties = meta.properties
        dtype = properties.dtype
        out.append({"name": name, "shape": shape, "dtype": str(dtype).removeprefix("torch."),
                    "bytes": math.prod(shape) * dtype.itemsize, "file": f"sharded ({len(meta.chunks)} chunks)"})
    return out


def remedy(info: CheckpointInfo, *, cli: str) -> list[str]:
    """What to do about a step that cannot be loaded, as lines to run (``cli`` is ``registry`` with the
    UI's ``--url``/``--root``); empty for a loadable step."""
    ref = f"{info.run}@{info.step}"
    if info.status == Status.CORRUPT:
        return ["# re-hash its files against its manifest", f"{cli} verify {ref}",
                f"# the step a load of {info.run} (@latest) uses instead", f"{cli} resolve {info.run}@latest",
                "# reconcile the catalog with the files on disk (add --repair to fix what it finds)", f"{cli} fsck"]
    if info.status in (Status.DELETED, Status.FAILED):
        return [f"# the step a load of {info.run} (@latest) uses instead", f"{cli} resolve {info.run}@latest",
                "# every step of the run, deleted and failed ones too", f"{cli} ls {info.run} --all"]
    return []


# ---------------------------------------------------------------------- events


def _actor(actor: str | None) -> str:
    return "" if not actor else " (" + ":".join(actor.split(":")[:2]) + ")"  # host:pid; the rest is a unique token


def describe_event(e: EventInfo) -> str:
    """One event as a sentence: what happened to which step, without JSON or digests."""
    d = e.detail
    at = f"step {e.step}" if e.step is not None else "the run"
    kind = e.kind
    if kind == "publish":
        n = len(d.get("linked") or ())
        linked = f", {n} file{'s' if n != 1 else ''} shared with an earlier step" if n else ""
        replaced = ", replacing the old one" if d.get("overwrite") else ""
        text = f"published {at} ({d.get('status', 'published')}{replaced}{linked})"
    elif kind == "publish-failed":
        text = f"publishing {at} failed: {d.get('reason', 'no reason recorded')}"
    elif kind == "tag":
        moved = f" (moved from step {d['old_step']})" if d.get("old_step") is not None else ""
        text = f"tagged {at} {d.get('tag')!r}{moved}"
    elif kind == "untag":
        text = f"removed tag {d.get('tag')!r} from {at}"
    elif kind == "delete":
        text = f"deleted {at}: {d.get('reason', 'no reason recorded')}"
    elif kind == "verify":
        text = f"verified {at}: every checksum matches"
    elif kind == "corrupt":
        text = f"marked {at} corrupt: {d.get('reason', 'checksums did not match')}"
    elif kind == "resume":
        text = f"training resumed from {at}"
    elif kind == "takeover":
        text = f"took over {at} from a writer that died"
    elif kind == "repair":
        text = f"fsck repaired {at} ({str(d.get('problem', 'a problem')).replace('-', ' ')}), now {d.get('status')}"
    else:
        problem = kind.replace("-", " ")
        text = f"{problem} at {at}" + (f", now {d['status']}" if d.get("status") else "")
    return text + _actor(e.actor)


def events_in_words(events: Sequence[EventInfo]) -> list[dict[str, Any]]:
    """The events, newest first, each with its sentence and one time format."""
    return [{"id": e.id, "step": e.step, "kind": e.kind, "text": describe_event(e), "time": format_time(e.created_at)}
            for e in reversed(events)]


__all__ = ["compare_config", "compare_doc", "describe_event", "diff_of", "differing_keys", "events_in_words",
           "health_doc", "remedy", "stamp_doc", "step_config", "step_contents", "table_doc"]
