// The runs page: filter by name, sort by any column (numbers as numbers; a best-value column best first on
// the first click, and kept in the URL's ?sort= so the order can be shared), add a metric column.
"use strict";
const runsTable = document.getElementById("runs");
const filter = document.getElementById("filter");
filter.addEventListener("input", () => {
  const needle = filter.value.toLowerCase();
  for (const row of runsTable.tBodies[0].rows) row.hidden = !row.dataset.run.toLowerCase().includes(needle);
});

function sortBy(th, descending) {
  const col = +th.dataset.col;
  for (const other of runsTable.tHead.rows[0].cells) delete other.dataset.dir;
  th.dataset.dir = descending ? "desc" : "asc";
  const key = row => {
    const cell = row.cells[col], raw = cell.dataset.sort !== undefined ? cell.dataset.sort : cell.textContent;
    const n = parseFloat(raw);
    return raw === "" || raw === "None" ? null : (isNaN(n) || /[a-z]/i.test(raw) && !/^[-\d.e+]+$/i.test(raw) ? raw : n);
  };
  const rows = Array.from(runsTable.tBodies[0].rows);
  rows.sort((a, b) => {
    const ka = key(a), kb = key(b);
    if (ka === null) return kb === null ? 0 : 1;
    if (kb === null) return -1;
    const c = typeof ka === "number" && typeof kb === "number" ? ka - kb : String(ka).localeCompare(String(kb));
    return descending ? -c : c;
  });
  for (const row of rows) runsTable.tBodies[0].appendChild(row);
  // a metric or parameter column is a sort the server can repeat: say it in the URL and the form
  const url = new URL(location.href);
  if (th.dataset.spec) {
    const bestFirst = descending === (th.dataset.best === "max");
    url.searchParams.set("sort", (bestFirst ? "" : "-") + th.dataset.spec);
  } else url.searchParams.delete("sort");
  document.getElementById("sort").value = url.searchParams.get("sort") || "";
  history.replaceState(null, "", url);
}

for (const th of runsTable.tHead.rows[0].cells) {
  const activate = () => {
    // first click: best first on a best-value column (highest for :max), lowest first elsewhere
    const first = th.dataset.best === "max";
    sortBy(th, th.dataset.dir ? th.dataset.dir === "asc" : first);
  };
  th.addEventListener("click", activate);
  th.addEventListener("keydown", e => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); activate(); } });
}

const addColumn = document.getElementById("add-column");
addColumn.addEventListener("change", () => {
  if (!addColumn.value) return;
  const columns = document.getElementById("columns");
  const have = columns.value.split(",").map(c => c.trim()).filter(c => c);
  if (!have.includes(addColumn.value)) have.push(addColumn.value);
  columns.value = have.join(", ");
  document.getElementById("table-form").submit();
});
