// The comparison page: several runs' curves on one chart (a colour per run, a dash per metric), each run's
// @latest and @best marked, and a table of their newest, latest verified, best and last values.
"use strict";
const query = JSON.parse(document.getElementById("compare-page").dataset.query);
const runUrl = run => "/runs/" + encodeURIComponent(run);

async function load() {
  document.body.dataset.ready = "";
  const opts = chartOptions();
  const chart = document.getElementById("chart");
  const keys = opts.keys.length ? opts.keys : query.keys;
  const url = "/api/compare?" + query.runs.map(r => "run=" + encodeURIComponent(r)).join("&") +
    keys.map(k => "&key=" + encodeURIComponent(k)).join("") + `&mode=${opts.mode}` +
    `&points=${Math.round(Math.max(480, chart.clientWidth || 900) * 1.5)}`;
  const doc = await getJSON(url);
  fillKeyBoxes(doc.available_keys, doc.keys, load);
  const colour = run => SERIES_COLOURS[doc.runs.indexOf(run) % SERIES_COLOURS.length];
  const dash = key => DASHES[doc.keys.indexOf(key) % DASHES.length];
  const label = s => doc.keys.length > 1 ? `${s.run} ${s.key}` : s.run;
  const best = doc.mode === "max" ? ":max" : "";
  const primary = doc.series.filter(s => s.key === doc.keys[0]);
  const spec = {
    series: doc.series.map(s => ({label: label(s), points: s.points, colour: colour(s.run), dash: dash(s.key)})),
    refs: primary.flatMap(s => [{ref: "latest", label: `${s.run}@latest`, colour: colour(s.run), ...s.latest},
                                {ref: "best", label: `${s.run}@best:${s.key}${best}`, colour: colour(s.run), ...s.best}])
      .filter(r => r.step !== undefined),
    log: opts.log, smooth: opts.smooth, yLabel: doc.keys.join(", ") || "no metric",
    title: `${doc.keys.join(", ")} of ${doc.runs.join(", ")}`};
  drawChart(chart, spec);
  drawLegend(document.getElementById("legend"), spec.series, []);
  document.getElementById("curve-note").textContent = `${doc.runs.length} runs`;
  const table = document.getElementById("compare-table");
  const head = el("tr");
  for (const h of ["run", "last step", "latest verified"]) head.appendChild(el("th", h));
  for (const k of doc.keys) {
    head.appendChild(el("th", `best ${k}${best}`));
    head.appendChild(el("th", `last ${k}`));
  }
  table.tHead.textContent = "";
  table.tHead.appendChild(head);
  const body = table.tBodies[0];
  body.textContent = "";
  const value = (v, step) => v === null || v === undefined ? "-" : `${fmt(v)} @${step}`;
  for (const row of doc.table) {
    const tr = el("tr", null, {"data-run": row.run});
    const name = el("td");
    const swatch = el("i", null, {class: "swatch"});
    swatch.style.background = colour(row.run);
    name.appendChild(swatch);
    name.appendChild(el("a", row.run, {href: runUrl(row.run)}));
    tr.appendChild(name);
    tr.appendChild(el("td", row.latest_step === null ? "-" : row.latest_step));
    tr.appendChild(el("td", row.latest_verified_step === null ? "-" : row.latest_verified_step));
    for (const k of doc.keys) {
      const m = row.metrics[k];
      tr.appendChild(el("td", value(m.best, m.best_step), {"data-key": k, class: "best"}));
      tr.appendChild(el("td", value(m.last, m.last_step), {"data-key": k, class: "last"}));
    }
    body.appendChild(tr);
  }
  document.body.dataset.ready = "1";
}

onChartControls(load);
load().catch(err => {
  const chart = document.getElementById("chart");
  chart.textContent = "";
  chart.appendChild(el("p", err.message, {class: "error"}));
  document.body.dataset.ready = "error";
});
