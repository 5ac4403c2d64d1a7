// The run page: the curve with its checkpoints, the checkpoint table, events and the retention preview.
"use strict";
const runName = document.getElementById("run").dataset.run;
const base = "/api/runs/" + encodeURIComponent(runName);
const stepUrl = step => "/runs/" + encodeURIComponent(runName) + "/steps/" + step;

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

async function load(key) {
  document.body.dataset.ready = "";
  const chart = document.getElementById("chart");
  const wanted = Math.round(Math.max(480, chart.clientWidth || 900) * 1.5);
  const data = await getJSON(`${base}/view?points=${wanted}` + (key ? "&key=" + encodeURIComponent(key) : ""));
  document.getElementById("key").value = data.key || "";
  drawChart(chart, data, stepUrl);
  drawLegend(document.getElementById("legend"), data.checkpoints);
  document.getElementById("curve-note").textContent = data.curve.downsampled
    ? `${data.curve.points.length} of ${data.curve.total_points} points (min and max per bucket, every checkpoint)`
    : `${data.curve.total_points} points`;
  const body = document.querySelector("#checkpoints tbody");
  body.textContent = "";
  for (const c of data.checkpoints.slice().reverse()) {
    const row = el("tr", null, {"data-step": c.step, "data-status": c.status});
    const cell = el("td"); cell.appendChild(el("a", c.step, {href: stepUrl(c.step)})); row.appendChild(cell);
    const status = el("td"); status.appendChild(el("span", c.status, {class: "badge s-" + c.status}));
    row.appendChild(status);
    row.appendChild(el("td", c.tags.join(", ")));
    row.appendChild(el("td", c.value === null ? "-" : fmt(c.value)));
    row.appendChild(el("td", bytes(c.total_bytes)));
    row.appendChild(el("td", c.created_at ? c.created_at.replace("T", " ").replace(/\.\d+/, "") : "-"));
    body.appendChild(row);
  }
  const events = document.getElementById("events");
  events.textContent = "";
  for (const e of data.events.slice().reverse()) {
    const item = el("li", null, {"data-kind": e.kind});
    item.appendChild(el("time", (e.created_at || "").replace("T", " ").replace(/\.\d+/, "")));
    item.appendChild(document.createTextNode(" "));
    item.appendChild(el("b", e.kind));
    item.appendChild(document.createTextNode(e.step === null ? " " : ` @${e.step} `));
    item.appendChild(el("code", JSON.stringify(e.detail)));
    events.appendChild(item);
  }
  document.body.dataset.ready = "1";
}

async function preview(policy) {
  const plan = document.getElementById("plan");
  plan.dataset.ready = "";
  plan.textContent = "";
  try {
    const doc = await getJSON(`${base}/gc?policy=` + encodeURIComponent(policy));
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
    plan.appendChild(el("p", err.message, {class: "error"}));
  }
  plan.dataset.ready = "1";
}

document.getElementById("key").addEventListener("change", e => load(e.target.value));
document.getElementById("retention").addEventListener("submit", e => {
  e.preventDefault();
  preview(document.getElementById("policy").value);
});
const initialKey = new URLSearchParams(location.search).get("key");
load(initialKey).catch(err => {
  document.getElementById("chart").appendChild(el("p", err.message, {class: "error"}));
  document.body.dataset.ready = "error";
});
