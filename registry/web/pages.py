"""The HTML pages: small server-rendered documents; the run page draws itself from ``/api/runs/RUN/view``.

Everything a page needs ships in ``registry/web/static`` (no CDN, no network).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from typing import Any
from urllib.parse import quote

from registry.records import human_bytes
from registry.views import (PARAMS, TRAINING_WINDOW, StepView, code_summary, format_age, format_time,
                            load_snippets)


LOCAL_TIME = "(writer's local time; no zone recorded)"  # the manifest's format predates zones


def layout(title: str, body: str, *, scripts: Sequence[str] = ()) -> str:
    tags = "".join(f'<script src="/static/{s}"></script>' for s in scripts)
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)} · registry</title>'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<link rel="stylesheet" href="/static/style.css"></head><body>'
            '<header><a class="home" href="/">registry</a><span class="ro">read-only</span></header>'
            f'<main>{body}</main>{tags}</body></html>')


def error_page(message: str) -> str:
    return layout("error", f'<h1>Not here</h1><p class="error">{escape(message)}</p><p><a href="/">all runs</a></p>')


def _cell(value: Any, sort: Any = None) -> str:
    key = "" if sort is None else f' data-sort="{escape(str(sort))}"'
    return f"<td{key}>{'-' if value is None else escape(str(value))}</td>"


def _health(r: dict[str, Any]) -> str:
    damaged = [f"{r[k]} {k}" for k in ("corrupt", "failed") if r.get(k)]
    cls = "damaged" if r.get("corrupt") else ("warn" if damaged else "ok")
    return (f'<td class="health {cls}" data-sort="{r.get("corrupt", 0) * 1000 + r.get("failed", 0)}">'
            f'{escape(", ".join(damaged) if damaged else "healthy")}</td>')


def state_help(window_s: int) -> str:
    """What the run states mean: the tooltip on every state badge."""
    return (f"training: a checkpoint was published (or its publish began) or a metric arrived in the last "
            f"{window_s // 60} minutes; finished: its last attempt ended cleanly; idle: neither")


def _state(state: str, window_s: int) -> str:
    return (f'<span class="state st-{escape(state)}" data-state="{escape(state)}" '
            f'title="{escape(state_help(window_s))}">{escape(state)}</span>')


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return value if isinstance(value, str) else json.dumps(value)


def _column_head(spec: str) -> tuple[str, str]:
    """A column's header and its tooltip."""
    if spec.startswith(PARAMS):
        return spec, f"the run parameter {spec[len(PARAMS):]}"
    key, _, mode = spec.partition(":")
    if mode == "last":
        return f"last {key}", f"{key} at the newest live checkpoint that has it, and its step"
    ref = f"RUN@best:{key}" + (":max" if mode == "max" else "")
    return (f"best {key}" + (" (max)" if mode == "max" else ""),
            f"the {'highest' if mode == 'max' else 'lowest'} {key} at a live checkpoint, and its step "
            f"(the step {ref} loads)")


def _column_cell(run: str, spec: str, cell: dict[str, Any]) -> str:
    value, step = cell.get("value"), cell.get("step")
    sort = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    key = f' data-sort="{escape(str(sort if sort is not None else _value(value)))}"' if value is not None else ""
    at = f' <a class="at" href="/runs/{quote(run)}/steps/{step}">@{step}</a>' if step is not None else ""
    shown = "-" if value is None else escape(_value(value))
    return f'<td class="col" data-spec="{escape(spec)}"{key}>{shown}{at}</td>'


def runs_page(table: dict[str, Any], *, error: str | None = None, columns: str = "", where: str = "") -> str:
    """Every run: its state, health (corrupt and failed steps), live checkpoints, last and latest verified step,
    a column per chosen metric (its best value and step) or parameter, size, last update; filtered by ``where``,
    sorted by a column; tick runs to compare them."""
    from datetime import datetime
    runs, specs, window = table["runs"], table["columns"], table["training_window_s"]
    rows = []
    for r in runs:
        updated = datetime.fromisoformat(r["last_updated"]) if r.get("last_updated") else None
        stamp = updated.timestamp() if updated else None
        name = escape(r["name"])
        rows.append(
            f'<tr data-run="{name}" data-state="{escape(r["state"])}"><td><input type="checkbox" name="run" '
            f'value="{name}" form="compare-form" aria-label="compare {name}"></td>'
            f'<td class="name" data-sort="{name}"><a href="/runs/{quote(r["name"])}">{name}</a> '
            f'{_state(r["state"], window)}</td>'
            + _health(r) + _cell(r["checkpoints"], r["checkpoints"]) + _cell(r["latest_step"], r["latest_step"])
            + _cell(r["latest_verified_step"], r["latest_verified_step"])
            + "".join(_column_cell(r["name"], spec, r["values"][spec]) for spec in specs)
            + _cell(human_bytes(r["total_bytes"]), r["total_bytes"])
            + _cell(format_time(updated), stamp)
            + _cell(format_age(updated) + " ago" if updated else None, -stamp if stamp is not None else None)
            + "</tr>")
    sort = table.get("sort") or ""
    heads: list[tuple[str, str, dict[str, str]]] = [
        (text, "", {}) for text in ("", "run", "health", "live checkpoints", "last step", "latest verified")]
    for spec in specs:
        text, tip = _column_head(spec)
        attrs = {"spec": spec, "best": "max" if spec.endswith(":max") else "min"}
        if sort.removeprefix("-") == spec:
            attrs["dir"] = ("desc" if spec.endswith(":max") else "asc") if not sort.startswith("-") else \
                ("asc" if spec.endswith(":max") else "desc")
        heads.append((text, tip, attrs))
    heads += [("size", "", {}), ("last updated", "", {}), ("age", "", {})]
    header = "".join(f'<th data-col="{i}" tabindex="0"' + (f' title="{escape(tip)}"' if tip else "")
                     + "".join(f' data-{k}="{escape(v)}"' for k, v in attrs.items()) + f">{escape(text)}</th>"
                     for i, (text, tip, attrs) in enumerate(heads))
    offered = "".join(f'<option value="{escape(k)}">{escape(k)}</option>'
                      + f'<option value="{escape(k)}:max">{escape(k)} (max)</option>' for k in table["metric_keys"])
    shown = columns or ", ".join(specs)
    default = table.get("default_column")
    note = (f'<p class="note" id="default-column">best of {escape(default)}, picked from the metrics the runs log; '
            "name others in columns</p>" if default and not columns else "")
    filtered = (f'<p class="note" id="filtered">{len(runs)} runs where {escape(" and ".join(table["where"]))}</p>'
                if table["where"] else "")
    body = (f'<h1>Runs <small>{len(runs)}</small></h1>'
            + (f'<p class="error" id="table-error">{escape(error)}</p>' if error else "")
            + '<form class="bar" id="table-form" method="get" action="/">'
            '<input id="filter" type="search" placeholder="filter by name" autocomplete="off">'
            f'<label>columns <input id="columns" name="columns" size="34" value="{escape(shown)}" '
            'placeholder="eval/loss, eval/acc:max, params.lr"></label>'
            f'<select id="add-column" aria-label="add a column"><option value="">+ metric</option>{offered}</select>'
            f'<label>where <input id="where" name="where" size="26" value="{escape(where)}" '
            'placeholder="eval/loss < 0.5, params.lr <= 1e-3"></label>'
            f'<input type="hidden" id="sort" name="sort" value="{escape(sort)}">'
            '<button>show</button></form>'
            + note + filtered +
            '<form id="compare-form" class="bar" method="get" action="/compare">'
            '<button id="compare">compare ticked runs</button>'
            '<span class="note">live = published or verified; health counts corrupt and failed steps; '
            f'<span title="{escape(state_help(window))}">training, idle or finished</span> says whether a trainer '
            'is writing to it</span></form>'
            f'<div class="wide"><table id="runs" class="sortable"><thead><tr>{header}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')
    return layout("runs", body, scripts=["runs.js"])


def _chart_controls(label: str) -> str:
    return (
            '<div class="bar controls"><span id="keys" class="keys" data-label="{label}"></span>'
            '<label><input type="checkbox" id="log"> log scale</label>'
            '<label>smoothing <input type="range" id="smooth" min="0" max="0.99" step="0.01" value="0">'
    '<output id="smooth-value">0</output></label>'
            '<label><input type="checkbox" id="higher"> higher is better</label>'
            '<span id="curve-note" class="note"></span></div>'
            '<div id="chart" class="chart"><p class="loading">loading…</p></div><div id="legend" class="legend"></div>'
            ).replace("{label}", escape(label))


def run_page(run: str, keys: Sequence[str], *, policy: dict[str, Any] | None = None) -> str:
    """The shell the run page's script fills: curves with checkpoints, ``@latest`` and ``@best``, events,
    retention; it polls for new steps while the run is training. ``policy``: the run's policy versions and
    consumers (``registry.web.data.policy_doc``), drawn here when it has any."""
    default = "eval/loss" if "eval/loss" in keys else (keys[0] if keys else "")
    options = "".join(f'<option value="{escape(k)}"{" selected" if k == default else ""}>{escape(k)}</option>'
                      for k in keys)
    body = (f'<h1 id="run" data-run="{escape(run)}">{escape(run)} '
            f'<small id="live-state" title="{escape(state_help(int(TRAINING_WINDOW.total_seconds())))}"></small></h1>'
            f'<div class="bar"><label>metric <select id="key">{options}</select></label>'
            '<label><input type="checkbox" id="refresh"> auto-refresh</label></div>'
            + _chart_controls("also plot") +
            '<h2>Retention preview <small>read-only: nothing is deleted</small></h2>'
            '<form id="retention" class="bar"><input id="policy" size="48" '
            'placeholder="keep-last 3, keep-best eval/loss 2, keep-every 1000, max-bytes 10G">'
            '<button>preview</button></form><div id="plan"></div>'
            '<h2>Checkpoints</h2><table id="checkpoints"><thead><tr><th>step</th><th>status</th><th>tags</th>'
            '<th>value</th><th>size</th><th>created</th></tr></thead>'
            '<tbody><tr class="loading"><td colspan="6">loading…</td></tr></tbody></table>'
            + (policy_section(policy) if policy is not None else "") +
            '<h2>Events</h2><ol id="events" class="timeline"><li class="loading">loading…</li></ol>')
    return layout(run, body, scripts=["chart.js", "run.js"])


def policy_section(doc: dict[str, Any]) -> str:
    """The run's newest policy versions and its consumers, with the lag (``registry policy ls``/``consumers``)."""
    lag = doc["lag"]
    rows = "".join(f'<tr><td>{v["version"]}</td><td>{"-" if v["step"] is None else v["step"]}</td>'
                   f'<td>{escape(v["kind"])}{" (anchored)" if v.get("anchored") else ""}</td>'
                   f'<td>{"-" if v["base_step"] is None else v["base_step"]}</td>'
                   f'<td>{"-" if v["kind"] == "marker" else human_bytes(v["total_bytes"])}</td>'
                   f'<td>{escape(v["status"])}</td></tr>' for v in reversed(doc["versions"]))
    consumers = "".join(
        f'<tr><td>{escape(c["name"])}</td><td>{escape(c["host"])}</td>'
        f'<td>{"-" if c["applied_version"] is None else c["applied_version"]}</td>'
        f'<td>{"-" if c["lag"] is None else c["lag"]}</td>'
        f'<td>{"ended" if c["ended_at"] else ("live" if c["live"] else "expired")}</td></tr>'
        for c in lag["consumers"])
    newest = "-" if lag["newest_version"] is None else lag["newest_version"]
    return (f'<h2 id="policy-channel">Policy <small>newest version {newest}, lag {lag["lag"]}'
            + (f', pending {escape(", ".join(lag["pending"]))}' if lag["pending"] else "") + '</small></h2>'
            '<table id="policy-versions"><thead><tr><th>version</th><th>step</th><th>kind</th><th>base</th>'
            f'<th>size</th><th>status</th></tr></thead><tbody>{rows}</tbody></table>'
            '<table id="policy-consumers"><thead><tr><th>consumer</th><th>host</th><th>serves</th><th>lag</th>'
            f'<th>state</th></tr></thead><tbody>{consumers}</tbody></table>')


def compare_page(runs: Sequence[str], keys: Sequence[str], config: dict[str, Any] | None = None) -> str:
    """Several runs on one chart, a table of their newest, latest verified, best and last values, and where
    their configs (and parameters) differ."""
    data = escape(json.dumps({"runs": list(runs), "keys": list(keys)}))
    links = ", ".join(f'<a href="/runs/{quote(r)}">{escape(r)}</a>' for r in runs)
    body = (f'<h1 id="compare-page" data-query="{data}">Compare <small>{links}</small></h1>'
            + _chart_controls("metrics") +
            '<table id="compare-table"><thead></thead>'
            '<tbody><tr class="loading"><td>loading…</td></tr></tbody></table>'
            + (_config_diff(config) if config is not None else ""))
    return layout("compare", body, scripts=["chart.js", "compare.js"])


def _diff_cell(cell: dict[str, Any] | None, differs: bool) -> str:
    if cell is None:
        return '<td class="unknown">?</td>'
    cls = "differs" if differs else "same"
    if cell.get("absent"):
        return f'<td class="{cls} absent" title="not set in this run">not set</td>'
    return f'<td class="{cls}"><code>{escape(json.dumps(cell["value"]))}</code></td>'


def _diff_table(table_id: str, heads: Sequence[str], rows: Sequence[dict[str, Any]], prefix: str = "") -> str:
    head = "".join(f"<th>{h}</th>" for h in heads)
    body = "".join(f'<tr data-key="{escape(prefix + r["key"])}"><td><code>{escape(prefix + r["key"])}</code></td>'
                   + "".join(_diff_cell(c, d) for c, d in zip(r["values"], r["differs"])) + "</tr>" for r in rows)
    return f'<table id="{table_id}" class="config-diff"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _config_diff(doc: dict[str, Any]) -> str:
    """The configs of the compared runs' newest live steps, only the keys where they differ."""
    runs, steps = doc["runs"], doc["steps"]
    heads = ["key"] + [f'<a href="/runs/{quote(r)}/steps/{s}">{escape(r)}@{s}</a>' if s is not None
                       else escape(r) for r, s in zip(runs, steps)]
    notes = "".join(f'<li data-run="{escape(r)}">{escape(r)}: {escape(n)}</li>' for r, n in doc["notes"].items())
    out = ('<h2>Config <small>config.json of each run\'s newest live step; only what differs, the first run '
           'is the baseline</small></h2>' + (f'<ul class="note" id="config-notes">{notes}</ul>' if notes else ""))
    if len(runs) < 2:
        out += '<p class="note">tick two runs or more to see where their configs differ</p>'
    elif doc["config"]:
        out += _diff_table("compare-config", heads, doc["config"])
    else:
        out += (f'<p class="note" id="config-same">the same config in every run '
                f'({doc["shared_keys"]} values)</p>')
    if doc.get("params") is not None and len(runs) > 1:
        out += "<h2>Parameters</h2>" + (_diff_table("compare-params", heads, doc["params"], PARAMS)
                                        if doc["params"] else '<p class="note">the same parameters in every run</p>')
    return out


def _pre(text: str, cls: str) -> str:
    return f'<pre class="{cls}">{escape(text)}</pre>'


def _table(table_id: str, heads: Sequence[str], rows: Sequence[Sequence[str]], *, empty: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in heads)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return (f'<table id="{table_id}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{body or f"<tr><td colspan={len(heads)}>{escape(empty)}</td></tr>"}</tbody></table>')


def step_page(view: StepView, *, lineage: Any = None, contents: dict[str, Any] | None = None,
              root: Any = None, url: str | None = None, durable: str | None = None,
              others: Sequence[int] = ()) -> str:
    """One step: its facts, how to load it (or, for a step that cannot be loaded, what to do instead), its
    tensors and config, a diff against another step, files, metrics, lineage if recorded, events in words."""
    from registry.web.data import events_in_words, remedy
    info = view.info
    manifest = view.manifest
    summary = (f'<p class="error">manifest unreadable: {escape(manifest["error"])}</p>' if "error" in manifest else
               "<dl>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}"
                                + (f" <small>{LOCAL_TIME}</small>" if k == "created_at" else "")
                                + "</dd>" for k, v in manifest.items() if k != "sha256" and v is not None)
               + "</dl>")
    # a publish writes epoch and consumed_samples as 0 when not given (meta.json and the catalog alike), so a 0
    # is not told from "never given": only a value that says something is shown, and None never is
    given = {"epoch": info.epoch or None, "consumed samples": info.consumed_samples or None,
             "policy version": info.policy_version, "optimizer step": info.optimizer_step,
             "created": info.created_at and format_time(info.created_at),
             "verified": info.verified_at and format_time(info.verified_at),
             "manifest sha256": info.manifest_sha256 and info.manifest_sha256[:16],
             "tags": ", ".join(f"{t} ({view.tag_notes[t]})" if t in view.tag_notes else t for t in info.tags) or None,
             "code": code_summary(view.attempt.environment) if view.attempt and view.attempt.environment else None}
    facts = {"status": str(info.status), "path": str(info.path), "size": human_bytes(info.total_bytes),
             **{k: v for k, v in given.items() if v is not None}}
    if view.ended is not None:
        facts["ended by"] = f"{view.ended.kind} at {format_time(view.ended.created_at)}"
    snippets = load_snippets(info, root=root, url=url, durable=durable)
    cli = snippets["shell"].split(" show ", 1)[0]
    fixes = remedy(info, cli=cli)
    if fixes:
        why = ("its bytes did not match the manifest: a load of this step fails, and a load of "
               f"{info.run}@latest falls back to the newest good step" if info.status == "corrupt"
               else f"a {info.status} step has no payload to load")
        load = (f'<h2>Cannot be loaded</h2><p class="error" id="remedy-why">{escape(why)}</p>'
                f'<pre id="remedy" class="shell">{escape(chr(10).join(fixes))}</pre>')
    else:
        load = f"<h2>Load it</h2>{_pre(snippets['shell'], 'shell')}{_pre(snippets['python'], 'python')}"
    contents = contents or {"tensors": [], "config": None, "error": None}
    tensors = [[f"<code>{escape(t['name'])}</code>", escape("×".join(map(str, t["shape"])) or "scalar"),
                escape(t["dtype"]), escape(human_bytes(t["bytes"])), escape(t["file"])] for t in contents["tensors"]]
    tensor_note = (f'<p class="error" id="tensors-error">{escape(contents["error"])}</p>' if contents["error"] else
                   f'<p class="note">{len(tensors)} tensors, '
                   f'{human_bytes(sum(t["bytes"] for t in contents["tensors"]))} (from the file headers)</p>')
    config = contents["config"]
    config_html = ("" if config is None else
                   f'<h2>Config</h2><pre id="config">{escape(json.dumps(config, indent=2, sort_keys=True))}</pre>')
    diff = ""
    if others:
        before = max((s for s in others if s < info.step), default=None)
        options = "".join(f'<option value="{escape(info.run)}@{s}"{" selected" if s == before else ""}>{s}</option>'
                          for s in sorted(others, reverse=True))
        diff = ('<form id="diff-form" class="bar" method="get" action="/diff">'
                f'<input type="hidden" name="b" value="{escape(info.run)}@{info.step}">'
                f'<label>diff against step <select name="a">{options}</select></label><button>diff</button></form>')
    files = [[escape(f.name), human_bytes(f.size)] for f in view.files]
    metrics = [[escape(k), f"{v:.6g}"] for k, v in sorted(info.metrics.items())]
    events = "".join(f'<li data-kind="{escape(e["kind"])}"><time>{escape(e["time"])}</time> {escape(e["text"])}</li>'
                     for e in events_in_words(view.events))
    body = (f'<h1 id="step" data-status="{escape(str(info.status))}"><a href="/runs/{quote(info.run)}">'
            f'{escape(info.run)}</a>@{info.step} <span class="badge s-{escape(str(info.status))}">'
            f'{escape(str(info.status))}</span></h1>'
            "<dl>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in facts.items()) + "</dl>"
            + load + diff
            + "<h2>Tensors</h2>" + tensor_note
            + _table("tensors", ["name", "shape", "dtype", "bytes", "file"], tensors, empty="none listed")
            + config_html
            + f'<h2>Metrics</h2>{_table("metrics", ["metric", "value"], metrics, empty="none")}'
            + f'<h2>Files</h2>{_table("files", ["name", "size"], files, empty="none")}'
            + f"<h2>Manifest</h2>{summary}"
            + (f'<h2>Lineage</h2><pre id="lineage">{escape(_lineage_text(lineage))}</pre>' if lineage is not None
               else "")
            + f'<h2>Events</h2><ol class="timeline" id="step-events">{events}</ol>')
    return layout(f"{info.run}@{info.step}", body)


def diff_page(diff: Any) -> str:
    """What changed between two steps, as :meth:`Registry.diff` reports it."""
    doc = diff.to_json()
    a, b = doc["a"], doc["b"]
    def link(ref: str) -> str:
        run, _, step = ref.rpartition("@")
        return f'<a href="/runs/{quote(run)}/steps/{escape(step)}">{escape(ref)}</a>'
    def shape(v: Any) -> str:
        return "-" if v is None else ("×".join(map(str, v)) or "scalar")
    rows = []
    for kind, changes in doc["tensors"].items():
        for t in changes:
            was = f'{t.get("dtype_a") or "-"} {shape(t.get("shape_a"))}'
            now = f'{t.get("dtype_b") or "-"} {shape(t.get("shape_b"))}'
            rows.append([f"<code>{escape(t['name'])}</code>", escape(kind), escape(was), escape(now)])
    def entries(items: Sequence[dict[str, Any]]) -> list[list[str]]:
        def show(v: Any) -> str:
            return "-" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))
        return [[escape(c["key"]), escape(c["change"]), escape(show(c["a"])), escape(show(c["b"]))] for c in items]
    verdict = ("identical tensors, config and metrics" if doc["identical"] else
               f"{len(rows)} tensors differ, {doc['unchanged_tensors']} unchanged")
    body = (f'<h1 id="diff" data-identical="{str(doc["identical"]).lower()}">{link(a)} → {link(b)}</h1>'
            f'<p class="summary">{escape(verdict)}; read {human_bytes(doc["bytes_read"])} of '
            f'{human_bytes(doc["bytes_total"])}</p>'
            + "<h2>Tensors</h2>" + _table("diff-tensors", ["tensor", "change", a, b], rows, empty="no change")
            + "<h2>Metrics</h2>" + _table("diff-metrics", ["metric", "change", a, b], entries(doc["metrics"]),
                                          empty="no change")
            + "<h2>Config</h2>" + _table("diff-config", ["key", "change", a, b], entries(doc["config"]),
                                         empty="no change")
            + "<h2>Files</h2>" + _table("diff-files", ["file", "change", f"{a} bytes", f"{b} bytes"],
                                        entries(doc["files"]), empty="no change"))
    return layout(f"{a} → {b}", body)


def _lineage_text(lineage: Any) -> str:
    """The recorded lineage as ``registry lineage`` prints it."""
    from registry.views import LINEAGE_HEADERS, lineage_rows
    rows = [list(LINEAGE_HEADERS)] + [[str(c) for c in row] for row in lineage_rows(lineage)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(LINEAGE_HEADERS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


__all__ = ["compare_page", "diff_page", "error_page", "run_page", "runs_page", "step_page"]
