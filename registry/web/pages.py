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
from registry.views import StepView, format_age, format_time, load_snippets


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


def runs_page(runs: Sequence[dict[str, Any]], *, metric: str) -> str:
    """Every run: last step, latest verified step, best value of ``metric``, size, age; sortable and filterable."""
    from datetime import datetime
    rows = []
    for r in runs:
        created = datetime.fromisoformat(r["created_at"]) if r["created_at"] else None
        stamp = created.timestamp() if created else None
        best = r.get("best") or {}
        value = best.get("value")
        rows.append(
            f'<tr data-run="{escape(r["name"])}"><td><a href="/runs/{quote(r["name"])}">{escape(r["name"])}</a></td>'
            + _cell(r["checkpoints"], r["checkpoints"]) + _cell(r["latest_step"], r["latest_step"])
            + _cell(r["latest_verified_step"], r["latest_verified_step"])
            + _cell(None if value is None else f"{value:.6g}", value)
            + _cell(human_bytes(r["total_bytes"]), r["total_bytes"])
            + _cell(format_time(created), stamp)
            + _cell(format_age(created), -stamp if stamp is not None else None) + "</tr>")
    heads = ["run", "checkpoints", "last step", "latest verified", f"best {metric}" if metric else "best",
             "size", "created", "age"]
    header = "".join(f'<th data-col="{i}" tabindex="0">{escape(h)}</th>' for i, h in enumerate(heads))
    body = (f'<h1>Runs <small>{len(runs)}</small></h1>'
            '<form class="bar" method="get" action="/">'
            '<input id="filter" type="search" placeholder="filter by name" autocomplete="off">'
            f'<label>best of <input id="metric" name="metric" value="{escape(metric)}" '
            'placeholder="eval/loss or eval/acc:max"></label><button>show</button></form>'
            f'<table id="runs" class="sortable"><thead><tr>{header}</tr></thead><tbody>{"".join(rows)}</tbody></table>')
    return layout("runs", body, scripts=["runs.js"])


def run_page(run: str, keys: Sequence[str]) -> str:
    """The shell the run page's script fills from ``/api/runs/RUN/view``: curve, markers, events, retention."""
    options = "".join(f'<option value="{escape(k)}">{escape(k)}</option>' for k in keys)
    body = (f'<h1 id="run" data-run="{escape(run)}">{escape(run)}</h1>'
            f'<div class="bar"><label>metric <select id="key">{options}</select></label>'
            '<span id="curve-note" class="note"></span></div>'
            '<div id="chart" class="chart"></div><div id="legend" class="legend"></div>'
            '<h2>Retention preview <small>read-only: nothing is deleted</small></h2>'
            '<form id="retention" class="bar"><input id="policy" size="48" '
            'placeholder="keep-last 3, keep-best eval/loss 2, keep-every 1000, max-bytes 10G">'
            '<button>preview</button></form><div id="plan"></div>'
            '<h2>Checkpoints</h2><table id="checkpoints"><thead><tr><th>step</th><th>status</th><th>tags</th>'
            '<th>value</th><th>size</th><th>created</th></tr></thead><tbody></tbody></table>'
            '<h2>Events</h2><ol id="events" class="timeline"></ol>')
    return layout(run, body, scripts=["chart.js", "run.js"])


def _pre(text: str, cls: str) -> str:
    return f'<pre class="{cls}">{escape(text)}</pre>'


def step_page(view: StepView, *, lineage: Any = None) -> str:
    """One step: manifest summary, files, metrics, tags, events, lineage if recorded, the lines that load it."""
    info = view.info
    manifest = view.manifest
    summary = (f'<p class="error">manifest unreadable: {escape(manifest["error"])}</p>' if "error" in manifest else
               "<dl>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}"
                                + (f" <small>{LOCAL_TIME}</small>" if k == "created_at" else "")
                                + "</dd>" for k, v in manifest.items())
               + "</dl>")
    facts = {"status": str(info.status), "path": str(info.path), "size": human_bytes(info.total_bytes),
             "epoch": info.epoch, "consumed samples": info.consumed_samples, "policy version": info.policy_version,
             "created": format_time(info.created_at), "verified": format_time(info.verified_at),
             "manifest sha256": info.manifest_sha256, "tags": ", ".join(info.tags) or "-"}
    if view.ended is not None:
        facts["ended by"] = f"{view.ended.kind} at {format_time(view.ended.created_at)}"
    files = "".join(f"<tr><td>{escape(f.name)}</td><td>{human_bytes(f.size)}</td><td><code>{f.sha256[:16]}</code></td>"
                    "</tr>" for f in view.files)
    metrics = "".join(f"<tr><td>{escape(k)}</td><td>{v:.6g}</td></tr>" for k, v in sorted(info.metrics.items()))
    events = "".join(f'<li><time>{escape(format_time(e.created_at))}</time> <b>{escape(e.kind)}</b> '
                     f'<code>{escape(json.dumps(e.detail, sort_keys=True))}</code></li>' for e in view.events)
    snippets = load_snippets(info)
    body = (f'<h1 id="step" data-status="{escape(str(info.status))}"><a href="/runs/{quote(info.run)}">'
            f'{escape(info.run)}</a>@{info.step} <span class="badge s-{escape(str(info.status))}">'
            f'{escape(str(info.status))}</span></h1>'
            "<dl>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in facts.items()) + "</dl>"
            f"<h2>Load it</h2>{_pre(snippets['shell'], 'shell')}{_pre(snippets['python'], 'python')}"
            f"<h2>Manifest</h2>{summary}"
            f'<h2>Files</h2><table id="files"><thead><tr><th>name</th><th>size</th><th>sha256</th></tr></thead>'
            f"<tbody>{files}</tbody></table>"
            f'<h2>Metrics</h2><table id="metrics"><tbody>{metrics or "<tr><td>none</td></tr>"}</tbody></table>'
            + (f'<h2>Lineage</h2><pre id="lineage">{escape(_lineage_text(lineage))}</pre>' if lineage is not None
               else "")
            + f'<h2>Events</h2><ol class="timeline">{events}</ol>')
    return layout(f"{info.run}@{info.step}", body)


def _lineage_text(lineage: Any) -> str:
    """The recorded lineage as ``registry lineage`` prints it."""
    from registry.views import LINEAGE_HEADERS, lineage_rows
    rows = [list(LINEAGE_HEADERS)] + [[str(c) for c in row] for row in lineage_rows(lineage)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(LINEAGE_HEADERS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


__all__ = ["error_page", "run_page", "runs_page", "step_page"]
