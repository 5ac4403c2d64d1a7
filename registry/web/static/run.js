// The run page: curves with the checkpoints, @latest and @best, the checkpoint table, the events in words
// and the retention preview; while the run is training it polls for changes and redraws.
"use strict";
const runName = document.getElementById("run").dataset.run;
const base = "/api/runs/" + encodeURIComponent(runName);
const stepUrl = step => "/runs/" + encodeURIComponent(runName) + "/steps/" + step;
const params = new URLSearchParams(location.search);
const pollEvery = Math.max(1, +(params.get("refresh") || 5)) * 1000;
let metricKeys = [];

async function load() {
  document.body.dataset.ready = "";
  const opts = chartOptions();
  const chart = document.getElementById("chart");
  const points = Math.round(Math.max(480, chart.clientWidth || 900) * 1.5);
  const key = document.getElementById("key").value || params.get("key");
  const view = await getJSON(`${base}/view?points=${points}` + (key ? "&key=" + encodeURIComponent(key) : ""));
  const keys = view.key ? [view.key, ...opts.keys.filter(k => k !== view.key)] : [];
  const query = keys.map(k => "&key=" + encodeURIComponent(k)).join("");
  const [compared, events] = await Promise.all([
    keys.length ? getJSON(`/api/compare?run=${encodeURIComponent(runName)}${query}&mode=${opts.mode}&points=${points}`)
                : Promise.resolve({series: []}),
    getJSON(`${base}/timeline`)]);
  metricKeys = view.keys;
  document.getElementById("key").value = view.key || "";
  fillKeyBoxes(view.keys.filter(k => k !== view.key), opts.keys, load);
  const first = compared.series[0];
  const best = view.key ? `@best:${view.key}` + (opts.mode === "max" ? ":max" : "") : "@best";
  const spec = {
    series: compared.series.map((s, i) => ({label: s.key, points: s.points, colour: SERIES_COLOURS[i % 8]})),
    checkpoints: view.checkpoints.map(c => ({...c, href: stepUrl(c.step)})),
    refs: first ? [{ref: "latest", label: "@latest", colour: "#24292f", ...first.latest},
                   {ref: "best", label: best, colour: "#24292f", ...first.best}].filter(r => r.step !== undefined) : [],
    log: opts.log, smooth: opts.smooth, yLabel: keys.join(", ") || "no metric", title: `${keys.join(", ")} of ${runName}`};
  drawChart(chart, spec);
  drawLegend(document.getElementById("legend"), spec.series, view.checkpoints);
  document.getElementById("curve-note").textContent = !view.key ? "no metrics logged" : view.curve.downsampled
    ? `${view.curve.points.length} of ${view.curve.total_points} points (min and max per bucket, every checkpoint)`
    : `${view.curve.total_points} points`;
  const body = document.querySelector("#checkpoints tbody");
  body.textContent = "";
  for (const c of view.checkpoints.slice().reverse()) {
    const row = el("tr", null, {"data-step": c.step, "data-status": c.status});
    const cell = el("td"); cell.appendChild(el("a", c.step, {href: stepUrl(c.step)})); row.appendChild(cell);
    const status = el("td"); status.appendChild(el("span", c.status, {class: "badge s-" + c.status}));
    row.appendChild(status);
    row.appendChild(el("td", c.tags.join(", ")));
    row.appendChild(el("td", c.value === null ? "-" : fmt(c.value)));
    row.appendChild(el("td", bytes(c.total_bytes)));
    row.appendChild(el("td", c.created_at ? new Date(c.created_at).toISOString().replace("T", " ").replace(/\.\d+Z/, " UTC") : "-"));
    body.appendChild(row);
  }
  if (!view.checkpoints.length) body.appendChild(el("tr")).appendChild(el("td", "no checkpoints yet", {colspan: 6}));
  const list = document.getElementById("events");
  list.textContent = "";
  for (const e of events) {
    const item = el("li", null, {"data-kind": e.kind});
    item.appendChild(el("time", e.time));
    item.appendChild(document.createTextNode(" " + e.text));
    list.appendChild(item);
  }
  if (!events.length) list.appendChild(el("li", "no events yet"));
  document.body.dataset.ready = "1";
}

// The server says whether the run is training (a publish or metric within its window), idle or finished.
function showLiveState(stamp) {
  const age = stamp.last_updated ? Date.now() - new Date(stamp.last_updated).getTime() : Infinity;
  const ago = isFinite(age) ? `${fmtAge(age)} ago` : "never";
  const state = document.getElementById("live-state");
  state.textContent = `${stamp.state} · updated ${ago}`;
  state.dataset.state = stamp.state;
  return stamp.state === "training";
}

function fmtAge(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 120) return `${s}s`;
  if (s < 7200) return `${Math.round(s / 60)}m`;
  if (s < 172800) return `${Math.round(s / 3600)}h`;
  return `${Math.round(s / 86400)}d`;
}

let lastStamp = null;
async function poll() {
  try {
    const stamp = await getJSON(`${base}/stamp`);
    const text = JSON.stringify({...stamp, last_updated: null, state: null}) + stamp.last_updated;
    const training = showLiveState(stamp);
    const on = document.getElementById("refresh");
    if (lastStamp === null) on.checked = training;
    else if (text !== lastStamp && on.checked) await load();
    if (lastStamp === null || on.checked) lastStamp = text;  // switched off, changes wait for it to be back on
  } catch (err) {
    document.getElementById("live-state").textContent = "cannot refresh: " + err.message;
  }
  setTimeout(poll, pollEvery);
}

const POLICY_WORDS = ["keep-last", "keep-best", "keep-every", "max-bytes"];

// The word of `words` within two edits of `word` (a typo), or null.
function closest(word, words) {
  if (!word) return null;
  const edits = (a, b) => {
    let row = Array.from({length: b.length + 1}, (_, j) => j);
    for (let i = 1; i <= a.length; i++) {
      const next = [i];
      for (let j = 1; j <= b.length; j++)
        next[j] = Math.min(row[j] + 1, next[j - 1] + 1, row[j - 1] + (a[i - 1] === b[j - 1] ? 0 : 1));
      row = next;
    }
    return row[b.length];
  };
  const best = words.map(w => [edits(word, w), w]).sort((x, y) => x[0] - y[0])[0];
  return best && best[0] <= 2 && best[0] > 0 ? best[1] : null;
}

async function preview(policy) {
  const plan = document.getElementById("plan");
  plan.dataset.ready = "";
  plan.textContent = "";
  plan.appendChild(el("p", "planning…", {class: "loading"}));
  try {
    const doc = await getJSON(`${base}/gc?policy=` + encodeURIComponent(policy));
    plan.textContent = "";
    plan.appendChild(el("p", `${doc.policy}: would delete ${doc.delete.length} of ${doc.decisions.length} ` +
                              `checkpoints, ${bytes(doc.bytes_freed)}; keeping ${bytes(doc.bytes_kept)}`,
                        {class: "summary"}));
    const table = el("table", null, {id: "plan-table"});
    const head = el("tr");
    for (const h of ["step", "status", "action", "size", "reasons"]) head.appendChild(el("th", h));
    table.appendChild(head);
    for (const d of doc.decisions) {
      const row = el("tr", null, {"data-step": d.step, "data-action": d.action, class: "a-" + d.action});
      row.appendChild(el("td", d.step));
      row.appendChild(el("td", d.status));
      row.appendChild(el("td", d.action === "delete" ? "DELETE" : d.action));
      row.appendChild(el("td", bytes(d.total_bytes)));
      row.appendChild(el("td", d.reasons.join("; ")));
      table.appendChild(row);
    }
    plan.appendChild(table);
  } catch (err) {
    plan.textContent = "";
    plan.appendChild(el("p", err.message, {class: "error"}));
    const key = metricKeys[0] || "eval/loss";
    const guess = closest(policy.split(",").map(c => c.trim().split(/\s+/)[0]).find(w => !POLICY_WORDS.includes(w)),
                          POLICY_WORDS.concat(metricKeys));
    if (guess) plan.appendChild(el("p", `Did you mean ${guess}?`, {class: "hint did-you-mean"}));
    plan.appendChild(el("p", `Type in this field one or more clauses separated by commas, for example: ` +
                             `keep-last 3, keep-best ${key} 2, keep-every 1000, max-bytes 10G` +
                             (metricKeys.length ? ` (this run's metrics: ${metricKeys.join(", ")}; add :max ` +
                                                  `after one where higher is better)` : ""), {class: "hint"}));
  }
  plan.dataset.ready = "1";
}

document.getElementById("key").addEventListener("change", load);
onChartControls(load);
document.getElementById("retention").addEventListener("submit", e => {
  e.preventDefault();
  preview(document.getElementById("policy").value);
});
if (params.get("key")) document.getElementById("key").value = params.get("key");
poll().then(load).catch(err => {
  const chart = document.getElementById("chart");
  chart.textContent = "";
  chart.appendChild(el("p", err.message, {class: "error"}));
  document.body.dataset.ready = "error";
});
