// The runs page: filter by name, sort by any column (numbers as numbers).
"use strict";
const runsTable = document.getElementById("runs");
const filter = document.getElementById("filter");
filter.addEventListener("input", () => {
  const needle = filter.value.toLowerCase();
  for (const row of runsTable.tBodies[0].rows) row.hidden = !row.dataset.run.toLowerCase().includes(needle);
});
for (const th of runsTable.tHead.rows[0].cells) {
  th.addEventListener("click", () => {
    const col = +th.dataset.col, descending = th.dataset.dir === "asc";
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
      if (ka === null) return 1;
      if (kb === null) return -1;
      const c = typeof ka === "number" && typeof kb === "number" ? ka - kb : String(ka).localeCompare(String(kb));
      return descending ? -c : c;
    });
    for (const row of rows) runsTable.tBodies[0].appendChild(row);
  });
}
