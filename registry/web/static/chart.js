// A small self-contained SVG line chart: several curves (runs or metrics) on one step axis, log scale,
// smoothing, every checkpoint marked by status, @latest and @best marked. No dependencies; shipped in the
// wheel (registry/web/static). Status colours match registry/cli/terminal.py.
"use strict";
const STATUS_COLOURS = {verified: "#2ea043", published: "#1f6feb", corrupt: "#cf222e",
                        deleted: "#8c8c8c", failed: "#bf8700", staging: "#8250df"};
const SERIES_COLOURS = ["#0969da", "#bc4c00", "#8250df", "#0598bc", "#bf3989", "#4d2d00", "#1a7f37", "#6e7781"];
const DASHES = ["", "6 3", "2 3", "8 3 2 3"];
const SVG_NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function niceTicks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toPrecision(12));
  return ticks;
}

function fmt(v) { return Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(2) : +v.toPrecision(4) + ""; }

// Exponential moving average with TensorBoard's debiasing: weight 0 is the raw curve.
function smooth(points, weight) {
  if (!(weight > 0)) return points;
  let acc = 0, n = 0;
  return points.map(([s, v]) => {
    if (v === null) return [s, null];
    acc = acc * weight + (1 - weight) * v; n++;
    return [s, acc / (1 - Math.pow(weight, n))];
  });
}

// spec: {series: [{label, points: [[step, value|null]], colour, dash}], checkpoints: [{step, status, tags,
// value, href}], refs: [{ref, step, value, label, colour}] (@latest, @best), log, smooth, yLabel, title}
function drawChart(container, spec) {
  container.textContent = "";
  const width = Math.max(480, container.clientWidth || 900), height = 360;
  const perStep = {};
  for (const r of (spec.refs || [])) perStep[r.step] = (perStep[r.step] || new Set()).add(r.colour);
  const rows = Math.max(1, ...Object.values(perStep).map(c => c.size));
  const m = {left: 72, right: 20, top: 18 + 12 * rows, bottom: 60};
  const ok = v => v !== null && (!spec.log || v > 0);
  const Tv = v => spec.log ? Math.log10(v) : v;
  const series = spec.series.map(s => ({...s, raw: s.points.filter(p => ok(p[1])),
                                        points: smooth(s.points, spec.smooth).filter(p => ok(p[1]))}));
  const checkpoints = spec.checkpoints || [], refs = (spec.refs || []).filter(r => r.step !== null);
  const steps = series.flatMap(s => s.points.map(p => p[0])).concat(checkpoints.map(c => c.step));
  const values = series.flatMap(s => s.points.map(p => Tv(p[1])));
  let x0 = Math.min(...steps), x1 = Math.max(...steps);
  if (!isFinite(x0)) { x0 = 0; x1 = 1; }
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  let y0 = values.length ? Math.min(...values) : 0, y1 = values.length ? Math.max(...values) : 1;
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad;
  const X = s => m.left + (s - x0) / (x1 - x0) * (width - m.left - m.right);
  const Y = v => m.top + (1 - (Tv(v) - y0) / (y1 - y0)) * (height - m.top - m.bottom);
  const root = svg("svg", {width, height, viewBox: `0 0 ${width} ${height}`, class: "chart-svg",
                           "data-scale": spec.log ? "log" : "linear", role: "img",
                           "aria-label": spec.title || spec.yLabel || "no metric"}, container);
  const axisY = height - m.bottom;
  for (const t of niceTicks(y0, y1, 5)) {
    const v = spec.log ? Math.pow(10, t) : t;
    svg("line", {x1: m.left, x2: width - m.right, y1: Y(v), y2: Y(v), class: "grid"}, root);
    svg("text", {x: m.left - 6, y: Y(v) + 4, "text-anchor": "end", class: "tick y-tick"}, root).textContent = fmt(v);
  }
  for (const t of niceTicks(x0, x1, 8).filter(t => Number.isInteger(t))) {
    svg("text", {x: X(t), y: axisY + 30, "text-anchor": "middle", class: "tick x-tick"}, root).textContent = fmt(t);
  }
  svg("line", {x1: m.left, x2: width - m.right, y1: axisY, y2: axisY, class: "axis"}, root);
  svg("line", {x1: m.left, x2: m.left, y1: m.top, y2: axisY, class: "axis"}, root);
  svg("text", {x: (m.left + width - m.right) / 2, y: height - 6, "text-anchor": "middle", class: "label x-label"},
      root).textContent = "step";
  svg("text", {x: 14, y: (m.top + axisY) / 2, "text-anchor": "middle", class: "label y-label",
               transform: `rotate(-90 14 ${(m.top + axisY) / 2})`}, root).textContent =
    (spec.yLabel || "value") + (spec.log ? " (log scale)" : "") + (spec.smooth > 0 ? `, smoothed ${spec.smooth}` : "");
  const line = pts => pts.map(p => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
  series.forEach((s, i) => {
    if (!s.points.length) return;
    const colour = s.colour || SERIES_COLOURS[i % SERIES_COLOURS.length];
    if (spec.smooth > 0) {  // the raw curve stays visible under the smoothed one, as the markers sit on it
      svg("polyline", {points: line(s.raw), class: "curve-raw", fill: "none", stroke: colour,
                       "stroke-dasharray": s.dash || ""}, root);
    }
    svg("polyline", {points: line(s.points), class: "curve", fill: "none", stroke: colour,
                     "stroke-dasharray": s.dash || "", "data-series": s.label}, root);
  });
  const markers = svg("g", {class: "markers"}, root);
  for (const c of checkpoints) {
    const colour = STATUS_COLOURS[c.status] || "#333";
    const on = ok(c.value);
    const link = svg("a", {href: c.href}, markers);
    svg("title", {}, link).textContent =
      `step ${c.step}: ${c.status}` + (c.tags.length ? ` [${c.tags.join(", ")}]` : "") +
      (c.value === null ? "" : ` ${spec.yLabel}=${fmt(c.value)}`);
    if (on) {
      svg("line", {x1: X(c.step), x2: X(c.step), y1: Y(c.value), y2: axisY, stroke: colour, class: "guide"}, link);
      svg("circle", {cx: X(c.step), cy: Y(c.value), r: 3.5, fill: colour, class: "on-curve"}, link);
    }
    svg("path", {d: `M${X(c.step)},${axisY + 2} l-5,9 l10,0 z`, fill: colour, class: "ckpt-marker",
                 "data-step": c.step, "data-status": c.status}, link);
    c.tags.forEach((tag, i) => {
      svg("text", {x: X(c.step), y: (on ? Y(c.value) : axisY - 6) - 10 - 12 * i, class: "tag-label",
                   "text-anchor": "middle", "data-step": c.step}, link).textContent = tag;
    });
  }
  // refs at one step share a line; each colour (run) gets one label line there, stacked above the plot
  const lines = new Map();
  for (const r of refs) {
    const key = `${r.step}|${r.colour}`;
    if (!lines.has(key)) lines.set(key, {...r, labels: [], kinds: []});
    lines.get(key).labels.push(r.label);
    lines.get(key).kinds.push(r.ref);
  }
  const stacked = {};
  for (const r of lines.values()) {
    const row = stacked[r.step] = (stacked[r.step] || 0) + 1;
    const g = svg("g", {class: "ref-marker", "data-ref": r.kinds.join(" "), "data-step": r.step}, root);
    svg("line", {x1: X(r.step), x2: X(r.step), y1: m.top, y2: axisY, stroke: r.colour, class: "ref-line"}, g);
    if (ok(r.value)) svg("circle", {cx: X(r.step), cy: Y(r.value), r: 6, stroke: r.colour, fill: "none",
                                    class: "ref-ring"}, g);
    const right = X(r.step) > width / 2;
    svg("text", {x: X(r.step) + (right ? -4 : 4), y: m.top - 4 - 12 * (row - 1), class: "ref-label",
                 "text-anchor": right ? "end" : "start", fill: r.colour}, g).textContent =
      `${r.labels.join(", ")} (${r.step})`;
  }
  return root;
}

// One swatch per curve, then the checkpoints counted by status.
function drawLegend(container, series, checkpoints) {
  container.textContent = "";
  const item = (colour, text, dash) => {
    const span = document.createElement("span");
    span.className = "legend-item";
    const sw = document.createElement("i");
    sw.style.background = colour;
    if (dash) sw.className = "dashed";
    span.appendChild(sw);
    span.appendChild(document.createTextNode(text));
    container.appendChild(span);
  };
  series.forEach((s, i) => item(s.colour || SERIES_COLOURS[i % SERIES_COLOURS.length], s.label, s.dash));
  const counts = {};
  for (const c of checkpoints || []) counts[c.status] = (counts[c.status] || 0) + 1;
  for (const [status, n] of Object.entries(counts)) item(STATUS_COLOURS[status] || "#333", `${status} ${n}`);
}

// Shared page helpers: elements, sizes, JSON, and the chart toolbar (metric boxes, log, smoothing, best).
function el(tag, text, attrs) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = text;
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i ? n.toFixed(1) + " " + units[i] : n + " B";
}

async function getJSON(url) {
  const response = await fetch(url, {credentials: "same-origin"});
  const doc = await response.json();
  if (!response.ok) throw new Error(doc.error || response.statusText);
  return doc;
}

function chartOptions() {
  return {log: document.getElementById("log").checked, smooth: +document.getElementById("smooth").value,
          mode: document.getElementById("higher").checked ? "max" : "min",
          keys: Array.from(document.querySelectorAll("#keys input:checked")).map(i => i.value)};
}

function fillKeyBoxes(available, checked, onChange) {
  const box = document.getElementById("keys");
  if (box.dataset.filled === available.join("\n")) return;
  box.dataset.filled = available.join("\n");
  box.textContent = box.dataset.label + ": ";
  for (const key of available) {
    const label = el("label", null, {class: "key"});
    const input = el("input", null, {type: "checkbox", value: key});
    input.checked = checked.includes(key);
    input.addEventListener("change", onChange);
    label.appendChild(input);
    label.appendChild(document.createTextNode(key));
    box.appendChild(label);
  }
}

function onChartControls(redraw) {
  for (const id of ["log", "higher"]) document.getElementById(id).addEventListener("change", redraw);
  const slider = document.getElementById("smooth");
  slider.addEventListener("input", () => {
    document.getElementById("smooth-value").textContent = slider.value;
    redraw();
  });
}
