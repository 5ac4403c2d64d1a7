// A small self-contained SVG line chart: one metric curve, every checkpoint marked on the step axis.
// No dependencies; shipped in the wheel (registry/web/static). Colours match registry/terminal.py.
"use strict";
const STATUS_COLOURS = {verified: "#2ea043", published: "#1f6feb", corrupt: "#cf222e",
                        deleted: "#8c8c8c", failed: "#bf8700", staging: "#8250df"};
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

// data: {curve: {points: [[step, value], ...]}, checkpoints: [{step, status, tags, value}], key, run}
// onStep(step) gives the link of a checkpoint's step page.
function drawChart(container, data, onStep) {
  container.textContent = "";
  const width = Math.max(480, container.clientWidth || 900), height = 340;
  const m = {left: 64, right: 16, top: 28, bottom: 56};
  const pts = data.curve.points.filter(p => p[1] !== null);
  const steps = pts.map(p => p[0]).concat(data.checkpoints.map(c => c.step));
  const values = pts.map(p => p[1]);
  let x0 = Math.min(...steps), x1 = Math.max(...steps);
  if (!isFinite(x0)) { x0 = 0; x1 = 1; }
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  let y0 = values.length ? Math.min(...values) : 0, y1 = values.length ? Math.max(...values) : 1;
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad;
  const X = s => m.left + (s - x0) / (x1 - x0) * (width - m.left - m.right);
  const Y = v => m.top + (1 - (v - y0) / (y1 - y0)) * (height - m.top - m.bottom);
  const root = svg("svg", {width, height, viewBox: `0 0 ${width} ${height}`, class: "chart-svg",
                           role: "img", "aria-label": `${data.key || "no metric"} of ${data.run}`}, container);
  const axisY = height - m.bottom;
  for (const t of niceTicks(y0, y1, 5)) {
    svg("line", {x1: m.left, x2: width - m.right, y1: Y(t), y2: Y(t), class: "grid"}, root);
    svg("text", {x: m.left - 6, y: Y(t) + 4, "text-anchor": "end", class: "tick"}, root).textContent = fmt(t);
  }
  for (const t of niceTicks(x0, x1, 8)) {
    svg("text", {x: X(t), y: axisY + 34, "text-anchor": "middle", class: "tick"}, root).textContent = fmt(t);
  }
  svg("line", {x1: m.left, x2: width - m.right, y1: axisY, y2: axisY, class: "axis"}, root);
  svg("text", {x: width - m.right, y: height - 4, "text-anchor": "end", class: "label"}, root).textContent = "step";
  if (pts.length) {
    svg("polyline", {points: pts.map(p => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" "),
                     class: "curve", fill: "none"}, root);
  }
  const markers = svg("g", {class: "markers"}, root);
  for (const c of data.checkpoints) {
    const colour = STATUS_COLOURS[c.status] || "#333";
    const link = svg("a", {href: onStep(c.step)}, markers);
    svg("title", {}, link).textContent =
      `step ${c.step}: ${c.status}` + (c.tags.length ? ` [${c.tags.join(", ")}]` : "") +
      (c.value === null ? "" : ` ${data.key}=${fmt(c.value)}`);
    if (c.value !== null) {
      svg("line", {x1: X(c.step), x2: X(c.step), y1: Y(c.value), y2: axisY, stroke: colour, class: "guide"}, link);
      svg("circle", {cx: X(c.step), cy: Y(c.value), r: 3.5, fill: colour, class: "on-curve"}, link);
    }
    svg("path", {d: `M${X(c.step)},${axisY + 2} l-5,9 l10,0 z`, fill: colour, class: "ckpt-marker",
                 "data-step": c.step, "data-status": c.status}, link);
    c.tags.forEach((tag, i) => {
      svg("text", {x: X(c.step), y: (c.value === null ? axisY - 6 : Y(c.value) - 8) - 12 * i, class: "tag-label",
                   "text-anchor": "middle", "data-step": c.step}, link).textContent = tag;
    });
  }
  return root;
}

function drawLegend(container, checkpoints) {
  const counts = {};
  for (const c of checkpoints) counts[c.status] = (counts[c.status] || 0) + 1;
  container.textContent = "";
  for (const [status, n] of Object.entries(counts)) {
    const item = document.createElement("span");
    item.className = "legend-item";
    item.innerHTML = `<i style="background:${STATUS_COLOURS[status] || "#333"}"></i>`;
    item.appendChild(document.createTextNode(`${status} ${n}`));
    container.appendChild(item);
  }
}
